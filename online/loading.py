"""Loading models the way every command does: targets on the config's [models] device and dtype
(overridden by `--device` / `--dtype`), drafters from a directory or an MLflow model URI."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from online.config import Config
from runtime.drafter_kinds import KINDS

if TYPE_CHECKING:
    from runtime.loader import LoadedModel


DRAFTER_KINDS = tuple(KINDS)  # runtime/drafter_kinds.py: importing it loads no model code
DRAFTER_KINDS_HELP = " | ".join(DRAFTER_KINDS)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", help="cpu, cuda, cuda:N or auto (default: [models] device, auto)")
    p.add_argument("--dtype", help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16 "
                                   "(default: [models] dtype)")


def load_target(spec: str, cfg: Config, args: argparse.Namespace | None = None) -> LoadedModel:
    """Loads `spec` on the configured device and dtype (command-line flags win). Raises ModelLoadError."""
    from runtime.loader import load_model, resolve_device, resolve_dtype

    device = resolve_device(getattr(args, "device", None) or cfg.models.device)
    dtype = resolve_dtype(getattr(args, "dtype", None) or cfg.models.dtype, device)
    return load_model(spec, cache_dir=cfg.models.cache_dir, dtype=dtype, device=device)


def resolve_drafter(spec: str | None, cfg: Config) -> str | None:
    """`--drafter` as a local directory: an MLflow model URI (models:/<name>@<alias>,
    models:/<name>/<version>) is downloaded from the configured registry (cached); anything else
    is returned as given. Raises RegistryError for an unknown model, alias or version."""
    if spec is None or not spec.startswith("models:/"):
        return spec
    from online.registry import DrafterRegistry

    return str(DrafterRegistry.from_config(cfg).local(spec).path)
