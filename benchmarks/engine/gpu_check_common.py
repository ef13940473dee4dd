"""What the two GPU check scripts share (gpu_check_sglang.py, gpu_check_vllm.py): no engine is imported here.

Parts run one after another, each under its own time budget, each printing one
summary line (`PART <name> PASS|FAIL|SKIP <seconds>s <facts>`), also appended to
$OUT/summary.txt (or runs/gpu_check/<engine>/) so a killed run still leaves the
lines it printed. Nothing runs a subprocess, so nothing waits on a pipe.

The checkpoint is made here: a V4-shaped Engram checkpoint at a scaled vocab
(`EngramLayout.scaled`: the two layers 1 and 14, 24 hash columns of prime sizes,
256-value fp8 rows with 8 E8M0 scales), with the bytes of a real checkpoint (no
fp8 NaN, scales 2^-12..2^0, no scale byte 0x00, which vLLM's lookup reads as
zero), staged for TP 1 by `stage_checkpoint`; a second checkpoint with another
seed is the negative control.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "src") not in sys.path:   # the package travels as the working tree's src/
    sys.path.insert(0, str(ROOT / "src"))

from slacktier.config import ControlFile, DiskOptions, EngineConfig, TableConfig, write_control  # noqa: E402
from slacktier.tables.engram_hash import EngramLayout  # noqa: E402
from slacktier.tables.stage import stage_checkpoint  # noqa: E402

LAYERS = (1, 14)
DIM = 256


def arguments(engine: str, doc: str) -> argparse.Namespace:
    """The scripts' shared options."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="dress rehearsal on the CPU: everything but the device calls")
    p.add_argument("--vocab", type=int, default=2_000, help="engram_vocab_size of the scaled checkpoint")
    p.add_argument("--engines", type=Path, default=None,
                   help="a folder holding the engine's package, appended to sys.path (the CPU venv's .venv/engines)")
    p.add_argument("--out", type=Path, default=None, help="where the checkpoint and summary go ($OUT by default)")
    p.add_argument("--budget-s", type=float, default=420.0, help="the whole run's time; parts share what is left")
    args = p.parse_args()
    if args.out is None:
        args.out = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "runs" / "gpu_check" / engine
    args.out.mkdir(parents=True, exist_ok=True)
    if args.engines is not None and str(args.engines) not in sys.path:
        sys.path.append(str(args.engines))
    if args.cpu:
        # The engines' Triton kernels run under the interpreter where they are called on the CPU.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return args


@dataclass
class Report:
    """The parts' summary lines, printed and appended to summary.txt as each part ends."""

    path: Path
    lines: list[str] = field(default_factory=list)
    failed: int = 0

    def line(self, text: str) -> None:
        print(text, flush=True)
        self.lines.append(text)
        with open(self.path, "a") as f:
            f.write(text + "\n")


class PartTimeout(Exception):
    """A part ran past its budget."""


@contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    def expire(signum: int, frame: Any) -> None:
        raise PartTimeout(f"past its budget of {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_part(report: Report, name: str, budget_s: float, fn: Callable[[], tuple[bool | None, str]]) -> None:
    """Run one part under `budget_s`; fn returns (passed, facts), passed None for a part skipped (facts say why)."""
    t0 = time.perf_counter()
    try:
        with _alarm(budget_s):
            passed, facts = fn()
    except Exception as exc:   # a part's failure is reported on its line and the next part runs
        traceback.print_exc(file=sys.stdout)
        passed, facts = False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    status = "SKIP" if passed is None else ("PASS" if passed else "FAIL")
    report.failed += passed is False
    report.line(f"PART {name} {status} {time.perf_counter() - t0:.1f}s {facts}")


def device_facts(cpu: bool) -> str:
    if cpu:
        return f"cpu rehearsal (torch {torch.__version__}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')})"
    props = torch.cuda.get_device_properties(0)
    return f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}"


