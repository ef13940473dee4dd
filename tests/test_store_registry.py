"""The tier registry: every registered tier (built-ins and the tests' own `memfile`) against real staged files.

The completeness test runs each tier through the whole interface: random
pages compared with plain os.pread of the staged file, a corrupted page caught
by the manifest's checksums, close refusing work, and the tier's options
struct known to the control-file schema. `tier_memfile` (in this folder)
shows that a tier is one file: nothing in the package knows its name.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
import tier_memfile  # registers the "memfile" tier
from tier_memfile import MemfileOptions, MemfileSource

from slacktier import config
from slacktier.config import Options, RedisOptions
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store import PageBufferPool, PageReads, PageSource, get_tier, open_source, register_tier, tiers
from slacktier.store.dram import DramSource
from slacktier.store.queued import QueuedSource
from slacktier.store.redis.loader import load_table
from slacktier.testing.store import stage_synthetic
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.regions import Region

Setup = Callable[[Sequence[Region], str], tuple[list[Region], Options | None]]


@pytest.fixture(scope="module")
def staged(o_direct_module_dir):
    # 2 layers x 2 ranks on 2 devices (files), 200 rows = 14 pages per region.
    return stage_synthetic(o_direct_module_dir / "intact", layers=(1, 14), ranks=2, rows=200, devices=2)


def _setup_for(name: str, request: pytest.FixtureRequest) -> Setup:
    """How tier `name` is opened over staged file regions: as they are, with default options, unless it keeps
    its pages elsewhere (Redis: loaded into a real redis-server first)."""
    if name == "redis":   # standalone mode here; cluster mode runs the same tier in test_store_redis_cluster.py
        server = request.getfixturevalue("redis_server")
        staged = request.getfixturevalue("staged")

        def to_redis(regions: Sequence[Region], tag: str) -> tuple[list[Region], Options | None]:
            # The loader checks every staged page against the manifest: a corrupted file is refused here.
            options = RedisOptions(url=server.url, prefix=f"reg-{tag}")
            load_table(options, regions, staged.manifest.identity, page_crc32c=_checksums(staged), tag_buckets=4)
            return list(regions), options
        return to_redis
    return lambda regions, tag: (list(regions), None)


def _checksums(staged) -> list[np.ndarray]:
    """The manifest's page CRC32Cs, split per region (manifest order = region order)."""
    sums = staged.manifest.checksums()
    bounds = np.cumsum([0] + [r.pages for r in staged.specs])
    return [sums[bounds[i]:bounds[i + 1]] for i in range(len(staged.specs))]


def _pread_page(region: Region, page: int) -> np.ndarray:
    fd = os.open(region.path, os.O_RDONLY)
    try:
        data = os.pread(fd, PAGE_BYTES, region.offset_bytes + page * PAGE_BYTES)
    finally:
        os.close(fd)
    assert len(data) == PAGE_BYTES
    return np.frombuffer(data, dtype=np.uint8)


def test_the_built_in_tiers_and_the_test_tier_are_registered():
    assert {"dram", "disk", "redis", "memfile"} <= set(tiers())
    assert get_tier("memfile").source_cls is MemfileSource
    assert set(tiers()) <= set(config.tier_names())


