"""The step engine under the balanced rank partition: exact rows, per-rank processes that sum to the table, refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from slacktier.config import from_dict, write_control
from slacktier.engine.step import StepEngine
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.testing.store import supports_o_direct
from slacktier.tables.codec import dequantize_bits
from slacktier.tables.engram_hash import EngramLayout
from slacktier.tables.manifest import Manifest
from slacktier.tables.stage import SyntheticSource, stage_synthetic

LAYOUT = EngramLayout.scaled(200)   # ~4,800 rows per layer, 24 columns of 3 orders x 8 heads
RANKS = 4


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> dict[str, Manifest]:
    tmp = tmp_path_factory.mktemp("partition")
    if not supports_o_direct(tmp):
        pytest.skip("tmp_path does not support O_DIRECT")
    return {kind: stage_synthetic([tmp / f"{kind}.bin"], LAYOUT, RANKS, 5, progress=False, partition=kind)
            for kind in ("columns", "balanced")}


def _control(tmp: Path, name: str, m: Manifest, *, rank: int = -1, partition: str | None = None,
             cache_rows: int = 600, **engine: object) -> str:
    tables = [{"layer": layer, "manifest": str(m.path), "cache_share": 0.5, "order": i, "rank": rank,
               "partition": partition or m.partition_kind} for i, layer in enumerate(LAYOUT.layer_ids)]
    doc = {"engine": {"cache_rows": cache_rows, "check": True, **engine}, "table": tables}
    return str(write_control(from_dict(doc), tmp / name))


def _ids(rng: np.random.Generator, tokens: int) -> np.ndarray:
    """[T, L, 24] hash-like ids: column c's id lies in column c's rows; a pad id (-1) here and there."""
    out = np.empty((tokens, len(LAYOUT.layer_ids), 24), dtype=np.int64)
    for j, layer in enumerate(LAYOUT.layer_ids):
        b = np.asarray(LAYOUT.layer_column_bounds(layer))
        out[:, j, :] = b[:-1] + rng.integers(0, b[1:] - b[:-1], size=(tokens, 24))
    out[0, 0, 5] = -1
    return out


def test_one_process_serves_a_balanced_table_bit_exact(staged, tmp_path: Path) -> None:
    m = staged["balanced"]
    truth = SyntheticSource(m.layout, 5)
    rng = np.random.default_rng(1)
    with StepEngine.from_control(_control(tmp_path, "all.toml", m)) as e:
        for _ in range(3):
            ids = _ids(rng, 32)
            e.begin_step(ids)
            for j, layer in enumerate(e.ids_layers):
                out = e.gather(layer).reshape(-1, 256).view(torch.int16).numpy()
                g = ids[:, j].reshape(-1)
                want = dequantize_bits(truth.rows(layer, np.where(g < 0, 0, g))).view(np.int16)
                want[g < 0] = 0   # the pad id: a +0.0 row
                assert np.array_equal(out, want)
            e.end_step()
        assert sum(c.mismatches for c in e.totals.values()) == 0 and sum(c.checked_rows for c in e.totals.values())


@pytest.mark.parametrize("kind", ["columns", "balanced"])
def test_per_rank_processes_sum_to_the_single_process_rows(staged, tmp_path: Path, kind: str) -> None:
    """Each rank serves its partition's columns (owned_only, -0.0 elsewhere); the sum over ranks is bit-exact."""
    m = staged[kind]
    ctl = [_control(tmp_path, f"r{k}.toml", m, rank=k, owned_only=True, cache_rows=200) for k in range(RANKS)]
    rng = np.random.default_rng(2)
    engines = [StepEngine.from_control(c) for c in ctl]
    try:
        with StepEngine.from_control(_control(tmp_path, "whole.toml", m)) as one:
            for _ in range(3):
                ids = _ids(rng, 16)
                for e in (one, *engines):
                    e.begin_step(ids)
                for layer in LAYOUT.layer_ids:
                    want = one.gather(layer)
                    parts = [e.gather(layer) for e in engines]
                    got = parts[0]
                    for p in parts[1:]:
                        got = got + p
                    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
                    # rank k's rows other than -0.0 (pad ids aside: +0.0 everywhere) are its partition's columns
                    j = LAYOUT.layer_ids.index(layer)
                    real = torch.from_numpy(ids[:, j, :] >= 0)
                    for k, p in enumerate(parts):
                        served = ((p.view(torch.int16) != -32768).any(-1) & real).any(0)
                        assert set(torch.nonzero(served).flatten().tolist()) == set(_owned(m, k))
                one.end_step()
                counts = [e.end_step().layers for e in engines]
                for layer in LAYOUT.layer_ids:   # every real lookup read or hit by exactly one rank
                    pads = 1 if layer == LAYOUT.layer_ids[0] else 0
                    assert sum(c[layer].lookups - c[layer].zero_rows for c in counts) == 16 * 24 - pads
    finally:
        for e in engines:
            e.close()


def _owned(m: Manifest, rank: int) -> tuple[int, ...]:
    return m.partition.columns[rank] if m.partition is not None else tuple(range(6 * rank, 6 * rank + 6))


def test_a_control_file_of_another_partition_is_refused_naming_both(staged, tmp_path: Path) -> None:
    for m, other in ((staged["balanced"], "columns"), (staged["columns"], "balanced")):
        with pytest.raises(SlackTierError) as err:
            StepEngine.from_control(_control(tmp_path, "bad.toml", m, partition=other))
        assert err.value.kind is ErrorKind.BAD_INPUT
        assert f"'{m.partition_kind}'" in err.value.message and f"'{other}'" in err.value.message
        assert f'partition = "{m.partition_kind}"' in err.value.fix
