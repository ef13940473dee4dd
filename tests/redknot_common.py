"""What the RedKnot test modules share: a tiny DeepSeek-V4 model, its profile, seeded token runs, a three-segment
layout (two documents and a query), the module-scoped runner and full-recompute fixtures, and one that closes
every service a test made.

A module imports the fixtures by name and defines its own `LAYOUT` (the `full` fixture reads it from the module).
"""

from __future__ import annotations

import pytest
import torch

from slacktier.redknot.model import build_model, tiny_config
from slacktier.redknot.profile import profile_for_config
from slacktier.redknot.runner import Layout, RedKnotRunner, Segment
from slacktier.redknot.service import RedKnotService

CFG = tiny_config()
MODEL = build_model(CFG, seed=0)
PROFILE = profile_for_config(CFG, name="tiny")


def tokens(n: int, seed: int) -> tuple[int, ...]:
    """`n` token ids (2 .. vocab - 1) from a seeded generator."""
    return tuple(torch.randint(2, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


def two_docs_and_a_query(d0: tuple[int, ...], d1: tuple[int, ...], q: tuple[int, ...]) -> Layout:
    return Layout.of([Segment("d0", d0), Segment("d1", d1), Segment("q", q, "query")])


@pytest.fixture(scope="module")
def runner() -> RedKnotRunner:
    return RedKnotRunner(MODEL, PROFILE, chunk_rows=32)


@pytest.fixture(scope="module")
def full(request, runner):
    return runner.full(request.module.LAYOUT)


@pytest.fixture(autouse=True)
def services_closed(monkeypatch):
    """Every service a test makes is closed after it, so none of its page sources (and their device queues)
    outlives the test."""
    made: list[RedKnotService] = []
    init = RedKnotService.__init__

    def recorded(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(RedKnotService, "__init__", recorded)
    yield
    for svc in made:
        svc.close()
