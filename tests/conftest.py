"""Shared fixtures: the real default model, tiny random-weight models, isolated cache dirs."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

# Keep tests off the user's cache; set before engine computes any path.
os.environ.setdefault("KVCHAT_HOME", tempfile.mkdtemp(prefix="kvchat-test-home-"))
# A model's first load builds the GEMV shim for the processes after it (`import engine`
# compiles nothing): build it in a child first, so this session runs as a second run does.
subprocess.run([sys.executable, "-c", "from engine.model import blas; blas.prepare_cache()"],
               check=False, timeout=300)

import engine  # noqa: E402,F401  (preloads OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def default_model():
    """The embedded SmolLM2-135M with float32 weights: the path whose greedy tokens equal
    mlx-lm's exactly (the parity tests). The CPU default (`load_model()`) keeps the Q4/Q8
    weights on kvchat's CPU extension when it builds: see `default_model_ext`."""
    from engine import load_model

    return load_model(weights="float32")


@pytest.fixture(scope="session")
def default_model_ext():
    """The embedded model as `load_model()` gives it on CPU: Q4/Q8 weights on the C++
    extension (built once per session under the test KVCHAT_HOME); skipped without it."""
    from engine import load_model
    from engine.model.cpu_ext import build

    if not build.available():
        pytest.skip(f"CPU extension unavailable: {build.unavailable_reason()}")
    loaded = load_model()
    assert loaded.cpu_ext
    return loaded


@pytest.fixture(scope="session")
def quick_model(request):
    """The quickest real default model here, for tests about something other than the
    weights' path: `default_model_ext` where the extension builds, else `default_model`."""
    from engine.model.cpu_ext import build

    return request.getfixturevalue("default_model_ext" if build.available() else "default_model")


def home_sharing_builds(home) -> str:
    """A fresh KVCHAT_HOME at ``home`` that links this session's CPU-extension build and
    converted default model: a new process there neither rebuilds (~30 s) nor converts."""
    from pathlib import Path

    home, shared = Path(home), Path(os.environ["KVCHAT_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    for name in ("cpu_ext", "models"):
        (shared / name).mkdir(mode=0o700, parents=True, exist_ok=True)
        (home / name).symlink_to(shared / name)
    return str(home)


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


# -- tiny random-weight models of other architectures ------------------------------

TINY = {
    "qwen3": dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                  rope_theta=1e6, max_position_embeddings=2048, tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                  num_attention_heads=4, num_key_value_heads=1, rms_norm_eps=1e-6,
                  rope_theta=1e6, max_position_embeddings=2048, tie_word_embeddings=False),
    "llama": dict(model_type="llama", hidden_size=48, num_hidden_layers=3, intermediate_size=64,
                  num_attention_heads=6, num_key_value_heads=3, rms_norm_eps=1e-5,
                  rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=False,
                  rope_traditional=False),
}


def build_tiny_model(tmp_path, default_model, kind: str):
    """Random weights for a real mlx-lm architecture, saved as a model directory."""
    from arch_zoo import save_random_model

    config = dict(TINY[kind], vocab_size=default_model.config["vocab_size"],
                  eos_token_id=default_model.config["eos_token_id"])
    return save_random_model(tmp_path / kind, config, default_model.path, seed=len(kind),
                             scale=4)


@pytest.fixture
def tiny_model_dir(tmp_path, default_model):
    """Factory: a tiny random-weight model directory of the given architecture."""
    return lambda kind: build_tiny_model(tmp_path, default_model, kind)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, default_model):
    """A loaded tiny qwen3 (2 layers, 64 wide): fast steps for scheduler stress tests."""
    from engine import load_model

    return load_model(str(build_tiny_model(tmp_path_factory.mktemp("tiny"), default_model,
                                           "qwen3")))


@pytest.fixture
def session_models(request, monkeypatch):
    """`engine.load_model` of the default model gives this session's loaded one (float32:
    `default_model`; auto: `default_model_ext` where the extension builds), so an in-process
    CLI run (`app.cli.main([...])`) skips the load; any other model loads as usual."""
    from engine.model.cpu_ext import build

    real, loading = engine.load_model, []

    def load(spec=None, *, weights="auto", **kwargs):
        name = {"float32": "default_model",
                "auto": "default_model_ext" if build.available() else None}.get(weights)
        if spec in (None, "default") and not kwargs and name and not loading:
            loading.append(name)  # the fixture's own load_model() is the real one
            try:
                return request.getfixturevalue(name)
            finally:
                loading.pop()
        return real(spec, weights=weights, **kwargs)

    monkeypatch.setattr(engine, "load_model", load)


@pytest.fixture
def kvchat_cli(session_models, capfd, monkeypatch):
    """`kvchat ARGS` in this process (`app.cli.main`, models from `session_models`):
    ``run(*args, stdin="")`` returns (exit status, stdout, stderr). stderr holds the file
    descriptor's output and, as a real process would print them there, the warnings shown
    under Python's default filters and log records of WARNING and above."""
    import io
    import logging
    import warnings

    from app.cli import main

    def run(*args: str, stdin: str = "") -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        capfd.readouterr()
        logs = io.StringIO()
        handler = logging.StreamHandler(logs)
        handler.setLevel(logging.WARNING)
        logging.getLogger().addHandler(handler)
        try:
            with warnings.catch_warnings(record=True) as shown:
                warnings.simplefilter("default")
                for quiet in (DeprecationWarning, PendingDeprecationWarning, ImportWarning,
                              ResourceWarning):
                    warnings.simplefilter("ignore", quiet)
                code = main(list(args))
        finally:
            logging.getLogger().removeHandler(handler)
        out, err = capfd.readouterr()
        err += "".join(f"{w.category.__name__}: {w.message}\n" for w in shown) + logs.getvalue()
        return code, out, err

    return run
