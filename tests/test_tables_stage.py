"""Staging and verification on real files (O_DIRECT), a real safetensors checkpoint and, as root, a loop device."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables import codec, odirect, pagecrc
from slacktier.tables.layout import PAGE_BYTES, ROW_BYTES, ROWS_PER_PAGE, pages_for_rows
from slacktier.tables.manifest import TARGET_HEADER_BYTES, Manifest, StagedLayout, TableIdentity, \
    check_target_header, header_page, manifest_digest, parse_header, plan_regions
from slacktier.tables.regions import Region
from slacktier.tables.stage import SyntheticSource, layer_seed, stage_checkpoint, stage_synthetic, stage_table
from slacktier.testing.tables import FailingSource
from slacktier.tables.verify import verify_table


def _read_region_rows(region, rows: int | None = None) -> np.ndarray:
    """A region's rows read back through plain os.pread (no O_DIRECT, no SlackTier reader)."""
    fd = os.open(region.path, os.O_RDONLY)
    try:
        data = os.pread(fd, region.pages * PAGE_BYTES, region.offset_bytes)
    finally:
        os.close(fd)
    assert len(data) == region.pages * PAGE_BYTES
    pages = np.frombuffer(data, dtype=np.uint8).reshape(region.pages, PAGE_BYTES)
    assert not pages[:, ROWS_PER_PAGE * ROW_BYTES:].any(), "page padding must be zero"
    body = pages[:, :ROWS_PER_PAGE * ROW_BYTES].reshape(-1, ROW_BYTES)
    assert not body[region.rows:].any(), "rows past the shard's end must be zero"
    return body[:region.rows]


def test_synthetic_table_reads_back_bit_identical(tmp_path):
    targets = [tmp_path / "a.bin", tmp_path / "b.bin"]
    layers = {1: 1000, 14: 737}
    m = stage_synthetic(targets, layers, ranks=3, seed=7, progress=False)
    assert Path(m.path) == Path(str(targets[0]) + ".manifest.json")
    assert [(r.layer, r.rank) for r in m.regions] == [(l, k) for l in (1, 14) for k in range(3)]
    for r in m.regions:
        assert r.device == r.rank % 2 and r.path == str(targets[r.device].resolve())
        assert r.offset_bytes % PAGE_BYTES == 0 and r.offset_bytes >= TARGET_HEADER_BYTES
        assert r.pages == pages_for_rows(r.rows)
        got = _read_region_rows(r)
        # independent regeneration: the layer's seed through the public codec function, row by row range
        want = codec.synthetic_rows(int(layer_seed(7, r.layer)), r.row_start, r.rows)
        assert np.array_equal(got, want), (r.layer, r.rank)
    assert sum(r.rows for r in m.regions if r.layer == 14) == 737
    # regions of one target never overlap
    for dev in (0, 1):
        spans = sorted((r.offset_bytes, r.offset_bytes + r.nbytes) for r in m.regions if r.device == dev)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    report = verify_table(m.path, rows_per_region=50, progress=False)
    assert report.ok, report.lines()
    assert report.pages_checked == m.total_pages and report.rows_checked > 0


def test_column_bounds_shard_on_columns(tmp_path):
    bounds = {1: (0, 100, 250, 270, 400)}  # 4 columns over 2 ranks: rank 1 owns columns 2..3 = rows 250..399
    m = stage_synthetic([tmp_path / "t.bin"], {1: 400}, ranks=2, seed=1, column_bounds=bounds, progress=False)
    assert [(r.row_start, r.rows) for r in m.regions] == [(0, 250), (250, 150)]
    assert Manifest.load(m.path).layout.column_bounds == {1: bounds[1]}


def _checkpoint(path: Path, layers: dict[int, int], prefix: str = "layers", seed: int = 0,
                drop: str | None = None, **overrides: torch.Tensor) -> dict[int, np.ndarray]:
    """Write a safetensors checkpoint of random fp8/e8m0 bytes (special bytes included); return raw rows."""
    rng = np.random.default_rng(seed)
    tensors, raws = {}, {}
    for layer, rows in layers.items():
        raw = rng.integers(0, 256, size=(rows, ROW_BYTES), dtype=np.uint8)
        raw[0, :4] = [0x7F, 0xFF, 0x80, 0x00]
        raw[0, 256:258] = [0x00, 0xFF]
        raws[layer] = raw
        t = torch.from_numpy(raw)
        tensors[f"{prefix}.{layer}.engram.embed.weight"] = t[:, :256].contiguous().view(torch.float8_e4m3fn)
        tensors[f"{prefix}.{layer}.engram.embed.scale"] = t[:, 256:].contiguous().view(torch.float8_e8m0fnu)
        tensors[f"{prefix}.{layer}.attn.wq.weight"] = torch.zeros(4, 4)
    tensors.update(overrides)
    if drop:
        del tensors[drop]
    save_file(tensors, str(path))
    return raws


