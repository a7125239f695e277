"""engine.distributed: the wire format and ledger in process; then 2 ranks on localhost.

The multi-process checks run `distributed_scenarios.py` as ranks 0 and 1 of a ring
(MLX_RANK / MLX_HOSTFILE, as `mlx.launch` sets them) on a tiny random-weight qwen3 whose
heads divide by 2, so one run covers pipeline and tensor parallel. The default model's
15/15 split, and a hung rank, are in scripts/distributed_check.sh.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import build_tiny_model

from engine.config import EngineConfig
from engine.distributed import handshake
from engine.distributed import plan_wire as wire
from engine.distributed.engine import rank_config
from engine.distributed.group import EXIT_RANK_LOST
from engine.distributed.launch import spawn_local, write_hostfile
from engine.distributed.ledger import BlockLedger, LedgerSender
from engine.distributed.stage import check_tensor_shapes, layer_split
from engine.errors import KVChatError
from engine.kvcache.block_manager import BlockManager
from engine.kvcache.kv_cache import KVLayout
from engine.kvcache.quant import QuantSpec
from engine.model.model_runner import StepBatch
from engine.model.packed_batch import pack

SCENARIOS = Path(__file__).with_name("distributed_scenarios.py")


# -- in process --------------------------------------------------------------------------
def test_step_batch_round_trips():
    b = StepBatch(mx.array([[5, 6], [7, 8]], mx.int32), mx.array([3, 9], mx.int32),
                  mx.array([10, 11, 40, 41], mx.int32), mx.array([[0, 1], [2, 2]], mx.int32),
                  [5, 11], None)
    got, logits = wire.decode_step(wire.encode_step(b, True))
    assert logits and got.context_lens == [5, 11] and got.block_run is None
    for name in ("input_ids", "offsets", "slots", "block_tables"):
        assert getattr(got, name).tolist() == getattr(b, name).tolist()


def test_packed_batch_round_trips():
    b = pack([([1, 2, 3], [16, 17, 18], [1, 2], 19), ([4], [40], [2], 9)],
             [(7, 50, [3, 4, 5], 40), (8, 60, [6], 3)])
    got = wire.decode_packed(wire.encode_packed(b))
    assert got.input_ids.tolist() == b.input_ids.tolist()
    assert got.positions.tolist() == b.positions.tolist()
    assert got.slots.tolist() == b.slots.tolist()
    assert got.decode_tables.tolist() == b.decode_tables.tolist()
    assert (got.decode_start, got.decode_lens) == (b.decode_start, b.decode_lens)
    for s, t in zip(got.prefills, b.prefills, strict=True):
        assert (s.start, s.length, s.context_len, s.block_run) == (
            t.start, t.length, t.context_len, t.block_run)
        assert s.block_table.tolist() == t.block_table.tolist()


def test_header_checks_magic_and_carries_the_tensor_shape():
    msg = wire.Message(wire.Op.STEP, 7, np.arange(5, dtype=np.int32),
                       tensor=mx.zeros((1, 3, 4), mx.float16))
    h = wire.parse_header(msg.header())
    assert (h.op, h.seq, h.payload_len, h.tensor_shape, h.tensor_dtype) == (
        wire.Op.STEP, 7, 5, (1, 3, 4), mx.float16)
    bad = msg.header()
    bad[0] = 0
    with pytest.raises(ValueError, match="out of step"):
        wire.parse_header(bad)


def test_ledger_follows_rank0_allocations_and_releases():
    bm = BlockManager(8, 4)
    sender, ledger = LedgerSender(bm), BlockLedger(8, 4)
    bm.allocate(1, 6)  # two blocks
    ledger.apply(sender.delta())
    assert ledger.counts() == (2, 0, 6)
    ledger.wrote(np.asarray(bm.slots(1, 0, 6)))
    assert ledger.writes_outside == 0
    bm.free(1)
    ledger.apply(sender.delta())
    assert ledger.counts() == (0, 0, 8)
    assert len(sender.delta()) == 0  # nothing changed since
    ledger.wrote(np.asarray([0]))  # a write into a free block is counted, never silent
    assert ledger.writes_outside == 1


def test_layer_split_even_explicit_and_refused():
    assert layer_split(30, 2) == [(0, 15), (15, 30)]
    assert layer_split(5, 2) == [(0, 3), (3, 5)]
    assert layer_split(30, 2, (10, 20)) == [(0, 10), (10, 30)]
    with pytest.raises(KVChatError, match="does not fit 30 layers"):
        layer_split(30, 2, (10, 10))


def test_tensor_parallel_refuses_shapes_that_do_not_divide(default_model):
    with pytest.raises(KVChatError, match=r"KV heads \(3\).*use --parallel pipeline"):
        check_tensor_shapes(default_model.model.args, 2)  # 9 heads, 3 KV heads


def test_rank_config_recomputes_and_sizes_for_the_largest_slice():
    config, notices = rank_config(EngineConfig(disk_cache=True, preempt_mode="swap",
                                               kv_budget_bytes=1000),
                                  part_layers=10, max_layers=20)
    assert (config.disk_cache, config.preempt_mode, config.kv_budget_bytes) == (
        True, "recompute", 500)
    assert len(notices) == 1 and "recomputes" in notices[0]
    config, notices = rank_config(EngineConfig(speculate="lookup"), part_layers=5,
                                  max_layers=5)
    assert config.speculate == "off" and notices == ["distributed: speculative decoding is off"]


def test_handshake_round_trip_and_refusals():
    layout = KVLayout(15, 3, 64, 16, mx.float16, QuantSpec(8, 64), None)
    hello = handshake.Hello("pipeline", 2, 123, layout, True, "fp-abc")
    got, end = handshake.decode_hello(handshake.encode_hello(hello))
    assert (got.mode, got.world, got.num_blocks, got.model_fingerprint) == (
        "pipeline", 2, 123, "fp-abc")
    assert (got.layout.k_quant, got.layout.v_quant, got.layout.dtype) == (
        QuantSpec(8, 64), None, mx.float16)
    assert handshake.check(got, world=2, mode="pipeline", fingerprint="fp-abc",
                           head_dim=64) == ""
    why = handshake.check(got, world=2, mode="pipeline", fingerprint="fp-xyz", head_dim=64)
    assert "another model" in why
    # the residual formats' flags travel too (a rank builds the pool rank 0 runs)
    kivi = KVLayout(15, 3, 64, 16, mx.float16, QuantSpec(4, 64, 1), QuantSpec(4, 64, 1),
                    residual=True, key_channel=True)
    got_kivi, _ = handshake.decode_hello(handshake.encode_hello(
        handshake.Hello("tensor", 2, 9, kivi, True, "fp")))
    assert got_kivi.layout.kv_format == kivi.kv_format and got_kivi.layout.key_channel
    answered = handshake.answer(handshake.encode_hello(hello), 1, why)
    with pytest.raises(KVChatError, match="rank 1: another model"):
        handshake.raise_refusals(answered, end)


@pytest.mark.subprocess
def test_a_rank_that_never_comes_is_a_clear_error_within_the_init_timeout(tmp_path):
    hostfile = write_hostfile(tmp_path / "hosts.json", 2)
    t = time.monotonic()
    p = spawn_local([sys.executable, "-m", "app", "generate", "--distributed", "--prompt", "hi",
                     "--dist-init-timeout", "1"], 1, hostfile, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)[0]  # rank 0 alone: rank 1 never starts
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2
    assert "the other ranks did not connect within 1 s" in err
    assert time.monotonic() - t < 30


# -- two ranks on localhost --------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, default_model):
    from engine.model.cpu_ext import build

    # the CPU extension (decode attention) builds once per session, here, under the test
    # KVCHAT_HOME: not in each rank at once
    build.available()
    return build_tiny_model(tmp_path_factory.mktemp("dist"), default_model, "qwen3")


def spawn(tmp_path, *args):
    hostfile = write_hostfile(tmp_path / "hosts.json", 2)
    return spawn_local([sys.executable, str(SCENARIOS), *args], 2, hostfile,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(procs, timeout: float = 300):
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()


@pytest.mark.subprocess
def test_two_ranks_match_one_process_and_release_together(tiny_dir, tmp_path):
    procs = spawn(tmp_path, "parity", "--model", str(tiny_dir), "--mode", "pipeline,tensor",
                  "--max-tokens", "8")
    (out, err), (_, err1) = finish(procs)
    assert procs[0].returncode == 0 and procs[1].returncode == 0, err + err1
    runs = json.loads(out.strip().splitlines()[-1])
    assert set(runs) == {"pipeline", "tensor"}
    for mode, run in runs.items():
        # greedy tokens identical to one process: one sequence alone, then a batch of three
        assert run["got_one"] == run["want_one"], mode
        assert run["got_batch"] == run["want_batch"], mode
        final = run["final"]
        # each rank's pool holds half of the model's K/V per token (15/15-style halves:
        # one layer each in pipeline, one of two KV heads each in tensor parallel)
        assert [r["bytes_per_token"] * 2 for r in final] == [run["ref_bytes_per_token"]] * 2
        assert final[0]["num_blocks"] == final[1]["num_blocks"]
        cancel = run["cancel"]
        assert cancel["finish"] == "cancelled"
        during, after = cancel["during"], cancel["after"]
        assert during[0]["blocks_used"] > 0
        keys = ("blocks_used", "blocks_cached", "blocks_free", "blocks_touched", "steps")
        for reports in (during, after, final):
            assert [{k: r[k] for k in keys} for r in reports][0] == {
                k: reports[1][k] for k in keys}, (mode, reports)
            assert all(r["writes_outside"] == 0 for r in reports)
        assert [r["blocks_used"] for r in after] == [0, 0]  # freed on both ranks


@pytest.fixture(scope="module")
def tiny_dir32(tiny_dir, tmp_path_factory, default_model):
    """The tiny qwen3 with head dim 32, which 4-bit groups of 32 quantize."""
    from arch_zoo import save_random_model
    from conftest import TINY

    config = dict(TINY["qwen3"], head_dim=32, vocab_size=default_model.config["vocab_size"],
                  eos_token_id=default_model.config["eos_token_id"])
    return save_random_model(tmp_path_factory.mktemp("dist32") / "qwen3", config,
                             default_model.path, seed=32, scale=4)


@pytest.mark.subprocess
def test_two_ranks_on_the_residual_4bit_pool(tiny_dir32, tmp_path):
    """q4-kivi (per-channel 4-bit keys, float filling blocks) across ranks: the hello carries
    the format, every rank builds the residual pool, and the tokens are one process's."""
    procs = spawn(tmp_path, "parity", "--model", str(tiny_dir32), "--mode",
                  "pipeline@q4-kivi,tensor@q4-kivi", "--max-tokens", "8")
    (out, err), (_, err1) = finish(procs)
    assert procs[0].returncode == 0 and procs[1].returncode == 0, err + err1
    runs = json.loads(out.strip().splitlines()[-1])
    assert set(runs) == {"pipeline@q4-kivi", "tensor@q4-kivi"}
    float16_bytes = 2 * 2 * 32 * 2 * 2  # layers x KV heads x head dim x (K, V) x 2 bytes
    for mode, run in runs.items():
        assert run["ref_bytes_per_token"] < float16_bytes / 2, mode  # quantized, 4-bit
        assert run["got_one"] == run["want_one"], mode
        assert run["got_batch"] == run["want_batch"], mode
        final = run["final"]
        assert [r["bytes_per_token"] * 2 for r in final] == [run["ref_bytes_per_token"]] * 2
        assert run["cancel"]["finish"] == "cancelled"
        assert [r["blocks_used"] for r in run["cancel"]["after"]] == [0, 0]
        assert all(r["writes_outside"] == 0 for r in final)
    # the disk prefix store on every rank: a fresh engine restores the residual pool's full
    # blocks from disk and answers the same
    disk = tmp_path / "prefix"
    procs = spawn(tmp_path, "disk", "--model", str(tiny_dir32), "--disk-dir", str(disk),
                  "--max-tokens", "6", "--mode", "tensor@q4-kivi,tensor@q4-kivi")
    (out, err), (_, err1) = finish(procs)
    assert procs[0].returncode == 0 and procs[1].returncode == 0, err + err1
    first, again = json.loads(out.strip().splitlines()[-1])["phases"]
    assert (first["source"], again["source"]) == ("none", "disk") and again["cached"] > 0
    assert first["tokens"] == again["tokens"]


