#!/usr/bin/env bash
# Sets up .venv (if needed), then runs the main job: `livedraft up --demo` — SmolLM2-135M served
# with the hybrid drafter (the traffic's suffix cache, else an EAGLE-3 head warm-started once on
# built-in prompts and cached), the collector and the trainer schedule in the same process, and
# 72 greedy story requests (--demo-requests); it prints acceptance and tokens/s against target-only requests
# of the same run as rounds promote new versions, then a table per version, drains and exits.
# Data goes to a fresh temporary directory unless --data-dir is given; extra arguments go to
# `livedraft up`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export MLFLOW_DISABLE_TELEMETRY=true
args=("$@")
if [[ " $* " != *" --data-dir "* ]]; then
    data_dir="$(mktemp -d -t livedraft-demo-XXXXXX)"
    args+=(--data-dir "$data_dir")
fi
exec livedraft up --demo "${args[@]}"