@pytest.mark.parametrize("prefix", ["layers", "model.layers"])
def test_checkpoint_table_reads_back_bit_identical(tmp_path, prefix):
    ckpt = tmp_path / "model.safetensors"
    raws = _checkpoint(ckpt, {1: 301, 14: 450}, prefix=prefix)
    m = stage_checkpoint(ckpt, [tmp_path / "t.bin"], ranks=4, progress=False)
    assert m.layout.rows == {1: 301, 14: 450}
    assert m.source["kind"] == "checkpoint" and m.source["files"] == [str(ckpt.resolve())]
    import hashlib
    assert m.source_digest == "sha256:" + hashlib.sha256(ckpt.read_bytes()).hexdigest()
    for r in m.regions:
        assert np.array_equal(_read_region_rows(r), raws[r.layer][r.row_start:r.row_start + r.rows])
    report = verify_table(m.path, rows_per_region=40, progress=False)
    assert report.ok, report.lines()
    # the staged rows dequantize exactly like the checkpoint tensors through the torch reference
    r = m.region(1, 0)
    got = codec.dequantize(torch.from_numpy(_read_region_rows(r).copy()))
    t = torch.from_numpy(raws[1][:r.rows])
    ref = codec.reference_dequant(t[:, :256].view(torch.float8_e4m3fn), t[:, 256:].view(torch.float8_e8m0fnu))
    same = (got.view(torch.int16) == ref.view(torch.int16)) | (torch.isnan(got) & torch.isnan(ref))
    assert bool(same.all())


