"""Miss curves, the cache split and the placement planner."""

from __future__ import annotations

import itertools
import json
import tomllib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slacktier import config
from slacktier.errors import SlackTierError
from slacktier.plan import (PAPER_NVME, DeviceReadModel, MissCurve, ReadFitRecord, TableDemand, TierSpec, best_split,
                            control_file, format_plan, load_miss_curves, load_tiers, make_plan, plan_comment,
                            predict_fixed_placement, predict_placement, split_cost_ms, write_plan, write_tiers)
from slacktier.tables.layout import PAGE_BYTES, pages_for_rows
from slacktier.plan.tiers import directory_bytes


def convex_curve(p0: float, tau: float, cap: float = 1e6, points: int = 9) -> MissCurve:
    caps = np.linspace(0, cap, points)
    return MissCurve(tuple(caps), tuple(p0 * np.exp(-caps / tau)))


DRAM = TierSpec("dram", DeviceReadModel(intercept_ms=0.01, page_ms=1e-5, ahead_page_ms=1e-5, behind_page_ms=0.0),
                holds_table=True)
DISK = TierSpec("disk", PAPER_NVME, holds_table=False, buffer_bytes=1 << 20)   # a, b, c, c_behind = 0.30 ms, 3.05,
#                                                                                 3.05, 0.37 us per page


# ---- curves -------------------------------------------------------------------------------------------------

def test_curve_interpolates_and_holds_flat_outside(tmp_path):
    c = MissCurve((0.0, 100.0, 300.0), (50.0, 10.0, 0.0))
    assert c.pages_at(50.0) == 30.0
    assert c.pages_at(200.0) == 5.0
    assert c.pages_at(1000.0) == 0.0
    assert c.is_convex()
    assert not MissCurve((0.0, 1.0, 2.0), (10.0, 9.0, 0.0)).is_convex()
    doc = {"workload": "agent", "batch": 8,
           "layers": {"1": {"capacity_rows": [0, 100, 300], "pages_per_step": [50, 10, 0]},
                      "14": {"capacity_rows": [0, 100], "pages_per_step": [40, 20]}}}
    path = tmp_path / "curves.json"
    path.write_text(json.dumps(doc))
    curves = load_miss_curves(path)
    assert curves.workload == "agent" and curves.batch == 8
    assert curves.curve(1) == c
    assert curves.curve(14).pages_at(50) == 30.0
    with pytest.raises(SlackTierError):
        curves.curve(2)
    with pytest.raises(SlackTierError):
        MissCurve((0.0, 0.0), (1.0, 1.0))


# ---- split ---------------------------------------------------------------------------------------------------

def _brute_force(curves, weights, cache_rows, units):
    best = None
    for ks in itertools.product(range(units + 1), repeat=len(curves)):
        if sum(ks) != units:
            continue
        c = split_cost_ms(curves, weights, [k / units for k in ks], cache_rows)
        if best is None or c < best:
            best = c
    return best


def test_split_on_the_paper_shape_gives_layer1_most_but_not_all():
    c1, c14 = convex_curve(4000, 2e5), convex_curve(4000, 2e5)
    s = best_split([1, 14], [c1, c14], [3.05e-3, 0.37e-3], 1_000_000)
    assert 0.5 < s.shares[0] < 1.0
    assert sum(s.shares) == pytest.approx(1.0)
    assert s.cost_ms <= split_cost_ms([c1, c14], [3.05e-3, 0.37e-3], [0.5, 0.5], 1_000_000)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_split_is_optimal_on_its_grid_for_convex_curves(n):
    rng = np.random.default_rng(n)
    curves = [convex_curve(rng.uniform(100, 5000), rng.uniform(5e4, 5e5)) for _ in range(n)]
    weights = list(rng.uniform(1e-4, 5e-3, n))
    units = 20
    s = best_split(list(range(n)), curves, weights, 1_000_000, grid=units, refine=1)
    assert s.cost_ms == pytest.approx(_brute_force(curves, weights, 1_000_000, units), rel=1e-12)
    # refinement only helps, and lands on the optimum of the finer grid
    fine = best_split(list(range(n)), curves, weights, 1_000_000, grid=units, refine=4)
    assert fine.cost_ms <= s.cost_ms + 1e-12
    if n <= 3:
        assert fine.cost_ms == pytest.approx(_brute_force(curves, weights, 1_000_000, units * 4), rel=1e-12)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.floats(1, 1e4), st.floats(1e3, 1e6), st.floats(1e-5, 1e-2)), min_size=2,
                max_size=2), st.integers(1, 2_000_000))
