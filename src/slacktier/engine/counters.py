"""Per-step, per-layer counters the engine publishes at `end_step` (and running totals)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class LayerCounters:
    """What one layer's lookups did in one step (or summed over steps).

    lookups = hits + reused + rows_read + zero_rows. padded counts the lookups of
    the pad id (zero rows, nothing read; included in zero_rows), out_of_table those of
    ids outside the whole layer (zero rows as the serving engines' own lookups give them,
    nothing read; included in zero_rows). rows_read counts unique rows
    fetched from pages, pages_read unique pages (packed_pages of them context
    packing's packed pages, tables.packing), bypass the rows read but not
    cached (every slot of the layer pinned), reused the lookups served by a read
    already requested this step. read_us is the source's submit-to-completion
    time, wait_us how long `gather` blocked on the reads, resolve_us the
    directory pass, submit_us handing pages to the source, gather_us the fill and
    dequant pass. mismatches: rows the checker found different from the reference
    (checked_rows of them compared).
    """

    lookups: int = 0
    hits: int = 0
    reused: int = 0
    rows_read: int = 0
    pages_read: int = 0
    zero_rows: int = 0
    padded: int = 0
    out_of_table: int = 0
    bypass: int = 0
    packed_pages: int = 0
    evictions: int = 0
    read_us: float = 0.0
    wait_us: float = 0.0
    resolve_us: float = 0.0
    submit_us: float = 0.0
    gather_us: float = 0.0
    checked_rows: int = 0
    mismatches: int = 0

    def add(self, other: LayerCounters) -> None:
        """Accumulate `other` into this one (every step, per layer: the field names are looked up once)."""
        for name in _LAYER_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def hit_rate(self) -> float:
        """hits / lookups (0 when there were none)."""
        return self.hits / self.lookups if self.lookups else 0.0

    def as_dict(self) -> dict[str, float]:
        """Plain dict (for logs and JSON)."""
        return asdict(self)


_LAYER_FIELDS = tuple(f.name for f in fields(LayerCounters))

#: LayerCounters' fields a directory pass fills, each the sum of these fields of its cache.PassResult (the
#: pass's counts, cache.directory.Count). A pass field named nowhere here is the pass's own (bad_index, pending).
FROM_PASS: dict[str, tuple[str, ...]] = {
    "lookups": ("lookups",), "hits": ("hits",), "reused": ("reused",), "rows_read": ("misses",),
    "pages_read": ("pages",), "padded": ("padded",), "out_of_table": ("outside",),
    "zero_rows": ("zero", "foreign", "padded", "outside"),
    "bypass": ("bypass",), "evictions": ("evicted",), "packed_pages": ("packed",),
}


def fill_from_pass(c: LayerCounters, res: tuple) -> None:
    """Set `c`'s pass-filled fields (FROM_PASS) from a PassResult."""
    for name, parts in FROM_PASS.items():
        setattr(c, name, sum(getattr(res, p) for p in parts))


@dataclass
class StepCounters:
    """One step's counters by layer id."""

    step: int
    tokens: int
    layers: dict[int, LayerCounters] = field(default_factory=dict)