def test_checkpoint_directory_and_layer_choice(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    raws = _checkpoint(d / "model-00001-of-00002.safetensors", {1: 40})
    raws.update(_checkpoint(d / "model-00002-of-00002.safetensors", {14: 50}, seed=1))
    m = stage_checkpoint(d, [tmp_path / "t.bin"], ranks=1, layers=[14], progress=False)
    assert m.layout.rows == {14: 50} and len(m.source["files"]) == 1
    assert np.array_equal(_read_region_rows(m.regions[0]), raws[14])


def test_verify_names_layer_rank_page_of_a_flipped_byte(tmp_path, capsys):
    target = tmp_path / "t.bin"
    m = stage_synthetic([target], {1: 900, 14: 900}, ranks=2, seed=3, progress=False)
    r = m.region(14, 1)
    page, byte = 5, 3 * ROW_BYTES + 17  # row 5 * 15 + 3 = 78 of the shard
    with open(target, "r+b") as f:
        f.seek(r.offset_bytes + page * PAGE_BYTES + byte)
        old = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([old[0] ^ 0x10]))
    report = verify_table(m.path, rows_per_region=0, progress=False)
    assert not report.ok
    assert [(x.kind, x.layer, x.rank, x.page) for x in report.mismatches] == [("checksum", 14, 1, 5)]
    # the row check alone finds it too when it samples that row (all 450 rows of the region)
    report = verify_table(m.path, rows_per_region=2000, check_pages=False, progress=False)
    rows = [(x.kind, x.layer, x.rank, x.page, x.row) for x in report.mismatches]
    assert rows == [("row", 14, 1, 5, r.row_start + 78)]
    # and the CLI exits non-zero, naming the place
    from slacktier.cli import main
    assert main(["verify", m.path, "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "layer 14, rank 1, page 5" in out


def test_verify_catches_a_flipped_padding_byte_and_a_bad_checksum_file(tmp_path):
    target = tmp_path / "t.bin"
    m = stage_synthetic([target], {2: 100}, ranks=1, seed=3, progress=False)
    r = m.regions[0]
    with open(target, "r+b") as f:
        f.seek(r.offset_bytes + 2 * PAGE_BYTES + 4000)  # padding of page 2
        f.write(b"\x01")
    report = verify_table(m.path, progress=False)
    assert [(x.kind, x.page) for x in report.mismatches] == [("checksum", 2)]
    crc = m.crc_path()
    data = bytearray(crc.read_bytes())
    data[0] ^= 1
    crc.write_bytes(bytes(data))
    with pytest.raises(SlackTierError) as e:
        verify_table(m.path, progress=False)
    assert e.value.kind == ErrorKind.CHECKSUM


def test_verify_reports_a_truncated_target_by_region(tmp_path):
    target = tmp_path / "t.bin"
    m = stage_synthetic([target], {1: 300, 14: 300}, ranks=1, seed=3, progress=False)
    r = m.region(14, 0)
    os.truncate(target, r.offset_bytes + 7 * PAGE_BYTES)
    report = verify_table(m.path, rows_per_region=0, progress=False)
    assert [(x.kind, x.layer, x.rank, x.page) for x in report.mismatches] == [("read", 14, 0, 7)]
    report = verify_table(m.path, rows_per_region=500, check_pages=False, progress=False)
    bad = {(x.kind, x.layer, x.rank) for x in report.mismatches}
    assert bad == {("read", 14, 0)} and min(x.page for x in report.mismatches) == 7


def test_manifest_round_trip_and_runtime_regions(tmp_path):
    m = stage_synthetic([tmp_path / "a.bin", tmp_path / "b.bin"], {1: 100, 14: 31}, ranks=2, seed=5, progress=False)
    loaded = Manifest.load(m.path)
    assert loaded.regions == m.regions and loaded.layout == m.layout and loaded.source == m.source
    runtime = loaded.runtime_regions()
    assert all(isinstance(r, Region) for r in runtime)
    assert [(r.layer, r.rank, r.path, r.offset_bytes, r.pages, r.device, r.row_start, r.rows) for r in runtime] == [
        (r.layer, r.rank, r.path, r.offset_bytes, r.pages, r.device, r.row_start, r.rows) for r in m.regions]
    # filters, and a moved target: device 1's regions read from the override, device 0's keep the staged path
    moved = loaded.runtime_regions(layer=14, targets=["", "/elsewhere/b.bin"])
    assert [(r.rank, r.path) for r in moved] == [(0, m.targets[0]), (1, "/elsewhere/b.bin")]
    assert loaded.runtime_regions(layer=1, rank=1) == [m.region(1, 1).runtime()]
    with pytest.raises(SlackTierError) as e:
        loaded.runtime_regions(layer=2)
    assert e.value.kind == ErrorKind.MISSING
    crcs = loaded.checksums()
    assert crcs.shape == (m.total_pages,) and crcs.dtype == np.dtype("<u4")
    assert loaded.stage_id == m.stage_id and len(m.stage_id) == 32
    assert loaded.identity == TableIdentity(m.source_digest, m.stage_id)
    # staging the same table again is allowed, byte-identical, and keeps its content-derived stage id
    before = Path(tmp_path / "a.bin").read_bytes()
    again = stage_synthetic([tmp_path / "a.bin", tmp_path / "b.bin"], {1: 100, 14: 31}, ranks=2, seed=5,
                            progress=False)
    after = Path(tmp_path / "a.bin").read_bytes()
    assert after == before
    assert again.stage_id == m.stage_id and again.source_digest == m.source_digest
    assert parse_header(after)["stage_id"] == again.stage_id
    assert np.array_equal(again.checksums(), crcs)


def test_page_checksums_are_crc32c_of_whole_pages(tmp_path):
    rng = np.random.default_rng(0)
    pages = rng.integers(0, 256, size=(37, PAGE_BYTES), dtype=np.uint8)
    pages[3] = 0
    assert np.array_equal(pagecrc.page_crcs(pages), pagecrc.page_crcs_package(pages))
    import crc32c
    assert int(pagecrc.page_crcs(pages[:1])[0]) == crc32c.crc32c(pages[0].tobytes())
    # the manifest's checksum file holds the package's CRC32C of every page as read back with pread
    m = stage_synthetic([tmp_path / "t.bin"], {1: 200, 2: 100}, ranks=2, seed=9, progress=False)
    crcs = m.checksums()
    for r in m.regions:
        with open(r.path, "rb") as f:
            f.seek(r.offset_bytes)
            data = f.read(r.nbytes)
        for p in range(r.pages):
            assert crcs[r.crc_first_page + p] == crc32c.crc32c(data[p * PAGE_BYTES:(p + 1) * PAGE_BYTES])


def test_plan_regions_worked_example():
    regions = plan_regions(StagedLayout.from_rows({1: 1000, 14: 1000}), 2, ["t"])
    assert [(r.layer, r.rank, r.offset_bytes, r.pages, r.crc_first_page) for r in regions][:2] == [
        (1, 0, 4096, 34, 0), (1, 1, 4096 + 34 * 4096, 34, 34)]


def test_synthetic_source_rows_match_pages():
    src = SyntheticSource(StagedLayout.from_rows({3: 100}), seed=11)
    pages = np.empty((pages_for_rows(40), PAGE_BYTES), dtype=np.uint8)
    crcs = np.zeros(pages.shape[0], dtype=np.uint32)
    src.fill_pages(3, 20, 40, pages, crcs)
    body = pages[:, :ROWS_PER_PAGE * ROW_BYTES].reshape(-1, ROW_BYTES)[:40]
    assert np.array_equal(body, src.rows(3, np.arange(20, 60)))
    assert np.array_equal(crcs, pagecrc.page_crcs_package(pages))
    again = np.empty_like(pages)
    src.fill_pages(3, 20, 40, again)
    assert np.array_equal(again, pages)


# ------------------------------------------------------------------ refusals, each before writing anything

def _untouched(tmp_path: Path, before: set[str]) -> None:
    assert {p.name for p in tmp_path.iterdir()} == before


def test_refuses_a_file_target_over_max_bytes(tmp_path):
    with pytest.raises(SlackTierError) as e:
        stage_synthetic([tmp_path / "t.bin"], {1: 15 * 10}, ranks=1, seed=0, max_bytes=10 * PAGE_BYTES,
                        progress=False)
    assert e.value.kind == ErrorKind.TARGET and "too small" in str(e.value)
    _untouched(tmp_path, set())
    # exactly enough: header page + 10 pages
    stage_synthetic([tmp_path / "t.bin"], {1: 15 * 10}, ranks=1, seed=0, max_bytes=11 * PAGE_BYTES, progress=False)


def test_refuses_a_target_holding_another_table(tmp_path):
    target = tmp_path / "t.bin"
    m = stage_synthetic([target], {1: 300}, ranks=1, seed=1, progress=False)
    before = target.read_bytes()
    with pytest.raises(SlackTierError) as e:
        stage_synthetic([target], {1: 300}, ranks=1, seed=2, progress=False)
    assert e.value.kind == ErrorKind.TARGET and "another table" in str(e.value)
    assert target.read_bytes() == before
    # even with the manifest gone, the header page gives it away
    other_manifest = tmp_path / "elsewhere.json"
    with pytest.raises(SlackTierError):
        stage_synthetic([target], {1: 300}, ranks=1, seed=2, manifest_path=other_manifest, progress=False)
    assert target.read_bytes() == before and not other_manifest.exists()
    # a manifest path that describes another table is refused too, for a fresh target
    with pytest.raises(SlackTierError) as e:
        stage_synthetic([tmp_path / "new.bin"], {1: 300}, ranks=1, seed=2, manifest_path=m.path, progress=False)
    assert "manifest" in str(e.value) and not (tmp_path / "new.bin").exists()
    m2 = stage_synthetic([target], {1: 300}, ranks=1, seed=2, overwrite=True, progress=False)
    assert m2.source_digest != m.source_digest and verify_table(m2, progress=False).ok


def test_refuses_a_target_holding_unknown_data(tmp_path):
    target = tmp_path / "t.bin"
    target.write_bytes(b"not a table" * 1000)
    with pytest.raises(SlackTierError) as e:
        stage_synthetic([target], {1: 30}, ranks=1, seed=0, progress=False)
    assert e.value.kind == ErrorKind.TARGET and target.read_bytes() == b"not a table" * 1000
    stage_synthetic([target], {1: 30}, ranks=1, seed=0, overwrite=True, progress=False)


def _tensor(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(rows, cols, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 else torch.zeros(rows, cols,
                                                                                                         dtype=dtype)


@pytest.mark.parametrize("case,overrides,drop,expect", [
    ("missing scale", {}, "layers.1.engram.embed.scale", "no tensor layers.1.engram.embed.scale"),
    ("weight dtype", {"layers.1.engram.embed.weight": _tensor(30, 256, torch.bfloat16)}, None, "dtype BF16"),
    ("scale dtype", {"layers.1.engram.embed.scale": _tensor(30, 8, torch.uint8)}, None, "dtype U8"),
    ("weight shape", {"layers.1.engram.embed.weight": _tensor(30, 128, torch.float8_e4m3fn)}, None, "shape [30, 128]"),
    ("scale shape", {"layers.1.engram.embed.scale": _tensor(29, 8, torch.float8_e8m0fnu)}, None, "shape [29, 8]"),
])
def test_refuses_a_bad_checkpoint(tmp_path, case, overrides, drop, expect):
    ckpt = tmp_path / "c.safetensors"
    _checkpoint(ckpt, {1: 30, 14: 30}, drop=drop, **overrides)
    with pytest.raises(SlackTierError) as e:
        stage_checkpoint(ckpt, [tmp_path / "t.bin"], ranks=2, progress=False)
    assert e.value.kind == ErrorKind.CHECKPOINT and expect in str(e.value), str(e.value)
    assert e.value.layer == 1
    _untouched(tmp_path, {"c.safetensors"})


def test_refuses_a_missing_layer_and_unexpected_rows(tmp_path):
    ckpt = tmp_path / "c.safetensors"
    _checkpoint(ckpt, {1: 30})
    with pytest.raises(SlackTierError) as e:
        stage_checkpoint(ckpt, [tmp_path / "t.bin"], ranks=1, layers=[1, 14], progress=False)
    assert e.value.kind == ErrorKind.CHECKPOINT and e.value.layer == 14
    with pytest.raises(SlackTierError) as e:
        stage_checkpoint(ckpt, [tmp_path / "t.bin"], ranks=1, expected={1: 31}, progress=False)
    assert e.value.kind == ErrorKind.CHECKPOINT and "31" in str(e.value)
    with pytest.raises(SlackTierError) as e:
        stage_checkpoint(tmp_path / "nope.safetensors", [tmp_path / "t.bin"], ranks=1, progress=False)
    assert e.value.kind == ErrorKind.MISSING
    _untouched(tmp_path, {"c.safetensors"})


def _losetup(backing: Path) -> str | None:
    if os.geteuid() != 0 or shutil.which("losetup") is None:
        return None
    res = subprocess.run(["losetup", "-f", "--show", str(backing)], capture_output=True, text=True)
    return res.stdout.strip() if res.returncode == 0 else None


def test_block_device_target(tmp_path):
    backing = tmp_path / "disk.img"
    with open(backing, "wb") as f:
        f.truncate(64 * PAGE_BYTES)
    dev = _losetup(backing)
    if dev is None:
        pytest.skip("no loop device (needs root and losetup)")
    try:
        # 63 pages of rows + the header page = 64 pages fits; one row more does not
        with pytest.raises(SlackTierError) as e:
            stage_synthetic([dev], {1: 63 * ROWS_PER_PAGE + 1}, ranks=1, seed=0, manifest_path=tmp_path / "m.json",
                            progress=False)
        assert e.value.kind == ErrorKind.TARGET and "block device" in str(e.value)
        assert not backing.read_bytes().strip(b"\x00")
        with pytest.raises(SlackTierError) as e:  # no room for a manifest beside /dev/loopN
            stage_synthetic([dev], {1: 30}, ranks=1, seed=0, progress=False)
        assert "--manifest" in str(e.value)
        m = stage_synthetic([dev], {1: 63 * ROWS_PER_PAGE}, ranks=1, seed=0, manifest_path=tmp_path / "m.json",
                            progress=False)
        assert verify_table(m, progress=False).ok
        got = _read_region_rows(m.regions[0])
        assert np.array_equal(got, codec.synthetic_rows(int(layer_seed(0, 1)), 0, 63 * ROWS_PER_PAGE))
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)


def test_direct_io_refuses_unaligned_buffers_and_logs_buffered(tmp_path, caplog):
    path = str(tmp_path / "f.bin")
    with odirect.DirectFile(path, write=True, create=True) as f:
        with pytest.raises(SlackTierError) as e:
            f.pwrite(np.zeros(4096, dtype=np.uint8)[1:4097 - 1], 0)
        assert e.value.kind == ErrorKind.IO
        buf = odirect.aligned_array(2 * PAGE_BYTES)
        buf[:] = 7
        f.pwrite(buf, PAGE_BYTES)
        back = odirect.aligned_array(PAGE_BYTES)
        f.pread_into(back, 2 * PAGE_BYTES)
        assert (back == 7).all()
        with pytest.raises(SlackTierError) as e:
            f.pread_into(odirect.aligned_array(PAGE_BYTES), 3 * PAGE_BYTES)  # past the end: short read
        assert e.value.kind == ErrorKind.IO
    count = odirect.BUFFERED_OPENS
    with caplog.at_level(logging.WARNING):
        m = stage_synthetic([tmp_path / "t.bin"], {1: 30}, ranks=1, seed=0, buffered=True, progress=False)
    assert odirect.BUFFERED_OPENS == count + 1 and "WITHOUT O_DIRECT" in caplog.text
    assert verify_table(m, progress=False).ok


def test_manifest_is_json_beside_the_data(tmp_path):
    m = stage_synthetic([tmp_path / "t.bin"], {1: 30}, ranks=1, seed=0, progress=False)
    d = json.loads(Path(m.path).read_text())
    assert d["format"] == "slacktier-table" and d["checksums"]["algorithm"] == "crc32c"
    assert (tmp_path / d["checksums"]["file"]).stat().st_size == 4 * m.total_pages
    assert d["source"]["kind"] == "synthetic" and d["source"]["digest"].startswith("sha256:")
    with pytest.raises(SlackTierError) as e:
        Manifest.load(tmp_path / "missing.json")
    assert e.value.kind == ErrorKind.MISSING


def test_stage_an_engram_layout_object(tmp_path):
    engram_hash = pytest.importorskip("slacktier.tables.engram_hash")
    layout = engram_hash.EngramLayout.scaled(1000)
    m = stage_synthetic([tmp_path / "t.bin"], layout, ranks=4, seed=2, progress=False)
    assert m.layout.layer_ids == tuple(layout.layer_ids)
    for i, layer in enumerate(layout.layer_ids):
        bounds = tuple(layout.column_bounds(i))
        assert m.layout.rows[layer] == bounds[-1] and m.layout.column_bounds[layer] == bounds
        # 24 hash columns over 4 ranks: each rank owns 6 whole columns
        assert [m.region(layer, k).row_start for k in range(4)] == [bounds[6 * k] for k in range(4)]
    assert verify_table(m, rows_per_region=20, check_pages=False, progress=False).ok


def test_staged_layout_from_either_hash_layout():
    from slacktier.tables.engram_hash import EngramLayout
    from slacktier.tables.ple_hash import PleLayout
    from slacktier.tables.stage import staged_layout

    engram, ple = EngramLayout.scaled(1000), PleLayout.scaled(1000, layer_id=3)
    for layout in (engram, ple):
        staged = StagedLayout.from_layout(layout)
        assert staged.layer_ids == tuple(sorted(layout.layer_ids))
        for layer in layout.layer_ids:
            bounds = layout.layer_column_bounds(layer)
            assert len(bounds) == layout.n_columns + 1
            assert staged.rows[layer] == layout.layer_rows(layer) == bounds[-1]
            assert staged.column_bounds[layer] == bounds
        assert staged_layout(layout) == staged
    assert StagedLayout.from_layout(ple).rows == {3: ple.rows}
    assert staged_layout({1: 30}, {1: (0, 10, 30)}) == StagedLayout({1: 30}, {1: (0, 10, 30)})
    with pytest.raises(SlackTierError) as e:
        staged_layout(engram, {1: (0, 10)})
    assert e.value.kind == ErrorKind.BAD_INPUT
    with pytest.raises(SlackTierError):
        engram.layer_rows(2)   # a layer id, not a position
    with pytest.raises(SlackTierError):
        ple.layer_rows(1)


@pytest.mark.parametrize("writers,fillers", [(3, 1), (4, 2)])
def test_parallel_writers_write_the_same_bytes(tmp_path, writers, fillers):
    # small chunks -> dozens of chunks, so several O_DIRECT writes really are in flight at once
    layers = {1: 3000, 14: 2111}
    one = stage_synthetic([tmp_path / "one.bin"], layers, ranks=2, seed=5, progress=False,
                          chunk_bytes=4 * PAGE_BYTES, writers=1, fillers=1)
    many = stage_synthetic([tmp_path / "many.bin"], layers, ranks=2, seed=5, progress=False,
                           chunk_bytes=4 * PAGE_BYTES, writers=writers, fillers=fillers)
    # past the header page, whose stage_id names each run
    assert (tmp_path / "one.bin").read_bytes()[TARGET_HEADER_BYTES:] == \
        (tmp_path / "many.bin").read_bytes()[TARGET_HEADER_BYTES:]
    assert one.crc_path().read_bytes() == many.crc_path().read_bytes()
    for r in many.regions:
        want = codec.synthetic_rows(int(layer_seed(5, r.layer)), r.row_start, r.rows)
        assert np.array_equal(_read_region_rows(r), want), (r.layer, r.rank)
    assert verify_table(many.path, rows_per_region=20, progress=False).ok


def test_refuses_zero_writers_or_fillers_before_writing(tmp_path):
    for kw in ({"writers": 0}, {"fillers": 0}):
        with pytest.raises(SlackTierError) as e:
            stage_synthetic([tmp_path / "t.bin"], {1: 100}, ranks=1, seed=1, progress=False, **kw)
        assert e.value.kind == ErrorKind.BAD_INPUT
        assert not (tmp_path / "t.bin").exists()


class _FailingFile:
    """A fake target whose write at one offset fails like a dying disk."""

    def __init__(self, bad_offset: int) -> None:
        self.bad_offset = bad_offset
        self.written: list[int] = []

    def pwrite(self, buf: np.ndarray, offset: int) -> None:
        if offset == self.bad_offset:
            raise SlackTierError(ErrorKind.IO, f"write at {offset} failed", fix="replace the disk")
        self.written.append(offset)


def test_a_write_error_in_any_writer_thread_reaches_the_caller():
    from slacktier.tables.page_writer import _Writer

    target = _FailingFile(bad_offset=5 * PAGE_BYTES)
    w = _Writer([target], n_buffers=4, chunk_bytes=PAGE_BYTES, n_threads=3)
    with pytest.raises(SlackTierError, match="write at 20480 failed"):
        for i in range(40):
            buf = w.take()
            w.put(0, buf, PAGE_BYTES, i * PAGE_BYTES)
        w.finish()
    if any(t.is_alive() for t in w.threads):
        with pytest.raises(SlackTierError):
            w.finish()
    assert 5 * PAGE_BYTES not in target.written


# ------------------------------------------------------------------ open-time identity checks (issue 11)

def test_check_target_header_passes_the_untouched_table(tmp_path):
    targets = [tmp_path / "a.bin", tmp_path / "b.bin"]
    m = stage_synthetic(targets, {1: 300, 14: 200}, ranks=2, seed=1, progress=False)
    for d, t in enumerate(m.targets):
        check_target_header(t, d, m.identity)
        header = parse_header(Path(t).read_bytes()[:TARGET_HEADER_BYTES])
        assert header["state"] == "complete" and header["stage_id"] == m.stage_id and header["device"] == d
        assert header["source_digest"] == m.source_digest and header["targets"] == 2
        assert header["target_bytes"] == m.target_need_bytes()[d] == os.path.getsize(t)
    m.check_targets()
    Manifest.load(m.path).check_targets()
    # the device index is checked: b.bin is device 1, not 0
    with pytest.raises(SlackTierError) as e:
        check_target_header(m.targets[1], 0, m.identity)
    assert e.value.kind == ErrorKind.TARGET and "device 1" in str(e.value) and m.targets[1] in str(e.value)


def test_a_restage_of_another_table_fails_the_old_manifest(tmp_path):
    target = tmp_path / "t.bin"
    first = stage_synthetic([target], {1: 300}, ranks=1, seed=1, progress=False)
    other = stage_synthetic([target], {1: 300}, ranks=1, seed=2, overwrite=True, progress=False,
                            manifest_path=tmp_path / "other.json")
    with pytest.raises(SlackTierError) as e:
        check_target_header(target, 0, first.identity)
    assert e.value.kind == ErrorKind.TARGET and "another table" in str(e.value) and str(target) in str(e.value)
    check_target_header(target, 0, other.identity)
    # an old manifest without a stage_id still catches another table by its digest
    with pytest.raises(SlackTierError):
        check_target_header(target, 0, TableIdentity(first.source_digest, ""))
    report = verify_table(first, rows_per_region=0, check_pages=False, progress=False)
    assert [x.kind for x in report.mismatches] == ["header"]


def test_the_stage_id_is_derived_from_the_content_not_drawn_per_run(tmp_path):
    """The same source staged again (here, or onto other targets) keeps its stage id and the old manifest still
    opens the target; other rows or another geometry give another id, and the old manifest is refused."""
    target = tmp_path / "t.bin"
    first = stage_synthetic([target], {1: 300}, ranks=1, seed=1, progress=False)
    again = stage_synthetic([target], {1: 300}, ranks=1, seed=1, progress=False,
                            manifest_path=tmp_path / "again.json")
    assert again.identity == first.identity
    check_target_header(target, 0, first.identity)
    elsewhere = stage_synthetic([tmp_path / "u.bin"], {1: 300}, ranks=1, seed=1, progress=False)
    assert elsewhere.identity == first.identity
    ranks2 = stage_synthetic([tmp_path / "v.bin"], {1: 300}, ranks=2, seed=1, progress=False)
    assert ranks2.source_digest == first.source_digest and ranks2.stage_id != first.stage_id
    other = stage_synthetic([target], {1: 300}, ranks=1, seed=2, progress=False, overwrite=True,
                            manifest_path=tmp_path / "other.json")
    assert other.stage_id != first.stage_id
    with pytest.raises(SlackTierError) as e:
        check_target_header(target, 0, first.identity)
    assert e.value.kind == ErrorKind.TARGET
    check_target_header(target, 0, other.identity)
    # an identity without a stage_id (a manifest from before stage ids) checks the digest only
    check_target_header(target, 0, TableIdentity(other.source_digest, ""))


def test_an_interrupted_restage_leaves_every_target_staging(tmp_path):
    targets = [tmp_path / "a.bin", tmp_path / "b.bin"]
    first = stage_synthetic(targets, {1: 3000, 14: 3000}, ranks=2, seed=1, progress=False)
    layout = StagedLayout.from_rows({1: 3000, 14: 3000})
    with pytest.raises(RuntimeError, match="row source failed"):
        stage_table(FailingSource(layout, 2, fail_after=3), targets, 2, overwrite=True, progress=False,
                    chunk_bytes=4 * PAGE_BYTES, fillers=1, writers=1, manifest_path=tmp_path / "new.json")
    assert not (tmp_path / "new.json").exists()
    for d, t in enumerate(first.targets):
        header = parse_header(Path(t).read_bytes()[:TARGET_HEADER_BYTES])
        assert header["state"] == "staging" and header["stage_id"] != first.stage_id
        with pytest.raises(SlackTierError) as e:
            check_target_header(t, d, first.identity)
        assert e.value.kind == ErrorKind.TARGET and t in str(e.value)
        # even with the new table's own identity, a half-written target is refused
        new_identity = TableIdentity(header["source_digest"], header["stage_id"])
        with pytest.raises(SlackTierError) as e:
            check_target_header(t, d, new_identity)
        assert "'staging'" in str(e.value) and "did not finish" in str(e.value)
    assert not verify_table(first, rows_per_region=0, check_pages=False, progress=False).ok


def test_a_staging_header_alone_is_refused(tmp_path):
    target = tmp_path / "t.bin"
    m = stage_synthetic([target], {1: 300}, ranks=1, seed=1, progress=False)
    with open(target, "r+b") as f:
        f.write(header_page(m.source_digest, 0, 1, "staging", m.stage_id, m.target_need_bytes()[0]).tobytes())
    with pytest.raises(SlackTierError) as e:
        check_target_header(target, 0, m.identity)
    assert e.value.kind == ErrorKind.TARGET and "staging" in str(e.value)


def test_a_truncated_or_foreign_target_is_refused(tmp_path):
    target = tmp_path / "t.bin"
    m = stage_synthetic([target], {1: 300}, ranks=1, seed=1, progress=False)
    need = m.target_need_bytes()[0]
    os.truncate(target, need - PAGE_BYTES)
    for kwargs in ({}, {"need_bytes": need}):
        with pytest.raises(SlackTierError) as e:
            check_target_header(target, 0, m.identity, **kwargs)
        assert e.value.kind == ErrorKind.TARGET and "truncated" in str(e.value) and str(target) in str(e.value)
    os.truncate(target, 100)  # not even a whole header page
    with pytest.raises(SlackTierError) as e:
        check_target_header(target, 0, m.identity)
    assert e.value.kind == ErrorKind.TARGET and "no SlackTier header" in str(e.value)
    target.write_bytes(b"\x00" * (2 * PAGE_BYTES))
    with pytest.raises(SlackTierError) as e:
        check_target_header(target, 0, m.identity)
    assert e.value.kind == ErrorKind.TARGET
    with pytest.raises(SlackTierError) as e:
        check_target_header(tmp_path / "gone.bin", 0, m.identity)
    assert e.value.kind == ErrorKind.MISSING


def test_old_manifests_without_stage_id_load(tmp_path):
    m = stage_synthetic([tmp_path / "t.bin"], {1: 30}, ranks=1, seed=1, progress=False)
    d = json.loads(Path(m.path).read_text())
    del d["stage_id"]
    d["manifest_digest"] = manifest_digest(d)   # as `slacktier verify --redigest` records it for an old manifest
    Path(m.path).write_text(json.dumps(d))
    old = Manifest.load(m.path)
    assert old.identity == TableIdentity(m.source_digest, "")
    old.check_targets()


@pytest.mark.parametrize("content", [None, b"\x00\xff\xfe binary", b"[1, 2]", b'{"format": "slacktier-table", '
                                     b'"format_version": 1}'])
def test_manifest_load_refuses_what_is_not_a_manifest(tmp_path, content):
    p = tmp_path / "m.json"
    if content is None:
        p.mkdir()
    else:
        p.write_bytes(content)
    with pytest.raises(SlackTierError) as e:
        Manifest.load(p)
    assert e.value.kind == ErrorKind.BAD_INPUT and str(p) in str(e.value)


def test_refuses_a_manifest_in_a_missing_directory_before_writing(tmp_path):
    with pytest.raises(SlackTierError) as e:
        stage_synthetic([tmp_path / "t.bin"], {1: 30}, ranks=1, seed=0, progress=False,
                        manifest_path=tmp_path / "nope" / "m.json")
    assert e.value.kind == ErrorKind.TARGET and "does not exist" in str(e.value)
    _untouched(tmp_path, set())


# ------------------------------------------------------------------ malformed safetensors headers (issue 11)

def _raw_safetensors(path: Path, header: object, data: bytes = b"", length: int | None = None) -> None:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(body) if length is None else length
    path.write_bytes(n.to_bytes(8, "little") + body + data)


_W, _S = "layers.1.engram.embed.weight", "layers.1.engram.embed.scale"


def _good_header(rows: int = 2) -> tuple[dict, bytes]:
    w = rows * 256
    return ({_W: {"dtype": "F8_E4M3", "shape": [rows, 256], "data_offsets": [0, w]},
             _S: {"dtype": "F8_E8M0", "shape": [rows, 8], "data_offsets": [w, w + rows * 8]}},
            bytes(rows * 264))


def _with(tensor: str, **fields) -> tuple[dict, bytes]:
    header, data = _good_header()
    header[tensor] = {**header[tensor], **fields}
    for k, v in fields.items():
        if v is None:
            del header[tensor][k]
    return header, data


@pytest.mark.parametrize("case,header,data,length,expect", [
    ("list header", [1, 2, 3], b"", None, "not an object"),
    ("non-JSON header", b"{not json", b"", None, "not JSON"),
    ("binary header", b"\xff\xfe\x00", b"", None, "not JSON"),
    ("header length beyond the file", b"{}", b"", 1 << 20, "runs past the end"),
    ("tensor not an object", {_W: [0, 1]}, b"", None, f"tensor {_W}"),
    ("missing data_offsets", *_with(_W, data_offsets=None), None, f"tensor {_W}"),
    ("reversed data_offsets", *_with(_W, data_offsets=[512, 0]), None, f"tensor {_W}"),
    ("negative data_offsets", *_with(_S, data_offsets=[-8, 16]), None, f"tensor {_S}"),
    ("short data_offsets", *_with(_S, data_offsets=[512]), None, f"tensor {_S}"),
    ("negative shape", *_with(_W, shape=[-2, 256]), None, f"tensor {_W}"),
    ("float shape", *_with(_W, shape=[2.0, 256]), None, f"tensor {_W}"),
    ("shape larger than its data", *_with(_W, shape=[3, 256]), None, f"tensor {_W}"),
    ("scale larger than its data", *_with(_S, shape=[2, 9]), None, f"tensor {_S}"),
    ("data past the end", *_with(_S, data_offsets=[512, 600]), None, f"tensor {_S}"),
    ("missing dtype", *_with(_S, dtype=None), None, f"tensor {_S}"),
])
def test_refuses_a_malformed_safetensors_header(tmp_path, case, header, data, length, expect):
    ckpt = tmp_path / "c.safetensors"
    _raw_safetensors(ckpt, header, data, length)
    with pytest.raises(SlackTierError) as e:
        stage_checkpoint(ckpt, [tmp_path / "t.bin"], ranks=1, progress=False)
    assert e.value.kind == ErrorKind.CHECKPOINT, case
    assert expect in str(e.value) and str(ckpt) in str(e.value), str(e.value)
    _untouched(tmp_path, {"c.safetensors"})


def test_a_well_formed_raw_header_stages(tmp_path):
    ckpt = tmp_path / "c.safetensors"
    header, data = _good_header()
    _raw_safetensors(ckpt, {"__metadata__": {"format": "pt"}, **header}, data)
    m = stage_checkpoint(ckpt, [tmp_path / "t.bin"], ranks=1, progress=False)
    assert m.layout.rows == {1: 2} and verify_table(m, progress=False).ok


def test_refuses_a_tensor_in_two_checkpoint_files(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    _checkpoint(d / "a.safetensors", {1: 30})
    _checkpoint(d / "b.safetensors", {1: 30}, seed=1)
    with pytest.raises(SlackTierError) as e:
        stage_checkpoint(d, [tmp_path / "t.bin"], ranks=1, progress=False)
    assert e.value.kind == ErrorKind.CHECKPOINT and "in both" in str(e.value)
