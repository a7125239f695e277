#!/usr/bin/env bash
# The heavier 2-rank checks of `--distributed` on one machine (localhost, ring backend), with
# the embedded default model (30 layers: a 15/15 pipeline split). The suite's focused test is
# tests/test_distributed.py; this adds, in a few minutes on 2 cores:
#   1. kvchat generate: one process vs 2 ranks under mlx.launch, greedy tokens identical, for
#      a short prompt and a prompt longer than a prefill chunk; tok/s and bytes/token of each
#   2. --parallel tensor on this model: a clear error (3 KV heads do not divide by 2)
#   3. a hung rank 1 (SIGSTOP) and a killed rank 1: rank 0 exits 3 within --dist-timeout
#   4. kvchat serve --distributed: a stream cut mid-answer, SIGTERM: every block free on both
# Usage: scripts/distributed_check.sh [OUT_DIR]   (results also in OUT_DIR/summary.json)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${TMPDIR:-/tmp}/kvchat-distributed-check}
mkdir -p "$OUT"
export OUT
exec nice .venv/bin/python - <<'PY'
import http.client
import inspect
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, ".")
from engine.distributed.launch import free_ports, spawn_local, write_hostfile  # noqa: E402

OUT = Path(os.environ["OUT"])
KV = ".venv/bin/kvchat"
LAUNCH = [".venv/bin/mlx.launch", "-n", "2", "--backend", "ring"]
summary, failures = {}, []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def generate(tag, prompt_args, *, distributed):
    cmd = [KV, "generate", *prompt_args, "--max-tokens", "64", "--json", "--no-disk-cache"]
    if distributed:
        cmd = LAUNCH + cmd + ["--distributed"]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    (OUT / f"{tag}.err").write_text(p.stderr)
    if p.returncode != 0:
        check(False, f"{tag}: exit {p.returncode}: {p.stderr[-400:]}")
        return None
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["wall_s"] = time.perf_counter() - t
    out["rank_lines"] = [ln for ln in p.stderr.splitlines() if ": rank " in ln]
    return out


# 1. greedy parity and throughput, 1 process vs 2 ranks
doc = OUT / "long_prompt.txt"  # past one 512-token prefill chunk: chunked prefill on the ranks
doc.write_text("Summarize what this code does:\n\n" + inspect.getsource(textwrap)[:3600])
cases = {"short": ["--prompt", "Explain what a KV cache is in one paragraph."],
         "long": ["--prompt-file", str(doc), "--raw"]}
for name, args in cases.items():
    one = generate(f"{name}-1rank", args, distributed=False)
    two = generate(f"{name}-2ranks", args, distributed=True)
    if not (one and two):
        continue
    check(one["tokens"] == two["tokens"],
          f"{name} prompt ({one['prompt_tokens']} tokens): 15/15 greedy tokens identical "
          f"({len(one['tokens'])} generated)")
    check(two["kv"]["bytes_per_token"] * 2 == one["kv"]["bytes_per_token"],
          f"rank 0 pool {two['kv']['bytes_per_token']} B/token = half of "
          f"{one['kv']['bytes_per_token']}")
    summary[name] = {k: {"prefill_tps": r["prefill_tps"], "decode_tps": r["decode_tps"],
                         "ttft_s": r["ttft_s"], "bytes_per_token": r["kv"]["bytes_per_token"],
                         "wall_s": r["wall_s"], "ranks": r["rank_lines"]}
                     for k, r in (("1 rank", one), ("2 ranks", two))}
    for line in two["rank_lines"]:
        print("     " + line)
    print(f"     tok/s prefill {one['prefill_tps']:.1f} -> {two['prefill_tps']:.1f}, "
          f"decode {one['decode_tps']:.1f} -> {two['decode_tps']:.1f}")

# 2. tensor parallel on a model whose KV heads do not divide
p = subprocess.run(LAUNCH + [KV, "generate", "--distributed", "--parallel", "tensor",
                             "--max-tokens", "4"], capture_output=True, text=True)
