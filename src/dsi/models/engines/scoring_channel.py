"""The scoring channel: ``dsi serve``'s fast path for a dsi that verifies on it, outside HTTP.

A verification is a short forward (a window of drafts) whose answer a decoder waits on, so what the
request path around it costs counts as much as the forward on a fast target. Over HTTP that path is
about 4 ms on 2 cores (uvicorn, FastAPI's routing and validation, the job queue, two thread
hand-offs, a JSON answer of ``prompt_logprobs`` entries; docs/results.md#emulated-latencies-over-engines). Next to
its OpenAI port, ``dsi serve`` listens on a plain TCP port (its model card's ``dsi.scoring_port``)
whose connections each have a thread of the server's that reads a request, runs the forward on an
engine slot and writes the rows back: no event loop, no JSON, no per-row dicts. Only a dsi uses it
(:class:`dsi.models.engines.target.EngineSession`, when the card advertises a port and a plain ``http://``
URL reaches it); anything else, or a port it cannot reach, goes through ``/v1/completions``.

The wire format (little-endian; every message is a frame: a ``u32`` byte length, then the body):

- hello, client first: ``HELLO`` (the protocol and its version), ``u16`` key length, the API key
  (UTF-8, empty without one). The server answers one JSON object: ``{"ok": true, "model": ...,
  "vocab_size": V}``, or ``{"ok": false, "error": ...}`` and closes.
- a request: ``u8`` op (1: score), ``u8`` mode (0: the argmax of each row; 1: each row's ``n``
  largest logits; 2: whole rows), ``i32`` n, ``u32`` rows, ``u32`` count, then ``count`` ``i32``
  token ids: the context. The answer's rows are the target's next-token logits after the first
  ``count - rows + 1`` .. ``count`` tokens of the context (the slot's KV cache is reused, as with
  ``prompt_logprobs_from``).
- an answer: ``u8`` status, then for :data:`OK` the rows: mode 0, ``rows`` ``i64`` ids; mode 1, a
  dtype byte (``f``: float32, ``d``: float64), ``rows * n`` ``i32`` ids (each row's largest first,
  ties in id order) and ``rows * n`` values; mode 2, a dtype byte and ``rows * V`` values. The
  values are the target's **raw logits** in the dtype its model gave them, unrounded: the numbers the
  server's session computed (HTTP carries log-softmax values, equal up to a constant per row).
  Any other status carries a UTF-8 message: :data:`REFUSED` (the request's fault, like a 4xx: the
  task fails), :data:`BUSY` (every slot busy and the queue full: 429), :data:`UNAVAILABLE` (the
  server is shutting down: 503) and :data:`FAILED` (the forward failed: 500). As over HTTP, the last
  two are a lost server on the client.

Cancellation: the client closes the connection (as closing an HTTP request does); the server's
forward checks the socket between layers (:class:`SocketCancel` on the server) and stops. A request
is never pipelined behind another, so anything readable on a busy connection means the client has
gone. Nothing is ever unpickled on either side: a frame that does not parse closes the connection
on the server and is a :class:`~dsi.errors.ServerLost` on the client.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dsi.errors import ConfigError, ServerLost, TaskCancelled
from dsi.models.base import CancelFlag

HELLO = b"DSI-SCORE/1"
OP_SCORE = 1
MODE_ARGMAX, MODE_TOP, MODE_WHOLE = 0, 1, 2
OK, REFUSED, BUSY, UNAVAILABLE, FAILED = 0, 1, 2, 3, 4
STATUS_NAMES = {REFUSED: "refused", BUSY: "busy", UNAVAILABLE: "unavailable", FAILED: "failed"}
DTYPES = {b"f": np.float32, b"d": np.float64}
LENGTH = struct.Struct("<I")
REQUEST = struct.Struct("<BBiII")  # op, mode, n, rows, count
MAX_HELLO_BYTES = 4096
MAX_TOKENS = 1 << 22  # the most tokens a request may carry (a frame larger than that is malformed)
MAX_ANSWER_BYTES = 1 << 31  # the most an answer may announce (whole rows of a large vocabulary)
POLL_S = 0.01  # how often a waiting client looks at its cancel flag


class ChannelRefused(Exception):
    """The server answered a request with a status other than OK (see the module doc)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# ---- frames ------------------------------------------------------------------------------------
def frame(body: bytes) -> bytes:
    return LENGTH.pack(len(body)) + body


def hello_body(api_key: str | None) -> bytes:
    key = (api_key or "").encode()
    return HELLO + struct.pack("<H", len(key)) + key


def parse_hello(body: bytes) -> str:
    """The API key a hello carries ("" without one); ``ValueError`` if it is not this protocol's hello."""
    if not body.startswith(HELLO) or len(body) < len(HELLO) + 2:
        raise ValueError("not a dsi scoring hello (another protocol, or another version of it)")
    (n,) = struct.unpack_from("<H", body, len(HELLO))
    key = body[len(HELLO) + 2:]
    if len(key) != n:
        raise ValueError(f"the hello announces a key of {n} bytes and carries {len(key)}")
    return key.decode("utf-8", "replace")


