#!/usr/bin/env bash
# Sets up .venv (if needed), then lints and runs the whole test suite, one pytest-xdist worker
# per core up to 4 (each test holds one torch thread; LIVEDRAFT_TEST_WORKERS=N sets the count,
# 0 runs in this process). Arguments go to pytest after these, so `-n 0` works too.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
cores=$(nproc 2>/dev/null || echo 1)
workers=${LIVEDRAFT_TEST_WORKERS:-$((cores < 4 ? cores : 4))}
python -m pytest -q -n "$workers" "$@"
