"""The probe's run-time config file and the noise model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slacktier.errors import SlackTierError
from slacktier.probe import (NO_TARGET, ConfigWatcher, ProbeTarget, noise_model, read_probe_config,
                             write_probe_config)


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_config_round_trips(tmp_path, suffix):
    p = tmp_path / f"probe{suffix}"
    for target in [ProbeTarget(3, 2.5), NO_TARGET, ProbeTarget(0, 0.1 + 0.2)]:
        write_probe_config(p, target)
        assert read_probe_config(p) == target
    assert not [f for f in tmp_path.iterdir() if f.name.endswith(".tmp")]


def test_handwritten_files(tmp_path):
    p = tmp_path / "probe.toml"
    p.write_text("layer = 7\ndelay_ms = 4\n")
    assert read_probe_config(p) == ProbeTarget(7, 4.0)
    p.write_text("")  # absent layer = no target
    assert read_probe_config(p) == NO_TARGET
    j = tmp_path / "probe.json"
    j.write_text('{"layer": -1, "delay_ms": 9}')
    assert read_probe_config(j).layer is None
    j.write_text("{not json")
    with pytest.raises(SlackTierError):
        read_probe_config(j)
    with pytest.raises(SlackTierError):
        write_probe_config(tmp_path / "probe.yaml", NO_TARGET)
    with pytest.raises(SlackTierError):
        read_probe_config(tmp_path / "absent.json")
    with pytest.raises(SlackTierError):
        ProbeTarget(1, -1.0)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 60)), st.floats(0, 1e4, allow_nan=False)),
                min_size=1, max_size=8))
def test_watcher_sees_every_rewrite_even_back_to_back(tmp_path_factory, targets):
    p = tmp_path_factory.mktemp("w") / "probe.json"
    write_probe_config(p, NO_TARGET)
    w = ConfigWatcher(p)
    assert w.poll() == NO_TARGET
    for layer, delay in targets:
        t = ProbeTarget(layer, delay)
        write_probe_config(p, t)
        assert w.poll() == t
    reloads = w.reloads
    assert w.poll() == ProbeTarget(*targets[-1])
    assert w.reloads == reloads  # no change, no re-read


def test_noise_threshold_is_the_largest_of_floor_three_std_and_one_percent():
    steady = [10.0] * 20
    assert noise_model(steady, 0.3).threshold_ms == 0.3
    assert noise_model([100.0] * 20, 0.3).threshold_ms == pytest.approx(1.0)  # 1% of a 100 ms step
    noisy = [10.0, 11.0, 9.0, 10.0, 12.0, 8.0, 10.0]  # median 10, MAD 1 -> robust std 1.4826
    m = noise_model(noisy, 0.3)
    assert m.baseline_ms == 10.0
    assert m.std_ms == pytest.approx(1.4826)
    assert m.threshold_ms == pytest.approx(3 * 1.4826)
    # one preempted step does not set the threshold
    assert noise_model(steady[:-1] + [500.0], 0.3).threshold_ms == 0.3
