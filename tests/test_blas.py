"""The OpenBLAS preload: a build older than the CPU gets a core it can run at full width;
importing the engine compiles nothing, and a model load leaves the shim to the next process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.model import blas

ROOT = Path(__file__).resolve().parents[1]
needs_cc = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler"
)

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


@pytest.mark.subprocess
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


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _fake_compilers(bindir: Path, marker: Path) -> None:
    """``cc`` and ``gcc`` that only leave ``marker``: any compile shows."""
    bindir.mkdir()
    for name in ("cc", "gcc"):
        tool = bindir / name
        tool.write_text(f"#!/bin/sh\necho \"$0 $@\" >> {marker}\nexit 1\n")
        tool.chmod(0o755)


def _python(code: str, home: Path, bindir: Path | None = None) -> str:
    env = dict(os.environ, KVCHAT_HOME=str(home), PYTHONPATH=str(ROOT))
    if bindir is not None:
        env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=True).stdout.strip().splitlines()[-1]


@pytest.mark.subprocess
def test_import_engine_compiles_nothing(tmp_path):
    home, marker = tmp_path / "home", tmp_path / "compiled"
    _fake_compilers(tmp_path / "bin", marker)
    out = _python("import engine; from engine.model import blas; print(blas.gemv_shim)",
                  home, tmp_path / "bin")
    assert out == "False"  # nothing was cached yet, and nothing was built to fill it
    assert not marker.exists(), marker.read_text()
    assert not home.exists()  # nor written anything: the cache is filled on a model load


@needs_cc
@pytest.mark.subprocess
def test_a_model_load_leaves_the_shim_for_the_next_process(tmp_path):
    home, marker = tmp_path / "home", tmp_path / "compiled"
    first = _python("import engine; from engine.model import blas; blas.prepare_cache(); "
                    "print(blas.loaded_path is not None, blas.gemv_shim)", home)
    if first == "False False":
        pytest.skip("no OpenBLAS on this machine")
    assert first == "True False"  # the first process runs without it...
    _fake_compilers(tmp_path / "bin", marker)
    second = _python("import engine; from engine.model import blas; print(blas.gemv_shim)",
                     home, tmp_path / "bin")
    assert second == "True" and not marker.exists()  # ...the next one loads the cached build


def test_a_recorded_core_skips_the_probe(home, tmp_path, monkeypatch):
    lib = tmp_path / "libopenblas.so.0"
    lib.write_bytes(b"stand-in: only its stat keys the record")
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    monkeypatch.setenv("KVCHAT_GEMV_SHIM", "0")  # this test builds nothing
    monkeypatch.setattr(blas, "_cpuinfo", lambda: ("a CPU newer than OpenBLAS", AVX512))
    monkeypatch.setattr(blas, "_probed", None)
    probes = []

    def probe(cmd, **kwargs):
        probes.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="Prescott\n")

    monkeypatch.setattr(subprocess, "run", probe)
    blas._choose_coretype(str(lib))
    assert os.environ.pop("OPENBLAS_CORETYPE") == "SkylakeX" and len(probes) == 1
    blas._choose_coretype(str(lib))  # nothing recorded before a model load: probed again
    assert os.environ.pop("OPENBLAS_CORETYPE") == "SkylakeX" and len(probes) == 2
    monkeypatch.setattr(blas, "loaded_path", str(lib))
    blas.prepare_cache()
    assert blas.corename_path(str(lib)).read_text() == "Prescott"
    blas._choose_coretype(str(lib))
    assert os.environ.pop("OPENBLAS_CORETYPE") == "SkylakeX" and len(probes) == 2
