"""KV pool storage: byte accounting, slot writes, copy-on-write block copies."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine.kvcache.kv_cache import KVLayout, PagedKVCache


def test_bytes_per_token_is_the_design_formula():
    # DESIGN.md: SmolLM2-135M at fp16 = 30 x 2 x 3 x 64 x 2 B = 23,040 B per token
    assert KVLayout(30, 3, 64, 16, mx.float16).bytes_per_token == 23_040
    assert KVLayout(30, 3, 64, 16, mx.float32).bytes_per_token == 46_080
    layout = KVLayout(2, 4, 8, 16, mx.bfloat16)
    assert layout.bytes_per_block == 2 * 2 * 4 * 8 * 2 * 16
    assert layout.num_blocks_for(layout.bytes_per_block * 5 + 1) == 5


def test_pool_size_matches_accounting():
    layout = KVLayout(3, 2, 8, 4, mx.float16)
    kv = PagedKVCache(layout, num_blocks=6)
    actual = sum(a.nbytes for a in kv.keys + kv.values)
    assert actual == kv.nbytes == 6 * layout.bytes_per_block


def test_write_then_copy_blocks():
    layout = KVLayout(2, 2, 4, 4, mx.float32)
    kv = PagedKVCache(layout, num_blocks=4)
    rows = mx.arange(2 * 3 * 4, dtype=mx.float32).reshape(2, 3, 4)
    slots = mx.array([5, 6, 7])  # block 1, offsets 1..3
    kv.write(1, slots, rows, -rows)
    k, v = kv.block_view(1)
    np.testing.assert_array_equal(np.array(k[:, 1, 1:]), np.array(rows))
    np.testing.assert_array_equal(np.array(v[:, 1, 1:]), -np.array(rows))
    assert float(mx.abs(kv.keys[0]).sum()) == 0  # other layers untouched
    kv.copy_blocks([(1, 3)])
    k, v = kv.block_view(1)
    np.testing.assert_array_equal(np.array(k[:, 3]), np.array(k[:, 1]))
    np.testing.assert_array_equal(np.array(v[:, 3]), np.array(v[:, 1]))
