"""RedKnot artifact tables placed like any table: per-layer tiers, read through the engine's per-layer reads."""

from __future__ import annotations

import json
import os

import pytest
import torch

from slacktier.cli import main
from slacktier.config import DiskOptions, RedisOptions, TableConfig, write_control
from slacktier.errors import SlackTierError
from slacktier.redknot.artifacts import ArtifactStore
from slacktier.redknot.model import build_model, tiny_config
from slacktier.redknot.placement import artifact_placement
from slacktier.redknot.profile import profile_for_config
from slacktier.redknot.protect import ProtectionPolicy
from slacktier.redknot.runner import Layout, RedKnotRunner, Segment
from slacktier.redknot.service import RedKnotService

CFG = tiny_config()
MODEL = build_model(CFG, seed=0)
PROFILE = profile_for_config(CFG, name="tiny")
A, B = PROFILE.reusable[0], PROFILE.reusable[-1]   # B's pages are the last region of each data file


def _tokens(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(2, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


D0, D1, Q = _tokens(36, 21), _tokens(40, 22), _tokens(12, 23)
DOCS = [("d0", D0), ("d1", D1)]
LAYOUT = Layout.of([Segment("d0", D0), Segment("d1", D1), Segment("q", Q, "query")])
DOC_ROWS = len(D0) + len(D1)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def runner() -> RedKnotRunner:
    return RedKnotRunner(MODEL, PROFILE, chunk_rows=32)


def _store(tmp_path, runner, *, same_context: bool = False) -> ArtifactStore:
    """d0 built alone; d1 alone (canonical) or after d0 (its artifacts are then exact for DOCS)."""
    store = ArtifactStore(tmp_path / "store")
    svc = RedKnotService(runner, store)
    svc.build("d0", D0)
    svc.build("d1", D1, context=D0 if same_context else ())
    return store


def _mixed(store: ArtifactStore):
    """Layer B's artifacts on disk (threads engine), every other reusable layer's in host memory."""
    return artifact_placement(store.root, PROFILE.reusable, "dram",
                              tiers={B: ("disk", DiskOptions(engine="threads", queue_depth=8))})


def test_two_tiers_equal_all_dram(tmp_path, runner):
    """Layer A from DRAM and layer B from disk read the same pages as all from DRAM: the same prefill, bit for bit."""
    store = _store(tmp_path, runner)
    svc = RedKnotService(runner, store)
    assert {t.source for t in svc.placement.tables} == {"dram"}
    dram = svc.prefill(DOCS, Q, ProtectionPolicy(0.2))
    mixed_svc = RedKnotService(runner, store, placement=_mixed(store))
    assert mixed_svc.placement.table(A).source == "dram" and mixed_svc.placement.table(B).source == "disk"
    mixed = mixed_svc.prefill(DOCS, Q, ProtectionPolicy(0.2))
    for rep in (dram, mixed):
        assert rep.fallback_reason is None and rep.reads.failed_layers == 0
        assert rep.result.stats.local_rows_reused > 0
    assert mixed_svc.counters["sources_opened"] == 2 * len(DOCS)   # one per document and tier
    assert (mixed.reads.pages, mixed.reads.tickets) == (dram.reads.pages, dram.reads.tickets)
    assert torch.equal(mixed.result.hidden, dram.result.hidden)
    assert torch.equal(mixed.result.last_logits, dram.result.last_logits)
    # the same move between prefills: layer B's pages now come from disk, the result does not change
    svc.apply(_mixed(store))
    again = svc.prefill(DOCS, Q, ProtectionPolicy(0.2))
    assert torch.equal(again.result.hidden, dram.result.hidden)
    mixed_svc.close()
    svc.close()


def test_failed_tier_recomputes_only_that_layer(tmp_path, runner):
    """d1's file shrinks under the open disk source: layer B's reads fail, only layer B is recomputed (so the
    prefill stays exact), it is counted, and the disk sources are reopened on the next prefill."""
    store = _store(tmp_path, runner, same_context=True)
    full = runner.full(LAYOUT)
    svc = RedKnotService(runner, store, placement=_mixed(store))
    first = svc.prefill(DOCS, Q, ProtectionPolicy(0.0))
    assert first.result.stats.local_rows_reused == DOC_ROWS * len(PROFILE.reusable)
    opened = svc.counters["sources_opened"]
    cert = store.certificate("d1", 0)
    b = cert.covered_layers.index(B)
    assert b == len(cert.covered_layers) - 1   # truncating at B's region leaves every other layer whole
    os.truncate(store.data_path(cert), cert.region_offsets_bytes[b])
    rep = svc.prefill(DOCS, Q, ProtectionPolicy(0.0))
    st_ = rep.result.stats
    assert rep.fallback_reason is None and st_.mode == "reuse"
    assert st_.layers_recomputed == 1 and rep.reads.failed_layers == 1
    assert svc.counters["artifact_layers_failed"] == 1
    assert st_.protected_rows[B].numel() == LAYOUT.rows                         # every row of B online
    assert all(st_.protected_rows[l].numel() < LAYOUT.rows for l in PROFILE.reusable if l != B)
    assert st_.local_rows_reused == DOC_ROWS * (len(PROFILE.reusable) - 1)
    torch.testing.assert_close(rep.result.hidden, full.hidden, rtol=0, atol=1e-10)
    torch.testing.assert_close(rep.result.last_logits, full.last_logits, rtol=0, atol=1e-10)
    # the failed layer's tier is reopened next time; d1's disk source now sees the short file when opening
    nxt = svc.prefill(DOCS, Q, ProtectionPolicy(0.0))
    assert nxt.fallback_reason is not None and nxt.fallback_reason.value == "unreadable"
    assert svc.counters["sources_opened"] == opened + 1
    svc.close()


def test_placement_must_place_every_reusable_layer_of_this_store(tmp_path, runner):
    store = _store(tmp_path, runner)
    whole = artifact_placement(store.root, PROFILE.reusable)
    missing = artifact_placement(store.root, PROFILE.reusable[1:])
    with pytest.raises(SlackTierError, match="reusable layers"):
        RedKnotService(runner, store, placement=missing)
    with pytest.raises(SlackTierError, match="not the artifact store"):
        RedKnotService(runner, store, placement=artifact_placement(tmp_path / "elsewhere", PROFILE.reusable))
    with pytest.raises(SlackTierError, match="verify_reads"):
        RedKnotService(runner, store, placement=whole.replace(verify_reads=False))
    redis = TableConfig(layer=A, manifest=str(store.root), source="redis", options=RedisOptions())
    on_redis = type(whole)(engine=whole.engine, tables=(redis,) + whole.tables[1:])
    with pytest.raises(SlackTierError, match="Redis"):
        RedKnotService(runner, store, placement=on_redis)


def test_cli_runs_a_placement_file(tmp_path, capsys):
    """`slacktier redknot run --placement` reads a control file the planner could have written."""
    store_dir = tmp_path / "s"
    args = ["--store", str(store_dir), "--model", "tiny", "--docs", "2", "--doc-tokens", "32", "--dtype", "float64"]
    assert main(["redknot", "build", *args]) == 0
    capsys.readouterr()
    control = write_control(artifact_placement(store_dir, PROFILE.reusable, "dram", tiers={B: ("disk", None)}),
                            tmp_path / "placement.toml", "RedKnot artifact placement")
    assert main(["redknot", "run", *args, "--placement", str(control)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "reuse" and out["pages_read"] > 0
    assert out["counters"]["sources_opened"] == 4   # 2 documents x 2 tiers


# ---- the artifact planner: tables placed by their layers' windows ---------------------------------------

def _tiers():
    from slacktier.plan.readmodel import DeviceReadModel
    from slacktier.plan.tiers import TierSpec
    return (TierSpec("dram", DeviceReadModel(0.0, 0.001, 0.001, 0.001), holds_table=True),
            TierSpec("disk", DeviceReadModel(0.3, 0.01, 0.01, 0.01), holds_table=False))


def test_planner_puts_every_layer_on_disk_when_the_windows_allow(tmp_path):
    """The docstring's worked example: 5 layers x 256 pages, windows 100..500 ms: all on disk, T = 13.1 ms."""
    from slacktier.plan.artifacts import ArtifactDemand, plan_artifact_placement
    demands = [ArtifactDemand(layer=l, pages=256, window_ms=100.0 * l) for l in range(1, 6)]
    plan = plan_artifact_placement(tmp_path, demands, _tiers())
    assert [t.source for t in plan.tables] == ["disk"] * 5
    assert plan.host_bytes == 0 and plan.slowdown_ms == 0.0
    assert plan.tables[0].read_ms == pytest.approx(0.3 + 0.01 * 256 + 0.01 * 1024)
    assert plan.tables[-1].read_ms == pytest.approx(0.3 + 0.01 * 1280)


def test_planner_keeps_short_window_layers_in_dram(tmp_path):
    """Windows 5, 10, 20, 40 ms for 1000-page layers: disk needs 10.3 ms for the first layer alone, so the earliest
    layers stay in DRAM until the disk queue fits; the control file carries the window order and is a valid
    artifact placement for this store."""
    from slacktier.plan.artifacts import ArtifactDemand, plan_artifact_placement
    from slacktier.redknot.placement import check_placement
    demands = [ArtifactDemand(layer=l, pages=1000, window_ms=w) for l, w in zip((4, 1, 2, 3), (40.0, 5.0, 10.0, 20.0))]
    plan = plan_artifact_placement(tmp_path, demands, _tiers())
    # disk queue for layers 3, 4: T_3 = 0.3 + 10 + 10 = 20.3 > 20, so only layer 4 fits on disk
    assert [(t.layer, t.source) for t in plan.tables] == [(1, "dram"), (2, "dram"), (3, "dram"), (4, "disk")]
    assert plan.slowdown_ms == 0.0 and plan.host_bytes == 3 * 1000 * 4096
    assert [t.order for t in plan.tables] == [0, 1, 2, 3]
    tables = check_placement(plan.control, tmp_path, (1, 2, 3, 4))
    assert [(t.layer, t.source, t.order) for t in tables] == [(1, "dram", 0), (2, "dram", 1), (3, "dram", 2),
                                                             (4, "disk", 3)]
    path = tmp_path / "artifacts.toml"
    write_control(plan.control, path)
    from slacktier.config import load_control
    assert load_control(path) == plan.control   # an ordinary control file
    with pytest.raises(SlackTierError, match="no split meets"):
        plan_artifact_placement(tmp_path, [ArtifactDemand(1, 10_000, 1.0)], _tiers())


def test_prefill_reports_each_layers_window_and_arrival(tmp_path, runner):
    """Per reusable layer: when the runner needed its pages, when they had landed, how long it blocked."""
    store = _store(tmp_path, runner)
    svc = RedKnotService(runner, store, placement=_mixed(store))
    rep = svc.prefill(DOCS, Q, ProtectionPolicy(0.2))
    r = rep.reads
    assert sorted(r.need_ms) == sorted(r.ready_ms) == sorted(r.layer_wait_ms) == list(PROFILE.reusable)
    needs = [r.need_ms[l] for l in PROFILE.reusable]
    assert needs == sorted(needs) and needs[0] > 0          # deeper layers are needed later
    assert all(v >= 0 for v in r.ready_ms.values())
    assert set(r.late_layers()) <= set(PROFILE.reusable)
    svc.close()


def test_warm_opens_sources_before_the_first_prefill(tmp_path, runner):
    """warm() opens each valid document's sources once per tier; the prefill then opens none and is unchanged."""
    store = _store(tmp_path, runner)
    first = RedKnotService(runner, store, placement=_mixed(store))
    cold = first.prefill(DOCS, Q, ProtectionPolicy(0.2))
    first.close()   # its sources hold the disk's device queue: left open, they would outlive this test
    svc = RedKnotService(runner, store, placement=_mixed(store))
    assert svc.warm(DOCS + [("d0", D1)]) == 2          # d0 with other tokens: its certificate does not fit
    assert svc.counters["sources_opened"] == 2 * len(DOCS)
    warm = svc.prefill(DOCS, Q, ProtectionPolicy(0.2))
    assert svc.counters["sources_opened"] == 2 * len(DOCS)
    assert torch.equal(warm.result.hidden, cold.result.hidden)
    svc.close()


def test_plan_verb_places_a_built_store_and_redknot_run_reads_its_control_file(tmp_path, runner, capsys):
    """`slacktier redknot plan`: pages from the store's certificates, windows from flags, tiers from TOML; the
    short-window layer stays in DRAM, the control file passes the service's own placement check."""
    from slacktier.redknot.placement import check_placement
    store = _store(tmp_path, runner)
    certs = [store.certificate(d, 0) for d, _ in DOCS]
    pages = {l: sum(c.region_pages[i] for c in certs) for i, l in enumerate(certs[0].covered_layers)}
    tiers = tmp_path / "tiers.toml"
    tiers.write_text('[[tier]]\nname = "dram"\nintercept_ms = 0.0\npage_ms = 0.001\ncontention_page_ms = 0.001\n'
                     'holds_table = true\n\n[[tier]]\nname = "disk"\nintercept_ms = 5.0\npage_ms = 0.01\n'
                     'contention_page_ms = 0.01\nholds_table = false\n')
    # layer A needs its pages before the disk's 5 ms intercept; every later layer has 100 ms
    windows = [f"--window={l}={1.0 if l == A else 100.0}" for l in pages]
    out = tmp_path / "placement.toml"
    assert main(["redknot", "plan", "--store", str(store.root), "--tiers", str(tiers), *windows,
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"{len(DOCS)} documents, rank 0" in printed and "predicted stall 0.000 ms" in printed
    from slacktier.config import load_control
    control = load_control(out)
    placed = {t.layer: t.source for t in check_placement(control, store.root, PROFILE.reusable)}
    assert placed == {l: ("dram" if l == A else "disk") for l in pages}
    # the same store with a window nothing meets: refused, naming the best prediction; a missing window: named
    assert main(["redknot", "plan", "--store", str(store.root), "--tiers", str(tiers),
                 *[f"--window={l}=0.0001" for l in pages], "--out", str(tmp_path / "x.toml")]) != 0
    assert "no split meets" in capsys.readouterr().err
    assert main(["redknot", "plan", "--store", str(store.root), "--tiers", str(tiers), windows[0],
                 "--out", str(tmp_path / "y.toml")]) != 0
    assert "no window for reusable layers" in capsys.readouterr().err
    assert not (tmp_path / "x.toml").exists() and not (tmp_path / "y.toml").exists()
