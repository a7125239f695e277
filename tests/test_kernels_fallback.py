"""The kernel switch and the runtime fallback, without a GPU.

The test hook: `backend.kernel_backend` is made to answer "metal", so decode
dispatches to the kernel, and `one_pass._paged_decode_kernel` hands out a
kernel callable that raises (or returns garbage). On this machine the real
Metal kernel also raises when called ("No Metal back-end"): a genuine launch
failure. Either way generation must finish on the reference, say so once
(a RuntimeWarning and a log line) and show the reason in the engine metrics.
"""

from __future__ import annotations

import logging
import warnings

import mlx.core as mx
import pytest
from kernel_harness.cases import Case, make_inputs

from engine import Engine, EngineConfig, SamplingParams
from engine.generation import collect
from engine.model import backend
from engine.model.attention import guard, paged_attention, reference
from engine.model.attention.gpu import abi, one_pass

CASE = Case("float16", 64, 16, 4, 2, (9, 17))
QCASE = Case("float16", 64, 16, 4, 2, (9, 17), k_quant=(8, 32), v_quant=(4, 32))


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    """No fallback before or after a test (the state is process-wide), kernels switched on."""
    monkeypatch.delenv(backend.KERNELS_SWITCH, raising=False)
    guard.GUARD.reset()
    yield
    guard.GUARD.reset()


@pytest.fixture
def fake_metal(monkeypatch):
    """Decode dispatches to the kernel; returns the list of kernel launches it sees."""
    launches = []
    monkeypatch.setattr(backend, "kernel_backend", lambda: "metal")

    def install(behaviour):
        def kernel(**launch):
            launches.append(launch)
            return behaviour(launch)

        monkeypatch.setattr(one_pass, "_paged_decode_kernel", lambda name: kernel)

    return launches, install


def _raise(launch):
    raise RuntimeError("Unable to build metal library from source (forced by the test)")


def _reference_like(inputs):
    ref = reference.paged_attention_ref(**inputs)
    return lambda launch: [ref]


def _no_warnings(action):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = action()
    assert not [w for w in seen if "kernels off" in str(w.message)]
    return result


def test_launch_failure_falls_back_once(fake_metal, caplog):
    launches, install = fake_metal
    install(_raise)
    inputs = make_inputs(CASE)
    expected = reference.paged_attention_ref(**inputs)
    with caplog.at_level(logging.INFO, logger="kvchat.attention"),\
            pytest.warns(RuntimeWarning, match="attention kernels off .*forced by the test"):
        out = paged_attention(**inputs)
    assert mx.array_equal(out, expected)
    assert len(launches) == 1
    assert "forced by the test" in guard.kernel_fallback()
    assert sum("kernels off" in r.message for r in caplog.records) == 1
    # For the rest of the process: no second launch, no second warning.
    out = _no_warnings(lambda: paged_attention(**inputs))
    assert mx.array_equal(out, expected) and len(launches) == 1
    assert guard.GUARD.switch.tripped


def test_real_metal_kernel_without_metal_falls_back(monkeypatch):
    """No fake kernel: MLX's own metal_kernel raises at launch on this machine."""
    if mx.metal.is_available():
        pytest.skip("Metal present: the kernel launches for real")
    monkeypatch.setattr(backend, "kernel_backend", lambda: "metal")
    inputs = make_inputs(QCASE)
    with pytest.warns(RuntimeWarning, match="No Metal back-end"):
        out = paged_attention(**inputs)
    assert mx.array_equal(out, reference.paged_attention_ref(**inputs))


def test_wrong_first_launch_falls_back(fake_metal):
    launches, install = fake_metal
    install(lambda launch: [mx.full(launch["output_shapes"][0], float("nan"), mx.float16)])
    inputs = make_inputs(CASE)
    with pytest.warns(RuntimeWarning, match="differs from the reference"):
        out = paged_attention(**inputs)
    assert mx.array_equal(out, reference.paged_attention_ref(**inputs))
    assert "KernelMismatch" in guard.kernel_fallback()


