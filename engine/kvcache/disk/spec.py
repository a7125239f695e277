"""What one KV block is on disk: the pool's geometry and full format, and the tensors it implies.

An entry holds, for every layer, the stored bytes of its K block and then, for every layer,
those of its V block (`kv_cache.PagedKVCache.take` order). A plain side is one tensor of the
compute dtype, ``(kv_heads, block_size, head_dim)``; a quantized side is three: the packed
uint32 data ``(kv_heads, block_size, head_dim * bits / 32)`` and the float16 scales and biases
``(kv_heads, block_size, head_dim / group_size)``. A residual pool's full block (`kvcache.residual`;
its float16 side store is never on disk) is the same, except that keys quantized per channel
(``key_channel``) are the block's slice of `channel_quant`'s store: uint8 codes
``(kv_heads, 1, head_dim, block_size * bits / 8)`` and float16 scales and biases
``(kv_heads, 1, head_dim)``. `EntrySpec` names all of it, so an entry's header can say exactly
what its payload must be and a reader can say exactly what it accepts.

No MLX here: the store's modules load without it (a crash test runs them in a bare child).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.kvcache.quant import SCALE_DTYPE, QuantSpec

# header dtype name -> how the bytes are stored; numpy has no bfloat16, so bfloat16 tensors
# travel as their uint16 bit patterns (a uint16 array is recorded as "bfloat16")
DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2"),
          "uint32": np.dtype("<u4"), "uint8": np.dtype("u1")}
_NAME_OF = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
            np.dtype(np.uint16): "bfloat16", np.dtype(np.uint32): "uint32",
            np.dtype(np.uint8): "uint8"}
FLOAT_DTYPES = ("float32", "float16", "bfloat16")  # what K/V compute in, or a plain side holds
PACKED_DTYPE = "uint32"  # `mx.quantize`'s packed data
CHANNEL_DTYPE = "uint8"  # per-channel key codes (`kvcache.channel_quant`)
CHANNEL_BITS = (4, 8)  # as `channel_quant.CHANNEL_BITS` (not imported: that module loads MLX)
_BASE_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "dtype", "k_quant", "v_quant")
# A sanity bound, not a model limit: a forged header must not make a reader build a huge list.
_MAX_LAYERS = 4096


def dtype_name(a: np.ndarray) -> str:
    """The header name of an array's dtype (uint16 means bfloat16 bits)."""
    try:
        return _NAME_OF[a.dtype.newbyteorder("=")]
    except KeyError:
        msg = f"unsupported KV dtype {a.dtype} (float32, float16, uint16=bfloat16, uint32)"
        raise ValueError(msg) from None