def request_body(context: Sequence[int], rows: int, mode: int, n: int) -> bytes:
    tokens = np.asarray(context, dtype="<i4")
    return REQUEST.pack(OP_SCORE, mode, n, rows, tokens.size) + tokens.tobytes()


def parse_request(body: bytes) -> tuple[int, int, int, np.ndarray]:
    """``(mode, n, rows, tokens)`` of a request body; ``ValueError`` naming what is malformed."""
    if len(body) < REQUEST.size:
        raise ValueError(f"a request of {len(body)} bytes is shorter than its {REQUEST.size}-byte header")
    op, mode, n, rows, count = REQUEST.unpack_from(body)
    if op != OP_SCORE:
        raise ValueError(f"unknown op {op}")
    if len(body) != REQUEST.size + 4 * count:
        raise ValueError(f"the request announces {count} tokens and carries {(len(body) - REQUEST.size) / 4:g}")
    tokens = np.frombuffer(body, dtype="<i4", offset=REQUEST.size, count=count).astype(np.int64)
    return mode, n, rows, tokens


def answer_body(mode: int, rows: np.ndarray, n: int) -> bytes:
    """The OK answer of ``rows`` (``[num_rows, V]`` raw logits) for a request of ``mode`` and ``n``."""
    if mode == MODE_ARGMAX:
        return bytes([OK]) + np.argmax(rows, axis=-1).astype("<i8").tobytes()
    rows = np.ascontiguousarray(rows)
    code = b"d" if rows.dtype == np.float64 else b"f"
    values = rows.astype("<f8" if code == b"d" else "<f4", copy=False)
    if mode == MODE_WHOLE:
        return bytes([OK]) + code + values.tobytes()
    from dsi.logprobs import top_ids  # the order prompt_logprobs uses: largest first, ties in id order

    ids = np.array([top_ids(row, n) for row in values], dtype="<i4").reshape(len(values), -1)
    return bytes([OK]) + code + ids.tobytes() + np.take_along_axis(values, ids.astype(np.int64), -1).tobytes()


def error_body(status: int, message: str) -> bytes:
    return bytes([status]) + message.encode("utf-8", "replace")[:2000]


def parse_answer(body: bytes, mode: int, rows: int, n: int, vocab_size: int) -> np.ndarray:
    """The rows of an OK answer: int64 ids ``[rows]`` (argmax), else logit rows ``[rows, V]`` (-inf
    where a top-n answer names no value); :class:`ChannelRefused` for another status; ``ValueError``
    for anything inconsistent."""
    if not body:
        raise ValueError("an empty answer")
    status = body[0]
    if status != OK:
        if status not in STATUS_NAMES:
            raise ValueError(f"unknown status {status}")
        raise ChannelRefused(status, body[1:].decode("utf-8", "replace"))
    if mode == MODE_ARGMAX:
        if len(body) != 1 + 8 * rows:
            raise ValueError(f"{len(body) - 1} bytes of argmax ids for {rows} rows")
        ids = np.frombuffer(body, "<i8", offset=1).astype(np.int64)
        _check_ids(ids, vocab_size)
        return ids
    dtype = DTYPES.get(body[1:2])
    if dtype is None:
        raise ValueError(f"unknown dtype {body[1:2]!r}")
    size = np.dtype(dtype).itemsize
    if mode == MODE_WHOLE:
        if len(body) != 2 + size * rows * vocab_size:
            raise ValueError(f"{len(body) - 2} bytes of values for {rows} whole rows of {vocab_size}")
        values = np.frombuffer(body, dtype, offset=2).reshape(rows, vocab_size)
        if np.isnan(values).any() or np.isposinf(values).any():
            raise ValueError("a whole row holds NaN or +inf")
        return values
    if len(body) != 2 + (4 + size) * rows * n:
        raise ValueError(f"{len(body) - 2} bytes for {rows} rows of the top {n}")
    ids = np.frombuffer(body, "<i4", rows * n, offset=2).astype(np.int64).reshape(rows, n)
    values = np.frombuffer(body, dtype, rows * n, offset=2 + 4 * rows * n).reshape(rows, n)
    _check_ids(ids, vocab_size)
    if np.isnan(values).any() or np.isposinf(values).any():
        raise ValueError("a top entry is NaN or +inf")
    if any(len(set(r.tolist())) != n for r in ids):
        raise ValueError("a row names one token twice")
    out = np.full((rows, vocab_size), -np.inf, dtype=dtype)
    np.put_along_axis(out, ids, values, -1)
    return out


def read_frame(sock: socket.socket, limit: int, cancel: CancelFlag | None = None,
               deadline: float | None = None) -> bytes:
    """One frame's body from ``sock`` (both ends read frames with it). With a ``deadline``
    (``time.monotonic()``) the socket's timeout is a poll interval: each time it passes, a set
    ``cancel`` raises :class:`~dsi.errors.TaskCancelled` and a passed deadline ``TimeoutError``;
    without one the socket's own timeout applies. ``EOFError`` if the peer closed before the frame
    began, ``ValueError`` if it announces more than ``limit`` bytes or is cut short."""
    (size,) = LENGTH.unpack(_read_exact(sock, LENGTH.size, cancel, deadline, at_start=True))
    if size > limit:
        raise ValueError(f"a frame of {size} bytes announced, more than the {limit} allowed")
    return bytes(_read_exact(sock, size, cancel, deadline, at_start=False))


