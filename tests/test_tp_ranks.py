"""A CLI-staged table served by 2 and 4 real TP rank processes through each plug-in, against the engine's stock
sharded path bit for bit; a rank killed mid-step.

Each rank is its own process, forked from one that imported the engine
(tests/tp_world.py). SGLang (tests/tp_rank_worker.py): SGLang
0.5.23's own process groups on gloo carry the all-reduce of
`EngramEmbedding._lookup`, the plug-in loads through SGLang's `load_plugins()`
and is turned on by SLACKTIER_SGLANG_CONTROL=<dir>/rank{tp_rank}.toml. vLLM
(tests/tp_rank_worker_vllm.py): vLLM 0.33.0's process groups on gloo carry
`Engram.embed`'s all-gather, its Triton lookup runs under TRITON_INTERPRET=1,
the plug-in loads through `load_general_plugins()` and is turned on by
SLACKTIER_VLLM_CONTROL; what stands in for the rest of vLLM is in that file's
docstring. The table is a small DeepSeek-V4-shaped checkpoint (config.json +
safetensors, with -0.0 bytes, and e8m0 0x00 for SGLang) staged by `slacktier
stage --checkpoint DIR --ranks N`, as a user runs it; the same checkpoint from
another seed is the negative control. vLLM's checkpoint has no e8m0 0x00 byte:
vLLM's Triton lookup reads it as zero where the plug-in reads 2^-127, a parity
gap of the plug-in's gather, not of its TP staging.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engines import SGLANG_VERSION, VLLM_VERSION, skip_reason
from slacktier.config import ControlFile, DiskOptions, EngineConfig, TableConfig, write_control
from slacktier.tables.engram_hash import EngramLayout
from slacktier.tables.manifest import Manifest

HERE = Path(__file__).resolve().parent
WORKERS = {"sglang": HERE / "tp_rank_worker.py", "vllm": HERE / "tp_rank_worker_vllm.py"}
# the vLLM ranks: vLLM's own Triton check keeps its kernels where no GPU is visible to a distributed worker
WORKER_ENV = {"sglang": {}, "vllm": {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}}
VOCAB = 300                # engram_vocab_size: ~7,300 rows per layer
LAYERS = (1, 14)
STEPS, TOKENS = 3, 24      # three one-request prefill steps of 24 tokens
RANK_TIMEOUT_S = 240

# Each case starts its rank processes, each importing SGLang: about a minute and a half per case on 2 cores.
pytestmark = pytest.mark.slow
VERSIONS = {"sglang": SGLANG_VERSION, "vllm": VLLM_VERSION}


def _needs(engine: str) -> None:
    reason = skip_reason(engine, VERSIONS[engine])
    if reason:
        pytest.skip(reason)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slacktier", *args], capture_output=True, text=True,
                          env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}, timeout=300)


def _checkpoint(folder: Path, seed: int, zero_scale: bool = True) -> Path:
    """A V4-shaped Engram checkpoint at the scaled vocab: config.json (engram_* keys) and one safetensors file."""
    import torch
    from safetensors.torch import save_file

    layout = EngramLayout.scaled(VOCAB)
    folder.mkdir(parents=True)
    config = {"architectures": ["DeepseekV4ForCausalLM"], "engram_layer_ids": list(LAYERS),
              "engram_num_embeddings": list(layout.rows_per_layer), "engram_max_ngram_size": 4,
              "engram_n_heads": 8, "engram_vocab_size": VOCAB, "engram_head_dim": 256, "engram_pad_token_id": 2,
              "engram_compressed_vocab_size": 99_092}
    (folder / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in LAYERS:
        rows = layout.layer_rows(layer)
        w = rng.integers(0, 256, size=(rows, 256), dtype=np.uint8)
        w[(w & 0x7F) == 0x7F] ^= 1    # no fp8 NaN: the all-reduce sums, and a NaN's payload is free
        w[::89, 5] = 0x80             # -0.0
        s = rng.integers(115, 128, size=(rows, 8), dtype=np.uint8)
        if zero_scale:
            s[::83, 1] = 0x00         # e8m0 2^-127
        tensors[f"layers.{layer}.engram.embed.weight"] = torch.from_numpy(w).view(torch.float8_e4m3fn)
        tensors[f"layers.{layer}.engram.embed.scale"] = torch.from_numpy(s).view(torch.float8_e8m0fnu)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def world(o_direct_module_dir: Path):
    """The checkpoint and another-seed one, real tokens for the steps."""
    from slacktier.testing.engine import real_text
    from slacktier.tables.tokenizer import encode

    d = o_direct_module_dir
    tokens = np.asarray(encode(real_text(8 * STEPS * TOKENS))[:STEPS * TOKENS], dtype=np.int64)
    np.save(d / "tokens.npy", tokens.reshape(STEPS, TOKENS))
    return {"dir": d, "tokens": d / "tokens.npy",
            "sglang": {"ckpt": _checkpoint(d / "ckpt", 1), "other": _checkpoint(d / "other", 2)},
            "vllm": {"ckpt": _checkpoint(d / "vckpt", 1, zero_scale=False),
                     "other": _checkpoint(d / "vother", 2, zero_scale=False)}}


def _stage(world: dict, name: str, ckpt: Path, ranks: int, *extra: str) -> Path:
    target = world["dir"] / f"{name}.bin"
    done = _cli("stage", "--checkpoint", str(ckpt), "--ranks", str(ranks), "--target", str(target),
                "--overwrite", "--no-progress", *extra)
    assert done.returncode == 0, done.stderr
    return Path(str(target) + ".manifest.json")


def _controls(folder: Path, manifest: Path, ranks: int, name: str, partition: str = "columns") -> str:
    """One control file per rank (rank = N, owned_only), as docs/integrating.md writes them; the template."""
    for rank in range(ranks):
        tables = tuple(TableConfig(layer=layer, manifest=str(manifest), source="disk", rank=rank, order=i,
                                   options=DiskOptions(queue_depth=32), cache_share=0.5, partition=partition)
                       for i, layer in enumerate(LAYERS))
        write_control(ControlFile(engine=EngineConfig(cache_rows=2_000, owned_only=True), tables=tables),
                      folder / f"{name}{rank}.toml")
    return str(folder / f"{name}{{tp_rank}}.toml")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(world: dict, engine: str, ranks: int, out: Path, controls: list[str], *extra: str) -> list[dict]:
    """Start one world of `ranks` rank processes of `engine` (tp_world.py: the engine imported once, each rank a
    fork), wait for all, and read each one's report, or its exit status and log where it wrote none."""
    return _worlds(world, engine, ranks, [(out, controls, extra)])[0]