def test_split_two_layers_matches_brute_force(params, cache_rows):
    curves = [convex_curve(p0, tau) for p0, tau, _ in params]
    weights = [w for _, _, w in params]
    s = best_split([1, 14], curves, weights, cache_rows, grid=40, refine=1)
    assert s.cost_ms == pytest.approx(_brute_force(curves, weights, cache_rows, 40), rel=1e-9, abs=1e-12)


def test_split_of_nothing_and_bad_inputs():
    c = convex_curve(100, 1e5)
    s = best_split([1, 14], [c, c], [1e-3, 1e-3], 0)
    assert sum(s.shares) == pytest.approx(1.0)
    with pytest.raises(SlackTierError):
        best_split([1], [c, c], [1e-3], 10)
    with pytest.raises(SlackTierError):
        best_split([1], [c], [-1.0], 10)


# ---- planner -------------------------------------------------------------------------------------------------

def _flat(pages: float) -> MissCurve:
    return MissCurve((0.0,), (pages,))


@pytest.mark.parametrize("pages,window_ms", [(100.0, 0.61), (100.0, 0.604), (100.0, 0.6), (100.0, 0.5),
                                             (1000.0, 3.35), (1000.0, 3.349)])
def test_table_goes_to_disk_exactly_when_its_reads_fit_its_window(pages, window_ms):
    read_ms = DISK.read.intercept_ms + DISK.read.page_ms * pages
    table = TableDemand(layer=14, rows=15_000, manifest="m14.json", window_ms=window_ms)
    plan = make_plan([table], [DRAM, DISK], {14: _flat(pages)}, cache_rows=0, target_ms=0.0)
    expected = "disk" if read_ms <= window_ms else "dram"
    assert plan.tables[0].source == expected
    assert plan.slowdown_ms == 0.0
    if expected == "disk":
        assert plan.host_bytes == directory_bytes(0) + (1 << 20)   # a directory sized to no cache slots
    else:
        assert plan.host_bytes == pages_for_rows(15_000) * PAGE_BYTES + directory_bytes(0)


@pytest.mark.parametrize("window_ms,expected", [(1.0, "disk"), (np.nextafter(1.0, 0.0), "dram"), (1.5, "disk")])
def test_reads_exactly_filling_the_window_still_fit(window_ms, expected):
    slow = TierSpec("disk", DeviceReadModel(0.5, 0.25, 0.25, 0.0), holds_table=False)
    plan = make_plan([TableDemand(1, 100, "m.json", float(window_ms))], [DRAM, slow], {1: _flat(2.0)},
                     cache_rows=0, target_ms=0.0)  # read = 0.5 + 0.25 * 2 = 1.0 ms exactly
    assert plan.tables[0].source == expected


def test_v41_shape_layer1_needs_cache_or_dram_layer14_stays_on_disk():
    rows = 1_000_000
    tables = [TableDemand(1, rows, "l1.json", 0.27), TableDemand(14, rows, "l14.json", 9.35)]
    curves = {1: convex_curve(3000, 1e5), 14: convex_curve(2500, 1e5)}
    # no cache: layer 1 reads 3000 pages (9.45 ms) > 0.27 ms window -> DRAM; layer 14 (7.9 ms) fits on disk
    plan = make_plan(tables, [DRAM, DISK], curves, cache_rows=0, target_ms=0.05)
    assert [(t.layer, t.source) for t in plan.tables] == [(1, "dram"), (14, "disk")]
    assert plan.slowdown_ms <= 0.05
    # a large cache makes layer 1's misses few enough that both fit on disk
    plan2 = make_plan(tables, [DRAM, DISK], curves, cache_rows=1_000_000, target_ms=0.2)
    assert [t.source for t in plan2.tables] == ["disk", "disk"]
    assert plan2.host_bytes < plan.host_bytes
    t1 = plan2.tables[0]
    assert t1.cache_share > 0.5
    assert t1.read_ms == pytest.approx(0.30 + 3.05e-3 * t1.pages_per_step + 0.37e-3 * plan2.tables[1].pages_per_step)
    # predict_placement reproduces the chosen plan's numbers
    again = predict_placement(tables, {1: "disk", 14: "disk"}, [DRAM, DISK], curves, 1_000_000, target_ms=0.2)
    assert again.slowdown_ms == pytest.approx(plan2.slowdown_ms)


