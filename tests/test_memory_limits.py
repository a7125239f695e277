"""Memory limits beyond the machine's RAM: a cgroup's and an address-space rlimit. A KV
budget past them is one line and exit 2, not a crash by a signal when the pool is made."""

from __future__ import annotations

import resource
import subprocess
import sys

from engine.model import memory_limits


def test_cgroup_limits_v1_and_v2(tmp_path):
    proc = tmp_path / "cgroup"
    root = tmp_path / "fs"
    (root / "box").mkdir(parents=True)
    (root / "box" / "memory.max").write_text("4294967296\n")
    proc.write_text("0::/box\n")
    assert memory_limits.cgroup_limit(str(root), str(proc)) == 4 << 30
    (root / "box" / "memory.max").write_text("max\n")
    assert memory_limits.cgroup_limit(str(root), str(proc)) is None
    (root / "memory" / "docker" / "c1").mkdir(parents=True)
    (root / "memory" / "docker" / "c1" / "memory.limit_in_bytes").write_text(f"{3 << 30}\n")
    proc.write_text("4:memory:/docker/c1\n1:cpu:/\n")
    assert memory_limits.cgroup_limit(str(root), str(proc)) == 3 << 30
    (root / "memory" / "docker" / "c1" / "memory.limit_in_bytes").write_text(f"{1 << 63}\n")
    assert memory_limits.cgroup_limit(str(root), str(proc)) is None  # v1's "no limit"
    assert memory_limits.cgroup_limit(str(root), str(tmp_path / "missing")) is None


def test_address_space_room_counts_what_is_mapped(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmSize:\t 1048576 kB\n")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        assert memory_limits.address_space_room(str(status)) is None
    else:
        assert memory_limits.address_space_room(str(status)) == max(soft - (1 << 30), 0)


def test_budget_past_an_address_space_limit_is_one_line():
    def limit():  # the case that died by SIGSEGV when the pool was allocated
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, resource.RLIM_INFINITY))

    r = subprocess.run([sys.executable, "-m", "app", "serve", "--kv-budget", "16G", "--port",
                        "0", "--no-disk-cache"], capture_output=True, text=True, timeout=300,
                       preexec_fn=limit)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "KV budget of 16.00 GiB exceeds" in lines[0]
    assert "Traceback" not in r.stderr
