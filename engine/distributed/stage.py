"""One rank's part of the model: a slice of layers (pipeline) or a share of heads (tensor).

`prepare_rank` cuts a loaded model down to what this rank computes, in place, and names the
result in its fingerprint, so the prefix-cache salt (and every disk entry keyed by it)
differs per rank and per split: a restart with another split never serves K/V computed for
other layers or heads. `StageModel` runs the rank's part of a forward with `PagedModel`'s
own pieces (embedding, layers, attention over the pool, norm and logits), so the
computation per layer is the single-process one, bit for bit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import mlx.core as mx
from mlx.nn.layers.distributed import shard_inplace, shard_linear
from mlx.utils import tree_flatten

from engine.distributed.config import ParallelConfig
from engine.errors import KVChatError
from engine.kvcache.kv_cache import PagedKVCache
from engine.model import architectures
from engine.model.fingerprint import combine
from engine.model.loader import LoadedModel
from engine.model.model_runner import Interrupt, PagedModel, StepBatch
from engine.model.packed_batch import PackedBatch


@dataclass(frozen=True, slots=True)
class RankPart:
    """What one rank holds: its layers [layer_start, layer_stop) and which ends it runs."""

    mode: str
    rank: int
    world: int
    layer_start: int
    layer_stop: int
    num_layers: int  # the whole model's

    @property
    def embeds(self) -> bool:
        """Runs the token embedding (tensor parallel: every rank does)."""
        return self.mode == "tensor" or self.layer_start == 0

    @property
    def heads(self) -> bool:
        """Computes the logits: the last pipeline stage, or rank 0 under tensor parallel."""
        if self.mode == "tensor":
            return self.rank == 0
        return self.layer_stop == self.num_layers

    def describe(self) -> str:
        if self.mode == "tensor":
            return f"tensor rank {self.rank} of {self.world}, all {self.num_layers} layers"
        return (f"pipeline rank {self.rank} of {self.world}, layers "
                f"{self.layer_start}-{self.layer_stop - 1} of {self.num_layers}")


def layer_split(num_layers: int, world: int, split: tuple[int, ...] | None = None,
                ) -> list[tuple[int, int]]:
    """[start, stop) of each rank's layers: ``split`` or an even split (first ranks +1)."""
    if split is None:
        base, extra = divmod(num_layers, world)
        split = tuple(base + (1 if r < extra else 0) for r in range(world))
    if len(split) != world or sum(split) != num_layers or min(split) < 1:
        raise KVChatError(f"a layer split of {list(split)} does not fit {num_layers} layers "
                          f"over {world} ranks (one count per rank, each >= 1, summing to "
                          f"{num_layers})")
    bounds, start = [], 0
    for n in split:
        bounds.append((start, start + n))
        start += n
    return bounds


def check_tensor_shapes(args, world: int) -> None:
    """Tensor parallel needs heads, KV heads and the MLP width to divide by ``world``.

    Raises:
        KVChatError: naming every count that does not divide.
    """
    counts = {"attention heads": args.num_attention_heads,
              "KV heads": getattr(args, "num_key_value_heads", None)
              or args.num_attention_heads,
              "MLP width": args.intermediate_size}
    bad = [f"{name} ({n})" for name, n in counts.items() if n % world]
    if bad:
        raise KVChatError(f"tensor parallel over {world} ranks needs the attention heads, KV "
                          f"heads and MLP width to divide by {world}; this model's "
                          f"{', '.join(bad)} do not: use --parallel pipeline")


def _shard_tensor(model, group: mx.distributed.Group) -> None:
    """Column-shard q/k/v and gate/up (kept as plain linears, so projections still fuse),
    row-shard o and down with an all-sum after them (mlx-lm's own `shard` scheme)."""
    from engine.model.cpu_ext.linear import CpuTiledLinear

    N = group.size()
    if any(isinstance(m, CpuTiledLinear) for _, m in model.named_modules()):
        raise KVChatError("tensor parallel needs the weights in MLX's layout: load the model "
                          "with tiled=False")
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            shard_inplace(proj, "all-to-sharded", group=group)
        attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)
        attn.n_heads //= N
        attn.n_kv_heads //= N


def prepare_rank(loaded: LoadedModel, group: mx.distributed.Group,
                 parallel: ParallelConfig) -> tuple[LoadedModel, RankPart]:
    """Cut ``loaded`` down to this rank's part, in place; returns it renamed, and the part.

    Each rank loads the whole checkpoint and drops what it does not run, so peak memory
    at load is the whole model's; afterwards it holds only its part.
    """
    rank, world = group.rank(), group.size()
    model = loaded.model
    if architectures.check_supported(loaded.config).path != "fused" or any(
            architectures.layer_windows(model)):
        raise KVChatError(f"multi-rank serving runs llama-family models without sliding "
                          f"windows; {loaded.model_type!r} runs on one rank")
    n = len(model.model.layers)
    if parallel.mode == "tensor":
        check_tensor_shapes(model.args, world)
        _shard_tensor(model, group)
        part = RankPart("tensor", rank, world, 0, n, n)
    else:
        start, stop = layer_split(n, world, parallel.split)[rank]
        model.model.layers = model.model.layers[start:stop]
        part = RankPart("pipeline", rank, world, start, stop, n)
    mx.eval(model.parameters())
    stage = combine([("weights", loaded.fingerprint), ("part", part.describe())])
    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    return dataclasses.replace(loaded, fingerprint=stage, weight_bytes=nbytes), part


class StageModel:
    """This rank's share of one forward, on `PagedModel`'s own modules and attention."""

    def __init__(self, paged: PagedModel, part: RankPart):
        self.paged, self.part = paged, part

    def hidden(self, batch: StepBatch | PackedBatch, kv: PagedKVCache, h: mx.array | None = None,
               *, interrupt: Interrupt | None = None, group: int = 1) -> mx.array:
        """This rank's layers on ``h`` (or on the embedded tokens when it embeds); writes
        their K/V into this rank's pool at the batch's slots."""
        pm = self.paged
        if h is None:
            h = pm.embed(batch.input_ids)
        return pm._layers(h, batch, kv, interrupt, group)

    def logits(self, batch: StepBatch | PackedBatch, h: mx.array) -> mx.array | None:
        """The logits `PagedModel` returns for ``batch`` from the last hidden states."""
        pm = self.paged
        if isinstance(batch, PackedBatch):
            if not batch.decode_lens:
                return None
            return pm._logits(h[:, batch.decode_start:, :])[0]
        return pm._logits(h[:, -1:, :])[:, -1, :]
