"""The serving engines' tensor-parallel sharding of an Engram table, and which one a staged manifest fits.

Both engines shard a layer's table by hash column (one column per (n-gram
order, head), each a prime-sized run of rows; `bounds` are the column bounds,
bounds[c] = the sum of the first c primes), read from their installed code:

- SGLang 0.5.23, sglang/srt/layers/engram.py `shard_range` (what
  `EngramEmbedding.__init__` cuts and `_owned_rows` serves): with C columns and
  TP dividing C, rank k owns rows [bounds[k C/TP], bounds[(k+1) C/TP]);
  otherwise the equal-row split [rows k // TP, rows (k+1) // TP).
- vLLM 0.33.0, vllm/models/deepseek_v41/common/engram.py
  `ParallelEngramEmbedding.__init__` (one table replica per DP rank):
  part_n_hash_cols = ceil(C / TP), head_start = k * part_n_hash_cols,
  vocab_start_idx = sum(head_sizes[:head_start]) = bounds[head_start],
  vocab_end_idx = sum(head_sizes[:head_start + part]) = bounds[min(head_start + part, C)].

How they agree for V4.1 (C = 24 = 3 orders x 8 heads, head_sizes = the layer's
24 primes in (order, head) order, the same primes in both engines: SGLang's
`EngramLayout.column_bounds` is the prefix sum of the head_sizes vLLM passes):
at every TP dividing 24 (1, 2, 3, 4, 6, 8, 12, 24) ceil(24 / TP) = 24 / TP, so
both give rank k columns [k 24/TP, (k+1) 24/TP) and the same rows. They differ
only where TP does not divide 24 (TP 5: SGLang splits rows equally, off the
column bounds; vLLM gives 5, 5, 5, 5, 4 heads), a TP both plug-ins refuse.
tests/test_adapters_sglang.py and tests/test_adapters_vllm.py check these rules
against the installed engines' own functions.

`manifest_fits` says which engine's sharding at TP N a manifest's rank regions
are; `check_staged_for` and `check_rank_rows` are the plug-ins' start-up
refusals, each naming both sides and the staging command that fixes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import shard_bounds
from slacktier.tables.manifest import Manifest, check_tp_sharding
from slacktier.tables.partition import columns_text

SGLANG = "SGLang 0.5.23"
VLLM = "vLLM 0.33.0"
ENGINES = (SGLANG, VLLM)
#: how to give `slacktier stage` the model's hash layout, in fixes
LAYOUT_FLAGS = "--config MODEL/config.json (a checkpoint directory's own config.json is read without it) or --engram v41"


def sglang_rank_rows(bounds: Sequence[int], tp_size: int, tp_rank: int) -> tuple[int, int]:
    """SGLang's `shard_range`: 24 columns of 100 rows, TP 4, rank 1 -> (600, 1200)."""
    return shard_bounds(int(bounds[-1]), tuple(int(b) for b in bounds), tp_rank, tp_size)


