"""Running the app under uvicorn with the shutdown ``dsi serve`` promises.

On SIGINT / SIGTERM (or ``server.should_exit = True``): requests still waiting in the queue are
answered 503 at once, and running requests get ``graceful_s`` seconds to finish *while the listener
stays open*: a new request, and ``/health``, are answered 503 meanwhile (a load balancer sees the
server going, not a refused connection). Then the app aborts what still runs (their decoders stop
within a step) and each request answers for itself: a stream ends with a last chunk per choice
(``finish_reason: "abort"``), an ``error`` event and ``data: [DONE]``, a plain request gets a 503
JSON error. Only then is the listening socket closed; uvicorn waits up to :data:`ABORT_S` more
seconds for those answers to be sent (it cancels a handler only past that, which cuts its
connection), and the app's lifespan shutdown closes every decoder. A second SIGINT (Ctrl-C again)
ends the grace period at once: what still runs is aborted and answers as above. Unlike plain
uvicorn, the signal is not re-raised afterwards, so the process exits normally.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

from dsi.errors import ConfigError

ABORT_S = 5.0  # after the grace period: how long aborted requests have to stop and send their last answer


def listen(host: str, port: int, backlog: int, what: str) -> socket.socket:
    """A listening TCP socket on (``host``, ``port``) (port 0 picks a free one), inheritable; a
    :class:`ConfigError` saying ``cannot listen on {what}`` where it cannot be had."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {what}: {exc}") from exc
    sock.set_inheritable(True)
    return sock


class DSIServer(uvicorn.Server):
    async def shutdown(self, sockets: Any = None) -> None:
        state = getattr(getattr(self.config.app, "state", None), "dsi", None)  # the app's ServerState
        if state is not None:
            state.drain()
            # the listener still answers 503; a second SIGINT (uvicorn's force_exit) ends the wait at once
            await state.wait_running(self.config.timeout_graceful_shutdown, until=lambda: self.force_exit)
            # what still runs is aborted, never cancelled mid-write: each handler sends its own last answer
            await state.abort_running(ABORT_S)
            self.config.timeout_graceful_shutdown = ABORT_S  # uvicorn's own wait: for those answers to go out
        await super().shutdown(sockets=sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def make_server(
    app: Any, *, graceful_s: float = 10.0, log_level: str = "warning", access_log: bool = False
) -> DSIServer:
    """A uvicorn server for ``app`` (run it with ``server.run(sockets=[sock])``)."""
    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on",
                            timeout_graceful_shutdown=graceful_s)
    return DSIServer(config)
