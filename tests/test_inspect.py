"""`slacktier inspect` on a staged demo-size table and its control file, and the TP head-sharding check."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from slacktier import cli
from slacktier.config import ControlFile, EngineConfig, TableConfig, write_control
from slacktier.engine.step import StepEngine
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.serve.demo import DemoConfig
from slacktier.testing.store import supports_o_direct
from slacktier.tables.engram_hash import EngramLayout
from slacktier.tables.manifest import check_tp_sharding
from slacktier.tables.stage import stage_synthetic

DEMO = DemoConfig()


@pytest.fixture(scope="module")
def demo_table(tmp_path_factory: pytest.TempPathFactory):
    """The demo's table: its rows per layer, layers and ranks (what `slacktier demo` stages)."""
    d = tmp_path_factory.mktemp("demo")
    if not supports_o_direct(d):
        pytest.skip("tmp folder does not support O_DIRECT")
    return stage_synthetic([d / "demo.bin"], {layer: DEMO.rows for layer in DEMO.layers}, DEMO.ranks, DEMO.seed,
                           progress=False)


@pytest.fixture(scope="module")
def engram_table(tmp_path_factory: pytest.TempPathFactory):
    """A V4.1-shaped table (24 hash columns per layer) staged for TP 4."""
    d = tmp_path_factory.mktemp("engram")
    if not supports_o_direct(d):
        pytest.skip("tmp folder does not support O_DIRECT")
    return stage_synthetic([d / "t.bin"], EngramLayout.scaled(1000), 4, 0, progress=False)


