"""Streaming text, stop strings, the bounded queue, client disconnects and shutdown, on synthetic
models whose greedy output is a known text (so every byte can be checked) and, for timing, on
the same models behind :class:`dsi.models.WithLatency`."""

from __future__ import annotations

import json
import logging
import re
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from dsi.models import WithLatency  # noqa: E402
from tests.tiny_hf import CORPUS  # noqa: E402
from tests.unit.server.conftest import Running, TokenizerCodec, running_server, scripted_lm, wait_until  # noqa: E402

pytestmark = pytest.mark.hf  # the tiny tokenizer needs transformers

TEXT = CORPUS[3]  # "héllo wörld, naïve café — 日本語のテキスト 🙂 and some emoji 🚀🎉"
LONG = CORPUS[0] + CORPUS[4]


def make_app(tok, script_text, *, cycle=False, latency=None, max_concurrent=2, max_queue=8, typo_every=4,
             fail_on=None):
    from dsi.server import ServeConfig, create_app

    script = tok.encode(script_text)
    vocab, eos = len(tok), tok.eos_token_id
    target = scripted_lm(script, vocab, eos, cycle=cycle, fail_on=fail_on)
    drafter = scripted_lm(script, vocab, eos, cycle=cycle, typo_every=typo_every)
    if latency is not None:
        target, drafter = WithLatency(target, *latency[0]), WithLatency(drafter, *latency[1])
    config = ServeConfig(method="dsi", lookahead=3, num_target_servers=2, max_concurrent=max_concurrent,
                         max_queue=max_queue, model_name="scripted", temperature=0.0,
                         speculation_by_load=False)  # DSI's own streaming and cancellation: every request speculates
    return create_app(target, drafter, config, codec=TokenizerCodec(tok))


@pytest.fixture(scope="module")
def scripted(tiny_tokenizer):
    [poison] = tiny_tokenizer.encode("!")
    with running_server(make_app(tiny_tokenizer, TEXT, fail_on=poison)) as running:
        yield running


