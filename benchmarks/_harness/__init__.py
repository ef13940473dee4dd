"""The benchmarks' shared harness: the run's command, time and machine, interleaved shuffled rounds, a table, a
PNG, a JSON result, and recording a dated run in its docs/bench-log/<area>.md file.

Every script appends to its own section (and maybe subsection) of the bench-log
file that holds it (`bench_log`) while other areas edit theirs, so
`append_to_section` re-reads the file right before the edit and touches nothing
outside the named section. BENCHMARKS.md holds only the headline figures; it is
edited by hand from these logs.

A script run by `python -m benchmarks.run` also finds SLACKTIER_BENCH_RESULT in
its environment: `write_result` puts its figures there as JSON, which the runner
collects (and compares, in an A/B run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[2]
BENCH_LOG = ROOT / "docs" / "bench-log"
RESULT_ENV = "SLACKTIER_BENCH_RESULT"   # set by benchmarks.run: where write_result puts a script's figures
T = TypeVar("T")


def utc_stamp() -> str:
    """Now, as '2026-11-29 13:40 UTC'."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def command_line(script: str | Path, argv: list[str] | None = None) -> str:
    """The command that ran `script` (its __file__) with this process's arguments, as typed from the repo root."""
    args = sys.argv[1:] if argv is None else argv
    path = Path(script).resolve()
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else Path("benchmarks") / path.name
    return " ".join([".venv/bin/python", str(rel), *args])


def cpu_model() -> str:
    """CPU model name and family/model numbers from /proc/cpuinfo (Linux), else what the platform module knows."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields = dict(re.findall(r"^(model name|cpu family|model)\s*:\s*(.+)$", info, re.M)[:3])
    return f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')})"


def machine() -> str:
    """One line about this machine, e.g. '2 cores (AMD EPYC (family 25, model 1)), 24 GiB, x86_64, Linux 6.8, host h'."""
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} cores ({cpu_model()}), {mem_gib:.0f} GiB, {platform.machine()}, "
            f"Linux {platform.release()}, host {platform.node()}")


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend; imported on first use, so a run without plots needs no
    matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: str | Path, **savefig_kwargs) -> None:
    """Write `fig` to `path`, creating its directory (kwargs to savefig, dpi 120 unless given)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, **{"dpi": 120, **savefig_kwargs})


def bench_log(section: str, subsection: str | None = None) -> Path:
    """The docs/bench-log/<area>.md file that holds the '## ' `section`: of those, the one that also holds
    `subsection` under it, else the one with the most subsections under it (hot-path.md repeats the tier's
    section heading for its one subsection)."""
    holders: list[tuple[int, Path]] = []
    for path in sorted(BENCH_LOG.glob("*.md")):
        lines = path.read_text().split("\n")
        if section in lines:
            after = lines[lines.index(section) + 1:]
            end = next((i for i, line in enumerate(after) if line.startswith("## ")), len(after))
            if subsection is not None and subsection in after[:end]:
                return path
            holders.append((sum(line.startswith("### ") for line in after[:end]), path))
    if not holders:
        raise SystemExit(f"no file in {BENCH_LOG} has the section {section!r}: add it to the area's log first")
    return max(holders, key=lambda h: h[0])[1]


def append_to_section(block: str, section: str, subsection: str | None = None, path: Path | None = None) -> None:
    """Insert `block` at the end of `subsection` inside the '## ' `section` (adding the subsection at the section's
    end if absent), or at the end of `section` when no subsection is named; one blank line around the block.
    The file is `path`, else the bench-log file that holds the section (`bench_log`)."""
    path = bench_log(section, subsection) if path is None else path
    lines = path.read_text().split("\n")
    start = lines.index(section)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    if subsection is not None:
        sub = next((i for i in range(start + 1, end) if lines[i] == subsection), None)
        if sub is None:
            lines[end:end] = ["", subsection]
            sub = end + 1
        end = next((i for i in range(sub + 1, len(lines)) if lines[i].startswith(("## ", "### "))), len(lines))
    head = "\n".join(lines[:end]).rstrip("\n")
    rest = "\n".join(lines[end:]).lstrip("\n")
    body = block.strip("\n")
    path.write_text(f"{head}\n\n{body}\n" + (f"\n{rest}" if rest else ""))


