"""Per-rank cache sizing (plan.ranks): the slowest rank's pages, minimized with exact numbers."""

from __future__ import annotations

import pytest

from slacktier.errors import SlackTierError
from slacktier.plan.curves import MissCurve
from slacktier.plan.ranks import rank_cache_rows


def test_the_worked_example() -> None:
    split = rank_cache_rows([MissCurve((0, 100), (100, 0)), MissCurve((0, 100), (100, 50))], 100, unit_rows=10)
    assert split.cache_rows == (40, 60) and split.pages == (60.0, 70.0) and split.slowest_pages == 70.0


def test_equal_curves_get_equal_shares_and_a_flat_rank_gets_none_it_cannot_use() -> None:
    same = MissCurve((0, 500, 1000), (300, 120, 100))
    assert rank_cache_rows([same] * 4, 2000, unit_rows=100).cache_rows == (500, 500, 500, 500)
    flat = MissCurve((0, 1000), (80, 80))   # no reuse: cache rows there save nothing
    split = rank_cache_rows([same, flat], 1000, unit_rows=100)
    assert split.cache_rows == (1000, 0) and split.slowest_pages == 100.0


def test_bad_input_is_refused() -> None:
    with pytest.raises(SlackTierError):
        rank_cache_rows([], 10)
    with pytest.raises(SlackTierError):
        rank_cache_rows([MissCurve((0,), (1,))], -1)
