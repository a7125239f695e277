"""Connections nobody finishes (issue 33 items 8 and 13): real `kvchat serve` processes, real
sockets.

- Idle sockets that never send a request used to stay open for good: ~2,050 of them, no
  key needed, used up the server's 2,048 file descriptors and locked every client out.
  Here the server runs under an open-file limit of 160 and gets 220 idle sockets; a good
  client is still served, and the server holds no more than its cap.
- A connection that sends nothing, or its headers a byte at a time, is closed with a 408
  at ``--read-timeout``.
- An authenticated request whose body never ends (declared longer than sent, or chunks
  dripping forever) gets a 408 in OpenAI's shape and the connection closes; a body over
  the size limit gets a 413 and the connection closes too, without reading the rest.
"""

from __future__ import annotations

import itertools
import json
import resource
import socket
import time

import httpx
import pytest
from test_server_process import ServerProcess, write_keys

pytestmark = pytest.mark.subprocess

KEY = "conn-test-key-0123456789"
READ_TIMEOUT = 2
NOFILE = 160  # the server's soft and hard open-file limit in the lock-out test
IDLE = 220


def lower_nofile() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-conn")
    keys = write_keys(tmp / "keys.json", {KEY: {"tenant": "a"}})
    srv = ServerProcess(tmp, "--api-keys", str(keys), "--kv-budget", "20M", "--no-disk-cache",
                        "--read-timeout", str(READ_TIMEOUT))
    srv.preexec_fn = lower_nofile
    srv.start(timeout=600)  # the first server of a session builds the CPU extension
    yield srv
    assert srv.stop() == 0, srv.log()


def address(srv) -> tuple[str, int]:
    host, port = srv.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def good_request(srv, timeout: float = 30) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/chat/completions", timeout=timeout,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})


def until_closed(sock: socket.socket, timeout: float = 10 * READ_TIMEOUT) -> bytes:
    """Everything the server sends until it closes; fails if it keeps the socket open."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        raise AssertionError(f"still open after {timeout} s; got {data[:200]!r}") from None
    except ConnectionResetError:
        pass
    return data


def error_of(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"connection: close" in head.lower(), head
    return status, json.loads(body)["error"]


def is_closed(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(65536) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_idle_sockets_past_the_open_file_limit_do_not_lock_out_a_client(server):
    idle = []
    try:
        for _ in range(IDLE):  # more than the server has file descriptors
            idle.append(socket.create_connection(address(server)))
        r = good_request(server)
        assert r.status_code == 200, r.text
        cap = NOFILE - 64  # `connections.max_connections`: an eighth, at least 64, kept back
        # the server closes the excess as it accepts them; on a loaded machine that takes
        # longer than a fixed pause (a full-suite run saw 104 of 96 still open after 0.2 s)
        deadline = time.monotonic() + 5.0
        while (still_open := sum(not is_closed(s) for s in idle)) > cap and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        print(f"\n{IDLE} idle sockets: {still_open} still open, cap {cap}")
        assert still_open <= cap
    finally:
        for s in idle:
            s.close()
    assert good_request(server).status_code == 200


def test_a_silent_connection_gets_a_408_and_is_closed(server):
    with socket.create_connection(address(server)) as s:
        status, error = error_of(until_closed(s))
    assert status == 408 and error["code"] == "request_timeout"


def drip(sock: socket.socket, pieces, every_s: float = 0.2) -> bytes:
    """Send the next of ``pieces`` every ``every_s`` until the server closes the connection;
    what it sent back (maybe nothing: a reset can drop it). Fails if the pieces run out, or
    if the server keeps the connection open past ten read timeouts."""
    deadline = time.monotonic() + 10 * READ_TIMEOUT
    data = b""
    sock.settimeout(every_s)
    for piece in pieces:
        assert time.monotonic() < deadline, "a slow client kept the connection open"
        try:
            sock.sendall(piece)
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return data
        if not chunk:
            return data
        data += chunk
    raise AssertionError("the whole slow request went through")


def test_headers_sent_a_byte_at_a_time_do_not_keep_a_connection_open(server):
    request = (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
               + b"\r\nX-Slow: " + b"a" * 300 + b"\r\n\r\n")  # 60 s at 0.2 s a byte
    with socket.create_connection(address(server)) as s:
        drip(s, (request[i : i + 1] for i in range(len(request))))


def post_head(path: str, extra: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\n{extra}\r\n").encode()


def test_a_body_that_never_ends_gets_a_408_and_a_good_client_is_served(server):
    with socket.create_connection(address(server)) as s:
        s.sendall(post_head("/v1/chat/completions", "Content-Length: 1000\r\n") + b'{"mess')
        r = good_request(server)  # served while the body is awaited
        assert r.status_code == 200, r.text
        status, error = error_of(until_closed(s))
    assert status == 408 and error["code"] == "request_timeout"
    assert error["type"] == "invalid_request_error"


def test_chunks_dripping_forever_get_a_408(server):
    with socket.create_connection(address(server)) as s:
        s.sendall(post_head("/v1/completions", "Transfer-Encoding: chunked\r\n"))
        answer = drip(s, itertools.repeat(b"1\r\n \r\n"))  # each read quick, the body endless
    if answer:  # else a reset overtook it
        status, error = error_of(answer)
        assert status == 408 and error["code"] == "request_timeout"


def test_a_body_over_the_limit_gets_a_413_and_the_connection_closes(server):
    with socket.create_connection(address(server)) as s:
        s.sendall(post_head("/v1/chat/completions", f"Content-Length: {9 << 20}\r\n")
                  + b"x" * 1000)
        status, error = error_of(until_closed(s))
    assert status == 413 and error["code"] == "request_too_large"
    assert good_request(server).status_code == 200


def test_past_the_cap_with_every_connection_busy_a_new_one_gets_a_503(tmp_path):
    srv = ServerProcess(tmp_path, "--kv-budget", "20M", "--no-disk-cache",
                        "--max-connections", "3", "--read-timeout", "60").start(timeout=600)
    busy = []
    try:
        for _ in range(3):  # each awaits the rest of its body: a request in progress
            s = socket.create_connection(address(srv))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
            busy.append(s)
        time.sleep(0.5)
        with socket.create_connection(address(srv)) as s:
            status, error = error_of(until_closed(s))
        assert status == 503 and error["code"] == "too_many_connections"
        assert all(not is_closed(b) for b in busy)  # none was taken for idle
    finally:
        for s in busy:
            s.close()
        assert srv.stop() == 0, srv.log()
