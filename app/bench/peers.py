"""The engines `kvchat bench` compares with, each run in a fresh interpreter.

- mlx-lm as shipped (`app.bench.worker`): always, unless ``--no-mlx-lm``.
- llama.cpp through llama-cpp-python (`app.bench.llama_worker`): with ``--peer llama.cpp``,
  on the GGUF file kvchat's model comes from. An optional extra (``pip install -e
  '.[peers]'``): it builds llama.cpp from source, so CI and ``make test`` go without it.
- llama.cpp's own C++ ``llama-bench`` (`app.bench.llama_bench`): with ``--peer llama-bench``,
  the binary from ``--llama-cpp-bin DIR`` (or PATH) on that same GGUF file.

A fresh interpreter each: the mlx-lm side must run without kvchat's process-wide
OpenBLAS preload, and llama.cpp's threads must not share a process with MLX's.
Every worker reads a JSON job and prints one JSON object: raw timed runs per length
(with the ``cached_tokens`` its engine reported per run) plus facts about itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from engine.errors import KVChatError

LLAMA_CPP = "llama.cpp"
LLAMA_BENCH = "llama-bench"  # llama.cpp's own C++ benchmark (`app.bench.llama_bench`)
PEER_CHOICES = (LLAMA_CPP, LLAMA_BENCH)  # the optional peers of --peer (mlx-lm: the default)
LLAMA_CPP_MODULE = "llama_cpp"  # what llama-cpp-python installs
LLAMA_CPP_MISSING = ("llama.cpp peer: llama-cpp-python is not installed; "
                     "pip install -e '.[peers]'")
# Seen on a VM whose CPU flags list AMX but whose hypervisor faults on AMX instructions:
# a native build of llama.cpp then dies in its AMX matmul on the first prompt.
LLAMA_CPP_CRASH_HINT = ("if the CPU lists AMX (grep amx /proc/cpuinfo) inside a VM, rebuild "
                        "llama-cpp-python without it: CMAKE_ARGS='-DGGML_NATIVE=OFF "
                        "-DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF' pip install "
                        "--force-reinstall --no-deps --no-cache-dir llama-cpp-python")


def check_llama_cpp(model_spec: str | None) -> Path:
    """The GGUF llama.cpp will run, or a `KVChatError` saying why it cannot run.

    Called before kvchat loads anything, so a missing extra fails in a second, not
    after minutes of benchmarking.
    """
    if importlib.util.find_spec(LLAMA_CPP_MODULE) is None:
        raise KVChatError(LLAMA_CPP_MISSING)
    return gguf_for(model_spec)


def gguf_for(model_spec: str | None, *, peer: str = LLAMA_CPP) -> Path:
    """The GGUF file kvchat loads ``model_spec`` from: the same weights for llama.cpp."""
    from engine.model.loader import DEFAULT_MODEL, default_gguf_path

    if model_spec in (None, "", DEFAULT_MODEL):
        return default_gguf_path()
    path = Path(model_spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path.resolve()
    raise KVChatError(f"{peer} peer: needs the model as a GGUF file (--model default or "
                      f"--model FILE.gguf), not {model_spec!r}")


def run_worker(module: str, flag: str, job: dict, name: str, crash_hint: str = "") -> dict:
    """Run ``python -m module flag JOB.json`` without the OpenBLAS preload; its JSON result.

    Raises:
        RuntimeError: the worker failed or printed no result (its error is on stderr).
    """
    root = Path(__file__).resolve().parents[2]  # the directory holding `app`
    env = dict(os.environ, KVCHAT_BLAS="none")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="kvchat-bench-") as tmp:
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(job))
        # stderr is inherited so the worker's progress shows up live.
        cmd = [sys.executable, "-m", module, flag, str(job_file)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, env=env, text=True)
    if proc.returncode < 0:  # killed by a signal: a crash inside a native library
        sig = signal.Signals(-proc.returncode).name
        raise RuntimeError(f"the {name} worker crashed ({sig})" + (f"; {crash_hint}" if
                                                                     crash_hint else ""))
    if proc.returncode != 0:
        raise RuntimeError(f"the {name} worker exited with status {proc.returncode} "
                           "(its error is above)")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if not lines:
        raise RuntimeError(f"the {name} worker printed no result")
    return json.loads(lines[-1])


def _job_prompts(prompts: dict[int, list[list[int]]], sized: dict[int, list[int]] | None,
                 ) -> list[list]:
    """``[length, runs]`` per length, plus its untimed warm-up prompt where given."""
    return [[n, runs] + ([sized[n]] if sized and n in sized else [])
            for n, runs in prompts.items()]


def run_mlx_lm(model_path: Path, prompts: dict[int, list[list[int]]], warmup: list[int],
               gen_tokens: int, sized: dict[int, list[int]] | None = None) -> dict:
    """mlx-lm as shipped over ``prompts`` (``{length: [ids per repeat]}``), each length
    after an untimed run of ``sized[length]`` where given."""
    from app.bench.worker import WORKER_FLAG

    job = {"model_path": str(model_path), "gen_tokens": gen_tokens, "warmup_ids": warmup,
           "prompts": _job_prompts(prompts, sized)}
    return run_worker("app.bench.worker", WORKER_FLAG, job, "mlx-lm")


def run_llama_cpp(gguf: Path, prompts: dict[int, list[list[int]]], warmup: list[int],
                  gen_tokens: int, threads: int | None = None,
                  sized: dict[int, list[int]] | None = None) -> dict:
    """llama.cpp on ``gguf`` over the same ids, ``threads`` or one thread per core; each
    length after an untimed run of ``sized[length]`` where given."""
    from app.bench.llama_worker import WORKER_FLAG

    longest = max([len(warmup)] + list(prompts))
    job = {"gguf": str(gguf), "gen_tokens": gen_tokens, "warmup_ids": warmup,
           "n_threads": threads or os.cpu_count() or 1, "n_ctx": longest + gen_tokens + 8,
           "prompts": _job_prompts(prompts, sized)}
    return run_worker("app.bench.llama_worker", WORKER_FLAG, job, LLAMA_CPP,
                      LLAMA_CPP_CRASH_HINT)
