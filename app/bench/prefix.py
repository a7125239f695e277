"""`kvchat bench prefix`: time to first token with a long shared prefix, cold vs warm.

A ~2k-token document, then a short question. Four runs of the same prompt:
cold (prefix cache off), warm from RAM (the document was asked about before in
this process), cold in a new process (disk cache off) and warm from disk in a new
process (its RAM cache empty: everything but the question comes from the disk store,
written by the warm engine when it asked another question about the document).
Reported as ratios of TTFT; the greedy tokens of all of them must agree. The new-process
pair is what a user sees on a restart: both pay the same start-up, so their ratio is
the disk restore's against recomputing the prefix.
"""

from __future__ import annotations

import inspect
import json
import sys
import tempfile
import textwrap
from pathlib import Path

from app import arg_types
from app.fresh_process import generate_in_fresh_process


def document(tokenizer, min_tokens: int) -> str:
    """Real text (the stdlib's textwrap source), cut to about ``min_tokens`` tokens."""
    source = inspect.getsource(textwrap)
    for n in range(2000, len(source) + 1000, 500):
        if len(tokenizer.encode(source[:n])) >= min_tokens:
            return source[:n]
    raise ValueError(f"no document of {min_tokens} tokens")


def add_parser(sub) -> None:
    """Register ``prefix`` on the subparsers of the ``bench`` command."""
    p = sub.add_parser("prefix", help="TTFT with a long shared prefix: cold, warm RAM, warm disk",
                       description=__doc__.splitlines()[0])
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p) -> None:
    """The flags of ``bench prefix``."""
    p.add_argument("--model", default=None)
    p.add_argument("--prefix-tokens", type=arg_types.positive_int, default=2048,
                   help="shared document length in tokens (2048)")
    p.add_argument("--gen-tokens", type=arg_types.positive_int, default=8,
                   help="tokens decoded per run (8)")
    p.add_argument("--json", default=None, help="write the results here")


def run(args) -> int:
    """Measure cold, warm-RAM and warm-disk TTFT in a private temp store, removed after."""
    with tempfile.TemporaryDirectory(prefix="kvchat-bench-prefix-") as cache_dir:
        return measure(args, cache_dir)


def measure(args, cache_dir: str) -> int:
    """The three runs; print the summary line and write the JSON; 1 if tokens differ."""
    from engine import Engine, EngineConfig, SamplingParams, load_model

    loaded = load_model(args.model)
    doc = document(loaded.tokenizer, args.prefix_tokens)
    first = f"{doc}\n\nQuestion: what is this module for?"
    second = f"{doc}\n\nQuestion: which functions does it export?"
    params = SamplingParams(max_tokens=args.gen_tokens, ignore_eos=True)

    cold_engine = Engine(loaded, EngineConfig(prefix_cache=False))
    ids = cold_engine.encode_prompt(second)
    r = cold_engine.generate_text(ids, params)
    cold_tokens, cold = r.tokens, r.stats
    cold_engine.shutdown()
    print(f"cold: {len(ids)} prompt tokens, TTFT {cold.ttft_s:.2f}s", file=sys.stderr)

    engine = Engine(loaded, EngineConfig(disk_cache=True, disk_cache_dir=cache_dir))
    engine.generate_text(engine.encode_prompt(first), params)  # the document, asked once
    r = engine.generate_text(ids, params)
    ram_tokens, ram = r.tokens, r.stats
    engine.shutdown()  # drains the disk writer
    print(f"warm (RAM): {ram.cached_tokens} cached, TTFT {ram.ttft_s:.3f}s", file=sys.stderr)

    fresh = generate_in_fresh_process(second, args.model, args.gen_tokens, cache_dir,
                                      disk_cache=False)
    print(f"cold (new process, disk cache off): TTFT {fresh['ttft_s']:.2f}s", file=sys.stderr)
    disk = generate_in_fresh_process(second, args.model, args.gen_tokens, cache_dir)
    print(f"warm (disk, new process): {disk['cached_tokens']} cached, "
          f"TTFT {disk['ttft_s']:.3f}s", file=sys.stderr)

    # the new-process runs stop at EOS (generate has no --ignore-eos): compare what they made
    def same(tokens: list[int]) -> bool:
        n = min(len(tokens), len(cold_tokens))
        return tokens[:n] == cold_tokens[:n]

    result = {
        "model": loaded.name,
        "prompt_tokens": len(ids),
        "shared_prefix_tokens": ram.cached_tokens,
        "ttft_cold_s": cold.ttft_s,
        "ttft_warm_ram_s": ram.ttft_s,
        "ttft_warm_disk_s": disk["ttft_s"],
        "ratio_ram": cold.ttft_s / ram.ttft_s,
        "ratio_disk": cold.ttft_s / disk["ttft_s"],
        # the restart row: both runs in a new process, the warm one served from disk only
        "ttft_cold_new_process_s": fresh["ttft_s"],
        "disk_restored_tokens": disk["cached_tokens"],
        "ratio_disk_new_process": fresh["ttft_s"] / disk["ttft_s"],
        "cache_source_ram": ram.cache_source,
        "cache_source_disk": disk["cache_source"],
        "cache_source_cold_new_process": fresh["cache_source"],
        "tokens_identical": cold_tokens == ram_tokens and same(disk["tokens"])
        and same(fresh["tokens"]),
    }
    print(f"\nprefix {len(ids)} tokens: TTFT cold {cold.ttft_s:.2f}s | warm RAM "
          f"{ram.ttft_s:.3f}s ({result['ratio_ram']:.1f}x) | warm disk {disk['ttft_s']:.3f}s "
          f"({result['ratio_disk']:.1f}x) | greedy tokens identical: "
          f"{result['tokens_identical']}")
    print(f"restart (new processes): TTFT cold {fresh['ttft_s']:.2f}s | warm from disk "
          f"{disk['ttft_s']:.3f}s, {disk['cached_tokens']} of {len(ids)} tokens restored, "
          f"RAM cache empty ({result['ratio_disk_new_process']:.1f}x)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["tokens_identical"] else 1