def client_for(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def sse_chunks(response):
    """Parsed ``data:`` payloads of an SSE response, as they arrive."""
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def metric(url, name, **labels):
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


# ---- text ------------------------------------------------------------------------------------

@pytest.mark.parametrize("chat", [False, True])
def test_stream_never_splits_multibyte_characters(scripted, chat, tiny_tokenizer):
    client = client_for(scripted.url)
    if chat:
        chunks = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=100, stream=True)
        deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    else:
        chunks = client.completions.create(model="scripted", prompt="hi", max_tokens=100, stream=True)
        deltas = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(deltas) == TEXT  # the drafter's typos were all rejected: output is the target's
    assert not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d) > 10  # really streamed, not sent at once
    full = client.completions.create(model="scripted", prompt="hi", max_tokens=100)
    assert full.choices[0].text == TEXT and full.choices[0].finish_reason == "stop"  # the target's EOS
    assert full.usage.completion_tokens == len(tiny_tokenizer.encode(TEXT)) + 1  # + EOS
    assert full.dsi["rejections"] > 0


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stop, expected", [
    ("naïve", "héllo wörld, "),
    (["日本", "café"], "héllo wörld, naïve "),  # the earliest stop string wins
    ("🚀", "héllo wörld, naïve café — 日本語のテキスト 🙂 and some emoji "),
    ("not there", TEXT),
])
def test_stop_strings_end_generation_and_trim(scripted, stop, expected, stream, tiny_tokenizer):
    client = client_for(scripted.url)
    kwargs = dict(model="scripted", prompt="hi", max_tokens=100, stop=stop)
    if stream:
        chunks = list(client.completions.create(**kwargs, stream=True))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = chunks[-1].choices[0].finish_reason
        usage = chunks[-1].usage
    else:
        r = client.completions.create(**kwargs)
        text, finish, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
    assert text == expected and finish == "stop"
    if expected != TEXT:  # the decoder was stopped early, not run to the end of the script
        assert usage.completion_tokens < len(tiny_tokenizer.encode(TEXT))
        assert tiny_tokenizer.decode(tiny_tokenizer.encode(TEXT)[: usage.completion_tokens]).startswith(expected)


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stop, expected", [
    ("naïve", "héllo wörld, "),  # the stop string's tokens ("na", "ï" in two, "ve") are left out
    (["日本", "café"], "héllo wörld, naïve "),
    # the first token of " 🚀" holds the space before it: it straddles the cut, and stays
    ("🚀", "héllo wörld, naïve café — 日本語のテキスト 🙂 and some emoji "),
])
def test_logprobs_cover_the_returned_text_and_not_the_stop_string(scripted, tiny_tokenizer, stop, expected, stream,
                                                                   chat):
    """Issue 49: with stop strings the text was cut before the stop string but the logprobs still held
    its tokens (and any committed with them in the same step). Now they are the tokens whose text is
    returned: the shortest prefix of the output that spells the text (a token straddling the cut stays)."""
    script = tiny_tokenizer.encode(TEXT)
    m = next(m for m in range(len(script) + 1) if tiny_tokenizer.decode(script[:m]).startswith(expected))
    pieces = [tiny_tokenizer.decode([t]) for t in script[:m]]
    client = client_for(scripted.url)
    if chat:
        kwargs = dict(model="scripted", messages=[{"role": "user", "content": "hi"}], max_tokens=100, stop=stop,
                      logprobs=True, top_logprobs=2)
        make = client.chat.completions.create
    else:
        kwargs = dict(model="scripted", prompt="hi", max_tokens=100, stop=stop, logprobs=2)
        make = client.completions.create
    if stream:
        chunks = [c for c in make(**kwargs, stream=True) if c.choices]
    else:
        chunks = [make(**kwargs)]
    text = "".join((c.choices[0].delta.content or "") if stream and chat else
                   (c.choices[0].message.content if chat else c.choices[0].text) for c in chunks)
    logprobs = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    tokens = [e.token for lp in logprobs for e in lp.content] if chat else [t for lp in logprobs for t in lp.tokens]
    assert text == expected and chunks[-1].choices[0].finish_reason == "stop"
    assert tokens == pieces


@pytest.mark.parametrize("stream", [False, True])
def test_a_failing_worker_is_a_500_and_the_slot_recovers(scripted, stream, caplog):
    decoders = [slot.decoder for slot in scripted.app.state.dsi.scheduler.slots]
    body = {"prompt": "boom!", "max_tokens": 5, "stream": stream}
    r = httpx.post(scripted.url + "/v1/completions", json=body, timeout=30)
    if stream:
        assert r.status_code == 200  # headers were sent; the error arrives as an SSE event
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        error = events[-1]["error"]
    else:
        assert r.status_code == 500
        error = r.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "generation_failed"
    # the answer names the error's type and the job, never its message (it may hold local paths)
    assert "WorkerError" in error["message"] and "poison" not in error["message"]
    job = re.search(r"job ([0-9a-f]{12})", error["message"]).group(1)
    assert any(job in r.getMessage() and "poison" in r.exc_text for r in caplog.records if r.exc_text), \
        "the server log has the details under the job id"
    for _ in range(3):  # every slot still serves...
        ok = httpx.post(scripted.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 100}, timeout=30)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == TEXT
    # ...with the same decoder: a model error leaves it healthy, so nothing is rebuilt (seconds per request)
    assert [slot.decoder for slot in scripted.app.state.dsi.scheduler.slots] == decoders
    assert not any("rebuilding" in r.getMessage() for r in caplog.records)
    assert metric(scripted.url, "dsi_request_finish_total", reason="error") >= 1


# ---- queue, disconnects, shutdown ----------------------------------------------------------

SLOW = ((0.02, 0.02), (0.01, 0.01))  # (ttft, tpot) of target and drafter: ~100 tokens/s at best


@pytest.fixture(scope="module")
def slow(tiny_tokenizer):
    app = make_app(tiny_tokenizer, LONG, cycle=True, latency=SLOW, max_concurrent=1, max_queue=1, typo_every=0)
    with running_server(app) as running:
        yield running


