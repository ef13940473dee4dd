"""The serving loop: replayed sessions (workloads.replay.Step records) through a real model.

Not transformers' continuous batching: its paged cache
(`generation/continuous_batching/cache.py`, `group_layers_by_attn_type`) accepts
only full and sliding attention layers and raises "Invalid layer type" for
DeepSeek-V4's compressed_sparse / heavily_compressed layers (whose compressor
state lives in V4's own cache layers; the model is `_is_stateful`) and for
Qwen4Exp's linear_attention / indexed_attention layers. So this is a small
batched loop over the same model objects with one transformers `DynamicCache`
per session; V4.1 runs each step layer-major
(`models.deepseek_v41.V41Model.forward_step`).

The schedule is the replay's (`workloads.replay.replay_steps`): B sessions at
once, each assistant turn's prompt prefilled in chunks on the session's cache,
then N decode steps teacher-forced from the original reply (so the lookups
are those of real text, not of a random-weight model's output), prefill and
decode in separate steps. Pulling the next Step (scheduling and hashing) is
part of the measured step, and the step's lookups are issued before its
forward. The greedy token (argmax) at every prompt end and decode step is
recorded as the model's output.

"Step time" is over decode steps only, as in the paper.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.serve.runners import Runner, StepItem


@dataclass(frozen=True)
class LoopConfig:
    """What the loop records and when it stops."""

    max_steps: int | None = None     # stop after this many steps (None: the whole replay)
    record_digests: bool = False     # sha1 of the step's logits (bit-exact checks)
    rss_every_steps: int = 1         # read VmRSS every k steps


@dataclass
class StepRecord:
    """One step as measured."""

    index: int
    kind: str                 # "prefill" | "decode"
    sessions: int
    tokens: int
    step_ms: float            # next(step) + issue + forward + argmax
    issue_ms: float           # step start -> all lookups issued
    rss_bytes: int
    digest: str = ""
    stats: object = None      # what `step_stats` returned after the step (arm 0's when paired)
    arm_ms: tuple[float, ...] = ()     # paired: each arm's step time (arm 0's is step_ms)
    arm_stats: tuple[object, ...] = ()  # paired: what `step_stats` returned after each arm
    mismatch: int = 0         # paired: arms whose logits differ from arm 0's at this step


@dataclass
class TurnRecord:
    """One assistant turn of one session."""

    session: int
    turn: int
    ttft_ms: float            # turn arrival (previous turn done) -> first token (prompt end)
    tpot_ms: float            # per decode step after the first token
    tokens: tuple[int, ...]   # greedy tokens: at the prompt end, then after each decode step


@dataclass
class ReplayResult:
    """Everything one replay measured."""

    steps: list[StepRecord] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    wall_s: float = 0.0

    def decode_step_ms(self) -> np.ndarray:
        """Step times of decode steps, in order."""
        return np.array([s.step_ms for s in self.steps if s.kind == "decode"], dtype=np.float64)

    def summary(self) -> dict[str, float]:
        """Mean and p99 decode step, TPOT, TTFT, peak RSS."""
        dec = self.decode_step_ms()
        ttft = np.array([t.ttft_ms for t in self.turns], dtype=np.float64)
        tpot = np.array([t.tpot_ms for t in self.turns if np.isfinite(t.tpot_ms)], dtype=np.float64)

        def pct(a: np.ndarray, q: float) -> float:
            return float(np.percentile(a, q)) if a.size else float("nan")

        return {
            "decode_steps": float(dec.size),
            "step_ms": float(dec.mean()) if dec.size else float("nan"),
            "step_p99_ms": pct(dec, 99),
            "tpot_ms": float(tpot.mean()) if tpot.size else float("nan"),
            "ttft_p50_ms": pct(ttft, 50),
            "ttft_p99_ms": pct(ttft, 99),
            "rss_peak_bytes": float(max((s.rss_bytes for s in self.steps), default=0)),
            "turns": float(len(self.turns)),
        }


def rss_bytes() -> int:
    """Resident memory of this process (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise SlackTierError(ErrorKind.UNAVAILABLE, "no VmRSS in /proc/self/status", fix="run on Linux")


@dataclass
class _Session:
    cache: object
    seen: int = 0             # tokens in the cache
    turn: int = 0
    arrival_s: float = 0.0
    first_s: float = 0.0
    greedy: list[int] = field(default_factory=list)
    decoded: int = 0


def _runs(session_ids: np.ndarray) -> list[tuple[int, int, int]]:
    """(session, start, end) of each run of equal consecutive session ids: [3,3,5] -> [(3,0,2),(5,2,3)]."""
    cuts = np.flatnonzero(np.diff(session_ids)) + 1
    bounds = np.concatenate([[0], cuts, [len(session_ids)]])
    return [(int(session_ids[a]), int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def replay(runner: Runner, sessions: Sequence, steps: Iterable, decode_tokens: int,
           config: LoopConfig = LoopConfig(), after_begin: Callable[[], None] | None = None,
           step_stats: Callable[[], object] | None = None, arms: Sequence | None = None) -> ReplayResult:
    """Run every Step of `steps` (workloads.replay.replay_steps over `sessions`) through `runner`.

    `step_stats`, called after each step (each arm), adds per-step measurements to its record.
    `arms`: row providers to compare side by side. Each step then runs once per arm, each arm with its own
    session caches, in an order that rotates step by step; `arm_ms` holds the arms' step times and
    `arm_stats` their stats. Arm 0's time is `step_ms`; a step whose logits differ between arms counts in
    `mismatch` (a bit-exactness check on every step). Pairing step by step keeps slow drifts of a
    shared machine's load out of the comparison.
    """
    n_arms = len(arms) if arms else 1
    live: dict[int, list] = {}
    state: dict[int, _Session] = {}
    result = ReplayResult()
    start = time.perf_counter()
    it: Iterator = iter(steps)
    rss = rss_bytes()
    last_turn_end: dict[int, float] = {}
    while config.max_steps is None or len(result.steps) < config.max_steps:
        t_next = time.perf_counter()
        step = next(it, None)
        if step is None:
            break
        next_ms = (time.perf_counter() - t_next) * 1e3
        runs = _runs(step.session_ids)
        for sid, a, b in runs:
            if sid not in state:
                state[sid] = _Session(None, arrival_s=last_turn_end.get(sid, start))
                live[sid] = [runner.new_cache() for _ in range(n_arms)]
            s = state[sid]
            if int(step.positions[a]) != s.seen:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"session {sid} step feeds position {step.positions[a]} "
                                     f"but its cache holds {s.seen} tokens", fix="replay steps in order")
        arm_ms, arm_issue, arm_stats, arm_logits = [0.0] * n_arms, [0.0] * n_arms, [None] * n_arms, [None] * n_arms
        for j in range(n_arms):
            k = (step.index + j) % n_arms
            if arms:
                runner.set_provider(arms[k])
            items = [StepItem(step.tokens[a:b], live[sid][k]) for sid, a, b in runs]
            marks = {}

            def begun() -> None:
                marks["issued"] = time.perf_counter()
                if after_begin is not None:
                    after_begin()

            t0 = time.perf_counter()
            logits = runner.run(items, step.ids, after_begin=begun)
            greedy = [int(torch.argmax(l)) for l in logits]
            t1 = time.perf_counter()
            arm_ms[k] = (t1 - t0) * 1e3 + next_ms
            arm_issue[k] = (marks.get("issued", t0) - t0) * 1e3 + next_ms
            arm_logits[k] = logits
            if step_stats is not None:
                arm_stats[k] = step_stats()
            if k == 0:
                greedy0, t_end0 = greedy, t1
        mismatch = sum(any(not torch.equal(x, y) for x, y in zip(arm_logits[0], arm_logits[k]))
                       for k in range(1, n_arms))
        digest = ""
        if config.record_digests:
            h = hashlib.sha1()
            for l in arm_logits[0]:
                h.update(l.contiguous().view(torch.uint8).numpy().tobytes())
            digest = h.hexdigest()
        if len(result.steps) % config.rss_every_steps == 0:
            rss = rss_bytes()
        result.steps.append(StepRecord(step.index, step.kind, len(runs), step.num_tokens, arm_ms[0], arm_issue[0],
                                       rss, digest, arm_stats[0], tuple(arm_ms) if arms else (),
                                       tuple(arm_stats) if arms else (), mismatch))
        t1 = t_end0
        for (sid, a, b), tok in zip(runs, greedy0):
            s = state[sid]
            s.seen += b - a
            ts = sessions[sid]
            reply_start = int(ts.reply_start[s.turn])
            if step.kind == "prefill" and s.seen == reply_start:
                s.first_s, s.greedy, s.decoded = t1, [tok], 0
            elif step.kind == "decode":
                s.greedy.append(tok)
                s.decoded += 1
                n_decode = min(decode_tokens, int(ts.reply_end[s.turn]) - reply_start)
                if s.decoded == n_decode:
                    result.turns.append(TurnRecord(sid, s.turn, (s.first_s - s.arrival_s) * 1e3,
                                                   (t1 - s.first_s) * 1e3 / n_decode, tuple(s.greedy)))
                    s.turn += 1
                    s.arrival_s = t1
                    last_turn_end[sid] = t1
                    if s.turn == ts.num_replies:
                        del live[sid]  # session done: its caches go
    result.wall_s = time.perf_counter() - start
    return result
