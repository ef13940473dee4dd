"""Every input file a verb reads, given bytes that are not text of its format, is refused in one line (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slacktier import cli
from slacktier.probe.config import read_probe_config
from slacktier.errors import SlackTierError

BINARY = bytes(range(256)) * 8 + b"\xff\xfe\x00"


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("inputs")
    assert cli.main(["stage", "--engram", "1000", "--target", str(d / "t.bin"), "--no-progress"]) == 0
    tiers = d / "tiers.toml"
    tiers.write_text('format = "slacktier-tiers/2"\n[[tier]]\nname = "disk"\nintercept_ms = 0.3\npage_ms = 0.003\n'
                     "ahead_page_ms = 0.003\nbehind_page_ms = 0.0004\nholds_table = false\n"
                     "directory_bytes_per_row = 0\nbuffer_bytes = 0\n")
    curves = d / "curves.json"
    curves.write_text(json.dumps({"workload": "chat", "batch": 8, "policy": "clock", "layers": {
        str(layer): {"capacity_rows": [0, 1000, 100000], "pages_per_step": [50.0, 20.0, 1.0]} for layer in (1, 14)}}))
    binary = d / "bin.dat"
    binary.write_bytes(BINARY)
    for name in ("bin.toml", "bin.json"):
        (d / name).write_bytes(BINARY)
    return {"dir": d, "manifest": d / "t.bin.manifest.json", "tiers": tiers, "curves": curves, "bin": binary,
            "toml": d / "bin.toml", "json": d / "bin.json"}


CASES = {
    "inspect manifest": ["inspect", "{json}"],
    "inspect control": ["inspect", "{toml}"],
    "verify manifest": ["verify", "{json}"],
    "load manifest": ["load", "{json}", "--url", "redis://127.0.0.1:1/0"],
    "plan tiers": ["plan", "--tiers", "{toml}", "--curves", "{curves}", "--table", "1={manifest}", "--window", "1=0.3",
                   "--cache-rows", "10", "--target-ms", "1"],
    "plan curves": ["plan", "--tiers", "{tiers}", "--curves", "{json}", "--table", "1={manifest}", "--window",
                    "1=0.3", "--cache-rows", "10", "--target-ms", "1"],
    "plan manifest": ["plan", "--tiers", "{tiers}", "--curves", "{curves}", "--table", "1={json}", "--window",
                      "1=0.3", "--cache-rows", "10", "--target-ms", "1"],
    "plan windows": ["plan", "--tiers", "{tiers}", "--curves", "{curves}", "--table", "1={manifest}",
                     "--windows-json", "{json}", "--cache-rows", "10", "--target-ms", "1"],
    "stage checkpoint": ["stage", "--checkpoint", "{bin}", "--target", "{dir}/x.bin"],
    "probe read-fit manifest": ["probe", "--read-fit", "{json}"],
    "whatif profile": ["whatif", "--profile", "{json}", "--table", "1=nvme-paper", "--table", "14=nvme-paper"],
    "whatif device model": ["whatif", "--table", "1={toml}", "--table", "14=nvme-paper"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_binary_input_file_is_refused_in_one_line(good, case, capsys):
    argv = [a.format(**{k: str(v) for k, v in good.items()}) for a in CASES[case]]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"slacktier {argv[0]}: error: [") and "\n" not in err, err
    assert "Traceback" not in err and "\\x" not in err, err   # a sentence, not a repr of the bytes


def test_a_probe_config_that_is_not_text_is_refused(good):
    with pytest.raises(SlackTierError, match="is not UTF-8 text"):
        read_probe_config(good["json"])


def test_the_inputs_themselves_are_accepted(good, capsys):
    """The negative control: the same verbs with the good files get past reading them."""
    assert cli.main(["inspect", str(good["manifest"])]) == 0
    assert cli.main(["plan", "--tiers", str(good["tiers"]), "--curves", str(good["curves"]), "--table",
                     f"1={good['manifest']}", "--window", "1=0.3", "--cache-rows", "10", "--target-ms", "5",
                     "--out", str(good["dir"] / "plan" / "c.toml"), "--no-plot"]) == 0
