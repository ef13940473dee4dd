"""Context packing served by the step engine: bit-exact rows from packed pages, fewer pages, and every fault.

A scaled Engram table (24 columns) is staged with and without a pack list made here from a small synthetic
traffic: tokens drawn, with repeats, from a pool of contexts whose ids lie in their columns; the pack list holds
the most frequent half of the pool. The engine's checker compares every gathered row with the rows the
manifest's own source regenerates (0 mismatches), on the disk, DRAM and emulated (what-if) tiers, one process
serving the whole table (TP1) and one serving rank 1 of 4 (`owned_only`), packing on and off. Faults: a packed region truncated,
restaged (another stage id), or its index edited, is refused at open; a packed page whose ids disagree with the
rows it is read for is a CHECKSUM fault at gather, never a wrong row (with reads' CRC32C checked, the CRC
catches an edited page first); an index budget too small is refused at staging naming --pack-index-mb.
"""

from __future__ import annotations

import contextlib

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from slacktier.config import from_dict, write_control
from slacktier.engine.step import StepEngine
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.codec import dequantize_bits
from slacktier.tables.engram_hash import EngramLayout
from slacktier.tables.manifest import Manifest
from slacktier.tables.packing import PACK_LIST_FORMAT, PackRequest, read_pack_list
from slacktier.tables.stage import SyntheticSource, stage_synthetic
from slacktier.testing.store import supports_o_direct

LAYOUT = EngramLayout.scaled(200)   # ~4,800 rows per layer, 24 columns of 3 orders x 8 heads
POOL = 120                          # contexts of the synthetic traffic
PACKED = 60                         # the pack list: the most frequent half


def _pool(seed: int = 11) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for layer in LAYOUT.layer_ids:
        b = np.asarray(LAYOUT.layer_column_bounds(layer))
        out[layer] = b[:-1] + rng.integers(0, b[1:] - b[:-1], size=(POOL, 24))
    return out


def _traffic(rng: np.random.Generator, tokens: int) -> np.ndarray:
    """[T, L, 24] ids: each token one pool context, Zipf-like (low indices more often); a pad id once."""
    pool = _pool()
    pick = np.minimum(rng.zipf(1.3, size=tokens) - 1, POOL - 1)
    out = np.stack([pool[layer][pick] for layer in LAYOUT.layer_ids], axis=1)
    out[0, 0, 5] = -1
    return np.ascontiguousarray(out)


def write_list(path: Path, n: int = PACKED, **meta_changes: object) -> Path:
    """A pack list of the pool's first `n` contexts (the most frequent), in the pack list format (tables.packing)."""
    pool = _pool()
    meta = {"format": PACK_LIST_FORMAT, "version": 1, "workload": "synthetic", "split": "fit", "seed": 11,
            "batch": 16, "cache_rows": 200, "ranks": 4, "partition": "columns", "tokens": 1000} | meta_changes
    arrays = {"layers": np.array(LAYOUT.layer_ids, dtype=np.int64), "meta": np.array(json.dumps(meta))}
    for layer in LAYOUT.layer_ids:
        arrays[f"ids_{layer}"] = pool[layer][:n]
        arrays[f"saved_{layer}"] = np.linspace(10, 1, n)
    np.savez(path, **arrays)
    return path


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> dict[str, Manifest]:
    tmp = tmp_path_factory.mktemp("packing")
    if not supports_o_direct(tmp):
        pytest.skip("tmp_path does not support O_DIRECT")
    pack = PackRequest(read_pack_list(write_list(tmp / "list.npz")), 1 << 30, 1 << 20)
    return {f"{name}-{ranks}": stage_synthetic([tmp / f"{name}-{ranks}.bin"], LAYOUT, ranks, 5, progress=False,
                                               pack=pack if name == "packed" else None)
            for name in ("packed", "plain") for ranks in (1, 4)}


def _control(tmp: Path, name: str, m: Manifest, *, rank: int = -1, tier: str = "disk", cache_rows: int = 300,
             **engine: object) -> str:
    tables = [{"layer": layer, "manifest": str(m.path), "cache_share": 0.5, "order": i, "rank": rank,
               "source": tier} for i, layer in enumerate(LAYOUT.layer_ids)]
    if tier == "emulated":   # a device model over a host copy of the staged files (slacktier.whatif)
        for t in tables:
            t["emulated"] = {"model": "nvme-paper", "device": "packing", "rank": max(rank, 0)}
    doc = {"engine": {"cache_rows": cache_rows, "check": True, "owned_only": rank >= 0, **engine}, "table": tables}
    return str(write_control(from_dict(doc), tmp / name))


