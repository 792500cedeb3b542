"""Derive a small drafter from a target: its embeddings, first N layers, final norm and LM head.

With `vocab_top`, the drafter's LM head is trimmed at load time to the V most
frequent target tokens of a text corpus (VocabTrim): the kept ids are stored in
`livedraft_drafter.json` and map the head's rows back to target ids. The saved
weights stay full, so training (which updates the full head) and trimming
compose.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from collections import Counter
from pathlib import Path

from transformers import AutoModelForCausalLM

from runtime.errors import ModelLoadError
from runtime.loader import DRAFTER_META, MODEL_LOAD_LOCK, LoadedModel

log = logging.getLogger(__name__)


def derive_drafter(
    target: LoadedModel,
    layers: int,
    out_dir: str | os.PathLike,
    *,
    vocab_top: int | None = None,
    text_file: str | os.PathLike | None = None,
) -> Path:
    """Writes a Hugging Face drafter directory to `out_dir` and returns its path."""
    total = int(target.model.config.num_hidden_layers)
    if not 1 <= layers <= total:
        raise ModelLoadError(f"--layers must be between 1 and the target's {total} layers, got {layers}")
    cfg = copy.deepcopy(target.model.config)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    with MODEL_LOAD_LOCK:  # module construction must not overlap a from_pretrained elsewhere
        drafter = AutoModelForCausalLM.from_config(cfg)
    keep = {k: v for k, v in target.model.state_dict().items() if not _beyond(k, layers)}
    missing, unexpected = drafter.load_state_dict(keep, strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise ModelLoadError(f"cannot derive a drafter from {target.model_id}: weights do not line up "
                             f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    meta: dict = {"derived_from": target.model_id, "layers": layers, "version": f"{target.model_id}-{layers}l"}
    if vocab_top is not None:
        meta["kept_ids"] = top_token_ids(target, vocab_top, text_file)
        meta["version"] += f"-v{len(meta['kept_ids'])}"
    out = Path(out_dir)
    # written beside `out`, then moved in: a derivation cut short (a kill, a full disk) never leaves a
    # directory that has a config.json and so reads as a whole drafter to the next start
    tmp = out.parent / f".{out.name}.{os.getpid()}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        drafter.save_pretrained(tmp)
        if target.tokenizer is not None:
            target.tokenizer.save_pretrained(tmp)
        (tmp / DRAFTER_META).write_text(json.dumps(meta))
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        if out.is_dir():  # a directory with other files in it: ours replace their namesakes
            for f in tmp.iterdir():
                os.replace(f, out / f.name)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("derived drafter %s: %d of %d layers -> %s", meta["version"], layers, total, out)
    return out


def top_token_ids(target: LoadedModel, vocab_top: int, text_file: str | os.PathLike | None) -> list[int]:
    """The `vocab_top` most frequent target token ids in `text_file`, plus special tokens."""
    if text_file is None:
        raise ModelLoadError("--vocab-top needs --vocab-text FILE: the corpus whose frequent tokens the head keeps")
    if target.tokenizer is None:
        raise ModelLoadError(f"target {target.model_id} has no tokenizer: cannot count token frequencies")
    if not 1 <= vocab_top <= target.vocab_size:
        raise ModelLoadError(f"--vocab-top must be between 1 and the vocab size {target.vocab_size}, got {vocab_top}")
    path = Path(text_file)
    if not path.is_file():
        raise ModelLoadError(f"vocab text file {path} does not exist")
    counts: Counter[int] = Counter()
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            counts.update(target.tokenizer(line, add_special_tokens=False).input_ids)
    special = set(target.eos_ids) | {i for i in target.tokenizer.all_special_ids if i is not None}
    ids = special | {t for t, _ in counts.most_common(vocab_top)}
    if len(counts) < vocab_top:
        log.warning("vocab text has only %d distinct tokens (< --vocab-top %d)", len(counts), vocab_top)
    return sorted(ids)


def _beyond(key: str, layers: int) -> bool:
    parts = key.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        return i + 1 < len(parts) and parts[i + 1].isdigit() and int(parts[i + 1]) >= layers
    return False
