"""The what-if with a pack list: it stages a packed table under its own name, its steps' rows stay exact, and a
pack list made for another table size is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from slacktier.cli import main
from slacktier.tables.engram_hash import EngramLayout
from slacktier.tables.manifest import Manifest
from slacktier.tables.packing import PACK_LIST_FORMAT

VOCAB = 2000


def _pack_list(path: Path, vocab: int, n: int = 40) -> Path:
    """A pack list of n random contexts of the scaled V4.1 table at `vocab` (one id per hash column)."""
    layout = EngramLayout.scaled(vocab, (1, 14))
    rng = np.random.default_rng(3)
    meta = {"format": PACK_LIST_FORMAT, "version": 1, "workload": "chat", "split": "fit", "seed": 0,
            "batch": 8, "cache_rows": 0, "ranks": 2, "partition": "columns", "tokens": 1000}
    arrays = {"layers": np.array(layout.layer_ids, dtype=np.int64), "meta": np.array(json.dumps(meta))}
    for layer in layout.layer_ids:
        b = np.asarray(layout.layer_column_bounds(layer))
        arrays[f"ids_{layer}"] = (b[:-1] + rng.integers(0, b[1:] - b[:-1], size=(n, 24))).astype(np.int64)
        arrays[f"saved_{layer}"] = np.linspace(n, 1, n)
    np.savez(path, **arrays)
    return path


def _whatif(tmp_path: Path, *extra: str) -> int:
    return main(["whatif", "--out", str(tmp_path / "w"), "--vocab", str(VOCAB), "--steps", "2", "--batch", "8",
                 "--ranks", "2", "--runs", "1", "--no-plot", "--table", "1=nvme-paper", "--table", "14=nvme-paper",
                 *extra])


def test_a_whatif_with_a_pack_list_stages_a_packed_table_apart_and_its_rows_are_exact(tmp_path, capsys):
    pl = _pack_list(tmp_path / "list.npz", VOCAB)
    assert _whatif(tmp_path, "--pack-list", str(pl), "--pack-disk-gb", "0.01", "--pack-index-mb", "1") == 0
    out = capsys.readouterr().out
    assert ": 0 mismatching rows" in out and "checker: 2 TP steps" in out
    packed = [p for p in (tmp_path / "w").glob("*.manifest.json") if "-pack" in p.name]
    assert len(packed) == 1
    pk = Manifest.load(packed[0]).packing
    assert pk is not None and pk.contexts == {1: 40, 14: 40}
    assert _whatif(tmp_path) == 0   # the same workdir without the list: an unpacked table of its own
    capsys.readouterr()
    plain = [p for p in (tmp_path / "w").glob("*.manifest.json") if "-pack" not in p.name]
    assert len(plain) == 1 and Manifest.load(plain[0]).packing is None


def test_a_pack_list_made_for_another_table_size_is_refused(tmp_path, capsys):
    pl = _pack_list(tmp_path / "list.npz", 50_000)
    assert _whatif(tmp_path, "--pack-list", str(pl)) == 2
    err = capsys.readouterr().err
    assert "rows outside the what-if's table" in err and "vocabulary 2000" in err


def test_characterize_hashes_for_the_whatifs_scaled_table_when_given_its_vocabulary():
    from slacktier.errors import SlackTierError
    from slacktier.workloads.hashing import lookup_hasher

    layout = EngramLayout.scaled(VOCAB, (1, 14))
    spec = lookup_hasher("engram", VOCAB).spec
    assert spec.table_rows == tuple(layout.rows(i) for i in range(layout.n_layers))
    assert lookup_hasher("engram").spec.table_rows != spec.table_rows
    with pytest.raises(SlackTierError, match="engram vocabulary"):
        lookup_hasher("ple", VOCAB)