def _run(ctl: str, steps: int = 4, tokens: int = 32, rank: int = -1) -> dict[str, int]:
    """Steps of the same traffic through the engine; rows compared with the source's; totals summed."""
    truth = SyntheticSource(staged_layout_rows(), 5)
    rng = np.random.default_rng(7)
    with StepEngine.from_control(ctl) as e:
        for _ in range(steps):
            ids = _traffic(rng, tokens)
            e.begin_step(ids)
            for j, layer in enumerate(e.ids_layers):
                out = e.gather(layer).reshape(-1, 256).view(torch.int16).numpy()
                if rank < 0:
                    g = ids[:, j].reshape(-1)
                    want = dequantize_bits(truth.rows(layer, np.where(g < 0, 0, g))).view(np.int16)
                    want[g < 0] = 0
                    assert np.array_equal(out, want)
            e.end_step()
        t = e.totals.values()
        return {k: sum(getattr(c, k) for c in t) for k in ("pages_read", "packed_pages", "mismatches",
                                                           "checked_rows", "rows_read")}


def staged_layout_rows():
    from slacktier.tables.manifest import StagedLayout

    return StagedLayout.from_layout(LAYOUT)


@pytest.mark.parametrize("tier", ["disk", "dram", "emulated"])
@pytest.mark.parametrize("ranks,rank", [(1, -1), (4, 1)])
def test_packed_steps_are_bit_exact_and_read_fewer_pages(staged, tmp_path: Path, tier: str, ranks: int,
                                                         rank: int) -> None:
    got = {}
    with contextlib.ExitStack() as stack:
        if tier == "emulated":   # the what-if's tier, on this test's own emulated device
            from slacktier.whatif.device import device_session
            stack.enter_context(device_session())
        for name in ("packed", "plain"):
            ctl = _control(tmp_path, f"{name}.toml", staged[f"{name}-{ranks}"], rank=rank, tier=tier,
                           verify_reads=True)
            got[name] = _run(ctl, rank=rank)
    for name, c in got.items():
        assert c["mismatches"] == 0 and c["checked_rows"] > 0, (name, c)
    assert got["plain"]["packed_pages"] == 0
    assert got["packed"]["packed_pages"] > 0
    assert got["packed"]["pages_read"] < got["plain"]["pages_read"]


def test_the_manifest_records_packing_and_its_budgets(staged) -> None:
    m = Manifest.load(staged["packed-4"].path)
    pk = m.packing
    assert pk is not None and pk.contexts == {layer: PACKED for layer in LAYOUT.layer_ids}
    assert pk.pages_per_context == 1 and len(pk.regions) == 2 * 4
    assert pk.budget_disk_bytes == 1 << 30 and pk.budget_index_bytes == 1 << 20
    assert pk.pack_list["meta"]["split"] == "fit"
    assert pk.disk_bytes_per_rank == 2 * PACKED * 4096
    assert Manifest.load(staged["packed-1"].path).packing.pages_per_context == 2   # 24 owned rows per context
    assert Manifest.load(staged["plain-4"].path).packing is None


def test_budgets_cap_the_contexts_in_file_order(tmp_path: Path) -> None:
    if not supports_o_direct(tmp_path):
        pytest.skip("tmp_path does not support O_DIRECT")
    pl = read_pack_list(write_list(tmp_path / "l.npz"))
    m = stage_synthetic([tmp_path / "t.bin"], LAYOUT, 4, 5, progress=False,
                        pack=PackRequest(pl, 2 * 10 * 4096, 1 << 20))   # disk: 10 contexts per layer
    assert m.packing.contexts == {layer: 10 for layer in LAYOUT.layer_ids}
    m = stage_synthetic([tmp_path / "u.bin"], LAYOUT, 4, 5, progress=False,
                        pack=PackRequest(pl, 1 << 30, 2 * 16 * 12))     # index: 16 entries -> 8 contexts per layer
    assert m.packing.contexts == {layer: 8 for layer in LAYOUT.layer_ids}
    assert m.packing.index_bytes_per_rank <= 2 * 16 * 12


def test_an_index_over_its_budget_is_refused_at_staging_naming_the_flag(tmp_path: Path) -> None:
    pl = read_pack_list(write_list(tmp_path / "l.npz"))
    with pytest.raises(SlackTierError) as err:
        stage_synthetic([tmp_path / "t.bin"], LAYOUT, 4, 5, progress=False, pack=PackRequest(pl, 1 << 30, 100))
    assert err.value.kind is ErrorKind.BAD_INPUT and "--pack-index-mb" in err.value.message
    assert not (tmp_path / "t.bin").exists()


def _copy_staged(src: Manifest, tmp: Path, name: str) -> Manifest:
    """A fresh staging of the packed TP4 table (its own files), for tests that damage it."""
    pl = read_pack_list(write_list(tmp / f"{name}.npz"))
    return stage_synthetic([tmp / f"{name}.bin"], LAYOUT, 4, 5, progress=False,
                           pack=PackRequest(pl, 1 << 30, 1 << 20))


