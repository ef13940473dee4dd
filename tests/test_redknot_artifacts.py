"""RedKnot-MLA artifacts: page format, atomic publication, page sources, TP ranks, and every fallback reason."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from redknot_common import (CFG, MODEL, PROFILE, full, runner, services_closed, tokens,  # noqa: F401
                            two_docs_and_a_query)
from slacktier.errors import SlackTierError
from slacktier.redknot.artifacts import ArtifactStore, Certificate, FallbackReason, RowFormat
from slacktier.redknot.model import build_model
from slacktier.redknot.profile import HeadPolicy, profile_for_config
from slacktier.redknot.protect import ProtectionPolicy
from slacktier.redknot.runner import RedKnotRunner
from slacktier.redknot.placement import artifact_placement
from slacktier.redknot.service import RedKnotService

D0, D1, Q = tokens(36, 11), tokens(30, 12), tokens(10, 13)
DOCS = [("d0", D0), ("d1", D1)]
LAYOUT = two_docs_and_a_query(D0, D1, Q)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), values=st.sampled_from([3, 16, 64, 512, 1500, 3000]),
       dtype=st.sampled_from(["float64", "float32", "bfloat16"]), seed=st.integers(0, 99))
def test_row_format_roundtrip(rows, values, dtype, seed):
    fmt = RowFormat(values, dtype)
    z = torch.randn(rows, values, generator=torch.Generator().manual_seed(seed)).to(
        {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
    pages = fmt.pack(z)
    assert pages.shape == (fmt.pages_for(rows), 4096) and pages.dtype == np.uint8
    assert torch.equal(fmt.unpack(pages, rows), z)


def test_row_format_worked_example():
    fmt = RowFormat(32, "float64")  # tiny model: 2 groups x 16 channels = 256 B rows, 16 per page
    assert (fmt.row_bytes, fmt.rows_per_page, fmt.pages_for(40)) == (256, 16, 3)
    z = torch.arange(40 * 32, dtype=torch.float64).reshape(40, 32)
    pages = fmt.pack(z)  # row 37 -> page 2, byte (37 % 16) * 256 = 1280
    assert np.frombuffer(pages[2, 1280:1288].tobytes(), dtype=np.float64)[0] == float(z[37, 0])
    flash_tp1 = RowFormat(8 * 1024, "bfloat16")  # Flash TP1 rows: 16 KiB, 4 pages each
    assert (flash_tp1.row_bytes, flash_tp1.pages_per_row, flash_tp1.pages_for(3)) == (16384, 4, 12)


def _built(tmp_path, runner, tier: str = "dram", **kw) -> RedKnotService:
    placement = artifact_placement(tmp_path / "store", runner.profile.reusable, tier)
    svc = RedKnotService(runner, ArtifactStore(tmp_path / "store"), placement=placement, **kw)
    for doc_id, toks in DOCS:
        svc.build(doc_id, toks)
    return svc


def test_certificate_roundtrip_and_contents(tmp_path, runner):
    svc = _built(tmp_path, runner)
    cert = svc.store.certificate("d0", 0)
    assert Certificate.from_json(cert.to_json()) == cert
    assert cert.covered_layers == PROFILE.reusable and cert.rows == len(D0) and cert.generation == 0
    assert cert.model_digest == svc.model_digest and cert.profile_name == "tiny"
    data = svc.store.data_path(cert).read_bytes()
    assert len(data) % 4096 == 0 and len(data) // 4096 == sum(cert.region_pages)
    with pytest.raises(SlackTierError) as exc:
        Certificate.from_json('{"format": "other"}')
    assert exc.value.kind.value == "certificate"


def test_publish_is_atomic(tmp_path, runner):
    """A build that dies after some layers leaves no certificate and no data; the previous one stays valid."""
    svc = _built(tmp_path, runner)
    old = svc.store.certificate("d0", 0)

    def die(layer):
        if layer == PROFILE.reusable[1]:
            raise RuntimeError("killed mid-build")

    with pytest.raises(RuntimeError):
        svc.build("d0", D0, on_layer=die)
    assert svc.store.certificate("d0", 0) == old
    names = sorted(p.name for p in (tmp_path / "store" / "d0").iterdir())
    assert names == ["rank0.cert.json", old.data_file]
    with pytest.raises(RuntimeError):
        svc.build("fresh", D0, on_layer=die)
    assert svc.store.certificate("fresh", 0) is None
    assert list((tmp_path / "store" / "fresh").iterdir()) == []
    rep = svc.prefill(DOCS, Q, ProtectionPolicy(0.2))
    assert rep.fallback_reason is None and rep.reads.pages > 0


@pytest.mark.parametrize("kind", ["dram", "disk"])
def test_tp_ranks_and_sources_agree(tmp_path, runner, kind):
    """TP2 artifacts (groups split over ranks) through either page source give TP1's result."""
    one = _built(tmp_path / "tp1", runner, kind).prefill(DOCS, Q, ProtectionPolicy(0.2))
    two_svc = _built(tmp_path / "tp2", runner, kind, tp_size=2)
    two = two_svc.prefill(DOCS, Q, ProtectionPolicy(0.2))
    assert one.fallback_reason is None and two.fallback_reason is None
    # one read batch per document and layer, holding every rank's pages
    assert two.reads.tickets == one.reads.tickets == len(DOCS) * len(PROFILE.reusable)
    assert torch.equal(one.result.hidden, two.result.hidden)
    assert one.result.stats.local_rows_reused > 0


