"""The OpenBLAS preload: a build older than the CPU gets a core it can run at full width."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.model import blas

AVX512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}


@pytest.mark.parametrize(("corename", "flags", "expected"), [
    ("Prescott", AVX512, "SkylakeX"),
    ("Prescott\n", {"avx2", "fma"}, "Haswell"),
    ("Nehalem", {"avx2", "fma", "avx512f"}, "Haswell"),  # partial AVX-512: not SkylakeX
    ("Prescott", {"sse3"}, None),  # an old CPU: generic is right
    ("SapphireRapids", AVX512, None),  # a core OpenBLAS knows: its choice stands
    ("Haswell", AVX512, None),
])
def test_coretype_only_replaces_a_generic_core(corename, flags, expected):
    assert blas.coretype_for(corename, flags) == expected


def test_preloaded_openblas_runs_a_core_that_matches_the_cpu():
    # a fresh interpreter: the choice is made once, before the library loads
    code = ("import ctypes; from engine.model import blas; blas.preload(); "
            "lib = ctypes.CDLL(blas.loaded_path) if blas.loaded_path else None; "
            "lib and setattr(lib.openblas_get_corename, 'restype', ctypes.c_char_p); "
            "print(lib.openblas_get_corename().decode() if lib else 'none')")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120, check=True).stdout.strip().splitlines()[-1]
    if out == "none":
        pytest.skip("no OpenBLAS on this machine")
    if "avx2" in blas._cpu_flags():
        assert out.lower() not in blas._GENERIC_CORES, out
