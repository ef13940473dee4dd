"""Where RedKnot's artifact pages are read from: one control-file table per reusable layer.

The artifacts of layer l are needed when the prefill reaches layer l, so they
are placed like any deadline-bound table (DESIGN.md section 9): a
`slacktier.config.ControlFile` whose `[[table]]` entries name, for each
reusable model layer, the tier and its typed options that serve that layer's
artifact pages, for every document. The planner writes it; the service reads
it (`RedKnotService(..., placement=...)` or `.apply(placement)`).

What the keys mean for an artifact table:

- `layer`: the model layer (a reusable one) whose artifact pages the table serves;
- `manifest`: the ArtifactStore's root directory, the index that certifies the
  pages (certificates are per document; the table names where they live);
- `source` and `[table.<tier>]`: the tier and its options for that layer;
- `order`: submission order; tables are read in (order, layer) order, the
  earliest deadline first.
- `[engine] wait_timeout_ms`: the longest a layer waits for its artifact pages.

Artifact pages are always read against their certificate's CRC32C, so the
`[engine]` section must say `verify_reads = true`; its other keys (device,
cache sizes, lossy, check, owned_only) are the step engine's and unused here.
A table's row-cache keys (`cache_share`, `seen`, `rank`, `targets`) do not
apply to artifacts and must keep their defaults. Artifacts are published to
files, so a tier that keeps pages elsewhere (Redis) is refused until
publication writes there too.

The planner for these tables, which places them by their layers' windows, is
`slacktier.plan.artifacts.plan_artifact_placement` (plan is a room of pure
functions; this module only builds and checks control files).

Worked example: a 6-layer model with fences 1-4-1 has reusable layers 1..4;
`artifact_placement(root, (1, 2, 3, 4), "dram", tiers={3: ("disk", None)})`
serves layers 1, 2 and 4 from host memory and layer 3 with O_DIRECT reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from slacktier.config import ControlFile, EngineConfig, Options, RedisOptions, TableConfig
from slacktier.errors import ErrorKind, SlackTierError


def artifact_placement(store_root: str | Path, layers: Iterable[int], source: str = "dram",
                       options: Options | None = None, *,
                       tiers: Mapping[int, tuple[str, Options | None]] | None = None,
                       wait_timeout_ms: float | None = None) -> ControlFile:
    """Every layer's artifacts on `source` (with `options`), except the layers `tiers` places elsewhere."""
    tiers = dict(tiers or {})
    layers = tuple(layers)
    stray = sorted(set(tiers) - set(layers))
    if stray:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"tiers given for layers {stray} outside {list(layers)}",
                             fix="place only the reusable layers")
    root = str(Path(store_root).resolve())
    tables = []
    for layer in layers:
        tier, opts = tiers.get(layer, (source, options))
        tables.append(TableConfig(layer=layer, manifest=root, source=tier, options=opts))
    engine = EngineConfig(verify_reads=True) if wait_timeout_ms is None else \
        EngineConfig(verify_reads=True, wait_timeout_ms=wait_timeout_ms)
    return ControlFile(engine=engine, tables=tuple(tables))


def check_placement(placement: ControlFile, store_root: str | Path,
                    reusable: Iterable[int]) -> tuple[TableConfig, ...]:
    """The placement's tables in deadline order, once they place exactly `reusable` over this store."""
    if not placement.engine.verify_reads:
        raise _bad("verify_reads = false, but artifact pages are always checked against their certificate",
                   "set verify_reads = true in [engine]")
    root = Path(store_root).resolve()
    for t in placement.tables:
        if Path(t.manifest).resolve() != root:
            raise _bad(f"layer {t.layer}: manifest {t.manifest} is not the artifact store {root}",
                       "point each artifact table's manifest at the ArtifactStore's root", layer=t.layer)
        if isinstance(t.options, RedisOptions):
            raise _bad(f"layer {t.layer}: artifacts are published to files, not to Redis",
                       "place artifact tables on a tier that reads files (dram, disk)", layer=t.layer)
        if t.rank != -1 or t.targets or t.cache_share or t.seen:
            raise _bad(f"layer {t.layer}: rank, targets, cache_share and seen do not apply to artifacts",
                       "leave them at their defaults", layer=t.layer)
    placed = {t.layer for t in placement.tables}
    want = set(reusable)
    if placed != want:
        raise _bad(f"tables for layers {sorted(placed)}, but the reusable layers are {sorted(want)}",
                   "give one table per reusable layer (artifact_placement builds them)")
    return placement.tables   # ControlFile keeps them sorted by (order, layer)


def _bad(message: str, fix: str, **where) -> SlackTierError:
    return SlackTierError(ErrorKind.BAD_INPUT, f"artifact placement: {message}", fix=fix, **where)

