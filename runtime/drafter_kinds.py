"""One registration per drafter kind: what the rest of livedraft asks of it — how it is built,
whether it is learned (a directory of weights that trainer rounds improve, and by which
trainer), whether drafting costs a forward pass, whether it reads the target's hidden states,
and which shared cache it drafts from. Callers ask the registration (`kind_of`, `KINDS`)
instead of comparing kind names; adding a kind is one builder in runtime/drafters/factory.py
and one entry here (and, where it is learned, its trainer in online/trainer/round.py).

Importing this module loads no model code (a command's --help lists the kinds from it)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.errors import ModelLoadError

if TYPE_CHECKING:
    from runtime.drafters.base import Drafter
    from runtime.drafters.factory import DrafterConfig
    from runtime.loader import LoadedModel


@dataclass(frozen=True)
class DrafterKind:
    name: str
    builder: str  # the function of runtime/drafters/factory.py that builds it from a DrafterConfig
    forward: bool  # drafting runs a model forward (False: model-free, its draft costs ~nothing)
    trainer: str | None = None  # the trainer that learns it from traffic; None: it is not learned
    features: bool = False  # reads the target's hidden states (replay and rounds need a target pass)
    # the shared structure it drafts from: "suffix" / "ngram" (the traffic cache online/cache
    # maintains) or "bridge" (the vocabulary bridge); None: its own state only
    cache: str | None = None
    llama_server: bool = False  # llama-server can serve it (`serve --engine llama-server`): a head as GGUF, or none

    @property
    def learned(self) -> bool:
        """Served from a directory of weights (a registry version, a trainer's candidate)."""
        return self.trainer is not None

    def build(self, cfg: DrafterConfig, target: LoadedModel | None,
              cache_dir: str | os.PathLike | None = None) -> Drafter:
        from runtime.drafters import factory

        return getattr(factory, self.builder)(cfg, target, cache_dir)


KINDS: dict[str, DrafterKind] = {k.name: k for k in (
    DrafterKind("eagle", "_eagle", forward=True, trainer="eagle", features=True, llama_server=True),
    DrafterKind("model", "_model", forward=True, trainer="distill"),
    DrafterKind("crossvocab", "_crossvocab", forward=True, trainer="crossvocab", cache="bridge"),
    DrafterKind("hybrid", "_hybrid", forward=True, cache="suffix"),
    DrafterKind("suffix", "_suffix", forward=False, cache="suffix"),
    DrafterKind("ngram", "_ngram", forward=False, cache="ngram"),
    DrafterKind("lookup", "_lookup", forward=False),
    DrafterKind("none", "_none", forward=False, llama_server=True),
)}
MODEL_FREE = tuple(name for name, k in KINDS.items() if not k.forward)  # drafting costs no forward pass


def kind_of(name: str) -> DrafterKind:
    """The registration of kind `name`; ModelLoadError naming the kinds for an unknown one."""
    try:
        return KINDS[name]
    except KeyError:
        raise ModelLoadError(f"unknown drafter kind {name!r}: choose one of {sorted(KINDS)}") from None