def ensure_entry_point(group: str, value: str, folder: Path) -> str | None:
    """Make `slacktier = value` findable in entry-point `group`, the way the engine's plug-in loader looks for it.

    On the device machine the package travels as the working tree's src/, not pip-installed, so it has no
    dist-info: a minimal one (its METADATA and entry_points.txt) is written into `folder`, which goes on sys.path.
    Returns a note saying so, or None when the entry point was already installed."""
    from importlib import invalidate_caches, metadata

    if any(ep.name == "slacktier" for ep in metadata.entry_points(group=group)):
        return None
    # A distribution of its own name: importlib.metadata keeps one distribution per name, an installed slacktier's
    info = folder / "slacktier_gpu_check-0.1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: slacktier-gpu-check\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\nslacktier = {value}\n")
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
    invalidate_caches()
    return f"entry point written to {info} (the package is not pip-installed here)"


def torchvision_without_compiled_ops() -> None:
    """Let torchvision's Python modules import where its compiled ops cannot load (a CUDA torchvision wheel beside
    a CPU torch: the CPU rehearsal); SGLang's config modules import torchvision.transforms. No torchvision op runs."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    folder = Path(next(iter(spec.submodule_search_locations)))
    library = next(iter(sorted(folder.glob("_C*.so"))), None)
    try:
        if library is not None:
            torch.ops.load_library(str(library))
            return
    except OSError:
        pass
    for op in ("nms", "qnms"):
        try:
            torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:
            pass   # defined by an earlier call in this process


def checkpoint_tables(layout: EngramLayout, seed: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """fp8 rows [rows, 256] and e8m0 scales [rows, 8] per layer, with a real checkpoint's bytes."""
    rng = np.random.default_rng(seed)
    tables = {}
    for layer in LAYERS:
        rows = layout.layer_rows(layer)
        w = rng.integers(0, 256, size=(rows, DIM), dtype=np.uint8)
        w[(w & 0x7F) == 0x7F] ^= 1   # no fp8 NaN
        w[::89, 5] = 0x80            # -0.0 values
        s = rng.integers(115, 128, size=(rows, DIM // 32), dtype=np.uint8)
        tables[layer] = (torch.from_numpy(w).view(torch.float8_e4m3fn), torch.from_numpy(s).view(torch.float8_e8m0fnu))
    return tables


def make_world(folder: Path, vocab: int, device: str) -> SimpleNamespace:
    """The scaled layout, the checkpoint and a negative control's, each staged for TP 1 with a control file."""
    from safetensors.torch import save_file

    layout = EngramLayout.scaled(vocab)
    world = SimpleNamespace(layout=layout, folder=folder, tables={}, controls={})
    for name, seed in (("ckpt", 0), ("other", 1)):
        tables = checkpoint_tables(layout, seed)
        ckpt = folder / f"{name}.safetensors"
        save_file({f"layers.{layer}.engram.embed.{part}": t for layer, (w, s) in tables.items()
                   for part, t in (("weight", w), ("scale", s))}, str(ckpt))
        manifest = stage_checkpoint(ckpt, [folder / f"{name}.bin"], ranks=1, expected=layout, overwrite=True,
                                    progress=False).path
        cfg = ControlFile(engine=EngineConfig(cache_rows=50_000, device=device), tables=tuple(
            TableConfig(layer=layer, manifest=manifest, source="disk", options=DiskOptions(queue_depth=64),
                        cache_share=0.5, order=i) for i, layer in enumerate(LAYERS)))
        world.tables[name] = tables
        world.controls[name] = write_control(cfg, folder / f"{name}.toml")
    world.config = SimpleNamespace(
        engram_layer_ids=list(LAYERS), engram_max_ngram_size=4, engram_n_heads=8, engram_vocab_size=vocab,
        engram_num_embeddings=list(layout.rows_per_layer), engram_head_dim=DIM, engram_pad_token_id=2,
        engram_compressed_vocab_size=99_092, rms_norm_eps=1e-6, hidden_size=64, hc_mult=2)
    return world


PLE_LAYERS = (1, 3)       # decoder layers with a PLE table; PLE layer indices 0 and 1
PLE_VOCAB, PLE_EOS, PLE_BASE = 129_280, 1, 1_000   # the DeepSeek-V4 tokenizer's ids; ngram_vocab_size_base
PLE_DIM = 16 * 256        # ple_embed_dim: 16 heads of SlackTier's 256-value rows
PLE_SCALE = 0.0123        # a per-tensor scale that rounds: the engines' own multiplication runs


def make_ple_world(folder: Path, device: str) -> SimpleNamespace:
    """Two scaled Qwen3.8-hash PLE tables (fp8 rows, a real checkpoint's bytes), staged as SlackTier rows with
    unit E8M0 scales (the plug-ins' format for an fp8 table with a per-tensor scale), a control file serving
    both, and a negative control's (other rows); two requests' prompts and next tokens of real text."""
    from safetensors.torch import save_file

    from slacktier.tables.ple_hash import PleLayout
    from slacktier.tables.tokenizer import encode
    from slacktier.testing.engine import real_text

    layouts = {layer: PleLayout.scaled(PLE_BASE, vocab_size=PLE_VOCAB, eos_token_id=PLE_EOS, ple_layer_index=i,
                                       layer_id=layer) for i, layer in enumerate(PLE_LAYERS)}
    world = SimpleNamespace(layouts=layouts, tables={}, controls={})
    for name, seed in (("ckpt", 0), ("other", 1)):
        tables = {}
        for layer, lay in layouts.items():
            w = np.random.default_rng(seed * 100 + layer).integers(0, 256, size=(lay.rows, 256), dtype=np.uint8)
            w[(w & 0x7F) == 0x7F] ^= 1   # no fp8 NaN
            tables[layer] = torch.from_numpy(w).view(torch.float8_e4m3fn)
        unit = {layer: torch.full((lay.rows, 8), 0x7F, dtype=torch.uint8).view(torch.float8_e8m0fnu)
                for layer, lay in layouts.items()}
        ckpt = folder / f"ple_{name}.safetensors"
        save_file({f"layers.{layer}.engram.embed.{part}": t for layer in PLE_LAYERS
                   for part, t in (("weight", tables[layer]), ("scale", unit[layer]))}, str(ckpt))
        manifest = stage_checkpoint(ckpt, [folder / f"ple_{name}.bin"], ranks=1,
                                    expected={layer: lay.rows for layer, lay in layouts.items()},
                                    column_bounds={layer: lay.column_bounds() for layer, lay in layouts.items()},
                                    overwrite=True, progress=False).path
        cfg = ControlFile(engine=EngineConfig(cache_rows=20_000, device=device), tables=tuple(
            TableConfig(layer=layer, manifest=manifest, source="disk", options=DiskOptions(queue_depth=64),
                        cache_share=0.5, order=i) for i, layer in enumerate(PLE_LAYERS)))
        world.tables[name] = tables
        world.controls[name] = write_control(cfg, folder / f"ple_{name}.toml")
    tokens = np.asarray(encode(real_text(2_000)), dtype=np.int64)
    world.prompts, world.next_tokens = [tokens[:170], tokens[200:321]], tokens[400:410]
    return world


def padded(rows: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """A checkpoint's table: `rows`, then zero rows up to the engine's padded row count."""
    out = torch.zeros(padded_rows, rows.shape[1], dtype=torch.uint8).view(rows.dtype)
    out[:rows.shape[0]] = rows
    return out


def same_rows(got: torch.Tensor, want: torch.Tensor) -> tuple[int, int]:
    """(rows compared, rows that differ) bit for bit over [..., 256] bf16."""
    got, want = got.detach().cpu().reshape(-1, DIM), want.detach().cpu().reshape(-1, DIM)
    if got.shape != want.shape or got.dtype != want.dtype:
        return want.shape[0], want.shape[0]
    differ = (got.view(torch.int16) != want.view(torch.int16)).any(dim=1)
    return want.shape[0], int(differ.sum())


def sync(cpu: bool) -> None:
    if not cpu:
        torch.cuda.synchronize()


def median_us(fn: Callable[[], Any], cpu: bool, repeats: int) -> float:
    """Median wall time of `fn` over `repeats` runs, each synchronized, after one warm-up run."""
    fn()
    sync(cpu)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        sync(cpu)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(times)


@contextmanager
def env(name: str, value: str | None) -> Iterator[None]:
    """`name` set to `value` (None: unset) inside the block."""
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def finish(report: Report) -> int:
    parts = sum(line.startswith("PART ") for line in report.lines)
    report.line(f"SUMMARY {parts} parts, {report.failed} failed")
    return 1 if report.failed else 0
