"""One factory: DrafterConfig -> Drafter, by the kind's registration (runtime/drafter_kinds.py),
whose `builder` names one of the functions below."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.drafter_kinds import DrafterKind, kind_of
from runtime.drafters.base import Drafter
from runtime.drafters.crossvocab import CrossVocabDrafter
from runtime.drafters.eagle import (
    EagleHead,
    FeatureDrafter,
    check_head_matches_target,
    is_eagle_dir,
)
from runtime.drafters.hybrid import HybridDrafter
from runtime.drafters.lookup import PromptLookupDrafter
from runtime.drafters.model import ModelDrafter
from runtime.drafters.ngram import NGramTable
from runtime.drafters.none import NoDrafter
from runtime.drafters.suffix import NGramDrafter, SuffixDrafter
from runtime.drafters.suffix_tree import SuffixCache
from runtime.drafters.vocab_bridge import VocabBridge
from runtime.errors import ModelLoadError
from runtime.loader import LoadedModel, load_model, read_drafter_meta


@dataclass
class DrafterConfig:
    kind: str = "model"  # a key of KINDS
    path: str | None = None  # model drafters: directory, GGUF file or packaged name
    version: str | None = None  # recorded in traces; defaults to the kind or directory name
    max_ngram: int = 3  # lookup
    min_ngram: int = 1  # lookup
    # suffix / hybrid: the shared global SuffixCache (online.cache keeps it in step with the
    # traffic log); ngram: the shared NGramTable; crossvocab: the shared VocabBridge (None: the
    # drafter translates by text only). None builds an empty one of defaults (suffix, ngram).
    cache: Any = None
    hybrid_threshold: float = 1.0  # hybrid: use the suffix draft when its score (expected accepted tokens) >= this


def _model(cfg: DrafterConfig, target: LoadedModel | None, cache_dir: str | os.PathLike | None) -> Drafter:
    if not cfg.path:
        raise ModelLoadError("a model drafter needs a path: --drafter DIR (derive one with `livedraft drafter init`)")
    return load_model_drafter(cfg.path, target, cache_dir=cache_dir, version=cfg.version)


def _eagle(cfg: DrafterConfig, target: LoadedModel | None, cache_dir: str | os.PathLike | None) -> Drafter:
    if not cfg.path:
        raise ModelLoadError("an eagle drafter needs a path: --drafter DIR (a speculators Eagle3 directory; "
                             "make one with `livedraft drafter init --kind eagle --from-target T`)")
    return load_feature_drafter(cfg.path, target, version=cfg.version)


def _crossvocab(cfg: DrafterConfig, target: LoadedModel | None, cache_dir: str | os.PathLike | None) -> Drafter:
    if not cfg.path:
        raise ModelLoadError("a crossvocab drafter needs a path: --drafter DIR (a small causal LM with its own "
                             "tokenizer, any vocabulary)")
    if target is None or target.tokenizer is None:
        raise ModelLoadError("a crossvocab drafter translates into the target's tokens: give a target with a "
                             "tokenizer (--target)")
    d = load_model(cfg.path, cache_dir=cache_dir, dtype=target.model.dtype, device=str(target.model.device))
    if d.tokenizer is None:
        raise ModelLoadError(f"crossvocab drafter {d.path} has no tokenizer: it drafts text in its own vocabulary")
    bridge = _shared(cfg, VocabBridge) if cfg.cache is not None else None
    meta = read_drafter_meta(d.path)
    return CrossVocabDrafter(d.model, d.tokenizer, target.tokenizer, bridge=bridge,
                             version=cfg.version or meta.get("version") or d.model_id)


def _lookup(cfg: DrafterConfig, target: LoadedModel | None, cache_dir: str | os.PathLike | None) -> Drafter:
    return PromptLookupDrafter(cfg.max_ngram, cfg.min_ngram, version=cfg.version or "lookup")


def _none(cfg: DrafterConfig, target: LoadedModel | None, cache_dir: str | os.PathLike | None) -> Drafter:
    return NoDrafter()


def _suffix(cfg: DrafterConfig, target: LoadedModel | None, cache_dir: str | os.PathLike | None) -> Drafter:
    return SuffixDrafter(_shared(cfg, SuffixCache), version=cfg.version or "suffix")


def _ngram(cfg: DrafterConfig, target: LoadedModel | None, cache_dir: str | os.PathLike | None) -> Drafter:
    return NGramDrafter(_shared(cfg, NGramTable), version=cfg.version or "ngram")


def _hybrid(cfg: DrafterConfig, target: LoadedModel | None, cache_dir: str | os.PathLike | None) -> Drafter:
    if not cfg.path:
        raise ModelLoadError("a hybrid drafter needs a learned drafter: --drafter DIR (a model or eagle drafter "
                             "directory; `livedraft drafter init`), or use --drafter-kind suffix")
    model = load_drafter(cfg.path, target, cache_dir=cache_dir, version=cfg.version)
    return HybridDrafter(SuffixDrafter(_shared(cfg, SuffixCache)), model, cfg.hybrid_threshold)


def _shared(cfg: DrafterConfig, cls: type) -> Any:
    if cfg.cache is None:
        return cls()
    if not isinstance(cfg.cache, cls):
        raise ModelLoadError(f"drafter kind {cfg.kind!r} needs a {cls.__name__} cache, got {type(cfg.cache).__name__}")
    return cfg.cache


def build_drafter(
    cfg: DrafterConfig, target: LoadedModel | None, cache_dir: str | os.PathLike | None = None
) -> Drafter:
    """`target` None (replay without a target) skips the vocabulary check."""
    return kind_of(cfg.kind).build(cfg, target, cache_dir)


def load_feature_drafter(path: str | os.PathLike, target: LoadedModel | None, *,
                         version: str | None = None) -> FeatureDrafter:
    """Loads an Eagle3 head (speculators layout) over `target`'s embedding."""
    if target is None:
        raise ModelLoadError(f"the eagle drafter {path} reads the target's hidden states and embedding: "
                             "give the target (--target)")
    p = Path(path)
    if not is_eagle_dir(p):
        raise ModelLoadError(f"{p} is not an Eagle3 drafter directory (no config.json with "
                             "speculators_model_type 'eagle3'); make one with `livedraft drafter init --kind eagle`")
    head = EagleHead.load(p, dtype=target.model.dtype, device=target.model.device)
    check_head_matches_target(head.config, target.model.config, str(p))
    meta = read_drafter_meta(p)
    embed = target.model.get_input_embeddings().weight
    return FeatureDrafter(head, embed, target.vocab_size, version=version or meta.get("version") or p.name)


