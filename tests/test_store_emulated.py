"""Emulated devices (issue 31): the fluid server's completion times from the model (exact numbers), device models
refused by key, real bytes through the emulated queue in window order, and `slacktier whatif`'s refusals and report.
No test reads a wall-clock time: landing times are the model's output, orders are the queue's trace."""

from __future__ import annotations

import numpy as np
import pytest

from slacktier.cli import main
from slacktier.errors import SlackTierError
from slacktier.store import PageBufferPool, PageReads
from slacktier.store.emulated import (NVME_PAPER, RDMA_PAPER, EmulatedOptions, EmulatedSource, SimJob,
                                      completions_ms, emulated_device, forget_devices, load_device_model,
                                      model_from_dict)
from slacktier.store.devqueue import open_queues
from slacktier.testing.store import stage_synthetic


def test_four_ranks_on_one_nvme_paper_disk_land_at_the_papers_fit():
    jobs = [SimJob(2 * r + i, layer, 700, 0.0) for r in range(4) for i, layer in enumerate((1, 14))]
    done = completions_ms(jobs, NVME_PAPER)
    for r in range(4):
        assert done[2 * r] == pytest.approx(0.30 + 3.05e-3 * 700 + 0.37e-3 * 700)      # T1, paper section 4.1
        assert done[2 * r + 1] == pytest.approx(0.30 + 3.05e-3 * 1400 + 0.37e-3 * 700)  # behind all of layer 1


def test_one_rank_per_disk_reads_at_a_quarter_of_the_shared_page_cost():
    done = completions_ms([SimJob(0, 1, 700, 0.0), SimJob(1, 14, 700, 0.0)], NVME_PAPER)
    assert done[0] == pytest.approx(0.30 + 0.7625e-3 * 700 + 0.0925e-3 * 700)
    assert done[1] == pytest.approx(0.30 + 0.7625e-3 * 1400 + 0.0925e-3 * 700)


def test_a_later_layer_arriving_after_the_earlier_one_finished_steals_nothing():
    done = completions_ms([SimJob(0, 1, 100, 0.0), SimJob(1, 14, 100, 5.0)], NVME_PAPER)
    assert done[0] == pytest.approx(0.30 + 0.07625)
    assert done[1] == pytest.approx(5.0 + 0.30 + 0.07625)


def test_an_earlier_layer_arriving_later_is_served_first():
    done = completions_ms([SimJob(0, 14, 1000, 0.0), SimJob(1, 1, 100, 0.1)], NVME_PAPER)
    assert done[1] == pytest.approx(0.1 + 0.30 + 0.07625)            # preempts layer 14's backlog
    assert done[0] == pytest.approx(0.30 + 0.7625e-3 * 1100)         # its own pages plus layer 1's


def test_rdma_paper_reads_600_and_740_pages_in_the_papers_times():
    assert completions_ms([SimJob(0, 1, 600, 0.0)], RDMA_PAPER)[0] == pytest.approx(0.21)
    assert completions_ms([SimJob(0, 1, 740, 0.0)], RDMA_PAPER)[0] == pytest.approx(0.25)


GOOD = {"name": "mine", "intercept_ms": 0.1, "page_us": 1.0, "behind_page_us": 0.1, "queue_depth": 32}


@pytest.mark.parametrize("key", ["intercept_ms", "page_us", "behind_page_us", "queue_depth"])
def test_a_device_model_missing_a_term_is_refused_naming_it(key):
    doc = {k: v for k, v in GOOD.items() if k != key}
    with pytest.raises(SlackTierError, match=f"{key} is missing"):
        model_from_dict({"device": doc}, "mine.toml")


@pytest.mark.parametrize("key, value", [("intercept_ms", -0.1), ("page_us", -1.0), ("behind_page_us", float("nan")),
                                        ("queue_depth", 0), ("ranks_in_fit", 0)])
def test_a_negative_term_or_a_queue_depth_of_0_is_refused_naming_it(key, value):
    with pytest.raises(SlackTierError, match=key):
        model_from_dict({"device": {**GOOD, key: value}}, "mine.toml")


def test_a_toml_model_loads_and_an_unknown_name_is_refused(tmp_path):
    p = tmp_path / "mine.toml"
    p.write_text('[device]\nname = "mine"\nintercept_ms = 0.1\npage_us = 1.0\nbehind_page_us = 0.1\n'
                 'queue_depth = 32\nranks_in_fit = 2\n')
    m = load_device_model(str(p))
    assert (m.name, m.page_us, m.ranks_in_fit) == ("mine", 1.0, 2)
    with pytest.raises(SlackTierError, match="neither built in nor a file"):
        load_device_model("nvme-fast")