def test_good_first_launch_is_checked_once_per_variant(fake_metal, monkeypatch):
    launches, install = fake_metal
    inputs = make_inputs(CASE)
    install(_reference_like(inputs))
    checks = []
    real_ref = reference.paged_attention_ref
    monkeypatch.setattr(reference, "paged_attention_ref", lambda *a, **k: checks.append(1) or
                        real_ref(*a, **k))
    for _ in range(3):
        _no_warnings(lambda: paged_attention(**inputs))
    assert len(launches) == 3 and len(checks) == 1  # one reference, for the first launch
    assert guard.kernel_fallback() is None
    # Another variant (bf16 queries: another compiled kernel) is checked again.
    other = dict(inputs, queries=inputs["queries"].astype(mx.bfloat16))
    other_ref = real_ref(**other)
    install(lambda launch: [other_ref])
    _no_warnings(lambda: paged_attention(**other))
    assert len(checks) == 2


def test_variant_key_tracks_what_changes_the_compiled_source():
    inputs = make_inputs(CASE)
    args = (inputs["queries"], inputs["k_pool"], inputs["v_pool"], inputs["block_tables"])
    key = abi.variant_key(*args, "one_pass")
    assert key == abi.variant_key(*args, "one_pass")
    q9 = mx.zeros((9, *inputs["queries"].shape[1:]), dtype=mx.float16)
    t9 = mx.zeros((9, inputs["block_tables"].shape[1]), dtype=mx.int32)
    assert abi.variant_key(q9, *args[1:3], t9, "one_pass") != key  # lengths move to device memory
    quant = make_inputs(QCASE)
    assert abi.variant_key(quant["queries"], quant["k_pool"], quant["v_pool"],
                               quant["block_tables"], "one_pass") != key


@pytest.mark.parametrize("value", ["0", "false", "OFF", "no"])
def test_environment_switch_turns_kernels_off(value, fake_metal, monkeypatch):
    launches, install = fake_metal
    install(_raise)
    monkeypatch.setenv(backend.KERNELS_SWITCH, value)
    assert not backend.kernels_enabled()
    inputs = make_inputs(CASE)
    out = _no_warnings(lambda: paged_attention(**inputs))
    assert mx.array_equal(out, reference.paged_attention_ref(**inputs))
    assert launches == [] and guard.kernel_fallback() is None


def test_use_kernels_false_keeps_the_reference(fake_metal):
    launches, install = fake_metal
    install(_raise)
    inputs = make_inputs(CASE)
    _no_warnings(lambda: paged_attention(**inputs, use_kernels=False))
    assert launches == []
    assert backend.kernels_enabled() and not guard.GUARD.switch.tripped


def test_engine_config_field_reaches_the_runner(default_model):
    assert EngineConfig().kernels is True
    engine = Engine(default_model, EngineConfig(kv_budget_bytes=16 << 20, kernels=False))
    assert engine.runner.use_kernels is False
    assert Engine(default_model, EngineConfig(kv_budget_bytes=16 << 20)).runner.use_kernels


def _two_requests(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Both requests in flight at once, so decode steps run a batch of two."""
    handles = [engine.submit(ids, SamplingParams(max_tokens=8)) for ids in prompts]
    return [collect(h).tokens for h in handles]


def test_generation_completes_with_the_kernel_forced_to_fail(default_model, fake_metal):
    launches, install = fake_metal
    install(_raise)
    tok = default_model.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode("One, two, three,")]
    config = EngineConfig(kv_budget_bytes=16 << 20, prefix_cache=False)
    baseline = _two_requests(Engine(default_model, EngineConfig(
        kv_budget_bytes=16 << 20, prefix_cache=False, kernels=False)), prompts)
    assert launches == [] and guard.kernel_fallback() is None
    engine = Engine(default_model, config)
    with pytest.warns(RuntimeWarning, match="attention kernels off"):
        tokens = _two_requests(engine, prompts)
    assert tokens == baseline and all(len(t) == 8 for t in tokens)
    assert len(launches) == 1  # the first decode launch failed; no kernel after it
    assert "forced by the test" in engine.metrics().kernel_fallback
    assert engine.metrics().to_dict()["kernel_fallback"] == guard.kernel_fallback()
