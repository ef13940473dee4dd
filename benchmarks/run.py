"""One runner for the benchmark suites: `python -m benchmarks.run SUITE [--config NAME]`.

    python -m benchmarks.run --list                       # suites, their presets and what each runs
    python -m benchmarks.run micro --config quick         # one suite, one preset (default: quick)
    python -m benchmarks.run headline                     # what `make bench` runs
    python -m benchmarks.run micro --before HEAD~5 --after HEAD --rounds 3    # A/B: two commits, one suite
    python -m benchmarks.run micro --only bench_tables_hash --before HEAD~5   # A/B of one script

Each job is a script of the suite run in a fresh process from the repository
root (`python -m benchmarks.<suite>.<script> ARGS`); it prints its own table and
may write a PNG. A script that calls `_harness.write_result` leaves its figures
as JSON in the run's folder (runs/bench/<suite>-<config>-<utc>/); the runner
adds a summary.json (machine, commit, each job's command, exit code, seconds,
figures) and prints one table.

A/B (`--before REV [--after REV]`): each revision is checked out in a
worktree of its own (a temporary `git worktree add --detach`), and this tree's
benchmark scripts run against each revision's package (PYTHONPATH=<worktree>/src),
interleaved: every round runs each job once per side in a shuffled order, so the
machine's drift falls on both. Reported per figure: median before, median after,
after / before. Without --after the working tree is the after side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the repo root: benchmarks.* imports
from benchmarks._harness import RESULT_ENV, ROOT, format_table, interleaved, machine, utc_stamp  # noqa: E402


@dataclass(frozen=True)
class Job:
    """One script of a suite and its arguments."""

    script: str                      # module under benchmarks/, e.g. "micro.bench_tables_hash"
    args: tuple[str, ...] = ()
    needs: str = ""                  # what it needs beyond the CPU build (said in --list), e.g. "fio"

    def command(self) -> list[str]:
        return [sys.executable, "-m", f"benchmarks.{self.script}", *self.args]


@dataclass
class Suite:
    """A folder of benchmarks and its named presets (preset name -> jobs)."""

    about: str
    presets: dict[str, tuple[Job, ...]] = field(default_factory=dict)


SUITES_FILE = Path(__file__).with_name("suites.toml")


def load_suites(path: Path = SUITES_FILE) -> dict[str, Suite]:
    """The suites and their presets from `path` (benchmarks/suites.toml), each job's script checked to exist."""
    doc = tomllib.loads(path.read_text())
    suites = {}
    for name, table in doc.items():
        presets = {}
        for preset, jobs in table.items():
            if preset == "about":
                continue
            presets[preset] = tuple(Job(j["script"], tuple(j.get("args", ())), j.get("needs", "")) for j in jobs)
            for job in presets[preset]:
                if not (Path(__file__).parent / (job.script.replace(".", "/") + ".py")).is_file():
                    raise SystemExit(f"{path}: [{name}.{preset}] names {job.script}, which is not a benchmark script")
        suites[name] = Suite(table.get("about", ""), presets)
    return suites


SUITES = load_suites()
# `make bench`: the suites whose headline figures a CPU machine reproduces in well under an hour.
HEADLINE = ("micro", "tier", "engine")


def jobs_of(suite: str, config: str, only: str | None = None) -> tuple[Job, ...]:
    """The jobs of `suite` under preset `config` ("headline" as a suite: every HEADLINE suite's headline jobs),
    only those whose script name contains `only` when given."""
    if suite == "headline":
        jobs = tuple(j for s in HEADLINE for j in SUITES[s].presets["headline"])
    elif suite not in SUITES:
        raise SystemExit(f"unknown suite {suite!r}: one of {', '.join([*SUITES, 'headline'])}")
    elif config not in SUITES[suite].presets:
        raise SystemExit(f"suite {suite!r} has no preset {config!r}: one of {', '.join(SUITES[suite].presets)}")
    else:
        jobs = SUITES[suite].presets[config]
    picked = tuple(j for j in jobs if only is None or only in j.script)
    if not picked:
        raise SystemExit(f"no job of {suite} --config {config} matches --only {only!r}")
    return picked


def list_suites() -> str:
    lines = []
    for name, suite in SUITES.items():
        lines.append(f"{name}: {suite.about}")
        for preset, jobs in suite.presets.items():
            lines.append(f"  --config {preset}")
            lines += [f"    {j.script} {' '.join(j.args)}".rstrip() + (f"   [needs {j.needs}]" if j.needs else "")
                      for j in jobs]
    lines.append(f"headline: the headline preset of {', '.join(HEADLINE)} (make bench)")
    return "\n".join(lines)


@dataclass
class Outcome:
    """One job's run."""

    job: Job
    side: str
    rc: int
    seconds: float
    figures: dict[str, float]


def run_job(job: Job, out: Path, tag: str, side: str = "", src: Path | None = None) -> Outcome:
    """Run `job` from the repo root (with `src` first on PYTHONPATH when given); its figures, if it wrote any."""
    result = out / f"{job.script}{'.' + side if side else ''}.{tag}.json"
    env = dict(os.environ, **{RESULT_ENV: str(result)})
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])])
    print(f"$ {' '.join(job.command()[1:])}" + (f"   [{side}: {src}]" if side else ""), flush=True)
    t0 = time.perf_counter()
    rc = subprocess.run(job.command(), cwd=ROOT, env=env, check=False).returncode
    seconds = time.perf_counter() - t0
    figures = json.loads(result.read_text())["figures"] if result.exists() else {}
    return Outcome(job, side, rc, seconds, figures)


