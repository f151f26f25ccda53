"""Bounded work per request and hostile input: body size (413), content type (415), a table of
malformed or abusive requests that must each get a 4xx with a message (never a 5xx), prompts
checked against the target's context before they are tokenised in full, tokenising off the
event loop (``/health`` stays responsive), the admission bound, and answers that never carry a
local path. On scripted synthetic models with the tiny tokenizer (method 'ar': no drafter
needed) unless the drafter's context is the point."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")

from dsi.models import CallableLM  # noqa: E402
from tests.unit.server.conftest import TokenizerCodec, running_server, scripted_lm, wait_until  # noqa: E402

pytestmark = pytest.mark.hf  # the tiny tokenizer needs transformers

LIMIT = 256 * 1024  # the body limit of the servers below
SCRIPT = "hello world"


def make_app(tok, *, codec=None, max_body_bytes=LIMIT, max_queue=4, max_concurrent=1, method="ar",
             target=None, drafter=None):
    from dsi.server import ServeConfig, create_app

    vocab, eos = len(tok), tok.eos_token_id
    script = tok.encode(SCRIPT)
    target = target or scripted_lm(script, vocab, eos)
    if method != "ar":
        drafter = drafter or scripted_lm(script, vocab, eos)
    config = ServeConfig(method=method, lookahead=3, max_concurrent=max_concurrent, max_queue=max_queue,
                         model_name="scripted", temperature=0.0, max_tokens=8, max_body_bytes=max_body_bytes)
    return create_app(target, drafter, config, codec=codec or TokenizerCodec(tok, max_context=256))


@pytest.fixture(scope="module")
def server(tiny_tokenizer):
    with running_server(make_app(tiny_tokenizer)) as running:
        yield running


def post(url, path="/v1/completions", *, timeout=30, **kwargs):
    return httpx.post(url + path, timeout=timeout, **kwargs)


def assert_openai_error(r, status=None):
    assert 400 <= r.status_code < 500, f"{r.status_code}: {r.text[:300]}"
    if status is not None:
        assert r.status_code == status, r.text[:300]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def samples(url):
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics").text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def five_hundreds(url):
    return sum(s.value for s in samples(url) if s.name == "dsi_requests_total" and s.labels["status"].startswith("5"))


def metric(url, name):
    return sum(s.value for s in samples(url) if s.name == name)


# ---- body size ---------------------------------------------------------------------------------

def test_a_body_over_the_limit_is_413_naming_the_limit(server):
    r = post(server.url, content=b'{"prompt": "' + b"x" * LIMIT + b'"}', headers={"content-type": "application/json"})
    error = assert_openai_error(r, 413)
    assert f"limit of {LIMIT} bytes" in error["message"] and error["code"] == "request_too_large"
    ok = post(server.url, json={"prompt": "hi", "max_tokens": 2, "user": "u" * (LIMIT - 100)})  # just under it
    assert ok.status_code == 200, ok.text


def test_a_chunked_body_over_the_limit_is_413(server):
    def chunks():  # no Content-Length: the server must count the bytes as they arrive
        yield b'{"prompt": "'
        for _ in range(2 * LIMIT // 65536):
            yield b"y" * 65536
        yield b'"}'

    r = post(server.url, content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(r, 413)


def test_a_declared_huge_body_is_refused_before_any_of_it_is_sent(server):
    """Content-Length of 10 GB and no body at all: the 413 comes at once (nothing is read)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 10000000000\r\nExpect: 100-continue\r\n\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.partition(b"\r\n\r\n")[2]) < 100:
            data = sock.recv(65536)  # raises on timeout: the answer must not wait for a body
            assert data, f"connection closed after {reply!r}"
            reply += data
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 413"), reply
    assert "100 Continue" not in reply and f"limit of {LIMIT} bytes" in reply


