"""One streamed completion from an engine: the tokens (and, where asked, rows) it decodes after a start.

:class:`CompletionStream` posts ``/v1/completions`` with ``stream: true`` after a context of token ids and reads the
server-sent events on a thread of its own, so a reader waits only for the tokens it needs. It asks for each token
by its id (``return_tokens_as_token_ids``, ``logprobs: n``) and with ``ignore_eos`` (the reader decides where the
output ends, by dsi's own stop rules); ``temperature: 0`` makes it the engine's greedy decoding, or, with
``vllm_xargs`` for dsi_vllm's processor, the engine's coupled draws (:mod:`dsi.models.engines.draws`). Two
readers use it: a drafter served by an engine (:mod:`dsi.models.engines.drafter`: each token's top-``n`` row) and
plain decoding through an engine's own generation (:mod:`dsi.models.engines.generation`: the tokens alone, ``n = 0``).
It also owns :func:`read_row`, how every engine path reads a row of log-probabilities.

Faults. A stream that cannot start or breaks (refused, reset, closed before its ``data: [DONE]``, a non-200
answer, a line that is not JSON, a chunk of another shape, an id outside the vocabulary, a streamed error) ends with a :class:`~dsi.errors.ServerLost` naming
the URL, raised to the reader; a stream silent for ``stall_s`` while a reader waits is a frozen engine (the same).
A reader's cancel flag abandons a wait within ``CANCEL_POLL_S``. :meth:`CompletionStream.close` shuts the socket:
vLLM and ``dsi serve`` take that as the client gone and abort the request.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

import numpy as np

from dsi.errors import ServerLost, TaskCancelled
from dsi.models.base import CancelFlag

CANCEL_POLL_S = 0.01  # how often a waiting reader looks at its cancel flag (its answer wakes it at once)


def read_row(entry: dict, vocab_size: int) -> dict[int, float]:
    """A logprobs object of one position as token id -> log-probability. Keys are ids or vLLM's
    ``token_id:N``; values are numbers or vLLM's ``{"logprob": ...}``. ``ValueError`` names the entry
    that is not an id of the vocabulary with a log-probability (an engine's answers are never believed
    past one)."""
    row: dict[int, float] = {}
    for key, value in entry.items():
        try:
            token = int(str(key).removeprefix("token_id:"))
            logprob = float(value["logprob"] if isinstance(value, dict) else value)
        except (TypeError, ValueError, KeyError):
            raise ValueError(f"holds {key!r}: {value!r}") from None
        if not 0 <= token < vocab_size:
            raise ValueError(f"names token {token}, outside the vocabulary [0, {vocab_size})")
        if np.isnan(logprob) or logprob > 1e-4:
            raise ValueError(f"gives token {token} {logprob}, which is not a log-probability")
        row[token] = logprob
    return row


class CompletionStream:
    """One streamed completion after ``start`` on the engine at ``url`` (see the module doc): the tokens it sent so
    far, and with ``n >= 1`` each token's row of its top ``n`` log-probabilities (``{id: logprob}``).

    ``max_tokens``: what it asks for (it ends there: :attr:`ended`); ``role``: names the server in errors;
    ``extra``: more fields of the request (``vllm_xargs``, ``stop_token_ids``)."""

    def __init__(self, url: str, model: str, start: Sequence[int], n: int, max_tokens: int, vocab_size: int, *,
                 connect_timeout: float, read_timeout: float, stall_s: float, role: str = "target",
                 extra: dict | None = None) -> None:
        self.url, self.role = url, role
        self.start, self.n = tuple(start), n  # n: log-probabilities per row (0: the tokens only)
        self.vocab_size = vocab_size
        self.stall_s = float(stall_s)
        self.tokens: list[int] = []
        self.rows: list[dict[int, float]] = []
        self.ended = False  # the engine finished it (its max_tokens, or a stop): nothing more comes
        self.finish_reason: str | None = None  # as the engine said it, where it did
        self.error: BaseException | None = None
        self._progress_at = time.monotonic()  # when the stream last sent a token (or was opened)
        self._cond = threading.Condition()
        self._closed = False
        parts = urlsplit(url)
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self._conn = cls(parts.hostname, parts.port, timeout=connect_timeout)
        self._read_timeout = read_timeout
        payload = {"model": model, "prompt": list(self.start), "max_tokens": max_tokens, "temperature": 0.0,
                   "stream": True, "logprobs": n, "return_tokens_as_token_ids": True, "ignore_eos": True,
                   **(extra or {})}
        self._body = json.dumps(payload).encode()
        self._path = parts.path + "/completions"
        self._thread = threading.Thread(target=self._read, name=f"dsi-{role}-stream", daemon=True)
        self._thread.start()

    def _fail(self, what: str) -> ServerLost:
        return ServerLost(f"{self.role} server {self.url}: {what}")

    def _read(self) -> None:
        try:
            self._conn.connect()
            self._conn.sock.settimeout(self._read_timeout)
            self._conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conn.request("POST", self._path, body=self._body, headers={"Content-Type": "application/json"})
            response = self._conn.getresponse()
            if response.status != 200:
                raise self._fail(f"answered {response.status}: {response.read(300)!r}")
            done = False
            for raw in response:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                self._add(self._parse(data))
            if not done:  # the connection closed mid-stream: an engine that died (vLLM and dsi serve end with it)
                raise self._fail(f"closed the stream after {len(self.tokens)} tokens, before its [DONE]")
        except BaseException as exc:  # noqa: BLE001 - handed to the reader of the tokens
            with self._cond:
                if not self._closed:
                    self.error = exc if isinstance(exc, ServerLost) else self._fail(f"{type(exc).__name__}: {exc}")
                self._cond.notify_all()
            return
        finally:
            with self._cond:
                self.ended = True
                self._cond.notify_all()

    def _parse(self, data: bytes) -> list[tuple[int, dict[int, float] | None]]:
        """The (token, row) pairs of one streamed chunk (rows None with ``n = 0``)."""
        try:
            chunk = json.loads(data)
        except (ValueError, RecursionError):  # (RecursionError: nested too deep)
            raise self._fail(f"streamed a line that is not JSON: {data[:120]!r}") from None
        if isinstance(chunk, dict) and "error" in chunk:
            raise self._fail(f"streamed an error: {str(chunk['error'])[:300]}")
        try:
            choices = chunk.get("choices") or []  # a usage chunk has none
            if choices and choices[0].get("finish_reason"):
                self.finish_reason = str(choices[0]["finish_reason"])
            logprobs = choices[0].get("logprobs") if choices else None
            if not logprobs:
                return []
            names = logprobs["tokens"]
            tops = logprobs["top_logprobs"] if self.n else [None] * len(names)
            out = []
            for name, top in zip(names, tops, strict=True):
                token = int(str(name).removeprefix("token_id:"))
                if not 0 <= token < self.vocab_size:
                    raise ValueError(f"token {token} is outside the vocabulary [0, {self.vocab_size})")
                if self.n and not top:
                    raise ValueError(f"token {token} comes with no log-probabilities")
                out.append((token, read_row(top, self.vocab_size) if self.n else None))
            return out
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise self._fail(f"streamed an inconsistent chunk ({exc}): {data[:160]!r}") from None

    def _add(self, items: list[tuple[int, dict[int, float] | None]]) -> None:
        if not items:
            return
        with self._cond:
            for token, row in items:
                self.tokens.append(token)
                if row is not None:
                    self.rows.append(row)
            self._progress_at = time.monotonic()
            self._cond.notify_all()

    def _wait(self, cancel: CancelFlag | None) -> None:
        """Wait (holding the condition) for the stream to move, within the cancel poll and the stall limit."""
        if cancel is not None and cancel.is_set():
            raise TaskCancelled(f"{self.role} stream wait abandoned")
        silent = time.monotonic() - self._progress_at
        if silent > self.stall_s:
            raise self._fail(f"sent no token for {silent:.0f} s (frozen?)")
        self._cond.wait(CANCEL_POLL_S if cancel is not None else min(1.0, self.stall_s))

    def _arrived(self, j: int, cancel: CancelFlag | None) -> bool:
        """Whether token j arrived, waiting for it (holding the condition); False if the stream ended before it, its
        error if it broke."""
        while len(self.tokens) <= j and not self.ended and self.error is None:
            self._wait(cancel)
        if len(self.tokens) > j:
            return True
        if self.error is not None:
            raise self.error
        return False

    def token(self, j: int, cancel: CancelFlag | None) -> int | None:
        """Token j of the stream (waiting for it), or None if the stream ended before it."""
        with self._cond:
            return self.tokens[j] if self._arrived(j, cancel) else None

    def tokens_from(self, j: int, cancel: CancelFlag | None) -> list[int]:
        """The tokens from j on that have arrived, waiting until at least one has; [] if the stream ended first."""
        with self._cond:
            return self.tokens[j:] if self._arrived(j, cancel) else []

    def row(self, j: int, cancel: CancelFlag | None) -> tuple[int, dict[int, float]] | None:
        """Token j of the stream and its row (``n >= 1``; waiting for it), or None if the stream ended before it."""
        token = self.token(j, cancel)
        return None if token is None else (token, self.rows[j])

    def follows(self, context: tuple[int, ...], cancel: CancelFlag | None) -> int | None:
        """Where ``context`` is on this stream (the index of the token after it), or None if it is not.

        A context longer than what has arrived (the engine has not streamed its last tokens yet, e.g. a
        bonus token the target committed) waits for them while every token that arrived matches."""
        j = len(context) - len(self.start)
        if j < 0 or context[:len(self.start)] != self.start:
            return None
        tail = context[len(self.start):]
        checked = 0
        with self._cond:
            while True:
                have = min(len(self.tokens), j)
                if tuple(self.tokens[checked:have]) != tail[checked:have]:
                    return None
                checked = have
                if checked == j:
                    return j
                if self.ended or self.error is not None:
                    return None
                self._wait(cancel)

    def close(self) -> None:
        with self._cond:
            self._closed = True
        sock = self._conn.sock
        if sock is not None:
            try:  # the engine sees the client gone and aborts the request; the reader wakes
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._conn.close()
