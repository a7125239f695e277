"""`kvchat serve` as a real process: the harness the server tests share, and start-up refusals.

The refusals (a keys file that is not 0600, no keys on a non-loopback address, a busy
port) all come before the model loads, so these tests are quick.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

LISTENING = re.compile(r"kvchat serve: listening on (http://\S+)")


class ServerProcess:
    """`python -m app serve --port 0 ...` in a subprocess, its output in a log file."""

    def __init__(self, tmp_path: Path, *args: str):
        self.log_path = tmp_path / "server.log"
        self.args = ["serve", "--port", "0", *args]
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.preexec_fn = None  # run in the child before the server (e.g. lower its limits)

    def start(self, timeout: float = 180.0) -> ServerProcess:
        # a file, not a pipe: nobody has to keep reading it for the server to go on
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "app", *self.args],
                                         stdout=log, stderr=subprocess.STDOUT,
                                         env=dict(os.environ), preexec_fn=self.preexec_fn)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = LISTENING.search(self.log())
            if found:
                self.url = found.group(1)
                return self
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.1)
        raise AssertionError(f"the server did not start in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """/metrics as {'name{label="v",...}': value} (labels sorted)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Metrics once nothing runs, waits or holds a block (or the last ones seen)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m['kvchat_requests{state="running"}'] == 0
                    and m['kvchat_requests{state="waiting"}'] == 0
                    and m['kvchat_kv_blocks{state="used"}'] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Send ``sig`` and wait for the exit status."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the server did not exit on {sig}:\n{self.log()}") from None


def write_keys(path: Path, table: dict, mode: int = 0o600) -> Path:
    """A keys file with exactly ``mode`` (rewritten in place: SIGHUP tests reuse it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(table))
    os.chmod(path, mode)
    return path


def refused(capsys, *argv: str) -> str:
    """Run ``kvchat`` in-process (each refusal comes before the model loads): its one line."""
    from app.cli import main

    assert main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvchat: error:"), lines
    return lines[0]


def test_keys_file_not_0600_is_refused(tmp_path, capsys):
    keys = write_keys(tmp_path / "keys.json", {"k" * 16: {"tenant": "a"}}, mode=0o640)
    assert "mode 0600" in refused(capsys, "serve", "--api-keys", str(keys))


def test_bad_keys_file_is_refused(tmp_path, capsys):
    keys = write_keys(tmp_path / "keys.json", {"short": {"tenant": "a"}})
    assert "at least 8" in refused(capsys, "serve", "--api-keys", str(keys))
    missing = str(tmp_path / "missing.json")
    assert "cannot read the keys file" in refused(capsys, "serve", "--api-keys", missing)


def test_no_keys_refuses_a_non_loopback_host(capsys):
    assert "not a loopback address" in refused(capsys, "serve", "--host", "0.0.0.0")


def test_busy_port_fails_before_the_model_loads(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = refused(capsys, "serve", "--port", str(port))
    assert f"cannot listen on 127.0.0.1:{port}" in line


@pytest.mark.parametrize("flag,value", [("--port", "70000"), ("--max-waiting", "0"),
                                        ("--drain-timeout", "-1"), ("--log-level", "loud"),
                                        ("--read-timeout", "0"), ("--max-connections", "0")])
def test_bad_flags_are_one_line(capsys, flag, value):
    assert flag in refused(capsys, "serve", flag, value)