# ---- hostile requests: every one is a 4xx with a message ---------------------------------------

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
HOSTILE = [
    # (what, path, raw body or JSON, headers, expected status)
    ("malformed JSON", None, b'{"prompt": ', None, 400),
    ("not UTF-8", None, b'{"prompt": "\xff\xfe"}', None, 400),
    ("a lone surrogate", None, b'{"prompt": "\\ud800"}', None, 400),
    ("a lone low surrogate in a stop string", None, b'{"prompt": "x", "stop": "a\\uDC00"}', None, 400),
    ("a lone surrogate as the model", None, b'{"prompt": "x", "model": "\\ud83d"}', None, 400),
    ("a surrogate encoded in UTF-8", None, b'{"prompt": "\xed\xa0\x80"}', None, 400),
    ("UTF-16", None, '{"prompt": "x"}'.encode("utf-16"), None, 400),
    ("-Infinity", None, b'{"prompt": "x", "top_p": -Infinity}', None, 400),
    ("nested 10000 deep", None, b'{"prompt": ' + b"[" * 10000 + b"]" * 10000 + b"}", None, 400),
    # small enough (3 KB) for the event loop's token-id fast path, which parses it first (issue 64)
    ("nested 1500 deep in 3 KB", None, b'{"prompt": ' + b"[" * 1500 + b"]" * 1500 + b"}", None, 400),
    # parsed, then too deep for what reads it next: the surrogate check, tool schemas, tool-call arguments
    ("nested 600 deep with a lone surrogate", None, b'{"prompt": ' + b"[" * 600 + b'"\\ud800"' + b"]" * 600 + b"}",
     None, 400),
    ("chat: tool parameters nested 600 deep", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], '
     b'"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": '
     + b'{"a": ' * 600 + b"1" + b"}" * 600 + b"}}]}", None, 400),
    ("chat: tool-call arguments nested 900 deep", CHAT, {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
            {"id": "c", "function": {"name": "f", "arguments": "[" * 900 + "]" * 900}}]}]}, None, 400),
    ("a schema as text with a number of 5000 digits", None, {"prompt": "x", "guided_json": '{"maximum": 1' + "0" * 5000
                                                              + "}"}, None, 400),
    ("a JSON array", None, b"[1, 2]", None, 400),
    ("JSON null", None, b"null", None, 400),
    ("an empty body", None, b"", None, 400),
    ("text/plain", None, b'{"prompt": "x"}', {"content-type": "text/plain"}, 415),
    ("a form", None, b"prompt=x", {"content-type": "application/x-www-form-urlencoded"}, 415),
    ("multipart", None, b"--b\r\n\r\nx\r\n--b--", {"content-type": "multipart/form-data; boundary=b"}, 415),
    ("max_tokens negative", None, {"prompt": "x", "max_tokens": -5}, None, 422),
    ("max_tokens zero", None, {"prompt": "x", "max_tokens": 0}, None, 400),  # allowed only with echo (scoring)
    ("max_tokens a float", None, {"prompt": "x", "max_tokens": 2.5}, None, 422),
    ("max_tokens a string", None, {"prompt": "x", "max_tokens": "8"}, None, 422),
    ("max_tokens huge", None, {"prompt": "x", "max_tokens": 10**100}, None, 400),
    ("max_tokens beyond JSON's range", None, b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None, 400),
    ("temperature infinite", None, b'{"prompt": "x", "temperature": 1e999}', None, 422),
    ("temperature NaN", None, b'{"prompt": "x", "temperature": NaN}', None, 400),
    ("temperature negative", None, {"prompt": "x", "temperature": -1e-300}, None, 422),
    ("top_p zero", None, {"prompt": "x", "top_p": 0.0}, None, 422),
    ("top_p above 1", None, {"prompt": "x", "top_p": 1.5}, None, 422),
    ("top_k below -1", None, {"prompt": "x", "top_k": -2}, None, 422),
    ("seed above 2**63", None, {"prompt": "x", "seed": 2**64}, None, 422),
    ("seed negative", None, {"prompt": "x", "seed": -1}, None, 422),
    ("n = 17", None, {"prompt": "x", "n": 17}, None, 400),
    ("n negative", None, {"prompt": "x", "n": -1}, None, 422),
    ("n huge", None, {"prompt": "x", "n": 10**30}, None, 400),
    ("n a string", None, {"prompt": "x", "n": "1"}, None, 422),
    ("best_of 0", None, {"prompt": "x", "best_of": 0}, None, 400),
    ("logprobs above --max-logprobs", None, {"prompt": "x", "logprobs": 21}, None, 400),
    ("logprobs huge", None, {"prompt": "x", "logprobs": 10**30}, None, 400),
    ("logprobs negative", None, {"prompt": "x", "logprobs": -1}, None, 422),
    ("logit_bias over 1024 entries", None, {"prompt": "x", "logit_bias": {str(i): 1.0 for i in range(1025)}}, None, 422),
    ("logit_bias an id beyond the vocabulary", None, {"prompt": "x", "logit_bias": {str(10**9): 1.0}}, None, 400),
    # OpenAI's keys are ASCII digit strings, at most 10 of them (issue 64: "²" and 5000 digits were 500s, "٥" was 5)
    ("logit_bias a key of 31 digits", None, {"prompt": "x", "logit_bias": {str(10**30): 1.0}}, None, 422),
    ("logit_bias a key of 5000 digits", None, {"prompt": "x", "logit_bias": {"5" * 5000: 1.0}}, None, 422),
    ("logit_bias a superscript two", None, {"prompt": "x", "logit_bias": {"²": 1}}, None, 422),
    ("logit_bias an Arabic-Indic five", None, {"prompt": "x", "logit_bias": {"٥": 1}}, None, 422),
    ("chat: logit_bias a superscript two", CHAT, {"messages": MSG, "logit_bias": {"²": 1}}, None, 422),
    ("logit_bias a list", None, {"prompt": "x", "logit_bias": [[1, 2.0]]}, None, 422),
    ("stop_token_ids over 64", None, {"prompt": "x", "stop_token_ids": list(range(65))}, None, 422),
    ("presence_penalty a string", None, {"prompt": "x", "presence_penalty": "1"}, None, 422),
    ("repetition_penalty negative", None, {"prompt": "x", "repetition_penalty": -1.0}, None, 422),
    ("logprobs true on completions", None, {"prompt": "x", "logprobs": True}, None, 422),
    ("stop a number", None, {"prompt": "x", "stop": 5}, None, 422),
    ("stop empty", None, {"prompt": "x", "stop": ""}, None, 422),
    ("17 stop strings", None, {"prompt": "x", "stop": [str(i) for i in range(17)]}, None, 422),
    ("a stop string of 5000 characters", None, {"prompt": "x", "stop": "s" * 5000}, None, 422),
    ("stream a string", None, {"prompt": "x", "stream": "yes"}, None, 422),
    ("stream_options unknown field", None, {"prompt": "x", "stream_options": {"x": 1}}, None, 400),
    ("an unknown field", None, {"prompt": "x", "frobnicate": 1}, None, 400),
    ("no prompt", None, {"max_tokens": 2}, None, 422),
    ("prompt a number", None, {"prompt": 7}, None, 422),
    ("prompt an empty list", None, {"prompt": []}, None, 400),  # empty_prompt, like [[]] (issue 49)
    ("prompt an empty id list", None, {"prompt": [[]]}, None, 400),
    ("prompt mixed ids and text", None, {"prompt": [1, "a"]}, None, 422),
    ("prompt ids as floats", None, {"prompt": [1.0, 2.0]}, None, 422),
    ("a batch with a prompt beyond the context", None, {"prompt": ["a", "word " * 2000]}, None, 400),
    ("a batch with a token id beyond the vocabulary", None, {"prompt": [[1], [1, 10**6]]}, None, 400),
    ("a token id beyond the vocabulary", None, {"prompt": [1, 10**6]}, None, 400),
    ("a token id beyond the vocabulary, echoed", None, {"prompt": [1, 10**6], "echo": True}, None, 400),
    ("a negative token id, echoed", None, {"prompt": [-1], "echo": True}, None, 400),
    ("a token id over 2**64, echoed and streamed", None, {"prompt": [2**70], "echo": True, "stream": True}, None, 400),
    ("another model", None, {"prompt": "x", "model": "gpt-4"}, None, 404),
    ("a prompt beyond the context", None, {"prompt": "word " * 2000}, None, 400),
    ("token ids beyond the context", None, {"prompt": list(range(300))}, None, 400),
    ("chat: messages missing", CHAT, {"max_tokens": 2}, None, 422),
    ("chat: messages empty", CHAT, {"messages": []}, None, 422),
    ("chat: messages an object", CHAT, {"messages": {"role": "user"}}, None, 422),
    ("chat: a message without role", CHAT, {"messages": [{"content": "x"}]}, None, 422),
    ("chat: a tool message", CHAT, {"messages": [{"role": "tool", "content": "x"}]}, None, 422),
    ("chat: an image part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     None, 400),
    ("chat: content null", CHAT, {"messages": [{"role": "user", "content": None}]}, None, 422),
    ("chat: top_logprobs without logprobs", CHAT, {"messages": MSG, "top_logprobs": 3}, None, 400),
    ("chat: top_logprobs negative", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": -1}, None, 422),
    ("chat: top_logprobs", CHAT, {"messages": MSG, "top_logprobs": 3}, None, 400),
    ("chat: a response_format of another kind", CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, None, 422),
    ("chat: json_schema without its schema", CHAT, {"messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x"}}}, None, 400),
    ("a schema that is no schema", None, {"prompt": "x", "guided_json": {"type": "bogus"}}, None, 400),
    ("a regex that does not parse", None, {"prompt": "x", "guided_regex": "a[12"}, None, 400),
    ("a GBNF grammar that does not parse", None, {"prompt": "x", "grammar": "root ::= "}, None, 400),
    ("two constraints at once", None, {"prompt": "x", "guided_regex": "a+", "guided_choice": ["a"]}, None, 400),
    ("structured_outputs with two kinds", None, {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
     None, 400),
    ("structured_outputs with an unknown kind", None, {"prompt": "x", "structured_outputs": {"xml": "a"}}, None, 400),
    ("chat: tools without tool_choice (auto)", CHAT, {"messages": MSG, "tools": [
        {"type": "function", "function": {"name": "f"}}]}, None, 400),
    ("chat: 129 tools", CHAT, {"messages": MSG, "tools": [
        {"type": "function", "function": {"name": f"f{i}"}} for i in range(129)], "tool_choice": "required"}, None, 422),
    ("chat: max_completion_tokens negative", CHAT, {"messages": MSG, "max_completion_tokens": -1}, None, 422),
    ("chat: beyond the context", CHAT, {"messages": [{"role": "user", "content": "word " * 2000}]}, None, 400),
]