def test_one_device_serves_one_model():
    forget_devices()
    try:
        emulated_device("d", NVME_PAPER)
        with pytest.raises(SlackTierError, match="already runs model nvme-paper"):
            emulated_device("d", RDMA_PAPER)
    finally:
        forget_devices()


def _reads(n: int) -> PageReads:
    return PageReads(np.zeros(n, np.int32), np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int32))


def test_an_emulated_disk_returns_the_staged_bytes_and_admits_layer_1_first(o_direct_dir):
    one = stage_synthetic(o_direct_dir / "l1", layers=(1,), ranks=1, rows=900)
    fourteen = stage_synthetic(o_direct_dir / "l14", layers=(14,), ranks=1, rows=900)
    forget_devices()
    opts = EmulatedOptions(model="nvme-paper", device="t", rank=0)
    s1, s14 = EmulatedSource(one.specs, opts), EmulatedSource(fourteen.specs, opts)
    try:
        dev = s1.emulated
        assert s14.emulated is dev
        n = one.specs[0].pages
        p1, p14 = PageBufferPool(n), PageBufferPool(n)
        [q] = [q for q in open_queues() if q.engine_name == "emulated" and q.device.name.startswith("emulated:t/")]
        q.trace(2 * n)
        dev.begin_step()
        dev.rank_host_pass(0)
        s1.hold(True)                         # both batches queued before the queue admits any read
        t14 = s14.submit(_reads(n), p14)      # layer 14 is submitted first ...
        t1 = s1.submit(_reads(n), p1)
        s1.hold(False)
        dev.start_rank(0)
        dev.end_step()
        r14, r1 = s14.wait(t14), s1.wait(t1)
        client, _, _ = q.traced()             # ... yet the queue admits every layer-1 read before layer 14's
        assert client.shape[0] == 2 * n and (client[:n] == client[0]).all() and (client[n:] != client[0]).all()
        q.trace(1)
        s1.wait(s1.submit(_reads(1), p1))
        assert q.traced()[0][0] == client[0], "layer 14's reads were admitted ahead of layer 1's"
        assert r1.pages == r14.pages == n
        assert np.array_equal(p1.pages[:n], one.pages[0][:n])
        assert np.array_equal(p14.pages[:n], fourteen.pages[0][:n])
        # ... and still lands after layer 1, whose pages the device serves first (model times, not a clock)
        done = completions_ms([SimJob(0, 14, n, 0.0), SimJob(1, 1, n, 0.0)], NVME_PAPER)
        assert done[1] < done[0]
    finally:
        s1.close()
        s14.close()
        forget_devices()


def _whatif(tmp_path, *extra: str) -> int:
    return main(["whatif", "--out", str(tmp_path / "w"), "--vocab", "2000", "--steps", "2", "--batch", "8",
                 "--ranks", "2", *extra])


def test_whatif_refuses_one_table_on_an_emulated_and_a_real_device(tmp_path, capsys):
    assert _whatif(tmp_path, "--table", "1=nvme-paper", "--real", "1") == 2
    err = capsys.readouterr().err
    assert "layer 1 placed on emulated and on disk" in err
    assert not (tmp_path / "w").exists()


def test_whatif_refuses_a_model_with_a_negative_term_naming_it(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[device]\nintercept_ms = 0.1\npage_us = -3\nbehind_page_us = 0\nqueue_depth = 8\n')
    assert _whatif(tmp_path, "--table", f"1={bad}", "--table", "14=nvme-paper") == 2
    assert "page_us = -3" in capsys.readouterr().err


def test_whatif_refuses_a_batch_the_traffic_cannot_fill(tmp_path, capsys):
    assert main(["whatif", "--out", str(tmp_path / "w"), "--batch", "128", "--max-session-tokens", "16",
                 "--table", "1=nvme-paper"]) == 2
    assert "B=128 needs 128 sessions" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_whatif_runs_two_ranks_on_one_emulated_disk_with_exact_rows(tmp_path, capsys):
    assert _whatif(tmp_path, "--table", "1=nvme-paper", "--table", "14=rdma-paper", "--disks", "per-rank") == 0
    out = capsys.readouterr().out
    first = out.splitlines()[[i for i, l in enumerate(out.splitlines()) if l.startswith("device reads")][0]]
    assert first == "device reads from model nvme-paper, rdma-paper; device compute from profile v41_paper"
    assert ": 0 mismatching rows" in out and "checker: 2 TP steps" in out