def test_fixed_placement_reproduces_a_plan_and_keeps_the_given_split():
    rows = 1_000_000
    tables = [TableDemand(1, rows, "l1.json", 0.27), TableDemand(14, rows, "l14.json", 9.35)]
    curves = {1: convex_curve(3000, 1e5), 14: convex_curve(2500, 1e5)}
    plan = make_plan(tables, [DRAM, DISK], curves, cache_rows=1_000_000, target_ms=0.2)
    fixed = predict_fixed_placement(tables, {t.layer: t.source for t in plan.tables},
                                    {t.layer: t.cache_share for t in plan.tables}, [DRAM, DISK], curves, 1_000_000,
                                    target_ms=0.2)
    assert fixed.tables == plan.tables
    assert (fixed.slowdown_ms, fixed.host_bytes, fixed.split_cost_ms) == (plan.slowdown_ms, plan.host_bytes,
                                                                          plan.split_cost_ms)


def test_fixed_placement_exact_numbers():
    # Flat curves: 100 pages at layer 1 and 40 at layer 14 whatever the share, so the split does not matter.
    # Both on disk, layer 1 submitted first: T_1 = 0.30 + 3.05e-3 * 100 + 0.37e-3 * 40 = 0.6198 ms,
    # T_14 = 0.30 + 3.05e-3 * (40 + 100) = 0.727 ms. Windows 0.27 and 0.5: d_1 = 0.3498, d_14 = 0.727 - 0.5 - 0.3498
    # = 0 -> slowdown 0.3498 + kappa 0.1.
    tables = [TableDemand(1, 1000, "l1.json", 0.27), TableDemand(14, 1000, "l14.json", 0.5)]
    curves = {1: _flat(100.0), 14: _flat(40.0)}
    p = predict_fixed_placement(tables, {1: "disk", 14: "disk"}, {1: 0.2, 14: 0.3}, [DRAM, DISK], curves, 1000,
                                kappa_ms=0.1)
    assert [t.read_ms for t in p.tables] == pytest.approx([0.6198, 0.727])
    assert p.slowdown_ms == pytest.approx(0.3498 + 0.1)
    assert [t.cache_rows for t in p.tables] == pytest.approx([200.0, 300.0])
    assert p.host_bytes == DISK.host_bytes(1000, 200) + DISK.host_bytes(1000, 300)
    # Layer 14 submitted first (the control file's order): it pays no contention, layer 1 waits behind its 40.
    q = predict_fixed_placement(tables, {1: "disk", 14: "disk"}, {1: 0.2, 14: 0.3}, [DRAM, DISK], curves, 1000,
                                order={1: 1, 14: 0})
    assert [t.layer for t in q.tables] == [14, 1]
    assert [t.read_ms for t in q.tables] == pytest.approx([0.30 + 3.05e-3 * 40 + 0.37e-3 * 100,
                                                           0.30 + 3.05e-3 * 140])
    with pytest.raises(SlackTierError, match="cache shares"):
        predict_fixed_placement(tables, {1: "disk", 14: "disk"}, {1: 0.7, 14: 0.5}, [DISK], curves, 1000)
    with pytest.raises(SlackTierError, match="no tier, source or cache share"):
        predict_fixed_placement(tables, {1: "disk"}, {1: 0.5, 14: 0.5}, [DISK], curves, 1000)


def test_infeasible_target_raises_with_fix():
    tables = [TableDemand(1, 1000, "l1.json", 0.0)]
    with pytest.raises(SlackTierError) as e:
        make_plan(tables, [DISK], {1: _flat(10.0)}, cache_rows=0, target_ms=0.0)
    assert "target" in str(e.value) and e.value.fix


