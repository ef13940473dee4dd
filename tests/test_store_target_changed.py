"""A disk target changed under a running source is named for what happened to it: truncated, damaged (its header
page overwritten by something other than a stage) or staged again; no row of the batch is served. Real staged
files read with O_DIRECT."""

from __future__ import annotations

import os

import numpy as np
import pytest

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store import PageBufferPool, PageReads, open_source
from slacktier.tables.layout import PAGE_BYTES
from slacktier.tables.manifest import header_page
from slacktier.testing.store import stage_synthetic


def _read_all(src, staged) -> None:
    pairs = [(r, p) for r, spec in enumerate(staged.specs) for p in range(spec.pages)]
    region, page = zip(*pairs, strict=True)
    reads = PageReads(np.array(region, np.int32), np.array(page, np.int64), np.arange(len(pairs), dtype=np.int32))
    pool = PageBufferPool(len(pairs))
    src.wait(src.submit(reads, pool))
    np.testing.assert_array_equal(pool.pages, np.concatenate(staged.pages))


def _zero_header(path: str) -> None:
    with open(path, "r+b") as f:
        f.write(bytes(PAGE_BYTES))


def _restage_header(path: str, staged) -> None:
    ident = staged.manifest.identity
    with open(path, "r+b") as f:
        f.write(header_page(ident.source_digest, 0, 2, "staging", "another-stage-id").tobytes())


@pytest.mark.parametrize("change, said", [
    (lambda path, staged: os.truncate(path, 0), "was truncated under this engine (now 0 bytes"),
    (lambda path, staged: os.truncate(path, 100), "was truncated under this engine (now 100 bytes"),
    (lambda path, staged: _zero_header(path), "is damaged: its header page was overwritten"),
    (lambda path, staged: _restage_header(path, staged), "was staged again under this engine"),
], ids=["truncated-to-0", "truncated-to-100", "header-zeroed", "staged-again"])
def test_a_target_changed_under_the_source_is_named_for_what_happened(o_direct_dir, change, said):
    staged = stage_synthetic(o_direct_dir, layers=(1,), ranks=2, rows=100, devices=2, seed=5)
    src = open_source("disk", staged.specs, identity=staged.manifest.identity)
    try:
        _read_all(src, staged)
        target = staged.manifest.targets[0]
        change(target, staged)
        with pytest.raises(SlackTierError) as info:
            _read_all(src, staged)
        message = str(info.value)
        assert info.value.kind is ErrorKind.TARGET and f"target {target} " in message, message
        assert said in message and "none of this batch's rows is served" in message, message
        if "staged again" not in said:
            assert "staged again" not in message and "restage the table" in message, message
    finally:
        src.close()
