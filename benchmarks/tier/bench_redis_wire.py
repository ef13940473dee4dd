"""The Redis tier's wire: our hand-written client (own sockets, compiled RESP scan) against valkey-glide's sync
client (MGET into caller buffers) and redis-py's per-node connections, on one local 3-node cluster.

    .venv/bin/python -m benchmarks.tier.bench_redis_wire --rounds 7 --append

The question (issue 29): is the library within 1.2x of ours? If so the tier uses it and drops its own client;
if not, `store/redis/_wire.py` says why at its top. Every client reads the same random pages of the same
table through the same key layout (`store/redis/keys.py`), 700 and 3,000 pages per batch, and lands them in a
page pool (glide: each value into a scratch row of 4,100 bytes, then one strided copy of the pages, as our
scan does; redis-py: one `bytes` per value, copied in). Reads are not CRC-checked here (the same cost for
all three); the source's own batching and routing are not in the glide and redis-py rounds, which are plain
calls. Interleaved: each round runs every (client, pages) cell once, in a shuffled order. Per cell: wall time
per batch (median over the batches of a round), and CPU per page = this process's CPU time (user + sys, every
thread: glide's Rust runtime threads count) over the pages read. The servers' CPU is not in it. glide is
optional: without `glide_sync` importable, its rows say so.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from benchmarks._harness import (command_line, format_table, interleaved, machine, publish,  # noqa: E402
                                 utc_stamp, write_result)

from slacktier.config import RedisOptions  # noqa: E402
from slacktier.store.base import PageBufferPool, PageReads  # noqa: E402
from slacktier.store.dram import load_region_pages  # noqa: E402
from slacktier.store.redis import keys as K  # noqa: E402
from slacktier.store.redis.loader import load_manifest  # noqa: E402
from slacktier.store.redis.source import RedisSource  # noqa: E402
from slacktier.testing.store import stage_synthetic  # noqa: E402
from slacktier.tables.layout import PAGE_BYTES  # noqa: E402
from slacktier.testing.redis_cluster import LocalRedisCluster  # noqa: E402

SECTION = "## The tier: page sources, cache and step engine"
SUBSECTION = "### Remote tier: Redis: our wire against valkey-glide and redis-py"
SIZES = (700, 3000)


def options(cluster: LocalRedisCluster, user, **kw) -> RedisOptions:
    env = f"BENCH_PW_{user.name.replace('-', '_').upper()}"
    os.environ[env] = user.password
    return RedisOptions(url=cluster.seed_url, mode="cluster", username=user.name, password_env=env, **kw)


def cpu_s() -> float:
    """This process's CPU time, every thread (time.process_time is user + sys of the whole process)."""
    return time.process_time()


class Ours:
    """The tier's source, verification off: submit + wait of one batch."""

    name = "ours"

    def __init__(self, regions, opts: RedisOptions, identity) -> None:
        self.src = RedisSource(regions, opts, identity=identity)

    def read(self, region: np.ndarray, page: np.ndarray, pool: PageBufferPool) -> None:
        n = region.shape[0]
        self.src.wait(self.src.submit(PageReads(region, page, np.arange(n, dtype=np.int32)), pool), timeout_s=60)

    def close(self) -> None:
        self.src.close()


class _KeyedClient:
    """The key list of a batch from the table's layout (the same keys our source sends)."""

    def __init__(self, regions, prefix: str, tag_buckets: int) -> None:
        self.prefix, self.T, self.regions = prefix, tag_buckets, regions

    def keys(self, region: np.ndarray, page: np.ndarray) -> list[bytes]:
        return [K.page_key(self.prefix, self.regions[r].layer, self.regions[r].rank, p, self.T)
                for r, p in zip(region.tolist(), page.tolist())]


