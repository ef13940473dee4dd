#!/usr/bin/env bash
# Runs the whole test suite. Starts what the tests need (redis-server from
# Debian's packages is installed if missing). pytest's exit code 5 (no tests
# collected) is a failure here, never a silent pass.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
if ! command -v redis-server >/dev/null 2>&1; then
    echo "installing redis-server (Debian package) for the Redis tier tests"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
        || echo "warning: could not install redis-server; Redis tests will fail"
fi
"$BIN/python" -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing on purpose" >&2
    exit 1
fi
exit "$rc"
