"""Issue 34: lossy seen-sets are `.npy` arrays of integer row ids or a uint8 bitmap; anything else is refused
naming the file, and the rows served are exactly the source's (a seen row) or zeros (an unseen one)."""

from __future__ import annotations

import pickle
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from slacktier.config import ControlFile, EngineConfig, TableConfig
from slacktier.engine import StepEngine, seen_bitmap
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.codec import dequantize_bits
from slacktier.tables.stage import SyntheticSource, stage_synthetic

ROWS = 600


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    return stage_synthetic([tmp_path_factory.mktemp("seen") / "t.bin"], {1: ROWS}, 1, 4, progress=False)


def _engine(staged, seen: Path) -> StepEngine:
    cfg = ControlFile(engine=EngineConfig(cache_rows=64, lossy=True, check=True),
                      tables=(TableConfig(layer=1, manifest=staged.path, source="dram", cache_share=1.0,
                                          seen=str(seen)),))
    return StepEngine.from_config(cfg)


def _save(path: Path, arr) -> Path:
    np.save(path, arr, allow_pickle=True)
    return path


CASES = {
    "floats": (lambda p: _save(p / "s.npy", np.array([1.5, 7.0])), "seen rows are float64, want integer row ids"),
    "bools": (lambda p: _save(p / "s.npy", np.ones(ROWS, dtype=bool)), "seen rows are bool, want integer row ids"),
    "object": (lambda p: _save(p / "s.npy", np.array([1, "a"], dtype=object)), "is not a .npy array: Object arrays"),
    "pickle": (lambda p: (p / "s.npy").write_bytes(pickle.dumps([1, 2])) and p / "s.npy",
               "is not a .npy array: no .npy header (a pickle or another format)"),
    "npz": (lambda p: (np.savez(p / "s.npz", a=np.arange(3)), p / "s.npz")[1], "is not a .npy file"),
    "2-d": (lambda p: _save(p / "s.npy", np.arange(6).reshape(2, 3)), "is 2-dimensional (2, 3)"),
    "short bitmap": (lambda p: _save(p / "s.npy", np.zeros(10, np.uint8)),
                     f"is a uint8 bitmap of 10 bytes, layer 1's {ROWS} rows need {ROWS // 8}"),
    "uint64 wrap": (lambda p: _save(p / "s.npy", np.array([3, 2**64 - 1], np.uint64)),
                    f"seen rows outside 0..{ROWS - 1} (from 3 to {2**64 - 1})"),
    "negative": (lambda p: _save(p / "s.npy", np.array([-1, 3])), f"seen rows outside 0..{ROWS - 1}"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_seen_set_is_refused_naming_the_file(staged, tmp_path, case) -> None:
    write, said = CASES[case]
    path = write(tmp_path)
    with pytest.raises(SlackTierError) as exc:
        _engine(staged, path)
    assert exc.value.kind is ErrorKind.BAD_INPUT and exc.value.layer == 1
    assert exc.value.message.startswith(f"seen-set {path}") and said in exc.value.message, exc.value.message


def test_a_missing_seen_set_is_missing(staged, tmp_path) -> None:
    with pytest.raises(SlackTierError) as exc:
        _engine(staged, tmp_path / "none.npy")
    assert exc.value.kind is ErrorKind.MISSING and str(tmp_path / "none.npy") in exc.value.message


def test_seen_bitmap_refuses_floats_and_bools() -> None:
    for rows, dtype in ((np.array([1.5]), "float64"), (np.array([True]), "bool")):
        with pytest.raises(SlackTierError) as exc:
            seen_bitmap(10, rows)
        assert exc.value.message == f"seen rows are {dtype}, want integer row ids"
    assert seen_bitmap(20, np.array([0, 9], np.uint16)).tolist() == [1, 2, 0]


@pytest.mark.parametrize("form", ["int64", "int32", "uint32", "bitmap"])
def test_seen_rows_are_served_exactly_and_the_others_as_zeros(staged, tmp_path, form) -> None:
    seen = np.arange(0, ROWS, 3, dtype=np.int64)   # every third row
    arr = {"int64": seen, "int32": seen.astype(np.int32), "uint32": seen.astype(np.uint32),
           "bitmap": seen_bitmap(ROWS, seen)}[form]
    engine = _engine(staged, _save(tmp_path / "s.npy", arr))
    truth = SyntheticSource(staged.layout, 4)
    ids = np.random.default_rng(1).integers(0, ROWS, (8, 1, 24))
    engine.begin_step(ids)
    got = engine.gather(1).reshape(-1, 256).view(torch.int16).numpy()
    engine.end_step()
    flat = ids.reshape(-1)
    want = dequantize_bits(truth.rows(1, flat)).view(np.int16)
    want[flat % 3 != 0] = 0
    assert (flat % 3 != 0).any() and (flat % 3 == 0).any()
    assert np.array_equal(got, want)
    engine.close()


def test_a_reload_that_narrows_the_seen_set_serves_zeros_for_the_rows_it_no_longer_holds(staged, tmp_path) -> None:
    """Rows cached under a wider seen-set are dropped by the reload: what a fresh engine with the narrow file
    serves (zeros outside it), not the cached real rows."""
    wide = _save(tmp_path / "wide.npy", np.arange(ROWS, dtype=np.int64))
    narrow = _save(tmp_path / "narrow.npy", np.arange(0, ROWS, 2, dtype=np.int64))
    engine = _engine(staged, wide)
    truth = SyntheticSource(staged.layout, 4)
    ids = np.arange(48, dtype=np.int64).reshape(2, 1, 24)   # 48 rows: all fit the 64-row cache
    flat = ids.reshape(-1)
    want = dequantize_bits(truth.rows(1, flat)).view(np.int16)
    for _ in range(2):   # the second step serves every row from the cache
        engine.begin_step(ids)
        got = engine.gather(1).reshape(-1, 256).view(torch.int16).numpy()
        engine.end_step()
    assert np.array_equal(got, want) and (want[flat % 2 == 1] != 0).any()
    engine.apply(ControlFile(engine=engine.config.engine, tables=tuple(
        msgspec.structs.replace(t, seen=str(narrow)) for t in engine.config.tables)))
    engine.begin_step(ids)
    got = engine.gather(1).reshape(-1, 256).view(torch.int16).numpy()
    engine.end_step()
    want[flat % 2 == 1] = 0
    assert np.array_equal(got, want)
    engine.close()