def health(url):
    return httpx.get(url + "/health").json()


def open_long_stream(url, max_tokens=400):
    """Start a long streamed request; return (response, chunk iterator) once it is generating."""
    client = httpx.Client(timeout=30)
    request = client.build_request("POST", url + "/v1/completions",
                                   json={"prompt": "go", "max_tokens": max_tokens, "stream": True})
    response = client.send(request, stream=True)
    assert response.status_code == 200
    chunks = sse_chunks(response)
    for _ in range(3):
        next(chunks)
    return client, response, chunks


def test_disconnect_mid_stream_frees_the_slot_at_once(slow):
    url = slow.url
    cancelled = metric(url, "dsi_request_finish_total", reason="cancelled")
    gone = metric(url, "dsi_requests_total", endpoint="/v1/completions", status="499")
    client, response, _ = open_long_stream(url)  # would take > 4 s to finish
    assert health(url)["running"] == 1
    response.close()
    client.close()
    start = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={"prompt": "go", "max_tokens": 4}, timeout=30)
    elapsed = time.monotonic() - start
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert elapsed < 1.5, f"the next request waited {elapsed:.2f} s for the abandoned one"
    wait_until(lambda: metric(url, "dsi_requests_total", endpoint="/v1/completions", status="499") == gone + 1,
               what="the disconnect to be counted")
    assert metric(url, "dsi_request_finish_total", reason="cancelled") == cancelled + 1
    assert health(url)["running"] == 0


def test_full_queue_gets_429_and_queued_requests_run_in_order(slow):
    url = slow.url
    client, response, _ = open_long_stream(url)
    results = {}
    queued = threading.Thread(target=lambda: results.setdefault("b", httpx.post(
        url + "/v1/completions", json={"prompt": "go", "max_tokens": 3}, timeout=30)))
    queued.start()
    wait_until(lambda: health(url)["queued"] == 1, what="the second request to queue")
    assert metric(url, "dsi_queue_length") == 1
    r = httpx.post(url + "/v1/completions", json={"prompt": "go", "max_tokens": 3}, timeout=30)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"] == "rate_limit_error"
    with pytest.raises(openai.RateLimitError):
        client_for(url).completions.create(model="scripted", prompt="go", max_tokens=3)
    response.close()
    client.close()
    queued.join(10)
    assert results["b"].status_code == 200 and results["b"].json()["usage"]["completion_tokens"] == 3
    assert metric(url, "dsi_requests_total", endpoint="/v1/completions", status="429") == 2


def test_a_queued_client_that_leaves_is_withdrawn(slow):
    url = slow.url
    client, response, _ = open_long_stream(url)
    with pytest.raises(httpx.ReadTimeout):  # waits in the queue, then gives up
        httpx.post(url + "/v1/completions", json={"prompt": "go", "max_tokens": 3}, timeout=0.5)
    wait_until(lambda: health(url)["queued"] == 0, what="the abandoned request to leave the queue")
    assert health(url)["running"] == 1  # the first one is still generating
    response.close()
    client.close()
    wait_until(lambda: health(url)["running"] == 0, what="the slot to be free")


def test_shutdown_cancels_running_and_queued_requests_and_closes_every_worker(tiny_tokenizer):
    before = {t.ident for t in threading.enumerate()}
    app = make_app(tiny_tokenizer, LONG, cycle=True, latency=SLOW, max_concurrent=1, max_queue=2, typo_every=0)
    running = Running(app, graceful_s=0.5).start()
    slot = app.state.dsi.scheduler.slots[0]
    workers = [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("dsi-")]
    assert len(workers) >= 3  # 2 target servers and the drafter of the one slot
    client, response, chunks = open_long_stream(running.url, max_tokens=2000)
    received = []

    def read():
        try:
            received.extend(chunks)
        except httpx.HTTPError:  # the server cut the connection
            pass

    reader = threading.Thread(target=read)
    reader.start()
    outcome = {}
    waiter = threading.Thread(target=lambda: outcome.setdefault("queued", httpx.post(
        running.url + "/v1/completions", json={"prompt": "go", "max_tokens": 3}, timeout=30)))
    waiter.start()
    wait_until(lambda: health(running.url)["queued"] == 1, what="a queued request")
    start = time.monotonic()
    running.shutdown()  # what SIGTERM does
    assert time.monotonic() - start < 10
    reader.join(10)
    waiter.join(10)
    response.close()
    client.close()
    assert not reader.is_alive() and not waiter.is_alive()
    assert outcome["queued"].status_code == 503  # told, not dropped
    assert len(received) < 2000  # the long stream was cut short, not run to the end
    assert slot.executor._shutdown
    wait_until(lambda: not any(t.is_alive() for t in workers), timeout=10, what="worker threads to stop")


