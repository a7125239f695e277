"""Shared fixtures: the real default model, tiny random-weight models, isolated cache dirs."""

from __future__ import annotations

import os
import tempfile

# Keep tests off the user's cache; set before engine computes any path.
os.environ.setdefault("KVCHAT_HOME", tempfile.mkdtemp(prefix="kvchat-test-home-"))

import engine  # noqa: E402,F401  (preloads OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def default_model():
    """The embedded SmolLM2-135M, float32 on CPU (the engine's fast path)."""
    from engine import load_model

    return load_model()


@pytest.fixture(scope="session")
def default_engine(default_model):
    from engine import Engine, EngineConfig

    return Engine(default_model, EngineConfig(kv_budget_bytes=256 << 20))


def pytest_collection_modifyitems(config, items):
    if mx.metal.is_available():
        return
    skip = pytest.mark.skip(reason="needs Metal (Apple GPU)")
    for item in items:
        if "metal" in item.keywords:
            item.add_marker(skip)