def test_inspect_demo_table_and_control_file(demo_table, tmp_path: Path, capsys) -> None:
    first, second = DEMO.layers
    cfg = ControlFile(engine=EngineConfig(cache_rows=8192, max_tokens=64),
                      tables=(TableConfig(layer=first, manifest=demo_table.path, source="dram", cache_share=0.75),
                              TableConfig(layer=second, manifest=demo_table.path, source="disk", cache_share=0.25,
                                          order=1, rank=1)))
    control = write_control(cfg, tmp_path / "placement.toml")
    assert cli.main(["inspect", str(control), demo_table.path, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    m = report["manifest_report"]
    assert m["ranks"] == DEMO.ranks and [layer["layer"] for layer in m["layers"]] == list(DEMO.layers)
    regions = m["layers"][0]["regions"]
    assert [(r["rank"], r["row_start"], r["rows"]) for r in regions] == [(0, 0, 150_000), (1, 150_000, 150_000)]
    assert regions[0]["pages"] == 10_000 and m["layers"][0]["bytes"] == 20_000 * 4096
    c = report["control_report"]
    t1, t14 = c["tables"]
    assert (t1["tier"], t1["rank"], t1["cache_rows"], t1["rows"]) == ("dram", "all", 6144, 300_000)
    assert (t14["tier"], t14["rank"], t14["cache_rows"], t14["rows"]) == ("disk", 1, 2048, 150_000)
    # the DRAM table's pages, and each table's directory, sized to its cache rows (8 B entries, >= 2 per row)
    assert t1["host_bytes"] == 20_000 * 4096 + 8 * 16384 and t14["host_bytes"] == 8 * 4096
    assert t14["devices"] == [demo_table.targets[demo_table.region(second, 1).device]]
    assert c["page_pool_bytes"] == 64 * 24 * 2 * 4096
    assert c["host_bytes"] == 20_000 * 4096 + 8 * 16384 + 8 * 4096 + c["page_pool_bytes"] + 8192 * 264
    # The same as text.
    assert cli.main(["inspect", str(control), demo_table.path]) == 0
    text = capsys.readouterr().out
    assert f"layer {first}: 300,000 rows, 78.1 MiB" in text
    assert "rank 1: rows [150,000, 300,000) on device 0, 10,000 pages, 39.1 MiB" in text
    assert f"layer {second} (order 1): tier disk, rank 1, 150,000 rows" in text
    assert "host memory in all:" in text
    # "counters+sketch" adds each table's frequency sketch: four rows of one-byte counters, a power of two at least
    # its cache rows each
    sketched = write_control(ControlFile(engine=EngineConfig(cache_rows=8192, max_tokens=64,
                                                             admission="counters+sketch"), tables=cfg.tables),
                             tmp_path / "sketched.toml")
    assert cli.main(["inspect", str(sketched), "--json"]) == 0
    s1, s14 = json.loads(capsys.readouterr().out)["control_report"]["tables"]
    assert (s1["sketch_bytes"], s14["sketch_bytes"]) == (4 * 8192, 4 * 2048)
    assert (s1["host_bytes"] - t1["host_bytes"], s14["host_bytes"] - t14["host_bytes"]) == (4 * 8192, 4 * 2048)


def _two_tables(demo_table, tmp_path: Path, first_source: str, first_share: float) -> Path:
    """A control file of the demo table's two layers: the first on `first_source` with `first_share` of 8,192
    cache rows, the second on disk with the rest, submitted second."""
    first, second = DEMO.layers
    cfg = ControlFile(engine=EngineConfig(cache_rows=8192, max_tokens=64),
                      tables=(TableConfig(layer=first, manifest=demo_table.path, source=first_source,
                                          cache_share=first_share),
                              TableConfig(layer=second, manifest=demo_table.path, source="disk",
                                          cache_share=1 - first_share, order=1)))
    return write_control(cfg, tmp_path / "placement.toml")


def test_inspect_says_what_each_table_reads_with_on_this_host(demo_table, tmp_path: Path, capsys,
                                                               monkeypatch) -> None:
    """Where io_uring is refused (a container's seccomp profile), inspect says so before any engine opens: the
    disk table reads with pread on C threads, the DRAM table's copies stay on the C worker."""
    control = _two_tables(demo_table, tmp_path, "dram", 0.5)
    monkeypatch.setattr("slacktier.store.disk.probe_io_uring", lambda: "io_uring_setup failed: Operation not permitted")
    assert cli.main(["inspect", str(control), "--json"]) == 0
    t1, t14 = json.loads(capsys.readouterr().out)["control_report"]["tables"]
    assert t14["engine_here"] == {"asked": "auto", "engine": "threads", "reads_with": "pread on C threads",
                                  "io_uring_missing": "io_uring_setup failed: Operation not permitted"}
    assert t1["engine_here"]["reads_with"] == "memcpy on a C worker" and t1["engine_here"]["io_uring_missing"] is None
    assert cli.main(["inspect", str(control)]) == 0
    text = capsys.readouterr().out
    assert ("on this host: engine 'auto' reads with pread on C threads (io_uring unavailable here: io_uring_setup "
            "failed: Operation not permitted)") in text


def test_sharding_mismatch_is_refused(engram_table, demo_table, capsys) -> None:
    check_tp_sharding(engram_table, 4)       # staged for TP 4: whole hash columns per rank
    with pytest.raises(SlackTierError) as err:
        check_tp_sharding(engram_table, 2)   # num_shards 4 != TP 2
    assert err.value.kind is ErrorKind.BAD_INPUT and "staged with 4 ranks" in str(err.value)
    assert "--ranks 2" in str(err.value)
    with pytest.raises(SlackTierError, match="records no hash-column bounds"):
        check_tp_sharding(demo_table, DEMO.ranks)
    assert cli.main(["inspect", engram_table.path, "--tp", "4"]) == 0
    assert "match TP 4 head sharding" in capsys.readouterr().out
    assert cli.main(["inspect", engram_table.path, "--tp", "8"]) == 2
    assert "staged with 4 ranks" in capsys.readouterr().err


def test_a_region_off_the_column_boundaries_is_refused(engram_table, tmp_path: Path) -> None:
    """A manifest whose rank regions were split by equal rows (not whole heads) is refused, naming the rank."""
    import dataclasses
    layer = engram_table.layout.layer_ids[0]
    moved = [dataclasses.replace(r, rows=r.rows - 1) if (r.layer, r.rank) == (layer, 0) else
             dataclasses.replace(r, row_start=r.row_start - 1, rows=r.rows + 1) if (r.layer, r.rank) == (layer, 1)
             else r for r in engram_table.regions]
    bad = dataclasses.replace(engram_table, regions=moved)
    with pytest.raises(SlackTierError) as err:
        check_tp_sharding(bad, 4)
    assert err.value.layer == layer and err.value.rank == 0 and "columns 0..5" in str(err.value)


def test_engine_refuses_a_rank_table_not_staged_as_head_shards(tmp_path: Path) -> None:
    """A control file serving one rank of a table whose 24 columns do not split over its 5 ranks is refused."""
    if not supports_o_direct(tmp_path):
        pytest.skip("tmp_path does not support O_DIRECT")
    m = stage_synthetic([tmp_path / "t.bin"], EngramLayout.scaled(500), 5, 0, progress=False)
    layer = m.layout.layer_ids[0]
    cfg = ControlFile(engine=EngineConfig(owned_only=True),
                      tables=(TableConfig(layer=layer, manifest=m.path, source="disk", rank=1),))
    with pytest.raises(SlackTierError, match="24 hash columns, which TP 5 cannot split"):
        StepEngine.from_config(cfg)
    # Every rank of the table served by one process is not per-rank serving: not checked, it runs.
    whole = ControlFile(tables=(TableConfig(layer=layer, manifest=m.path, source="disk"),))
    with StepEngine.from_config(whole) as eng:
        eng.begin_step(np.zeros((1, 1, 24), dtype=np.int64))
        eng.gather(layer)
        eng.end_step()


def test_inspect_predicts_the_control_files_placement_as_the_planner_does(demo_table, tmp_path: Path,
                                                                         capsys) -> None:
    """--window/--tiers/--curves: the placement as stated (tiers, split, order), priced by predict_fixed_placement."""
    from slacktier.plan import TableDemand, load_miss_curves, load_tiers, predict_fixed_placement

    first, second = DEMO.layers
    control = _two_tables(demo_table, tmp_path, "disk", 0.75)
    tiers = tmp_path / "tiers.toml"
    tiers.write_text('[[tier]]\nname = "dram"\nintercept_ms = 0.01\npage_ms = 0.00001\ncontention_page_ms = 0\n\n'
                     '[[tier]]\nname = "disk"\nintercept_ms = 0.30\npage_ms = 0.00305\ncontention_page_ms = 0.00037\n'
                     'buffer_bytes = 1048576\n')
    curves = tmp_path / "curves.json"
    curves.write_text(json.dumps({"workload": "agent", "batch": 4, "layers": {
        str(first): {"capacity_rows": [0, 8192], "pages_per_step": [400, 100]},
        str(second): {"capacity_rows": [0, 8192], "pages_per_step": [300, 60]}}}))
    flags = ["--window", f"{first}=0.27", "--window", f"{second}=0.9", "--tiers", str(tiers), "--curves", str(curves),
             "--kappa-ms", "0.05"]
    assert cli.main(["inspect", str(control), *flags, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["prediction"]
    want = predict_fixed_placement(
        [TableDemand(first, DEMO.rows, demo_table.path, 0.27), TableDemand(second, DEMO.rows, demo_table.path, 0.9)],
        {first: "disk", second: "disk"}, {first: 0.75, second: 0.25}, load_tiers(tiers),
        load_miss_curves(curves).by_layer, 8192, kappa_ms=0.05)
    assert got["slowdown_ms"] == want.slowdown_ms > 0.05
    assert got["host_bytes"] == want.host_bytes == 8 * 16384 + 8 * 4096 + 2 * 1048576
    assert [(t["layer"], t["source"], t["cache_share"], t["read_ms"]) for t in got["tables"]] == \
        [(t.layer, t.source, t.cache_share, t.read_ms) for t in want.tables]
    # the split is the control file's, not re-optimised: layer 1 sits behind 6144 rows
    assert got["tables"][0]["pages_per_step"] == pytest.approx(400 - 300 * 6144 / 8192)
    assert cli.main(["inspect", str(control), *flags]) == 0
    text = capsys.readouterr().out
    assert f"predicted slowdown {want.slowdown_ms:.4f} ms per step for this placement" in text
    assert f"layer {first} on disk (submitted 0)" in text
    # the tiers file is the first form: c_ahead = b, c_behind = its contention_page_ms (plan.tiers)
    assert ("read model of disk: T = 0.3000 ms + 3.050 us/page own + 3.050 us/page queued ahead + 0.370 us/page "
            "queued behind") in text
    assert got["read_models"] == {"disk": {"intercept_ms": 0.30, "page_ms": 0.00305, "ahead_page_ms": 0.00305,
                                           "behind_page_ms": 0.00037, "fit": None}}
    # windows without a tiers file, or a table without a window, are refused with a fix
    assert cli.main(["inspect", str(control), "--window", f"{first}=0.27"]) == 2
    assert "needs a control file, --tiers, --curves" in capsys.readouterr().err
    assert cli.main(["inspect", str(control), *flags[2:]]) == 2
    assert f"no window for layer(s) [{first}]" in capsys.readouterr().err
