"""The replay's page count with a pack list equals the engine's: a small table staged with the list this side
writes (TP4 `columns`), served by one rank's engine (`owned_only`), and the same ids replayed through
`workloads.packing` (the served CLOCK of `cache.simulate`, the same cache rows, the same contexts packed):
pages read per step and layer, packed pages included, are equal step by step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from slacktier.config import from_dict, write_control
from slacktier.engine.step import StepEngine
from slacktier.tables.engram_hash import EngramLayout
from slacktier.tables.packing import PackRequest, read_pack_list
from slacktier.tables.stage import stage_synthetic
from slacktier.testing.store import supports_o_direct
from slacktier.workloads import packing as P
from slacktier.workloads.replay import LookupTrace

LAYOUT = EngramLayout.scaled(200)   # ~4,800 rows per layer, 24 columns of 3 orders x 8 heads
POOL = 150                          # contexts the synthetic traffic draws from
RANKS, RANK = 4, 3
CACHE_ROWS = 120                    # the engine's cache; half per layer
STEPS, TOKENS = 12, 24


def _pool() -> dict[int, np.ndarray]:
    rng = np.random.default_rng(5)
    out = {}
    for layer in LAYOUT.layer_ids:
        b = np.asarray(LAYOUT.layer_column_bounds(layer))
        out[layer] = b[:-1] + rng.integers(0, b[1:] - b[:-1], size=(POOL, 24))
    return out


def _steps(seed: int) -> list[np.ndarray]:
    """STEPS steps of [TOKENS, L, 24] ids, each token a pool context drawn Zipf-like."""
    rng, pool = np.random.default_rng(seed), _pool()
    out = []
    for _ in range(STEPS):
        pick = np.minimum(rng.zipf(1.2, size=TOKENS) - 1, POOL - 1)
        out.append(np.ascontiguousarray(np.stack([pool[layer][pick] for layer in LAYOUT.layer_ids], axis=1)))
    return out


def _trace(steps: list[np.ndarray]) -> LookupTrace:
    ids = np.concatenate(steps)                                       # [T, L, 24]
    n = ids.shape[0]
    layers = tuple(LAYOUT.layer_ids)
    return LookupTrace("synthetic", TOKENS, layers, tuple(LAYOUT.layer_rows(l) for l in layers), 24, 8, 2,
                       np.ascontiguousarray(ids.transpose(1, 0, 2).reshape(len(layers), -1)),
                       np.repeat(np.arange(len(steps), dtype=np.int32), TOKENS), np.ones(n, dtype=bool),
                       np.zeros(n, dtype=np.int32), tuple(tuple(LAYOUT.layer_column_bounds(l)) for l in layers))


def test_engine_pages_equal_the_replay_with_a_pack_list(tmp_path: Path) -> None:
    if not supports_o_direct(tmp_path):
        pytest.skip("tmp_path does not support O_DIRECT")
    layers = tuple(LAYOUT.layer_ids)
    rows = {l: CACHE_ROWS // 2 for l in layers}
    fit = _trace(_steps(seed=1))
    meta = P.pack_meta("synthetic", 1, TOKENS, CACHE_ROWS, RANKS, "columns", "deepseek")
    choice = P.choose_contexts(fit, layers, rows, RANKS, None, "columns", None, meta)
    assert all(choice.count(l) > 0 for l in layers)
    path = P.write_pack_list(tmp_path / "list.npz", choice)
    m = stage_synthetic([tmp_path / "table.bin"], LAYOUT, RANKS, 5, progress=False,
                        pack=PackRequest(read_pack_list(path), 1 << 30, 1 << 20))
    tables = [{"layer": layer, "manifest": str(m.path), "cache_share": 0.5, "order": i, "rank": RANK,
               "source": "dram"} for i, layer in enumerate(layers)]
    ctl = write_control(from_dict({"engine": {"cache_rows": CACHE_ROWS, "owned_only": True}, "table": tables}),
                        tmp_path / "ctl.toml")

    held = _steps(seed=2)
    engine_pages = {l: [] for l in layers}
    packed = {l: 0 for l in layers}
    with StepEngine.from_control(str(ctl)) as e:
        for ids in held:
            e.begin_step(ids)
            for layer in e.ids_layers:
                e.gather(layer)
            c = e.end_step()
            for l in layers:
                engine_pages[l].append(c.layers[l].pages_read)
                packed[l] += c.layers[l].packed_pages
    assert all(packed[l] > 0 for l in layers)   # the list was served, not ignored

    trace = _trace(held)
    for l in layers:
        lk = P.rank_lookups(trace, l, RANK, RANKS)
        hit = P.hit_mask(lk, rows[l])
        pack = P.lookup_contexts(choice.ids[l], P.token_contexts(trace, l))
        assert P.step_pages(lk, hit, pack).tolist() == engine_pages[l], l
        assert P.step_pages(lk, hit).sum() > sum(engine_pages[l])   # packing read fewer pages than without