class Glide(_KeyedClient):
    """valkey-glide's sync cluster client: one MGET of the batch's keys (glide splits it per slot and sends the
    parts to their nodes concurrently), each value written into its own 4,100-byte scratch row."""

    name = "glide"

    def __init__(self, cluster: LocalRedisCluster, regions, prefix: str, tag_buckets: int) -> None:
        super().__init__(regions, prefix, tag_buckets)
        from glide_sync import GlideClusterClient, GlideClusterClientConfiguration, NodeAddress, ServerCredentials
        cfg = GlideClusterClientConfiguration(
            [NodeAddress("127.0.0.1", cluster.ports[0])],
            credentials=ServerCredentials(cluster.reader.password, cluster.reader.name), request_timeout=10_000)
        self.client = GlideClusterClient.create(cfg)
        self.scratch = np.empty((max(SIZES), K.VALUE_BYTES), np.uint8)
        self.views = [memoryview(row) for row in self.scratch]

    def read(self, region: np.ndarray, page: np.ndarray, pool: PageBufferPool) -> None:
        n = region.shape[0]
        got = self.client.mget(self.keys(region, page), buffers=self.views[:n])
        if any(g is None or int(g) != K.VALUE_BYTES for g in got):
            raise AssertionError("glide: a missing or short value")
        pool.pages[:n] = self.scratch[:n, :PAGE_BYTES]

    def close(self) -> None:
        self.client.close()


class KeysOnly(_KeyedClient):
    """Not a client: only the Python key list glide's row builds per batch (ours packs keys in compiled code),
    to say how much of glide's row is that list rather than glide."""

    name = "keys only"

    def read(self, region: np.ndarray, page: np.ndarray, pool: PageBufferPool) -> None:
        self.keys(region, page)

    def close(self) -> None:
        pass


class RedisPy(_KeyedClient):
    """redis-py's cluster client: one MGET per page group through its non-transactional cluster pipeline."""

    name = "redis-py"

    def __init__(self, cluster: LocalRedisCluster, regions, prefix: str, tag_buckets: int) -> None:
        super().__init__(regions, prefix, tag_buckets)
        import redis
        self.client = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.ports[0],
                                                 username=cluster.reader.name, password=cluster.reader.password)

    def read(self, region: np.ndarray, page: np.ndarray, pool: PageBufferPool) -> None:
        group = region.astype(np.int64) * self.T + page % self.T
        order = np.argsort(group, kind="stable")
        keys = self.keys(region[order], page[order])
        cuts = np.flatnonzero(np.diff(group[order])) + 1
        pipe = self.client.pipeline()
        bounds = list(zip(np.r_[0, cuts].tolist(), np.r_[cuts, len(keys)].tolist()))
        for lo, hi in bounds:
            pipe.execute_command("MGET", *keys[lo:hi])
        values = [v for reply in pipe.execute() for v in reply]
        for i, v in zip(order.tolist(), values):
            pool.pages[i] = np.frombuffer(v, np.uint8, count=PAGE_BYTES)

    def close(self) -> None:
        self.client.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=200_000, help="rows per layer of the synthetic table (2 layers)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (every cell once per round)")
    p.add_argument("--batches", type=int, default=20, help="batches per cell and round (after one warm-up)")
    p.add_argument("--append", action="store_true", help="add the block to docs/bench-log/tier.md")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-wire-"))
    try:
        return _run(args, argv, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)   # the staged table and the nodes' folders (~110 MB at the default)


