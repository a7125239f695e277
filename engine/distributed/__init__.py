"""Serving one model from several processes or Macs over `mx.distributed`.

Rank 0 runs the whole engine (tokenizer, scheduler, block tables, prefix index) over its
part of the model; every other rank holds its own part and a KV pool for it alone, with
the same block ids, and runs what rank 0 plans each step.

- `config`: `ParallelConfig` (pipeline or tensor, layer split, timeouts, backend)
- `group`: joining the ranks; the watchdog that turns a hung or dead rank into an exit
- `plan_wire`: a step's plan as int32 arrays; `link`: framed messages between neighbours
- `stage`: a rank's part of the model (layer slice or head share) and its forward
- `ledger`: each rank's mirror of rank 0's block accounting
- `handshake`: the pool format every rank must agree on
- `leader` / `engine`: rank 0's runners and `DistributedEngine`; `worker`: the other ranks
- `prefix`: the disk prefix store, one per rank, restored only where every rank can
- `launch`: several ranks on one machine without `mlx.launch` (tests, checks)
"""

from engine.distributed.config import ParallelConfig
from engine.distributed.group import EXIT_RANK_LOST, init_group

__all__ = ["EXIT_RANK_LOST", "ParallelConfig", "init_group"]