def _worlds(world: dict, engine: str, ranks: int, runs: list[tuple[Path, list[str], tuple[str, ...]]],
            ) -> list[list[dict]]:
    """Run one world of `ranks` ranks per (out, controls, extra flags) in `runs`, one after another from one
    launcher (one import of the engine), and read each world's reports as `_ranks` does."""
    argv = [sys.executable, str(HERE / "tp_world.py"), str(WORKERS[engine])]
    for k, (out, controls, extra) in enumerate(runs):
        out.mkdir(parents=True, exist_ok=True)
        argv += (["--next"] if k else []) + [
            "--world", str(ranks), "--init", f"tcp://127.0.0.1:{_free_port()}", "--checkpoint",
            str(world[engine]["ckpt"]), "--tokens", str(world["tokens"]), "--out", str(out), "--controls",
            *controls, *extra]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"} | WORKER_ENV[engine]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log = proc.communicate(timeout=RANK_TIMEOUT_S * len(runs))[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)   # the launcher and every rank it forked
            proc.wait()
    out_reports = []
    for out, _, _ in runs:
        assert proc.returncode == 0 and (out / "exits.json").exists(), log[-3000:]
        exits = json.loads((out / "exits.json").read_text())
        reports = []
        for r in range(ranks):
            path = out / f"rank{r}.json"
            rank_log = out / f"rank{r}.log"
            reports.append(json.loads(path.read_text()) if path.exists() else {
                "rank": r, "exit": exits[str(r)], "log": rank_log.read_text()[-3000:] if rank_log.exists() else ""})
        out_reports.append(reports)
    return out_reports


