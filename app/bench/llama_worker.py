"""The llama.cpp side of `kvchat bench --peer llama.cpp`, in its own interpreter.

Started by `app.bench.peers` as ``python -m app.bench.llama_worker --llama-cpp-worker JOB.json``.
It runs llama-cpp-python on the same GGUF file kvchat's default model comes from, over the
same prompt token ids, and sends raw timed runs back (the parent summarizes every side
with the same code). A separate process keeps kvchat's OpenBLAS preload and MLX's
threads out of llama.cpp's way, and llama.cpp's out of kvchat's.

Every run is cold. `Llama.generate` reuses the K/V of the longest prefix shared with the
previous call; `Llama.reset` before each run sets its past to zero tokens, so nothing
matches and the K/V cache is cleared from position 0. That is not assumed: llama.cpp's
own counters (``llama_perf_context``: prompt and decode tokens evaluated) are reset per
run and read back, and ``cached_tokens`` is the prompt tokens it did not evaluate.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path

from app.bench.common import log, time_stream

WORKER_FLAG = "--llama-cpp-worker"
WARMUP_GEN_TOKENS = 3


def evaluated_tokens(llm) -> int:
    """Tokens llama.cpp evaluated since the last perf reset (prompt batches + single steps)."""
    import llama_cpp

    data = llama_cpp.llama_perf_context(llm._ctx.ctx)
    # Both counters are reported as at least 1 even when zero; the caller clamps.
    return int(data.n_p_eval) + int(data.n_eval)


def worker_main(job_file: str) -> int:
    """Time llama.cpp over the job's prompts; print one JSON object on stdout."""
    out, sys.stdout = sys.stdout, sys.stderr  # a library's prints must not corrupt the JSON
    job = json.loads(Path(job_file).read_text())
    if "engine" in sys.modules:
        raise RuntimeError("the llama.cpp worker must not import kvchat's engine")

    import llama_cpp

    threads = job["n_threads"]
    log("llama.cpp", f"loading {job['gguf']} ({threads} threads)")
    llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=job["n_ctx"], n_threads=threads,
                          n_threads_batch=threads, verbose=False)

    def run(ids: list[int], n: int) -> dict:
        llm.reset()  # past = 0 tokens: generate() finds no prefix to reuse
        llama_cpp.llama_perf_context_reset(llm._ctx.ctx)

        def tokens():
            # Greedy (temp 0 is llama.cpp's greedy sampler; penalties 1.0/0 are no-ops).
            # generate() never stops on EOS itself (create_completion does): EOS ignored.
            for i, token in enumerate(llm.generate(ids, temp=0.0, repeat_penalty=1.0,
                                                   frequency_penalty=0.0,
                                                   presence_penalty=0.0)):
                yield token
                if i + 1 == n:
                    break

        r = time_stream(len(ids), tokens)
        # n tokens sampled took the prompt plus n - 1 single-token steps.
        prompt_evaluated = evaluated_tokens(llm) - (r["generated_tokens"] - 1)
        return r | {"cached_tokens": max(0, len(ids) - prompt_evaluated)}

    log("llama.cpp", "warm-up")
    run(job["warmup_ids"], WARMUP_GEN_TOKENS)
    results = {}
    for length, repeats, *sized in job["prompts"]:  # one independent prompt per repeat
        if sized:  # this size's untimed warm-up, as kvchat's
            run(sized[0], WARMUP_GEN_TOKENS)
        runs = []
        for i, ids in enumerate(repeats):
            log("llama.cpp", f"length {length} run {i + 1}/{len(repeats)}")
            runs.append(run(ids, job["gen_tokens"]))
        log("llama.cpp", f"length {length}: prefill "
                         f"{statistics.median(r['prefill_tps'] for r in runs):.1f} tok/s, decode "
                         f"{statistics.median(r['decode_tps'] for r in runs):.1f} tok/s")
        results[str(length)] = runs
    system = llama_cpp.llama_print_system_info()
    info = {
        "llama_cpp_python_version": getattr(llama_cpp, "__version__", "?"),
        "gguf": job["gguf"],
        "weight_format": _file_type(llm),
        "n_threads": threads,
        "n_batch": llm.n_batch,
        "n_ctx": llm.n_ctx(),
        "system_info": (system.decode() if isinstance(system, bytes) else str(system)).strip(),
        "results": results,
    }
    out.write(json.dumps(info) + "\n")
    out.flush()
    return 0


def _file_type(llm) -> str:
    # GGUF general.file_type is llama.cpp's enum; the file name says it readably (…Q4_1.gguf).
    name = Path(llm.model_path).stem
    return name.rsplit(".", 1)[-1] if "." in name else str(
        llm.metadata.get("general.file_type", "?"))


def _main(argv: Iterable[str]) -> int:
    argv = list(argv)
    if len(argv) == 2 and argv[0] == WORKER_FLAG:
        return worker_main(argv[1])
    print(f"usage: python -m app.bench.llama_worker {WORKER_FLAG} JOB.json "
          "(internal; see kvchat bench --peer llama.cpp)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
