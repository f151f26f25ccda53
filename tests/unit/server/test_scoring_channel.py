"""The scoring channel of ``dsi serve`` (dsi.server.scoring) and its client (dsi.models.engines.scoring_channel):
the rows equal what ``/v1/completions`` gives, decoders over it give the same tokens, and cancelling,
bad frames, a wrong key, a full queue, an unreachable port and a stopping server each end as they must.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import numpy as np
import pytest

from dsi.errors import ConfigError, ModelError, ServerLost, TaskCancelled
from tests.unit.server.conftest import running_server, wait_until

MODEL = "tiny"


def serve(target, drafter=None, codec=None, **config):
    from dsi.server import ServeConfig, create_app
    from dsi.server.scoring import bind

    config = {"method": "ar", "model_name": MODEL, "max_logprobs": -1, **config}
    app = create_app(target, drafter, ServeConfig(**config), codec=codec, scoring_socket=bind("127.0.0.1", 0))
    return running_server(app)


def engines(running, target, **kwargs):
    from dsi.models.engines.target import EngineTarget

    return EngineTarget([running.url + "/v1"], reference=target, **kwargs)


@pytest.fixture(scope="module")
def server(tiny_pair):
    target, _ = tiny_pair
    with serve(target) as running:
        yield running


def log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - np.logaddexp.reduce(x, axis=-1, keepdims=True)


def test_the_card_advertises_the_port_and_sessions_use_it(server, tiny_pair):
    target, _ = tiny_pair
    fast, slow = engines(server, target), engines(server, target, scoring_channel=False)
    (info,) = fast.engines.values()
    assert info.scoring_port == server.app.state.dsi.scoring.port
    a, b = fast.new_session(), slow.new_session()
    try:
        assert a.channel is not None and a.channel.port == info.scoring_port
        assert b.channel is None
        before = server.app.state.dsi.scoring.served
        a.extend_rows(target.encode("def add(a, b):"), None, 2, True)
        assert server.app.state.dsi.scoring.served == before + 1 and a.channel.requests == 1
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("greedy, top", [(True, None), (False, 4), (False, None)])
def test_rows_on_the_channel_are_the_rows_over_http(server, tiny_pair, greedy, top):
    target, _ = tiny_pair
    fast, slow = engines(server, target).new_session(), engines(server, target, scoring_channel=False).new_session()
    context = target.encode("for i in range(10):\n    print(i)")
    try:
        for cut in (len(context) - 5, 3):  # windows after a cached prefix, and after a rollback
            got = fast.extend_rows(context, None, 6, greedy, top)
            http = slow.extend_rows(context, None, 6, greedy, top)
            fast.truncate(cut)
            slow.truncate(cut)
            if greedy:
                assert got.dtype == np.int64 and got.tolist() == http.tolist()
                continue
            kept = np.isfinite(got)
            if top is None:
                assert kept.all()
                assert np.abs(log_softmax(got) - http).max() < 1e-5  # raw logits there, log-softmax over HTTP
            else:  # exactly the top 4 of each row (HTTP adds the prompt's own token to a row's entries)
                assert (kept.sum(-1) == top).all()
                for row, theirs in zip(got, http, strict=True):
                    assert set(np.flatnonzero(np.isfinite(row))) == set(np.argsort(-theirs, kind="stable")[:top])
    finally:
        fast.close()
        slow.close()


@pytest.mark.parametrize("method, kwargs", [
    ("si", {"lookahead": 3}),
    ("dsi", {"lookahead": 2}),
    ("dsi", {"lookahead": "auto", "max_window": 4}),
])
def test_decoders_over_the_channel_give_the_local_tokens(tiny_pair, method, kwargs):
    import dsi
    from dsi.sampling import SamplingParams

    target, drafter = tiny_pair
    prompt = target.encode("def fibonacci(n):")
    with serve(target) as a, serve(target) as b:
        urls = [a.url + "/v1", b.url + "/v1"]
        for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=11)):
            local = dsi.generate(target=target, drafter=drafter, prompt=prompt, method=method, max_new_tokens=12,
                                 num_target_servers=2, sampling=sampling, **kwargs)
            over = dsi.generate(target=target, drafter=drafter, prompt=prompt, method=method, max_new_tokens=12,
                                target_servers=urls, sampling=sampling, **kwargs)
            assert over.tokens == local.tokens, sampling
        served = a.app.state.dsi.scoring.served + b.app.state.dsi.scoring.served
        assert served >= over.stats.completed_target_forwards > 0  # they verified on the channel, not over HTTP


@pytest.fixture
def slow_server():
    """A synthetic target whose forwards take a minute (unless cancelled) after its first (the canary's,
    which takes none), on one slot, no queue."""
    from dsi.models.emulated.latency import WithLatency
    from dsi.models.emulated.synthetic import synthetic_pair
    from dsi.server.codec import IdsCodec

    target, _ = synthetic_pair(0.9, vocab_size=32)
    slow = WithLatency(target, 0.0, 60.0)
    with serve(slow, codec=IdsCodec(32), max_queue=0, model_name="slow") as running:
        yield running, target


def test_a_cancelled_forward_stops_on_the_server_and_frees_its_slot(slow_server):
    running, target = slow_server
    state = running.app.state.dsi
    session = engines(running, target).new_session()
    cancel = threading.Event()
    errors = []

    def verify():
        try:
            session.extend_rows([1, 2, 3, 4], cancel, 2, True)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=verify)
    thread.start()
    wait_until(lambda: state.scheduler.running == 1, what="the forward to hold the slot")
    cancel.set()
    thread.join(10)
    assert not thread.is_alive() and len(errors) == 1 and isinstance(errors[0], TaskCancelled)
    wait_until(lambda: state.scheduler.running == 0, what="the server to stop the forward and free the slot")
    session.close()


def test_a_full_queue_is_a_refused_request_and_a_stopping_server_a_lost_one(slow_server):
    running, target = slow_server
    state = running.app.state.dsi
    target_engines = engines(running, target)
    holder, other = target_engines.new_session(), target_engines.new_session()
    cancel = threading.Event()
    thread = threading.Thread(target=lambda: _swallow(holder.extend_rows, [1, 2, 3], cancel, 1, True))
    thread.start()
    try:
        wait_until(lambda: state.scheduler.running == 1, what="the slot to be taken")
        with pytest.raises(ModelError, match="server busy"):  # max_queue=0: a 429, the task fails
            other.extend_rows([5, 6, 7], None, 1, True)
    finally:
        cancel.set()
        thread.join(10)
    state.closing = True  # what draining does: a new request is answered unavailable, a lost server
    try:
        with pytest.raises(ServerLost, match="shutting down"):
            other.extend_rows([5, 6, 7], None, 1, True)
    finally:
        state.closing = False
        holder.close()
        other.close()


def _swallow(fn, *args):
    try:
        fn(*args)
    except Exception:  # noqa: BLE001
        pass


def test_stopping_the_server_ends_a_running_forward_as_a_lost_server(slow_server):
    running, target = slow_server
    session = engines(running, target).new_session()
    errors = []
    thread = threading.Thread(target=lambda: _capture(errors, session.extend_rows, [1, 2, 3], None, 1, True))
    thread.start()
    wait_until(lambda: running.app.state.dsi.scheduler.running == 1, what="the forward to start")
    began = time.monotonic()
    running.app.state.dsi.scoring.close()
    thread.join(20)
    assert not thread.is_alive(), "the client hung on a server that stopped"
    assert time.monotonic() - began < 20
    assert len(errors) == 1 and isinstance(errors[0], ServerLost), errors
    session.close()


def _capture(errors, fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001
        errors.append(exc)


def raw_connection(running):
    port = running.app.state.dsi.scoring.port
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def closed(sock) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("garbage", [
    b"\x05\x00\x00\x00hello",  # not this protocol's hello
    b"\xff\xff\xff\x7f",  # a hello frame far larger than allowed
])
def test_a_bad_hello_closes_its_connection_and_the_server_serves_on(server, tiny_pair, garbage):
    target, _ = tiny_pair
    with raw_connection(server) as sock:
        sock.sendall(garbage)
        assert closed(sock)
    session = engines(server, target).new_session()
    try:
        assert session.channel is not None
        assert session.extend_rows([5, 6, 7], None, 1, True).shape == (1,)
    finally:
        session.close()


def test_malformed_and_invalid_requests(server, tiny_pair):
    from dsi.models.engines import scoring_channel as wire

    target, _ = tiny_pair
    with raw_connection(server) as sock:
        sock.sendall(wire.frame(wire.hello_body(None)))
        assert b'"ok": true' in _read(sock)
        vocab = target.vocab_size
        for body, message in [
            (wire.request_body([1, vocab], 1, wire.MODE_ARGMAX, 0), f"[0, {vocab})"),
            (wire.request_body([1, 2], 3, wire.MODE_ARGMAX, 0), "rows=3"),
            (wire.request_body([1, 2], 1, 7, 0), "mode 7"),
            (wire.request_body([1, 2], 1, wire.MODE_TOP, 0), "n=0"),
            (wire.request_body(list(range(300)), 1, wire.MODE_ARGMAX, 0), "exceeds the model's"),
        ]:
            sock.sendall(wire.frame(body))
            answer = _read(sock)
            assert answer[0] == wire.REFUSED and message in answer[1:].decode(), (message, answer)
        sock.sendall(wire.frame(wire.REQUEST.pack(1, 0, 0, 1, 5) + b"\x00" * 8))  # announces 5 tokens, carries 2
        assert closed(sock)


def _read(sock) -> bytes:
    (size,) = struct.unpack("<I", _exact(sock, 4))
    return _exact(sock, size)


def _exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "closed"
        data += chunk
    return data


def test_the_api_key_guards_the_channel(tiny_pair):
    from dsi.models.engines.scoring_channel import ScoringChannel

    target, _ = tiny_pair
    with serve(target, api_key="s3cret") as running:
        port = running.app.state.dsi.scoring.port
        url = running.url + "/v1"
        with pytest.raises(ConfigError, match="refused its scoring channel: missing or invalid API key"):
            ScoringChannel(url, "127.0.0.1", port, target.vocab_size, api_key="wrong").connect()
        channel = ScoringChannel(url, "127.0.0.1", port, target.vocab_size, api_key="s3cret")
        try:
            assert channel.connect()["model"] == MODEL
            assert channel.score([5, 6, 7], 1, 0, 0, None).shape == (1,)
        finally:
            channel.close()


def test_a_port_it_cannot_reach_is_said_once_and_http_verifies(tiny_pair, caplog):
    target, _ = tiny_pair
    with serve(target) as running:
        running.app.state.dsi.scoring.close()  # the card still advertises the port, nothing listens
        target_engines = engines(running, target)
        with caplog.at_level(logging.WARNING, logger="dsi.models.engines.target"):
            sessions = [target_engines.new_session() for _ in range(2)]
        try:
            assert all(s.channel is None for s in sessions)
            assert sum("cannot use" in r.getMessage() for r in caplog.records) == 1
            context = target.encode("import numpy")
            assert sessions[0].extend_rows(context, None, 2, True).tolist() == \
                np.argmax(target.new_session().extend(context)[-2:], -1).tolist()
        finally:
            for s in sessions:
                s.close()


def test_an_answer_that_is_not_consistent_is_a_lost_server():
    from dsi.models.engines import scoring_channel as wire

    rows = np.zeros((2, 5), np.float32)
    ok = wire.answer_body(wire.MODE_TOP, rows, 2)
    assert wire.parse_answer(ok, wire.MODE_TOP, 2, 2, 5).shape == (2, 5)
    for body, mode, message in [
        (ok[:-1], wire.MODE_TOP, "bytes for 2 rows"),
        (wire.answer_body(wire.MODE_ARGMAX, rows, 0), wire.MODE_WHOLE, "unknown dtype"),
        (bytes([0]) + np.array([1, 9], "<i8").tobytes(), wire.MODE_ARGMAX, "outside the vocabulary"),
        (bytes([0]) + b"f" + np.full(10, np.nan, "<f4").tobytes(), wire.MODE_WHOLE, "NaN"),
        (bytes([9]) + b"?", wire.MODE_ARGMAX, "unknown status"),
    ]:
        with pytest.raises(ValueError, match=message):
            wire.parse_answer(body, mode, 2, 2, 5)
    with pytest.raises(wire.ChannelRefused, match="too long"):
        wire.parse_answer(wire.error_body(wire.REFUSED, "too long"), wire.MODE_ARGMAX, 2, 2, 5)


def test_a_server_that_answers_garbage_on_the_channel_is_lost():
    from dsi.models.engines import scoring_channel as wire

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def fake():  # says hello properly, then answers a request with an argmax outside the vocabulary
        conn, _ = listener.accept()
        with conn:
            _read(conn)
            conn.sendall(wire.frame(b'{"ok": true, "model": "m", "vocab_size": 5}'))
            _read(conn)
            conn.sendall(wire.frame(bytes([0]) + np.array([7], "<i8").tobytes()))
            time.sleep(0.5)

    thread = threading.Thread(target=fake, daemon=True)
    thread.start()
    channel = wire.ScoringChannel("http://127.0.0.1:1/v1", "127.0.0.1", port, 5)
    try:
        with pytest.raises(ServerLost, match="outside the vocabulary"):
            channel.score([1, 2], 1, wire.MODE_ARGMAX, 0, None)
    finally:
        channel.close()
        listener.close()
        thread.join(5)