def test_control_file_round_trips_through_toml(tmp_path):
    # The planner builds a config.ControlFile; config.write_control writes it and config.load_control reads back
    # the same object (manifest paths absolute: relative ones are anchored at the file's folder on load).
    tables = [TableDemand(1, 30_000, "/data/l1/manifest.json", 0.27),
              TableDemand(14, 30_000, str(tmp_path / 'odd"name.json'), 9.35)]
    curves = {1: convex_curve(3000, 1e5), 14: convex_curve(3000, 1e5)}
    plan = make_plan(tables, [DRAM, DISK], curves, cache_rows=500_000, target_ms=1.0)
    disk = config.DiskOptions(io_threads=4)
    cfg = control_file(plan, config.EngineConfig(device="cpu", verify_reads=True), (disk,))
    path = config.write_control(cfg, tmp_path / "control.toml", comment=plan_comment(plan))
    assert config.load_control(path) == cfg
    assert cfg.engine.cache_rows == cfg.engine.max_cache_rows == 500_000 and cfg.engine.verify_reads
    assert [t.layer for t in cfg.tables] == [1, 14] and [t.order for t in cfg.tables] == [0, 1]
    assert [t.source for t in cfg.tables] == [t.source for t in plan.tables]
    assert [t.cache_share for t in cfg.tables] == [t.cache_share for t in plan.tables]
    assert sum(t.cache_share for t in cfg.tables) == pytest.approx(1.0)
    for t in cfg.tables:   # each table carries its own tier's options: the given ones or the tier's defaults
        assert type(t.options) is config.tier_options_type(t.source)
        assert t.source != "disk" or t.options == disk
    text = path.read_text()
    assert text.startswith("# SlackTier control file") and "predicted slowdown" in text
    doc = tomllib.loads(text)
    assert doc["table"][1]["manifest"] == str(tmp_path / 'odd"name.json')
    # write_plan is the same two steps
    assert write_plan(plan, tmp_path / "again.toml", config.EngineConfig(verify_reads=True), (disk,)) == cfg
    assert config.load_control(tmp_path / "again.toml") == cfg
    text = format_plan(plan).splitlines()
    table = text[text.index("") + 1:]
    assert table[0].split()[:3] == ["layer", "order", "tier"] and len(table) == 2 + len(plan.tables)
    # the verdict above it says the table's placement in words, computed from the plan
    verdict = " ".join(l.strip() for l in text[:text.index("")])
    for t in plan.tables:
        where = "in DRAM" if t.source == "dram" else f"on {t.source}"
        assert f"layer {t.layer} {where}" in verdict
    assert verdict.startswith("Verdict: ") and f"predicted {plan.slowdown_ms:+.3f} ms per step, within" in verdict
    assert max(map(len, text)) <= 120


def test_control_file_takes_the_engine_section_and_refuses_two_options_of_one_tier():
    tables = [TableDemand(1, 1000, "/m.json", 5.0)]
    plan = make_plan(tables, [DISK], {1: _flat(1.0)}, cache_rows=100, target_ms=0.0)
    cfg = control_file(plan, config.EngineConfig(max_cache_rows=1000, max_tokens=64))
    assert (cfg.engine.cache_rows, cfg.engine.max_cache_rows, cfg.engine.max_tokens) == (100, 1000, 64)
    assert cfg.tables[0].options == config.DiskOptions()
    with pytest.raises(SlackTierError):
        control_file(plan, options=(config.DiskOptions(), config.DiskOptions(io_threads=2)))


def test_plan_page_layout_matches_the_tables_room():
    from slacktier.plan import tiers
    from slacktier.tables import layout

    assert (tiers.PAGE_BYTES, tiers.ROWS_PER_PAGE) == (layout.PAGE_BYTES, layout.ROWS_PER_PAGE)
    dram = TierSpec("dram", DeviceReadModel(0.0, 0.0, 0.0, 0.0), holds_table=True)
    for rows in (1, 15, 16, 384_006_168):
        assert dram.host_bytes(rows) == layout.pages_for_rows(rows) * layout.PAGE_BYTES + tiers.directory_bytes(0)


def test_tiers_file_of_the_first_form_maps_to_the_device_model(tmp_path):
    """A file without `format` is the first form, T = a + b (P + pages ahead) + c (pages behind): the same
    equation as the device model with c_ahead = b and c_behind = c."""
    p = tmp_path / "tiers.toml"
    p.write_text('[[tier]]\nname = "disk"\nintercept_ms = 0.3\npage_ms = 0.00305\ncontention_page_ms = 0.00037\n'
                 'buffer_bytes = 4096\n[[tier]]\nname = "dram"\nintercept_ms = 0.01\npage_ms = 0.00001\n')
    disk, dram = load_tiers(p)
    assert disk == TierSpec("disk", DeviceReadModel(0.3, 0.00305, 0.00305, 0.00037), holds_table=False,
                            buffer_bytes=4096)
    assert dram.holds_table and dram.read == DeviceReadModel(0.01, 0.00001, 0.00001, 0.00001)
    p.write_text('[[tier]]\nname = "disk"\nintercept_ms = 0.3\npage_ms = 0.003\nahead_page_ms = 0.001\n')
    with pytest.raises(SlackTierError, match="unknown key") as e:
        load_tiers(p)
    assert 'format = "slacktier-tiers/2"' in e.value.fix
    p.write_text('[[tier]]\nname = "tape"\nintercept_ms = 1\npage_ms = 1\n')
    with pytest.raises(SlackTierError) as e:
        load_tiers(p)
    assert all(name in e.value.fix for name in config.tier_names())


