"""Several ranks on this one machine without `mlx.launch`: for tests, checks and benchmarks.

The ring backend reads two environment variables: MLX_RANK, and MLX_HOSTFILE naming a
JSON list with one list of "ip:port" per rank. `mlx.launch -n N` writes the same thing
(and on several Macs also starts the ranks over ssh); this module does it for local
processes the caller wants to watch, stop or kill one by one.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path


def free_ports(n: int) -> list[int]:
    """``n`` TCP ports free on 127.0.0.1 now (the OS picks them)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def write_hostfile(path: Path, n: int) -> Path:
    """A ring hostfile for ``n`` ranks on 127.0.0.1."""
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
    return path


def spawn_local(argv: Sequence[str], n: int, hostfile: Path, *,
                env: dict[str, str] | None = None, **popen) -> list[subprocess.Popen]:
    """Start ``argv`` as ranks 0..n-1 of a ring over ``hostfile``; returns the processes."""
    procs = []
    for rank in range(n):
        e = dict(os.environ if env is None else env)
        e.update(MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile))
        procs.append(subprocess.Popen(list(argv), env=e, **popen))
    return procs
