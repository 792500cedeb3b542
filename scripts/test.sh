#!/usr/bin/env bash
# Sets up .venv (if needed), then lints and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
python -m pytest -q "$@"
