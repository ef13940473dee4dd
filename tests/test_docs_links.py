"""Every link and section reference a reader follows leads somewhere.

Two kinds of pointer are checked. A markdown link (``[text](path#anchor)``) on
README.md, BENCHMARKS.md, benchmarks/README.md and docs/*.md must name a file or
folder that exists, and its ``#anchor`` must be a heading of that page as GitHub
renders it. A reference by name, ``BENCHMARKS.md, "Host pass"`` or
``docs/bench-log/tier.md ("Page sources")``, written in the pages, the
benchmarks, the tests or the bench logs, must name a heading of that file (the
heading may go on after the name). Links inside code blocks and code spans are
examples, not links, and are left alone.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK_PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "benchmarks" / "README.md",
              *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?(?P<target>[^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(?P<text>.+?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
# `FILE.md, "Section"` or `FILE.md ("Section")`, the file name maybe in backticks; the name may wrap a line.
_NAMED_REF = re.compile(r"(?P<file>[\w./-]*\w\.md)`?\s*(?:,\s*\(?|\(\s*)\"(?P<name>[^\"]{2,200}?)\"")


def _prose_lines(text: str, keep_code_spans: bool = False) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with code spans blanked unless kept."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line if keep_code_spans else _CODE_SPAN.sub("", line)))
    return out


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: "Host pass: `s` (B=128)" -> "host-pass-s-b128"."""
    text = re.sub(r"<[^>]+>", "", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)      # a link in a heading keeps its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings(page: Path) -> list[str]:
    """A page's headings in order, as written (outside code blocks)."""
    return [m.group("text") for _, line in _prose_lines(page.read_text(encoding="utf-8"), keep_code_spans=True)
            if (m := _HEADING.match(line))]


def anchors(page: Path) -> set[str]:
    """Every anchor of a page: its headings' slugs (a repeated one gets -1, -2, ...) and HTML anchors."""
    seen: dict[str, int] = {}
    out = set()
    for h in headings(page):
        slug = github_slug(h)
        k = seen.get(slug, 0)
        seen[slug] = k + 1
        out.add(slug if k == 0 else f"{slug}-{k}")
    out.update(_HTML_ANCHOR.findall(page.read_text(encoding="utf-8")))
    return out


def broken_links(page: Path) -> list[str]:
    """'page:line: target (why)' for every relative link of a page that leads nowhere."""
    bad = []
    for n, line in _prose_lines(page.read_text(encoding="utf-8")):
        for m in _LINK.finditer(line):
            target = m.group("target")
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):          # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(ROOT)}:{n}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
            elif anchor:
                if dest.is_dir() or dest.suffix != ".md":
                    bad.append(f"{where} (an anchor into something that is not a markdown page)")
                elif anchor not in anchors(dest):
                    bad.append(f"{where} (no heading with that anchor in {dest.relative_to(ROOT)})")
    return bad


def _norm(text: str) -> str:
    """Whitespace and comment markers folded, so a name wrapped over lines reads as written."""
    return re.sub(r"\s+", " ", re.sub(r"\n\s*#+", "\n", text)).strip().lower()


def _resolve(name: str, source: Path) -> Path | None:
    for base in (ROOT, source.parent):
        p = (base / name).resolve()
        if p.is_file():
            return p
    return None


def broken_section_refs(source: Path) -> list[str]:
    """'file:line: FILE.md "Name" (why)' for every reference by name to a heading that is not there."""
    text = source.read_text(encoding="utf-8")
    bad = []
    for m in _NAMED_REF.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        where = f"{source.relative_to(ROOT)}:{line}: {m.group('file')} \"{' '.join(m.group('name').split())}\""
        dest = _resolve(m.group("file"), source)
        if dest is None:
            bad.append(f"{where} (no such file)")
            continue
        name = _norm(m.group("name"))
        if not any(_norm(h).startswith(name) for h in headings(dest)):
            bad.append(f"{where} (no heading of that name in {dest.relative_to(ROOT)})")
    return bad


def _ref_sources() -> list[Path]:
    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]
    code = sorted((ROOT / "benchmarks").rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.md")) + \
        sorted((ROOT / "src").rglob("*.py"))
    tests = sorted((ROOT / "tests").rglob("*.py"))
    return [p for p in pages + code + tests if p.name != Path(__file__).name]


@pytest.mark.parametrize("page", LINK_PAGES, ids=[str(p.relative_to(ROOT)) for p in LINK_PAGES])
def test_relative_links_resolve(page: Path) -> None:
    bad = broken_links(page)
    assert not bad, "links that lead nowhere:\n" + "\n".join(bad)


def test_sections_named_in_text_exist() -> None:
    bad = [b for p in _ref_sources() for b in broken_section_refs(p)]
    assert not bad, "references to sections that are not there (rename the reference or the heading):\n" + \
        "\n".join(bad)


def test_the_checks_catch_what_they_should(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative controls: a missing file, a missing anchor and a missing section are each reported."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "B.md").write_text("# Title\n\n## Host pass: `s` (B=128)\n\n## Host pass: `s` (B=128)\n")
    page = tmp_path / "docs" / "p.md"
    page.write_text("[ok](../B.md#host-pass-s-b128) [ok2](../B.md#host-pass-s-b128-1) [self](#here)\n"
                    "# here\n[gone](../C.md) [no anchor](../B.md#host-pass) `[code](../D.md)`\n"
                    "```\n[fenced](../E.md)\n```\n[web](https://example.com/x#y)\n")
    assert broken_links(page) == ["docs/p.md:3: ../C.md (no such file)",
                                  "docs/p.md:3: ../B.md#host-pass (no heading with that anchor in B.md)"]
    src = tmp_path / "s.py"
    src.write_text('# see B.md, "Host pass" and B.md ("Host\n# pass: `s`") and B.md, "Disk" and X.md, "Ab"\n')
    assert broken_section_refs(src) == ['s.py:2: B.md "Disk" (no heading of that name in B.md)',
                                        's.py:2: X.md "Ab" (no such file)']
