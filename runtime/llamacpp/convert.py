"""Hugging Face model directory -> GGUF with llama.cpp's own converter (installed beside llama-server)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from runtime.errors import LivedraftError
from runtime.llamacpp.binary import Locations, find_converter


def hf_to_gguf(hf_dir: str | os.PathLike, out_path: str | os.PathLike, outtype: str = "f32", *,
               locations: Locations | None = None, python: str = sys.executable) -> Path:
    """Writes `out_path` (outtype: f32, f16, bf16, q8_0, ...) and returns it."""
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    if not (hf_dir / "config.json").is_file():
        raise LivedraftError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
    converter = find_converter(locations)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [python, str(converter / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(out_path),
           "--outtype", outtype]
    # the converter's own gguf-py, not the (possibly older) gguf package of the venv
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(converter / "gguf-py"),
                                                                     os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0 or not out_path.is_file():
        tail = (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or ["no output"])[-1]
        raise LivedraftError(f"convert_hf_to_gguf.py failed on {hf_dir} (exit {done.returncode}): {tail}")
    return out_path
