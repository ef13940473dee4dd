"""Binary units for sizes and memory in every verb (KiB, MiB, GiB: powers of 1024), never GB/MB beside GiB."""

from __future__ import annotations

import re

import pytest

from slacktier import cli
from slacktier.serve.report import demo_stage_report
from slacktier.tables.layout import binary_bytes


@pytest.mark.parametrize("n, text", [(100, "100 B"), (4096, "4.0 KiB"), (78_643_200, "75.0 MiB"),
                                     (4_000_000_000, "3.73 GiB"), (3 * 2**40, "3.00 TiB"), (1023, "1023 B")])
def test_binary_bytes_worked_examples(n, text):
    assert binary_bytes(n) == text


DECIMAL = re.compile(r"\d (kB|KB|MB|GB|TB)\b")


def test_stage_prints_its_size_and_rate_in_binary_units(tmp_path, capsys):
    assert cli.main(["stage", "--synthetic", "1=3000,14=4500", "--target", str(tmp_path / "t.bin"),
                     "--no-progress"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert re.search(r"pages, \d+\.\d (KiB|MiB)\) in [\d.]+ s \([\d.]+ (KiB|MiB|GiB)/s\)", first), first
    assert not DECIMAL.search(out), out


def test_the_demos_staging_line_is_in_binary_units():
    text = demo_stage_report(2, 1000, 1, 2, 3 * 2**20, "t.bin", 0.5, "t.json", 1, [0.0], [])
    assert "staged     3.0 MiB in 0.50 s" in text and "(6.0 MiB/s" in text and "into       t.bin" in text
    assert not DECIMAL.search(text)
