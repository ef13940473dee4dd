"""The emulated device's model and fluid server: completion times from the model (exact numbers), device models
refused by key, read back from TOML, one model per device. No test reads a wall-clock time."""

from __future__ import annotations

import pytest

from slacktier.errors import SlackTierError
from slacktier.plan.readmodel import DeviceReadModel
from slacktier.whatif import (NVME_PAPER, RDMA_PAPER, DeviceModel, SimJob, completions_ms, device_model_toml,
                              device_session, load_device_model, model_from_dict)


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


GOOD = {"name": "mine", "intercept_ms": 0.1, "page_ms": 1e-3, "behind_page_ms": 1e-4, "queue_depth": 32}


@pytest.mark.parametrize("key", ["intercept_ms", "page_ms", "behind_page_ms", "queue_depth"])
def test_a_device_model_missing_a_term_is_refused_naming_it(key):
    doc = {k: v for k, v in GOOD.items() if k != key}
    with pytest.raises(SlackTierError, match=f"{key} is missing"):
        model_from_dict({"device": doc}, "mine.toml")


@pytest.mark.parametrize("key, value", [("intercept_ms", -0.1), ("page_ms", -1.0), ("behind_page_ms", float("nan")),
                                        ("ahead_page_ms", float("inf")), ("queue_depth", 0), ("ranks_in_fit", 0)])
def test_a_negative_term_or_a_queue_depth_of_0_is_refused_naming_it(key, value):
    with pytest.raises(SlackTierError, match=key):
        model_from_dict({"device": {**GOOD, key: value}}, "mine.toml")


@pytest.mark.parametrize("old, new", [("page_us", "page_ms"), ("behind_page_us", "behind_page_ms")])
def test_a_term_in_us_is_refused_with_the_ms_key_to_write(old, new):
    with pytest.raises(SlackTierError, match=f"{old} = 1.0 is in us.*write {new} in ms"):
        model_from_dict({"device": {**GOOD, old: 1.0}}, "mine.toml")


def test_a_toml_model_loads_in_ms_with_c_defaulting_to_b_and_an_unknown_name_is_refused(tmp_path):
    p = tmp_path / "mine.toml"
    p.write_text('[device]\nname = "mine"\nintercept_ms = 0.1\npage_ms = 0.001\nbehind_page_ms = 0.0001\n'
                 'queue_depth = 32\nranks_in_fit = 2\n')
    m = load_device_model(str(p))
    assert (m.name, m.read, m.ranks_in_fit) == ("mine", DeviceReadModel(0.1, 0.001, 0.001, 0.0001), 2)
    with pytest.raises(SlackTierError, match="neither built in nor a file"):
        load_device_model("nvme-fast")


def test_a_model_written_as_toml_reads_back_equal(tmp_path):
    m = DeviceModel("my \"nvme\"", DeviceReadModel(0.123456789, 2.5e-3, 2.0e-3, 0.0), 64, 4,
                    'fit of "today", C:\\runs')
    path = tmp_path / "m.toml"
    path.write_text(device_model_toml(m))
    assert load_device_model(str(path)) == m


def test_the_papers_nvme_is_the_planners_read_model_and_scales_with_the_ranks_sharing_it():
    """One read model: nvme-paper's terms are plan.readmodel.PAPER_NVME's; read by one rank instead of the
    fit's four, each per-page term is a quarter, the intercept stays."""
    from slacktier.plan.readmodel import PAPER_NVME

    assert NVME_PAPER.read == PAPER_NVME and NVME_PAPER.scaled(4) == PAPER_NVME
    one = NVME_PAPER.scaled(1)
    assert (one.intercept_ms, one.page_ms, one.ahead_page_ms, one.behind_page_ms) == pytest.approx(
        (0.30, 3.05e-3 / 4, 3.05e-3 / 4, 0.37e-3 / 4))


def test_one_device_serves_one_model_and_a_session_forgets_its_devices():
    with device_session() as session:
        d = session.device("d", NVME_PAPER)
        assert session.device("d", NVME_PAPER) is d
        with pytest.raises(SlackTierError, match="already runs model nvme-paper"):
            session.device("d", RDMA_PAPER)
    with device_session() as later:
        assert later.devices() == [] and later.device("d", RDMA_PAPER).model is RDMA_PAPER


def test_sessions_do_not_nest():
    with device_session():
        with pytest.raises(SlackTierError, match="already open"):
            with device_session():
                pass
