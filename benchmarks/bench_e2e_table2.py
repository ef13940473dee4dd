"""End to end: the paper's Table 2, Figures 3 and 5 on this machine (see slacktier.serve.bench).

    .venv/bin/python benchmarks/bench_e2e_table2.py            # full run, updates BENCHMARKS.md
    .venv/bin/python benchmarks/bench_e2e_table2.py --quick    # the demo's short version

Prints the Table 2 analog, writes docs/img/e2e_fig3_cache_split.png and docs/img/e2e_fig5_load.png,
and replaces the '## End to end' section of BENCHMARKS.md with the numbers it printed.
"""

from __future__ import annotations

import sys

from slacktier.cli import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--quick" not in argv:
        argv = ["--png-dir", "docs/img", "--markdown", "BENCHMARKS.md",
                "--command-line", "python benchmarks/bench_e2e_table2.py " + " ".join(argv)] + argv
    sys.exit(main(["bench", *argv]))