def _run(args: argparse.Namespace, argv: list[str] | None, work: Path) -> int:
    staged = stage_synthetic(work / "t", layers=(1, 14), ranks=1, rows=args.rows)
    regions, manifest = staged.specs, staged.manifest
    pages_total = sum(r.pages for r in regions)
    rng = np.random.default_rng(0)
    with LocalRedisCluster(work / "c", masters=3, replicas=0) as cluster:
        report = load_manifest(options(cluster, cluster.loader), manifest, tag_buckets=K.DEFAULT_TAG_BUCKETS)
        prefix = K.default_prefix(manifest.identity)
        clients = {"ours": Ours(regions, options(cluster, cluster.reader), manifest.identity)}
        try:
            clients["glide"] = Glide(cluster, regions, prefix, report.tag_buckets)
            import glide_sync
            glide_version = getattr(glide_sync, "__version__", None) or _dist_version("valkey-glide-sync")
        except ImportError as exc:
            glide_version = f"not importable ({exc})"
        clients["redis-py"] = RedisPy(cluster, regions, prefix, report.tag_buckets)
        keys_only = KeysOnly(regions, prefix, report.tag_buckets)
        pools = {n: PageBufferPool(n) for n in SIZES}
        # every client's pages of one batch must be the staged pages: a wrong client is not timed
        check_r, check_p = np.zeros(64, np.int32), np.arange(64, dtype=np.int64)
        want = load_region_pages(regions[0])[:64]
        for c in clients.values():
            c.read(check_r, check_p, pools[700])
            assert np.array_equal(pools[700].pages[:64], want), c.name
        clients["keys only"] = keys_only
        cells = [(c, n) for c in clients for n in SIZES]
        wall: dict[tuple[str, int], list[float]] = {k: [] for k in cells}   # per round: median ms per batch
        cpu: dict[tuple[str, int], list[float]] = {k: [] for k in cells}    # per round: us per page
        for _, (name, n) in interleaved(cells, args.rounds, seed=1):
            c, pool = clients[name], pools[n]
            work_items = [(rng.integers(0, 2, n).astype(np.int32),
                           rng.integers(0, min(r.pages for r in regions), n).astype(np.int64))
                          for _ in range(args.batches + 1)]
            c.read(*work_items[0], pool)   # warm-up
            times = []
            c0 = cpu_s()
            for region, page in work_items[1:]:
                t0 = time.perf_counter()
                c.read(region, page, pool)
                times.append((time.perf_counter() - t0) * 1e3)
            cpu[(name, n)].append((cpu_s() - c0) * 1e6 / (args.batches * n))
            wall[(name, n)].append(float(np.median(times)))
        for c in clients.values():
            c.close()

    def mmm(xs) -> str:
        return f"{min(xs):.2f} / {np.median(xs):.2f} / {max(xs):.2f}"

    rows, figures = [], {}
    for name in clients:
        for n in SIZES:
            w, u = wall[(name, n)], cpu[(name, n)]
            rw = [a / b for a, b in zip(w, wall[("ours", n)])]
            ru = [a / b for a, b in zip(u, cpu[("ours", n)])]
            rows.append([name, n, mmm(w), mmm(u), mmm(rw), mmm(ru)])
            figures[f"{name}_{n}_ms"] = float(np.median(w))
            figures[f"{name}_{n}_cpu_us_page"] = float(np.median(u))
            figures[f"{name}_{n}_wall_ratio"] = float(np.median(rw))
            figures[f"{name}_{n}_cpu_ratio"] = float(np.median(ru))
    table = format_table(["client", "pages", "ms per batch (min / median / max of rounds)",
                          "CPU us per page", "wall / ours (per round)", "CPU / ours (per round)"], rows)
    block = "\n".join([
        f"#### {utc_stamp()}", "", f"`{command_line(__file__, argv)}`", "",
        f"Machine: {machine()}, shared with other engineers' jobs while it ran (so ratios, each within one round). "
        f"One local 3-master cluster (redis-server 7.0, Debian), ACL reader, no TLS; table {pages_total} pages in "
        f"{report.tag_buckets} hash-tag groups per region; {args.rounds} interleaved rounds x {args.batches} "
        f"batches per cell; valkey-glide-sync {glide_version}. Ratios are per round, then min / median / max.",
        "", table])
    write_result("tier.bench_redis_wire", figures)
    return publish(block, args.append, SECTION, SUBSECTION)


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
