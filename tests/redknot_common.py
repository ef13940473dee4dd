"""What the RedKnot test modules share: a tiny DeepSeek-V4 model, its profile, seeded token runs, a three-segment
layout (two documents and a query), and the module-scoped runner and full-recompute fixtures.

A module imports the fixtures by name and defines its own `LAYOUT` (the `full` fixture reads it from the module).
"""

from __future__ import annotations

import pytest
import torch

from slacktier.redknot.model import build_model, tiny_config
from slacktier.redknot.profile import profile_for_config
from slacktier.redknot.runner import Layout, RedKnotRunner, Segment

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