def test_a_truncated_packed_region_is_refused_at_open(tmp_path: Path) -> None:
    if not supports_o_direct(tmp_path):
        pytest.skip("tmp_path does not support O_DIRECT")
    m = _copy_staged(None, tmp_path, "trunc")
    last = max(m.packing.regions, key=lambda r: r.offset_bytes)
    os.truncate(m.targets[0], last.offset_bytes + 4096)   # the last packed region loses all but one page
    with pytest.raises(SlackTierError) as err:
        StepEngine.from_control(_control(tmp_path, "t.toml", m, rank=last.rank))
    assert err.value.kind is ErrorKind.TARGET and "truncated" in err.value.message


def test_a_restaged_target_is_refused_by_the_older_manifest(tmp_path: Path) -> None:
    if not supports_o_direct(tmp_path):
        pytest.skip("tmp_path does not support O_DIRECT")
    m = _copy_staged(None, tmp_path, "again")
    old = tmp_path / "old.manifest.json"
    Path(m.path).rename(old)
    pl = read_pack_list(write_list(tmp_path / "fewer.npz", n=20))   # another pack list: another stage id
    m2 = stage_synthetic([tmp_path / "again.bin"], LAYOUT, 4, 5, progress=False, overwrite=True,
                         manifest_path=tmp_path / "again.bin.manifest.json", pack=PackRequest(pl, 1 << 30, 1 << 20))
    assert m2.stage_id != Manifest.load(old).stage_id
    (tmp_path / "old.crc").write_bytes((tmp_path / "again.bin.manifest.crc").read_bytes())
    with pytest.raises(SlackTierError) as err:
        StepEngine.from_control(_control(tmp_path, "o.toml", Manifest.load(old), rank=0))
    assert err.value.kind in (ErrorKind.TARGET, ErrorKind.CHECKSUM)


def test_an_edited_index_is_refused_at_open(tmp_path: Path) -> None:
    if not supports_o_direct(tmp_path):
        pytest.skip("tmp_path does not support O_DIRECT")
    m = _copy_staged(None, tmp_path, "ix")
    p = m.index_path()
    data = bytearray(p.read_bytes())
    data[-3] ^= 0x40
    p.write_bytes(bytes(data))
    with pytest.raises(SlackTierError) as err:
        StepEngine.from_control(_control(tmp_path, "i.toml", m, rank=2))
    assert err.value.kind is ErrorKind.CHECKSUM and "pack index" in err.value.message


def _swap_packed_pages(m: Manifest, rank: int, layer: int, a: int, b: int) -> None:
    """Swap pages a and b of (layer, rank)'s packed region on disk: each now names the other context's rows."""
    r = m.packed_regions(layer, rank)[0]
    with open(r.path, "r+b") as f:
        f.seek(r.offset_bytes + a * 4096)
        pa = f.read(4096)
        f.seek(r.offset_bytes + b * 4096)
        pb = f.read(4096)
        f.seek(r.offset_bytes + a * 4096)
        f.write(pb)
        f.seek(r.offset_bytes + b * 4096)
        f.write(pa)


