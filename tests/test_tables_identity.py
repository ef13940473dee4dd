"""A staged table's identity (tables.identity): the sample, the manifest record, and the check a plug-in feeds."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.identity import SAMPLE_ROWS, IdentityCheck, recorded_identity, sample_rows
from slacktier.tables.manifest import Manifest, manifest_digest
from slacktier.tables.stage import source_from_manifest, stage_checkpoint, stage_synthetic


@pytest.mark.parametrize("rows", [1, 2, 15, 4095, 4096, 4097, 100_003, 384_006_168])
def test_sample_is_distinct_ascending_and_spans_the_table(rows):
    ids = sample_rows(rows)
    assert ids.shape[0] == min(rows, SAMPLE_ROWS)
    assert ids[0] == 0 and ids[-1] == rows - 1
    assert bool((np.diff(ids) > 0).all()) and ids[-1] < rows
    k = ids.shape[0]
    strata = (np.arange(k) * rows) // k   # one row in each stratum
    assert bool((ids[1:-1] >= strata[1:-1]).all() and (ids[1:-1] < strata[2:]).all())
    np.testing.assert_array_equal(sample_rows(rows), ids)   # a function of the row count alone


def test_sample_is_not_an_evenly_spaced_grid():
    """The offsets inside the strata vary, so a table periodic in its row id is not sampled on one phase."""
    ids = sample_rows(1_000_000)
    assert len(set((ids[1:-1] % 244).tolist())) > 200


def _checkpoint(path, rows: dict[int, int], seed: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    from safetensors.torch import save_file

    rng = np.random.default_rng(seed)
    tables = {layer: (torch.from_numpy(rng.integers(0, 256, (n, 256), dtype=np.uint8)).view(torch.float8_e4m3fn),
                      torch.from_numpy(rng.integers(0, 256, (n, 8), dtype=np.uint8)).view(torch.float8_e8m0fnu))
              for layer, n in rows.items()}
    save_file({f"layers.{layer}.engram.embed.{part}": t for layer, (w, s) in tables.items()
               for part, t in (("weight", w), ("scale", s))}, str(path))
    return tables


def test_checkpoint_staging_records_the_sample_and_the_header_entries(tmp_path):
    tables = _checkpoint(tmp_path / "a.safetensors", {1: 9_000, 14: 700}, 1)
    m = Manifest.load(stage_checkpoint(tmp_path / "a.safetensors", [tmp_path / "a.bin"], 1, progress=False).path)
    ident = m.source["identity"]
    assert ident["method"] == "sampled-rows-v1" and set(ident["layers"]) == {"1", "14"}
    rec = ident["layers"]["1"]
    assert rec["rows"] == rec["tensor_rows"] == 9_000
    weight = rec["tensors"]["weight"][0]
    assert weight["name"] == "layers.1.engram.embed.weight" and weight["dtype"] == "F8_E4M3"
    assert weight["shape"] == [9_000, 256] and weight["nbytes"] == 9_000 * 256
    raw = open(weight["file"], "rb").read()   # the recorded offset is where the tensor's bytes are
    first_row = tables[1][0][0].view(torch.uint8).numpy().tobytes()
    assert raw[weight["offset_bytes"]:weight["offset_bytes"] + 256] == first_row
    check = IdentityCheck(recorded_identity(m, 1), "test", "a.safetensors")
    w, s = tables[1]
    check.feed("values", w)
    check.feed("scales", s)
    assert check.done


def test_sharded_feeds_equal_a_whole_feed_and_a_changed_sampled_row_is_refused(tmp_path):
    tables = _checkpoint(tmp_path / "a.safetensors", {3: 10_000}, 2)
    m = stage_checkpoint(tmp_path / "a.safetensors", [tmp_path / "a.bin"], 1, progress=False)
    w = tables[3][0]
    check = IdentityCheck(recorded_identity(m, 3), "test", "x")
    for start in range(0, 10_000, 3_000):   # shards of 3,000 rows in any order
        check.feed("values", w[start:start + 3_000], start, whole=False)
    assert check.pending_parts() == ["scales"]
    changed = w.view(torch.uint8).clone()
    changed[int(sample_rows(10_000)[77]), 5] ^= 1   # one bit of one sampled row
    with pytest.raises(SlackTierError, match="sampled rows digest to") as err:
        IdentityCheck(recorded_identity(m, 3), "test", "x").feed("values", changed)
    assert err.value.kind is ErrorKind.CHECKPOINT
    unsampled = w.view(torch.uint8).clone()
    spare = sorted(set(range(10_000)) - set(sample_rows(10_000).tolist()))[0]
    unsampled[spare, 5] ^= 1   # the trade-off, stated: a row outside the sample is not seen
    IdentityCheck(recorded_identity(m, 3), "test", "x").feed("values", unsampled)
    with pytest.raises(SlackTierError, match="9999 rows, where the staged table's tensor has 10000"):
        IdentityCheck(recorded_identity(m, 3), "test", "x").feed("values", w[:9_999])
    with pytest.raises(SlackTierError, match=r"shape \[10000, 128\]"):
        IdentityCheck(recorded_identity(m, 3), "test", "x").feed("values", w.view(torch.uint8).view(-1, 128)[:10_000])


def test_a_synthetic_table_records_its_generators_rows(tmp_path):
    m = stage_synthetic([tmp_path / "s.bin"], {1: 5_000}, 1, 4, progress=False)
    rows = source_from_manifest(m).rows(1, np.arange(5_000))
    check = IdentityCheck(recorded_identity(m, 1), "test", "x")
    check.feed("values", rows[:, :256])
    check.feed("scales", rows[:, 256:])
    assert check.done and "synthetic table" in check.recorded.source and "seed 4" in check.recorded.source
    other = source_from_manifest(stage_synthetic([tmp_path / "o.bin"], {1: 5_000}, 1, 5, progress=False))
    with pytest.raises(SlackTierError, match="synthetic table"):
        IdentityCheck(recorded_identity(m, 1), "test", "x").feed("values", other.rows(1, np.arange(5_000))[:, :256])


def test_a_malformed_identity_is_refused_at_load(tmp_path):
    m = stage_synthetic([tmp_path / "s.bin"], {1: 500}, 1, 4, progress=False)
    doc = json.loads(open(m.path).read())
    doc["source"]["identity"]["layers"]["1"]["values"] = "sha256:12"
    doc["manifest_digest"] = manifest_digest(doc)
    open(m.path, "w").write(json.dumps(doc))
    with pytest.raises(SlackTierError, match=r"\$.source.identity.layers.1.values"):
        Manifest.load(m.path)
    del doc["source"]["identity"]   # a manifest staged before identities: loads, and has none
    doc["manifest_digest"] = manifest_digest(doc)
    open(m.path, "w").write(json.dumps(doc))
    assert recorded_identity(Manifest.load(m.path), 1) is None


def test_a_manifest_without_identity_is_served_with_a_warning_and_unfed_checks_are_reported(tmp_path, caplog):
    """The plug-ins' side (adapters.identity_check): a manifest staged before identities gets no check and a
    warning naming it; a check its engine's loader never completes is reported, naming the table, at the
    first step; a completed one is not."""
    from slacktier import adapters

    m = stage_synthetic([tmp_path / "s.bin"], {1: 500, 14: 300}, 1, 4, progress=False)
    source = source_from_manifest(m)
    rows = {layer: source.rows(layer, np.arange(n)) for layer, n in m.layout.rows.items()}
    caplog.set_level("WARNING", logger=adapters.log.name)
    adapters.report_unchecked()   # checks left by other tests
    caplog.clear()
    fed = adapters.identity_check(m.path, 1, "SGLang", "/models/x")
    unfed = adapters.identity_check(m.path, 14, "SGLang", "/models/x")
    adapters.checking_loader(fed, "values")(None, rows[1][:, :256])
    adapters.checking_loader(fed, "scales")(None, rows[1][:, 256:])
    adapters.checking_loader(unfed, "values")(None, rows[14][:, :256])   # its scales never arrive
    adapters.report_unchecked()
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "layer 14" in warned[0] and "scales" in warned[0] and "not compared" in warned[0]
    adapters.report_unchecked()   # once only
    assert len(caplog.records) == 1
    doc = json.loads(open(m.path).read())
    del doc["source"]["identity"]
    doc["manifest_digest"] = manifest_digest(doc)
    open(m.path, "w").write(json.dumps(doc))
    assert adapters.identity_check(m.path, 1, "SGLang", "/models/x") is None
    assert "records no checkpoint identity" in caplog.records[-1].getMessage()
