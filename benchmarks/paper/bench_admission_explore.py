"""Second round of admission rules, beyond `bench_admission`'s families, on held-out traffic.

Families tried here (an experimental kernel of this file, not the served one):
CLOCK with small per-slot counters (decode rows inserted and bumped by more
than prefill rows, prefill hits leaving the counter alone), with or without
the TinyLFU sketch on prefill misses (decode-weighted counts, ageing period,
"admit when not below the victim"); a prefill segment (a FIFO only prefill
misses enter, promoted into CLOCK on a decode hit); and causal admission masks
(a prefill miss admitted only on its row's first sighting, or only on its
k-th). Each family's best is chosen on the FIT half at the same B; the figures
printed are the HELD-OUT half. Beside them: served CLOCK (`cache.simulate`),
the served rule "prefill cold" replayed by the served pass, and Belady with bypass.

    nice -n 5 .venv/bin/python benchmarks/paper/bench_admission_explore.py [--batch 64,128]
        [--workloads agent,chat] [--capacity 1e6]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import numba
import numpy as np

from slacktier.workloads import admission as A
from slacktier.workloads import policies as pol
from slacktier.workloads.characterize import prepare_layer, run_policy
from slacktier.workloads.corpus import CorpusConfig, load_workload
from slacktier.workloads.hashing import EngramLookupHasher
from slacktier.workloads.replay import ReplayConfig, collect_trace, replay_steps

LAYER = 14


@numba.njit(nogil=True, cache=True)
def _kernel(ids, decode, allow, n_items, capacity, maxc, ins_d, ins_p, inc_d, inc_p, pcap, use_sketch, wd, wp, ge,
            bits, reset_every, mult, hit):
    main_cap = capacity - pcap
    where = np.zeros(n_items, np.uint8)
    slot_of = np.full(n_items, -1, np.int32)
    marked = np.zeros(n_items, np.uint8)
    slot_item = np.full(max(main_cap, 1), -1, np.int32)
    cnt = np.zeros(max(main_cap, 1), np.uint8)
    fifo = np.empty(max(pcap, 1), np.int32)
    fh = 0
    fs = 0
    filled = 0
    hand = 0
    shift = np.uint64(64 - bits)
    sketch = np.zeros((A.SKETCH_ROWS, (np.int64(1) << bits) if use_sketch else 1), np.uint8)
    samples = 0
    for i in range(ids.shape[0]):
        x = ids[i]
        dec = decode[i] != 0
        if use_sketch:
            for j in range(A.SKETCH_ROWS):
                k = A._sketch_index(x, j, shift, mult)
                sketch[j, k] = min(A.SKETCH_MAX, sketch[j, k] + (wd if dec else wp))
            samples += 1
            if samples >= reset_every:
                for j in range(A.SKETCH_ROWS):
                    for k in range(sketch.shape[1]):
                        sketch[j, k] >>= 1
                samples = 0
        w = where[x]
        if w == 1:
            hit[i] = 1
            s = slot_of[x]
            cnt[s] = min(max(cnt[s] + (inc_d if dec else inc_p), cnt[s]), maxc)
            continue
        if w == 2:
            hit[i] = 1
            if dec:
                marked[x] = 1
            continue
        hit[i] = 0
        if allow[i] == 0:
            continue
        y = x
        yc = ins_d if dec else ins_p
        filt = use_sketch and not dec
        if not dec and pcap > 0:
            y = -1
            if fs == pcap:
                t = fifo[fh]
                fh += 1
                if fh == pcap:
                    fh = 0
                fs -= 1
                where[t] = 0
                if marked[t]:
                    y = t
                    yc = ins_d
                    filt = False
            fifo[(fh + fs) % pcap] = x
            fs += 1
            where[x] = 2
            marked[x] = 0
            if y < 0:
                continue
        if filled < main_cap:
            s = filled
            filled += 1
        else:
            while cnt[hand] > 0:
                cnt[hand] -= 1
                hand += 1
                if hand == main_cap:
                    hand = 0
            v = slot_item[hand]
            if filt and A._estimate(sketch, y, shift, mult) + ge <= A._estimate(sketch, v, shift, mult):
                continue
            where[v] = 0
            slot_of[v] = -1
            s = hand
            hand += 1
            if hand == main_cap:
                hand = 0
        slot_item[s] = y
        slot_of[y] = s
        cnt[s] = yc
        where[y] = 1


def run(ids, dec, n_items, cap, allow=None, maxc=1, ins_d=1, ins_p=1, inc_d=1, inc_p=1, pshare=0.0, sketch=False,
        wd=1, wp=1, ge=0, width=1.0, reset=40.0) -> np.ndarray:
    m = ids.shape[0]
    al = np.ones(m, np.uint8) if allow is None else allow.astype(np.uint8)
    hit = np.empty(m, np.uint8)
    bits = int(max(16, int(np.ceil(width * cap))) - 1).bit_length()
    _kernel(ids, dec.astype(np.uint8), al, n_items, cap, maxc, ins_d, ins_p, inc_d, inc_p, int(pshare * cap), sketch,
            wd, wp, ge, bits, max(1, int(reset * cap)), A.SKETCH_MULTIPLIERS, hit)
    return hit


@dataclass(frozen=True)
class CountersSketch:
    """Round two's best agent rule as a rule object `workloads.packing.hit_mask` replays with this file's kernel:
    2-bit CLOCK counters (decode misses enter at 2, decode hits add 2, prefill lookups 0 / +0) and a TinyLFU
    sketch on prefill misses (decode lookups counted `decode_weight` times, every counter halved after `reset`
    lookups per cache row). Not served: the engine's pass has no sketch."""

    reset: float = 10.0
    decode_weight: int = 2

    def label(self) -> str:
        return f"counters + TinyLFU(prefill, r{self.reset:g}, decode x{self.decode_weight}) (evaluated, not served)"

    def replay(self, prep, capacity: int) -> np.ndarray:
        return run(prep.ids, prep.decode, prep.n_items, capacity, None, maxc=3, ins_d=2, inc_d=2, ins_p=0, inc_p=0,
                   sketch=True, reset=self.reset, wd=self.decode_weight)


