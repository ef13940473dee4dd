"""The cache's admission rules served (`admission = "prefill-cold"`, `"counters"`, `"counters+sketch"`) with
begin_step's per-token decode flags.

One staged table (scaled V4.1 layout), both layers on disk behind a small cache
that evicts in every step, traffic of real text as prefill chunks and decode
steps. Checked: rows stay bit-exact (the engine's checker and the generator's
rows), the served cache's hits, reuses and reads per step are exactly what the
characterizer's replay (`policies.clock` with the same heat codes) says for
that layer's slots, and the rule changes which rows end up cached.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from slacktier.cache import ADMISSIONS, token_heat
from slacktier.cache.directory import SKETCHED
from slacktier.cache.simulate import HIT, READ, REUSE_BYPASS, REUSE_FILLED, replay_clock
from slacktier.config import ADMISSION_RULES
from slacktier.engine.step import StepEngine
from slacktier.errors import SlackTierError
from slacktier.tables.codec import dequantize_bits
from slacktier.tables.engram_hash import EngramLayout
from slacktier.tables.manifest import Manifest
from slacktier.tables.stage import SyntheticSource, stage_synthetic
from slacktier.testing.engine import real_token_ids
from slacktier.workloads import policies as P

SEED = 5
LAYOUT = EngramLayout.scaled(2000)
CACHE_ROWS = 3000
TOKENS = 1500


def _steps(n_tokens: int) -> list[tuple[int, int, bool]]:
    """(start, end, decode) of each step: a 200-token prefill chunk, then 10 decode steps of 8 tokens."""
    out, at, k = [], 0, 0
    while at < n_tokens:
        t, dec = (200, False) if k % 11 == 0 else (8, True)
        out.append((at, min(at + t, n_tokens), dec))
        at += t
        k += 1
    return out


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("admission")
    return Path(stage_synthetic([d / "t.bin"], LAYOUT, 1, SEED, progress=False).path)


def _control(path: Path, manifest: Path, admission: str) -> Path:
    tables = "".join(f"""
[[table]]
layer = {layer}
source = "disk"
manifest = "{manifest}"
cache_share = 0.5
order = {order}
""" for order, layer in enumerate((1, 14)))
    path.write_text(f"""
[engine]
device = "cpu"
cache_rows = {CACHE_ROWS}
check = true
max_tokens = 256
admission = "{admission}"
{tables}""")
    return path


def _serve(manifest: Path, tmp_path: Path, admission: str, ids: np.ndarray):
    """Per step the layer-14 counters, the layer's slot count and its cached rows at the end; every row checked."""
    rows_of = SyntheticSource(Manifest.load(manifest).layout, SEED)
    engine = StepEngine.from_control(str(_control(tmp_path / f"{admission}.toml", manifest, admission)))
    per_step = []
    with engine:
        for a, b, dec in _steps(ids.shape[0]):
            batch = ids[a:b]
            engine.begin_step(batch, decode=np.full(b - a, dec))
            for j, layer in enumerate((1, 14)):
                out = engine.gather(layer)
                want = dequantize_bits(rows_of.rows(layer, batch[:, j, :].reshape(-1)))
                assert np.array_equal(out.reshape(-1, 256).view(torch.int16).numpy(), want.view(np.int16))
            per_step.append(engine.end_step().layers[14])
        totals = engine.totals
        slots = engine.cache.owned_slots(14)
        cached = set(engine.cache.cached(14)[0].tolist())
    assert sum(c.mismatches for c in totals.values()) == 0
    assert sum(c.checked_rows for c in totals.values()) == ids.shape[0] * 48
    return per_step, slots, cached


@pytest.fixture(scope="module")
def token_ids() -> np.ndarray:
    return real_token_ids(TOKENS, LAYOUT)


@pytest.mark.parametrize("admission", ["off", "prefill-cold", "counters", "counters+sketch"])
def test_served_admission_is_the_characterizers(admission, staged, token_ids, tmp_path) -> None:
    per_step, slots, _ = _serve(staged, tmp_path, admission, token_ids)
    steps = _steps(TOKENS)
    rows = token_ids[:, 1, :].reshape(-1)   # layer 14's lookups in step order
    sketch = admission in SKETCHED          # the sketch counts row ids: replay the rows themselves
    ids, n = (rows.astype(np.int64), int(rows.max()) + 1) if sketch else P.densify(rows)
    starts = np.array([a * 24 for a, _, _ in steps] + [TOKENS * 24], dtype=np.int64)
    prefill = np.concatenate([np.full(b - a, not dec) for a, b, dec in steps])
    heat = None if admission == "off" else np.repeat(token_heat(admission, prefill), 24)
    outcome = replay_clock(ids, starts, n, slots, evict_ahead=True, heat=heat, sketch=sketch)
    for (a, b, _), c in zip(steps, per_step, strict=True):
        o = outcome[a * 24:b * 24]
        assert (c.hits, c.reused, c.rows_read) == (int((o == HIT).sum()),
                                                   int(((o == REUSE_FILLED) | (o == REUSE_BYPASS)).sum()),
                                                   int((o == READ).sum()))
    assert sum(c.evictions for c in per_step) > 0   # the cache was under pressure


