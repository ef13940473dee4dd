"""Bit-exactness of the step engine over >= 1,000,000 real-token lookups.

Row ids come from the Engram hasher (scaled V4.1 layout, ~50k rows per layer)
over real source text tokenized with the DeepSeek-V4 tokenizer. Tables are
staged to real files by the staging code (synthetic rows), and served from
DRAM, from one disk region, and from several regions on two files, with a
large cache, no cache, and a tiny cache that evicts every step, and with slots emptied ahead between steps
(evict_ahead). Every lookup is
compared twice: by the engine's checker (torch reference gather of the rows
read from the staged files), and here, against the rows regenerated from the
synthetic generator (dequantized by the codec's exact table).
Seven configurations x 211,200 lookups each = 1,478,400 lookups.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from slacktier.engine.step import StepEngine
from slacktier.testing.engine import real_token_ids
from slacktier.tables.codec import dequantize_bits
from slacktier.tables.engram_hash import EngramLayout
from slacktier.tables.manifest import Manifest
from slacktier.tables.stage import SyntheticSource, stage_synthetic

SEED = 11
TOKENS_PER_CONFIG = 4400          # x 2 layers x 24 = 211,200 lookups
LAYOUT = EngramLayout.scaled(2000)  # rows per layer: 50,148 and 54,840


@pytest.fixture(scope="module")
def token_ids() -> np.ndarray:
    """[len(CONFIGS) * TOKENS_PER_CONFIG, 2, 24] row ids of real text."""
    return real_token_ids(len(CONFIGS) * TOKENS_PER_CONFIG, LAYOUT)


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One table staged twice: 1 rank on one file, and 4 ranks over two files."""
    d = tmp_path_factory.mktemp("exact")
    one = stage_synthetic([d / "one.bin"], LAYOUT, 1, SEED, progress=False)
    four = stage_synthetic([d / "a.bin", d / "b.bin"], LAYOUT, 4, SEED, progress=False)
    return {"one": Path(one.path), "four": Path(four.path)}


def write_control(path: Path, manifest: Path, source: str, cache_rows: int, shares: tuple[float, float]) -> Path:
    """A control file for both layers of `manifest`, layer 1 first."""
    tables = "".join(f"""
[[table]]
layer = {layer}
source = "{source}"
manifest = "{manifest}"
cache_share = {share}
order = {order}
""" for order, (layer, share) in enumerate(zip((1, 14), shares, strict=True)))
    path.write_text(f"""
[engine]
device = "cpu"
cache_rows = {cache_rows}
check = true
max_tokens = 64
{tables}""")
    return path


CONFIGS = {
    # name: (staging, source, cache rows, shares, step sizes in tokens, evict_ahead)
    "dram-4ranks-nocache": ("four", "dram", 0, (0.0, 0.0), (128,), False),
    "disk-1region-cached": ("one", "disk", 30_000, (0.6, 0.4), (128, 8, 256), False),
    "disk-4regions-cached": ("four", "disk", 30_000, (0.5, 0.5), (64, 200), False),
    "disk-4regions-tinycache": ("four", "disk", 96, (0.5, 0.5), (128,), False),
    "dram-1region-tinycache": ("one", "dram", 40, (0.7, 0.3), (1, 33, 128), False),
    "disk-1region-cached-ahead": ("one", "disk", 30_000, (0.6, 0.4), (128, 8, 256), True),
    "disk-4regions-tinycache-ahead": ("four", "disk", 96, (0.5, 0.5), (128,), True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_zero_mismatches(name: str, token_ids: np.ndarray, staged: dict[str, Path], tmp_path: Path) -> None:
    which, source, cache_rows, shares, sizes, ahead = CONFIGS[name]
    manifest = Manifest.load(staged[which])
    rows_of = SyntheticSource(manifest.layout, SEED)
    k = list(CONFIGS).index(name)
    ids = token_ids[k * TOKENS_PER_CONFIG:(k + 1) * TOKENS_PER_CONFIG]
    engine = StepEngine.from_control(str(write_control(tmp_path / "c.toml", staged[which], source, cache_rows,
                                                       shares)), evict_ahead=ahead)
    evicting_steps = steps = 0
    with engine:
        at = 0
        while at < ids.shape[0]:
            t = sizes[steps % len(sizes)]
            batch = ids[at:at + t]
            at += t
            engine.begin_step(batch)
            for j, layer in enumerate((1, 14)):
                out = engine.gather(layer)   # [T, 24, 256] bf16
                # Independent of the engine's checker: rows regenerated from the generator, dequantized by
                # the codec's exact table (itself checked against torch on all 65,536 entries).
                want = dequantize_bits(rows_of.rows(layer, batch[:, j, :].reshape(-1)))
                assert np.array_equal(out.reshape(-1, 256).view(torch.int16).numpy(), want.view(np.int16))
            counters = engine.end_step()
            steps += 1
            evicting_steps += all(c.evictions > 0 for c in counters.layers.values())
        totals = engine.totals
        # Each step's evictions are its pass's; summed they are every eviction the cache made.
        assert all(totals[layer].evictions == engine.cache.evictions(layer) for layer in (1, 14))
    checked = sum(c.checked_rows for c in totals.values())
    assert checked == ids.shape[0] * 48 >= 210_000
    assert sum(c.mismatches for c in totals.values()) == 0
    lookups = sum(c.lookups for c in totals.values())
    assert lookups == sum(c.hits + c.reused + c.rows_read + c.zero_rows for c in totals.values())
    if cache_rows >= 30_000:
        assert sum(c.hits for c in totals.values()) > lookups // 3
    if "tinycache" in name:
        assert evicting_steps >= steps - 2   # the tiny cache evicts in (nearly) every step
        assert all(c.bypass > 0 for c in totals.values())
    if cache_rows == 0:
        assert sum(c.hits for c in totals.values()) == 0
    if ahead:   # rows were evicted, by the passes and ahead of them between steps; every row exact (above)
        assert sum(c.evictions for c in totals.values()) > 0
