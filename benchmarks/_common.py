"""Shared by the benchmark scripts: the run's command, time and machine, and recording a run in BENCHMARKS.md.

Every script appends to its own section (and maybe subsection) of BENCHMARKS.md
while other areas edit theirs, so `append_to_section` re-reads the file right
before the edit and touches nothing outside the named section.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"


def utc_stamp() -> str:
    """Now, as '2026-11-29 13:40 UTC'."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def command_line(script: str | Path, argv: list[str] | None = None) -> str:
    """The command that ran `script` (its __file__) with this process's arguments, as typed from the repo root."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join([".venv/bin/python", f"benchmarks/{Path(script).name}", *args])


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


def append_to_section(block: str, section: str, subsection: str | None = None, path: Path = BENCHMARKS_MD) -> None:
    """Insert `block` at the end of `subsection` inside the '## ' `section` (adding the subsection at the section's
    end if absent), or at the end of `section` when no subsection is named; one blank line around the block."""
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
    """Print a benchmark's block; with `append`, also add it to BENCHMARKS.md (`append_to_section`). Returns 0."""
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
    `report(measure(count), args)` (to `subsection` of BENCHMARKS.md)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument(f"--{option}", type=int, default=default)
    ap.add_argument("--append", action="store_true", help=f"append the table to BENCHMARKS.md ({subsection})")
    args = ap.parse_args()
    return publish(report(measure(getattr(args, option)), args), args.append, section, subsection)


def against_main(doc: str, what: str, rounds: int, section: str, subsection: str, measure, report) -> int:
    """main() of a bench that runs an earlier commit's `what` beside this tree's: parses --against COMMIT,
    --rounds and --append, then publishes `report(measure(commit, rounds), commit, args)` (to `subsection`)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--against", required=True, help=f"the earlier commit whose {what} runs beside")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--append", action="store_true", help=f"append the table to BENCHMARKS.md ({subsection})")
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
