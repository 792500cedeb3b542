"""Drafters: anything that proposes tokens for the target to verify."""

from runtime.drafters.base import Draft, Drafter
from runtime.drafters.factory import DrafterConfig, build_drafter

__all__ = ["Draft", "Drafter", "DrafterConfig", "build_drafter"]
