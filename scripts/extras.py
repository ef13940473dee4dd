"""Print the pinned requirements of pyproject.toml's named extras, one line: `python scripts/extras.py vllm sglang`.

The Makefile installs some extras with `pip install --no-deps` (the serving engines' CPU test oracles), which
pip's own `.[extra]` syntax cannot do: this keeps their pins in pyproject.toml only.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def main(names: list[str]) -> int:
    extras = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    missing = [n for n in names if n not in extras]
    if missing or not names:
        print(f"unknown extras {missing or names}; pyproject.toml has {sorted(extras)}", file=sys.stderr)
        return 2
    print(" ".join(req for n in names for req in extras[n]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