# TP4 (every V4.1 deployment) on both engines; TP2 once, for a second cut of the 24 hash columns. vLLM's head
# shards at TP2 equal our rank regions (tests/test_adapters_vllm.py), so its TP2 world would run the same cut.
@pytest.mark.parametrize("engine, ranks", [("sglang", 4), ("vllm", 4), ("sglang", 2)])
def test_cli_staged_table_on_every_rank_equals_the_engines_sharded_path(world, tmp_path, engine, ranks):
    _needs(engine)
    manifest = _stage(world, f"{engine}{ranks}", world[engine]["ckpt"], ranks)
    other = _stage(world, f"{engine}other{ranks}", world[engine]["other"], ranks)
    m = Manifest.load(manifest)
    assert m.sharding_rule == "hash-columns" and m.ranks == ranks
    served = _controls(tmp_path, manifest, ranks, "rank")
    control = _controls(tmp_path, other, ranks, "other")
    reports = _ranks(world, engine, ranks, tmp_path / "out", [served, control])
    for rep in reports:
        assert "error" not in rep, rep.get("error", rep.get("log"))
    stock = {tuple(rep["runs"]["stock"]["digests"]) for rep in reports}
    assert len(stock) == 1   # the all-reduce gave every rank the same rows
    for rep in reports:
        run = rep["runs"][served]
        assert "error" not in run, run["error"]
        assert run["served_layers"] == list(LAYERS) and run["table_rows"] == {"1": 0, "14": 0}   # plug-in active
        assert run["engine_rows"] > 0 and not run["in_step"]
        assert run["rows"] == STEPS * TOKENS * len(LAYERS) * 24 and run["mismatches"] == 0
        assert run["mismatches_shifted"] > run["rows"] // 2   # the comparison can fail
        assert run["digests"] == rep["runs"]["stock"]["digests"]
        # another checkpoint's table through the same path: every rank's loader refuses it in one line, naming the
        # checkpoint it was staged from, before a row is served (the checkpoint identity)
        neg = rep["runs"][control]
        assert "error" in neg and neg["error"]["type"] == "SlackTierError", neg
        message = neg["error"]["message"].strip()
        assert message.startswith("[checkpoint]") and "\n" not in message, message
        assert "mismatches" not in neg


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_a_rank_killed_mid_step_fails_the_others_next_collective_as_the_engines_own(world, tmp_path, engine):
    """Rank 1 is SIGKILLed in step 1, after its begin_step and before the layers' collective (SGLang's all-reduce,
    vLLM's all-gather). Rank 0's collective then fails with the error the engine's stock path raises in the same
    place; its step is ended (no step left open), and every step it returned before is the stock one (no row of
    another table, none half-filled)."""
    _needs(engine)
    manifest = _stage(world, f"{engine}kill2", world[engine]["ckpt"], 2)
    served = _controls(tmp_path, manifest, 2, "rank")
    die = ("--die-at-step", "1", "--die-rank", "1")
    stock, plugged = _worlds(world, engine, 2, [(tmp_path / "stock", [], die),
                                                (tmp_path / "plugged", [served], ("--skip-stock", *die))])
    for reports in (stock, plugged):
        assert reports[1].get("exit") == -9 and "runs" not in reports[1]   # killed: it wrote nothing
    want = stock[0]["error"]
    assert want["type"] in ("RuntimeError", "DistBackendError") and len(stock[0]["runs"]["stock"]["digests"]) == 1
    assert "error" not in plugged[0], plugged[0]["error"]
    run = plugged[0]["runs"][served]
    assert run["error"]["type"] == want["type"], (run["error"], want)
    # gloo's words for a lost peer vary with timing, in the stock path too ("Connection reset by peer" when the
    # read fails, "Connection closed by peer" when the close is seen first)
    for message in (want["message"], run["error"]["message"]):
        assert re.search(r"Connection (reset|closed) by peer", message), message
    assert run["error"]["in_step"] is False   # end_step ran after the failed forward
    assert run["digests"] == stock[0]["runs"]["stock"]["digests"]   # step 0, served, equal to stock's step 0
