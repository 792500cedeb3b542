"""Shared fixtures. Topic-specific fixtures live in their own tests/conftest_*.py modules, imported here."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def stories(tmp_path_factory):
    """The real stories260K target (skips when ../shared is absent)."""
    from tests.models import load_stories

    return load_stories(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def stories_drafter_dir(stories, tmp_path_factory):
    """A 2-layer drafter derived from stories260K."""
    from runtime.derive import derive_drafter

    return derive_drafter(stories, 2, tmp_path_factory.mktemp("drafter") / "d2")
