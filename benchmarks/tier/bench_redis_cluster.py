"""The Redis tier in cluster mode: read time against nodes and hash-tag groups, the raw-socket limit, CPU per page,
redis-py's own cluster pipeline beside our routing, many serving processes on one copy, and the read-time
model the planner reads. (Our wire against valkey-glide and redis-py, interleaved: bench_redis_wire.py.)

    .venv/bin/python -m benchmarks.tier.bench_redis_cluster --append

Everything runs on this machine: every node is a local redis-server (Debian's) on loopback, sharing the
machine's cores with the client, so the figures say what the client and the protocol cost here, not what a
cluster of separate hosts would give (there, nodes add cores and network; here they only split the same two).
Each setting is measured in one run, side by side, and reported as the median (and p90) of `--reps` reads of
fresh random pages; ratios are against the raw-socket server in the same run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import append_to_section, command_line, machine, utc_stamp  # noqa: E402
from benchmarks.tier.raw_page_server import RawPageClient, RawPageServer  # noqa: E402

from slacktier.config import RedisOptions  # noqa: E402
from slacktier.plan.fit import fit_quality  # noqa: E402
from slacktier.store.base import PageBufferPool, PageReads  # noqa: E402
from slacktier.store.dram import load_region_pages  # noqa: E402
from slacktier.store.redis.loader import load_manifest  # noqa: E402
from slacktier.store.redis.source import RedisSource  # noqa: E402
from slacktier.testing.store import stage_synthetic  # noqa: E402
from slacktier.testing.redis_cluster import LocalRedisCluster  # noqa: E402

SECTION = "## The tier: page sources, cache and step engine"
SUBSECTION = "### Remote tier: Redis Cluster"


def options(cluster: LocalRedisCluster, user, **kw) -> RedisOptions:
    env = f"BENCH_PW_{user.name.replace('-', '_').upper()}"
    os.environ[env] = user.password
    return RedisOptions(mode="cluster", url=cluster.seed_url, username=user.name, password_env=env, **kw)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def batches(regions, n: int, reps: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(reps):
        region = rng.integers(0, len(regions), n).astype(np.int32)
        page = rng.integers(0, min(r.pages for r in regions), n).astype(np.int64)
        out.append((region, page))
    return out


def time_source(src: RedisSource, regions, n: int, reps: int, seed: int = 0) -> dict:
    pool = PageBufferPool(n)
    buf = np.arange(n, dtype=np.int32)
    work = batches(regions, n, reps + 3, seed)
    times, c0 = [], None
    for i, (region, page) in enumerate(work):
        if i == 3:
            c0 = cpu_s()
        t0 = time.perf_counter()
        src.wait(src.submit(PageReads(region, page, buf), pool), timeout_s=60)
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    cpu = cpu_s() - c0
    return {"median_ms": float(np.median(times)), "p90_ms": float(np.percentile(times, 90)),
            "cpu_us_page": cpu * 1e6 / (reps * n)}


def time_cluster_pipeline(cluster: LocalRedisCluster, src: RedisSource, regions, n: int, reps: int) -> dict:
    """redis-py's own ClusterPipeline, the same MGETs per page group: what our routing replaces."""
    import redis
    client = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.ports[0], username=cluster.reader.name,
                                        password=cluster.reader.password)
    work = batches(regions, n, reps + 3, 1)
    times = []
    c0 = 0.0
    try:
        for i, (region, page) in enumerate(work):
            if i == 3:
                c0 = cpu_s()
            t0 = time.perf_counter()
            pipe = client.pipeline()
            for c in src._commands(region, page, np.arange(n)):
                pipe.execute_command("MGET", *c.keys)  # (its pipe.mget is refused in cluster mode)
            replies = pipe.execute()
            assert sum(len(r) for r in replies) == n
            if i >= 3:
                times.append((time.perf_counter() - t0) * 1e3)
    finally:
        client.close()
    return {"median_ms": float(np.median(times)), "p90_ms": float(np.percentile(times, 90)),
            "cpu_us_page": (cpu_s() - c0) * 1e6 / (reps * n)}


