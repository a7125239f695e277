"""A bounded load test of `kvchat serve`, then a SIGTERM in the middle of another burst.

64 concurrent streaming clients (the official async `openai` client) on a small KV pool
(20M: 28 blocks of 16 tokens, so requests queue for memory); a quarter disconnect at random
points: before the response starts, during the queue or prefill, or after a few tokens.
Afterwards every request completed, was cancelled by its client, or got a clear 4xx, and
/metrics shows no block in use and nothing running or waiting. The figures (requests/s,
P95 TTFT, release latency) are printed; run with ``-s`` to see them.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections import Counter
from pathlib import Path

import openai
import pytest
from openai import AsyncOpenAI
from test_server_process import ServerProcess

from engine.kvcache.disk import entry as disk_entry
from engine.paths import TEMP_MARK

pytestmark = pytest.mark.subprocess  # the server is a real `kvchat serve` process

CLIENTS = 64
DISCONNECT_MODES = ["before_response", "in_prefill", "after_tokens", "after_tokens"]
WORDS = ["river", "stone", "lamp", "cloud", "engine", "garden", "violin", "harbor", "maple",
         "signal"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-load")
    srv = ServerProcess(tmp, "--kv-budget", "20M", "--cache-dir", str(tmp / "prefix"),
                        "--drain-timeout", "3").start()
    srv.cache_dir = tmp / "prefix"
    yield srv
    srv.stop()


def client(server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.url}/v1", api_key="local", max_retries=0, timeout=120)


SYSTEM = ("You are the terse assistant of a load test. Answer every question with a few "
          "words only, and never ask a question back.")  # shared: its blocks are cached


def plan(rng: random.Random) -> list[dict]:
    """Seeded clients: prompt (one in eight long), max_tokens, and whether/where to leave."""
    leave = set(rng.sample(range(CLIENTS), CLIENTS // 4))
    out = []
    for i in range(CLIENTS):
        n = rng.randint(80, 120) if i % 8 == 0 else rng.randint(3, 12)
        text = f"Client {i}: " + " ".join(rng.choice(WORDS) for _ in range(n))
        out.append({"i": i, "messages": [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": text}],
                    "max_tokens": rng.randint(3, 8),
                    "leave": rng.choice(DISCONNECT_MODES) if i in leave else None,
                    "after": rng.randint(1, 2), "delay": rng.uniform(0.01, 0.3)})
    return out


async def run_client(c: AsyncOpenAI, p: dict, t0: float) -> dict:
    """One streaming client; returns its outcome and time to first token."""
    out = {"outcome": None, "ttft": None, "leave": p["leave"]}
    create = c.chat.completions.create(model="kvchat", messages=p["messages"],
                                       max_tokens=p["max_tokens"], temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    try:
        if p["leave"] == "before_response":
            try:  # the request is sent; the client gives up before the response starts
                stream = await asyncio.wait_for(create, timeout=p["delay"])
            except asyncio.TimeoutError:
                out["outcome"] = "cancelled"
                return out
        else:
            stream = await create
        tokens, usage = 0, None
        async for chunk in stream:
            if p["leave"] == "in_prefill":
                break  # the role chunk is here, no token yet: queued or prefilling
            if chunk.choices and chunk.choices[0].delta.content:
                tokens += 1
                out["ttft"] = out["ttft"] or time.perf_counter() - t0
                if p["leave"] == "after_tokens" and tokens >= p["after"]:
                    break
            usage = chunk.usage or usage
        await stream.close()
        if p["leave"] in ("in_prefill", "after_tokens") and usage is None:
            out["outcome"] = "cancelled"
        else:
            assert usage is not None and usage.completion_tokens >= 1, "no usage at the end"
            out["outcome"] = "completed"
    except openai.APIStatusError as e:
        assert 400 <= e.status_code < 500, f"{e.status_code}: {e.message}"
        out["outcome"] = f"http_{e.status_code}"
    return out


def rss(m: dict) -> float:
    return m["process_resident_memory_bytes"] / 2**20

def test_without_keys_other_hosts_and_cross_site_origins_are_refused(server):
    """DNS rebinding (a foreign Host) and a web page's cross-site POST get a 403; a client
    with no Origin, or a page served from localhost, is served."""
    import httpx

    url = f"{server.url}/v1/completions"
    body = {"prompt": "Hello", "max_tokens": 1}
    for headers in ({"Host": "attacker.example"}, {"Host": "attacker.example:8000"},
                    {"Origin": "https://attacker.example"}, {"Origin": "null"},
                    {"Origin": "http://127.0.0.1.attacker.example"}):
        r = httpx.post(url, json=body, headers=headers, timeout=60)
        assert r.status_code == 403, (headers, r.text)
        assert r.json()["error"]["type"] == "permission_error"
    for headers in ({}, {"Origin": "http://localhost:3000"}, {"Origin": "http://127.0.0.1"}):
        r = httpx.post(url, json=body, headers=headers, timeout=60)
        assert r.status_code == 200, (headers, r.text)
    assert server.wait_idle()['kvchat_kv_blocks{state="used"}'] == 0



async def test_64_clients_a_quarter_disconnecting(server):
    c = client(server)
    warm = await c.chat.completions.create(model="kvchat", max_tokens=4, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Warm up."}])
    assert warm.usage.completion_tokens >= 1
    idle = server.wait_idle()
    t0 = time.perf_counter()
    results = await asyncio.gather(*[run_client(c, p, time.perf_counter())
                                     for p in plan(random.Random(14))])
    wall = time.perf_counter() - t0
    await c.close()
    outcomes = Counter(r["outcome"] for r in results)
    assert set(outcomes) <= {"completed", "cancelled", "http_429"}, outcomes
    assert outcomes["completed"] >= CLIENTS // 2 and outcomes["cancelled"] >= 1
    m = server.wait_idle()
    assert m['kvchat_kv_blocks{state="used"}'] == 0
    assert m['kvchat_requests{state="running"}'] == 0
    assert m['kvchat_requests{state="waiting"}'] == 0
    assert m["kvchat_client_disconnects_total"] >= 1
    assert rss(m) < rss(idle) * 1.3 + 64, (rss(idle), rss(m))  # memory back near idle
    ttfts = sorted(r["ttft"] for r in results if r["outcome"] == "completed" and r["ttft"])
    p95 = ttfts[max(0, int(0.95 * len(ttfts)) - 1)]
    release = [m[f'kvchat_cancel_release_latency_ms{{quantile="{v}"}}'] for v in ("0.5", "0.95")]
    ttft95 = m['kvchat_ttft_seconds{quantile="0.95"}']
    print(f"\n[serve load] {CLIENTS} clients in {wall:.1f} s: {dict(outcomes)}; "
          f"{outcomes['completed'] / wall:.2f} completed requests/s; "
          f"client P95 TTFT {p95:.2f} s; server P95 TTFT {ttft95:.2f} s; "
          f"cancel release latency P50/P95 {release[0]:.1f}/{release[1]:.1f} ms "
          f"({m['kvchat_cancel_release_latency_ms_samples']:.0f} cancels); "
          f"preemptions {m['kvchat_preemptions_total']:.0f}; disconnects "
          f"{m['kvchat_client_disconnects_total']:.0f}; RSS {rss(idle):.0f} -> {rss(m):.0f} MiB")


async def test_sigterm_during_load_exits_0_with_no_half_written_entry(server):
    c = client(server)
    started = asyncio.Event()
    count = Counter()

    async def one(i: int) -> str:
        text = f"Burst {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(40))
        try:
            stream = await c.chat.completions.create(
                model="kvchat", messages=[{"role": "user", "content": text}], max_tokens=12,
                temperature=0, stream=True)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    count["tokens"] += 1
                    if count["tokens"] >= 3:
                        started.set()
            return "completed"
        except (openai.APIError, openai.APIConnectionError) as e:
            return type(e).__name__  # "the server is shutting down", or the connection went

    tasks = [asyncio.ensure_future(one(i)) for i in range(16)]
    await asyncio.wait_for(started.wait(), timeout=120)
    status = await asyncio.to_thread(server.stop, signal.SIGTERM, 60)
    ends = Counter(await asyncio.gather(*tasks))
    await c.close()
    log = server.log()
    assert status == 0, log
    assert "stopped: 0 blocks in use" in log, log
    assert set(ends) <= {"completed", "APIError", "APIConnectionError"}, ends
    root = Path(server.cache_dir)
    files = [p for p in root.rglob("*") if p.is_file()]
    assert not [p for p in files if TEMP_MARK in p.name]  # no write left half-done
    entries = [p for p in files if p.suffix == ".kvb"]
    assert entries, "the load wrote no prefix block to disk"
    for p in entries:  # each one whole: its checksum over header and payload holds
        disk_entry.decode_entry(bytearray(p.read_bytes()))
    print(f"\n[serve sigterm] exit {status}; clients {dict(ends)}; {len(entries)} disk entries")

