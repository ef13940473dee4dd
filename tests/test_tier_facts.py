"""Tier facts instead of tier names: no code outside store/ (and the registry of option types in config.py)
compares a tier's name, so a first-class tier touches store/ and its registration only."""

from __future__ import annotations

import re
from pathlib import Path

from slacktier.config import DiskOptions, DramOptions, RedisOptions, tier_facts, tier_names

SRC = Path(__file__).resolve().parents[1] / "src" / "slacktier"


def test_no_tier_name_is_compared_outside_store() -> None:
    names = "|".join(re.escape(n) for n in tier_names())
    compare = re.compile(rf"""(==|!=)\s*["']({names})["']|["']({names})["']\s*(==|!=)|\bin\s*\(\s*["']({names})["']""")
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if rel.parts[0] == "store" or rel.as_posix() == "config.py":
            continue
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if compare.search(line):
                found.append(f"{rel}:{no}: {line.strip()}")
    assert found == [], "compare a tier's facts (config.tier_facts), not its name:\n" + "\n".join(found)


def test_the_built_in_tiers_facts() -> None:
    assert [tier_facts(n) for n in ("dram", "disk", "redis")] == [DramOptions, DiskOptions, RedisOptions]
    assert [(o.holds_host_copy, o.device_kind) for o in (DramOptions, DiskOptions, RedisOptions)] \
        == [(True, "host"), (False, "file"), (False, "remote")]
