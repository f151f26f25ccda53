"""The HTTP side of :mod:`dsi.models.engines.target` without an engine: URL checks, which answers are
believed (anything inconsistent is a lost server, never a row), and connection faults."""

from __future__ import annotations

import pytest

from dsi.errors import ConfigError, ServerLost, WorkerError
from dsi.models.engines.target import Connection, EngineTarget, check_url, parse_rows


@pytest.mark.parametrize("url, normal", [
    ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1"),
    ("http://host:8000/v1/", "http://host:8000/v1"),
    ("https://a.example/prefix/v1", "https://a.example/prefix/v1"),
])
def test_urls_are_taken_as_openai_clients_take_them(url, normal):
    assert check_url(url) == normal


@pytest.mark.parametrize("url, message", [
    ("", "non-empty"), (None, "non-empty"), ("127.0.0.1:8000/v1", "http:// or https://"),
    ("http://127.0.0.1:8000", "must end in /v1"), ("http://h:99999/v1", "invalid port"),
    ("ftp://h/v1", "http:// or https://"),
])
def test_bad_urls_are_refused_naming_them(url, message):
    with pytest.raises(ConfigError, match=message):
        check_url(url)


def answer(rows, model="m"):
    return {"model": model, "choices": [{"text": "", "prompt_logprobs": rows}]}


def row(*pairs):
    return {str(t): {"logprob": lp, "rank": i + 1, "decoded_token": None} for i, (t, lp) in enumerate(pairs)}


def test_rows_are_read_by_position():
    rows = [None, row((3, -0.1), (1, -2.5)), row((2, -0.7))]
    got = parse_rows(answer(rows), "u", "m", 3, 1, 2, 10)
    assert got == [{3: -0.1, 1: -2.5}, {2: -0.7}]
    assert parse_rows(answer(rows), "u", "m", 3, 2, 1, 10) == [{2: -0.7}]


@pytest.mark.parametrize("bad, what", [
    (answer([None, row((3, -0.1))]), "2 positions for a prompt of 3"),
    (answer([None, row((3, -0.1)), row((2, -0.7))], model="other"), "served model 'other'"),
    (answer([None, row((3, -0.1)), row((12, -0.7))]), "token 12, outside the vocabulary"),
    (answer([None, row((3, -0.1)), row((2, 0.5))]), "not a log-probability"),
    (answer([None, row((3, -0.1)), {}]), "not a non-empty object"),
    (answer([None, row((3, -0.1)), {"x": {"logprob": -1}}]), "holds 'x'"),
    ({"choices": []}, "no choices"),
    ([1, 2], "not a JSON object"),
])
def test_an_inconsistent_answer_is_a_lost_server(bad, what):
    with pytest.raises(ServerLost, match=what):
        parse_rows(bad, "http://u/v1", "m", 3, 1, 2, 10)
    assert issubclass(ServerLost, WorkerError)


def test_a_refused_connection_is_a_lost_server_naming_the_url():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conn = Connection(f"http://127.0.0.1:{port}/v1", 2.0, 2.0)
    try:
        with pytest.raises(ServerLost, match=f"127.0.0.1:{port}"):
            conn.request("GET", "/models")
    finally:
        conn.close()


def test_engine_target_arguments_are_checked_before_connecting():
    with pytest.raises(ConfigError, match="non-empty list"):
        EngineTarget("http://h:1/v1", vocab_size=10)
    with pytest.raises(ConfigError, match="names one URL twice"):
        EngineTarget(["http://h:1/v1", "http://h:1/v1/"], vocab_size=10)
    with pytest.raises(ConfigError, match=r"\(reference=\) or its vocab_size="):
        EngineTarget(["http://h:1/v1"])


def test_build_decoder_refuses_target_servers_with_another_transport_or_the_deterministic_mode():
    import dsi
    from tests.conftest import random_lm

    target = random_lm(16, 0)
    with pytest.raises(ConfigError, match="transport='processes': with target_servers"):
        dsi.build_decoder(target=target, drafter=target, transport="processes",
                          target_servers=["http://127.0.0.1:1/v1"])
    with pytest.raises(ConfigError, match="deterministic=True cannot hold with target_servers"):
        dsi.build_decoder(target=target, drafter=target, deterministic=True,
                          target_servers=["http://127.0.0.1:1/v1"])


def test_an_engine_that_accepts_but_never_answers_times_out_as_a_lost_server():
    """A socket timeout inside the request (a stopped engine) is a ServerLost within the read timeout,
    not a poll that spins on the failed request (it did, growing memory, before)."""
    import socket
    import time

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)  # accepts (the kernel completes the handshake) and never answers
        port = listener.getsockname()[1]
        conn = Connection(f"http://127.0.0.1:{port}/v1", 2.0, 0.5)
        try:
            began = time.monotonic()
            with pytest.raises(ServerLost, match="TimeoutError"):
                conn.request("GET", "/models")
            assert time.monotonic() - began < 5.0
        finally:
            conn.close()
