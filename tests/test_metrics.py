"""Prometheus metrics: scraped over real HTTP during a replay, they equal the sums of end_step's counters.

Each test uses its own CollectorRegistry (a host application's registry, as an
inference server would pass), except the control-file test, which checks that
`metrics = true` registers into prometheus_client's global registry. The
multi-process test runs two real rank processes with PROMETHEUS_MULTIPROC_DIR.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from slacktier.cache import RowCache
from slacktier.engine.counters import LayerCounters
from slacktier.engine.metrics import EngineMetrics, serve_metrics
from slacktier.engine.step import StepEngine
from slacktier.testing.engine import array_tables, real_token_ids
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.engram_hash import EngramLayout

LAYOUT = EngramLayout.scaled(2000)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of http://127.0.0.1:port/metrics: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _series(samples: dict, name: str, layer: int, tier: str, rank: str = "all") -> float:
    return samples[(name, (("layer", str(layer)), ("rank", rank), ("tier", tier)))]


def _engine(registry: CollectorRegistry, cache_rows: int = 3000) -> StepEngine:
    rows = {layer: LAYOUT.rows(i) for i, layer in enumerate(LAYOUT.layer_ids)}
    tables, _, _ = array_tables(rows, cache_shares={1: 0.6, 14: 0.4})
    return StepEngine(tables, RowCache(cache_rows), max_tokens=64, metrics=EngineMetrics(registry=registry))


def test_scraped_metrics_equal_the_engine_counters_over_a_replay() -> None:
    registry = CollectorRegistry()
    port = _free_port()
    server, thread = serve_metrics(port, addr="127.0.0.1", registry=registry)
    eng = _engine(registry)
    ids = real_token_ids(480, LAYOUT)
    ids[-7:] = -1   # the last step is padded, as vLLM pads a batch
    totals = {layer: LayerCounters() for layer in eng.layers}
    stall_s = {layer: 0.0 for layer in eng.layers}
    read_steps = {layer: 0 for layer in eng.layers}
    steps = 0
    for a in range(0, ids.shape[0], 16):
        eng.begin_step(ids[a:a + 16])
        for layer in eng.layers:
            eng.gather(layer)
        c = eng.end_step()
        steps += 1
        for layer, lc in c.layers.items():
            totals[layer].add(lc)
            stall_s[layer] += lc.wait_us / 1e6
            read_steps[layer] += lc.pages_read > 0
        if steps == 10:   # scrape in the middle of the replay too
            mid = _scrape(port)
            assert _series(mid, "slacktier_lookups_total", 1, "ArraySource") == eng.totals[1].lookups
    samples = _scrape(port)
    server.shutdown()
    tier = "ArraySource"   # an engine not built from a control file is labelled with its source's class
    for layer, t in totals.items():
        assert t.lookups == 30 * 16 * 24 and t.hits > 0 and t.evictions > 0 and t.padded == 7 * 24
        for name, want in [("slacktier_lookups_total", t.lookups), ("slacktier_hits_total", t.hits),
                           ("slacktier_rows_read_total", t.rows_read), ("slacktier_pages_read_total", t.pages_read),
                           ("slacktier_evictions_total", t.evictions), ("slacktier_padded_total", t.padded)]:
            assert _series(samples, name, layer, tier) == want, name
        assert _series(samples, "slacktier_gather_stall_seconds_count", layer, tier) == steps
        assert _series(samples, "slacktier_gather_stall_seconds_sum", layer, tier) == pytest.approx(stall_s[layer])
        assert _series(samples, "slacktier_read_seconds_count", layer, tier) == read_steps[layer]
        assert _series(samples, "slacktier_cache_rows", layer, tier) == eng.cache.owned_slots(layer)
        assert _series(samples, "slacktier_table_tier", layer, tier) == 1
    assert eng.cache.owned_slots(1) == 1800
    eng.close()


def test_errors_are_counted_by_kind() -> None:
    registry = CollectorRegistry()
    eng = _engine(registry, cache_rows=0)
    source = eng.table(1).source
    source.fail(0, 0, "io")
    ids = np.zeros((1, 2, 24), dtype=np.int64)
    eng.begin_step(ids)
    with pytest.raises(SlackTierError):
        eng.gather(1)
    eng.gather(14)
    eng.end_step()
    bad = ids.copy()
    bad[0, 0, 0] = 10**9
    with pytest.raises(SlackTierError):
        eng.begin_step(bad)
    assert registry.get_sample_value("slacktier_errors_total", {"kind": "io", "layer": "1", "rank": "all"}) == 1
    assert registry.get_sample_value("slacktier_errors_total",
                                     {"kind": "bad_input", "layer": "1", "rank": "all"}) == 1
    # Argument errors refused before a step opens are counted too (no layer: label "").
    with pytest.raises(SlackTierError):
        eng.begin_step(np.zeros((1, 2, 24), dtype=np.float32))
    with pytest.raises(SlackTierError):
        eng.begin_step(np.zeros((1, 3, 24), dtype=np.int64))
    assert registry.get_sample_value("slacktier_errors_total",
                                     {"kind": "bad_input", "layer": "", "rank": "all"}) == 2
    eng.close()


def test_off_by_default_registers_nothing(tmp_path: Path) -> None:
    rows = {1: 1000}
    tables, _, _ = array_tables(rows)
    eng = StepEngine(tables, RowCache(100))
    assert eng.metrics is None
    eng.close()


def test_control_file_key_turns_metrics_on(tmp_path: Path) -> None:
    from prometheus_client import REGISTRY
    from slacktier.config import ControlFile, EngineConfig, TableConfig
    from slacktier.testing.store import supports_o_direct
    from slacktier.tables.stage import stage_synthetic
    if not supports_o_direct(tmp_path):
        pytest.skip("tmp_path does not support O_DIRECT")
    m = stage_synthetic([tmp_path / "t.bin"], {1: 1500, 14: 1500}, 2, 1, progress=False)
    layer_tables = (TableConfig(layer=1, manifest=m.path, source="dram", cache_share=0.5),
                    TableConfig(layer=14, manifest=m.path, source="disk", cache_share=0.5, order=1))
    cfg = ControlFile(engine=EngineConfig(cache_rows=200, metrics=True), tables=layer_tables)
    eng = StepEngine.from_config(cfg)
    labels = {"layer": "14", "tier": "disk", "rank": "all"}
    before = REGISTRY.get_sample_value("slacktier_lookups_total", labels) or 0.0
    eng.begin_step(np.arange(48, dtype=np.int64).reshape(1, 2, 24))
    eng.gather(1)
    eng.gather(14)
    eng.end_step()
    assert REGISTRY.get_sample_value("slacktier_lookups_total", labels) - before == 24
    # Labelled with the control file's tier names only (no series under the source classes' names).
    assert REGISTRY.get_sample_value("slacktier_lookups_total", {**labels, "tier": "DiskSource"}) is None
    assert REGISTRY.get_sample_value("slacktier_host_table_bytes", {**labels, "layer": "1", "tier": "dram"}) > 0
    eng.apply(cfg.replace(metrics=False))
    assert eng.metrics is None
    eng.close()


RANK_PROCESS = textwrap.dedent("""
    import json, sys
    import numpy as np
    from slacktier.cache import RowCache
    from slacktier.engine.metrics import EngineMetrics
    from slacktier.engine.step import StepEngine
    from slacktier.testing.engine import array_tables
    rank = int(sys.argv[1])
    tables, _, _ = array_tables({1: 3000}, ranks=1, seed=rank)
    eng = StepEngine(tables, RowCache(200), metrics=EngineMetrics())
    rng = np.random.default_rng(rank)
    total = 0
    for _ in range(5 + rank):
        eng.begin_step(rng.integers(0, 3000, (4, 1, 24)))
        eng.gather(1)
        total += eng.end_step().layers[1].rows_read
    print(json.dumps({"rows_read": total}))
