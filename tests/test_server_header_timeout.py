"""The sampler server's header-read timeout and connection bound, with real sockets against a real server.

A slow-loris client (request headers a byte at a time, never finished) held its socket for ever (issue 44):
uvicorn's keep-alive timer stops at a connection's first byte. `ServerArgs.header_timeout_s`
(`mixfleet serve --header-timeout`) closes a connection whose request headers are not complete in time;
a request whose headers arrived is not timed.
"""

from __future__ import annotations

import contextlib
import socket
import time

import httpx
import pytest
from sampler_helpers import make_checkpoint, served_engine

TIMEOUT_S = 1.0
N_SLOW = 50


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ck = make_checkpoint(tmp_path_factory.mktemp("ck"), seed=1, weight_version="v0")
    with served_engine(ck, header_timeout_s=TIMEOUT_S) as (_engine, url):
        yield url


def _addr(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _closed_by_peer(s: socket.socket) -> bool:
    """True once the server has closed `s` (EOF or reset); never blocks."""
    s.setblocking(False)
    try:
        return s.recv(4096) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _drip(socks: list[socket.socket], alive: list[bool], i: int) -> None:
    """One more header byte on every socket still open (a header line that never ends)."""
    for k, s in enumerate(socks):
        if alive[k]:
            try:
                s.send(b"x" if i else b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            except OSError:
                alive[k] = False


def test_slow_loris_sockets_are_closed_while_normal_requests_succeed(server):
    addr = _addr(server)
    socks = [socket.create_connection(addr) for _ in range(N_SLOW)]
    alive = [True] * N_SLOW
    t0 = time.monotonic()
    try:
        i = 0
        ok_during = 0
        drips = []                                             # when each byte went out on the open sockets
        while any(alive) and time.monotonic() - t0 < TIMEOUT_S + 10.0:
            _drip(socks, alive, i)
            drips.append(time.monotonic())
            i += 1
            if time.monotonic() - t0 < TIMEOUT_S * 0.8:       # a normal client is served meanwhile
                assert httpx.get(server + "/health", timeout=5).status_code == 200
                ok_during += 1
            time.sleep(0.1)
            for k, s in enumerate(socks):
                if alive[k] and _closed_by_peer(s):
                    alive[k] = False
        took = time.monotonic() - t0
        assert not any(alive), f"{sum(alive)} of {N_SLOW} slow sockets still open after {took:.1f} s"
        assert took >= TIMEOUT_S * 0.9, f"closed after {took:.2f} s, before the {TIMEOUT_S} s timeout"
        # the sockets kept sending bytes, each gap shorter than the timeout, until they were closed: an idle timer
        # would never have fired, so the header deadline closed them (how many drips fit depends on the machine)
        gaps = [b - a for a, b in zip(drips, drips[1:], strict=False)]
        largest = max(gaps, default=0.0)
        assert len(drips) >= 3 and largest < TIMEOUT_S, f"{len(drips)} drips, largest gap {largest:.2f} s"
        assert ok_during >= 1
        r = httpx.post(server + "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}},
                       timeout=30)
        assert r.status_code == 200 and len(r.json()["output_ids"]) >= 1
    finally:
        for s in socks:
            s.close()


def test_silent_socket_and_slow_second_request_are_closed(server):
    addr = _addr(server)
    silent = socket.create_connection(addr)           # connects, never sends a byte
    keep = socket.create_connection(addr)             # one full request, then a second one that never ends
    try:
        keep.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert keep.recv(4096).startswith(b"HTTP/1.1 200")
        keep.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        t0 = time.monotonic()
        open_ = {"silent": silent, "keep-alive": keep}
        while open_ and time.monotonic() - t0 < TIMEOUT_S + 10.0:
            with contextlib.suppress(OSError):
                keep.send(b"X: y\r\n")
            for name in [n for n, s in open_.items() if _closed_by_peer(s)]:
                del open_[name]
            time.sleep(0.1)
        assert not open_, f"still open: {sorted(open_)}"
    finally:
        silent.close()
        keep.close()


def test_request_with_complete_headers_is_not_timed(server):
    """Headers in time, body after the header timeout: served (only the header read is bounded)."""
    s = socket.create_connection(_addr(server))
    try:
        body = b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}'
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode())
        time.sleep(TIMEOUT_S * 1.8)
        s.sendall(body)
        s.settimeout(30)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
    finally:
        s.close()


def test_header_timeout_option_is_checked():
    from mixfleet.runner.sampler.server import ServerArgs

    for bad in (0, -1, float("nan"), True, "5"):
        with pytest.raises(ValueError, match="header_timeout_s"):
            ServerArgs(header_timeout_s=bad)
    with pytest.raises(ValueError, match="limit_concurrency"):
        ServerArgs(limit_concurrency=0)
