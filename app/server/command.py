"""`kvchat serve`: flags, the listening socket, the engine, uvicorn, signals, the final check.

Start-up refuses what would be unsafe before the slow model load: a keys file that is
not 0600, or no keys file on a non-loopback address (anyone on the network would be the
local tenant). SIGTERM (and Ctrl+C) stop accepting, let in-flight requests finish until
``--drain-timeout`` and cancel the rest, stop the engine (which drains the disk-cache
writer) and exit 0 with every block free; SIGHUP reloads the keys file.
"""

from __future__ import annotations

import argparse
import ipaddress
import socket

from app import arg_types
from app.context_policy import add_context_args
from app.disk_state import disk_reason
from app.distributed import add_distributed_args
from app.engine_args import add_engine_args, build_engine, check_kv_budget
from app.engine_config import config_from_args
from app.server import native_heap
from app.server.log import log
from engine.errors import KVChatError


def add_parser(sub) -> None:
    """Register ``serve`` on the CLI's subparsers object."""
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (Starlette + uvicorn)",
                       description="Serve /v1/chat/completions, /v1/completions, /v1/models, "
                                   "/health and /metrics over one engine.")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (127.0.0.1; another needs --api-keys)")
    p.add_argument("--port", metavar="N", type=arg_types.int_in(0, 65535), default=8000,
                   help="TCP port (8000; 0 picks a free one and prints it)")
    p.add_argument("--api-keys", metavar="FILE", default=None,
                   help='JSON {"<key>": {"tenant": ..., "permission_version": N}}, mode 0600; '
                        "without it every request is the local tenant")
    p.add_argument("--max-waiting", metavar="N", type=arg_types.positive_int, default=64,
                   help="requests queued for admission before new ones get a 429 (64)")
    p.add_argument("--max-running", metavar="N", type=arg_types.positive_int, default=16,
                   help="sequences prefilling or decoding at once (16)")
    p.add_argument("--prefill-chunk", metavar="N", type=arg_types.int_in(16, 8192), default=512,
                   help="prompt tokens per prefill step; smaller bounds how long a cancel "
                        "and the other streams wait on a long prompt (512)")
    p.add_argument("--default-max-tokens", metavar="N", type=arg_types.positive_int, default=512,
                   help="max_tokens of a request that sets none (512)")
    p.add_argument("--max-n", metavar="N", type=arg_types.int_in(1, 128), default=8,
                   help="answers one request may ask for (n); they share the prompt's "
                        "blocks (8)")
    p.add_argument("--drain-timeout", metavar="SECONDS", type=arg_types.int_in(0, 3600), default=30,
                   help="seconds in-flight requests may finish after SIGTERM (30)")
    p.add_argument("--read-timeout", metavar="SECONDS", type=arg_types.int_in(1, 3600),
                   default=30, help="seconds a client has to send a request's headers, and "
                                    "again its body, before a 408 closes the connection (30)")
    p.add_argument("--max-connections", metavar="N", type=arg_types.int_in(1), default=None,
                   help="connections open at once; past it the longest idle one is closed "
                        "(default and most: the open-file limit less an eighth)")
    p.add_argument("--log-level", choices=["warning", "info", "debug"], default="warning",
                   help="uvicorn's log level; info logs every request (warning)")
    add_context_args(p, default="error",
                     budget_help="prompt tokens a chat request may take before the policy "
                                 "applies (default: the context less its max_tokens)")
    add_engine_args(p)
    add_distributed_args(p)
    p.set_defaults(func=run)


def check_host(host: str, keys_required: bool) -> None:
    """Without API keys, only loopback: every address ``host`` resolves to must be one."""
    if keys_required:
        return
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError as e:
        raise KVChatError(f"cannot resolve --host {host}: {e}") from None
    if not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise KVChatError(f"--host {host} is not a loopback address: without --api-keys the "
                          "server runs as the single local tenant and serves loopback only")


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so a busy port fails fast."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise KVChatError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / Ctrl+C; 0 when every block came back."""
    from app.distributed import rank_lines, run_if_worker
    from app.server.keys import KeyStore

    worker_status = run_if_worker(args)  # --distributed, ranks other than 0: no socket
    if worker_status is not None:
        return worker_status

    keys = KeyStore(args.api_keys)  # a bad or non-0600 file: one line, before the load
    check_host(args.host, keys.required)
    check_kv_budget(config_from_args(args).kv_budget_bytes)
    sock = bind(args.host, args.port)
    native_heap.tune()  # before the load: every big block after it is mapped, not carved
    try:
        engine = build_engine(args, max_running=args.max_running,
                              prefill_chunk=args.prefill_chunk)
    except BaseException:
        sock.close()
        raise
    for notice in engine.notices:
        log(f"note: {notice}")
    if (m := engine.metrics()).disk_warning:  # a directory it cannot use: say so, and why
        log(f"disk prefix cache {m.disk_state or 'off'}: {disk_reason(m)}")
    try:
        from app.server.runner import serve  # uvicorn and starlette: only for `serve`

        serve(args, engine, keys, sock)
    finally:
        engine.shutdown()  # idempotent: the app's lifespan normally did it
        sock.close()
    m = engine.metrics()
    log(f"stopped: {m.blocks_used} blocks in use, {m.blocks_cached} cached, "
        f"{m.blocks_free} free of {m.blocks_total}; disk cache {m.disk_entries} entries"
        + (f", {m.disk_write_errors} write errors" if m.disk_write_errors else ""))
    for line in rank_lines(engine):
        log(line)
    return 0 if m.blocks_used == 0 and m.running == 0 else 1