def time_raw(pages: np.ndarray, n: int, reps: int) -> dict:
    server = RawPageServer(pages)
    server.start()
    try:
        client = RawPageClient("127.0.0.1", server.port)
        out = np.empty((n, pages.shape[1]), dtype=np.uint8)
        rng = np.random.default_rng(2)
        times = []
        c0 = 0.0
        for i in range(reps + 3):
            if i == 3:
                c0 = cpu_s()
            idx = rng.integers(0, pages.shape[0], n).astype(np.uint32)
            t0 = time.perf_counter()
            client.read(idx, out)
            if i >= 3:
                times.append((time.perf_counter() - t0) * 1e3)
        client.close()
    finally:
        server.stop()
    return {"median_ms": float(np.median(times)), "p90_ms": float(np.percentile(times, 90)),
            "cpu_us_page": (cpu_s() - c0) * 1e6 / (reps * n)}


def time_redis_raw_client(cluster: LocalRedisCluster, src: RedisSource, regions, n: int, reps: int) -> dict:
    """One node's redis-server answering the same MGETs to a raw socket that only receives the bytes (no reply
    parsing, no copy into the pool): what the server and loopback cost by themselves."""
    import socket

    import hiredis
    sock = socket.create_connection(("127.0.0.1", cluster.ports[0]))
    sock.sendall(hiredis.pack_command(("AUTH", cluster.reader.name, cluster.reader.password)))
    assert sock.recv(64) == b"+OK\r\n"
    buf = memoryview(bytearray(n * 4200 + (1 << 16)))
    times = []
    try:
        for i, (region, page) in enumerate(batches(regions, n, reps + 3, 3)):
            cmds = src._commands(region, page, np.arange(n))
            data = b"".join(hiredis.pack_command(("MGET", *c.keys)) for c in cmds)
            expect = sum(len(b"*%d\r\n" % len(c.keys)) for c in cmds) + n * (len(b"$4100\r\n") + 4100 + 2)
            t0 = time.perf_counter()
            sock.sendall(data)
            got = 0
            while got < expect:
                got += sock.recv_into(buf[got:], expect - got)
            if i >= 3:
                times.append((time.perf_counter() - t0) * 1e3)
    finally:
        sock.close()
    return {"median_ms": float(np.median(times)), "p90_ms": float(np.percentile(times, 90)), "cpu_us_page": 0.0}


def _instance(seed_url: str, user: str, password: str, manifest_path: str, n: int, reps: int, start, out) -> None:
    """One serving process with its own source over the shared copy: its median read time of n-page steps."""
    from slacktier.tables.manifest import Manifest
    os.environ["BENCH_INST_PW"] = password
    manifest = Manifest.load(manifest_path)
    regions = manifest.runtime_regions()
    src = RedisSource(regions, RedisOptions(mode="cluster", url=seed_url, username=user, password_env="BENCH_INST_PW"),
                             identity=manifest.identity)
    start.wait()
    try:
        out.put(time_source(src, regions, n, reps, seed=os.getpid()))
    finally:
        src.close()