@pytest.mark.parametrize("what, path, body, headers, status", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_requests_get_a_4xx_with_a_message(server, what, path, body, headers, status):
    kwargs = {"content": body} if isinstance(body, bytes) else {"content": json.dumps(body).encode()}
    headers = headers or {"content-type": "application/json"}
    r = post(server.url, path or "/v1/completions", headers=headers, **kwargs)
    assert_openai_error(r, status)


def test_after_the_hostile_table_nothing_was_a_5xx_and_the_server_serves(server):
    for what, path, body, headers, _ in HOSTILE:  # (again, in one go: a 5xx here names its case)
        kwargs = {"content": body} if isinstance(body, bytes) else {"content": json.dumps(body).encode()}
        r = post(server.url, path or "/v1/completions", headers=headers or {"content-type": "application/json"},
                 **kwargs)
        assert r.status_code < 500, f"{what}: {r.status_code} {r.text[:200]}"
    assert five_hundreds(server.url) == 0
    r = post(server.url, json={"prompt": "hi", "max_tokens": 20})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == SCRIPT
    # valid extremes are served, not refused: no Content-Type, top_k far above the vocabulary
    r = post(server.url, content=json.dumps({"prompt": "hi", "top_k": 10**30, "temperature": 1e300}).encode())
    assert r.status_code == 200, r.text
    r = post(server.url, content=b'{"prompt": "hi \\ud83d\\ude00", "max_tokens": 2}')  # a paired escape: an emoji
    assert r.status_code == 200, r.text
    # a temperature so small that logits / temperature overflows: greedy, or refused; never a 5xx
    r = post(server.url, json={"prompt": "hi", "max_tokens": 20, "temperature": 1e-320})
    assert r.status_code in (200, 422), r.text
    assert r.status_code == 422 or r.json()["choices"][0]["text"] == SCRIPT


def test_echoed_token_ids_are_validated_before_they_are_decoded(tiny_tokenizer):
    """The issue's 500: echo decoded the ids before checking them. The decoder must never see them."""
    decoded = []

    class Watching(TokenizerCodec):
        def decode(self, ids):
            decoded.append(list(ids))
            return super().decode(ids)

    with running_server(make_app(tiny_tokenizer, codec=Watching(tiny_tokenizer, max_context=256))) as running:
        r = post(running.url, json={"prompt": [5, 2**40], "echo": True, "max_tokens": 2})
        error = assert_openai_error(r, 400)
        assert error["param"] == "prompt" and "prompt[1]" in error["message"]
        assert not any(2**40 in ids for ids in decoded)
        ok = post(running.url, json={"prompt": [5, 6], "echo": True, "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"].startswith(tiny_tokenizer.decode([5, 6]))


# ---- prompt length: checked against the target, before the prompt is tokenised in full -----------

class Counting(TokenizerCodec):
    """Counts the characters it was asked to tokenise."""

    def __init__(self, tok, max_context):
        super().__init__(tok, max_context)
        self.chars = 0

    def _encode(self, text, special=True):
        self.chars += len(text)
        return super()._encode(text, special)


@pytest.mark.parametrize("path", ["/v1/completions", CHAT])
def test_a_prompt_far_beyond_the_context_is_refused_after_tokenising_a_prefix(tiny_tokenizer, path):
    codec = Counting(tiny_tokenizer, max_context=256)
    text = "the quick brown fox " * 50_000  # 1 MB, ~250k tokens for a context of 256
    body = {"prompt": text} if path != CHAT else {"messages": [{"role": "user", "content": text}]}
    with running_server(make_app(tiny_tokenizer, codec=codec, max_body_bytes=4 * 2**20)) as running:
        r = post(running.url, path, json=body)
    error = assert_openai_error(r, 400)
    assert error["code"] == "context_length_exceeded" and "at least" in error["message"]
    assert codec.chars < 20_000, f"{codec.chars} characters tokenised to refuse a prompt for a context of 256"


def test_a_prompt_within_the_context_is_never_refused_by_the_early_check(tiny_tokenizer):
    """Prompts near the limit, some with words longer than the probe: the exact count decides."""
    from dsi.server.codec import PromptTooLong, encode_within

    codec = Counting(tiny_tokenizer, max_context=None)
    texts = ["the quick brown fox " * 40, "日本語のテキスト" * 60, "a" * 3000, "1234567890" * 200,
             "héllo wörld, naïve café " * 30, "x\n\t" * 500]
    for text in texts:
        ids = codec.encode(text)
        n = len(ids)
        assert encode_within(codec._encode, text, n) == ids  # exactly at the limit: accepted, same ids
        with pytest.raises(PromptTooLong) as info:
            encode_within(codec._encode, text, n - 1)
        assert info.value.count <= n  # "at least" is a true lower bound
        for limit in (n // 8, n // 3):
            with pytest.raises(PromptTooLong) as info:
                encode_within(codec._encode, text, limit)
            assert limit < info.value.count <= n


def test_a_prefix_cut_inside_a_word_never_makes_a_prompt_too_long():
    """A toy tokenizer where a known word is 1 token and a cut word 1 token per character: cutting
    a prefix mid-word would count more tokens than the whole text has (a false refusal)."""
    from dsi.server.codec import PromptTooLong, encode_within

    word = "abcdefghij" * 4  # 40 characters: a cut word counts up to 39 tokens, more than PROBE_SLACK

    def toy(text):
        return [t for w in text.split() for t in ([0] if w == word else range(len(w)))]

    for m in range(10, 60):  # every prefix tried (8 * (m + 1) characters or more) has a space to cut at
        text = (word + " ") * m
        assert encode_within(toy, text, m) == [0] * m
        with pytest.raises(PromptTooLong):
            encode_within(toy, text, m - 1)


def test_requests_are_checked_against_the_targets_context_not_the_drafters(tiny_tokenizer):
    """A drafter with a context of 16 tokens does not limit requests (the engine goes on with the
    target's own tokens); a target that declares 64 does, before the request is queued."""
    tok = tiny_tokenizer
    vocab, eos, script = len(tok), tok.eos_token_id, tok.encode(SCRIPT)
    target = scripted_lm(script, vocab, eos)
    small = CallableLM(scripted_lm(script, vocab, eos).next_logits, vocab, name="short drafter", max_context=16)
    prompt = "the quick brown fox " * 8  # ~40 tokens: more than the drafter holds
    app = make_app(tok, method="dsi", target=target, drafter=small, codec=TokenizerCodec(tok, max_context=256))
    with running_server(app) as running:
        r = post(running.url, json={"prompt": prompt, "max_tokens": 20})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == SCRIPT
    declared = CallableLM(target.next_logits, vocab, name="target", max_context=64)
    with running_server(make_app(tok, target=declared, codec=TokenizerCodec(tok, max_context=4096))) as running:
        r = post(running.url, json={"prompt": "word " * 100, "max_tokens": 4})
        error = assert_openai_error(r, 400)
        assert error["code"] == "context_length_exceeded" and "context of 64 tokens" in error["message"]
        assert metric(running.url, "dsi_queue_time_seconds_count") == 0  # never queued
        models = httpx.get(running.url + "/v1/models").json()
        assert models["data"][0]["max_model_len"] == 64


# ---- tokenising off the event loop, and the admission bound -------------------------------------

class Slow(TokenizerCodec):
    """Tokenising takes ``delay`` seconds (sleeping: the GIL is free, as in a Rust tokenizer)."""

    def __init__(self, tok, delay):
        super().__init__(tok, max_context=256)
        self.delay = delay

    def _encode(self, text, special=True):
        time.sleep(self.delay)
        return super()._encode(text, special)


def poll_health(url, stop, latencies):
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            start = time.monotonic()
            assert client.get(url + "/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.01)


def generate_while_polling(url, body, **kwargs):
    stop, latencies = threading.Event(), []
    poller = threading.Thread(target=poll_health, args=(url, stop, latencies))
    poller.start()
    try:
        time.sleep(0.05)
        start = time.monotonic()
        r = post(url, json=body, timeout=120, **kwargs)
        elapsed = time.monotonic() - start
    finally:
        stop.set()
        poller.join(30)
    return r, elapsed, latencies


def test_tokenising_does_not_block_the_event_loop(tiny_tokenizer):
    with running_server(make_app(tiny_tokenizer, codec=Slow(tiny_tokenizer, delay=1.5))) as running:
        r, elapsed, latencies = generate_while_polling(running.url, {"prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200 and elapsed >= 1.5
    # a blocked loop answers /health after the whole 1.5 s tokenisation; 1 s leaves room for a busy machine's pauses
    # (0.75 s failed once at 0.755 s in a full run)
    assert len(latencies) >= 10 and max(latencies) < 1.0, f"/health took up to {max(latencies):.2f} s"


def test_a_small_token_id_completion_is_prepared_on_the_loop_and_text_on_the_threads(tiny_tokenizer):
    """What a dsi verifying on this server sends skips the preparation threads' hand-offs; a text prompt,
    a chat, a large body and a body that is not JSON still go there."""
    app = make_app(tiny_tokenizer)
    with running_server(app) as running:
        pool = app.state.dsi._prepare_pool
        submitted = []
        original = pool.submit

        def counting(fn, *args, **kwargs):
            submitted.append(fn)
            return original(fn, *args, **kwargs)

        pool.submit = counting
        try:
            assert post(running.url, json={"prompt": [5, 6, 7], "max_tokens": 2}).status_code == 200
            assert post(running.url, json={"prompt": [[5, 6, 7]], "max_tokens": 2}).status_code == 200
            assert submitted == []
            assert post(running.url, json={"prompt": "hi", "max_tokens": 2}).status_code == 200
            assert len(submitted) == 1
            assert post(running.url, json={"prompt": [5] * 3000, "max_tokens": 2}).status_code in (200, 400)
            assert len(submitted) == 2
            assert post(running.url, content=b'{"prompt": [5, 6', headers={"content-type": "application/json"}
                        ).status_code == 400
            assert len(submitted) == 3
            assert post(running.url, "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                  "max_tokens": 2}).status_code == 200
            assert len(submitted) == 4, submitted
        finally:
            del pool.submit


def test_requests_being_prepared_count_against_the_queue_bound(tiny_tokenizer):
    """max_queue=0 and one slot: one request may be in preparation; a second one gets 429 at once."""
    app = make_app(tiny_tokenizer, codec=Slow(tiny_tokenizer, delay=1.0), max_queue=0, max_concurrent=1)
    with running_server(app) as running:
        first = {}
        thread = threading.Thread(target=lambda: first.setdefault("r", post(running.url, json={"prompt": "a"})))
        thread.start()
        wait_until(lambda: httpx.get(running.url + "/health").json()["preparing"] == 1, what="a request in preparation")
        start = time.monotonic()
        r = post(running.url, json={"prompt": "b"})
        assert time.monotonic() - start < 0.5
        error = assert_openai_error(r, 429)
        assert error["code"] == "queue_full" and r.headers["retry-after"] == "1"
        thread.join(30)
        assert first["r"].status_code == 200
        assert httpx.get(running.url + "/health").json()["preparing"] == 0


def test_more_generations_than_the_server_can_ever_hold_is_a_400_not_a_429(tiny_tokenizer):
    """One slot and a queue of 2 hold 3 generations at most: n=4 sampled could never be admitted, so it is
    a 400 naming n and the limit (a 429 would be retried forever, issue 64); n=3 is served, greedy n=4 is
    one generation, and a batch counts prompts x n (:func:`dsi.server.prepare.check_jobs`)."""
    app = make_app(tiny_tokenizer, max_queue=2, max_concurrent=1)
    with running_server(app) as running:
        for path, body in (("/v1/completions", {"prompt": "a"}), (CHAT, {"messages": MSG})):
            r = post(running.url, path, json={**body, "n": 4, "temperature": 1.0, "max_tokens": 2})
            error = assert_openai_error(r, 400)
            assert error["param"] == "n" and error["code"] == "invalid_value" and "retry-after" not in r.headers
            assert "n=4 needs 4 generations at once" in error["message"]
            assert "max_concurrent + max_queue = 1 + 2 = 3" in error["message"]
            ok = post(running.url, path, json={**body, "n": 3, "temperature": 1.0, "max_tokens": 2})
            assert ok.status_code == 200 and len(ok.json()["choices"]) == 3, ok.text
            greedy = post(running.url, path, json={**body, "n": 4, "temperature": 0.0, "max_tokens": 2})
            assert greedy.status_code == 200 and len(greedy.json()["choices"]) == 4, greedy.text
        error = assert_openai_error(post(running.url, json={"prompt": ["a", "b"], "n": 2, "temperature": 1.0}), 400)
        assert error["param"] == "n" and "2 prompts x n=2 needs 4 generations" in error["message"]
        error = assert_openai_error(post(running.url, json={"prompt": ["a", "b", "c", "d"], "temperature": 1.0}), 400)
        assert error["param"] == "prompt" and "4 prompts x n=1 needs 4 generations" in error["message"]


@pytest.mark.parametrize("key", ["²", "٥", "5" * 5000, "-1", "0x1", " 7"])
def test_a_logit_bias_key_that_is_not_ascii_digits_is_a_422_naming_logit_bias(server, key):
    for path, body in (("/v1/completions", {"prompt": "x"}), (CHAT, {"messages": MSG})):
        error = assert_openai_error(post(server.url, path, json={**body, "logit_bias": {key: 1}}), 422)
        assert error["param"] == "logit_bias" and "must be a token id: 1 to 10 ASCII digits" in error["message"]
        assert len(error["message"]) < 300  # a long key is cut in the message


@pytest.mark.slow
def test_a_large_prompt_leaves_health_responsive(tiny_tokenizer):
    """A 3 MB prompt tokenised in full (the context is large enough not to refuse it early) with
    the real tiny tokenizer: seconds of tokenising, /health answers throughout."""
    codec = TokenizerCodec(tiny_tokenizer, max_context=1_000_000)  # ~2M tokens: refused after the exact count
    app = make_app(tiny_tokenizer, codec=codec, max_body_bytes=8 * 2**20)
    with running_server(app) as running:
        r, elapsed, latencies = generate_while_polling(running.url, {"prompt": "The quick brown fox. " * 150_000})
    error = assert_openai_error(r, 400)
    assert error["code"] == "context_length_exceeded" and "at least" not in error["message"]  # the exact count
    assert len(latencies) >= 10, f"only {len(latencies)} health checks in {elapsed:.1f} s"
    assert max(latencies) < 1.0, f"/health took up to {max(latencies):.2f} s while a prompt was tokenised"


# ---- no local paths in answers -------------------------------------------------------------------

def test_an_unexpected_error_is_a_500_without_its_message(tiny_tokenizer, caplog):
    class Broken(TokenizerCodec):
        def _encode(self, text, special=True):
            raise RuntimeError("cannot read /home/alice/models/secret-7b/tokenizer.json")

    with running_server(make_app(tiny_tokenizer, codec=Broken(tiny_tokenizer))) as running:
        r = post(running.url, json={"prompt": "hi"})
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["code"] == "internal_error" and "RuntimeError" in error["message"]
        assert "/home/alice" not in r.text and "Traceback" not in r.text
        assert any("/home/alice" in (rec.exc_text or "") for rec in caplog.records)  # logged, not answered
        assert httpx.get(running.url + "/health").status_code == 200


@pytest.mark.parametrize("path, prompt_param", [("/v1/completions", "prompt"), (CHAT, "messages")])
def test_a_prompt_too_long_by_itself_names_the_prompt_and_one_that_only_needs_fewer_tokens_names_max_tokens(
        server, tiny_tokenizer, path, prompt_param):
    def body(text, max_tokens):
        key = {"prompt": text} if path != CHAT else {"messages": [{"role": "user", "content": text}]}
        return {**key, "max_tokens": max_tokens}

    alone = assert_openai_error(post(server.url, path, json=body("x " * 400, 4)), 400)  # > 256 by itself
    assert alone["param"] == prompt_param and "alone fills the model's context of 256" in alone["message"]
    ids = len(tiny_tokenizer.encode("word " * 40))
    together = assert_openai_error(post(server.url, path, json=body("word " * 40, 256 - ids + 8)), 400)
    assert together["param"] == "max_tokens" and "lower max_tokens" in together["message"]


def test_decoding_is_not_held_up_by_a_prompt_being_tokenised(tiny_tokenizer):
    """HFCodec: a long prompt's tokenisation (a preparation thread, holding the encoder) used to hold the one lock
    every decode takes, so slot threads' text and the event loop's logprob names waited for it: every stream
    paused. Decoding has a copy of the tokenizer and a lock of its own; it gives HFModel.decode's text (special
    tokens skipped or kept, ids past the tokenizer as nothing) and refuses an id out of range alike."""
    import copy
    from types import SimpleNamespace

    from dsi.errors import ConfigError
    from dsi.server.codec import HFCodec

    tok = copy.deepcopy(tiny_tokenizer)
    codec = HFCodec(SimpleNamespace(tokenizer=tok, vocab_size=len(tok) + 2, eos_token_ids=[tok.eos_token_id],
                                    max_context=None, name="tiny"))
    inside, release = threading.Event(), threading.Event()
    encode = tok.encode

    def slow_encode(*args, **kwargs):  # a tokenisation that takes as long as the test says
        inside.set()
        assert release.wait(30)
        return encode(*args, **kwargs)

    tok.encode = slow_encode
    encoder = threading.Thread(target=codec.encode, args=("a long prompt",), kwargs={"add_special_tokens": False})
    encoder.start()
    try:
        assert inside.wait(10)
        decoded = {}
        decoder = threading.Thread(target=lambda: decoded.setdefault("text", codec.decode([5, 6, 7])))
        decoder.start()
        decoder.join(10)  # the encode is still underway: it waits on `release`
        assert "text" in decoded, "a decode waited for a prompt's tokenisation"
    finally:
        release.set()
        encoder.join(30)
    ids = [tok.eos_token_id, 5, 6, len(tok) + 1]
    assert decoded["text"] == tiny_tokenizer.decode([5, 6, 7])
    assert codec.decode(ids) == tiny_tokenizer.decode(ids[:-1], skip_special_tokens=True)
    assert codec.decode(ids, skip_special_tokens=False) == tiny_tokenizer.decode(ids[:-1], skip_special_tokens=False)
    with pytest.raises(ConfigError, match="tiny"):
        codec.decode([len(tok) + 2])


def test_a_tokenizer_that_cannot_be_copied_still_serves(tiny_tokenizer, monkeypatch, caplog):
    """A Hugging Face tokenizer the decoding copy cannot be made of (a user's own kind): the server still starts
    and decodes, under the encoder's one lock, and says why at INFO."""
    import copy
    import logging
    from types import SimpleNamespace

    from dsi.server import codec as codec_module

    def refuse(obj, memo=None):
        raise TypeError("cannot pickle 'SomeHandle' object")

    tok = copy.deepcopy(tiny_tokenizer)
    monkeypatch.setattr(codec_module.copy, "deepcopy", refuse)
    with caplog.at_level(logging.INFO, logger="dsi.server.codec"):
        codec = codec_module.HFCodec(SimpleNamespace(tokenizer=tok, vocab_size=len(tok), eos_token_ids=[],
                                                     max_context=None, name="tiny", decode=tok.decode))
    assert "could not be copied for decoding (TypeError: cannot pickle 'SomeHandle' object)" in caplog.text
    assert codec.decode([5, 6, 7]) == tiny_tokenizer.decode([5, 6, 7])
    assert codec.decode(codec.encode("a b", add_special_tokens=False)) == tiny_tokenizer.decode(
        tiny_tokenizer.encode("a b", add_special_tokens=False))