""")


def test_multiprocess_mode_sums_rank_processes(tmp_path: Path) -> None:
    """Two processes write to PROMETHEUS_MULTIPROC_DIR; the collector's sum equals theirs."""
    mp = tmp_path / "prom"
    mp.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp)}
    want = 0
    for rank in range(2):
        out = subprocess.run([sys.executable, "-c", RANK_PROCESS, str(rank)], env=env, capture_output=True,
                             text=True, check=True, timeout=300)
        want += json.loads(out.stdout.strip().splitlines()[-1])["rows_read"]
    script = ("from prometheus_client import CollectorRegistry, multiprocess\n"
              "r = CollectorRegistry(); multiprocess.MultiProcessCollector(r)\n"
              "print(r.get_sample_value('slacktier_rows_read_total', "
              "{'layer': '1', 'tier': 'ArraySource', 'rank': 'all'}))\n"
              "print(r.get_sample_value('slacktier_gather_stall_seconds_count', "
              "{'layer': '1', 'tier': 'ArraySource', 'rank': 'all'}))\n")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True,
                         timeout=120).stdout.split()
    assert float(out[0]) == want and want > 0
    assert float(out[1]) == 5 + 6


def test_serve_metrics_binds_loopback_unless_told_otherwise() -> None:
    """Issue 34: it bound 0.0.0.0, a metrics port on every interface of a serving node by default."""
    server, thread = serve_metrics(_free_port(), registry=CollectorRegistry())
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.shutdown()
        server.server_close()
    for addr, port, kind, said in (("every-interface", 9400, ErrorKind.BAD_INPUT, "is not an IP address"),
                                   ("127.0.0.1", 70000, ErrorKind.BAD_INPUT, "metrics port 70000 is outside 0..65535"),
                                   ("192.0.2.1", _free_port(), ErrorKind.UNAVAILABLE, "cannot serve metrics on "
                                                                                      "192.0.2.1 port")):
        with pytest.raises(SlackTierError) as exc:
            serve_metrics(port, addr=addr, registry=CollectorRegistry())
        assert exc.value.kind is kind and said in exc.value.message
