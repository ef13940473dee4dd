"""`slacktier <verb>`: one module per verb under slacktier.commands.

Each verb module defines `HELP` (one line), `add_arguments(parser)` and
`run(args) -> int`. Verbs are imported only when used, so `--help` stays fast
and a verb's heavy imports (torch, transformers) cost nothing elsewhere.

Exit codes: 0 done; 1 the verb ran and found a problem (`verify` found a bad
page); 2 the command was refused: bad arguments (argparse), or a SlackTierError
(from the verb, or from an argument type of `commands._args` while parsing)
or OSError, printed as one line "slacktier VERB: error: ..." with its fix and
no traceback (`-v` adds the traceback).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback
from pathlib import Path

from slacktier.errors import SlackTierError

# verb -> module under slacktier.commands. The end-to-end benchmark is not a verb: it is an experiment beside the
# package, `python benchmarks/paper/bench_e2e_table2.py`.
VERBS = {
    "demo": "demo",
    "stage": "stage",
    "verify": "verify",
    "characterize": "characterize",
    "probe": "probe",
    "plan": "plan",
    "inspect": "inspect",
    "load": "load",
    "redknot": "redknot",
    "whatif": "whatif",
}


def _load(verb: str):
    return importlib.import_module(f"slacktier.commands.{VERBS[verb]}")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless it has none (None, a flag's False) or states it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if (default is None or default is False or default is argparse.SUPPRESS or not action.help
                or "%(default)" in action.help or "default" in action.help.lower()):
            return action.help
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return action.help + " (default: %(default)s)"
        return action.help


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows defaults; the verbs' subparsers (and theirs) are of this class too."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        if not action.help and action.default is not None and action.default is not False:
            action.help = "default: %(default)s"   # an option without help still shows its default
        return action


def build_parser() -> argparse.ArgumentParser:
    """The full parser, every verb with its own --help."""
    from slacktier import __file__ as package_file, __version__

    parser = Parser(
        prog="slacktier",
        description="Serve token-indexed LLM lookup tables from DRAM, disk or remote memory by layer deadline.",
    )
    parser.add_argument("--version", action="version",
                        version=f"slacktier {__version__} ({Path(package_file).parent})")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for verb in VERBS:
        try:
            module = _load(verb)
        except ModuleNotFoundError as exc:
            if exc.name != f"slacktier.commands.{VERBS[verb]}":
                raise
            continue  # a verb whose module is not written yet is not offered
        p = sub.add_parser(verb, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `slacktier` command."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parser.parse_args(argv)
    except SlackTierError as exc:   # an argument type (commands._args) refused a value: one line, exit 2
        verb = next((a for a in argv if a in VERBS), "")
        print(f"slacktier {verb}: error: {exc}".replace("slacktier : ", "slacktier: "), file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except (SlackTierError, OSError) as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"slacktier {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:   # Ctrl-C: one line, not a traceback; verbs that can save partial work do so first
        print(f"slacktier {args.verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