def publish(block: str, append: bool, section: str, subsection: str | None = None) -> int:
    """Print a benchmark's block; with `append`, also add it to its bench-log file (`append_to_section`).
    Returns 0."""
    print(block)
    if append:
        append_to_section(block, section, subsection)
    return 0


def git_show(commit: str, path: str, missing_ok: bool = False) -> str | None:
    """The text of `path` (from the repository root) at `commit`; when it has none, None with `missing_ok`, else
    exit with git's message."""
    proc = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:{path}"], capture_output=True, text=True,
                          check=False)
    if proc.returncode == 0:
        return proc.stdout
    if missing_ok and subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet",
                                      f"{commit}^{{commit}}"], capture_output=True, check=False).returncode == 0:
        return None
    raise SystemExit(f"cannot read {path} at {commit}: {proc.stderr.strip()}")


def count_main(doc: str, option: str, default: int, section: str, subsection: str, measure, report) -> int:
    """main() of a bench with one count (`--rounds`, `--steps`, ...) and --append: publishes
    `report(measure(count), args)` (to `subsection` of its bench-log file)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument(f"--{option}", type=int, default=default)
    ap.add_argument("--append", action="store_true", help=f"append the table to its bench-log file ({subsection})")
    args = ap.parse_args()
    return publish(report(measure(getattr(args, option)), args), args.append, section, subsection)


def against_main(doc: str, what: str, rounds: int, section: str, subsection: str, measure, report) -> int:
    """main() of a bench that runs an earlier commit's `what` beside this tree's: parses --against COMMIT,
    --rounds and --append, then publishes `report(measure(commit, rounds), commit, args)` (to `subsection`)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--against", required=True, help=f"the earlier commit whose {what} runs beside")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--append", action="store_true", help=f"append the table to its bench-log file ({subsection})")
    args = ap.parse_args()
    return publish(report(measure(args.against, args.rounds), args.against, args), args.append, section, subsection)


def thread_timed(fn, into: list[int]):
    """`fn`, wrapped to append the thread CPU ns of each call to `into` (each call adds two clock reads)."""
    def call(*args):
        c0 = time.thread_time_ns()
        r = fn(*args)
        into.append(time.thread_time_ns() - c0)
        return r
    return call


def interleaved(variants: Sequence[T], rounds: int, seed: int = 0) -> Iterator[tuple[int, T]]:
    """(round, variant) for `rounds` rounds, every variant once per round in a freshly shuffled order: the
    machine's drift falls on all variants alike (seeded, so a rerun runs the same order)."""
    rng = random.Random(seed)
    for r in range(rounds):
        order = list(variants)
        rng.shuffle(order)
        for v in order:
            yield r, v


def drop_file_cache(path: str | Path) -> None:
    """Write back and drop `path`'s pages from the OS page cache (posix_fadvise DONTNEED), so what reads it next
    starts with none of them resident."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table a person can read (and paste into a bench-log file)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_result(bench: str, figures: dict[str, float], path: str | Path | None = None,
                 **context: object) -> Path | None:
    """Write this run's `figures` (name -> number; the runner compares them in an A/B run) as JSON with the
    machine stamp, the command and `context`, to `path`, else to $SLACKTIER_BENCH_RESULT when the runner set it;
    returns the file written, or None when neither names one."""
    target = path or os.environ.get(RESULT_ENV)
    if not target:
        return None
    doc = {"bench": bench, "figures": {k: float(v) for k, v in figures.items()}, "machine": machine(),
           "utc": utc_stamp(), "command": command_line(sys.argv[0]), **context}
    out = Path(target)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return out


def timed_step(engine, ids, end_us: list | None = None, decode=None) -> tuple[float, float, object]:
    """One whole engine step on `ids`: (begin_step wall us, begin_step thread CPU us, the step's counters);
    end_step's wall us appended to `end_us` when given; `decode`: the tokens' decode flags, passed to
    begin_step when given."""
    c0 = time.thread_time_ns()
    t0 = time.perf_counter_ns()
    if decode is None:
        engine.begin_step(ids)
    else:
        engine.begin_step(ids, decode)
    t1 = time.perf_counter_ns()
    c1 = time.thread_time_ns()
    for layer in engine.layers:
        engine.gather(layer)
    t2 = time.perf_counter_ns()
    counters = engine.end_step()
    if end_us is not None:
        end_us.append((time.perf_counter_ns() - t2) / 1e3)
    return (t1 - t0) / 1e3, (c1 - c0) / 1e3, counters