@pytest.mark.parametrize("admission", ["prefill-cold", "counters", "counters+sketch"])
def test_admission_changes_which_rows_are_cached(admission, staged, token_ids, tmp_path) -> None:
    off, _, cached_off = _serve(staged, tmp_path, "off", token_ids)
    on, _, cached_on = _serve(staged, tmp_path, admission, token_ids)
    assert cached_on != cached_off
    assert [c.hits for c in on] != [c.hits for c in off]


def test_decode_flags_are_checked(staged, tmp_path) -> None:
    ids = real_token_ids(4, LAYOUT)
    with StepEngine.from_control(str(_control(tmp_path / "c.toml", staged, "prefill-cold"))) as engine:
        for bad in (np.ones(3, dtype=bool), np.ones(4, dtype=np.int64), [True] * 5):
            with pytest.raises(SlackTierError, match="decode flags"):
                engine.begin_step(ids, decode=bad)
        engine.begin_step(ids, decode=np.array([False, False, True, True]))
        engine.gather(1)
        engine.gather(14)
        engine.end_step()


def test_the_pass_makes_token_heat_codes_from_every_kind_of_flags(staged, tmp_path) -> None:
    """begin_step's flags (numpy, a strided numpy view, torch, a list, or None: all decode) become `token_heat`'s
    codes per token inside the compiled pass, under the rule set when the engine was built and under each rule
    it is switched to between steps ("off": no codes)."""
    rng = np.random.default_rng(0)
    ids_all = real_token_ids(128, LAYOUT)
    with StepEngine.from_control(str(_control(tmp_path / "h.toml", staged, "counters"))) as engine:
        for rule in ("counters", *ADMISSIONS):
            engine.admission = rule
            for tokens in (1, 7, 64):
                ids = np.ascontiguousarray(ids_all[:tokens])
                dec = rng.random(2 * tokens) < 0.5
                for flags in (dec[:tokens], dec[::2], torch.from_numpy(dec[:tokens]), dec[:tokens].tolist(), None):
                    want = (np.zeros(tokens, bool) if flags is None
                            else ~np.asarray(flags.numpy() if isinstance(flags, torch.Tensor) else flags))
                    engine.begin_step(ids, decode=flags)
                    got = engine._plan.cp.heat_codes(tokens).tolist()
                    engine.gather(1)
                    engine.gather(14)
                    engine.end_step()
                    assert got == ([] if rule == "off" else token_heat(rule, want).tolist()), (rule, tokens)


def test_admission_rules_and_heat_codes_are_checked(staged, tmp_path) -> None:
    """An unknown rule is refused by the control file and by the replay; heat codes that are not one uint8 code
    per token are refused before the pass trusts them."""
    with pytest.raises(SlackTierError, match="admission"):
        StepEngine.from_control(str(_control(tmp_path / "bad.toml", staged, "sometimes")))
    with pytest.raises(SlackTierError, match="admission"):
        token_heat("sometimes", np.zeros(2, dtype=bool))
    # "counters": a prefill token's misses enter at 0 and its hits add nothing; a decode token's enter at 2 and
    # its hits add 2, up to 3 (kernels.heat_code's worked example)
    assert token_heat("counters", np.array([True, False])).tolist() == [0x30, 0x3A]
    # "counters+sketch": the same counts; a prefill token's misses pass the sketch (FILTER, 0x40), a decode
    # token's lookups count twice in it (HEAVY, 0x80)
    assert token_heat("counters+sketch", np.array([True, False])).tolist() == [0x70, 0xBA]
    assert token_heat("off", np.array([True, False])).shape == (0,)   # plain CLOCK: the pass's fastest path
    assert ADMISSIONS == ADMISSION_RULES   # the cache's rules are the ones the control file may name
    ids = np.array([0, 1, 0])
    for bad in (np.array([1, 1, 1], dtype=bool), np.array([0x3A, 0x3A], dtype=np.uint8),
                np.array([0x3A, 0x40, 0x3A], dtype=np.int16)):
        with pytest.raises(SlackTierError, match="heat codes"):
            replay_clock(ids, np.array([0, 3]), 2, 1, heat=bad)
