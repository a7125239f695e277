"""`kvchat cache stats | ls | purge | ttl | verify`: the disk prefix store from the command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from app import arg_types
from app.fresh_process import generate_in_fresh_process
from engine.errors import KVChatError

# Inspecting must not evict: the byte budget belongs to the engine that writes.
NO_BUDGET = 1 << 62
MAX_VERIFY_PROMPT_BYTES = 1 << 20


def open_store(args, *, warn: bool = True, **kw):
    """The store at ``--cache-dir``; its ``degraded`` reason, if any, goes to stderr once."""
    from engine.kvcache.disk.store import DiskPrefixStore

    root = Path(args.cache_dir).expanduser() if args.cache_dir else None
    store = DiskPrefixStore(root, budget_bytes=NO_BUDGET, **kw)
    if store.degraded and warn:
        print(f"kvchat: warning: {store.degraded}", file=sys.stderr)
    return store


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def _span(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


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
        "tenant_ttl_s": store.ttls.by_tenant,
        "write_errors": st.write_errors,
        "degraded": store.degraded,
        "state": store.state,  # on / read-only / off (why: degraded)
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
    for tenant, ttl in sorted(out["tenant_ttl_s"].items()):
        print(f"  tenant {tenant}: TTL {_span(ttl)}")
    if out["next_expiry"]:
        print(f"  next expiry {_when(out['next_expiry'])}")
    if out["removed_at_open"]:
        print(f"  removed on open: {out['removed_at_open']}")
    print(f"  write errors: {out['write_errors']}")
    return 0


def _sessions(store) -> list:
    from app.documents.sessions import SessionRegistry

    return sorted(SessionRegistry(store.root).load().values(), key=lambda x: x.created)


def cmd_ls(args) -> int:
    store = open_store(args)
    entries = store.entries()
    sessions = _sessions(store)
    store.close()
    if args.json:
        print(json.dumps({"entries": [asdict(e) for e in entries],
                          "sessions": [asdict(x) for x in sessions]}))
        return 0
    print(f"{'hash':14} {'tenant':10} {'perm':>4} {'model':14} {'tokens':>6} {'KiB':>7} "
          f"{'expires':16} last used")
    for e in entries:
        print(f"{e.hash[:12]:14} {e.tenant[:10]:10} {e.permission_version:>4} {e.model[:12]:14} "
              f"{e.tokens:>6} {e.bytes / 1024:>7.0f} {_when(e.expires):16} {_when(e.last_used)}")
    if sessions:
        print(f"\ndocument sessions ({len(sessions)}):")
        print(f"{'name':28} {'documents':32} {'tokens':>7} {'blocks':>6} {'asked':>5} expires")
        now = time.time()
        for x in sessions:
            docs = ", ".join(d["name"] for d in x.documents)
            state = "expired" if x.expired(now) else _when(x.expires)
            print(f"{x.name[:28]:28} {docs[:32]:32} {x.prefix_tokens:>7} "
                  f"{len(x.block_hashes):>6} {x.questions:>5} {state}")
    return 0


def _writable_store(args):
    # Expired entries stay indexed at open, so the command that deletes them counts them.
    store = open_store(args, warn=False, expire_at_open=False)
    if store.degraded:  # the error says why: no warning line before it
        store.close()
        raise KVChatError(f"nothing changed: {store.degraded}")
    return store


def cmd_purge(args) -> int:
    if args.permission_below is not None and args.tenant is None:
        raise KVChatError("--permission-below needs --tenant (permission versions are per tenant)")
    if not (args.tenant or args.model or args.expired or args.all or args.session):
        raise KVChatError("purge needs --session, --tenant, --model, --expired, "
                          "--permission-below or --all")
    if args.session and (args.tenant or args.model or args.all or args.permission_below):
        raise KVChatError("--session cannot be combined with other filters")
    from app.documents.sessions import SessionRegistry

    store = _writable_store(args)
    registry = SessionRegistry(store.root)
    if args.session:
        gone = registry.remove(args.session)
        if gone is None:
            store.close()
            raise KVChatError(f"no document session named {args.session!r} "
                              "(`kvchat cache ls` lists them)")
        n = store.remove([bytes.fromhex(h) for h in gone.block_hashes])
        store.close()
        print(f"removed session {gone.name!r} and its {n} entries")
        return 0
    n = store.purge(tenant=args.tenant, model=args.model, expired_only=args.expired,
                    all=args.all, permission_below=args.permission_below)
    if args.expired:
        registry.sweep()
    elif args.all:
        for name in list(registry.load()):
            registry.remove(name)
    at_open = store.stats().removed_by_reason  # unreadable entries and stale temp files
    store.close()
    print(f"removed {n} entries")
    if at_open:
        print(f"  also removed on open: {at_open}")
    return 0


def cmd_ttl(args) -> int:
    """Show the per-tenant TTLs, or set / clear one (saved with the store for every engine)."""
    if args.ttl is None and not args.clear:
        store = open_store(args)
        ttls = store.ttls.by_tenant
        store.close()
        if args.json:
            print(json.dumps(ttls))
            return 0
        for tenant, ttl in sorted(ttls.items()):
            print(f"tenant {tenant}: {_span(ttl)}")
        if not ttls:
            print("no tenant TTLs: entries live as long as the engine's default TTL")
        return 0
    if args.tenant is None:
        raise KVChatError("setting a TTL needs --tenant")
    store = _writable_store(args)
    n = store.set_tenant_ttl(args.tenant, None if args.clear else args.ttl)
    store.close()
    what = "the default" if args.clear else _span(args.ttl)
    print(f"tenant {args.tenant}: TTL {what}; removed {n} entries older than that")
    return 0


def cmd_verify(args) -> int:
    """Cold, warm from RAM, warm from disk in a fresh process: identical greedy tokens."""
    if args.prompt_file:
        prompt = arg_types.read_text_file(args.prompt_file, MAX_VERIFY_PROMPT_BYTES)
    else:
        prompt = args.prompt
    with contextlib.ExitStack() as cleanup:  # a temporary store is removed however we leave
        cache_dir = args.cache_dir or cleanup.enter_context(
            tempfile.TemporaryDirectory(prefix="kvchat-verify-"))
        return _verify(args, prompt, cache_dir, temporary=not args.cache_dir)


def _verify(args, prompt: str, cache_dir: str, *, temporary: bool) -> int:
    from engine import Engine, EngineConfig, SamplingParams, load_model

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
        where = "a temporary store, now removed" if temporary else cache_dir
        print(f"OK: identical greedy tokens; {disk['cached_tokens']} of {len(ids)} prompt tokens "
              f"restored from disk ({where})")
        return 0
    why = "tokens differ" if not ok else "a warm run did not hit the cache"
    print(f"FAILED: {why}", file=sys.stderr)
    return 1


def add_parser(sub) -> None:
    c = sub.add_parser("cache", help="the disk prefix cache: stats, ls, purge, ttl, verify")
    cs = c.add_subparsers(dest="cache_command", required=True)

    def common(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--cache-dir", default=None,
                       help="the store's directory (default ~/.cache/kvchat/prefix)")
        return p

    p = common(cs.add_parser("stats", help="entries, bytes, tenants, models, write errors"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_stats)
    p = common(cs.add_parser("ls", help="list entries (newest use first) and document sessions"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ls)
    p = common(cs.add_parser("purge", help="delete entries"))
    p.add_argument("--tenant", type=arg_types.tenant, help="only this tenant's entries")
    p.add_argument("--model", type=arg_types.non_empty,
                   help="only entries of this model fingerprint (or a prefix)")
    p.add_argument("--permission-below", type=arg_types.int_in(1, (1 << 63) - 1), metavar="N",
                   help="only the tenant's entries of permission versions below N (with --tenant)")
    p.add_argument("--expired", action="store_true", help="only expired entries")
    p.add_argument("--all", action="store_true", help="everything")
    p.add_argument("--session", type=arg_types.non_empty, metavar="NAME",
                   help="a document session and its blocks (`kvchat ask --session`)")
    p.set_defaults(func=cmd_purge)
    p = common(cs.add_parser(
        "ttl", help="per-tenant lifetimes of cached blocks, kept with the store",
        description="Without SECONDS: list the tenant TTLs. With --tenant and SECONDS (or 90m, "
                    "12h, 7d): every engine using this directory writes the tenant's blocks with "
                    "that lifetime, and older blocks of the tenant are deleted now."))
    p.add_argument("--tenant", type=arg_types.tenant, help="the tenant to set or clear")
    what = p.add_mutually_exclusive_group()
    what.add_argument("ttl", nargs="?", type=arg_types.duration, metavar="SECONDS",
                      help="the lifetime: seconds, or with a unit s, m, h, d")
    what.add_argument("--clear", action="store_true", help="back to the engine's default TTL")
    p.add_argument("--json", action="store_true", help="list as one JSON object")
    p.set_defaults(func=cmd_ttl)
    p = common(cs.add_parser("verify", help="cold == warm (RAM) == warm (disk) greedy tokens"))
    p.add_argument("--model", default=None)
    p.add_argument("--prompt", default="Summarize in one sentence why caches matter. " * 20)
    p.add_argument("--prompt-file", type=arg_types.regular_file, default=None)
    p.add_argument("--max-tokens", type=arg_types.int_in(1, 4096), default=24)
    p.set_defaults(func=cmd_verify)
