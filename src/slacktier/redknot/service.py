"""Build artifacts offline and serve prefills that reuse them, reading artifact pages like any other table.

`RedKnotService` ties the runner (model), an ArtifactStore (files + certificates)
and a placement (`slacktier.redknot.placement`: a control file with one table
per reusable layer, naming the tier and options that serve that layer's pages):
- `build(doc_id, tokens, context=())`: prefill the document alone at position 0
  (or after `context`), capture every reusable layer's Local z, publish per rank;
- `prefill(docs, query, protection)`: validate every certificate first; on any
  problem log it, count it in `counters`, and run full recompute (no artifact
  page is read, no Local row reused); otherwise submit every artifact page read
  at once through the engine's per-layer reads (`engine.reads.LayerReads`: one
  batch per document and layer, in the placement's deadline order) and run
  reuse, each layer waiting only for its own pages;
- `apply(placement)`: move layers between tiers between prefills.

Sources: one per (document build, tier and options), kept open across
prefills (a DRAM source keeps the document's pages resident, a disk source its
file and workers). A rebuild, a new placement or a failed read reopens it.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from slacktier.config import ControlFile, Options
from slacktier.engine.reads import LayerReads
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.redknot.artifacts import (
    ArtifactStore,
    Certificate,
    Expectation,
    FallbackReason,
    RowFormat,
    TPGeometry,
    tokens_digest,
    validate,
)
from slacktier.redknot.model import model_digest
from slacktier.redknot.placement import artifact_placement, check_placement
from slacktier.redknot.protect import ProtectionPolicy
from slacktier.redknot.runner import Layout, RedKnotRunner, RunResult, Segment
from slacktier.store.base import PageBufferPool, PageReads, PageSource
from slacktier.store.registry import open_source
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.regions import Region

log = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16",
                torch.float16: "float16"}

#: (tier name, its options): the layers placed on the same pair share one source per document
TierKey = tuple[str, Options]


@dataclass
class ReadCounters:
    """Artifact I/O of one prefill."""

    pages: int = 0
    bytes: int = 0
    tickets: int = 0          # read batches: one per document and layer
    wait_s: float = 0.0
    failed_layers: int = 0
    # per layer, ms from the first read's submission (prefill start): when the runner asked for the layer (its
    # window), when its pages had landed (its last ticket's submission + the slowest ticket's read time), and how
    # long the runner blocked on them
    need_ms: dict[int, float] = field(default_factory=dict)
    ready_ms: dict[int, float] = field(default_factory=dict)
    layer_wait_ms: dict[int, float] = field(default_factory=dict)

    def late_layers(self) -> list[int]:
        """Layers whose pages landed after the runner needed them."""
        return sorted(l for l, need in self.need_ms.items() if self.ready_ms.get(l, 0.0) > need)


@dataclass(frozen=True)
class _Slot:
    """Where one (document, rank, layer) artifact region lands: its pool buffers -> rows x the rank's columns.

    Worked example: TP2, o_lora_rank 16, rank 1 of a document at request rows
    [40, 85) -> rows 40..84, columns [16, 32) of the layer's z_off [S, 32].
    """

    row_start: int
    row_end: int
    col_start: int
    col_end: int
    fmt: RowFormat
    buffers: np.ndarray   # [pages] int32, in the prefill's pool


class StoredLocal:
    """LocalSource over artifact pages already submitted to a `LayerReads` (at prefill start).

    `layer(l)` waits for layer l's reads only (the sources check each page's
    CRC32C against the certificate) and assembles z_off [S, G*R] from the
    ranks' column slices. A failed read makes that layer unusable: it is
    logged, counted, and the runner recomputes its Local heads for every row.
    `close()` waits out the layers never asked for, so no read outlives the prefill.
    """

    def __init__(self, layout: Layout, width: int, dtype: torch.dtype, reads: LayerReads, pool: PageBufferPool,
                 slots: dict[int, list[_Slot]], has_artifact: torch.Tensor, counters: ReadCounters,
                 submitted_at: float = 0.0, submit_ms: dict[int, float] | None = None) -> None:
        self.layout = layout
        self.width = width
        self.dtype = dtype
        self.reads = reads
        self.pool = pool
        self.slots = slots
        self.has_artifact = has_artifact   # [S] bool
        self.counters = counters
        self.submitted_at = submitted_at          # perf_counter() when the first read was submitted
        self.submit_ms = dict(submit_ms or {})    # layer -> ms after that when its last ticket was submitted
        self.failed_layers: set[int] = set()

    def layer(self, layer: int) -> torch.Tensor | None:
        """z_off [S, G*R] of `layer` (rows without an artifact are zero), or None if a read failed."""
        if layer in self.failed_layers:
            return None
        t0 = time.perf_counter()
        self.counters.need_ms[layer] = (t0 - self.submitted_at) * 1e3
        try:
            waited = self.reads.wait(layer)
        except SlackTierError as exc:
            log.warning("layer %d: artifact pages unusable, its Local heads are recomputed: %s", layer, exc)
            self.failed_layers.add(layer)
            self.counters.failed_layers += 1
            return None
        finally:
            self.counters.wait_s += time.perf_counter() - t0
            self.counters.layer_wait_ms[layer] = (time.perf_counter() - t0) * 1e3
        self.counters.ready_ms[layer] = self.submit_ms.get(layer, 0.0) + waited.read_us / 1e3
        self.counters.pages += waited.pages
        self.counters.bytes += waited.pages * PAGE_BYTES
        z = torch.zeros(self.layout.rows, self.width, dtype=self.dtype)
        for s in self.slots.get(layer, ()):
            rows = s.fmt.unpack(self.pool.pages[s.buffers], s.row_end - s.row_start)
            z[s.row_start:s.row_end, s.col_start:s.col_end] = rows.to(self.dtype)
        return z

    def close(self) -> set[int]:
        """Wait out every layer not yet waited for; the layers whose reads failed (logged), asked for or not."""
        for exc in self.reads.drain():
            log.warning("artifact pages of a layer the prefill did not need failed: %s", exc)
            if exc.layer is not None:
                self.failed_layers.add(exc.layer)
        return set(self.failed_layers)


@dataclass
class PrefillReport:
    """What a prefill did besides its outputs."""

    result: RunResult
    fallback_reason: FallbackReason | None = None
    reads: ReadCounters = field(default_factory=ReadCounters)
    new_documents: int = 0


class RedKnotService:
    """Offline builds and online prefills over one model, profile, policy, store, TP geometry and placement."""

    def __init__(self, runner: RedKnotRunner, store: ArtifactStore, *, tp_size: int = 1,
                 placement: ControlFile | None = None) -> None:
        """`placement` None: every reusable layer's artifacts in host memory (`artifact_placement(root, reusable)`)."""
        self.runner = runner
        self.store = store
        cfg = runner.config
        self.tp = TPGeometry(tp_size, cfg.o_groups)
        self.dtype = runner.model.model.embed_tokens.weight.dtype
        self.counters: collections.Counter[str] = collections.Counter()
        self._model_digest: str | None = None
        # open page sources: (doc_id, tier key) -> (the regions it was opened over, the source)
        self._sources: dict[tuple[str, TierKey], tuple[tuple[Region, ...], PageSource]] = {}
        if placement is None:
            placement = artifact_placement(store.root, runner.profile.reusable)
        self.placement = placement
        self._tables = check_placement(self.placement, store.root, runner.profile.reusable)

    def apply(self, placement: ControlFile) -> None:
        """Serve artifact pages from the tiers `placement` names from the next prefill on (between prefills)."""
        tables = check_placement(placement, self.store.root, self.runner.profile.reusable)
        self.placement, self._tables = placement, tables
        keep = {(t.source, t.options) for t in tables}
        for doc_id, key in [k for k in self._sources if k[1] not in keep]:
            self._drop(doc_id, key)

    def _source_for(self, doc_id: str, key: TierKey, regions: list[Region], sums: list[np.ndarray]) -> PageSource:
        """The open source of this exact build of the document on tier `key` (a new build reopens it)."""
        cached = self._sources.get((doc_id, key))
        if cached is not None and cached[0] == tuple(regions):
            return cached[1]
        if cached is not None:
            self._drop(doc_id, key)
        source = open_source(key[0], regions, key[1], page_crc32c=sums)
        self._sources[(doc_id, key)] = (tuple(regions), source)
        self.counters["sources_opened"] += 1
        return source

    def _drop(self, doc_id: str, key: TierKey) -> None:
        cached = self._sources.pop((doc_id, key), None)
        if cached is not None:
            cached[1].close()

    def drop_source(self, doc_id: str) -> None:
        """Close and forget a document's open sources (after a failed read, or when it is evicted)."""
        for d, key in [k for k in self._sources if k[0] == doc_id]:
            self._drop(d, key)

    def close(self) -> None:
        """Close every open page source."""
        for doc_id, key in list(self._sources):
            self._drop(doc_id, key)

    @property
    def model_digest(self) -> str:
        """Digest of the served weights (computed once)."""
        if self._model_digest is None:
            self._model_digest = model_digest(self.runner.model)
        return self._model_digest

    def expectation(self) -> Expectation:
        """What certificates must match for this service."""
        r = self.runner
        return Expectation(model_digest=self.model_digest, profile_name=r.profile.name,
                           profile_digest=r.profile.digest(), head_policy_digest=r.policy.digest(),
                           reusable_layers=r.profile.reusable, tp=self.tp, o_lora_rank=r.config.o_lora_rank,
                           dtype=_DTYPE_NAMES[self.dtype])

    # ---- offline ------------------------------------------------------------------
    def build(self, doc_id: str, tokens, *, context=(), layers: tuple[int, ...] | None = None,
              on_layer=None) -> list[Certificate]:
        """Prefill the document alone at position 0 (or after `context`) and publish one artifact per rank."""
        tokens = tuple(int(t) for t in tokens)
        context = tuple(int(t) for t in context)
        layers = tuple(self.runner.profile.reusable if layers is None else layers)
        bad = [l for l in layers if not self.runner.profile.is_reusable(l)]
        if bad:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"layers {bad} are fence layers",
                                 fix=f"cover only reusable layers {self.runner.profile.reusable}")
        segs = ([Segment("context", context)] if context else []) + [Segment(doc_id, tokens)]
        layout = Layout.of(segs)
        result = self.runner.full(layout, capture_layers=layers)
        doc_rows = slice(layout.starts[-1], layout.ends[-1])
        exp = self.expectation()
        generation = self.store.next_generation(doc_id)
        fields = dict(tp_size=self.tp.tp_size, o_groups=self.tp.o_groups, o_lora_rank=exp.o_lora_rank,
                      model_digest=exp.model_digest, tokens_digest=tokens_digest(tokens),
                      context_digest=tokens_digest(context), rows=len(tokens), profile_name=exp.profile_name,
                      profile_digest=exp.profile_digest, head_policy_digest=exp.head_policy_digest,
                      generation=generation, dtype=exp.dtype)
        R = exp.o_lora_rank
        certs = []
        for rank in range(self.tp.tp_size):
            lo, hi = self.tp.groups(rank)
            fmt = RowFormat((hi - lo) * R, exp.dtype)
            layer_pages = [(l, fmt.pack(result.captured[l][doc_rows, lo * R:hi * R])) for l in layers]
            certs.append(self.store.publish(doc_id=doc_id, rank=rank, layer_pages=layer_pages, fields=fields,
                                            on_layer=on_layer))
        self.counters["builds"] += 1
        return certs

    # ---- online -------------------------------------------------------------------
    def _start_reads(self, layout: Layout, doc_certs: dict[int, list[Certificate]]) -> StoredLocal:
        """Open (or reuse) every document's sources, then submit all artifact reads in deadline order.

        Opening comes first, so a certified file that is gone fails here before
        any read is issued (the caller then falls back to full recompute).
        """
        R = self.runner.config.o_lora_rank
        opened: dict[tuple[int, TierKey], tuple[PageSource, list[Region], dict[tuple[int, int], int]]] = {}
        has_artifact = torch.zeros(layout.rows, dtype=torch.bool)
        total_pages = 0
        for seg, certs in doc_certs.items():
            has_artifact[layout.starts[seg]:layout.ends[seg]] = True
            for key, layers in self._tier_layers().items():
                opened[(seg, key)] = self._open(certs, key, layers)
                total_pages += sum(r.pages for r in opened[(seg, key)][1])
        pool = PageBufferPool(max(total_pages, 1))
        reads = LayerReads(self.placement.engine.wait_timeout_ms / 1e3)
        counters = ReadCounters()
        slots: dict[int, list[_Slot]] = collections.defaultdict(list)
        next_buffer = 0
        submitted_at = time.perf_counter()
        submit_ms: dict[int, float] = {}
        try:
            for t in self._tables:  # (order, layer): the earliest deadline first
                for seg, certs in doc_certs.items():
                    source, regions, index = opened[(seg, (t.source, t.options))]
                    region_ids, pages, buffers = [], [], []
                    for cert in certs:
                        ri = index[(t.layer, cert.rank)]
                        n = regions[ri].pages
                        buf = np.arange(next_buffer, next_buffer + n, dtype=np.int32)
                        next_buffer += n
                        region_ids.append(np.full(n, ri, dtype=np.int32))
                        pages.append(np.arange(n, dtype=np.int64))
                        buffers.append(buf)
                        lo, hi = self.tp.groups(cert.rank)
                        slots[t.layer].append(_Slot(layout.starts[seg], layout.ends[seg], lo * R, hi * R,
                                                    cert.row_format, buf))
                    batch = PageReads(np.concatenate(region_ids), np.concatenate(pages), np.concatenate(buffers))
                    reads.submit(t.layer, source, batch, pool)
                    submit_ms[t.layer] = (time.perf_counter() - submitted_at) * 1e3
                    counters.tickets += 1
        except BaseException:
            reads.drain()  # nothing submitted may still be landing when the pool is dropped
            raise
        return StoredLocal(layout, self.tp.o_groups * R, self.dtype, reads, pool, dict(slots), has_artifact,
                           counters, submitted_at, submit_ms)

    def _tier_layers(self) -> dict[TierKey, list[int]]:
        """The placed layers of each (tier, options), in deadline order."""
        tier_layers: dict[TierKey, list[int]] = {}
        for t in self._tables:
            tier_layers.setdefault((t.source, t.options), []).append(t.layer)
        return tier_layers

    def _open(self, certs: list[Certificate], key: TierKey, layers: list[int]
              ) -> tuple[PageSource, list[Region], dict[tuple[int, int], int]]:
        """The source of one document's `layers` on tier `key`, its regions, and (layer, rank) -> region."""
        regions, sums, index = [], [], {}
        for layer in layers:
            for cert in certs:
                i = cert.covered_layers.index(layer)
                index[(layer, cert.rank)] = len(regions)
                regions.append(Region(layer=layer, rank=cert.rank, path=str(self.store.data_path(cert)),
                                      offset_bytes=cert.region_offsets_bytes[i], pages=cert.region_pages[i]))
                sums.append(np.asarray(cert.page_crc32c[i], dtype=np.uint32))
        return self._source_for(certs[0].doc_id, key, regions, sums), regions, index

    def warm(self, docs: list[tuple[str, tuple[int, ...]]]) -> int:
        """Open the sources of these documents' canonical artifacts on every placed tier now (a DRAM source
        loads its pages), so the next prefill does not pay it; the number of documents warmed.

        A document without a certificate valid for these tokens is skipped (its prefill validates again).
        """
        exp = self.expectation()
        warmed = 0
        for doc_id, toks in docs:
            certs = [self.store.certificate(doc_id, r) for r in range(self.tp.tp_size)]
            if any(c is None for c in certs) or validate(certs, exp, tuple(toks), (), self.store.floor(doc_id)):
                continue
            for key, layers in self._tier_layers().items():
                self._open(certs, key, layers)
            warmed += 1
        return warmed

    def _fallback(self, layout: Layout, reason: FallbackReason, new_docs: int) -> PrefillReport:
        self.counters[f"fallback.{reason.value}"] += 1
        result = self.runner.full(layout)
        result.stats.mode = "fallback"
        result.stats.fallback_reason = reason.value
        return PrefillReport(result, reason, ReadCounters(), new_docs)

    def prefill(self, docs: list[tuple[str, tuple[int, ...]]], query: tuple[int, ...],
                protection: ProtectionPolicy, *, dirty: torch.Tensor | None = None) -> PrefillReport:
        """Prefill documents + query, reusing valid artifacts; full recompute on any certificate problem."""
        segs = [Segment(doc_id, tuple(toks)) for doc_id, toks in docs] + [Segment("query", tuple(query), "query")]
        layout = Layout.of(segs)
        exp = self.expectation()
        doc_certs: dict[int, list[Certificate]] = {}
        reason: FallbackReason | None = None
        new_docs = 0
        preceding: list[int] = []
        for i, (doc_id, toks) in enumerate(docs):
            certs = [self.store.certificate(doc_id, r) for r in range(self.tp.tp_size)]
            reason = validate(certs, exp, toks, preceding, self.store.floor(doc_id))
            if reason is not None:
                log.warning("RedKnot fallback to full recompute: document %s: %s", doc_id, reason.value)
                break
            if all(c is None for c in certs):
                new_docs += 1
            else:
                doc_certs[i] = certs
            preceding += list(toks)
        if reason is None and not doc_certs:
            reason = FallbackReason.NO_ARTIFACT
            log.info("RedKnot: no document of the request has an artifact; full recompute")
        if reason is not None:
            return self._fallback(layout, reason, new_docs)
        try:
            local = self._start_reads(layout, doc_certs)
        except SlackTierError as exc:  # a certified file that is gone or unreadable: still before reuse work
            log.warning("RedKnot fallback to full recompute: artifact data unreadable: %s", exc)
            return self._fallback(layout, FallbackReason.UNREADABLE, new_docs)
        try:
            result = self.runner.reuse(layout, local, protection, dirty)
        finally:
            failed = local.close()
            # a bad page may sit in a resident copy: reopen the sources that served a failed layer next time
            bad_keys = {(t.source, t.options) for t in self._tables if t.layer in failed}
            for certs in doc_certs.values():
                for key in bad_keys:
                    self._drop(certs[0].doc_id, key)
        self.counters["reuse"] += 1
        self.counters["new_documents"] += new_docs
        self.counters["artifact_layers_failed"] += local.counters.failed_layers
        return PrefillReport(result, None, local.counters, new_docs)
