#!/usr/bin/env bash
# Runs the whole test suite. Starts what the tests need (redis-server from
# Debian's packages is installed if missing). pytest's exit code 5 (no tests
# collected) is a failure here, never a silent pass.
#
# Two worker processes (one where the machine has one core), each taking
# whole test files (--dist loadfile: a file's module fixtures stay in one
# process): the suite is CPU-bound and single-threaded, so on CI's two cores
# this about halves it. Files go out in collection order, which
# tests/conftest.py starts with the files that hold slow tests
# (--no-loadscope-reorder: xdist would otherwise send the files with the most
# tests first, and the few long ones would end the run on one process).
# SLACKTIER_TEST_WORKERS overrides the count (0 runs everything in this
# process).
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
if ! command -v redis-server >/dev/null 2>&1; then
    echo "installing redis-server (Debian package) for the Redis tier tests"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
        || echo "warning: could not install redis-server; Redis tests will fail"
fi
workers=${SLACKTIER_TEST_WORKERS:-$(( $(nproc) < 2 ? 1 : 2 ))}
if [ "$workers" -gt 0 ]; then
    "$BIN/python" -m pytest -q -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
else
    "$BIN/python" -m pytest -q "$@"
fi
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing on purpose" >&2
    exit 1
fi
exit "$rc"