def _commit(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=False).stdout.strip() or "unknown"


def _summary(out: Path, suite: str, config: str, outcomes: list[Outcome], **extra: object) -> None:
    doc = {"suite": suite, "config": config, "utc": utc_stamp(), "machine": machine(), "commit": _commit(ROOT),
           **extra, "jobs": [{"script": o.job.script, "args": list(o.job.args), "side": o.side, "rc": o.rc,
                              "seconds": round(o.seconds, 2), "figures": o.figures} for o in outcomes]}
    (out / "summary.json").write_text(json.dumps(doc, indent=1) + "\n")


def run_suite(jobs: tuple[Job, ...], suite: str, config: str, out: Path) -> int:
    outcomes = [run_job(job, out, str(i)) for i, job in enumerate(jobs)]
    rows = [(o.job.script, "ok" if o.rc == 0 else f"exit {o.rc}", f"{o.seconds:.1f}",
             ", ".join(f"{k} {v:.4g}" for k, v in o.figures.items()) or "-") for o in outcomes]
    print(f"\n{suite} --config {config}, {utc_stamp()}, {machine()}\n")
    print(format_table(("script", "result", "seconds", "figures (write_result)"), rows))
    _summary(out, suite, config, outcomes)
    print(f"\nsummary: {out / 'summary.json'}")
    return 0 if all(o.rc == 0 for o in outcomes) else 1


def _worktree(rev: str, parent: Path) -> Path:
    path = parent / rev.replace("/", "_").replace("~", "-").replace("^", "-")
    proc = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"cannot check out {rev}: {proc.stderr.strip()}")
    return path


def run_ab(jobs: tuple[Job, ...], suite: str, config: str, before: str, after: str | None, rounds: int, seed: int,
           out: Path) -> int:
    with tempfile.TemporaryDirectory(prefix="slacktier-ab-") as tmp:
        trees = {"before": _worktree(before, Path(tmp))}
        trees["after"] = _worktree(after, Path(tmp)) if after else ROOT
        try:
            outcomes = [run_job(job, out, f"r{r}", side, trees[side] / "src")
                        for r, (job, side) in interleaved([(j, s) for j in jobs for s in trees], rounds, seed)]
        finally:
            for side, tree in trees.items():
                if tree != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                                   capture_output=True, check=False)
    commits = {"before": before, "after": after or f"{_commit(ROOT)} (working tree)"}
    rows = []
    for job in jobs:
        runs = {s: [o for o in outcomes if o.job is job and o.side == s] for s in commits}
        failed = sum(o.rc != 0 for s in runs for o in runs[s])
        secs = {s: statistics.median(o.seconds for o in runs[s]) for s in commits}
        rows.append((job.script, "wall seconds of the script", f"{secs['before']:.2f}", f"{secs['after']:.2f}",
                     f"{secs['after'] / secs['before']:.2f}", f"{failed} failed" if failed else "ok"))
        names = sorted({k for s in runs for o in runs[s] for k in o.figures})
        for name in names:
            vals = {s: [o.figures[name] for o in runs[s] if name in o.figures] for s in commits}
            if not all(vals.values()):
                continue
            med = {s: statistics.median(v) for s, v in vals.items()}
            ratio = f"{med['after'] / med['before']:.2f}" if med["before"] else "-"
            rows.append(("", name, f"{med['before']:.4g}", f"{med['after']:.4g}", ratio,
                         f"{len(vals['before'])}+{len(vals['after'])} runs"))
    print(f"\nA/B {suite} --config {config}: before {commits['before']}, after {commits['after']}; {rounds} rounds, "
          f"shuffled per round; {utc_stamp()}, {machine()}\n")
    print(format_table(("script", "figure", "before (median)", "after (median)", "after / before", "runs"), rows))
    _summary(out, suite, config, outcomes, before=commits["before"], after=commits["after"], rounds=rounds)
    print(f"\nsummary: {out / 'summary.json'}")
    return 0 if all(o.rc == 0 for o in outcomes) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    ap.add_argument("suite", nargs="?", help=f"one of {', '.join([*SUITES, 'headline'])}")
    ap.add_argument("--config", help="the preset: quick (default) or headline")
    ap.add_argument("--only", help="run only the jobs whose script name contains this (e.g. bench_tables_hash)")
    ap.add_argument("--list", action="store_true", help="print the suites, presets and jobs, and exit")
    ap.add_argument("--before", help="A/B: the earlier commit (any git revision)")
    ap.add_argument("--after", help="A/B: the later commit (default: the working tree)")
    ap.add_argument("--rounds", type=int, default=3, help="A/B: rounds, each job once per side per round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="where results go (default runs/bench/<suite>-<config>-<utc>)")
    args = ap.parse_args(argv)
    if args.list or not args.suite:
        print(list_suites())
        return 0
    config = args.config or ("headline" if args.suite == "headline" else "quick")
    jobs = jobs_of(args.suite, config, args.only)   # a bad name fails before anything runs
    if args.after and not args.before:
        raise SystemExit("--after needs --before")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = args.out or ROOT / "runs" / "bench" / f"{args.suite}-{config}{'-ab' if args.before else ''}-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    if args.before:
        return run_ab(jobs, args.suite, config, args.before, args.after, args.rounds, args.seed, out)
    return run_suite(jobs, args.suite, config, out)


if __name__ == "__main__":
    sys.exit(main())