def test_during_the_grace_period_the_listener_answers_503_and_the_running_request_finishes(tiny_tokenizer):
    app = make_app(tiny_tokenizer, LONG, cycle=True, latency=SLOW, max_concurrent=1, max_queue=2, typo_every=0)
    running = Running(app, graceful_s=20.0).start()
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
        running.url + "/v1/completions", json={"prompt": "go", "max_tokens": 200}, timeout=60)))
    worker.start()
    wait_until(lambda: health(running.url)["running"] == 1, what="the request to run")
    stopper = threading.Thread(target=running.shutdown)
    stopper.start()
    wait_until(lambda: app.state.dsi.closing, what="shutdown to begin")
    during = httpx.get(running.url + "/health", timeout=10)  # not a refused connection
    assert during.status_code == 503 and during.json()["status"] == "unavailable"
    late = httpx.post(running.url + "/v1/completions", json={"prompt": "go", "max_tokens": 2}, timeout=10)
    assert late.status_code == 503
    worker.join(60)
    stopper.join(60)
    assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 200
    with pytest.raises(httpx.ConnectError):  # once it has ended, the listener is closed
        httpx.get(running.url + "/health", timeout=5)


class Records(logging.Handler):
    """Every log record of a logger, kept (uvicorn's loggers do not propagate to caplog's root handler)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def read_stream(url, path, body, results, key, started):
    """POST a streamed request; keep every ``data:`` line, or the transport error if the connection was cut."""
    lines = []
    try:
        with httpx.stream("POST", url + path, json=body, timeout=60) as response:
            results[key + ".status"] = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    started.set()
    except httpx.HTTPError as exc:  # e.g. "incomplete chunked read": the server cut the stream
        results[key + ".error"] = exc
    results[key] = lines


def post(url, path, body, results, key):
    try:
        results[key] = httpx.post(url + path, json=body, timeout=60)
    except httpx.HTTPError as exc:
        results[key] = exc


def test_shutdown_past_the_grace_period_ends_every_stream_with_a_last_event_and_done(tiny_tokenizer, caplog):
    """Issue 49: streams running when the shutdown grace period ends were cut mid-message (no last
    event, no [DONE]) with a CancelledError traceback each. Now every running request is aborted and
    answers for itself: each unfinished choice gets a chunk with finish_reason "abort", then an error
    event, then [DONE]; a plain request gets a 503 JSON error; and the log has no traceback."""
    app = make_app(tiny_tokenizer, LONG, cycle=True, latency=SLOW, max_concurrent=4, max_queue=2, typo_every=0)
    running = Running(app, graceful_s=0.3).start()  # 2000 tokens take > 20 s: far past the grace period
    uvicorn_log = Records()
    logging.getLogger("uvicorn").addHandler(uvicorn_log)
    url, results = running.url, {}
    try:
        streams = [("completion", "/v1/completions", {"prompt": "go", "max_tokens": 2000, "stream": True}),
                   ("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}],
                                                     "max_tokens": 2000, "stream": True, "n": 2,
                                                     "temperature": 1.0, "seed": 7})]  # two jobs, two slots
        started = {key: threading.Event() for key, _, _ in streams}
        threads = [threading.Thread(target=read_stream, args=(url, path, body, results, key, started[key]))
                   for key, path, body in streams]
        threads.append(threading.Thread(target=post, args=(url, "/v1/completions",
                                                           {"prompt": "go", "max_tokens": 2000}, results, "plain")))
        for thread in threads:
            thread.start()
        for event in started.values():
            assert event.wait(30), "a stream did not start"
        wait_until(lambda: health(url)["running"] == 4, what="four slots to run")
        queued = threading.Thread(target=post, args=(url, "/v1/completions", {"prompt": "go", "max_tokens": 3},
                                                     results, "queued"))
        queued.start()
        wait_until(lambda: health(url)["queued"] == 1, what="a queued request")
        running.shutdown()  # what SIGTERM does
        for thread in [*threads, queued]:
            thread.join(30)
            assert not thread.is_alive()
    finally:
        logging.getLogger("uvicorn").removeHandler(uvicorn_log)
    for key, _, _ in streams:
        assert key + ".error" not in results, f"{key}: the stream was cut: {results.get(key + '.error')!r}"
        lines = results[key]
        assert lines[-1] == "[DONE]", lines[-3:]
        error = json.loads(lines[-2])["error"]
        assert error["code"] == "unavailable" and "shutting down" in error["message"]
        ends = [choice for line in lines[:-2] for choice in json.loads(line)["choices"] if choice["finish_reason"]]
        assert sorted((c["index"], c["finish_reason"]) for c in ends) == \
            [(i, "abort") for i in range(2 if key == "chat" else 1)]
        assert len(lines) > 5  # it did stream before the shutdown
    assert isinstance(results["plain"], httpx.Response), results["plain"]
    assert results["plain"].status_code == 503 and results["plain"].json()["error"]["code"] == "unavailable"
    assert results["queued"].status_code == 503  # told at once, as before
    problems = [r for r in [*uvicorn_log.records, *caplog.records] if r.levelno >= logging.ERROR or r.exc_info]
    assert not problems, [r.getMessage() for r in problems]


def test_a_second_ctrl_c_ends_the_grace_period_at_once(tiny_tokenizer):
    """Ctrl-C starts the grace period (running requests may finish); Ctrl-C again (uvicorn's force_exit) used to
    change nothing, so the server waited out the whole grace period. Now the wait ends at once: what still runs
    is aborted and answers for itself (its abort chunk, the error event, [DONE]), and the server stops long
    before its 600 s grace period would have ended."""
    import signal

    app = make_app(tiny_tokenizer, LONG, cycle=True, latency=SLOW, max_concurrent=1, max_queue=2, typo_every=0)
    running = Running(app, graceful_s=600.0).start()  # 4000 tokens take about 40 s
    results, started = {}, threading.Event()
    reader = threading.Thread(target=read_stream, args=(running.url, "/v1/completions",
                                                        {"prompt": "go", "max_tokens": 4000, "stream": True},
                                                        results, "stream", started))
    reader.start()
    try:
        assert started.wait(30), "the stream did not start"
        running.server.handle_exit(signal.SIGINT, None)  # Ctrl-C: what uvicorn's signal handler calls
        wait_until(lambda: app.state.dsi.closing, what="shutdown to begin")
        time.sleep(0.5)
        assert reader.is_alive() and running.thread.is_alive()  # the grace period: the stream goes on
        running.server.handle_exit(signal.SIGINT, None)  # Ctrl-C again
        running.thread.join(30)  # well before the request could have ended by itself
        assert not running.thread.is_alive(), "the server waited on after a second Ctrl-C"
        reader.join(30)
        assert not reader.is_alive()
    finally:
        if running.thread.is_alive():
            running.shutdown(timeout=5)
        running.sock.close()
    assert "stream.error" not in results, results.get("stream.error")
    lines = results["stream"]
    assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == "unavailable", lines[-3:]
    ends = [c["finish_reason"] for line in lines[:-2] for c in json.loads(line)["choices"] if c["finish_reason"]]
    assert ends == ["abort"] and len(lines) > 5