def _read_exact(sock: socket.socket, size: int, cancel: CancelFlag | None, deadline: float | None,
                at_start: bool) -> bytearray:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        try:
            n = sock.recv_into(view[got:])
        except TimeoutError:
            if deadline is None:
                raise
            if cancel is not None and cancel.is_set():
                raise TaskCancelled() from None
            if time.monotonic() > deadline:
                raise
            continue
        if n == 0:
            if at_start and got == 0:
                raise EOFError("the peer closed the connection")
            raise ValueError(f"the connection closed {got} bytes into a {size}-byte read")
        got += n
    return buf


def _check_ids(ids: np.ndarray, vocab_size: int) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"names a token outside the vocabulary [0, {vocab_size})")


# ---- the client ----------------------------------------------------------------------------------
class ScoringChannel:
    """One connection to a ``dsi serve``'s scoring port (``host``, ``port``), for one session.

    :meth:`score` blocks on the caller's thread (no I/O thread to hand over to), waking every
    :data:`POLL_S` to look at its cancel flag; cancelling closes the connection (the server's
    forward then stops) and the next request opens a new one. Every fault of the connection or of an
    answer is a :class:`~dsi.errors.ServerLost` naming ``url``; a refused request is a
    :class:`ChannelRefused`. Not for concurrent use.
    """

    def __init__(self, url: str, host: str, port: int, vocab_size: int, *, api_key: str | None = None,
                 connect_timeout: float = 10.0, read_timeout: float = 600.0, role: str = "target") -> None:
        self.url, self.host, self.port, self.role = url, host, port, role
        self.vocab_size = vocab_size
        self._api_key = api_key
        self._connect_timeout, self._read_timeout = connect_timeout, read_timeout
        self._sock: socket.socket | None = None
        self.requests = 0
        self.connects = 0

    def __repr__(self) -> str:
        return f"ScoringChannel({self.host}:{self.port} for {self.url})"

    def _lost(self, what: str) -> ServerLost:
        return ServerLost(f"{self.role} server {self.url} (scoring port {self.port}): {what}")

    def connect(self) -> dict:
        """Open the connection and say hello; the server's hello answer. :class:`ConfigError` if the
        server refuses it (a wrong API key), :class:`ServerLost` if it cannot be reached."""
        self.close()
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self._connect_timeout)
        except OSError as exc:
            raise self._lost(f"cannot connect: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(POLL_S)  # reads wake this often to look at their cancel flag and deadline
        self._sock = sock
        self.connects += 1
        try:
            sock.sendall(frame(hello_body(self._api_key)))
            reply = json.loads(read_frame(sock, MAX_HELLO_BYTES, None, time.monotonic() + self._connect_timeout))
        except (OSError, ValueError, EOFError, RecursionError) as exc:  # (JSON nested too deep: not our server)
            self.close()
            raise self._lost(f"no hello answer ({type(exc).__name__}: {exc})") from exc
        if not isinstance(reply, dict) or reply.get("ok") is not True:
            self.close()
            error = reply.get("error") if isinstance(reply, dict) else reply
            raise ConfigError(f"{self.role} server {self.url} refused its scoring channel: {error}")
        if reply.get("vocab_size") != self.vocab_size:
            self.close()
            raise self._lost(f"it serves a vocabulary of {reply.get('vocab_size')}, not {self.vocab_size}")
        return reply

    def score(self, context: Sequence[int], rows: int, mode: int, n: int, cancel: CancelFlag | None) -> np.ndarray:
        """The last ``rows`` rows of the target after ``context`` (see the module doc for ``mode``)."""
        if self._sock is None:
            self.connect()
        self.requests += 1
        deadline = time.monotonic() + self._read_timeout
        try:
            self._sock.sendall(frame(request_body(context, rows, mode, n)))
            body = read_frame(self._sock, MAX_ANSWER_BYTES, cancel, deadline)
        except TaskCancelled:
            self.close()
            raise
        except TimeoutError as exc:
            self.close()
            raise self._lost(f"no answer within {self._read_timeout:g} s") from exc
        except (OSError, ValueError, EOFError) as exc:
            self.close()
            raise self._lost(f"{type(exc).__name__}: {exc}") from exc
        try:
            return parse_answer(body, mode, rows, n, self.vocab_size)
        except ValueError as exc:
            self.close()  # out of step, or not to be believed: a new connection next time
            raise self._lost(f"answered inconsistently: {exc}") from None

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


def advertised_port(card: Any) -> int | None:
    """The scoring port a ``dsi serve`` model card advertises (``dsi.scoring_port``), or None."""
    info = card.get("dsi") if isinstance(card, dict) else None
    port = info.get("scoring_port") if isinstance(info, dict) else None
    return port if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536 else None


__all__ = ["ScoringChannel", "ChannelRefused", "advertised_port", "MODE_ARGMAX", "MODE_TOP", "MODE_WHOLE"]