def test_bad_page_recomputes_that_layer(tmp_path, runner):
    """A page whose CRC32C fails: that layer's Local heads are recomputed for every row, logged and counted."""
    svc = _built(tmp_path, runner, "disk")
    cert = svc.store.certificate("d1", 0)
    path = svc.store.data_path(cert)
    raw = bytearray(path.read_bytes())
    raw[cert.region_offsets_bytes[1] + 8] ^= 0xFF  # second covered layer, first page
    path.write_bytes(bytes(raw))
    rep = svc.prefill(DOCS, Q, ProtectionPolicy(0.2))
    assert rep.fallback_reason is None
    assert rep.result.stats.layers_recomputed == 1 and rep.reads.failed_layers == 1
    assert torch.isfinite(rep.result.hidden).all()


def _reason_case(name, tmp_path, runner):
    """Set up one certificate problem; returns the service to prefill with."""
    if name == "no_artifact":
        return RedKnotService(runner, ArtifactStore(tmp_path / "store"))
    if name == "missing_layer":
        svc = RedKnotService(runner, ArtifactStore(tmp_path / "store"))
        svc.build("d0", D0)
        svc.build("d1", D1, layers=PROFILE.reusable[:-1])
        return svc
    svc = _built(tmp_path, runner)
    if name == "token_mismatch":
        svc.build("d1", D1[:-1] + (7,))
    elif name == "model_mismatch":
        other = RedKnotRunner(build_model(CFG, seed=1), PROFILE, chunk_rows=32)
        return RedKnotService(other, svc.store)
    elif name == "profile_mismatch":
        prof = profile_for_config(CFG, name="tiny", fence_front=2, fence_back=1)
        return RedKnotService(RedKnotRunner(MODEL, prof, chunk_rows=32), svc.store)
    elif name == "head_policy_mismatch":
        pol = HeadPolicy.every_nth(CFG.num_hidden_layers, CFG.num_attention_heads, 4)
        return RedKnotService(RedKnotRunner(MODEL, PROFILE, pol, chunk_rows=32), svc.store)
    elif name == "stale_generation":
        svc.store.invalidate("d1")
    elif name == "unreadable":
        svc.store.data_path(svc.store.certificate("d1", 0)).unlink()
    elif name == "geometry_mismatch":
        return RedKnotService(runner, svc.store, tp_size=2)
    elif name == "rank_disagreement":
        svc2 = RedKnotService(runner, ArtifactStore(tmp_path / "tp2"), tp_size=2)
        for doc_id, toks in DOCS:
            svc2.build(doc_id, toks)
        calls = []

        def die_on_rank1(layer):  # rank 0 publishes generation 1, rank 1 dies and keeps generation 0
            calls.append(layer)
            if len(calls) > len(PROFILE.reusable):
                raise RuntimeError("rank 1 died")

        with pytest.raises(RuntimeError):
            svc2.build("d1", D1, on_layer=die_on_rank1)
        assert svc2.store.certificate("d1", 0).generation == 1
        assert svc2.store.certificate("d1", 1).generation == 0
        return svc2
    return svc


@pytest.mark.parametrize("reason", [r.value for r in FallbackReason])
def test_each_fallback_reason_gives_full_recompute(tmp_path, runner, full, reason):
    svc = _reason_case(reason, tmp_path, runner)
    rep = svc.prefill(DOCS, Q, ProtectionPolicy(0.2))
    assert rep.fallback_reason is not None and rep.fallback_reason.value == reason
    assert svc.counters[f"fallback.{reason}"] == 1
    st_ = rep.result.stats
    assert st_.mode == "fallback" and st_.fallback_reason == reason
    assert st_.reuse_work == 0 and st_.local_rows_reused == 0 and rep.reads.pages == 0 and rep.reads.tickets == 0
    assert st_.head_rows_online == st_.head_rows_total
    ref = full if reason != "model_mismatch" else svc.runner.full(LAYOUT)
    assert torch.equal(rep.result.hidden, ref.hidden) and torch.equal(rep.result.last_logits, ref.last_logits)


def test_resident_sources_are_reused_and_refreshed(tmp_path, runner):
    """One page source per document build stays open across prefills; a rebuild or a bad read reopens it."""
    svc = _built(tmp_path, runner)
    first = svc.prefill(DOCS, Q, ProtectionPolicy(0.2))
    again = svc.prefill(DOCS, Q, ProtectionPolicy(0.2))
    assert svc.counters["sources_opened"] == 2 and torch.equal(first.result.hidden, again.result.hidden)
    svc.build("d1", D1)  # generation 1: a new data file
    svc.prefill(DOCS, Q, ProtectionPolicy(0.2))
    assert svc.counters["sources_opened"] == 3
    svc.close()


def test_document_without_artifact_is_new_rows(tmp_path, runner):
    """A document never built is served as new rows (computed online) next to reused ones."""
    svc = RedKnotService(runner, ArtifactStore(tmp_path / "store"))
    svc.build("d0", D0)
    rep = svc.prefill(DOCS, Q, ProtectionPolicy(0.0))
    assert rep.fallback_reason is None and rep.new_documents == 1
    st_ = rep.result.stats
    assert st_.local_rows_reused == len(D0) * len(PROFILE.reusable)