def test_tiers_file_of_the_second_form_round_trips_and_refuses_bad_terms_by_name(tmp_path):
    fit = ReadFitRecord(runs=30, r2=0.8, rmse_ms=4.25, held_out_runs=15, held_out_r2=0.75, held_out_rmse_ms=5.5,
                        at_zero=("intercept_ms",), measured="2026-12-02 10:00 UTC, slacktier probe --read-fit t.json")
    tiers = (TierSpec("disk", DeviceReadModel(0.0, 0.0136, 0.0055, 0.0054), holds_table=False, buffer_bytes=4096,
                      fit=fit), DRAM)
    p = write_tiers(tiers, tmp_path / "tiers.toml", comment="two tiers\nmeasured here")
    text = p.read_text()
    assert text.startswith("# two tiers\n# measured here\n") and 'format = "slacktier-tiers/2"' in text
    assert load_tiers(p) == tiers
    p.write_text('format = "slacktier-tiers/2"\n[[tier]]\nname = "disk"\nintercept_ms = 0.3\npage_ms = 0.003\n'
                 'ahead_page_ms = 0.003\nbehind_page_ms = -0.001\n')
    with pytest.raises(SlackTierError, match="tier 'disk': read-time term behind_page_ms = -0.001") as e:
        load_tiers(p)
    assert "probe --read-fit" in e.value.fix
    p.write_text('format = "slacktier-tiers/2"\n[[tier]]\nname = "disk"\nintercept_ms = 0.3\npage_ms = 0.003\n'
                 'contention_page_ms = 0.001\n')
    with pytest.raises(SlackTierError, match="contention_page_ms") as e:
        load_tiers(p)
    assert "behind_page_ms" in e.value.fix and "probe --read-fit" in e.value.fix
    p.write_text('format = "slacktier-tiers/2"\n[[tier]]\nname = "disk"\nintercept_ms = 0.3\npage_ms = 0.003\n')
    with pytest.raises(SlackTierError, match="has no ahead_page_ms"):
        load_tiers(p)
    p.write_text('format = "slacktier-tiers/9"\n[[tier]]\nname = "disk"\n')
    with pytest.raises(SlackTierError, match="format 'slacktier-tiers/9'"):
        load_tiers(p)


def test_the_planner_prices_pages_queued_ahead_at_c():
    """A device whose second table waits c = 1 us per page queued ahead (not b = 3.05): exact numbers, the split
    and stall follow. Flat curves: 100 pages at layer 1, 40 at layer 14; windows 0.27 and 0.4 ms."""
    shared = TierSpec("disk", DeviceReadModel(0.30, 3.05e-3, 1e-3, 0.37e-3), holds_table=False)
    tables = [TableDemand(1, 1000, "l1.json", 0.27), TableDemand(14, 1000, "l14.json", 0.4)]
    curves = {1: _flat(100.0), 14: _flat(40.0)}
    p = predict_fixed_placement(tables, {1: "disk", 14: "disk"}, {1: 0.5, 14: 0.5}, [shared], curves, 1000)
    # T_1 = 0.30 + 0.305 + 0.37e-3 * 40 = 0.6198; T_14 = 0.30 + 3.05e-3 * 40 + 1e-3 * 100 = 0.522
    assert [t.read_ms for t in p.tables] == pytest.approx([0.6198, 0.522], abs=1e-12)
    # d_1 = 0.6198 - 0.27 = 0.3498; d_14 = [0.522 - 0.4 - 0.3498]+ = 0
    assert [t.stall_ms for t in p.tables] == pytest.approx([0.3498, 0.0], abs=1e-12)
    fifo = predict_fixed_placement(tables, {1: "disk", 14: "disk"}, {1: 0.5, 14: 0.5}, [DISK], curves, 1000)
    assert fifo.tables[1].read_ms == pytest.approx(0.30 + 3.05e-3 * 140, abs=1e-12)   # c = b: 0.727


# ---- the CLI ---------------------------------------------------------------------------------------------------

