"""The server side of the scoring channel (:mod:`dsi.models.engines.scoring_channel`): a plain TCP port next
to the OpenAI one, on which a dsi verifying on this server has its forwards run without HTTP.

:class:`ScoringListener` owns the listening socket, an accept thread and one thread per connection.
A connection's thread reads a request, checks it (as ``/v1/completions`` checks ``prompt_logprobs``:
token ids in the vocabulary, the context within the model's, ``n`` within ``max_logprobs``), takes an
engine slot from the scheduler, runs the slot decoder's ``score`` (its cache reused) on its own
thread and writes the rows back. Slots are taken and given back on the event loop's thread, so the
scheduler stays lock-free and requests over HTTP and over the channel share one FIFO queue; a
connection asks for the slot it last used, whose cache holds its context.

A forward stops when the client closes the connection (:class:`SocketCancel`, checked between
layers) or the server stops. A frame that does not parse ends its connection, never the server. With
an API key, the hello must carry it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import logging
import select
import socket
import threading
import time
from typing import Any

from dsi.errors import ConfigError, TaskCancelled
from dsi.models.engines.scoring_channel import (
    BUSY,
    FAILED,
    MAX_HELLO_BYTES,
    MAX_TOKENS,
    MODE_ARGMAX,
    MODE_TOP,
    MODE_WHOLE,
    REFUSED,
    REQUEST,
    UNAVAILABLE,
    answer_body,
    error_body,
    frame,
    parse_hello,
    parse_request,
    read_frame,
)
from dsi.server.runner import listen
from dsi.server.scheduler import QueueFull, RequestCancelled

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 1024  # each an idle thread until it asks: every slot of every front verifying here holds one
HELLO_TIMEOUT_S = 10.0
ACCEPT_POLL_S = 0.25  # how often the accept thread looks whether the listener is stopping
ENDPOINT = "scoring"  # the endpoint label of the channel's requests in /metrics


def bind(host: str, port: int) -> socket.socket:
    """A listening socket for the scoring channel on (``host``, ``port``); port 0 picks a free one."""
    return listen(host, port, 64, f"{host} port {port} for the scoring channel")


class SocketCancel:
    """A cancel flag (:class:`dsi.models.base.CancelFlag`) that is set once the client's socket is
    readable (it closed, or broke the protocol by sending mid-request) or the server stops."""

    def __init__(self, sock: socket.socket, stopping: threading.Event) -> None:
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        self._stopping = stopping
        self._set = False

    def is_set(self) -> bool:
        if not self._set and (self._stopping.is_set() or self._poll.poll(0)):
            self._set = True
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if left <= 0:
                return False
            self._poll.poll(left * 1000)
        return True


class ScoringListener:
    """The scoring channel of one app (see the module doc). ``state`` is its
    :class:`~dsi.server.app.ServerState`: config, codec, scheduler, metrics."""

    def __init__(self, sock: socket.socket, state: Any) -> None:
        self.sock = sock
        self.port = sock.getsockname()[1]
        self.state = state
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._accepter: threading.Thread | None = None
        self.served = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.sock.settimeout(ACCEPT_POLL_S)  # closing a socket does not wake a thread blocked in accept
        self._accepter = threading.Thread(target=self._accept_loop, name="dsi-scoring-accept", daemon=True)
        self._accepter.start()
        log.info("dsi serve: scoring channel on port %d", self.port)

    # ---- connections -----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # the socket was closed: stopping
            conn.settimeout(None)
            with self._lock:
                if self.stopping.is_set() or len(self._connections) >= MAX_CONNECTIONS:
                    conn.close()
                    continue
                thread = threading.Thread(target=self._serve_connection, args=(conn,), daemon=True,
                                          name=f"dsi-scoring-{conn.fileno()}")
                self._connections[conn] = thread
            thread.start()

    def _serve_connection(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            if self._greet(conn):
                self._serve_requests(conn)
        except (OSError, ValueError, EOFError) as exc:  # the client went, or sent what does not parse
            log.debug("scoring connection closed: %s", exc)
        except Exception:  # noqa: BLE001 - one connection's failure never ends the listener
            log.exception("scoring connection failed")
        finally:
            with self._lock:
                self._connections.pop(conn, None)
            try:
                conn.close()
            except OSError:
                pass

    def _greet(self, conn: socket.socket) -> bool:
        conn.settimeout(HELLO_TIMEOUT_S)
        key = parse_hello(read_frame(conn, MAX_HELLO_BYTES))
        conn.settimeout(None)
        expected = self.state.config.api_key
        if expected is not None and not hmac.compare_digest(key.encode(), expected.encode()):
            conn.sendall(frame(json.dumps({"ok": False, "error": "missing or invalid API key"}).encode()))
            return False
        conn.sendall(frame(json.dumps({"ok": True, "model": self.state.config.model_name,
                                       "vocab_size": self.state.target.vocab_size}).encode()))
        return True

    def _serve_requests(self, conn: socket.socket) -> None:
        limit = REQUEST.size + 4 * MAX_TOKENS  # a longer context than the model's is refused by _check, by name
        cancel = SocketCancel(conn, self.stopping)
        last_slot = None
        while not self.stopping.is_set():
            try:
                body = read_frame(conn, limit)
            except EOFError:
                return
            mode, n, rows, tokens = parse_request(body)
            began = time.monotonic()
            status, answer, last_slot = self._answer(mode, n, rows, tokens, cancel, last_slot)
            self.state.metrics.requests.labels(ENDPOINT, str(status)).inc()
            if status == 499:  # the client is gone
                return
            self.served += 1  # before the answer: a client reading it sees the count
            conn.sendall(frame(answer))
            log.debug("scoring: %d tokens, %d rows in %.1f ms", tokens.size, rows, 1000 * (time.monotonic() - began))

    # ---- one request -------------------------------------------------------------------------------
    def _check(self, mode: int, n: int, rows: int, tokens) -> str | None:
        """What is wrong with a request (a message naming the value), or None."""
        vocab = self.state.target.vocab_size
        limit = self.state.max_context
        max_logprobs = self.state.config.max_logprobs
        if mode not in (MODE_ARGMAX, MODE_TOP, MODE_WHOLE):
            return f"mode {mode} must be {MODE_ARGMAX} (argmax), {MODE_TOP} (top n) or {MODE_WHOLE} (whole rows)"
        if tokens.size == 0:
            return "the context is empty"
        if not 1 <= rows <= tokens.size:
            return f"rows={rows} must be in [1, {tokens.size}] (the context's length)"
        if limit is not None and tokens.size > limit:
            return f"a context of {tokens.size} tokens exceeds the model's {limit}"
        if tokens.min() < 0 or tokens.max() >= vocab:
            return f"token ids must be in [0, {vocab})"
        if mode == MODE_TOP and not 1 <= n <= vocab:
            return f"n={n} must be in [1, {vocab}] for the top n of a row"
        wanted = vocab if mode == MODE_WHOLE else n if mode == MODE_TOP else 1
        if max_logprobs != -1 and wanted > max_logprobs:
            return (f"{wanted} entries per row exceed this server's --max-logprobs {max_logprobs} "
                    "(-1 allows the whole vocabulary)")
        return None

    def _answer(self, mode: int, n: int, rows: int, tokens, cancel: SocketCancel, last_slot: Any
                ) -> tuple[int, bytes, Any]:
        """``(status for /metrics, the answer's body, the slot it ran on)``."""
        problem = self._check(mode, n, rows, tokens)
        if problem is not None:
            return 400, error_body(REFUSED, problem), last_slot
        if self.state.closing or self.state.scheduler is None:
            return 503, error_body(UNAVAILABLE, "the server is shutting down"), last_slot
        try:
            slot = self._take_slot(last_slot, cancel)
        except QueueFull as exc:
            return 429, error_body(BUSY, f"server busy: {exc}; retry later"), last_slot
        except RequestCancelled as exc:
            return 503, error_body(UNAVAILABLE, str(exc)), last_slot
        except TaskCancelled:
            return 499, b"", last_slot
        try:
            context = [int(t) for t in tokens]
            logits = slot.decoder.score(context, len(context) - rows + 1, cancel)
            slot.served += 1
            return 200, answer_body(mode, logits, n), slot
        except TaskCancelled:
            return 499, b"", slot
        except ConfigError as exc:  # e.g. a context the model cannot take
            return 400, error_body(REFUSED, str(exc)), slot
        except Exception as exc:  # noqa: BLE001 - a failed forward: the client takes the server as lost
            log.exception("scoring on slot %d failed", slot.index)
            try:
                slot.recover()
            except Exception:  # noqa: BLE001
                log.exception("slot %d: could not rebuild its decoder", slot.index)
            return 500, error_body(FAILED, f"the forward failed: {type(exc).__name__}: {exc}"[:500]), slot
        finally:
            self.loop.call_soon_threadsafe(self.state.scheduler.release, slot)

    def _take_slot(self, prefer: Any, cancel: SocketCancel) -> Any:
        """A slot from the scheduler (the one ``prefer``\\ red if free), waiting in its queue; gives it
        up (on the loop, where grants happen) if the client goes meanwhile."""
        box: concurrent.futures.Future = concurrent.futures.Future()
        held: list = []  # the scheduler's future, once reserved

        def reserve() -> None:  # on the loop
            try:
                future = self.state.scheduler.reserve(prefer)
            except QueueFull as exc:
                box.set_exception(exc)
                return
            held.append(future)

            def granted(f: asyncio.Future) -> None:
                if box.done():
                    return
                if f.cancelled():
                    box.set_exception(RequestCancelled("withdrawn"))
                elif f.exception() is not None:
                    box.set_exception(f.exception())
                else:
                    box.set_result(f.result())

            future.add_done_callback(granted)

        def abandon() -> None:  # on the loop: withdraw the wait, or give back a slot granted meanwhile
            if not held:
                return
            future = held[0]
            if future.done() and not future.cancelled() and future.exception() is None:
                self.state.scheduler.release(future.result())
            else:
                self.state.scheduler.withdraw(future, "the client went away")

        self.loop.call_soon_threadsafe(reserve)
        while True:
            try:
                return box.result(timeout=0.01)
            except concurrent.futures.TimeoutError:
                if cancel.is_set():
                    box.cancel()
                    self.loop.call_soon_threadsafe(abandon)
                    raise TaskCancelled() from None

    # ---- stopping -----------------------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> None:
        """Stop accepting, stop the running forwards (their cancel flags), close every connection and
        wait for their threads."""
        self.stopping.set()
        try:
            self.sock.close()
        except OSError:
            pass
        with self._lock:
            connections = dict(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for thread in connections.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        if self._accepter is not None:
            self._accepter.join(max(0.0, deadline - time.monotonic()))

