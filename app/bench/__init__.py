"""kvchat's benchmarks, one module per `kvchat bench` mode.

- `compare`: ``kvchat bench`` — prefill/decode speed vs mlx-lm as shipped (`worker` runs
  mlx-lm in its own interpreter; `compare_report` prints the table)
- `load`: ``bench load`` — throughput and latency under concurrent load (`load_report`)
- `prefix`: ``bench prefix`` — TTFT with a long shared prefix, cold vs warm RAM vs warm disk
- `decode`: ``bench decode`` — aggregate decode tok/s of B streams vs one
- `kernel`: ``bench kernel`` — the paged decode kernel vs the reference (Metal/CUDA only)
- `common`: machine info, prompt token ids, timing and summaries shared by all

Nothing here is imported at package import: ``python -m app.bench.worker`` must not
load the engine.
"""

from __future__ import annotations


def add_parser(sub) -> None:
    """Register ``bench`` (the comparison) and its modes on the CLI's subparsers object."""
    from app.bench import compare, decode, kernel, load, prefix

    p = sub.add_parser(
        "bench",
        help="prefill/decode speed of kvchat vs mlx-lm (a benchmark, not a test)",
        description=compare.__doc__.splitlines()[0],
    )
    compare.add_arguments(p)
    # An optional sub-command: plain `kvchat bench [flags]` stays the comparison, and
    # `kvchat bench load|prefix|decode|kernel [flags]` (flags after the mode) runs another.
    modes = p.add_subparsers(dest="bench_mode", title="other benchmarks",
                             metavar="{load,prefix,decode,kernel}")
    for mode in (load, prefix, decode, kernel):
        mode.add_parser(modes)
