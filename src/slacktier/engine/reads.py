"""One step's page reads, per layer: submitted in deadline order, waited per layer, forgotten on failure.

Both users of the tier issue their reads this way: the step engine (each
table layer's missed pages, submitted before the next layer is resolved) and
RedKnot (each document's artifact pages, by layer). A layer may hold several
tickets (one per source it reads from); `wait(layer)` waits for all of them and
only them.

Failure: `wait(layer)` first waits out every ticket of the layer, so none of
its reads is still landing when the error reaches the caller, then raises the
first error (naming layer, rank and page) and marks the layer failed. A read
that does not finish within the timeout cannot be waited out: its buffers may
still be written later, so the reads object records that the pool is
`tainted` and the owner must not hand those buffers out again (the engine
retires the whole pool and allocates a fresh one).

Worked example: layer 1 submitted (ticket 7), layer 14 submitted (ticket 8);
`wait(1)` returns once ticket 7 is done, while layer 14's reads still run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store.base import PageBufferPool, PageReads, PageSource


@dataclass
class LayerWait:
    """What waiting for one layer's reads cost."""

    pages: int = 0
    read_us: float = 0.0   # the slowest ticket's submit -> completion
    wait_us: float = 0.0   # how long `wait` blocked


@dataclass
class _Layer:
    tickets: list[tuple[PageSource, int, int]] = field(default_factory=list)   # (source, ticket, pages)
    waited: bool = False
    error: SlackTierError | None = None


class LayerReads:
    """The reads of one step (or one prefill), keyed by layer."""

    def __init__(self, timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self._layers: dict[int, _Layer] = {}
        self.tainted = False   # a read timed out: its buffers may still be written

    def submit(self, layer: int, source: PageSource, reads: PageReads, pool: PageBufferPool) -> None:
        """Hand `reads` of `layer` to `source` now; an error names the layer."""
        entry = self._layers.setdefault(layer, _Layer())
        if entry.waited:
            raise SlackTierError(ErrorKind.BAD_INPUT, "reads submitted after the layer was waited for",
                                 layer=layer, fix="submit every read of a layer before waiting for it")
        if len(reads) == 0:
            return
        ticket = _named(layer, lambda: source.submit(reads, pool))
        entry.tickets.append((source, ticket, len(reads)))

    def track(self, layer: int, source: PageSource, ticket: int, pages: int) -> None:
        """Wait for a ticket of `layer` that `source` gave elsewhere (a lane's book, after the compiled pass)."""
        entry = self._layers.get(layer)
        if entry is None:   # once per layer and step: no throwaway _Layer per call, as setdefault would make
            entry = self._layers[layer] = _Layer()
        if entry.waited:
            raise SlackTierError(ErrorKind.BAD_INPUT, "reads submitted after the layer was waited for",
                                 layer=layer, fix="submit every read of a layer before waiting for it")
        entry.tickets.append((source, ticket, pages))

    def wait(self, layer: int) -> LayerWait:
        """Block until every read of `layer` is done; raise the first error (the layer is then failed)."""
        entry = self._layers.get(layer)
        if entry is None:
            entry = self._layers[layer] = _Layer()
        if entry.error is not None:
            raise SlackTierError(ErrorKind.IO, f"this layer's reads failed earlier: {entry.error.message}",
                                 layer=layer, fix="end the step and retry it")
        out = LayerWait()
        if entry.waited:
            return out
        entry.waited = True
        t0 = time.perf_counter_ns()
        for source, ticket, pages in entry.tickets:
            try:
                stats = _named(layer, lambda: source.wait(ticket, self.timeout_s))
            except SlackTierError as exc:
                if exc.kind is ErrorKind.TIMEOUT:
                    self.tainted = True
                entry.error = entry.error or exc
                continue
            out.pages += pages
            out.read_us = max(out.read_us, stats.read_us)
        entry.tickets.clear()
        out.wait_us = (time.perf_counter_ns() - t0) / 1e3
        if entry.error is not None:
            raise entry.error
        return out

    def failed(self, layer: int) -> bool:
        """True once a read of `layer` failed."""
        entry = self._layers.get(layer)
        return entry is not None and entry.error is not None

    def drain(self) -> list[SlackTierError]:
        """Wait out every layer not yet waited for (ending or abandoning a step); the errors, in layer order."""
        errors = []
        for layer in list(self._layers):
            if self._layers[layer].waited:
                continue
            try:
                self.wait(layer)
            except SlackTierError as exc:
                errors.append(exc)
        return errors


def _named(layer: int, fn):
    """Run a source call; name the layer on any error it raises (rank and page where the source knows them)."""
    try:
        return fn()
    except SlackTierError as exc:
        if exc.layer is not None:
            raise
        raise SlackTierError(exc.kind, exc.message, fix=exc.fix, layer=layer, rank=exc.rank,
                             page=exc.page) from exc
    except OSError as exc:
        raise SlackTierError(ErrorKind.IO, f"page source failed: {exc}", layer=layer,
                             fix="check the table's device or server") from exc
