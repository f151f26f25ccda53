"""A target served by inference engines over HTTP: vLLM's OpenAI server, or another ``dsi serve``.

:class:`EngineTarget` is a :class:`~dsi.models.base.LanguageModel` whose sessions compute their rows
on a remote engine, so every transport, decoder and window policy runs on it unchanged: a thread
transport over it with one server per URL is a target pool whose servers are the engines
(:func:`dsi.engine.api.build_decoder` with ``target_servers``).

How a row is computed. Prompts travel as token ids (the tokenizer stays local). A session keeps its
tokens here; a forward posts the whole context, plus one placeholder token, to ``/v1/completions``
with ``max_tokens: 1``, ``temperature: 0`` and ``prompt_logprobs: N`` (vLLM's extension; ``dsi
serve`` implements it). Position p of ``prompt_logprobs`` is the engine's log-softmax of the
next-token logits after the first p tokens; the placeholder makes the last real position one of
them. These are raw log-probabilities (an engine applies no temperature, top-k or top-p to prompt
logprobs), which equal the logits up to a constant per row: every processing dsi applies
(temperature, top-k, top-p) gives the same distribution from either.

What a response determines, and so what stays exact:

- greedy: the argmax of each row (N = 1);
- sampling with ``1 <= top_k <= N``: the top-k logits of each row, and so the whole processed law.
  Sessions are told the ``top`` a caller reads (:func:`dsi.models.base.extend_rows`) and ask the
  engine for exactly that many; the other logits of a row are ``-inf``;
- any other sampling needs the whole vocabulary (N = -1, which vLLM allows with
  ``--max-logprobs -1``). Where the engine does not allow it, :meth:`EngineTarget.check_sampling`
  refuses the request before it starts, naming what would make it exact. Nothing is approximated.
- sampling on engines that run dsi_vllm's logits processor (found at start: :meth:`EngineTarget._draw_check`):
  no rows at all. The engine makes each row's coupled draw itself and answers it as a token
  (:mod:`dsi.models.engines.draws`); the request runs with coupled draws (:mod:`dsi.coupling`), whose decisions
  read only the target's draw, so the session hands back that draw's one-hot row. Processing the processor does
  not make (penalties, bias, ``min_tokens``, constraints) and logprobs move rows as above.

``dsi serve`` also takes ``prompt_logprobs_from`` (the first position whose logprobs are wanted): it
then computes only the rows asked for, on a slot whose KV cache is reused across requests. vLLM reads
no prefix cache for a request with prompt logprobs, so a verification that way recomputes its whole
context; where the engine's prefix cache makes it cheaper, a session asks for the rows as one batch of
prefixes instead (:mod:`dsi.models.engines.prefixes`, docs/engines.md). Where a ``dsi serve``'s model card advertises a scoring port
(``dsi.scoring_port``) and a plain ``http://`` URL reaches it, a session verifies through that
channel instead (:mod:`dsi.models.engines.scoring_channel`: the same rows, as raw logits, without HTTP's
path through the server); where it cannot connect, it says so once and uses ``/v1/completions``.

Checks at start (:meth:`EngineTarget.__init__`): each URL answers ``GET /v1/models``; a canary
forward gives the engine's vocabulary size (the number of entries of a full row) and, with a local
``reference`` model, its rows are compared with the local model's; a mismatch is refused.

Faults. A connection refused or reset, a timeout, a 5xx, a malformed or inconsistent answer (wrong
row count, another model) raises :class:`~dsi.errors.ServerLost`: the pool treats the server as
dead (its task re-queued) and the engine as *lost* (:meth:`EngineTarget.mark_lost`): an engine is a process
of its own that may come back (``servers_can_return``), so the pool probes it with backoff, and a new session
on a lost engine first passes the start check again, canary included (:meth:`EngineTarget.health` counts
them for ``/health`` and ``/metrics``). A 4xx is this request's fault:
a :class:`~dsi.errors.ModelError`, so the task fails. Cancellation closes the connection, which
vLLM and ``dsi serve`` take as the client gone and abort the request.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from dsi.coupling import coupled_draw
from dsi.errors import ConfigError, ContextLengthError, ModelError, ServerLost, TaskCancelled
from dsi.models.base import CancelFlag, LanguageModel, check_int, check_token_ids, common_prefix_length
from dsi.models.engines import draws as drawing
from dsi.models.engines import prefixes
from dsi.models.engines.draws import draw_tokens
from dsi.models.engines.scoring_channel import (
    BUSY,
    MODE_ARGMAX,
    MODE_TOP,
    MODE_WHOLE,
    REFUSED,
    ChannelRefused,
    ScoringChannel,
    advertised_port,
)
from dsi.models.engines.streams import CANCEL_POLL_S, read_row
from dsi.sampling import BonusRead, ChainRead, SamplingParams, process_logits

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0  # a single forward; a frozen engine is caught sooner by the pool's liveness deadline
PROBE_TIMEOUT_S = 10.0  # a new session first asks the engine for its models, within this
PLACEHOLDER = 0  # the token appended after the context so that its last position gets prompt logprobs
TEXT_ATTRIBUTES = ("encode", "decode", "eos_token_ids")  # what an EngineTarget takes from its local reference
CANARY_LENGTH = 8
CANARY_TOLERANCE = 0.25  # nats: the most a canary logprob may differ from the local model's
CANARY_DRAW_SEED = 1  # the seed of the draw an engine's dsi_vllm processor is checked with at start
PREFIX_TOLERANCE = 1e-3  # nats: a row from a batch of prefixes against the same row from prompt_logprobs


def check_url(url: object, role: str = "target") -> str:
    """``url`` as OpenAI clients take it (``http://host:port/v1``), normalised without a trailing slash;
    ``role`` names the server in errors ("target" or "drafter")."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"{role} server URL {url!r} must be a non-empty string like http://127.0.0.1:8000/v1")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{role} server URL {url!r} must start with http:// or https:// and name a host "
                          "(like http://127.0.0.1:8000/v1)")
    try:
        parts.port
    except ValueError:
        raise ConfigError(f"{role} server URL {url!r} has an invalid port") from None
    path = parts.path.rstrip("/")
    if not path.endswith("/v1"):
        raise ConfigError(f"{role} server URL {url!r} must end in /v1, as OpenAI clients take it "
                          f"(e.g. {parts.scheme}://{parts.netloc}{path}/v1)")
    return f"{parts.scheme}://{parts.netloc}{path}"


