"""Loading holds the weights about once: each layer's re-laid copy replaces its lazily
loaded source before the next is read, and the largest (the tied embedding) goes first."""

from __future__ import annotations

import mlx.core as mx
import pytest

from app.dev.make_model import make_model
from engine.model.cpu_ext import build

# the tied embedding is ~1/7 of the weights, as in a 1B Llama: re-laid last, after every
# layer is loaded, with its source and tiles alive together, the load peaked at 1.15x;
# largest first, at 1.001x
CONFIG = dict(model_type="llama", hidden_size=512, num_hidden_layers=8, intermediate_size=1536,
              num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=8192,
              tie_word_embeddings=True)


@pytest.mark.skipif(not build.available(), reason="the CPU extension is not built here")
def test_loading_peaks_near_the_weights_once(tmp_path):
    from engine import load_model

    make_model(tmp_path / "m", CONFIG, "q8", seed=3, group_size=64)
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    loaded = load_model(str(tmp_path / "m"))
    assert loaded.cpu_ext
    peak = mx.get_peak_memory() - base
    assert peak <= 1.05 * loaded.weight_bytes, (peak, loaded.weight_bytes)
