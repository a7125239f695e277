"""How a model is split over ranks: plain data, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("pipeline", "tensor")


@dataclass(slots=True)
class ParallelConfig:
    """The parallel layout and the fault timeouts of a distributed run."""

    mode: str = "pipeline"
    """"pipeline": each rank holds a contiguous slice of layers (and their K/V);
    "tensor": each rank holds every layer's share of the attention heads and MLP."""
    split: tuple[int, ...] | None = None
    """Pipeline: layers per rank, in rank order (sums to the model's layers); None = even,
    the first ranks taking one more when the layers do not divide."""
    timeout_s: float = 60.0
    """Seconds one exchange with another rank may take (it includes that rank's forward of
    a prefill chunk) before the run ends with an error instead of hanging."""
    init_timeout_s: float = 180.0
    """Seconds for the ranks to connect and for every rank to load its model."""
    backend: str = "ring"
    """MLX distributed backend: "ring" (TCP: Ethernet, Thunderbolt bridge), "jaccl" (RDMA
    over Thunderbolt, macOS 26.2+), "mpi", "nccl" or "any"."""

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"parallel mode must be one of {', '.join(MODES)}")
        if not self.timeout_s > 0 or not self.init_timeout_s > 0:
            raise ValueError("distributed timeouts must be positive")
        if self.split is not None:
            if self.mode != "pipeline":
                raise ValueError("a layer split applies to pipeline parallel only")
            if not self.split or any(n < 1 for n in self.split):
                raise ValueError("a layer split needs at least one layer per rank")
