"""Float checkpoints quantized at load for the CPU extension's tiled matmul.

On the CPU a float16/bfloat16 GEMV is MLX's slowest path and float32 reads 4 bytes per
weight; `--weights q8|q4` (and `auto` above `FLOAT32_AUTO_MAX_BYTES`) quantize the float
layers at load instead (measured in the README: a 1B Llama decodes 2.6x faster at q8 than
at float32).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from engine.model import backend

QUANTIZE_AT_LOAD = {"q8": 8, "q4": 4}
LOAD_GROUP_SIZE = 32
# Above this many bytes of float32 weights, `auto` quantizes a float checkpoint to q8 on
# the CPU extension rather than running float32 GEMVs (which read 4 bytes per weight).
FLOAT32_AUTO_MAX_BYTES = 1 << 30


def quantize_floats(model: nn.Module, bits: int, group_size: int = LOAD_GROUP_SIZE, *,
                    heads_only: bool = False) -> int:
    """Quantize ``model``'s float Linear/Embedding layers in place (affine, ``bits``,
    ``group_size``) where their input width allows and the model's own ``quant_predicate``
    (mlx-lm's, e.g. keeping MoE routers float) agrees; ``heads_only``: just the embedding
    and output head. Returns how many."""
    count = 0
    own = getattr(model, "quant_predicate", None)

    def predicate(path: str, module: nn.Module) -> bool:
        nonlocal count
        ok = (type(module) in (nn.Linear, nn.Embedding)
              and module.weight.shape[-1] % group_size == 0
              and mx.issubdtype(module.weight.dtype, mx.floating)
              and (not heads_only or path.endswith(("embed_tokens", "lm_head")))
              and (own is None or own(path, module) is not False))
        count += ok
        return ok

    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=predicate)
    return count


def norms_to_float32(model: nn.Module) -> int:
    """Cast the float parameters outside quantized layers (norms, biases) to float32, as a
    converted GGUF has them; scales and biases of quantized layers keep their dtype.
    Returns how many. (An mlx-community checkpoint's bfloat16 norms would make every
    activation bfloat16, which MLX computes slowly on CPU: measured on a 1B Llama 4-bit,
    prefill 48 vs 95 tok/s, decode 13.3 vs 16.9.)"""
    quantized = {name for name, m in model.named_modules() if hasattr(m, "bits")}
    updates = [(k, v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())
               if mx.issubdtype(v.dtype, mx.floating) and v.dtype != mx.float32
               and k.rsplit(".", 1)[0] not in quantized]
    if updates:
        model.load_weights(updates, strict=False)
    return len(updates)


def float_dtype(model: nn.Module) -> str:
    dtypes = {str(v.dtype).removeprefix("mlx.core.") for _, v in tree_flatten(model.parameters())
              if v.ndim == 2 and mx.issubdtype(v.dtype, mx.floating)}
    return "/".join(sorted(dtypes)) or "float"


def quantize_at_load_bits(model: nn.Module, weights: str) -> int:
    """Bits to quantize a float checkpoint to at load on CPU (0: none): ``q8``/``q4`` asked
    for, or ``auto`` for a float model whose float32 copy passes `FLOAT32_AUTO_MAX_BYTES`
    where the extension builds."""
    if backend.backend() != "cpu" or any(hasattr(m, "bits") for _, m in model.named_modules()):
        return 0  # already quantized: the extension's rule below takes any float head
    if weights in QUANTIZE_AT_LOAD:
        return QUANTIZE_AT_LOAD[weights]
    if weights != "auto":
        return 0
    from mlx_lm.utils import get_total_parameters

    if get_total_parameters(model) * 4 <= FLOAT32_AUTO_MAX_BYTES:
        return 0
    from engine.model.cpu_ext import build

    return 8 if build.available() else 0
