"""The one placement type and its one conversion to a control file (plan.placement)."""

from __future__ import annotations

import pytest

from slacktier import config
from slacktier.config import DiskOptions, DramOptions, EngineConfig, Options
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.plan.placement import Placement, placement_control

BOTH = ((1, "disk"), (14, "disk"))


class _ModelOptions(Options, frozen=True):
    """A stand-in emulated tier: reads land when a device model says."""

    device_kind = "model"


def test_a_layer_not_placed_is_in_dram_and_uncached():
    p = Placement("x", ((14, "disk"),), 100, ((14, 1.0),))
    assert (p.tier(1), p.tier(14), p.share(1), p.share(14), p.model(14)) == ("dram", "disk", 0.0, 1.0, None)


@pytest.mark.parametrize("kwargs, says", [
    ({"tiers": ((1, "tape"),)}, "layer 1 on 'tape'"),
    ({"tiers": BOTH, "shares": ((1, 0.7), (14, 0.4))}, "cache shares"),
    ({"tiers": BOTH, "shares": ((1, -0.1),)}, "cache shares"),
    ({"tiers": BOTH, "disks": "every-other"}, "disks 'every-other'"),
    ({"tiers": BOTH, "models": ((14, "nvme-paper"),)}, "has device model nvme-paper but is placed on disk"),
    ({"tiers": BOTH, "devices": 0}, "devices"),
])
def test_a_bad_placement_is_refused_naming_what_is_wrong(kwargs, says):
    with pytest.raises(SlackTierError) as e:
        Placement("bad", **kwargs)
    assert e.value.kind is ErrorKind.BAD_INPUT and says in e.value.message


def test_an_unregistered_tier_is_refused_with_how_to_register_it():
    with pytest.raises(SlackTierError) as e:
        Placement("x", ((1, "placement-test-unregistered"),))
    assert "import the module that registers it" in e.value.fix


def test_an_emulated_layer_needs_its_device_model_and_is_known_by_its_facts_not_its_name(monkeypatch):
    # registered for this test only: the registry is process-wide
    monkeypatch.setitem(config._TIER_OPTIONS, "placement-test-model", _ModelOptions)
    with pytest.raises(SlackTierError, match="without a device model"):
        Placement("x", ((1, "dram"), (14, "placement-test-model")))
    p = Placement("x", ((1, "dram"), (14, "placement-test-model")), models=((14, "nvme-paper"),), disks="per-rank")
    assert (p.model(14), p.disks) == ("nvme-paper", "per-rank")


def test_the_control_file_lists_layers_in_window_order_with_the_placement_cache():
    p = Placement("split", BOTH, 1000, ((1, 0.25), (14, 0.75)))
    cfg = placement_control(p, EngineConfig(device="cpu", max_tokens=64), "/t/m.json", (1, 14))
    assert (cfg.engine.cache_rows, cfg.engine.max_cache_rows, cfg.engine.max_tokens) == (1000, 1000, 64)
    assert [(t.layer, t.source, t.order, t.cache_share, t.rank, t.manifest) for t in cfg.tables] == [
        (1, "disk", 0, 0.25, -1, "/t/m.json"), (14, "disk", 1, 0.75, -1, "/t/m.json")]
    assert isinstance(cfg.table(1).options, DiskOptions)


def test_the_control_file_keeps_a_larger_reserve_and_takes_options_per_layer():
    p = Placement("l1-dram", ((1, "dram"), (14, "disk")))
    opts = DiskOptions(queue_depth=8)
    cfg = placement_control(p, EngineConfig(max_cache_rows=5000), "m.json", (1, 14), rank=2,
                            options=lambda layer, tier: opts if tier == "disk" else None)
    assert (cfg.engine.cache_rows, cfg.engine.max_cache_rows) == (0, 5000)
    assert cfg.table(14).options == opts and isinstance(cfg.table(1).options, DramOptions)
    assert {t.rank for t in cfg.tables} == {2}


def test_engine_layers_only_leaves_the_host_copies_out():
    cfg = placement_control(Placement("l1-dram", ((1, "dram"), (14, "disk"))), EngineConfig(), "m.json", (1, 14),
                            engine_layers_only=True)
    assert [(t.layer, t.order) for t in cfg.tables] == [(14, 0)]


def test_the_stock_table_has_no_control_file():
    with pytest.raises(SlackTierError, match="stock DRAM table"):
        placement_control(Placement("dram-table", stock=True), EngineConfig(), "m.json", (1, 14))
