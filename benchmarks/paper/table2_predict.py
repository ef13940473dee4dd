"""The planner's prediction of Table 2's "4 disks" rows against their measurement (issue 27): RMSE, R^2, kappa.

Reads the dated "4 disks" blocks of docs/bench-log/table2.md (bench_full_rank.py's tables) and predicts each
row's stall with Eq. 1 over the device read-time model (plan.device_exposure): T_l from the model's terms, fitted
before the runs by bench_probe_readfit.py; the pages per layer from the row (they equal the traffic's own
counts, which `bench_full_rank.py pages` gives without timing anything: 706 / 353 on agent at B=128); the
windows from the profile; s from the row (the host pass, issue 28's subject). kappa is fitted on the agent
rows and the chat rows are predicted with it, held out.

    .venv/bin/python benchmarks/table2_predict.py --log docs/bench-log/table2.md \\
        --model 3.229,0.01344,0.01402,0
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np

from slacktier.plan.exposure import device_exposure
from slacktier.plan.readmodel import DeviceReadModel, LayerPages
from slacktier.serve.timeline import load_profile

ROW = re.compile(r"^\s*(\d+) (\S+)\s+3\s+([\d.]+)\s+([\d.]+) ms")


def rows(log: Path) -> list[dict]:
    """The measured rows of the last "4 disks" block of each workload."""
    out: dict[str, list[dict]] = {}
    workload = None
    for line in log.read_text().splitlines():
        m = re.match(r'^#### "4 disks".*?, (agent|chat), B=', line)
        if m:
            workload = m.group(1)
            out[workload] = []
            continue
        if line.startswith("#### "):
            workload = None
        r = ROW.match(line)
        if workload and r:
            cells = line.split()
            pages = {}
            for layer, col in ((1, -6), (14, -3)):   # hit, pg, read per layer, then s
                if cells[col] != "-":
                    pages[layer] = float(cells[col])
            out[workload].append({"workload": workload, "placement": r.group(2), "stall": float(r.group(4)),
                                  "s": float(cells[-1]), "pages": pages})
    return [x for v in out.values() for x in v]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--log", type=Path, default=Path("docs/bench-log/table2.md"))
    ap.add_argument("--model", required=True, help="a,b,c,c_behind in ms (bench_probe_readfit.py's fit)")
    args = ap.parse_args(argv)
    model = DeviceReadModel(*(float(x) for x in args.model.split(",")))
    profile = load_profile("v41_paper")
    table = rows(args.log)
    if not table:
        ap.error(f"no \"4 disks\" rows in {args.log}")
    for r in table:
        t = profile.times(128, r["workload"], (1, 14))
        loads = [LayerPages(l, "disk", p, i) for i, (l, p) in enumerate(sorted(r["pages"].items()))]
        e = device_exposure(loads, {l: t.windows_ms[l] for l in r["pages"]}, {"disk": model}, resolve_ms=r["s"])
        r["pred"] = e.slowdown_ms
    fit = [r for r in table if r["workload"] == "agent"]
    held = [r for r in table if r["workload"] != "agent"]
    kappa = float(np.mean([r["stall"] - r["pred"] for r in fit]))
    print(f"{'workload':8} {'placement':16} {'measured':>9} {'predicted':>9} {'+kappa':>7}")
    for r in table:
        print(f"{r['workload']:8} {r['placement']:16} {r['stall']:9.2f} {r['pred']:9.2f} {r['pred'] + kappa:7.2f}")
    for name, sel in (("agent (kappa fitted here)", fit), ("chat (held out)", held), ("all", table)):
        meas = np.array([r["stall"] for r in sel])
        pred = np.array([r["pred"] + kappa for r in sel])
        rmse = float(np.sqrt(np.mean((meas - pred) ** 2)))
        r2 = 1 - float(np.sum((meas - pred) ** 2)) / float(np.sum((meas - meas.mean()) ** 2))
        print(f"{name}: RMSE {rmse:.2f} ms, R^2 {r2:.3f} ({len(sel)} rows)")
    print(f"kappa (agent rows) {kappa:.2f} ms; model {model}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