def vllm_rank_rows(bounds: Sequence[int], tp_size: int, tp_rank: int) -> tuple[int, int] | None:
    """vLLM's head shard rows of rank `tp_rank`, or None where vLLM refuses the TP size (a rank without heads).

    24 columns of 100 rows, TP 5, rank 4 -> heads 20..23, (2000, 2400)."""
    cols = len(bounds) - 1
    heads = -(-cols // tp_size)
    if (tp_size - 1) * heads >= cols:
        return None
    start = tp_rank * heads
    return int(bounds[start]), int(bounds[min(start + heads, cols)])


def engine_rank_rows(engine: str, bounds: Sequence[int], tp_size: int, tp_rank: int) -> tuple[int, int] | None:
    """`engine`'s (SGLANG or VLLM) rows of rank `tp_rank` at `tp_size`."""
    if engine == SGLANG:
        return sglang_rank_rows(bounds, tp_size, tp_rank)
    return vllm_rank_rows(bounds, tp_size, tp_rank)


@dataclass(frozen=True)
class Fit:
    """Whether a manifest's rank regions are `engine`'s TP shards, and why (or why not)."""

    engine: str
    fits: bool
    why: str


def manifest_fits(m: Manifest, tp_size: int) -> list[Fit]:
    """For each engine: do the manifest's rank regions serve its TP `tp_size` ranks, one region per rank?"""
    out = []
    for engine in ENGINES:
        out.append(_fit(m, engine, tp_size))
    return out


def _fit(m: Manifest, engine: str, tp_size: int) -> Fit:
    if m.ranks != tp_size and tp_size > 1:
        return Fit(engine, False, f"staged for {m.ranks} ranks, not {tp_size}")
    if tp_size == 1:
        return Fit(engine, True, "TP 1 serves the whole table, every region")
    rule = m.sharding_rule
    if rule == "equal-rows":
        return Fit(engine, False, "staged without hash-column bounds: equal row splits, no engine's TP shards")
    if rule != "hash-columns":
        try:
            check_tp_sharding(m, tp_size)
        except SlackTierError as exc:
            return Fit(engine, False, exc.message)
        return Fit(engine, True, f"the {rule} partition: each rank serves its partition's heads through the "
                   "plug-in (not the engine's own shards)")
    for layer in m.layout.layer_ids:
        bounds = m.layout.column_bounds[layer]
        for rank, spans in enumerate(m.rank_rows(layer)):
            want = engine_rank_rows(engine, bounds, tp_size, rank)
            if want is None:
                return Fit(engine, False, f"{engine} refuses TP {tp_size} over {len(bounds) - 1} hash columns")
            if tuple(spans[0]) != want:
                return Fit(engine, False, f"layer {layer} rank {rank} holds rows {list(spans[0])}, {engine}'s "
                           f"rank owns {list(want)}")
    cols = len(m.layout.column_bounds[m.layout.layer_ids[0]]) - 1
    return Fit(engine, True, f"whole hash columns, {cols // tp_size} per rank")


def check_staged_for(m: Manifest, control: str, engine: str, tp_size: int, tp_rank: int, layer: int) -> None:
    """Refuse (BAD_INPUT), at start-up, a manifest whose rank regions cannot be rank `tp_rank`'s at TP `tp_size`:
    staged for another rank count, without hash-column bounds, or without this rank's region (--only-ranks)."""
    where = m.path or "the manifest"
    kind = m.partition_kind
    restage = f"slacktier stage ... --ranks {tp_size} --partition {kind}"
    if m.ranks != tp_size:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{control} serves layer {layer} from {where}, staged for "
                             f"{m.ranks} TP ranks; {engine} runs TP {tp_size}", layer=layer, rank=tp_rank,
                             fix=f"stage it again for this TP: `{restage}` (or run {engine} at TP {m.ranks})")
    if m.sharding_rule == "equal-rows":
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{where} was staged without the model's hash-column bounds (equal "
                             f"row splits); {engine} at TP {tp_size} shards layer {layer} by whole hash columns",
                             layer=layer, rank=tp_rank, fix=f"stage it again with the model's layout: `{restage}` "
                             f"with {LAYOUT_FLAGS}")
    if not any(r.layer == layer and r.rank == tp_rank for r in m.regions):
        staged = sorted({r.rank for r in m.regions if r.layer == layer})
        raise SlackTierError(ErrorKind.MISSING, f"{where} holds no region of TP rank {tp_rank} for layer {layer} "
                             f"(it holds ranks {staged}: staged with --only-ranks)", layer=layer, rank=tp_rank,
                             fix=f"stage this rank's region for this machine: `{restage} --only-ranks {tp_rank}`")


def check_rank_rows(m: Manifest, control: str, engine: str, tp_size: int, tp_rank: int, layer: int,
                    engine_rows: tuple[int, int], served: tuple[int, int]) -> None:
    """Refuse (BAD_INPUT) a region that is not the engine's own shard (`engine_rows`, from the engine's code) of
    rank `tp_rank`: `served` is what the step engine built from the control file and manifest."""
    if tuple(served) == tuple(engine_rows):
        return
    where = m.path or "the manifest"
    bounds = m.layout.column_bounds.get(layer)
    cols = ""
    if bounds is not None and engine_rows[0] in bounds and engine_rows[1] in bounds:
        cols = f" (hash columns {columns_text(range(bounds.index(engine_rows[0]), bounds.index(engine_rows[1])))})"
    raise SlackTierError(ErrorKind.BAD_INPUT, f"layer {layer}: {control} serves rows [{served[0]}, {served[1]}) of "
                         f"{where} ({m.sharding_rule} regions, {m.ranks} ranks); {engine}'s TP {tp_size} rank "
                         f"{tp_rank} owns rows [{engine_rows[0]}, {engine_rows[1]}){cols}", layer=layer, rank=tp_rank,
                         fix=f"stage it again for this TP: `slacktier stage ... --ranks {tp_size}` with {LAYOUT_FLAGS}, "
                         f"and set rank = {tp_rank} (TP 1: rank = -1) in this rank's control file")


__all__ = ["ENGINES", "LAYOUT_FLAGS", "SGLANG", "VLLM", "Fit", "check_rank_rows", "check_staged_for",
           "engine_rank_rows", "manifest_fits", "sglang_rank_rows", "vllm_rank_rows"]
