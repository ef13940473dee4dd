"""Page layout: rows land at page r // 15, byte (r % 15) * 264, and come back unchanged."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slacktier.errors import SlackTierError
from slacktier.tables.layout import (PAGE_BYTES, ROW_BYTES, ROWS_PER_PAGE, offset_in_page, pack_rows_into_pages,
                                     page_of_row, pages_for_rows, rows_from_pages, shard_bounds)


def test_worked_example():
    assert ROWS_PER_PAGE == 15 and ROW_BYTES == 264
    assert page_of_row(31) == 2 and offset_in_page(31) == 264
    assert pages_for_rows(15) == 1 and pages_for_rows(16) == 2


@settings(max_examples=40, deadline=None)
@given(st.integers(min_value=1, max_value=100), st.integers(min_value=0, max_value=2**32 - 1))
def test_pack_places_every_row_and_zeroes_the_tail(rows, seed):
    raw = np.random.default_rng(seed).integers(0, 256, size=(rows, ROW_BYTES), dtype=np.uint8)
    pages = pack_rows_into_pages(raw)
    assert pages.shape == (pages_for_rows(rows), PAGE_BYTES)
    flat = pages.reshape(-1)
    for r in range(rows):
        start = page_of_row(r) * PAGE_BYTES + offset_in_page(r)
        assert np.array_equal(flat[start:start + ROW_BYTES], raw[r])
    assert not pages[:, ROWS_PER_PAGE * ROW_BYTES:].any()
    assert np.array_equal(rows_from_pages(pages, rows), raw)


def test_shard_bounds_on_columns_and_rows():
    bounds = tuple(range(0, 241, 10))  # 24 columns of 10 rows
    assert shard_bounds(240, bounds, 1, 4) == (60, 120)
    assert shard_bounds(100, None, 3, 4) == (75, 100)
    assert shard_bounds(240, bounds, 0, 5) == (0, 48)  # 24 columns do not split 5 ways: equal rows
    with pytest.raises(SlackTierError):
        shard_bounds(240, bounds, 4, 4)