@pytest.mark.parametrize("verify", [False, True])
def test_a_packed_page_that_disagrees_with_its_ids_is_a_fault(tmp_path: Path, verify: bool) -> None:
    if not supports_o_direct(tmp_path):
        pytest.skip("tmp_path does not support O_DIRECT")
    m = _copy_staged(None, tmp_path, "swap")
    layer = LAYOUT.layer_ids[0]
    for p in range(PACKED // 2):   # every early (frequent) context's page now holds another context's rows
        _swap_packed_pages(m, 1, layer, p, PACKED - 1 - p)
    ctl = _control(tmp_path, "s.toml", m, rank=1, verify_reads=verify)
    with StepEngine.from_control(ctl) as e:
        e.begin_step(_traffic(np.random.default_rng(3), 16))
        with pytest.raises(SlackTierError) as err:
            e.gather(layer)
        assert err.value.kind is ErrorKind.CHECKSUM and err.value.layer == layer
        if not verify:   # caught by the packed page's own ids, not by a page checksum
            assert "packed page" in err.value.message
        e.end_step()   # the error reached the caller at gather; the slots its reads claimed are forgotten
        assert e.cache.cached(layer)[0].size == 0


def test_read_pack_list_refuses_what_is_not_one(tmp_path: Path) -> None:
    good = write_list(tmp_path / "good.npz")
    assert read_pack_list(good).layers == LAYOUT.layer_ids
    cases = {
        "held-out.npz": lambda p: write_list(p, split="held-out"),
        "version.npz": lambda p: write_list(p, version=2),
        "text.npz": lambda p: p.write_text("not a zip"),
    }
    for name, make in cases.items():
        make(tmp_path / name)
        with pytest.raises(SlackTierError) as err:
            read_pack_list(tmp_path / name)
        assert err.value.kind is ErrorKind.BAD_INPUT and name in err.value.message
    z = dict(np.load(good))
    z[f"ids_{LAYOUT.layer_ids[0]}"] = z[f"ids_{LAYOUT.layer_ids[0]}"].astype(np.int32)
    np.savez(tmp_path / "int32.npz", **z)
    with pytest.raises(SlackTierError, match="int64"):
        read_pack_list(tmp_path / "int32.npz")
    with pytest.raises(SlackTierError) as err:
        read_pack_list(tmp_path / "absent.npz")
    assert err.value.kind is ErrorKind.MISSING


def test_stage_and_inspect_on_the_command_line(tmp_path: Path, capsys) -> None:
    """`slacktier stage --pack-list` stages packed regions and prints what they take; `inspect` shows the extra
    disk and index host memory per rank, of the manifest and of a control file serving it; a too small index
    budget is refused naming its flag, and budgets without a list are refused."""
    if not supports_o_direct(tmp_path):
        pytest.skip("tmp_path does not support O_DIRECT")
    from slacktier import cli

    lst = write_list(tmp_path / "l.npz")
    base = ["stage", "--engram", "200", "--ranks", "4", "--no-progress", "--pack-list", str(lst)]
    assert cli.main([*base, "--target", str(tmp_path / "x.bin"), "--pack-disk-gb", "1",
                     "--pack-index-mb", "0.0001"]) == 2
    assert "--pack-index-mb" in capsys.readouterr().err
    assert cli.main(["stage", "--engram", "200", "--target", str(tmp_path / "y.bin"), "--pack-disk-gb", "1"]) == 2
    assert "--pack-list" in capsys.readouterr().err
    assert cli.main([*base, "--target", str(tmp_path / "t.bin"), "--pack-disk-gb", "1", "--pack-index-mb", "1"]) == 0
    assert f"packed {2 * PACKED} contexts" in capsys.readouterr().out
    manifest = tmp_path / "t.bin.manifest.json"
    assert cli.main(["inspect", str(manifest)]) == 0
    out = capsys.readouterr().out
    assert "context packing:" in out and "index host memory" in out and "fit half" in out
    ctl = _control(tmp_path, "c.toml", Manifest.load(manifest), rank=3)
    assert cli.main(["inspect", ctl, "--json"]) == 0
    tables = json.loads(capsys.readouterr().out)["control_report"]["tables"]
    assert all(t["index_bytes"] > 0 and t["packed_bytes"] == PACKED * 4096 for t in tables)


def test_verify_checks_packed_regions(tmp_path: Path) -> None:
    """`verify_table` checks packed pages' CRC32Cs and their rows; swapped packed pages are found both ways."""
    if not supports_o_direct(tmp_path):
        pytest.skip("tmp_path does not support O_DIRECT")
    from slacktier.tables.verify import verify_table

    m = _copy_staged(None, tmp_path, "verify")
    report = verify_table(m, rows_per_region=30, progress=False)
    assert report.ok and report.pages_checked == m.total_pages
    last = PACKED - 1   # the first and last pages are always among the sampled ones
    _swap_packed_pages(m, 2, LAYOUT.layer_ids[1], 0, last)
    kinds = {(x.kind, x.rank, x.page) for x in verify_table(m, rows_per_region=30, progress=False).mismatches}
    assert {("checksum", 2, 0), ("checksum", 2, last), ("packed", 2, 0), ("packed", 2, last)} <= kinds


def test_a_balanced_rank_serves_packed_contexts_bit_exact(tmp_path: Path) -> None:
    """Under the balanced partition a rank packs its own heads of each order (stored rows in the index's key,
    global ids in the pages): the checker finds 0 mismatches and packed pages are read."""
    if not supports_o_direct(tmp_path):
        pytest.skip("tmp_path does not support O_DIRECT")
    pl = read_pack_list(write_list(tmp_path / "l.npz"))
    m = stage_synthetic([tmp_path / "b.bin"], LAYOUT, 4, 5, progress=False, partition="balanced",
                        heads_per_order=8, pack=PackRequest(pl, 1 << 30, 1 << 20))
    assert m.packing.rank_columns[1] == (2, 3, 10, 11, 18, 19)
    for rank in (1, 3):
        doc = {"engine": {"cache_rows": 300, "check": True, "owned_only": True},
               "table": [{"layer": layer, "manifest": str(m.path), "cache_share": 0.5, "order": i, "rank": rank,
                          "partition": "balanced"} for i, layer in enumerate(LAYOUT.layer_ids)]}
        c = _run(str(write_control(from_dict(doc), tmp_path / f"b{rank}.toml")), rank=rank)
        assert c["mismatches"] == 0 and c["checked_rows"] > 0 and c["packed_pages"] > 0, c