class Connection:
    """One keep-alive HTTP connection to an engine, whose requests can be abandoned mid-flight.

    The request runs on a thread of the connection's own, while the caller waits on it and on its
    cancel flag; cancelling shuts the socket down (the engine sees the client gone) and raises
    :class:`TaskCancelled`. Not for concurrent use: one session, one connection.
    """

    def __init__(self, url: str, connect_timeout: float = CONNECT_TIMEOUT_S, read_timeout: float = READ_TIMEOUT_S,
                 role: str = "target"):
        self.url = url
        self.role = role  # names the server in errors
        parts = urlsplit(url)
        self._host, self._port, self._https = parts.hostname, parts.port, parts.scheme == "https"
        self._base = parts.path
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._conn: http.client.HTTPConnection | None = None
        self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dsi-engine-io")
        self.requests = 0  # requests sent (tests and telemetry)
        self._cancelling = False  # a cancel is shutting the socket: never retry then

    def _connect(self) -> http.client.HTTPConnection:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=self._connect_timeout)
            conn.connect()
            conn.sock.settimeout(self._read_timeout)
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conn = conn
        return self._conn

    def _send(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        reused = self._conn is not None
        conn = self._connect()
        headers = {"Content-Type": "application/json"} if body is not None else {}
        try:
            conn.request(method, self._base + path, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            self._drop()
            if not reused or self._cancelling:
                raise
            # a kept-alive connection the engine closed while idle (uvicorn does after 5 s): once more,
            # on a new one; scoring a prompt changes nothing on the engine, so it is safe to repeat
            return self._send(method, path, body)
        except BaseException:
            self._drop()
            raise
        if response.getheader("connection", "").lower() == "close":
            self._drop()
        return response.status, data

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                if conn.sock is not None:
                    conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def request(self, method: str, path: str, payload: dict | None = None, cancel: CancelFlag | None = None) -> Any:
        """The parsed JSON answer of ``method path``; see the module doc for what each fault raises."""
        body = None if payload is None else json.dumps(payload).encode()
        self.requests += 1
        self._cancelling = False
        future = self._io.submit(self._send, method, path, body)
        # wait() never raises: a socket timeout inside the request is a TimeoutError too, which must not
        # be taken for this poll's own timeout (that would spin on the failed future forever)
        while not concurrent.futures.wait([future], timeout=CANCEL_POLL_S if cancel is not None else None)[0]:
            if cancel is not None and cancel.is_set():
                self._cancelling = True
                conn = self._conn
                if conn is not None and conn.sock is not None:
                    try:  # wake the blocked read; the I/O thread then drops the connection
                        conn.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                concurrent.futures.wait([future], timeout=5.0)
                raise TaskCancelled()
        try:
            status, data = future.result()
        except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out (TimeoutError is an OSError)
            raise ServerLost(f"{self.role} server {self.url}: {type(exc).__name__}: {exc}") from exc
        try:
            answer = json.loads(data)
        except (ValueError, RecursionError):  # (RecursionError: nested too deep)
            raise ServerLost(f"{self.role} server {self.url} answered {status} with a body that is not JSON: "
                             f"{data[:120]!r}") from None
        if status >= 500:
            raise ServerLost(f"{self.role} server {self.url} answered {status}: {_message(answer)}")
        if status >= 400:
            reason = _message(answer)
            raise EngineRefused(status, f"{self.role} server {self.url} answered {status}: {reason}", reason)
        return answer

    def close(self) -> None:
        self._drop()
        self._io.shutdown(wait=False)


class EngineRefused(ModelError):
    """An engine answered 4xx: this request's fault (too long, a limit of the engine), not the server's.
    ``reason``: what the engine said (the message without the engine named)."""

    def __init__(self, status: int, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = message if reason is None else reason


def _message(answer: Any) -> str:
    if isinstance(answer, dict):
        error = answer.get("error", answer)
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])[:300]
        if "detail" in answer:
            return str(answer["detail"])[:300]
    return json.dumps(answer)[:300]


class CanaryMismatch(ConfigError):
    """An engine's canary rows are not the local copy's: another model, or the same one in another dtype.

    ``difference``: the largest |logprob difference| (nats); ``local_dtype``: the local copy's dtype where it
    has one ("bf16", "fp32"), which the message names with the flag that changes it."""

    def __init__(self, message: str, url: str, role: str, difference: float, local_dtype: str | None) -> None:
        super().__init__(message)
        self.url, self.role, self.difference, self.local_dtype = url, role, difference, local_dtype


def dtype_hint(reference: object, role: str) -> str:
    """What to try when an engine's rows differ from the local copy's: the local copy's dtype and the flag."""
    dtype = getattr(reference, "dtype", None)
    if not isinstance(dtype, str):
        return ""
    other = "fp32" if dtype != "fp32" else "bf16"
    engine = "float32" if other == "fp32" else "bfloat16"
    return (f". The local {role} runs {dtype}: if the engine runs another dtype (vLLM's --dtype, e.g. {engine}), "
            f"load the local copy in it (--dtype {other}, or dtype={other!r} in Python)")


@dataclass(frozen=True)
class EngineInfo:
    """What one engine said about itself at start."""

    url: str
    model: str  # the served model name (sent with every request)
    kind: str  # "dsi" (a dsi serve: takes prompt_logprobs_from) or "openai" (vLLM and others)
    max_model_len: int | None
    vocab_size: int | None  # entries of a full row; None where the engine allows no full row
    full_rows: bool  # prompt_logprobs=-1 (the whole vocabulary) allowed
    # top entries per row known to be allowed: None (the whole vocabulary), else 1 (the canary's); an
    # engine's own lower limit shows when a request exceeds it (a 4xx: that request fails)
    max_logprobs: int | None
    canary_difference: float | None  # largest |logprob difference| against the local reference
    scoring_port: int | None = None  # a dsi serve's scoring channel, as its card advertised it at start
    block_size: int | None = None  # a vLLM engine's KV block size (its /metrics), where it says
    prefixes: bool = False  # verifies from its prefix cache as a batch of prefixes (dsi.models.engines.prefixes)
    draws: bool = False  # runs dsi_vllm's processor: a sampled row is answered by its coupled draw (dsi.coupling)


def model_cards(conn: Connection, url: str, role: str = "target") -> list[dict]:
    """The model cards an engine lists at ``GET /v1/models`` (the first one a card with an ``id``);
    :class:`~dsi.errors.ConfigError` naming the URL where it cannot be asked or lists none."""
    try:
        listing = conn.request("GET", "/models")
    except (ServerLost, EngineRefused) as exc:
        raise ConfigError(f"{role} server {url} cannot be used: {exc}") from None
    cards = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(cards, list) or not cards or not isinstance(cards[0], dict) or "id" not in cards[0]:
        raise ConfigError(f"{role} server {url} lists no model at {url}/models (is it an OpenAI server?)")
    return cards


def parse_rows(answer: Any, url: str, model: str, context_length: int, first: int, count: int, vocab_size: int,
               role: str = "target") -> list[dict[int, float]]:
    """Rows ``first .. first + count - 1`` of an answer's ``prompt_logprobs``: token id -> logprob.

    Position p holds the distribution after the first p tokens of a prompt of ``context_length``
    tokens. Anything inconsistent (another model, the wrong length, ids outside the vocabulary, a
    value that is not a log-probability) is a :class:`ServerLost`."""
    def lost(what: str) -> ServerLost:
        return ServerLost(f"{role} server {url} answered inconsistently: {what}")

    if not isinstance(answer, dict):
        raise lost("the answer is not a JSON object")
    if answer.get("model") not in (None, model):
        raise lost(f"it served model {answer.get('model')!r}, not {model!r}")
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise lost("no choices")
    rows = answer.get("prompt_logprobs")  # at the top (some servers) or, as vLLM answers, in the choice
    if rows is None:
        rows = choices[0].get("prompt_logprobs")
    if not isinstance(rows, list) or len(rows) != context_length:
        got = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise lost(f"prompt_logprobs has {got} positions for a prompt of {context_length} tokens")
    out = []
    for p in range(first, first + count):
        entry = rows[p]
        if not isinstance(entry, dict) or not entry:
            raise lost(f"prompt_logprobs[{p}] is {type(entry).__name__}, not a non-empty object")
        try:
            out.append(read_row(entry, vocab_size))
        except ValueError as exc:
            raise lost(f"prompt_logprobs[{p}] {exc}") from None
    return out


def prefix_rows(conn: Connection, url: str, model: str, context: Sequence[int], first: int, count: int, n: int,
                vocab_size: int, role: str = "target", cancel: CancelFlag | None = None) -> list[dict[int, float]]:
    """Rows ``first .. first + count - 1`` of ``context`` (``n`` log-probabilities each, -1: all) as one batch of
    prefixes (:mod:`dsi.models.engines.prefixes`): token id -> logprob. An answer that is not such rows is a
    :class:`ServerLost`, as for the ``prompt_logprobs`` way."""
    answer = conn.request("POST", "/completions", prefixes.payload(model, context, first, count, n), cancel)
    try:
        return [read_row(entry, vocab_size) for entry in prefixes.row_entries(answer, url, model, count, role)]
    except ValueError as exc:
        raise ServerLost(f"{role} server {url} answered a batch of prefixes inconsistently: {exc}") from None


def dense_rows(rows: Sequence[dict[int, float]], vocab_size: int) -> np.ndarray:
    """Rows of token id -> log-probability as logit rows ``[len(rows), vocab_size]``, ``-inf`` where a
    row names no value (the processed law of a row's top entries is the law of the whole row's top)."""
    out = np.full((len(rows), vocab_size), -np.inf)
    for i, row in enumerate(rows):
        out[i, np.fromiter(row, np.int64, len(row))] = np.fromiter(row.values(), np.float64, len(row))
    return out


class LocalText:
    """A model served elsewhere whose text side (``encode``, ``decode``, ``eos_token_ids``) is its local
    ``reference``'s: the tokenizer stays local."""

    reference: Any = None

    def __getattr__(self, name: str) -> Any:
        if name in TEXT_ATTRIBUTES and self.__dict__.get("reference") is not None:
            return getattr(self.__dict__["reference"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


class EngineTarget(LocalText):
    """The target model as served by the engines at ``urls`` (see the module doc).

    ``reference``: the local copy of the target (or None): its ``vocab_size`` is the vocabulary
    the engines must serve and its rows are compared with a canary forward on each engine;
    ``vocab_size`` is needed without one. ``model``: the served name to request (default: the first
    one each engine lists).
    """

    deterministic = False  # an engine's rows depend on its own batching: nothing here can promise bits
    servers_can_return = True  # an engine is a process of its own: a pool probes a lost one until it is back

    def __init__(self, urls: Sequence[str], reference: LanguageModel | None = None, *, vocab_size: int | None = None,
                 model: str | None = None, canary_tolerance: float = CANARY_TOLERANCE,
                 connect_timeout: float = CONNECT_TIMEOUT_S, read_timeout: float = READ_TIMEOUT_S,
                 role: str = "target", scoring_channel: bool = True, prefix_cache: bool = True,
                 engine_draws: bool = True, engine_generation: bool = True) -> None:
        self.role = role  # names the servers in errors: "target", or "drafter" (dsi.models.engines.drafter)
        # plain decoding streams the engines' own generation where it is exact (dsi.models.engines.generation)
        self.engine_generation = engine_generation
        # let engines that run dsi_vllm's processor draw sampled rows (dsi.models.engines.draws); False: never
        self.engine_draws = engine_draws
        # verify from a vLLM engine's prefix cache where it is cheaper (dsi.models.engines.prefixes); False: never
        self.prefix_cache = prefix_cache
        self.scoring_channel = scoring_channel  # verify on a dsi serve's scoring port where it advertises one
        self._channel_warned: set[str] = set()  # engines whose unusable scoring port was said (once each)
        if isinstance(urls, str) or not urls:
            raise ConfigError(f"target_servers={urls!r} must be a non-empty list of URLs like http://127.0.0.1:8000/v1")
        self.urls = tuple(check_url(u, role) for u in urls)
        if len(set(self.urls)) != len(self.urls):
            raise ConfigError(f"target_servers={list(urls)!r} names one URL twice")
        if reference is None and vocab_size is None:
            raise ConfigError("EngineTarget needs the local target (reference=) or its vocab_size=")
        self.reference = reference
        self.vocab_size = int(reference.vocab_size if reference is not None else vocab_size)
        self.tokenizer = getattr(reference, "tokenizer", None)
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.canary_tolerance = canary_tolerance
        self._model_name = model
        self._next = 0
        self._lock = threading.Lock()
        self.lost: dict[str, str] = {}  # engine URL -> why it was lost, until it passes the start check again
        self.readmissions = 0  # lost engines that passed the start check again
        self._checking = {url: threading.Lock() for url in self.urls}  # one start check of an engine at a time
        self.engines = {url: self._describe(url) for url in self.urls}
        lens = [e.max_model_len for e in self.engines.values() if e.max_model_len]
        local = getattr(reference, "max_context", None)
        # the placeholder and the one token each request generates take two positions of the engine's context
        limits = [n - 2 for n in lens] + ([local] if isinstance(local, int) else [])
        self.max_context = min(limits) if limits else None

    def __repr__(self) -> str:  # also what method="auto" caches its choice under
        served = ", ".join(f"{e.url} ({e.model})" for e in self.engines.values()) if hasattr(self, "engines") else ""
        return f"EngineTarget({served or ', '.join(self.urls)}; reference {self.reference!r})"

    # ---- start-up checks ---------------------------------------------------------------------
    def _describe(self, url: str) -> EngineInfo:
        conn = Connection(url, self.connect_timeout, self.read_timeout, self.role)
        try:
            cards = model_cards(conn, url, self.role)
            names = [str(c.get("id")) for c in cards if isinstance(c, dict)]
            name = self._model_name or names[0]
            if name not in names:
                raise ConfigError(f"{self.role} server {url} serves {names}, not {name!r}")
            card = cards[names.index(name)]
            kind = "dsi" if isinstance(card.get("dsi"), dict) else "openai"
            max_len = card.get("max_model_len")
            max_len = max_len if isinstance(max_len, int) and max_len > 2 else None
            return replace(self._canary(conn, url, name, kind, max_len), scoring_port=advertised_port(card))
        finally:
            conn.close()

    def _canary(self, conn: Connection, url: str, name: str, kind: str, max_len: int | None) -> EngineInfo:
        prompt = [int(t) for t in np.random.default_rng(0).integers(1, self.vocab_size, CANARY_LENGTH)]
        full = True
        try:
            answer = conn.request("POST", "/completions", self._payload(name, prompt, -1, 1, kind))
        except EngineRefused as exc:
            full = False
            log.info("%s server %s gives no whole-vocabulary rows (%s); %s", self.role, url, exc,
                     self._partial_rows_note())
            try:
                answer = conn.request("POST", "/completions", self._payload(name, prompt, 1, 1, kind))
            except (ServerLost, EngineRefused) as exc2:
                raise ConfigError(f"{self.role} server {url} cannot score a prompt: {exc2}") from None
        except ServerLost as exc:
            raise ConfigError(f"{self.role} server {url} cannot be used: {exc}") from None
        context = len(prompt) + 1
        try:
            rows = parse_rows(answer, url, name, context, 1, len(prompt), 1 << 62, self.role)
        except ServerLost as exc:
            raise ConfigError(f"{self.role} server {url} is not an engine dsi can verify with: {exc}") from None
        vocab = len(rows[0]) if full else None
        if full and any(len(r) != vocab for r in rows):
            raise ConfigError(f"{self.role} server {url} gave rows of {sorted({len(r) for r in rows})} entries")
        if vocab is not None and vocab != self.vocab_size:
            raise ConfigError(f"{self.role} server {url} serves {name!r} with a vocabulary of {vocab} tokens; "
                              f"the local {self.role} has {self.vocab_size}: it is another model")
        seen = max(max(r) for r in rows)
        if seen >= self.vocab_size:
            raise ConfigError(f"{self.role} server {url} names token {seen}, outside the local {self.role}'s "
                              f"vocabulary of {self.vocab_size}: it is another model")
        difference = None
        if self.reference is not None:
            session = self.reference.new_session()
            try:
                local = np.asarray(session.extend(prompt), np.float64)  # [len, V]
            finally:
                session.close()
            local = local - np.logaddexp.reduce(local, axis=-1, keepdims=True)
            difference = 0.0
            for i, row in enumerate(rows):
                ids = np.fromiter(row, np.int64)
                values = np.fromiter(row.values(), np.float64)
                difference = max(difference, float(np.abs(local[i, ids] - values).max()))
                theirs, ours = int(ids[np.argmax(values)]), int(np.argmax(local[i]))
                if theirs != ours and local[i, ours] - local[i, theirs] > self.canary_tolerance:  # not a near-tie
                    raise self._mismatch(url, f"{name!r} does not compute the local {self.role}'s rows (canary "
                                              f"position {i}: argmax {theirs}, the local {self.role}'s {ours})",
                                         max(difference, float(local[i, ours] - local[i, theirs])))
            if difference > self.canary_tolerance:
                raise self._mismatch(url, f"{name!r} does not compute the local {self.role}'s rows (canary logprobs "
                                          f"differ by up to {difference:.3g} nats, more than {self.canary_tolerance})",
                                     difference)
        reads_cache, block = self._prefix_check(conn, url, name, prompt, rows) if kind == "openai" else (False, None)
        draws = (kind == "openai" and self.role == "target" and self.engine_draws
                 and self._draw_check(conn, url, name, prompt, rows))
        return EngineInfo(url, name, kind, max_len, vocab, full, None if full else 1, difference, block_size=block,
                          prefixes=reads_cache, draws=draws)

    def _draw_check(self, conn: Connection, url: str, name: str, prompt: list[int],
                    rows: list[dict[int, float]]) -> bool:
        """Whether the engine at ``url`` makes coupled draws itself (dsi_vllm's processor, :mod:`dsi.coupling`): it
        answers a probe (``dsi_probe``, a token other than the canary's argmax) with the probed token and, where
        its rows are whole, a seeded draw of the canary's last row with the draw dsi makes of that row. Said
        once (INFO) either way; an engine that fails the second check (a processor of another version) is not
        used for draws."""
        last = rows[-1]
        probe = (_argmax(last) + 1) % self.vocab_size
        try:
            got = draw_tokens(conn, url, name, [prompt], {drawing.PROBE: probe}, self.role)
        except (EngineRefused, ServerLost) as exc:
            log.info("%s server %s takes no draw arguments (%s): sampled verifications move rows", self.role, url, exc)
            return False
        if got != [probe]:
            log.info("%s server %s runs no dsi_vllm processor: sampled verifications move rows (start it with "
                     "--logits-processors dsi_vllm.processor:CoupledDraws: docs/engines.md)", self.role, url)
            return False
        if len(last) == self.vocab_size:
            row = dense_rows([last], self.vocab_size)[0]
            law = process_logits(row, SamplingParams(temperature=1.0))
            expected = coupled_draw(law, CANARY_DRAW_SEED, len(prompt))
            try:
                got = draw_tokens(conn, url, name, [prompt], drawing.args(SamplingParams(temperature=1.0,
                                                                                        seed=CANARY_DRAW_SEED)),
                                  self.role)
            except (EngineRefused, ServerLost) as exc:
                log.warning("%s server %s answers a probe but not a draw (%s): sampled verifications move rows",
                            self.role, url, exc)
                return False
            if got != [expected]:
                log.warning("%s server %s draws token %s where dsi draws %d from the same row: its dsi_vllm is not "
                            "this dsi's; sampled verifications move rows", self.role, url, got, expected)
                return False
        log.info("%s server %s draws sampled rows itself (dsi_vllm): a sampled verification moves a token a row",
                 self.role, url)
        return True

    def _prefix_check(self, conn: Connection, url: str, name: str, prompt: list[int],
                      rows: list[dict[int, float]]) -> tuple[bool, int | None]:
        """Whether the engine at ``url`` verifies from its prefix cache (:mod:`dsi.models.engines.prefixes`):
        prefix caching on, its block size known, and a batch of the canary's prefixes answering the canary's rows
        (their argmax and its log-probability); said once where it cannot. Returns it and the block size."""
        if not self.prefix_cache:
            return False, None
        block, caching = prefixes.cache_config(url, min(self.connect_timeout, PROBE_TIMEOUT_S))
        if block is None or not caching:
            log.info("%s server %s shows no prefix cache in its /metrics: each verification recomputes its context "
                     "(vLLM: --enable-prefix-caching)", self.role, url)
            return False, block
        try:
            got = prefix_rows(conn, url, name, prompt, 1, len(prompt), 1, self.vocab_size, self.role)
        except (EngineRefused, ServerLost) as exc:
            log.warning("%s server %s does not answer a batch of prefixes (%s): each verification recomputes its "
                        "context", self.role, url, exc)
            return False, block
        for i, (theirs, ours) in enumerate(zip(got, rows, strict=True)):
            t, o = _argmax(theirs), _argmax(ours)
            if t != o or abs(theirs[t] - ours[o]) > PREFIX_TOLERANCE:
                log.warning("%s server %s answers a batch of prefixes with other rows than its prompt_logprobs "
                            "(position %d: %d %.6g against %d %.6g): each verification recomputes its context",
                            self.role, url, i + 1, t, theirs[t], o, ours[o])
                return False, block
        return True, block

    def _partial_rows_note(self) -> str:
        """What rows of the top log-probabilities only mean for this role (said at start, at -v)."""
        if self.role == "drafter":  # drafts are drawn from the law verification uses, whatever it is
            return ("drafts are drawn from its top log-probabilities, which keeps any sampling exact (with top_k "
                    "above them, drafts are accepted less often)")
        return "sampling then needs top_k, and penalties, biases and constraints need whole rows"

    def _mismatch(self, url: str, what: str, difference: float) -> CanaryMismatch:
        dtype = getattr(self.reference, "dtype", None)
        return CanaryMismatch(f"{self.role} server {url}: {what}{dtype_hint(self.reference, self.role)}", url,
                              self.role, difference, dtype if isinstance(dtype, str) else None)

    @staticmethod
    def _payload(name: str, context: Sequence[int], n: int, first: int, kind: str) -> dict:
        payload = {"model": name, "prompt": [*context, PLACEHOLDER], "max_tokens": 1, "temperature": 0.0,
                   "prompt_logprobs": n}
        if kind == "dsi":
            payload["prompt_logprobs_from"] = first
        return payload

    # ---- what the engines can serve exactly -----------------------------------------------------
    def check_sampling(self, params: Any, whole_rows: bool = False) -> None:
        """Refuse a request whose processed law (with ``whole_rows``: whose log-probabilities too)
        the engines' answers would not determine."""
        partial = [e.url for e in self.engines.values() if not e.full_rows]
        if partial and whole_rows:
            raise ConfigError(
                f"logprobs over target server(s) {', '.join(partial)} need whole rows: they return only the top "
                "log-probabilities of a row. Start them with --max-logprobs -1 (the whole vocabulary)")
        if params.raw_argmax or (not whole_rows and self.draws(params)):
            return
        if partial and params.moves_argmax:
            raise ConfigError(
                f"penalties, logit_bias, min_tokens or a structured-output constraint over target server(s) "
                f"{', '.join(partial)} are not exact: they return only the top log-probabilities of a row, and "
                "processing may lift a token from below them (a constraint masks rows in dsi, which needs them "
                "whole). Start them with --max-logprobs -1 (the whole vocabulary)")
        if partial and not params.greedy and params.top_k == 0:
            raise ConfigError(
                f"sampling with top_k=0 over target server(s) {', '.join(partial)} is not exact: they return only "
                "the top log-probabilities of a row. Set top_k (it then asks for exactly top_k of them), or start "
                "them with --max-logprobs -1 (the whole vocabulary)")

    def draws(self, params: Any) -> bool:
        """Whether every engine makes ``params``' draws itself (:attr:`EngineInfo.draws`): sampling whose
        processing the engine's processor makes (temperature, top-k, top-p, min_p: no penalty, bias, ``min_tokens``
        or constraint). A decoder then runs such a request with coupled draws (:mod:`dsi.coupling`), and each
        sampled row crosses as one token."""
        return (not params.greedy and not params.moves_argmax and bool(self.engines)
                and all(e.draws for e in self.engines.values()))

    def generation(self, params: Any, logprobs: bool = False) -> Any:
        """Plain decoding of a request with sampling ``params`` through the engines' own generation
        (:class:`~dsi.models.engines.generation.EngineGeneration`), or None where that would not be exact or was
        turned off (``engine_generation=False``): logprobs, and processing that moves the argmax unless the engines
        draw it. Greedy on raw rows, and sampling every engine draws (the request runs with coupled draws)."""
        if not self.engine_generation or logprobs:
            return None
        coupled = self.draws(params)
        if not (params.raw_argmax or coupled):
            return None
        from dsi.models.engines.generation import EngineGeneration

        return EngineGeneration(self, params, coupled)

    def _next_url(self) -> str:
        """The next engine's URL in turn (sessions and streams are spread over the engines in one rotation)."""
        with self._lock:
            url, self._next = self.urls[self._next % len(self.urls)], self._next + 1
        return url

    def engine_in_service(self) -> EngineInfo:
        """The next engine in turn that is in service (a lost one passes its start check again first), or
        :class:`~dsi.errors.ServerLost` when none is."""
        why = []
        for _ in range(len(self.urls)):
            url = self._next_url()
            if url in self.lost:
                try:
                    self._readmit(url)
                except ServerLost as exc:
                    why.append(str(exc))
                    continue
            return self.engines[url]
        raise ServerLost(f"every {self.role} server is lost: {'; '.join(why)}")

    # ---- sessions ------------------------------------------------------------------------------
    def new_session(self, device: str | None = None) -> EngineSession:
        """A session on the engine at ``device`` (a URL of :attr:`urls`), or on the next one in turn."""
        url = self._next_url() if device is None else check_url(device)
        if url not in self.engines:
            raise ConfigError(f"{url} is not one of this target's servers ({', '.join(self.urls)})")
        if url in self.lost:
            self._readmit(url)
        return EngineSession(self, self.engines[url])

    # ---- engines lost and back ----------------------------------------------------------------------
    def mark_lost(self, url: str, why: str) -> None:
        """The engine at ``url`` failed like a lost server (:class:`~dsi.errors.ServerLost`): out of service
        until a new session on it passes the start check again."""
        with self._lock:
            self.lost.setdefault(url, why)

    def _readmit(self, url: str) -> None:
        """The start check of the lost engine at ``url`` (its model listed, the canary): back in service if it
        passes, else :class:`~dsi.errors.ServerLost` (a pool probes it again later)."""
        with self._checking[url]:
            if url not in self.lost:  # another session's check brought it back meanwhile
                return
            try:
                info = self._describe(url)
            except (ConfigError, ServerLost, ModelError) as exc:
                raise ServerLost(f"{self.role} server {url} is still lost: {exc}") from None
            with self._lock:
                self.engines[url] = info  # as it is now: a restarted engine may allow other rows or ports
                why = self.lost.pop(url, "")
                self.readmissions += 1
        log.warning("%s server %s passes its start check again (it was lost: %s): back in service", self.role, url,
                    why)

    def stop_prefixes(self, url: str, why: str) -> EngineInfo:
        """The engine at ``url`` refused a batch of prefixes after its start check accepted one, and serves the
        ``prompt_logprobs`` way: it verifies that way from now on (said once). Returns its description."""
        with self._lock:
            info = self.engines[url]
            first = info.prefixes
            self.engines[url] = info = replace(info, prefixes=False)
        if first:
            log.warning("%s server %s refuses a batch of prefixes now (%s): each verification recomputes its context "
                        "from now on", self.role, url, why)
        return info

    def health(self) -> dict:
        """Engines configured, in service and lost (with why), and how many came back, for /health and /metrics."""
        with self._lock:
            lost = dict(self.lost)
            return {"configured": len(self.urls), "in_service": len(self.urls) - len(lost), "lost": lost,
                    "readmissions": self.readmissions}


class EngineSession:
    """One token sequence whose forwards run on one engine (the cache, if any, is the engine's)."""

    takes_top = True  # extend_rows(top=k) asks the engine for each row's k largest logits only
    reads_rows = True  # a sampled read with coupled draws is answered by the engine's draws (one token a row)

    def __init__(self, target: EngineTarget, engine: EngineInfo) -> None:
        self._target = target
        self.engine = engine
        self._tokens: tuple[int, ...] = ()
        probe = Connection(engine.url, target.connect_timeout, min(target.read_timeout, PROBE_TIMEOUT_S))
        try:  # a server restarted by its pool must answer before it takes tasks (a dead one then stays down)
            listing = probe.request("GET", "/models")
        except EngineRefused as exc:
            target.mark_lost(engine.url, str(exc))
            raise ServerLost(str(exc)) from None
        except ServerLost as exc:
            target.mark_lost(engine.url, str(exc))
            raise
        finally:
            probe.close()
        self._conn = Connection(engine.url, target.connect_timeout, target.read_timeout)
        self.counters = {"engine_requests": 0, "prefix_requests": 0, "draw_requests": 0}
        # the longest context this session sent the engine: what its prefix cache holds (eviction aside)
        self._sent: tuple[int, ...] = ()
        # the card as it is now: a restarted dsi serve may listen on another scoring port
        self.channel = self._open_channel(listing) if target.scoring_channel else None

    def __repr__(self) -> str:
        via = f", scoring port {self.channel.port}" if self.channel is not None else ""
        return f"EngineSession({self.engine.url}{via}, {len(self._tokens)} tokens)"

    def _open_channel(self, listing: Any) -> ScoringChannel | None:
        """The scoring channel of the engine's card in ``listing`` (``GET /v1/models``), connected; None
        where it advertises none, the URL is not plain http, or the port cannot be reached (said once
        per engine: the session then verifies over HTTP)."""
        cards = listing.get("data") if isinstance(listing, dict) else None
        card = next((c for c in cards if isinstance(c, dict) and c.get("id") == self.engine.model), None) \
            if isinstance(cards, list) else None
        port = advertised_port(card)
        parts = urlsplit(self.engine.url)
        if port is None or parts.scheme != "http":
            return None
        target = self._target
        channel = ScoringChannel(self.engine.url, parts.hostname, port, target.vocab_size, role=target.role,
                                 connect_timeout=min(target.connect_timeout, PROBE_TIMEOUT_S),
                                 read_timeout=target.read_timeout)
        try:
            channel.connect()
        except (ServerLost, ConfigError) as exc:
            with target._lock:
                first = self.engine.url not in target._channel_warned
                target._channel_warned.add(self.engine.url)
            if first:
                log.warning("%s server %s advertises a scoring channel on port %d that this dsi cannot use (%s); "
                            "verifying through /v1/completions instead", target.role, self.engine.url, port, exc)
            return None
        return channel

    @property
    def tokens(self) -> tuple[int, ...]:
        return self._tokens

    def extend(self, tokens: Sequence[int], cancel: CancelFlag | None = None) -> np.ndarray:
        return self.extend_rows(tokens, cancel, len(tokens), False)

    def extend_rows(self, tokens: Sequence[int], cancel: CancelFlag | None, num_rows: int, greedy: bool,
                    top: int | None = None, read: Any = None) -> Any:
        """The last ``num_rows`` rows of a forward of ``tokens`` (see :func:`dsi.models.base.extend_rows`):
        argmax ids with ``greedy``; else logit rows holding the ``top`` largest logits (all with None); with
        ``read``, what it makes of them. A sampled read with coupled draws on an engine that draws
        (:attr:`EngineInfo.draws`) reads the one-hot rows of the engine's draws (:meth:`_drawn_rows`), which
        decide each position as the whole rows would (:mod:`dsi.coupling`). An engine that fails as a lost
        server does (:class:`~dsi.errors.ServerLost`) is marked lost."""
        try:
            if read is not None and self._draws(read, greedy):
                return read(self._drawn_rows(tokens, cancel, num_rows, read.params))
            rows = self._extend_rows(tokens, cancel, num_rows, greedy, top)
            return rows if read is None else read(rows)
        except ServerLost as exc:
            self._target.mark_lost(self.engine.url, str(exc))
            raise

    def _draws(self, read: Any, greedy: bool) -> bool:
        """Whether the engine draws what ``read`` reads: the decisions of a sampled chain or a plain draw, with
        coupled draws (not logprobs, which read the rows themselves)."""
        params = getattr(read, "params", None)
        return (not greedy and self.engine.draws and isinstance(read, ChainRead | BonusRead) and params is not None
                and params.coupled_draws and not params.moves_argmax)

    def _context(self, tokens: Sequence[int]) -> tuple[int, ...]:
        """The session's tokens and ``tokens`` (checked here: an id an engine refuses, or fails on, would be taken
        for a lost server), within the context the engines leave."""
        context = self._tokens + tuple(check_token_ids(tokens, self._target.vocab_size, "tokens", self.engine.url))
        limit = self._target.max_context
        if limit is not None and len(context) > limit:
            raise ContextLengthError(f"{len(context)} tokens exceed the context of {limit} tokens that "
                                     f"{self._target.role} server {self.engine.url} leaves (its max_model_len minus 2)")
        return context

    def _sent_now(self, context: tuple[int, ...]) -> None:
        """The engine computed ``context``: the session holds it, and it is what the engine's cache holds unless a
        longer context that starts with it was sent before."""
        if len(context) > len(self._sent) or context[:len(self._sent)] != self._sent:
            self._sent = context
        self._tokens = context

    def _drawn_rows(self, tokens: Sequence[int], cancel: CancelFlag | None, num_rows: int,
                    params: Any) -> np.ndarray:
        """The last ``num_rows`` rows after ``tokens`` as the one-hot rows (0 at the token, -inf elsewhere) of the
        engine's coupled draws: one batch of prefixes whose answers are a token each (read from the prefix cache
        where the engine keeps one)."""
        context = self._context(tokens)
        if cancel is not None and cancel.is_set():
            raise TaskCancelled()
        first = len(context) - num_rows + 1
        self.counters["engine_requests"] += 1
        self.counters["draw_requests"] += 1
        prompts = [list(context[:p]) for p in range(first, first + num_rows)]
        drawn = draw_tokens(self._conn, self.engine.url, self.engine.model, prompts, drawing.args(params),
                            self._target.role, cancel)
        vocab = self._target.vocab_size
        outside = next((t for t in drawn if t >= vocab), None)
        if outside is not None:
            raise ServerLost(f"{self._target.role} server {self.engine.url} answered a draw inconsistently: token "
                             f"{outside}, outside the vocabulary of {vocab}")
        self._sent_now(context)
        rows = np.full((num_rows, vocab), -np.inf, dtype=np.float32)
        rows[np.arange(num_rows), drawn] = 0.0
        return rows

    def _extend_rows(self, tokens: Sequence[int], cancel: CancelFlag | None, num_rows: int, greedy: bool,
                     top: int | None) -> np.ndarray:
        context = self._context(tokens)
        vocab = self._target.vocab_size
        if greedy:
            n = 1
        elif top is not None and 1 <= top < vocab:
            n = top  # an engine whose limit is lower refuses it (a 4xx: the task fails, naming the limit)
        else:
            if not self.engine.full_rows:
                raise ModelError(f"{self._target.role} server {self.engine.url} gives no whole-vocabulary rows; "
                                 "this request needs them (set top_k, or start it with --max-logprobs -1)")
            n = -1
        if cancel is not None and cancel.is_set():
            raise TaskCancelled()
        self.counters["engine_requests"] += 1
        if self.channel is not None:
            rows = self._score_on_channel(context, num_rows, greedy, n, cancel)
            self._tokens = context
            return rows
        first = len(context) - num_rows + 1  # position p: the distribution after the first p tokens
        role = self._target.role
        rows = None
        if self.engine.prefixes and prefixes.prefixes_cheaper(
                len(context), first, num_rows, common_prefix_length(context, self._sent), self.engine.block_size):
            try:
                rows = self._rows_from_prefixes(context, first, num_rows, n, cancel)
            except EngineRefused as exc:  # as at start: the prompt_logprobs way, if the engine takes that
                rows = self._rows_after_refusal(context, first, num_rows, n, cancel, exc)
        if rows is None:
            rows = self._prompt_logprobs_rows(context, first, num_rows, n, cancel)
        self._sent_now(context)
        if greedy:
            return np.array([_argmax(row) for row in rows], dtype=np.int64)
        short = next((len(row) for row in rows if len(row) != vocab), None) if n == -1 else None
        if short is not None:
            raise ServerLost(f"{role} server {self.engine.url} answered inconsistently: a whole-vocabulary "
                             f"row of {short} entries, not {vocab}")
        return dense_rows(rows, vocab)

    def _prompt_logprobs_rows(self, context: tuple[int, ...], first: int, num_rows: int, n: int,
                              cancel: CancelFlag | None) -> list[dict[int, float]]:
        """Rows ``first ..`` of ``context`` from one request's ``prompt_logprobs`` (the whole context computed)."""
        payload = EngineTarget._payload(self.engine.model, context, n, first, self.engine.kind)
        answer = self._conn.request("POST", "/completions", payload, cancel)
        return parse_rows(answer, self.engine.url, self.engine.model, len(context) + 1, first, num_rows,
                          self._target.vocab_size, self._target.role)

    def _rows_after_refusal(self, context: tuple[int, ...], first: int, num_rows: int, n: int,
                            cancel: CancelFlag | None, refusal: EngineRefused) -> list[dict[int, float]]:
        """The rows the ``prompt_logprobs`` way after the engine refused them as a batch of prefixes (it answered
        one at start): where that way serves them, the engine verifies that way from now on (said once); where
        it refuses them too, an :class:`EngineRefused` naming the engine and both requests' refusals (a limit of
        the engine, such as ``--max-logprobs``: this request fails)."""
        try:
            rows = self._prompt_logprobs_rows(context, first, num_rows, n, cancel)
        except EngineRefused as exc:
            raise EngineRefused(exc.status, f"{exc} (the same rows as a batch of prefixes, field 'prompt' a list of "
                                            f"prompts with 'logprobs': {n}: {refusal.reason})", exc.reason) from None
        self.engine = self._target.stop_prefixes(self.engine.url, refusal.reason)
        return rows

    def _rows_from_prefixes(self, context: tuple[int, ...], first: int, num_rows: int, n: int,
                            cancel: CancelFlag | None) -> list[dict[int, float]]:
        """Rows ``first ..`` of ``context`` as one batch of prefixes, read from the engine's prefix cache."""
        self.counters["prefix_requests"] += 1
        return prefix_rows(self._conn, self.engine.url, self.engine.model, context, first, num_rows, n,
                           self._target.vocab_size, self._target.role, cancel)

    def _score_on_channel(self, context: tuple[int, ...], num_rows: int, greedy: bool, n: int,
                          cancel: CancelFlag | None) -> np.ndarray:
        mode = MODE_ARGMAX if greedy else MODE_WHOLE if n == -1 else MODE_TOP
        try:
            return self.channel.score(context, num_rows, mode, n, cancel)
        except ChannelRefused as exc:
            message = f"{self._target.role} server {self.engine.url} (scoring channel): {exc}"
            if exc.status in (REFUSED, BUSY):  # this request's fault, or a full queue: as a 4xx, the task fails
                raise EngineRefused(400 if exc.status == REFUSED else 429, message) from None
            raise ServerLost(message) from None  # shutting down, or its forward failed: as a 5xx

    def truncate(self, length: int) -> None:
        self._tokens = self._tokens[: check_int(length, "length", 0, len(self._tokens))]

    def close(self) -> None:
        self._conn.close()
        if self.channel is not None:
            self.channel.close()


def _argmax(row: dict[int, float]) -> int:
    """The most likely token of a row (the smallest id among equals, as ``np.argmax``)."""
    best = max(row.values())
    return min(t for t, v in row.items() if v == best)


def wait_until_serving(url: str, timeout: float = 120.0, process: Any = None) -> None:
    """Poll ``url``/models until the engine answers (for starting servers in scripts and tests);
    ``process`` (a ``subprocess.Popen``): fail early if it exits."""
    url = check_url(url)
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise ModelError(f"the server for {url} exited with {process.returncode} before serving")
        conn = Connection(url, 2.0, 5.0)
        try:
            conn.request("GET", "/models")
            return
        except (ServerLost, ModelError) as exc:
            last = str(exc)
        finally:
            conn.close()
        time.sleep(0.25)
    raise ModelError(f"{url} did not serve within {timeout:.0f} s ({last})")


__all__ = ["CanaryMismatch", "EngineTarget", "LocalText", "dense_rows", "model_cards", "read_row", "EngineSession",
           "EngineInfo",
           "Connection", "check_url", "parse_rows", "wait_until_serving"]