# (mlx.launch itself exits 0 here: it reports "Node with rank 0 exited with code 2")
check("KV heads (3)" in p.stderr and "--parallel pipeline" in p.stderr
      and "rank 0 exited with code 2" in p.stderr, "tensor parallel on 3 KV heads: a clear error")


# 3. a hung rank and a killed rank
def lost_rank(how, timeout=10):
    hostfile = write_hostfile(OUT / "hosts.json", 2)
    cmd = [KV, "generate", "--distributed", "--prompt", "Tell me a very long story.",
           "--max-tokens", "2000", "--dist-timeout", str(timeout), "--no-disk-cache"]
    procs = spawn_local(cmd, 2, hostfile, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        text=True)
    try:
        # wait for streamed text: the run is decoding
        os.set_blocking(procs[0].stdout.fileno(), False)
        t0 = time.monotonic()
        while not procs[0].stdout.read(1) and time.monotonic() - t0 < 180:
            time.sleep(0.2)
        time.sleep(1.0)
        procs[1].send_signal(signal.SIGSTOP if how == "hung" else signal.SIGKILL)
        t = time.monotonic()
        _, err = procs[0].communicate(timeout=timeout + 60)
        took = time.monotonic() - t
    finally:
        for q in procs:
            q.kill()
            q.wait()
    line = (err.strip().splitlines() or [""])[-1]
    check(procs[0].returncode == 3 and took <= timeout + 2 and "distributed (rank 0)" in line,
          f"{how} rank 1: rank 0 exit {procs[0].returncode} after {took:.1f} s "
          f"(timeout {timeout} s)")
    print("     " + line)
    summary[f"{how}_rank"] = {"exit": procs[0].returncode, "after_s": took, "error": line}


lost_rank("hung")
lost_rank("killed")

# 4. serve: a stream cut mid-answer, a whole answer, SIGTERM
hostfile = write_hostfile(OUT / "hosts.json", 2)
port = free_ports(1)[0]
procs = spawn_local([KV, "serve", "--distributed", "--port", str(port), "--no-disk-cache",
                     "--kv-budget", "256M"], 2, hostfile,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def request(path, body=None, timeout=120):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    if body is None:
        c.request("GET", path)
    else:
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return c, c.getresponse()


try:
    t0 = time.monotonic()
    while time.monotonic() - t0 < 180:
        try:
            if request("/health", timeout=5)[1].status == 200:
                break
        except OSError:
            time.sleep(0.5)
    chat = {"model": "default", "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 400, "temperature": 0}
    c, r = request("/v1/chat/completions", dict(chat, stream=True))
    chunks = 0
    for line in r:
        chunks += line.startswith(b"data:")
        if chunks >= 5:
            break
    c.close()  # the disconnect cancels the request on rank 0: its blocks leave every rank
    time.sleep(2)
    _, r = request("/v1/chat/completions", dict(chat, max_tokens=16))
    check(r.status == 200 and json.loads(r.read())["choices"][0]["message"]["content"],
          "serve: an answer after a stream cut mid-answer")
finally:
    procs[0].send_signal(signal.SIGTERM)
    outs = []
    for q in procs:
        try:
            outs.append(q.communicate(timeout=90))
        except subprocess.TimeoutExpired:
            q.kill()
            outs.append(q.communicate())
err = outs[0][1]
ranks = [ln for ln in err.splitlines() if "kvchat serve: rank " in ln]
check(procs[0].returncode == 0 and procs[1].returncode == 0 and len(ranks) == 2
      and all(" 0 used" in ln and " 0 outside" in ln for ln in ranks),
      "serve: SIGTERM drains, both ranks end with 0 blocks used")
for line in ranks:
    print("     " + line)
summary["serve"] = {"exit": [q.returncode for q in procs], "ranks": ranks}

(OUT / "summary.json").write_text(json.dumps(summary, indent=1))
print(f"results: {OUT / 'summary.json'}")
sys.exit(1 if failures else 0)
PY
