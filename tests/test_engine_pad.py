"""The serving engines' padding conventions: vLLM's -1 "dead" ids and SGLang's row 0 on idle ranks.

A padded lookup comes out as a zero row, touches no cache slot, reads no page and is
counted (`padded`, inside `zero_rows`); the real lookups of the same step come out
exactly as without the padding. Row 0 is a real row and is served as row 0.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slacktier.cache import RowCache
from slacktier.engine.step import StepEngine
from slacktier.testing.engine import array_tables
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.codec import dequantize_bits

ROWS = {1: 3000, 14: 2000}


def _engine(cache_rows: int = 500, **kw) -> tuple[StepEngine, dict[int, np.ndarray]]:
    tables, _, raws = array_tables(ROWS)
    return StepEngine(tables, RowCache(cache_rows), max_tokens=32, check=True, check_raise=True, **kw), raws


def _ids(rng: np.random.Generator, tokens: int) -> np.ndarray:
    """[T, 2, 24] int64 random row ids of both layers."""
    return np.stack([rng.integers(0, ROWS[1], (tokens, 24)), rng.integers(0, ROWS[14], (tokens, 24))], axis=1)


@pytest.mark.parametrize("gather_impl", ["numba", "torch"])
def test_minus_one_padding_gives_zero_rows_and_reads_nothing(gather_impl: str) -> None:
    eng, raws = _engine(gather_impl=gather_impl)
    rng = np.random.default_rng(0)
    # A step that is all padding: zero rows, no page read, no slot touched.
    eng.begin_step(np.full((8, 2, 24), -1, dtype=np.int64))
    for layer in ROWS:
        out = eng.gather(layer)
        assert out.shape == (8, 24, 256)
        assert torch.equal(out.view(torch.int16), torch.zeros_like(out.view(torch.int16)))   # +0.0 bits
    c = eng.end_step()
    for layer in ROWS:
        lc = c.layers[layer]
        assert (lc.lookups, lc.padded, lc.zero_rows) == (192, 192, 192)
        assert (lc.hits, lc.rows_read, lc.pages_read, lc.evictions, lc.read_us) == (0, 0, 0, 0, 0.0)
    # Mixed: the last 5 tokens of a 12-token step are padding (vLLM pads a batch to a captured size).
    ids = _ids(rng, 12)
    ids[7:] = -1
    eng.begin_step(ids)
    for i, layer in enumerate(ROWS):
        out = eng.gather(layer).view(torch.int16).numpy()
        want = dequantize_bits(raws[layer][ids[:7, i].reshape(-1)]).view(np.int16)
        assert np.array_equal(out[:7].reshape(-1, 256), want)
        assert not out[7:].any()
    c = eng.end_step()
    for layer in ROWS:
        lc = c.layers[layer]
        assert lc.padded == 5 * 24 and lc.lookups == 12 * 24
        assert lc.hits + lc.reused + lc.rows_read + lc.zero_rows == lc.lookups
        assert lc.mismatches == 0 and lc.checked_rows == 7 * 24
    # The padding claimed no slot: a second identical step hits every real row and reads nothing.
    eng.begin_step(ids)
    for layer in ROWS:
        eng.gather(layer)
    c = eng.end_step()
    for layer in ROWS:
        lc = c.layers[layer]
        assert lc.rows_read == 0 and lc.pages_read == 0 and lc.padded == 120
    assert eng.totals[1].padded == 192 + 120 + 120
    eng.close()


def test_another_pad_id_and_negative_ids_that_are_not_padding() -> None:
    eng, _ = _engine(pad_id=-7)
    ids = np.zeros((2, 2, 24), dtype=np.int64)
    ids[1] = -7
    eng.begin_step(ids)
    eng.gather(1)
    eng.gather(14)
    assert eng.end_step().layers[1].padded == 24
    ids[1, 0, 3] = -1   # not the pad id: still an id outside the table
    with pytest.raises(SlackTierError) as err:
        eng.begin_step(ids)
    assert err.value.kind is ErrorKind.BAD_INPUT and "row id -1" in str(err.value)
    eng.close()
    with pytest.raises(SlackTierError, match="pad_id 0 is a row id"):
        _engine(pad_id=0)
    with pytest.raises(SlackTierError, match="pad_id"):
        _engine(pad_id=3)


def test_pad_id_key_is_validated() -> None:
    from slacktier.config import from_dict
    with pytest.raises(SlackTierError, match="pad_id"):
        from_dict({"engine": {"pad_id": 0}, "table": [{"layer": 1, "manifest": "m.json"}]})
    assert from_dict({"engine": {"pad_id": -2}, "table": [{"layer": 1, "manifest": "m.json"}]}).engine.pad_id == -2


def test_row_zero_of_an_idle_rank_is_a_real_row() -> None:
    """SGLang's idle DP ranks send row 0: it is read, cached and served as the table's row 0, not padding."""
    eng, raws = _engine()
    ids = np.zeros((4, 2, 24), dtype=np.int64)
    eng.begin_step(ids)
    for i, layer in enumerate(ROWS):
        out = eng.gather(layer).view(torch.int16).numpy().reshape(-1, 256)
        want = dequantize_bits(raws[layer][np.zeros(96, dtype=np.int64)]).view(np.int16)
        assert np.array_equal(out, want)
    c = eng.end_step()
    for layer in ROWS:
        lc = c.layers[layer]
        assert (lc.padded, lc.zero_rows, lc.rows_read, lc.pages_read, lc.reused) == (0, 0, 1, 1, 95)
    eng.close()


def test_padding_in_per_rank_mode_is_plus_zero_not_foreign() -> None:
    """owned_only: the pad id is padding (+0.0 on every rank, so the all-reduce sum is +0.0), not a foreign row."""
    tables, _, _ = array_tables({1: 3000}, ranks=1)
    eng = StepEngine(tables, RowCache(100), max_tokens=8, owned_only=True)
    ids = np.full((2, 1, 24), -1, dtype=np.int64)
    ids[0, 0, 0] = 5000   # foreign
    eng.begin_step(ids)
    out = eng.gather(1).view(torch.int16).reshape(-1, 256)
    assert int(out[0, 0]) == -32768 and not out[1:].any()
    lc = eng.end_step().layers[1]
    assert (lc.padded, lc.zero_rows, lc.rows_read) == (47, 48, 0)
    eng.close()