@pytest.mark.parametrize("name", tiers())
def test_every_registered_tier_reads_checks_and_closes(name, staged, request, o_direct_module_dir):
    tier = get_tier(name)
    assert config.tier_options_type(name) is tier.options_cls
    assert issubclass(tier.source_cls, PageSource) and not inspect.isabstract(tier.source_cls)
    params = list(inspect.signature(tier.source_cls.__init__).parameters.values())[1:]
    assert [p.name for p in params[:4]] == ["regions", "options", "page_crc32c", "identity"]
    assert params[2].kind is params[3].kind is inspect.Parameter.KEYWORD_ONLY
    assert isinstance(tier.source_cls.verify_by_default, bool)
    assert tier.source_cls.verify_identity.__func__ is not PageSource.verify_identity.__func__
    setup = _setup_for(name, request)

    # Random pages, bit for bit against plain os.pread of the staged files.
    regions, options = setup(staged.specs, f"{name}-intact")
    src = open_source(name, regions, options)
    try:
        rng = np.random.default_rng(11)
        n = 120
        region = rng.integers(0, len(regions), n).astype(np.int32)
        page = np.array([rng.integers(0, regions[r].pages) for r in region], dtype=np.int64)
        reads = PageReads(region, page, rng.permutation(n).astype(np.int32))
        pool = PageBufferPool(n)
        pool.pages[:] = 0xA5
        stats = src.wait(src.submit(reads, pool))
        assert stats.pages == n
        for i in range(n):
            want = _pread_page(staged.specs[reads.region[i]], int(reads.page[i]))
            assert np.array_equal(pool.pages[reads.buffer[i]], want), (name, i)
    finally:
        src.close()

    # Close refuses work.
    with pytest.raises(SlackTierError) as info:
        src.submit(reads, pool)
    assert info.value.kind is ErrorKind.CLOSED

    # A corrupted page: one byte flipped in a copy of the staged files; the manifest's checksums catch it.
    copy_dir = o_direct_module_dir / f"corrupt-{name}"
    copy_dir.mkdir()
    paths = {r.path: str(copy_dir / Path(r.path).name) for r in staged.specs}
    for old, new in paths.items():
        shutil.copyfile(old, new)
    bad = staged.specs[3]
    with open(paths[bad.path], "r+b") as f:
        f.seek(bad.offset_bytes + 5 * PAGE_BYTES + 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    corrupt = [dataclasses.replace(r, path=paths[r.path]) for r in staged.specs]
    if name == "redis":  # its loader checks every page before it counts: the corrupted one never gets in
        with pytest.raises(SlackTierError) as info:
            setup(corrupt, f"{name}-corrupt")
        assert info.value.kind is ErrorKind.CHECKSUM
        assert (info.value.layer, info.value.rank, info.value.page) == (bad.layer, bad.rank, 5)
        return
    regions, options = setup(corrupt, f"{name}-corrupt")
    if name == "dram":  # DRAM checks every page once, when it loads them (store/dram.py)
        with pytest.raises(SlackTierError) as info:
            open_source(name, regions, options, page_crc32c=_checksums(staged))
        assert info.value.kind is ErrorKind.CHECKSUM
        assert (info.value.layer, info.value.rank, info.value.page) == (bad.layer, bad.rank, 5)
        return
    src = open_source(name, regions, options, page_crc32c=_checksums(staged))
    try:
        pool = PageBufferPool(3)
        intact = PageReads(np.array([0, 3], np.int32), np.array([5, 4], np.int64), np.array([0, 1], np.int32))
        src.wait(src.submit(intact, pool))
        broken = PageReads(np.array([0, 3, 1], np.int32), np.array([5, 5, 2], np.int64), np.arange(3, dtype=np.int32))
        with pytest.raises(SlackTierError) as info:
            src.wait(src.submit(broken, pool))
        assert info.value.kind is ErrorKind.CHECKSUM
        assert (info.value.layer, info.value.rank, info.value.page) == (bad.layer, bad.rank, 5)
    finally:
        src.close()


def test_a_tier_name_is_taken_once():
    register_tier("memfile", MemfileSource, MemfileOptions)  # the same pair again: a no-op
    with pytest.raises(SlackTierError, match="already registered"):
        register_tier("memfile", DramSource, MemfileOptions)
    with pytest.raises(SlackTierError, match="already registered"):
        register_tier("disk", MemfileSource, MemfileOptions)
    with pytest.raises(SlackTierError, match="not a concrete PageSource"):
        register_tier("half", QueuedSource, MemfileOptions)

    class Unchecked(MemfileSource):  # reads fine, but inherits PageSource's refusing verify_identity
        verify_identity = classmethod(PageSource.verify_identity.__func__)  # type: ignore[attr-defined]

    with pytest.raises(SlackTierError, match="does not implement verify_identity"):
        register_tier("unchecked", Unchecked, MemfileOptions)
    assert "half" not in tiers() and "unchecked" not in tiers()


def test_a_control_file_names_the_test_tier_and_round_trips(staged, tmp_path):
    text = f"""
[engine]
cache_rows = 0

[[table]]
layer = 14
manifest = "{staged.manifest.path}"
source = "memfile"

[table.memfile]
advise_random = false
"""
    cfg = config.parse_control(text, tmp_path / "ctl.toml")
    table = cfg.table(14)
    assert table.source == "memfile" and table.options == MemfileOptions(advise_random=False)
    again = config.parse_control(config.dump_control(cfg), tmp_path / "ctl.toml")
    assert again == cfg
    assert "[table.memfile]" in config.dump_control(cfg)
    with pytest.raises(SlackTierError, match="advise_random"):
        config.parse_control(text.replace("false", '"no"'), tmp_path / "ctl.toml")

    # The tier named by the control file reads the table bit-exactly through the registry.
    regions = staged.manifest.runtime_regions(layer=14)
    src = open_source(table.source, regions, table.options)
    try:
        want_regions = [i for i, r in enumerate(staged.specs) if r.layer == 14]
        pairs = [(i, p) for i, r in enumerate(regions) for p in range(r.pages)]
        reads = PageReads(np.array([i for i, _ in pairs], np.int32), np.array([p for _, p in pairs], np.int64),
                          np.arange(len(pairs), dtype=np.int32))
        pool = PageBufferPool(len(pairs))
        src.wait(src.submit(reads, pool))
        for k, (i, p) in enumerate(pairs):
            assert np.array_equal(pool.pages[k], staged.pages[want_regions[i]][p])
    finally:
        src.close()


def test_the_step_engine_serves_a_table_from_the_test_tier(o_direct_dir):
    """A table on the test tier gathers bit for bit what the same table on DRAM gathers.

    Needs the engine's control path (StepEngine.from_control over slacktier.config); written while
    the lead rewrites the engine, so it may fail until that lands.
    """
    torch = pytest.importorskip("torch")
    from slacktier.engine import StepEngine
    from slacktier.tables.engram_hash import EngramLayout
    from slacktier.tables.stage import stage_synthetic as stage_table

    layout = EngramLayout.scaled(engram_vocab_size=2000)
    manifest = stage_table([o_direct_dir / "t.bin"], layout, ranks=2, seed=0, overwrite=True)
    engines = {}
    for source in ("memfile", "dram"):
        path = o_direct_dir / f"{source}.toml"
        path.write_text(f"""[engine]
cache_rows = 2000
[[table]]
layer = 1
source = "{source}"
manifest = "{manifest.path}"
cache_share = 0.5
order = 0
[[table]]
layer = 14
source = "{source}"
manifest = "{manifest.path}"
cache_share = 0.5
order = 1
""")
        engines[source] = StepEngine.from_control(path)
    try:
        rng = np.random.default_rng(0)
        layers = list(layout.layer_ids)
        tokens = 48
        bounds = [np.asarray(layout.layer_column_bounds(layer)) for layer in layers]
        columns = bounds[0].shape[0] - 1
        ids = np.empty((tokens, len(layers), columns), dtype=np.int64)  # [T, L, C] row ids, column c in its range
        for li, b in enumerate(bounds):
            for c in range(columns):
                ids[:, li, c] = rng.integers(b[c], b[c + 1], tokens)
        for step in range(2):  # the second step hits the cache
            out = {}
            for name, engine in engines.items():
                engine.begin_step(ids)
                out[name] = [engine.gather(layer) for layer in layers]
                engine.end_step()
            for a, b in zip(out["memfile"], out["dram"], strict=True):
                assert torch.equal(a.view(torch.int16), b.view(torch.int16)), step
    finally:
        for engine in engines.values():
            engine.close()


def test_tier_memfile_is_outside_the_package():
    assert Path(tier_memfile.__file__).parent == Path(__file__).parent