def _positive_int(name: str, value) -> None:
    # bool is an int subclass: True must not pass for a layer count
    if type(value) is not int or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class EntrySpec:
    """A KV pool's geometry and full format: what each of its blocks is on disk.

    Entry headers record it and `entry.check_structure` holds the payload to it; a
    reader passes its pool's (`EntrySpec.of(layout)`) and is served only an exact match.

    Attributes:
        num_layers, num_kv_heads, head_dim: the pool's geometry.
        dtype: the compute dtype (``"float32"``, ``"float16"`` or ``"bfloat16"``).
        k_quant, v_quant: that side's quantized format, or None for plain ``dtype``.
        residual: a residual pool's block (`kvcache.residual`): its K/V were computed reading
            their own block exact, so it never mixes with a per-token pool's, even where the
            bytes' layout is the same.
        key_channel: the tokens of one per-channel key group (the block size), 0 for keys
            per token.

    ``residual`` and ``key_channel`` are written to a header only when set, so every other
    spec's header is byte for byte what it was before they existed.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    k_quant: QuantSpec | None = None
    v_quant: QuantSpec | None = None
    residual: bool = False
    key_channel: int = 0

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            _positive_int(name, getattr(self, name))
        if self.num_layers > _MAX_LAYERS:
            raise ValueError(f"num_layers {self.num_layers} > {_MAX_LAYERS}")
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {self.dtype!r}")
        for q in (self.k_quant, self.v_quant):
            if q is not None and (not isinstance(q, QuantSpec) or not q.fits(self.head_dim)):
                raise ValueError(f"{q!r} does not fit head_dim {self.head_dim}")
        if type(self.residual) is not bool or type(self.key_channel) is not int:
            raise ValueError(f"residual {self.residual!r}, key_channel {self.key_channel!r}")
        if self.residual and not (self.k_quant and self.v_quant):
            raise ValueError("a residual block quantizes K and V")
        if self.key_channel:
            _positive_int("key_channel", self.key_channel)
            if not self.residual or self.k_quant.bits not in CHANNEL_BITS \
                    or self.key_channel * self.k_quant.bits % 8:
                raise ValueError(f"per-channel keys over {self.key_channel} tokens need a "
                                 f"residual block and {CHANNEL_BITS} bits")

    @classmethod
    def of(cls, layout) -> EntrySpec:
        """The spec of a `kv_cache.KVLayout` (duck-typed: this module does not load MLX;
        the layout's formats are this one's `QuantSpec`)."""
        return cls(layout.num_layers, layout.num_kv_heads, layout.head_dim,
                   str(layout.dtype).removeprefix("mlx.core."), layout.k_quant, layout.v_quant,
                   bool(getattr(layout, "residual", False)),
                   layout.block_size if getattr(layout, "key_channel", False) else 0)

    @classmethod
    def infer(cls, arrays: Sequence[np.ndarray]) -> EntrySpec:
        """The spec of a plain block: keys then values of each layer, one float dtype and
        one shape ``(kv_heads, block_size, head_dim)``. Raises ValueError for anything else
        (a quantized block cannot be inferred: pass its spec)."""
        if not arrays or len(arrays) % 2:
            raise ValueError(f"{len(arrays)} arrays: not keys and values of whole layers")
        names = {dtype_name(a) for a in arrays}
        shapes = {tuple(a.shape) for a in arrays}
        if len(names) != 1 or len(shapes) != 1:
            raise ValueError("plain K/V arrays differ in dtype or shape")
        (name,), (shape,) = names, shapes
        if len(shape) != 3:
            raise ValueError(f"K/V arrays must be (heads, block_size, dim), got {shape}")
        return cls(len(arrays) // 2, shape[0], shape[2], name)

    @property
    def quantized(self) -> bool:
        return self.k_quant is not None or self.v_quant is not None

    @property
    def kv_format(self) -> str:
        """The KV format as the prefix key's salt names it: complete, so two pools whose
        blocks differ never share a key (a quantized pool names its compute dtype too; a
        residual one as `KVLayout.kv_format` does, ``res=`` its dtype, ``c<n>`` for keys
        grouped per channel over n tokens)."""
        if not self.quantized:
            return self.dtype
        k, v = (q.name if q else self.dtype for q in (self.k_quant, self.v_quant))
        if self.key_channel:
            k = k.replace(f"g{self.k_quant.group_size}", f"c{self.key_channel}")
        if self.residual:
            return f"k={k},v={v},res={self.dtype}"
        return f"k={k},v={v},dtype={self.dtype}"

    @property
    def num_tensors(self) -> int:
        return self.num_layers * sum(3 if q else 1 for q in (self.k_quant, self.v_quant))

    def _side(self, quant: QuantSpec | None, block_size: int,
              channel: bool = False) -> list[tuple[str, tuple]]:
        if channel:  # one block of (heads, blocks, channels, ...); codes for block_size tokens
            lead = (self.num_kv_heads, 1, self.head_dim)
            return [(CHANNEL_DTYPE, (*lead, block_size * quant.bits // 8)),
                    (SCALE_DTYPE, lead), (SCALE_DTYPE, lead)]
        rows = (self.num_kv_heads, block_size)
        if quant is None:
            return [(self.dtype, (*rows, self.head_dim))]
        groups = (*rows, quant.num_groups(self.head_dim))
        return [(PACKED_DTYPE, (*rows, quant.packed_dim(self.head_dim))),
                (SCALE_DTYPE, groups), (SCALE_DTYPE, groups)]

    def tensors(self, block_size: int) -> list[tuple[str, tuple[int, ...]]]:
        """(dtype name, shape) of every tensor of one block, in payload order."""
        return (self._side(self.k_quant, block_size, bool(self.key_channel)) * self.num_layers
                + self._side(self.v_quant, block_size) * self.num_layers)

    def block_bytes(self, block_size: int) -> int:
        """Payload bytes of one block: the pool's ``bytes_per_block``, scales included."""
        return sum(DTYPES[d].itemsize * math.prod(s) for d, s in self.tensors(block_size))

    def to_dict(self) -> dict:
        """Plain JSON-able fields (what entry headers hold)."""
        def quant(q):
            if q is None:
                return None
            doc = {"bits": q.bits, "group_size": q.group_size}
            return doc | ({"rotation": q.rotation} if q.rotation else {})

        return {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "dtype": self.dtype,
                "k_quant": quant(self.k_quant), "v_quant": quant(self.v_quant)} \
            | ({"residual": True} if self.residual else {}) \
            | ({"key_channel": self.key_channel} if self.key_channel else {})

    @classmethod
    def from_dict(cls, doc) -> EntrySpec:
        """Rebuild from `to_dict`; raises ValueError or TypeError on anything else."""
        # the optional fields are present only when set: one encoding per spec
        extra = sorted(set(doc) - set(_BASE_FIELDS)) if isinstance(doc, dict) else None
        if extra not in ([], ["residual"], ["key_channel", "residual"]) \
                or not set(_BASE_FIELDS) <= set(doc):
            raise ValueError(f"spec fields {doc!r}")
        if doc.get("residual", True) is not True or doc.get("key_channel", 1) == 0:
            raise ValueError(f"spec fields {doc!r}")

        def quant(q) -> QuantSpec | None:
            if q is None:
                return None
            if not isinstance(q, dict) or sorted(q) not in (
                    ["bits", "group_size"], ["bits", "group_size", "rotation"]):
                raise ValueError(f"quant fields {q!r}")
            return QuantSpec(**q)

        return cls(doc["num_layers"], doc["num_kv_heads"], doc["head_dim"], doc["dtype"],
                   quant(doc["k_quant"]), quant(doc["v_quant"]), "residual" in doc,
                   doc.get("key_channel", 0))
