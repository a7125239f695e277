"""Limits on the memory this process may use beyond the machine's RAM: a cgroup's (a
container started with ``--memory``) and an address-space rlimit (``ulimit -v``).

The KV pool is allocated up front; past such a limit that allocation dies by a signal
with no message (seen: SIGSEGV for ``serve --kv-budget 16G`` under ``prlimit --as=8G`` on a
24 GB machine), so the budget check must count them (`memory.engine_memory_limit`).
"""

from __future__ import annotations

import resource
from pathlib import Path

UNLIMITED = 1 << 60  # cgroup v1 writes ~2**63 for "no limit"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():
        return None  # "max": no limit
    value = int(text)
    return value if 0 < value < UNLIMITED else None


def cgroup_limit(root: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup") -> int | None:
    """The memory limit of this process's cgroup (v2 ``memory.max`` or v1
    ``memory.limit_in_bytes``), or None when it has none or it cannot be read."""
    try:
        lines = Path(proc).read_text().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        controllers, _, path = line.partition(":")[2].partition(":")
        rel = path.lstrip("/")
        if controllers == "":  # v2: one unified hierarchy
            found.append(_read_int(Path(root, rel, "memory.max")))
        elif "memory" in controllers.split(","):  # v1
            found.append(_read_int(Path(root, "memory", rel, "memory.limit_in_bytes"))
                         or _read_int(Path(root, "memory", "memory.limit_in_bytes")))
    limits = [v for v in found if v is not None]
    return min(limits) if limits else None


def address_space_room(status: str = "/proc/self/status") -> int | None:
    """Bytes the address-space rlimit still leaves this process (its soft limit less the
    virtual memory already mapped), or None when there is no such limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    mapped = 0
    try:
        for line in Path(status).read_text().splitlines():
            if line.startswith("VmSize:"):
                mapped = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return max(soft - mapped, 0)
