"""kvchat's benchmarks, one module per `kvchat bench` mode.

- `compare`: ``kvchat bench`` — cold prefill/decode speed vs mlx-lm as shipped and, with
  ``--peer llama.cpp``, llama.cpp (`peers` runs each in its own interpreter: `worker` for
  mlx-lm, `llama_worker` for llama.cpp; `prompts` gives every run its own text;
  `compare_report` builds the ratios and prints the tables)
- `load`: ``bench load`` — throughput and latency under concurrent load (`load_report`)
- `prefix`: ``bench prefix`` — TTFT with a long shared prefix, cold vs warm RAM vs warm disk
- `decode`: ``bench decode`` — aggregate decode tok/s of B streams vs one
- `speculate`: ``bench spec`` — speculative decoding (prompt lookup) vs plain on document Q&A
- `kernel`: ``bench kernel`` — the paged decode kernel vs the reference (Metal/CUDA only)
- `common`: machine info, prompt token ids, timing and summaries shared by all

Nothing here is imported at package import: ``python -m app.bench.worker`` (and
``llama_worker``) must not load the engine.
"""

from __future__ import annotations


def add_parser(sub) -> None:
    """Register ``bench`` (the comparison) and its modes on the CLI's subparsers object."""
    from app.bench import compare, decode, kernel, load, prefix, speculate

    p = sub.add_parser(
        "bench",
        help="cold prefill/decode speed of kvchat vs mlx-lm and llama.cpp (a benchmark)",
        description=compare.__doc__.splitlines()[0],
    )
    compare.add_arguments(p)
    # An optional sub-command: plain `kvchat bench [flags]` stays the comparison, and
    # `kvchat bench load|prefix|decode|kernel [flags]` (flags after the mode) runs another.
    modes = p.add_subparsers(dest="bench_mode", title="other benchmarks",
                             metavar="{load,prefix,decode,spec,kernel}")
    for mode in (load, prefix, decode, speculate, kernel):
        mode.add_parser(modes)