def instances(cluster, manifest_path: str, count: int, n: int, reps: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    out, start = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_instance, args=(cluster.seed_url, cluster.reader.name, cluster.reader.password,
                                                 manifest_path, n, reps, start, out)) for _ in range(count)]
    for p in procs:
        p.start()
    time.sleep(3.0)   # every process imported and connected before they start together
    start.set()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=200_000, help="rows per layer of the synthetic table (2 layers)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--nodes", default="1,3,6")
    p.add_argument("--tags", default="4,16,64,256,1024,0", help="hash-tag groups per region; 0 = one per page")
    p.add_argument("--append", action="store_true")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    staged = stage_synthetic(work / "t", layers=(1, 14), ranks=1, rows=args.rows)
    regions, manifest = staged.specs, staged.manifest
    crcs = manifest.region_checksums()
    pages_total = sum(r.pages for r in regions)
    print(f"table: 2 regions, {pages_total} pages ({pages_total * 4096 / 2**20:.0f} MiB)", flush=True)
    lines: list[str] = []
    by_nodes: dict[int, dict] = {}
    fit_rows = []

    # 1. Nodes: our source and redis-py's pipeline, 700 and 3000 pages; T = 64.
    for nodes in [int(x) for x in args.nodes.split(",")]:
        with LocalRedisCluster(work / f"c{nodes}", masters=nodes, replicas=0) as cluster:
            t0 = time.perf_counter()
            load_manifest(options(cluster, cluster.loader), manifest, tag_buckets=64, workers=4)
            load_s = time.perf_counter() - t0
            row = {"load_s": load_s}
            src = RedisSource(regions, options(cluster, cluster.reader), page_crc32c=crcs,
                                     identity=manifest.identity)
            if nodes == 1:
                row.update({f"rawredis{n}": time_redis_raw_client(cluster, src, regions, n, args.reps)
                            for n in (700, 3000)})
            for n in (700, 3000):
                row[n] = time_source(src, regions, n, args.reps)
                row[f"pipe{n}"] = time_cluster_pipeline(cluster, src, regions, n, args.reps)
            if nodes == 3:   # the read-time model: pages of each layer varied independently
                rng = np.random.default_rng(5)
                for _ in range(24):
                    p1, p14 = (int(x) for x in rng.integers(50, 1600, 2))
                    region = np.r_[np.zeros(p1, np.int32), np.ones(p14, np.int32)]
                    page = np.r_[rng.integers(0, regions[0].pages, p1), rng.integers(0, regions[1].pages, p14)]
                    pool = PageBufferPool(p1 + p14)
                    t1 = time.perf_counter()
                    src.wait(src.submit(PageReads(region, page, np.arange(p1 + p14, dtype=np.int32)), pool))
                    fit_rows.append((p1, p14, (time.perf_counter() - t1) * 1e3))
                row["instances"] = {k: instances(cluster, str(manifest.path), k, 700, max(10, args.reps // 2))
                                    for k in (1, 2, 4)}
            src.close()
            by_nodes[nodes] = row
            print(nodes, "nodes:", {k: v for k, v in row.items() if k != "instances"}, flush=True)

    # 2. The raw-socket limit, same pages.
    every_page = np.concatenate([load_region_pages(r) for r in regions])
    raw = {n: time_raw(every_page, n, args.reps) for n in (700, 3000)}
    print("raw:", raw, flush=True)

    # 3. Hash-tag groups at 3 nodes, 3000 pages.
    tags = {}
    with LocalRedisCluster(work / "ctags", masters=3, replicas=0) as cluster:
        for T in [int(x) for x in args.tags.split(",")]:
            groups = T or max(r.pages for r in regions)
            pfx = f"tags{T}"
            load_manifest(options(cluster, cluster.loader), manifest, tag_buckets=groups, prefix=pfx, workers=4)
            src = RedisSource(regions, options(cluster, cluster.reader, prefix=pfx), page_crc32c=crcs,
                                     identity=manifest.identity)
            tags[T] = {n: time_source(src, regions, n, args.reps) for n in (700, 3000)}
            src.close()
            print("T", T, tags[T], flush=True)

    # 4. The planner's read-time model.
    # one batch holding both layers' pages: T = a + b_1 P1 + b_14 P14 by least squares (one request, so this is the
    # tier's b, not the device model's queued-ahead c; `slacktier probe --read-fit` fits that per tier)
    X = np.array([[1.0, a, b] for a, b, _ in fit_rows], dtype=np.float64)
    y = np.array([t for _, _, t in fit_rows], dtype=np.float64)
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    fit_q = fit_quality(X @ coef, y)

    def cell(d):
        return f"{d['median_ms']:.2f} ({d['p90_ms']:.2f})"

    lines += [f"#### {utc_stamp()}", "", f"`{command_line(__file__, argv)}`", "",
              f"Machine: {machine()}. Every node is a local redis-server 7.0 (Debian) on loopback, no replicas, "
              "ACLs on (the read-only serving user); the client, the nodes and the raw server share the two cores, "
              "so more nodes here split the same CPUs rather than add any: this measures the client and the "
              "protocol, not a multi-host cluster's bandwidth. "
              f"Table: 2 regions, {pages_total} pages ({pages_total * 4096 / 2**20:.0f} MiB); reads of uniformly "
              f"random pages, {args.reps} batches per cell after 3 warm-up ones, median (p90) ms; CPU per page is "
              "this process's user+sys over the pages read (the servers' CPU is not in it).", "",
              "Read time against nodes (64 hash-tag groups per region). Ours: our own node sockets and the "
              "compiled reply scan (`store/redis/_wire.py`, `_resp.py`). Beside it, redis-py's own "
              "`ClusterPipeline` with the same MGETs; the raw-socket server (one process, numpy gather, one `sendall`; "
              "`benchmarks/raw_page_server.py`) is the limit. Reads are CRC32C-verified (the tier's default), "
              "which the raw server is not.", "",
              "| nodes | load s | 700 pages: ours | CPU us/page | redis-py pipeline | 3000 pages: "
              "ours | CPU us/page | redis-py pipeline | ours / raw (700, 3000) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for nodes, row in by_nodes.items():
        lines.append(f"| {nodes} | {row['load_s']:.1f} | {cell(row[700])} | {row[700]['cpu_us_page']:.2f} | "
                     f"{cell(row['pipe700'])} | {cell(row[3000])} | "
                     f"{row[3000]['cpu_us_page']:.2f} | {cell(row['pipe3000'])} | "
                     f"{row[700]['median_ms'] / raw[700]['median_ms']:.2f}x, "
                     f"{row[3000]['median_ms'] / raw[3000]['median_ms']:.2f}x |")
    if 1 in by_nodes and "rawredis700" in by_nodes[1]:
        r1 = by_nodes[1]
        lines.append(f"| 1, raw client (server only) | - | {cell(r1['rawredis700'])} | - | - | "
                     f"{cell(r1['rawredis3000'])} | - | - | {r1['rawredis700']['median_ms'] / raw[700]['median_ms']:.2f}x, "
                     f"{r1['rawredis3000']['median_ms'] / raw[3000]['median_ms']:.2f}x |")
    lines.append(f"| raw socket | - | {cell(raw[700])} | {raw[700]['cpu_us_page']:.2f} | - | {cell(raw[3000])} | "
                 f"{raw[3000]['cpu_us_page']:.2f} | - | 1x |")
    lines += ["", "Hash-tag groups per region T (3 nodes): pages p and q share a slot, and so can share an MGET, "
              "when p % T == q % T; T = 0 here means one group per page (no sharing: one key per MGET).", "",
              "| T | 700 pages | 3000 pages |", "|---|---|---|"]
    for T, row in tags.items():
        lines.append(f"| {T or 'one per page'} | {cell(row[700])} | {cell(row[3000])} |")
    if 3 in by_nodes and "instances" in by_nodes[3]:
        lines += ["", "Serving processes reading one copy (3 nodes, 700-page steps, each process its own source; "
                  "all start together): each instance's median read time (ms).", "",
                  "| instances | per-instance median ms | mean | vs 1 instance |", "|---|---|---|---|"]
        base = None
        for k, res in by_nodes[3]["instances"].items():
            meds = [r["median_ms"] for r in res]
            base = base or float(np.mean(meds))
            lines.append(f"| {k} | {', '.join(f'{m:.2f}' for m in meds)} | {np.mean(meds):.2f} | "
                         f"{np.mean(meds) / base:.2f}x |")
    lines += ["", f"Read-time model for the planner (3 nodes; {len(fit_rows)} batches with layer 1's and layer 14's "
              "pages drawn independently from 50-1600): "
              f"T = {coef[0]:.3f} ms + {coef[1] * 1e3:.2f} us x P1 + {coef[2] * 1e3:.2f} us "
              f"x P14; R^2 {fit_q.r2:.3f}, RMSE {fit_q.rmse_ms:.2f} ms (least squares, one batch per step)."]
    block = "\n".join(lines)
    print(block)
    if args.append:
        append_to_section(block, SECTION, SUBSECTION)


if __name__ == "__main__":
    main()
