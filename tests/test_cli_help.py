"""`slacktier --version`, and every verb's --help (and its subcommands') shows each option's default."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import slacktier
from slacktier import cli

ROOT = Path(__file__).resolve().parents[1]


def _parsers(parser: argparse.ArgumentParser, name: str = "slacktier"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def _missing_defaults(parser: argparse.ArgumentParser) -> list[str]:
    """Options with a real default (not None, not a flag's False) whose default the help does not show."""
    text = " ".join(parser.format_help().split())
    out = []
    for action in parser._actions:
        default = action.default
        if (not action.option_strings or default is None or default is False or default is argparse.SUPPRESS
                or action.help is argparse.SUPPRESS):
            continue
        shown = f"default: {default}" in text
        stated = bool(action.help) and "default" in action.help.lower() and str(default) in action.help
        if not (shown or stated):
            out.append(f"{action.option_strings[0]}={default!r}")
    return out


def test_every_verbs_help_shows_its_options_defaults():
    seen = 0
    for name, parser in _parsers(cli.build_parser()):
        assert _missing_defaults(parser) == [], name
        seen += 1
    assert seen > len(cli.VERBS)   # the verbs and redknot's subcommands were walked


def test_the_check_fails_on_a_plain_argparse_help():
    """The negative control: argparse's own formatter hides defaults, and the check says which."""
    plain = argparse.ArgumentParser(prog="slacktier plan")
    cli._load("plan").add_arguments(plain)
    assert _missing_defaults(plain) != []


def test_version_prints_the_package_version_and_where_it_was_imported_from():
    r = subprocess.run([sys.executable, "-m", "slacktier", "--version"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert slacktier.__version__ == version
    assert re.fullmatch(rf"slacktier {re.escape(version)} \(.+\)\n", r.stdout), r.stdout
    assert str(Path(slacktier.__file__).parent) in r.stdout


@pytest.mark.parametrize("verb", sorted(cli.VERBS))
def test_a_verbs_help_exits_zero(verb, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([verb, "--help"])
    assert done.value.code == 0
    assert "usage: slacktier " + verb in capsys.readouterr().out
