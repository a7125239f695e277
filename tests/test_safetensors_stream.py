"""The streaming safetensors writer (a GGUF conversion never holds the whole model) and the
row-chunked block conversion it is fed by."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from safetensors import safe_open

from engine.model import gguf_quants
from engine.model.safetensors_stream import SafetensorsWriter


def test_a_streamed_file_reads_back_in_mlx_and_safetensors(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"a.weight": rng.integers(0, 2**32, (16, 8), dtype=np.uint32),
              "a.scales": rng.normal(size=(16, 3)).astype(np.float16),
              "norm": rng.normal(size=(5,)).astype(np.float32),
              "odd": rng.normal(size=(3,)).astype(np.float16)}  # 6 bytes: padding after
    bf16 = mx.array(rng.normal(size=(4, 4)).astype(np.float32)).astype(mx.bfloat16)
    path = tmp_path / "model.safetensors"
    writer = SafetensorsWriter(path)
    for name, arr in arrays.items():
        writer.add(name, arr)
    writer.add("bf", np.array(bf16.view(mx.uint16)), "BF16")
    writer.close({"format": "mlx"})
    assert not (tmp_path / "model.safetensors.data").exists()
    assert path.stat().st_mode & 0o777 == 0o600
    got, meta = mx.load(str(path), return_metadata=True)
    assert meta == {"format": "mlx"}
    for name, arr in arrays.items():
        assert np.array_equal(np.array(got[name]), arr) and got[name].dtype == mx.array(arr).dtype
    assert got["bf"].dtype == mx.bfloat16 and mx.array_equal(got["bf"], bf16).item()
    with safe_open(str(path), "np") as ref:  # the reference reader agrees
        assert set(ref.keys()) == set(arrays) | {"bf"}
        assert np.array_equal(ref.get_tensor("a.scales"), arrays["a.scales"])


def test_a_failed_conversion_leaves_no_file(tmp_path):
    path = tmp_path / "model.safetensors"
    writer = SafetensorsWriter(path)
    writer.add("x", np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="twice"):
        writer.add("x", np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="dtype"):
        writer.add("y", np.zeros(4, np.complex64))
    writer.abort()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_block_conversion_in_row_chunks_equals_one_pass(kind, monkeypatch):
    rng = np.random.default_rng(1)
    rows, cols = 12, 512
    per, nbytes = gguf_quants.BLOCKS[kind]
    blocks = rng.integers(0, 256, (rows, cols // per * nbytes), dtype=np.uint8)  # any bytes
    whole = gguf_quants.to_affine(kind, blocks, (rows, cols))
    monkeypatch.setattr(gguf_quants, "CHUNK_WEIGHTS", 5 * cols)  # 5, 5 and 2 rows
    chunked = gguf_quants.to_affine(kind, blocks, (rows, cols))
    assert whole[3] == chunked[3]
    for a, b in zip(whole[:3], chunked[:3], strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
