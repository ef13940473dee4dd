"""Running the jobs: one rig, every job in the shuffled order, typed records; results.json at the end."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from benchmarks.e2e.config import E2EConfig
from benchmarks.e2e.jobs import BenchPlacement, Experiment, Job, placements, plan_jobs
from benchmarks.rig.placements import DelayedRowProvider
from benchmarks.rig.records import record_from_json, record_to_json
from slacktier.serve.runs import ReplayRig, RigConfig, RunRecord


@dataclass
class E2ERun:
    """A run record with the experiment its placement belongs to."""

    experiment: Experiment
    split_f: float | None
    record: RunRecord


@dataclass
class Results:
    """Everything one benchmark measured, and what it needs to be read again."""

    config: E2EConfig
    layers: tuple[int, ...]
    model: dict[str, Any]              # the model preset's fields, for the report's header
    table_rows: tuple[int, ...]
    stage_s: float
    runs: list[E2ERun] = field(default_factory=list)
    wall_s: float = 0.0
    finished_utc: str = ""

    def to_json(self) -> dict[str, Any]:
        """Plain data for results.json."""
        return {"config": dataclasses.asdict(self.config), "layers": list(self.layers), "model": self.model,
                "table_rows": list(self.table_rows), "stage_s": self.stage_s, "wall_s": self.wall_s,
                "finished_utc": self.finished_utc,
                "runs": [{"experiment": r.experiment.value, "split_f": r.split_f, "record": record_to_json(r.record)}
                         for r in self.runs]}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Results:
        """The results `to_json` wrote."""
        c = dict(doc["config"])
        c["rig"] = RigConfig(**c["rig"])
        for key in ("workloads", "batches", "split_fs"):
            c[key] = tuple(c[key])
        c["delays_ms"] = tuple(tuple(d) for d in c["delays_ms"])
        return cls(E2EConfig(**c), tuple(doc["layers"]), doc["model"], tuple(doc["table_rows"]), doc["stage_s"],
                   [E2ERun(Experiment(r["experiment"]), r["split_f"], record_from_json(r["record"]))
                    for r in doc["runs"]], doc.get("wall_s", 0.0), doc.get("finished_utc", ""))


def save(results: Results, path: Path) -> Path:
    """Write results.json."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results.to_json(), indent=1, default=float))
    return path


def load(path: Path) -> Results:
    """Read results.json."""
    return Results.from_json(json.loads(Path(path).read_text()))


def run_all(cfg: E2EConfig, progress: bool = False,
            on_run: Callable[[int, int, RunRecord], None] | None = None) -> Results:
    """Run every job; results also go to workdir/results.json (and, run by run, results.partial.jsonl)."""
    rig = ReplayRig(cfg.rig, progress=progress)
    places: dict[str, BenchPlacement] = placements(cfg, rig.first, rig.second)
    jobs: list[Job] = plan_jobs(cfg, places)
    results = Results(cfg, rig.layer_ids, dataclasses.asdict(rig.model_cfg), rig.table_rows, rig.stage_s)
    t0 = time.perf_counter()
    partial = Path(cfg.rig.workdir) / "results.partial.jsonl"
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text("")
    try:
        for i, job in enumerate(jobs):
            bp = places[job.placement]
            delays = dict(bp.delays_ms)
            rec = rig.run(job.workload, job.batch, bp.placement, job.rep, i, paired=job.paired,
                          wrap=(lambda p, d=delays: DelayedRowProvider(p, d)) if delays else None)
            rec.delays_ms = delays
            results.runs.append(E2ERun(bp.experiment, bp.split_f, rec))
            with partial.open("a") as f:   # survives an interrupted benchmark
                f.write(json.dumps(record_to_json(rec), default=float) + "\n")
            if on_run is not None:
                on_run(i, len(jobs), rec)
    finally:
        rig.close()
    results.wall_s = time.perf_counter() - t0
    results.finished_utc = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    save(results, Path(cfg.rig.workdir) / "results.json")
    return results