@pytest.mark.subprocess
def test_killed_rank_ends_the_run_with_a_clear_error(tiny_dir, tmp_path):
    timeout = 20
    procs = spawn(tmp_path, "stream", "--model", str(tiny_dir), "--timeout", str(timeout))
    try:
        assert json.loads(procs[0].stdout.readline())["started"]
        procs[1].kill()
        t = time.monotonic()
        _, err = procs[0].communicate(timeout=timeout + 30)
        took = time.monotonic() - t
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == EXIT_RANK_LOST, err
    assert took < timeout
    line = err.strip().splitlines()[-1]
    assert line.startswith("kvchat: error: distributed (rank 0): lost rank 1")
    assert "rank 0 released its KV pool (1 requests ended" in line


@pytest.mark.subprocess
def test_disk_store_per_rank_keyed_by_split(default_model, tmp_path):
    # 3 layers: two 2-rank pipeline splits, 1/2 and 2/1
    model = build_tiny_model(tmp_path, default_model, "llama")
    disk = tmp_path / "prefix"
    procs = spawn(tmp_path, "disk", "--model", str(model), "--disk-dir", str(disk),
                  "--max-tokens", "6", "--forget-rank1-at", "3",
                  "--mode", "pipeline:1/2,pipeline:1/2,pipeline:2/1,pipeline:1/2")
    (out, err), (_, err1) = finish(procs)
    assert procs[0].returncode == 0 and procs[1].returncode == 0, err + err1
    first, again, other, forgotten = json.loads(out.strip().splitlines()[-1])["phases"]
    assert first["source"] == "none"
    # a fresh engine on the same split: every rank restores its part of the prefix from disk
    assert again["source"] == "disk" and again["cached"] == 48
    # another split: each rank's entries name its layers, so nothing is served
    assert other["source"] == "none"
    # rank 0 still has its entries, rank 1 lost its own: a miss on every rank
    assert forgotten["source"] == "none"
    assert first["tokens"] == again["tokens"] == other["tokens"] == forgotten["tokens"]
    assert disk.is_dir() and (tmp_path / "prefix-rank1").is_dir()
