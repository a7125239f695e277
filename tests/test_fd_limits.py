"""Importing kvchat keeps the process's open-file limits (`engine.model.fd_limits`):
mlx-lm's import-time setrlimit neither lowers a larger hard limit nor crashes under a
smaller one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def limits_after_import(soft: int, hard: int) -> str:
    code = (f"import resource\nresource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))\n"
            "import engine, mlx_lm.utils\nprint(*resource.getrlimit(resource.RLIMIT_NOFILE))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-500:]
    return r.stdout.strip()


def test_a_large_hard_limit_is_kept_and_the_soft_one_raised():
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 4096:
        pytest.skip(f"this process's hard limit is {hard}: nothing above mlx-lm's 4096")
    big = min(hard, 20_000) if hard != resource.RLIM_INFINITY else 20_000
    assert limits_after_import(1024, big) == f"2048 {big}"  # mlx-lm would make it 4096


def test_a_small_hard_limit_does_not_break_the_import():
    assert limits_after_import(512, 1000) == "1000 1000"  # mlx-lm's call raised here
