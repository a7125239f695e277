"""llama.cpp's own C++ `llama-bench` as a peer of `kvchat bench` (``--peer llama-bench``).

llama.cpp as its users measure it: the binary in ``--llama-cpp-bin DIR`` (or on PATH), on
the GGUF file kvchat's model comes from (`peers.gguf_for`), per prompt length N:

- prefill: ``llama-bench -m GGUF -p N -n 0``: N prompt tokens on an empty context
- decode:  ``llama-bench -m GGUF -p 0 -n G -d N``: G single-token steps after an untimed
  N-token fill, the context kvchat decodes at (a decode step reads the whole context, so
  ``tg`` from an empty context would flatter whoever is slower at attention)

both with ``-t THREADS -r REPEATS -o json``. Its prompts are its own random token ids, not
kvchat's text, and it has no prompt cache: each repetition clears its KV memory first
(the depth fill is computed once per call and restored, untimed, for later repetitions).
It reports no per-token latency, so its ITL is "n/a". The rates are recomputed from its
``samples_ns`` (tokens x 1e9 / ns, what its ``samples_ts`` rounds) and the median taken,
as for kvchat's repeats; its ``avg_ts``/``stddev_ts`` are kept beside them.

`kvchat bench` calls `LlamaBench.measure` right after kvchat's runs of each length, in
the same invocation, with kvchat's engine loaded and idle.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path

from app.bench.common import log
from app.bench.peers import LLAMA_BENCH, gguf_for

# What llama-bench's JSON says about its build and the run (kept in the report as printed).
BUILD_FIELDS = ("build_commit", "build_number", "cpu_info", "gpu_info", "backends")
RUN_FIELDS = ("model_type", "model_size", "model_n_params", "n_threads", "n_batch", "n_ubatch",
              "type_k", "type_v", "flash_attn")


def command(binary: str, gguf: Path, *, n_prompt: int, n_gen: int, depth: int, threads: int,
            repeats: int) -> list[str]:
    """One llama-bench test: ``pp n_prompt`` (n_gen 0) or ``tg n_gen @ d depth`` (n_prompt 0)."""
    cmd = [binary, "-m", str(gguf), "-p", str(n_prompt), "-n", str(n_gen)]
    if depth:
        cmd += ["-d", str(depth)]
    return cmd + ["-t", str(threads), "-r", str(repeats), "-o", "json"]


def run_test(cmd: list[str]) -> dict:
    """The one test ``cmd`` runs, as llama-bench's JSON gives it.

    Raises:
        RuntimeError: it failed or printed no single test (its last error line is kept).
    """
    proc = subprocess.run(cmd, capture_output=True, text=True)
    last = (proc.stderr.strip().splitlines() or [""])[-1][-300:]
    if proc.returncode:
        raise RuntimeError(f"llama-bench exited with status {proc.returncode}: {last}")
    try:
        tests = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(f"llama-bench printed no JSON: {last}") from None
    if not isinstance(tests, list) or len(tests) != 1:
        raise RuntimeError(f"llama-bench printed {len(tests)} tests, not one")
    return tests[0]


def rates(test: dict) -> list[float]:
    """tok/s per repetition: llama-bench's tokens over each sample's nanoseconds."""
    tokens = test["n_prompt"] + test["n_gen"]
    return [tokens * 1e9 / ns for ns in test.get("samples_ns") or []] or [test["avg_ts"]]


def summary(pp: dict, tg: dict) -> dict:
    """A row of the report from one ``pp N`` and one ``tg G @ dN`` test."""
    pp_ts, tg_ts = rates(pp), rates(tg)
    return {
        "prompt_tokens": pp["n_prompt"],
        "generated_tokens": tg["n_gen"],
        "depth": tg["n_depth"],
        "repeats": len(pp_ts),
        "prefill_s": statistics.median(pp.get("samples_ns") or [pp["avg_ns"]]) / 1e9,
        "decode_s": statistics.median(tg.get("samples_ns") or [tg["avg_ns"]]) / 1e9,
        "prefill_tps": statistics.median(pp_ts),
        "decode_tps": statistics.median(tg_ts),
        "itl_p50_ms": None,  # llama-bench times whole tests, never a token
        "itl_p95_ms": None,
        "prefill_avg_ts": pp["avg_ts"], "prefill_stddev_ts": pp["stddev_ts"],
        "decode_avg_ts": tg["avg_ts"], "decode_stddev_ts": tg["stddev_ts"],
        "prefill_tps_runs": pp_ts,
        "decode_tps_runs": tg_ts,
        "runs": [{"prefill_tps": a, "decode_tps": b} for a, b in zip(pp_ts, tg_ts,
                                                                     strict=False)],
    }


class LlamaBench:
    """The llama-bench side of one `kvchat bench` run: its results per length, its build
    info and its failures (a failed length is a note, the other sides go on)."""

    def __init__(self, binary: str, gguf: Path, *, threads: int, repeats: int,
                 gen_tokens: int):
        self.binary, self.gguf = binary, gguf
        self.threads, self.repeats, self.gen_tokens = threads, repeats, gen_tokens
        self.results: dict[int, dict] = {}
        self.failures: list[str] = []
        self.build: dict | None = None
        self.commands: list[str] = []

    @classmethod
    def from_args(cls, args) -> LlamaBench:
        """Checked before anything slow: the binary exists and the model is a GGUF file
        (`KVChatError`, one line, otherwise)."""
        from app.eval.llama_peer import tool

        binary = tool(LLAMA_BENCH, args.llama_cpp_bin)
        gguf = gguf_for(args.model, peer=LLAMA_BENCH)
        return cls(binary, gguf, threads=args.llama_cpp_threads or os.cpu_count() or 1,
                   repeats=args.repeats, gen_tokens=args.gen_tokens)

    def measure(self, n: int) -> dict | None:
        """``pp n`` then ``tg G @ d n``; the row, or None (and a failure) if either fails."""
        opts = dict(threads=self.threads, repeats=self.repeats)
        cmds = [command(self.binary, self.gguf, n_prompt=n, n_gen=0, depth=0, **opts),
                command(self.binary, self.gguf, n_prompt=0, n_gen=self.gen_tokens, depth=n,
                        **opts)]
        log(LLAMA_BENCH, f"length {n}: pp {n}, then tg {self.gen_tokens} @ d{n} "
                         f"({self.threads} threads, -r {self.repeats})")
        try:
            pp, tg = (run_test(cmd) for cmd in cmds)
        except (RuntimeError, OSError, ValueError, KeyError) as e:
            self.failures.append(f"llama-bench failed at length {n}: {e}")
            return None
        self.commands += [" ".join(cmd) for cmd in cmds]
        if self.build is None:
            self.build = {k: pp.get(k) for k in BUILD_FIELDS + RUN_FIELDS}
        self.results[n] = s = summary(pp, tg)
        log(LLAMA_BENCH, f"length {n}: prefill {s['prefill_tps']:.1f} tok/s, decode "
                         f"{s['decode_tps']:.1f} tok/s")
        return s

    def info(self) -> dict:
        """The report's ``llama_bench`` entry: binary, file, settings, build as printed."""
        return {"binary": self.binary, "gguf": str(self.gguf),
                "weight_format": self.gguf.stem.rsplit(".", 1)[-1], "threads": self.threads,
                "repetitions": self.repeats, "build": self.build, "commands": self.commands}

    def notes(self) -> list[str]:
        """What llama-bench measured, for the report's notes (with its failures)."""
        g = self.gen_tokens
        return self.failures + [
            f"llama-bench (C++, {self.threads} threads, -r {self.repeats}, median of its "
            f"samples; avg_ts in the JSON) runs its own prompt of random token ids, not "
            f"kvchat's text: prefill = pp N on an empty context, decode = tg {g} at depth N "
            f"(-d N: after an untimed N-token fill), the context kvchat decodes at; its "
            f"prefill tok/s = N / time of the prompt's batches, its decode tok/s = {g} / time "
            f"of {g} single-token steps",
            "llama-bench's runs are not prefix-cached: it has no prompt cache and clears its "
            "KV memory before every repetition (the depth fill is untimed; recent builds "
            "compute it once per call and restore it); it reports no cached-token count, no "
            "tokens and no per-token latency (ITL and agree: n/a)",
            "llama-bench ran right after kvchat's runs of each length, in this invocation "
            "(kvchat's engine loaded and idle meanwhile)",
        ]
