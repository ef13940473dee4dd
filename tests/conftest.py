"""Fixtures shared by several test files (keep them generic: no area's own setup here)."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from slacktier.testing.store import RedisServer, supports_o_direct

REPO = Path(__file__).resolve().parents[1]
# Experiments live beside the package, in benchmarks/ (issue 29); their tests import them from there.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files holding a `slow` test run first, each file's tests kept together and in order.

    scripts/test.sh splits the suite across processes file by file; a long file taken last would leave the
    other processes idle at the end.
    """
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)


def _o_direct_dir(candidate: Path) -> Iterator[Path]:
    """`candidate` if it takes O_DIRECT, else a fresh directory under the repo's git-ignored runs/ (removed after)."""
    if supports_o_direct(candidate):
        yield candidate
        return
    (REPO / "runs").mkdir(exist_ok=True)
    fallback = Path(tempfile.mkdtemp(prefix="test-store-", dir=REPO / "runs"))
    assert supports_o_direct(fallback), "no directory here supports O_DIRECT; the disk tier needs one"
    yield fallback
    shutil.rmtree(fallback)


@pytest.fixture
def o_direct_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory that takes O_DIRECT: tmp_path, else one under runs/."""
    yield from _o_direct_dir(tmp_path)


@pytest.fixture(scope="module")
def o_direct_module_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A directory that takes O_DIRECT, shared by one test module: a pytest tmp dir, else one under runs/."""
    yield from _o_direct_dir(tmp_path_factory.mktemp("regions"))


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch intra-op thread for a module: tiny matrices on a shared 2-core machine run many times
    faster than with two spinning threads. Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def small_agent_sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of part of the vendored agent trajectories: every file except the Nebius set, plus its first four
    files (by name). Rendering the whole sample takes ~15 s of tokenizer time, too much for tests that only need
    each format once; pass it as `CorpusConfig(agent_dir=...)` or `load_trajectories(...)`."""
    from slacktier.workloads.trajectories import SAMPLE_DIR, trajectory_files

    out = tmp_path_factory.mktemp("agent_sample")
    files = trajectory_files(SAMPLE_DIR)
    nebius = [p for p in files if p.parent.name == "nebius"][:4]
    for p in [p for p in files if p.parent.name != "nebius"] + nebius:
        dst = out / p.relative_to(SAMPLE_DIR)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(p, dst)
    return out


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port, for one test module (skips where none is installed)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not found (apt-get install -y redis-server; scripts/test.sh does)")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


from slacktier.testing.redis_cluster import LocalRedisCluster  # noqa: E402  (kept beside the fixture that uses it)


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    """A local Redis Cluster (3 masters, 3 replicas, auth on) on loopback ports, for one test module; stopped
    by PID at teardown (skips where no redis-server is installed)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not found (apt-get install -y redis-server; scripts/test.sh does)")
    cluster = LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster"), masters=3, replicas=1).start()
    yield cluster
    cluster.stop()
