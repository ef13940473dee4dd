"""The Qwen3.8-shaped model: transformers' Qwen4Exp, its n-gram table read through SlackTier."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from slacktier.errors import SlackTierError
from slacktier.models.qwen38 import (Q38Config, Q38Served, QwenSlot, build_qwen38, load_ple_tables,
                                     ple_column_bounds, ple_table_rows, ple_tables_from)
from slacktier.models.rows import DramRowProvider
from slacktier.plan.placement import Placement
from slacktier.serve.tiers import TierSet
from slacktier.tables.manifest import StagedLayout
from slacktier.tables.stage import SyntheticSource


pytestmark = pytest.mark.usefixtures("one_torch_thread")

EOS = 1


def _chunks() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(3, 129_280, (1, 26), generator=gen)
    seq[0, 9] = EOS  # n-grams must not reach across an EOS
    return [seq[:, :1], seq[:, 1:12], seq[:, 12:20], seq[:, 20:21], seq[:, 21:22], seq[:, 22:26]]


@pytest.fixture(scope="module")
def setup():
    model = build_qwen38(Q38Config.preset("tiny"))
    layout = StagedLayout(ple_table_rows(model), ple_column_bounds(model))
    source = SyntheticSource(layout, seed=21)
    tables = ple_tables_from(source, model)
    load_ple_tables(model, tables)
    ref, cache = [], DynamicCache(config=model.config)
    with torch.no_grad():   # the unmodified transformers model
        for chunk in _chunks():
            ref.append(model(input_ids=chunk, cache=cache, use_cache=True).logits[0])
    return model, layout, tables, ref


def _served_logits(served: Q38Served) -> list[torch.Tensor]:
    cache = served.new_cache()
    return [served.forward_step([QwenSlot(chunk, cache)])[0] for chunk in _chunks()]


def test_served_from_dram_equals_unmodified_transformers(setup) -> None:
    model, layout, tables, ref = setup
    served = Q38Served(model, DramRowProvider(tables, tuple(sorted(tables))))
    try:
        got = _served_logits(served)
    finally:
        served.restore()
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


@pytest.mark.parametrize("placement", [
    Placement("disk-split", ((0, "disk"), (1, "disk")), 600, ((0, 0.5), (1, 0.5))),
    Placement("dram-disk2", ((0, "dram"), (1, "disk")), 600, ((1, 1.0),), devices=2),
])
def test_served_through_the_step_engine_equals_unmodified_transformers(setup, tmp_path, placement) -> None:
    model, layout, tables, ref = setup
    tiers = TierSet(tmp_path, layout, seed=21, columns=16, max_cache_rows=600, devices=2)
    tiers.stage((placement.devices,))
    served = Q38Served(model, tiers.provider(placement))
    try:
        got = _served_logits(served)
        got_again = _served_logits(served)   # a second pass: cached rows now hit where there is a cache
        totals = tiers.engine.totals
    finally:
        served.restore()
        tiers.close()
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert all(torch.equal(a, b) for a, b in zip(ref, got_again))
    assert sum(c.pages_read for c in totals.values()) > 0
    if placement.cache_rows:
        assert sum(c.hits for c in totals.values()) > 0


def test_rows_are_read_only_inside_a_step(setup) -> None:
    model, layout, tables, ref = setup
    served = Q38Served(model, DramRowProvider(tables, tuple(sorted(tables))))
    try:
        with pytest.raises(SlackTierError), torch.no_grad():
            model(input_ids=torch.tensor([[5, 6]]), use_cache=False)
    finally:
        served.restore()


def test_served_model_refuses_a_provider_for_other_layers(setup) -> None:
    model, layout, tables, ref = setup
    with pytest.raises(SlackTierError):
        Q38Served(model, DramRowProvider({0: tables[0]}, (0,)))
