"""`kvchat cache stats | ls | purge | verify`: the disk prefix store from the command line."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from engine.errors import KVChatError

# Inspecting must not evict: the byte budget belongs to the engine that writes.
NO_BUDGET = 1 << 62


def open_store(args):
    from engine.kvcache.disk_store import DiskPrefixStore

    root = Path(args.cache_dir).expanduser() if args.cache_dir else None
    return DiskPrefixStore(root, budget_bytes=NO_BUDGET)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def cmd_stats(args) -> int:
    store = open_store(args)
    entries = store.entries()
    st = store.stats()
    out = {
        "dir": str(store.root),
        "entries": st.entries,
        "bytes": st.bytes,
        "tokens": sum(e.tokens for e in entries),
        "tenants": dict(Counter(e.tenant for e in entries)),
        "models": dict(Counter(e.model[:16] for e in entries)),
        "removed_at_open": st.removed_by_reason,
        "next_expiry": min((e.expires for e in entries), default=None),
    }
    store.close()
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['dir']}: {out['entries']} blocks, {out['tokens']} tokens, "
          f"{out['bytes'] / 2**20:.1f} MiB")
    for tenant, n in sorted(out["tenants"].items()):
        print(f"  tenant {tenant}: {n} blocks")
    for model, n in sorted(out["models"].items()):
        print(f"  model {model}: {n} blocks")
    if out["next_expiry"]:
        print(f"  next expiry {_when(out['next_expiry'])}")
    if out["removed_at_open"]:
        print(f"  removed on open: {out['removed_at_open']}")
    return 0


def cmd_ls(args) -> int:
    store = open_store(args)
    entries = store.entries()
    store.close()
    if args.json:
        print(json.dumps([asdict(e) for e in entries]))
        return 0
    print(f"{'hash':14} {'tenant':10} {'perm':>4} {'model':14} {'tokens':>6} {'KiB':>7} "
          f"{'expires':16} last used")
    for e in entries:
        print(f"{e.hash[:12]:14} {e.tenant[:10]:10} {e.permission_version:>4} {e.model[:12]:14} "
              f"{e.tokens:>6} {e.bytes / 1024:>7.0f} {_when(e.expires):16} {_when(e.last_used)}")
    return 0


def cmd_purge(args) -> int:
    if not (args.tenant or args.model or args.expired or args.all):
        raise KVChatError("purge needs --tenant, --model, --expired or --all")
    store = open_store(args)
    n = store.purge(tenant=args.tenant, model=args.model, expired_only=args.expired,
                    all=args.all)
    store.close()
    print(f"removed {n} entries")
    return 0


def generate_in_fresh_process(prompt: str, model: str | None, max_tokens: int,
                              cache_dir: str) -> dict:
    """`kvchat generate --json` in a new interpreter: nothing in RAM, only the disk store."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt)
    try:
        child = subprocess.run(
            [sys.executable, "-m", "app.cli", "generate", "--json", "--prompt-file", f.name,
             "--model", model or "default", "--max-tokens", str(max_tokens),
             "--cache-dir", cache_dir],
            capture_output=True, text=True, env=dict(os.environ), check=False)
    finally:
        os.unlink(f.name)
    if child.returncode != 0:
        raise KVChatError(f"the fresh process failed: {child.stderr.strip()}")
    return json.loads(child.stdout)


def cmd_verify(args) -> int:
    """Cold, warm from RAM, warm from disk in a fresh process: identical greedy tokens."""
    from engine import Engine, EngineConfig, SamplingParams, load_model

    prompt = Path(args.prompt_file).read_text() if args.prompt_file else args.prompt
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="kvchat-verify-")
    loaded = load_model(args.model)
    params = SamplingParams(max_tokens=args.max_tokens)
    cold_engine = Engine(loaded, EngineConfig(prefix_cache=False))
    ids = cold_engine.encode_prompt(prompt)
    r = cold_engine.generate_text(ids, params)
    cold, s_cold = r.tokens, r.stats
    cold_engine.shutdown()
    engine = Engine(loaded, EngineConfig(disk_cache=True, disk_cache_dir=cache_dir))
    engine.generate_text(ids, params)  # fills RAM and (in the background) the disk store
    r = engine.generate_text(ids, params)
    warm, s_ram = r.tokens, r.stats
    engine.shutdown()  # drains the disk writer
    disk = generate_in_fresh_process(prompt, args.model, args.max_tokens, cache_dir)
    rows = [("cold", cold, "none", s_cold.ttft_s),
            ("warm (RAM)", warm, s_ram.cache_source, s_ram.ttft_s),
            ("warm (disk, new process)", disk["tokens"], disk["cache_source"], disk["ttft_s"])]
    for name, tokens, source, ttft in rows:
        print(f"{name:26} {len(tokens):>4} tokens  cache {source:6}  TTFT {ttft:.3f}s")
    ok = cold == warm == disk["tokens"]
    sources_ok = s_ram.cache_source == "memory" and disk["cache_source"] == "disk"
    if ok and sources_ok:
        print(f"OK: identical greedy tokens; {disk['cached_tokens']} of {len(ids)} prompt tokens "
              f"restored from disk ({cache_dir})")
        return 0
    why = "tokens differ" if not ok else "a warm run did not hit the cache"
    print(f"FAILED: {why}", file=sys.stderr)
    return 1


def add_parser(sub) -> None:
    c = sub.add_parser("cache", help="the disk prefix cache: stats, ls, purge, verify")
    cs = c.add_subparsers(dest="cache_command", required=True)

    def common(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--cache-dir", default=None,
                       help="the store's directory (default ~/.cache/kvchat/prefix)")
        return p

    p = common(cs.add_parser("stats", help="entries, bytes, tenants, models"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_stats)
    p = common(cs.add_parser("ls", help="list entries, most recently used first"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ls)
    p = common(cs.add_parser("purge", help="delete entries"))
    p.add_argument("--tenant", help="only this tenant's entries")
    p.add_argument("--model", help="only entries of this model fingerprint (or a prefix)")
    p.add_argument("--expired", action="store_true", help="only expired entries")
    p.add_argument("--all", action="store_true", help="everything")
    p.set_defaults(func=cmd_purge)
    p = common(cs.add_parser("verify", help="cold == warm (RAM) == warm (disk) greedy tokens"))
    p.add_argument("--model", default=None)
    p.add_argument("--prompt", default="Summarize in one sentence why caches matter. " * 20)
    p.add_argument("--prompt-file", default=None)
    p.add_argument("--max-tokens", type=int, default=24)
    p.set_defaults(func=cmd_verify)
