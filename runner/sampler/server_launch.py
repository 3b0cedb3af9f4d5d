"""Running the embedded sampler server: in the foreground (`serve`, the `mixfleet serve` command) or on a
background thread of this process (`start_in_thread` -> `ServerHandle`: tests, notebooks, the runner), under
uvicorn with the limits that bound what a client can hold (`header_timeout_protocol`: a header-read timeout
against slow-loris clients; `limit_concurrency`; the keep-alive timeout). The app itself is
runner/sampler/server.py's `create_app`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any

from mixfleet.runner.sampler.engine_api import SamplerEngine
from mixfleet.runner.sampler.server import ServerArgs, create_app
from mixfleet.runner.sampler.server_state import ENGINE_JOIN_TIMEOUT_S, EmbeddedSampler

log = logging.getLogger("mixfleet.server")


class ServerHandle:
    """A server running in this process on a background thread (tests, notebooks, the runner)."""

    def __init__(self, server: Any, thread: threading.Thread, url: str, sampler: EmbeddedSampler) -> None:
        self._server, self._thread, self.url, self.sampler = server, thread, url, sampler

    def stop(self) -> None:
        """Answer the requests in flight (finish_reason abort), then shut the server and engine down."""
        with contextlib.suppress(Exception):
            self.sampler.engine.abort(abort_all=True)
        self._server.should_exit = True
        self._thread.join(ENGINE_JOIN_TIMEOUT_S + 5)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_in_thread(engine: SamplerEngine, *, server_args: ServerArgs | None = None,
                    startup_timeout_s: float = 30.0) -> ServerHandle:
    """Start uvicorn serving `engine` on a thread and return once it accepts connections.

    `server_args.port = 0` picks a free port; the handle's `url` carries the real one.
    """
    import socket

    import uvicorn

    args = server_args or ServerArgs(port=0)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    port = sock.getsockname()[1]
    app = create_app(engine, server_args=args)
    app.state.sampler.port = port
    config = uvicorn.Config(app, log_level=args.log_level, lifespan="on", timeout_graceful_shutdown=5,
                            **_uvicorn_limits(args))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="mixfleet-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the sampler server did not start on {args.host}:{port}")
        time.sleep(0.01)
    return ServerHandle(server, thread, f"http://{args.host}:{port}", app.state.sampler)


def serve(engine: SamplerEngine, *, server_args: ServerArgs) -> None:
    """Serve `engine` in the foreground until interrupted (the `mixfleet serve` command)."""
    import uvicorn

    app = create_app(engine, server_args=server_args)
    uvicorn.run(app, host=server_args.host, port=server_args.port, log_level=server_args.log_level,
                timeout_graceful_shutdown=5, **_uvicorn_limits(server_args))


def _uvicorn_limits(args: ServerArgs) -> dict:
    """uvicorn settings bounding what a client can hold: the header-read timeout (our h11 protocol), the
    number of connections + requests (`limit_concurrency`), and the keep-alive idle timeout (uvicorn's)."""
    return {"http": header_timeout_protocol(float(args.header_timeout_s)), "limit_concurrency": args.limit_concurrency,
            "timeout_keep_alive": 5}


def header_timeout_protocol(timeout_s: float) -> type:
    """uvicorn's h11 protocol with a header-read timeout. uvicorn has none: its keep-alive timer stops at a
    connection's first byte, so a client that sends a request's headers a byte at a time (slow-loris) held
    its socket for ever. Here a timer starts when a connection opens and whenever bytes arrive while no
    request is in progress; if the request's headers are not complete `timeout_s` later, the connection is
    closed. A request whose headers have arrived is not timed (its body and its response may take long)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11Protocol(H11Protocol):
        header_timeout_s = timeout_s

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            self._header_timer: asyncio.TimerHandle | None = None
            self._header_cycle: Any = None
            super().connection_made(transport)
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._header_cycle = self.cycle          # the request (if any) that was in place when the wait began
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _idle(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self._idle():
                self._arm_header_timer()
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self._header_timer is not None and self.cycle is not self._header_cycle:
                self._cancel_header_timer()          # a new request's headers arrived in time

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.cycle is self._header_cycle and not self.transport.is_closing():
                log.info("closing a connection from %s: request headers not received within %.1f s",
                         self.client, self.header_timeout_s)
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

    return HeaderTimeoutH11Protocol