def sightings(ids: np.ndarray) -> np.ndarray:
    """[M] int64: how many lookups of the row came before this one (causal)."""
    m = ids.shape[0]
    o = np.lexsort((np.arange(m), ids))
    start = np.ones(m, bool)
    start[1:] = ids[o[1:]] != ids[o[:-1]]
    run_pos = np.arange(m) - np.maximum.accumulate(np.where(start, np.arange(m), 0))
    out = np.empty(m, np.int64)
    out[o] = run_pos
    return out


def families(dec: np.ndarray, seen: np.ndarray) -> dict[str, list[tuple[str, dict]]]:
    cnt = dict(maxc=3, ins_p=0, inc_p=0)
    fams: dict[str, list[tuple[str, dict]]] = {
        "counters": [(f"CLOCK counters<={m}, decode insert {d} / hit +{h}, prefill 0 / +0",
                      dict(maxc=m, ins_d=d, inc_d=h, ins_p=0, inc_p=0)) for m in (1, 3) for d in (1, 2) for h in (1, 2)
                     if d <= m and h <= m],
        "counters+sketch": [(f"counters<=3, decode 2 / +2, prefill 0 / +0 + TinyLFU(prefill, r{r:g}, decode x{wd}"
                             f"{', >=' if ge else ''})",
                             dict(cnt, ins_d=2, inc_d=2, sketch=True, reset=r, wd=wd, ge=ge))
                            for r in (10.0, 40.0) for wd in (1, 2) for ge in (0, 1)],
        "prefill segment": [(f"prefill FIFO {p:g}, promoted on a decode hit", dict(pshare=p))
                            for p in (0.05, 0.1, 0.2, 0.4)],
        "sighting": [(f"prefill miss admitted cold on its {'first' if k == 0 else f'>= {k + 1}th'} sighting",
                      dict(ins_p=0, allow=dec | ((seen == 0) if k == 0 else (seen >= k)))) for k in (0, 1, 3)],
    }
    return fams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="64,128")
    ap.add_argument("--workloads", default="agent,chat")
    ap.add_argument("--capacity", type=float, default=1e6)
    args = ap.parse_args()
    cap = int(args.capacity)
    hasher = EngramLookupHasher()
    t0 = time.perf_counter()
    print("| workload | B | rule (chosen on fit) | fit decode hit % | held-out decode hit % |")
    print("|---|---:|---|---:|---:|")
    for wl in [w for w in args.workloads.split(",") if w]:
        split = load_workload(wl, CorpusConfig())
        for b in [int(x) for x in args.batch.split(",") if x]:
            preps = {}
            for side, sessions in (("fit", split.fit), ("holdout", split.holdout)):
                tr = collect_trace(replay_steps(list(sessions), hasher, ReplayConfig(batch=b)), hasher, wl, b)
                preps[side] = prepare_layer(tr, LAYER)

            def rate(side, kw):
                p = preps[side]
                kw = dict(kw)
                allow = kw.pop("allow", None)
                if callable(allow):
                    allow = allow(side)
                h = run(p.ids, p.decode, p.n_items, cap, allow, **kw)
                return 100 * float(h[p.decode].mean())

            seen = {s: sightings(p.ids) for s, p in preps.items()}
            for fam, grid in families(preps["fit"].decode, seen["fit"]).items():
                # masks are per side: rebuild the held-out one from the held-out half's own sightings
                scored = []
                for (label, kw), (_, kw_h) in zip(grid, families(preps["holdout"].decode, seen["holdout"])[fam]):
                    scored.append((rate("fit", kw), label, kw_h))
                best = max(scored, key=lambda s: s[0])
                print(f"| {wl} | {b} | {fam}: {best[1]} | {best[0]:.1f} | {rate('holdout', best[2]):.1f} |",
                      flush=True)
            h = preps["holdout"]
            clock = run_policy(h, "clock", cap)
            print(f"| {wl} | {b} | CLOCK (served) | - | {100 * float(clock[h.decode].mean()):.1f} |")
            bel = pol.belady(h.ids, h.decode, h.n_items, cap)
            print(f"| {wl} | {b} | Belady with bypass | - | {100 * float(bel[h.decode].mean()):.1f} |", flush=True)
    print(f"\nRun time {time.perf_counter() - t0:.0f} s.", file=sys.stderr)


if __name__ == "__main__":
    main()
