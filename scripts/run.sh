#!/usr/bin/env bash
# Sets up .venv (if needed), then runs the main job: `livedraft up --demo` — SmolLM2-135M served
# with a drafter derived from it, the collector and the trainer schedule in the same process, and
# greedy traffic for ~150 s; it prints the mean acceptance length and the drafter version as rounds
# promote new versions, then drains and exits. Data goes to a fresh temporary directory unless
# --data-dir is given; extra arguments go to `livedraft up`.
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
