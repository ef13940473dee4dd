"""What the checkpoint identity check costs at load time, against the table's size (tables.identity).

One Engram layer's table (fp8 values [rows, 256] and E8M0 scales [rows, 8]) is
written as a safetensors file of each size. Timed, per size, interleaved over rounds:

- ``check-mem``: what a plug-in adds to its engine's weight loading: `IdentityCheck.feed` of
  the values and the scales, handed as in-memory tensors (the engine has read them already);
- ``check-cold``: the same on tensors memory-mapped from the file with the file evicted from the
  page cache first (posix_fadvise DONTNEED): the worst case, every sampled row a disk read;
- ``stage-record``: the identity staging records (4096 rows preaded from the checkpoint, cold);
- ``sha-full``: the alternative design, a sha256 of every byte of the two tensors (in memory).

    .venv/bin/python benchmarks/micro/bench_tables_identity.py --sizes-gb 0.25,1,4 --rounds 3

Files go to --dir (default /tmp/slacktier-identity) and are deleted at the end. Prints one row per
(size, measure) with min/median/max in ms, ms per GB, and the 203 GB extrapolation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import struct
import sys
import time
from pathlib import Path

import numpy as np
import torch

from slacktier.tables.checkpoint_source import CheckpointSource
from slacktier.tables.identity import IdentityCheck, Recorded, source_identity

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import drop_file_cache  # noqa: E402

ROW = 264
FULL_GB = 203.0


def write_table(path: Path, rows: int) -> None:
    """A one-layer Engram checkpoint of `rows` rows: random bytes (a 64 MiB block repeated)."""
    header = {"layers.1.engram.embed.weight": {"dtype": "F8_E4M3", "shape": [rows, 256],
                                               "data_offsets": [0, rows * 256]},
              "layers.1.engram.embed.scale": {"dtype": "F8_E8M0", "shape": [rows, 8],
                                              "data_offsets": [rows * 256, rows * ROW]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    block = np.random.default_rng(1).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    left = rows * ROW
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        while left:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-gb", default="0.25,1,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--full-sha-max-gb", type=float, default=1.0, help="time sha-full only up to this size")
    ap.add_argument("--dir", default="/tmp/slacktier-identity")
    args = ap.parse_args()
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    sizes = [float(x) for x in args.sizes_gb.split(",")]
    files = {}
    try:
        for gb in sizes:
            rows = int(gb * 1e9 / ROW)
            files[gb] = (folder / f"t{gb}.safetensors", rows)
            write_table(*files[gb])
        times: dict[tuple[float, str], list[float]] = {}
        for _ in range(args.rounds):
            order = [(gb, what) for gb in sizes for what in ("check-mem", "check-cold", "stage-record", "sha-full")
                     if what != "sha-full" or gb <= args.full_sha_max_gb]
            random.shuffle(order)
            for gb, what in order:
                path, rows = files[gb]
                src = CheckpointSource(path)
                w, s = (torch.from_numpy(a) for a in (src._weight[1], src._scale[1]))   # memory maps
                ident = source_identity(src)["layers"]["1"]
                rec = Recorded("m", 1, rows, rows, {"values": ident["values"], "scales": ident["scales"]}, "x", {})
                if what == "check-mem" or what == "sha-full":
                    w, s = w.clone(), s.clone()   # in memory, as the engine's loader holds them
                else:
                    drop_file_cache(path)
                t0 = time.perf_counter()
                if what.startswith("check"):
                    check = IdentityCheck(rec, "bench", str(path))
                    check.feed("values", w)
                    check.feed("scales", s)
                    assert check.done
                elif what == "stage-record":
                    source_identity(CheckpointSource(path))
                else:
                    hashlib.sha256(w.numpy().data).hexdigest()
                    hashlib.sha256(s.numpy().data).hexdigest()
                times.setdefault((gb, what), []).append((time.perf_counter() - t0) * 1e3)
                del w, s
        print(f"{'GB':>6} {'measure':<13} {'min ms':>9} {'median ms':>10} {'max ms':>9} {'ms/GB':>9} "
              f"{'at 203 GB':>12}")
        for (gb, what), ts in sorted(times.items()):
            med = statistics.median(ts)
            flat = what != "sha-full"
            at_full = f"{med / 1e3:.3f} s/layer" if flat else f"{med / gb * FULL_GB / 1e3:.0f} s"
            print(f"{gb:>6} {what:<13} {min(ts):>9.2f} {med:>10.2f} {max(ts):>9.2f} {med / gb:>9.2f} {at_full:>12}")
    finally:
        for path, _ in files.values():
            path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
