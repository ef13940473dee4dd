"""`slacktier probe` on a tiny saved model: its defaults, and Ctrl-C (SIGINT) saving what was measured."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slacktier.probe.report import ProbeRunConfig, parse_layers

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_are_the_table_layers_at_one_batch_size():
    from slacktier.cli import build_parser

    args = build_parser().parse_args(["probe"])
    assert args.batch == [1] and args.layers == "tables"
    assert ProbeRunConfig().batches == (1,) and ProbeRunConfig().layers == "tables"
    assert parse_layers("tables", 30) == [1, 14] and parse_layers("tables", 0) == [1, 14]
    from slacktier.errors import SlackTierError

    with pytest.raises(SlackTierError, match="--layers all"):
        parse_layers("tables", 8)


def _tiny_model(path: Path, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(path)


def test_ctrl_c_writes_the_layers_measured_so_far(tmp_path):
    _tiny_model(tmp_path / "tiny", 12)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # a grid long enough that the sweep is still running when the signal comes
    cmd = [sys.executable, "-m", "slacktier", "probe", "--model", str(tmp_path / "tiny"), "--layers", "all",
           "--clock", "thread_cpu", "--threads", "1", "--config", str(out / "probe.json"), "--repeats", "2",
           "--baseline-steps", "5", "--points-per-step", "20", "--max-delay-frac", "4", "--prompt-tokens", "3",
           "--max-new-tokens", "4", "--json", str(out / "w.json"), "--no-plot"]
    # A shell's background job (`cmd &`) starts with SIGINT ignored, and a Python started so keeps ignoring it:
    # give the probe the default disposition, as a terminal's Ctrl-C finds it.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    err_lines = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            err_lines.append(line)
            if "(1 of 12)" in line:
                break
        assert any("(1 of 12)" in l for l in err_lines), "".join(err_lines)
        proc.send_signal(signal.SIGINT)
        stdout, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    err = "".join(err_lines) + rest
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert "interrupted" in err and "interrupted" in stdout
    sweep = json.loads((out / "w.json").read_text())["sweeps"][0]
    assert sweep["interrupted"] is True
    assert 1 <= len(sweep["layers"]) < 12
    assert sweep["layers_requested"] == list(range(12))
    assert [lw["layer"] for lw in sweep["layers"]] == list(range(len(sweep["layers"])))
    assert json.loads((out / "probe.json").read_text())["layer"] is None   # the model is left unheld