def drafter_kind(path: str | os.PathLike) -> str:
    """"eagle" for an Eagle3 directory; the kind its livedraft_drafter.json names ("crossvocab"); else "model"."""
    if is_eagle_dir(path):
        return "eagle"
    return str(read_drafter_meta(Path(path)).get("kind") or "model")


def kind_of_dir(path: str | os.PathLike) -> DrafterKind:
    """The registration of the learned drafter directory at `path` (ModelLoadError if its kind is not learned)."""
    kind = kind_of(drafter_kind(path))
    if not kind.learned:
        raise ModelLoadError(f"{path} names drafter kind {kind.name!r}, which has no directory of weights")
    return kind


def load_drafter(path: str | os.PathLike, target: LoadedModel | None, *, cache_dir: str | os.PathLike | None = None,
                 version: str | None = None, bridge: VocabBridge | None = None) -> Drafter:
    """A learned drafter directory of any kind (registry versions, candidates); `bridge`: the shared
    n-gram cache a crossvocab drafter translates through."""
    kind = kind_of_dir(path)
    cache = bridge if kind.cache == "bridge" else None
    cfg = DrafterConfig(kind=kind.name, path=str(path), version=version, cache=cache)
    return kind.build(cfg, target, cache_dir)


def load_model_drafter(
    spec: str | os.PathLike,
    target: LoadedModel | None,
    *,
    cache_dir: str | os.PathLike | None = None,
    version: str | None = None,
) -> ModelDrafter:
    """Loads a drafter model and checks it speaks the target's vocabulary."""
    if target is None:
        d = load_model(spec, cache_dir=cache_dir)
    else:
        d = load_model(spec, cache_dir=cache_dir, dtype=target.model.dtype, device=str(target.model.device))
        check_same_vocab(d, target)
    meta = read_drafter_meta(d.path)
    vocab = target.vocab_size if target is not None else d.vocab_size
    return ModelDrafter(d.model, vocab, kept_ids=meta.get("kept_ids"),
                        version=version or meta.get("version") or d.model_id)


def check_same_vocab(drafter: LoadedModel, target: LoadedModel) -> None:
    rows = drafter.model.get_input_embeddings().num_embeddings
    same = rows >= target.vocab_size
    if same and drafter.tokenizer is not None and target.tokenizer is not None:
        same = drafter.tokenizer.get_vocab() == target.tokenizer.get_vocab()
    if not same:
        raise ModelLoadError(
            f"drafter vocab {drafter.vocab_size} ({drafter.path}) does not match target vocab {target.vocab_size} "
            f"({target.path}): a model drafter must share the target's tokenizer; derive one with "
            "`livedraft drafter init --from-target`, or use a model-free drafter (--drafter-kind lookup)"
        )
