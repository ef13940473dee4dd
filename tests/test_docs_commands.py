"""Every code block of README.md and docs/*.md does what the page says, as written.

Each page's shell and python blocks run in page order in a scratch folder of
their own (``.venv`` linked in, ``.venv/bin`` first on PATH), so a command
that depends on an earlier one finds its files where the page left them; a toml
block is read by the product's own reader for what it shows. A block a reader
cannot run here carries a ``docs-test: skip`` comment that says why; the test
lists them. A failing block fails its page's test, naming the page and line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from docs_blocks import Block, blocks, toml_kind

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK_TIMEOUT_S = 900


def _env(scratch: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("MPLBACKEND", "Agg")
    return env


def _run(block: Block, scratch: Path) -> None:
    cwd = ROOT if block.in_repo else scratch
    if block.kind == "shell":
        cmd = ["bash", "-euo", "pipefail", "-c", block.text]
    else:
        cmd = [str(ROOT / ".venv" / "bin" / "python"), "-c", block.text]
    try:
        p = subprocess.run(cmd, cwd=cwd, env=_env(scratch), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{block.where()}: the {block.kind} block ran past {BLOCK_TIMEOUT_S} s\n{block.text}\n"
                    f"{(e.stdout or '')[-3000:]}")
    if p.returncode != 0:
        pytest.fail(f"{block.where()}: the {block.kind} block failed (exit {p.returncode}) as written:\n{block.text}\n"
                    f"--- stdout (tail)\n{p.stdout[-3000:]}\n--- stderr (tail)\n{p.stderr[-3000:]}")


def _check_toml(block: Block, scratch: Path) -> None:
    kind = toml_kind(block.text)
    path = scratch / f"block-{block.line}.toml"
    path.write_text(block.text, encoding="utf-8")
    try:
        if kind == "control":
            from slacktier.config import parse_control
            parse_control(block.text, path)
        elif kind == "tiers":
            from slacktier.plan.tiers import load_tiers
            load_tiers(path)
        else:
            from slacktier.whatif.models import load_device_model
            load_device_model(str(path))
    except Exception as e:  # the reader's own error says what is wrong; the page and line say where
        pytest.fail(f"{block.where()}: the toml block is not a valid {kind} file: {e}")


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_blocks_run_as_written(page: Path, tmp_path: Path, record_property) -> None:
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    skipped = []
    ran = 0
    for block in blocks(page):
        if block.kind == "text":
            continue
        if block.skip is not None:
            skipped.append(f"{block.where()}: {block.skip}")
            continue
        if block.kind == "toml":
            _check_toml(block, tmp_path)
        else:
            _run(block, tmp_path)
        ran += 1
    record_property("skipped_blocks", skipped)
    for s in skipped:
        print(f"not run here: {s}")
    assert ran or skipped, f"{page.name} has no code block: nothing to check (drop it from PAGES?)"


def test_commands_sit_in_fenced_blocks() -> None:
    """A command shown as an indented block would never run here: it must be fenced."""
    starts = ("slacktier ", ".venv/bin/", "python -m ", "make ", "export ", "pip install ")
    found = []
    for page in PAGES:
        fenced = {line for b in blocks(page) for line in range(b.line, b.line + b.text.count("\n") + 2)}
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if n in fenced or not line.startswith("    "):
                continue
            if line.strip().startswith(starts):
                found.append(f"{page.name}:{n}: {line.strip()}")
    assert not found, "commands outside fenced blocks (fence them as ```bash so they run):\n" + "\n".join(found)


def test_directives_are_read(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("text\n<!-- docs-test: skip: needs a GPU -->\n```bash\nnvidia-smi\n```\n\n```python\nprint(1)\n```\n"
                    "<!-- docs-test: frobnicate -->\n```bash\ntrue\n```\n")
    with pytest.raises(ValueError, match="unknown docs-test directive"):
        blocks(page)
    page.write_text("<!-- docs-test: skip: needs a GPU -->\n```bash\nnvidia-smi\n```\n```python\nprint(1)\n```\n")
    got = blocks(page)
    assert [(b.line, b.kind, b.skip) for b in got] == [(2, "shell", "needs a GPU"), (5, "python", None)]
    page.write_text("```bash\ntrue\n")
    with pytest.raises(ValueError, match="never closed"):
        blocks(page)


def test_a_failing_block_fails_its_page(tmp_path: Path) -> None:
    """The negative control: a page whose command fails makes the page's test fail."""
    page = tmp_path / "bad.md"
    page.write_text("```bash\nslacktier no-such-verb\n```\n")
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    with pytest.raises(pytest.fail.Exception, match="bad.md:1: the shell block failed"):
        _run(blocks(page)[0], tmp_path)
    page.write_text("```toml\n[engine]\ncache_row = 5\n```\n")
    with pytest.raises(pytest.fail.Exception, match="not a valid control file"):
        _check_toml(blocks(page)[0], tmp_path)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