def test_plan_cli_end_to_end(tmp_path, o_direct_dir, capsys):
    from slacktier import cli
    from slacktier.tables.stage import stage_synthetic

    # plan writes only what the engine opens: real manifests (planned at :ROWS rows per layer)
    l1 = stage_synthetic([o_direct_dir / "l1.bin"], {1: 150}, 1, 0, progress=False).path
    l14 = stage_synthetic([o_direct_dir / "l14.bin"], {14: 150}, 1, 0, progress=False).path
    curves = tmp_path / "curves.json"
    caps = [0, 250_000, 500_000, 1_000_000]
    curves.write_text(json.dumps({"workload": "agent", "batch": 128, "layers": {
        "1": {"capacity_rows": caps, "pages_per_step": [3000, 250, 40, 10]},
        "14": {"capacity_rows": caps, "pages_per_step": [2500, 300, 60, 20]}}}))
    tiers = tmp_path / "tiers.toml"
    tiers.write_text('[[tier]]\nname = "dram"\nintercept_ms = 0.01\npage_ms = 0.00001\n'
                     '[[tier]]\nname = "disk"\nintercept_ms = 0.30\npage_ms = 0.00305\ncontention_page_ms = 0.00037\n'
                     'buffer_bytes = 1048576\n')
    probe_json = tmp_path / "windows.json"
    probe_json.write_text(json.dumps({"sweeps": [{"batch": 1, "layers": [
        {"layer": 1, "window_ms": 0.5, "window_frac": 0.009},
        {"layer": 14, "window_ms": 20.0, "window_frac": 0.318}]}]}))
    out = tmp_path / "control.toml"
    rc = cli.main(["plan", "--table", f"1={l1}:1000000", "--table", f"14={l14}:1000000",
                   "--windows-json", str(probe_json), "--step-ms", "29.4", "--window", "1=0.27",
                   "--tiers", str(tiers), "--curves", str(curves), "--cache-rows", "1000000", "--target-ms", "0.3",
                   "--out", str(out), "--json", str(tmp_path / "plan.json")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "predicted slowdown" in text and text.startswith("Verdict: put layer 1 on disk")
    assert (tmp_path / "plan.png").stat().st_size > 5000 and f"wrote {tmp_path / 'plan.png'}" in text
    cfg = config.load_control(out)
    assert [t.source for t in cfg.tables] == ["disk", "disk"]
    assert cfg.engine.cache_rows == 1_000_000
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["tables"][0]["window_ms"] == 0.27  # --window overrides the probe JSON
    assert plan["tables"][1]["window_ms"] == pytest.approx(0.318 * 29.4)
    assert plan["slowdown_ms"] <= 0.3
    # an unreachable target is an error with a fix, not a file
    rc = cli.main(["plan", "--table", f"1={l1}:1000", "--window", "1=0", "--tiers", str(tiers), "--curves",
                   str(curves), "--cache-rows", "0", "--target-ms", "0", "--out", str(tmp_path / "no.toml")])
    assert rc == 2
    assert "Fix:" in capsys.readouterr().err
    assert not (tmp_path / "no.toml").exists()


def test_the_planner_places_a_table_on_the_redis_cluster_tier_and_the_control_file_carries_its_options():
    """The remote tier's read-time model from bench_redis_cluster.py: a table whose reads fit its window goes to
    the cluster (no host copy), and the control file names the tier with the operator's cluster options."""
    remote = TierSpec("redis", DeviceReadModel(2.26, 0.0151, 0.0151, 0.0128), holds_table=False,
                      buffer_bytes=1 << 20)
    rows = 1_000_000
    tables = [TableDemand(1, rows, "l1.json", 0.27), TableDemand(14, rows, "l14.json", 9.35)]
    curves = {1: _flat(300.0), 14: _flat(300.0)}   # 300 pages -> 2.26 + 4.53 = 6.8 ms on the cluster
    plan = make_plan(tables, [DRAM, remote], curves, cache_rows=0, target_ms=0.0)
    assert [(t.layer, t.source) for t in plan.tables] == [(1, "dram"), (14, "redis")]
    opts = config.RedisOptions(mode="cluster", url="redis://10.0.0.5:7000", username="slacktier-reader",
                               password_env="SLACKTIER_REDIS_PASSWORD")
    cfg = control_file(plan, options=(opts,))
    assert cfg.table(14).source == "redis" and cfg.table(14).options == opts
    assert config.parse_control(config.dump_control(cfg)) == cfg
