"""The code blocks of README.md and docs/*.md, as the tests that run them see them.

A page's fenced blocks are read in order. What a block is for comes from its
language tag; an HTML comment on the line right above a block (invisible on a
rendered page) says what a reader cannot run here, and why:

    <!-- docs-test: skip: the suite itself (CI runs it) -->
    <!-- docs-test: in-repo -->          run in the checkout (``make demo``), not in the page's scratch folder

Shell blocks (bash, sh, console) and python blocks run; toml blocks are parsed
by the product's own reader for what they show (a control file, a tiers file, a
device model); text blocks (diagrams, output) are not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

RUN_LANGS = {"bash": "shell", "sh": "shell", "shell": "shell", "console": "shell", "python": "python",
             "toml": "toml"}
_DIRECTIVE = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<what>[a-z-]+)\s*(?::\s*(?P<why>.*?))?\s*-->\s*$")
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[A-Za-z0-9_+-]*)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it stands, what it is, and what the page says about running it."""

    page: Path
    line: int          # 1-based line of the opening fence
    lang: str          # the fence's language tag, lower case ("" when none)
    text: str          # the block's lines, the fence's indentation removed
    skip: str | None   # why it is not run here, from a `docs-test: skip` comment
    in_repo: bool      # runs in the checkout rather than in the page's scratch folder

    @property
    def kind(self) -> str:
        """shell, python, toml, or text (not run)."""
        return RUN_LANGS.get(self.lang, "text")

    def where(self) -> str:
        return f"{self.page.name}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """Every fenced block of a markdown page, in page order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group("indent")), m.group("fence"), m.group("lang").lower()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        if i >= len(lines):
            raise ValueError(f"{page}:{start + 1}: a code block opened here is never closed")
        i += 1
        skip, in_repo = None, False
        d = _DIRECTIVE.match(lines[start - 1]) if start > 0 else None
        if d:
            what = d.group("what")
            if what == "skip":
                if not d.group("why"):
                    raise ValueError(f"{page}:{start}: a docs-test skip must say why (docs-test: skip: REASON)")
                skip = d.group("why")
            elif what == "in-repo":
                in_repo = True
            else:
                raise ValueError(f"{page}:{start}: unknown docs-test directive {what!r} (skip, in-repo)")
        out.append(Block(page, start + 1, lang, "\n".join(body) + "\n", skip, in_repo))
    return out


def toml_kind(text: str) -> str:
    """What a toml block shows: a control file, a tiers file, or a device model."""
    if re.search(r"^\s*format\s*=\s*\"slacktier-tiers/", text, re.M) or re.search(r"^\s*\[\[tier\]\]", text, re.M):
        return "tiers"
    if re.search(r"^\s*\[device\]", text, re.M):
        return "device"
    return "control"
