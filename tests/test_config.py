"""The control file as data: parse, validate, dump, round trip; strict types."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slacktier.config import (ControlFile, DiskOptions, DramOptions, EngineConfig, RedisOptions,
                              TableConfig,
                              dump_control, load_control, parse_control, tier_names, write_control)
from slacktier.errors import ErrorKind, SlackTierError

TABLE = '[[table]]\nlayer = 1\nmanifest = "/t/m.json"\ncache_share = 0.5\n'


def _err(text: str) -> SlackTierError:
    with pytest.raises(SlackTierError) as info:
        parse_control(text)
    assert info.value.kind is ErrorKind.BAD_INPUT
    return info.value


def test_defaults_and_tier_options():
    cfg = parse_control(TABLE + '[table.disk]\nqueue_depth = 64\n')
    t = cfg.table(1)
    assert t.source == "disk" and t.options == DiskOptions(queue_depth=64)
    assert cfg.engine == EngineConfig() and cfg.engine.wait_timeout_ms > 0
    assert parse_control(TABLE + 'source = "dram"\n').table(1).options == DramOptions()


def test_relative_paths_resolve_against_the_control_files_folder(tmp_path):
    (tmp_path / "c.toml").write_text('[[table]]\nlayer = 1\nmanifest = "m.json"\nseen = "s.npy"\n')
    t = load_control(tmp_path / "c.toml").table(1)
    assert t.manifest == str(tmp_path / "m.json") and t.seen == str(tmp_path / "s.npy")


@pytest.mark.parametrize("text, says", [
    ('[engine]\nlossy = "false"\n' + TABLE, "Expected `bool`, got `str` - at `$.lossy`"),
    ('[engine]\ncheck = "false"\n' + TABLE, "$.check"),
    ('[engine]\nverify_reads = "false"\n' + TABLE, "$.verify_reads"),
    ('[engine]\nverify_reads = "always"\n' + TABLE, "$.verify_reads"),
    ('[engine]\ncache_rows = 1e11\n' + TABLE, "Expected `int`, got `float`"),
    ('[engine]\ncache_rows = "100"\n' + TABLE, "Expected `int`, got `str`"),
    ('[engine]\ncache_rows = 100000000000\n' + TABLE, "$.cache_rows"),
    ('[engine]\ncache_rows = 10\n[[table]]\nlayer = 1\nmanifest = "m"\n', "every cache_share is 0"),
    ('[engine]\ncache_rows = 10\nmax_cache_rows = 5\n' + TABLE, "above max_cache_rows"),
    ('[engine]\ndevice = "tpu"\n' + TABLE, "device 'tpu'"),
    ('[engine]\nwait_timeout_ms = 0\n' + TABLE, "wait_timeout_ms"),
    ('[engine]\nwait_timeout_ms = inf\n' + TABLE, "<= 86400000.0 - at `$.wait_timeout_ms`"),
    ('[engine]\nwait_timeout_ms = 1e13\n' + TABLE, "<= 86400000.0 - at `$.wait_timeout_ms`"),
    ('[engine]\nbogus = 1\n' + TABLE, "bogus"),
    ("[other]\n" + TABLE, "unknown section `other`"),
    (TABLE + 'cache_share = 1.5\n'.replace("cache_share", "order = 0\nx"), "x"),
    ('[[table]]\nlayer = 1\nmanifest = "m"\ncache_share = 1.5\n', "$.cache_share"),
    (TABLE + TABLE, "listed twice"),
    (TABLE + '[[table]]\nlayer = 2\nmanifest = "m"\ncache_share = 0.6\n', "above 1"),
    ('[[table]]\nlayer = 1\nmanifest = ""\n', "no manifest"),
    ('[[table]]\nlayer = 1\n', "manifest"),
    (TABLE + 'source = "tape"\n', "unknown tier 'tape'"),
    (TABLE + '[table.redis]\nurl = "redis://x"\n', "put options under [table.disk]"),
    (TABLE + '[table.disk]\nengine = "aio"\n', "$.engine"),
    (TABLE + '[table.disk]\nqueue_depth = 0\n', "$.queue_depth"),
    ("[engine\n", "is not TOML"),
])
def test_bad_control_files_name_the_key(text, says):
    assert says in str(_err(text))


def test_no_tables_is_refused():
    assert "no [[table]]" in str(_err("[engine]\ncache_rows = 0\n"))


def test_tables_are_kept_in_window_order():
    cfg = parse_control('[[table]]\nlayer = 14\nmanifest = "m"\norder = 1\n'
                        '[[table]]\nlayer = 1\nmanifest = "m"\norder = 0\n')
    assert [t.layer for t in cfg.tables] == [1, 14]


def test_replace_validates_again():
    cfg = parse_control(TABLE)
    assert cfg.replace(cache_rows=7).engine.cache_rows == 7
    with pytest.raises(SlackTierError):
        cfg.replace(cache_rows=-1)


def test_write_is_atomic_and_reads_back(tmp_path):
    cfg = parse_control(TABLE)
    p = write_control(cfg, tmp_path / "sub" / "c.toml", comment="line one\n\nline two")
    text = p.read_text()
    assert text.startswith("# line one\n#\n# line two\n")
    assert load_control(p) == cfg
    assert [f.name for f in (tmp_path / "sub").iterdir()] == ["c.toml"]


_names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)


def _a_host(n: str) -> bool:
    """A url host part RedisOptions takes: no "@" (userinfo), no "password=" (a secret), a host and port it
    can read (issue 33: a port that is not a number, or a broken IPv6 literal, is refused at load)."""
    try:
        RedisOptions(url="redis://" + n)
    except SlackTierError:
        return False
    return True


_hosts = _names.map(lambda n: n.replace("@", "")).filter(_a_host)
_options = st.one_of(
    st.builds(DramOptions),
    st.builds(DiskOptions, engine=st.sampled_from(["auto", "io_uring", "threads"]),
              queue_depth=st.integers(1, 4096), io_threads=st.integers(1, 64)),
    st.builds(RedisOptions, url=_hosts.map(lambda n: "redis://" + n), prefix=_names,
              username=_names, password_env=_names),
    st.builds(RedisOptions, mode=st.just("cluster"), url=_hosts.map(lambda n: "rediss://" + n), prefix=_names,
              password_file=_names, tls_ca_file=_names, read_from_replicas=st.booleans()),
)


@st.composite
def _control(draw) -> ControlFile:
    layers = draw(st.lists(st.integers(0, 100), min_size=1, max_size=4, unique=True))
    shares = [draw(st.floats(0, 1 / len(layers), allow_nan=False)) for _ in layers]
    tables = []
    for layer, share in zip(layers, shares):
        options = draw(_options)
        source = {DramOptions: "dram", DiskOptions: "disk", RedisOptions: "redis"}[type(options)]
        tables.append(TableConfig(layer=layer, manifest="/m/" + draw(_names), source=source, options=options,
                                  rank=draw(st.integers(-1, 8)), targets=tuple(draw(st.lists(_names, max_size=2))),
                                  cache_share=share, order=draw(st.integers(-3, 3)), seen=draw(_names)))
    cache = draw(st.integers(0, 10**9)) if sum(shares) > 0 else 0
    engine = EngineConfig(device=draw(st.sampled_from(["cpu", "cuda", "cuda:1"])), cache_rows=cache,
                          max_cache_rows=draw(st.integers(cache, 2**31 - 1)),
                          max_tokens=draw(st.integers(1, 1 << 20)),
                          wait_timeout_ms=draw(st.floats(0.001, 1e6, allow_nan=False)),
                          verify_reads=draw(st.sampled_from([True, False, "auto"])), lossy=draw(st.booleans()),
                          check=draw(st.booleans()), owned_only=draw(st.booleans()))
    return ControlFile(engine=engine, tables=tuple(tables))


@settings(max_examples=200, deadline=None)
@given(_control())
def test_round_trip_is_exact(cfg):
    assert parse_control(dump_control(cfg)) == cfg


def test_built_in_tiers_are_named_once():
    assert tier_names()[:3] == ("dram", "disk", "redis")


def test_the_redis_tier_of_earlier_releases_is_refused_naming_the_new_keys():
    """One Redis tier for both modes: `source = "redis-cluster"` and `[table.redis-cluster]` say what to write."""
    for text in (TABLE + 'source = "redis-cluster"\n',
                 TABLE + 'source = "redis"\n[table.redis-cluster]\nurl = "redis://127.0.0.1:7000"\n'):
        with pytest.raises(SlackTierError) as info:
            parse_control(text)
        assert info.value.kind is ErrorKind.BAD_INPUT and "retired" in info.value.message
        assert 'source = "redis"' in info.value.fix and 'mode = "cluster"' in info.value.fix
    cfg = parse_control(TABLE + 'source = "redis"\n[table.redis]\nmode = "cluster"\nurl = "redis://127.0.0.1:7000"\n'
                        'nodes = ["127.0.0.1:7001"]\nread_from_replicas = true\n')
    assert cfg.table(1).options == RedisOptions(mode="cluster", url="redis://127.0.0.1:7000", nodes=("127.0.0.1:7001",),
                                                read_from_replicas=True)
    with pytest.raises(SlackTierError, match="standalone") as info:   # cluster keys on one server
        parse_control(TABLE + 'source = "redis"\n[table.redis]\nread_from_replicas = true\n')
    assert 'mode = "cluster"' in info.value.fix
