#!/usr/bin/env bash
# Sets up .venv (if needed), then runs the main job: the speculative generation demo on
# SmolLM2-135M with a drafter derived from it, printing text and acceptance statistics.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export MLFLOW_DISABLE_TELEMETRY=true
exec livedraft demo "$@"
