"""Resolve `pip install 'slacktier[EXTRA]'` against the registry's metadata only: `python scripts/resolve_extras.py sglang vllm`.

The serving engines' extras must resolve in one environment with their own pins (sglang 0.5.23 pins
transformers, torch, numba, tokenizers exactly). `make setup` installs the engines with `--no-deps` as CPU test
oracles, which would hide a conflict; this runs the real resolution first, without downloading a wheel: uv
reads each wheel's metadata (PEP 658 files where the index serves them, else HTTP range requests into the wheel)
for the platform of a serving machine (Linux x86_64, glibc 2.34), not the machine running it.

Prints one line per extra (packages, the engine's key pins, seconds, cache bytes) and exits 0 when every extra
resolves; else prints the resolver's reason and exits 1. `--constraint REQ` adds a requirement (the tests'
negative control: the old core pin `transformers>=5.20` beside sglang must fail). uv is the test extra's
(`pip install uv`); the index is PyPI unless `--index-url` says otherwise.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHOWN = ("sglang", "vllm", "torch", "transformers", "tokenizers", "numba", "numpy")


def uv_binary() -> str:
    """The uv executable: the `uv` package's own (the test extra), else one on PATH."""
    try:
        from uv import find_uv_bin
        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if found is None:
            raise SystemExit("resolve_extras: uv is not installed. Fix: pip install uv (the test extra has it)")
        return found


def cache_facts(cache: Path) -> tuple[int, int, list[str]]:
    """(bytes in the cache, largest file's bytes, wheels unpacked into it): uv unpacks every wheel it downloads
    under archive-v*/, so an empty list means no wheel was downloaded, only index pages and metadata."""
    sizes = [p.stat().st_size for p in cache.rglob("*") if p.is_file()]
    unpacked = sorted(str(p.relative_to(cache)) for d in cache.glob("archive-v*") for p in d.iterdir())
    return sum(sizes), max(sizes, default=0), unpacked


def resolve(extra: str, *, python: str, platform: str, index_url: str, cache: Path,
            constraints: list[str]) -> tuple[bool, str]:
    """(resolved, the one-line summary or the resolver's reason) for slacktier[extra]."""
    cmd = [uv_binary(), "pip", "compile", str(ROOT / "pyproject.toml"), "--extra", extra, "--no-config",
           "--python-version", python, "--python-platform", platform, "--index-url", index_url,
           "--cache-dir", str(cache), "--no-header", "--no-annotate", "--system-certs", "--quiet"]
    with tempfile.TemporaryDirectory() as tmp:
        if constraints:
            path = Path(tmp) / "constraints.txt"
            path.write_text("\n".join(constraints) + "\n")
            cmd += ["--constraint", str(path)]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        seconds = time.perf_counter() - t0
    if r.returncode != 0:
        return False, f"slacktier[{extra}] does not resolve: {r.stderr.strip()}"
    pins = dict(re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)$", r.stdout, re.M))
    total, largest, unpacked = cache_facts(cache)
    shown = ", ".join(f"{n}=={pins[n]}" for n in SHOWN if n in pins)
    wheels = "no wheel downloaded" if not unpacked else f"wheels downloaded: {', '.join(unpacked)}"
    return True, (f"slacktier[{extra}] resolves for Python {python} on {platform}: {len(pins)} packages ({shown}); "
                  f"{seconds:.1f} s, cache {total / 2**20:.1f} MiB (largest file {largest / 2**20:.1f} MiB), "
                  f"{wheels}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("extras", nargs="+", help="pyproject.toml extras to resolve, e.g. sglang vllm")
    parser.add_argument("--python", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                        help="the Python version to resolve for")
    parser.add_argument("--platform", default="x86_64-manylinux_2_34", help="uv's --python-platform")
    parser.add_argument("--index-url", default="https://pypi.org/simple", help="the package index")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="uv's cache (default: a fresh temporary one, so the bytes it holds are what was read)")
    parser.add_argument("--constraint", action="append", default=[], metavar="REQ",
                        help="an added requirement, e.g. 'transformers>=5.20'")
    args = parser.parse_args(argv)
    failed = 0
    with tempfile.TemporaryDirectory(prefix="slacktier-resolve-") as tmp:
        for extra in args.extras:
            cache = args.cache_dir or Path(tmp) / extra
            ok, line = resolve(extra, python=args.python, platform=args.platform, index_url=args.index_url,
                               cache=cache, constraints=args.constraint)
            print(line, file=sys.stdout if ok else sys.stderr)
            failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
