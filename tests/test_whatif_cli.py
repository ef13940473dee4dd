"""`slacktier whatif`: its refusals, and its report over emulated devices (exact rows, the verdict from its
table, a stated host pass named first)."""

from __future__ import annotations

import pytest

from slacktier.cli import main


def _whatif(tmp_path, *extra: str, runs: int = 1) -> int:
    return main(["whatif", "--out", str(tmp_path / "w"), "--vocab", "2000", "--steps", "2", "--batch", "8",
                 "--ranks", "2", "--runs", str(runs), "--no-plot", *extra])


def test_whatif_refuses_one_table_on_an_emulated_and_a_real_device(tmp_path, capsys):
    assert _whatif(tmp_path, "--table", "1=nvme-paper", "--real", "1") == 2
    err = capsys.readouterr().err
    assert "layer 1 placed on emulated and on disk" in err
    assert not (tmp_path / "w").exists()


def test_whatif_refuses_a_model_with_a_negative_term_naming_it(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[device]\nintercept_ms = 0.1\npage_ms = -3\nbehind_page_ms = 0\nqueue_depth = 8\n')
    assert _whatif(tmp_path, "--table", f"1={bad}", "--table", "14=nvme-paper") == 2
    assert "page_ms = -3" in capsys.readouterr().err


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


def _report_lines(out: str) -> list[str]:
    lines = out.splitlines()
    return lines[[i for i, l in enumerate(lines) if l.startswith("device reads")][0]:]


def test_whatif_report_starts_with_a_verdict_computed_from_its_table(tmp_path, capsys):
    """Two placements, 3 runs each: the verdict names the cheaper one in words with the table's own figure; every
    line fits 120 characters and names no tracker issue."""
    import re

    from slacktier.cli import build_parser

    assert build_parser().parse_args(["whatif"]).runs == 3
    assert main(["whatif", "--out", str(tmp_path / "w"), "--vocab", "2000", "--steps", "2", "--batch", "8",
                 "--ranks", "2", "--table", "1=nvme-paper", "--table", "14=nvme-paper"]) == 0   # default runs: 3
    lines = _report_lines(capsys.readouterr().out)
    assert max(map(len, lines)) <= 120 and not any(re.search(r"issue \d", l) for l in lines)
    at = [i for i, l in enumerate(lines) if l.startswith("Verdict: ")]
    assert len(at) == 1
    verdict = " ".join(l.strip() for l in lines[at[0]:at[0] + 2])
    assert verdict.startswith("Verdict: put layer 1 on nvme-paper, layer 14 on nvme-paper (one disk for 2 ranks):")
    head = next(i for i, l in enumerate(lines) if l.startswith("placement "))
    row = lines[head + 1]
    assert at[0] < head   # the verdict above the table
    overhead = re.search(r"([+-]\d+\.\d)%", row[30:]).group(1)
    assert f": {overhead}% of the step in stalls (3 runs," in verdict
    assert (tmp_path / "w" / "whatif.png").stat().st_size > 5000


def test_a_one_rank_whatif_on_emulated_devices_copies_each_steps_pages_at_the_seal(tmp_path, capsys, monkeypatch):
    """One rank runs the TP step as four do: its host pass, then the device's seal (every page copied before the
    step's clock starts), then its timeline step; only a layer on this machine's disk runs begin_step inline."""
    from slacktier.whatif.device import EmulatedDevice

    seals = {"n": 0}
    real = EmulatedDevice.seal

    def seal(self):
        seals["n"] += 1
        return real(self)

    monkeypatch.setattr(EmulatedDevice, "seal", seal)
    assert main(["whatif", "--out", str(tmp_path / "w"), "--vocab", "2000", "--steps", "2", "--batch", "8",
                 "--ranks", "1", "--runs", "1", "--no-plot", "--table", "1=rdma-paper",
                 "--table", "14=nvme-paper"]) == 0
    out = capsys.readouterr().out
    assert ": 0 mismatching rows" in out
    assert seals["n"] >= 2 * 2   # two devices (one per model), at least the two timed steps


@pytest.mark.parametrize("value", ["nan", "-0.1", "1e400", "x"])
def test_whatif_refuses_a_stated_host_pass_that_is_not_a_finite_number_of_ms(tmp_path, capsys, value):
    assert _whatif(tmp_path, "--table", "1=nvme-paper", "--host-pass-ms", value) == 2
    assert "--host-pass-ms" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_whatif_refuses_a_stated_host_pass_beside_this_machines_disk(tmp_path, capsys):
    assert main(["whatif", "--out", str(tmp_path / "w"), "--vocab", "2000", "--steps", "2", "--batch", "8",
                 "--ranks", "1", "--real", "1", "--host-pass-ms", "0.1"]) == 2
    assert "a stated host pass with layer 1 on this machine's disk" in capsys.readouterr().err


def test_a_stated_host_pass_is_named_in_the_first_line_beside_the_measured_one(tmp_path, capsys):
    """--host-pass-ms states the user's s: the report says so before anything else, and still prints this
    machine's own begin_step from the same runs; the rows stay exact."""
    assert _whatif(tmp_path, "--table", "1=nvme-paper", "--table", "14=nvme-paper", "--host-pass-ms", "0.05") == 0
    lines = capsys.readouterr().out.splitlines()
    first = [i for i, l in enumerate(lines) if l.startswith("device reads")][0]
    assert lines[first] == ("device reads from model nvme-paper; device compute from profile v41_paper; host pass "
                            "stated at 0.05 ms per rank, not measured")
    stated = [i for i, l in enumerate(lines) if l.startswith("  host pass s: stated, 0.05 ms per rank")]
    assert len(stated) == 1 and "slowest rank's mean" in " ".join(lines[stated[0]:stated[0] + 2])
    assert any(": 0 mismatching rows" in l for l in lines)




def test_an_admission_rule_is_served_with_the_replays_prefill_flags_and_named_first(tmp_path, capsys, monkeypatch):
    """--admission sets every rank's [engine] admission; the replay's prefill chunks reach begin_step flagged as
    prefill (what the rule reads), its decode steps as decode; the report names the rule; rows stay exact."""
    from slacktier.engine.step import StepEngine

    seen = {"prefill": 0, "decode": 0, "rules": set()}
    real = StepEngine.begin_step

    def begin_step(self, ids, decode=None):
        seen["rules"].add(self.admission)
        if decode is not None:
            seen["prefill"] += int((~decode).sum())
            seen["decode"] += int(decode.sum())
        return real(self, ids, decode)

    monkeypatch.setattr(StepEngine, "begin_step", begin_step)
    assert _whatif(tmp_path, "--table", "1=nvme-paper", "--table", "14=nvme-paper", "--cache-rows", "2000",
                   "--share", "1=0.5", "--share", "14=0.5", "--admission", "counters") == 0
    lines = capsys.readouterr().out.splitlines()
    first = [i for i, l in enumerate(lines) if l.startswith("device reads")][0]
    assert lines[first].endswith('; cache admission "counters"')
    assert seen["rules"] == {"counters"} and seen["prefill"] > 0 and seen["decode"] > 0
    assert any(": 0 mismatching rows" in l for l in lines)
    from slacktier.errors import SlackTierError
    from slacktier.whatif.run import WhatIfConfig

    with pytest.raises(SlackTierError, match="admission 'sometimes'"):
        WhatIfConfig(admission="sometimes")
