"""Pieces of the server without HTTP: stop strings, the FIFO scheduler, request parsing."""

from __future__ import annotations

import asyncio
import re

import pytest

from dsi.server.jobs import StopStrings, cut_at_stop
from dsi.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request, unsupported_option
from dsi.server.scheduler import QueueFull, RequestCancelled, Scheduler


def feed_all(stops, pieces):
    s = StopStrings(stops)
    out = [s.feed(p) for p in pieces]
    return out, s.flush(), s.matched


def test_stop_strings_hold_back_possible_prefixes_and_cut_before_the_stop():
    out, tail, matched = feed_all(["END"], ["abc E", "N", "D more"])
    assert out == ["abc", " ", ""] and tail == "" and matched == "END"  # the last 2 chars are held back
    out, tail, matched = feed_all(["END"], ["abc E", "N", "x"])  # a false alarm is released
    assert out == ["abc", " ", "E"] and tail == "Nx" and matched is None
    out, tail, matched = feed_all(["ab", "b"], ["xab"])  # earliest occurrence wins
    assert out == ["x"] and matched == "ab"
    out, tail, matched = feed_all([], ["hé", "llo"])
    assert out == ["hé", "llo"] and tail == ""


def test_cut_at_stop():
    assert cut_at_stop("hello world", ["wor", "o"]) == ("hell", "o")
    assert cut_at_stop("hello", ["z"]) == ("hello", None)


def test_scheduler_is_fifo_bounded_and_withdraws():
    async def scenario():
        granted = []
        sched = Scheduler(["s0"], max_queue=2)  # slots are opaque to the scheduler
        first = sched.reserve()
        assert first.done() and first.result() == "s0" and sched.running == 1
        a, b = sched.reserve(), sched.reserve()
        with pytest.raises(QueueFull):
            sched.reserve()
        assert sched.queued == 2
        sched.withdraw(a, "gone")
        with pytest.raises(RequestCancelled):
            await a
        c = sched.reserve()  # room again
        for fut in (b, c):
            fut.add_done_callback(lambda f: granted.append(f))
        sched.release("s0")  # goes to b (older than c)
        await asyncio.sleep(0)
        assert granted == [b] and b.result() == "s0"
        sched.release("s0")
        await asyncio.sleep(0)
        assert granted == [b, c] and sched.queued == 0
        sched.release("s0")
        assert sched.running == 0 and sched.reserve().result() == "s0"

    asyncio.run(scenario())


@pytest.mark.parametrize("body, status, param", [
    (b"{oops", 400, None),
    (b"[1, 2]", 400, None),
    (b'{"prompt": "x", "foo": 1}', 400, "foo"),
    (b'{"prompt": "x", "max_tokens": "3"}', 422, "max_tokens"),
    (b'{"prompt": "x", "max_tokens": true}', 422, "max_tokens"),
    (b'{"prompt": "x", "temperature": -0.5}', 422, "temperature"),
    (b'{"prompt": [1, "a"]}', 422, "prompt"),
    (b'{"prompt": "x", "stop": ["", "a"]}', 422, "stop"),
    (b'{"max_tokens": 3}', 422, "prompt"),
])
def test_parse_request_errors_name_the_field(body, status, param):
    with pytest.raises(APIError) as info:
        parse_request(CompletionRequest, body)
    assert (info.value.status, info.value.param) == (status, param)
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}


def test_chat_message_errors_name_the_nested_field():
    with pytest.raises(APIError) as info:
        parse_request(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": 5}]}')
    assert info.value.status == 422 and info.value.param == "messages.0.content"


@pytest.mark.parametrize("body, param", [
    (b'{"prompt": "x", "n": 17}', "n"),
    (b'{"prompt": "x", "best_of": 2}', "best_of"),
    (b'{"prompt": "x", "suffix": "y"}', "suffix"),
])
def test_unsupported_options_are_400(body, param):
    error = unsupported_option(parse_request(CompletionRequest, body))
    assert error is not None and error.status == 400 and error.param == param


def test_supported_defaults_pass():
    req = parse_request(CompletionRequest, b'{"prompt": ["one"], "n": 1, "best_of": 1, "logprobs": null}')
    assert unsupported_option(req) is None and req.prompts() == ["one"]


def test_stop_strings_keep_only_the_text_held_back():
    """Each feed costs the same however long the output: only a possible stop prefix is kept."""
    s = StopStrings(["<END>", "zz"])
    out = [s.feed("ab <") for _ in range(10_000)]
    assert out[0] == "" and set(out[1:]) == {"ab <"} and s.held == "ab <"  # 4 = len("<END>") - 1
    assert s.feed("END> tail") == "ab " and s.matched == "<END>"


@pytest.mark.parametrize("key, problem", [
    (" s3cret", "whitespace"),
    ("s3cret\n", "whitespace"),
    ("\ts3cret", "whitespace"),
    ("clé-secrète", "position 2 that is not printable ASCII"),
    ("s3cret\x00", "position 6 that is not printable ASCII"),
    ("", "non-empty"),
])
def test_api_keys_that_no_client_could_send_are_refused_at_start_up(key, problem):
    from dsi.errors import ConfigError
    from dsi.server import ServeConfig

    with pytest.raises(ConfigError) as info:
        ServeConfig(api_key=key)
    assert problem in str(info.value) and "--api-key" in str(info.value)
    if key.strip():
        assert key.strip() not in str(info.value)  # the message never shows the key


@pytest.mark.parametrize("key", ["s3cret", "sk-AbC_123.~+/=", "two words", "!#$%&'()*"])
def test_printable_ascii_keys_are_accepted(key):
    from dsi.server import ServeConfig

    assert ServeConfig(api_key=key).api_key == key


def test_the_default_served_name_is_never_a_local_path(tmp_path):
    from dsi.cli.serve import served_name

    model_dir = tmp_path / "models" / "my-7b"
    model_dir.mkdir(parents=True)
    gguf = tmp_path / "Llama-3.2-1B.Q4_K_M.gguf"
    gguf.write_bytes(b"")
    assert served_name(str(model_dir)) == "my-7b"
    assert served_name(str(model_dir) + "/") == "my-7b"
    assert served_name(str(gguf)) == "Llama-3.2-1B.Q4_K_M"
    assert served_name("qwen2.5-coder-1.5b-instruct") == "qwen2.5-coder-1.5b-instruct"  # embedded short name
    assert served_name("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"  # a hub id, not a local path


def test_load_json_holds_at_most_two_body_sized_objects_and_stops_at_too_many_numbers():
    import tracemalloc

    from dsi.server.protocol import TooManyNumbers, load_json

    text_body = bytearray(b'{"prompt": "' + b"x" * 4_000_000 + b'"}')
    ids_body = bytearray(b'{"prompt": [' + b"1000, " * 700_000 + b'1]}')  # 4.2 MB, 700k ids
    tracemalloc.start()
    try:
        holder = [text_body]
        del text_body
        tracemalloc.reset_peak()
        value = load_json(holder.pop())
        text_peak = tracemalloc.get_traced_memory()[1]
        assert len(value["prompt"]) == 4_000_000
        del value
        size = len(ids_body)
        holder = [ids_body]
        del ids_body
        tracemalloc.reset_peak()
        with pytest.raises(TooManyNumbers) as info:
            load_json(holder.pop(), max_numbers=1000)
        ids_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert text_peak < 2.2 * 4_000_000, f"{text_peak / 1e6:.1f} MB to parse a 4 MB prompt"
    assert ids_peak < 1.2 * size, f"{ids_peak / 1e6:.1f} MB to refuse 700k token ids (a list of them is ~30 MB)"
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"
    assert load_json(b'{"prompt": [1, 2, 3], "max_tokens": 2}', max_numbers=4)["prompt"] == [1, 2, 3]


@pytest.mark.parametrize("body", [b'{"prompt": NaN}', b'{"prompt": "\\ud800"}', b"\xff", b"[1]", b"{" * 5000,
                                  b'{"prompt": 1' + b"0" * 5000 + b"}",
                                  # parses, then its surrogate is looked for in a loop, not a recursion (issue 64)
                                  b'{"prompt": ' + b"[" * 600 + b'"\\ud800"' + b"]" * 600 + b"}"])
def test_load_json_refuses_what_is_not_standard_json_with_a_400(body):
    from dsi.server.protocol import load_json

    with pytest.raises(APIError) as info:
        load_json(body)
    assert info.value.status == 400 and info.value.code == "invalid_json" and info.value.message


def test_a_slot_keeps_a_healthy_decoder_after_a_failure_and_rebuilds_a_broken_one():
    from dsi.server.scheduler import Slot

    class Fake:
        def __init__(self, healthy):
            self._healthy = healthy
            self.closed = False

        def healthy(self):
            if isinstance(self._healthy, Exception):
                raise self._healthy
            return self._healthy

        def close(self):
            self.closed = True

    for state, rebuilt in ((True, False), (False, True), (RuntimeError("cannot tell"), True)):
        built = iter([Fake(state), Fake(True)])
        slot = Slot(0, lambda: next(built))
        first = slot.decoder
        assert slot.recover() is rebuilt
        assert (slot.decoder is not first) is rebuilt and first.closed is rebuilt
        slot.close()


def test_read_body_fills_a_buffer_of_the_declared_size_and_refuses_more():
    import asyncio

    from dsi.server.limits import read_body
    from dsi.server.protocol import APIError

    def receiver(chunks, disconnect=False):
        messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
        if disconnect:
            messages = messages[:1] + [{"type": "http.disconnect"}]

        async def receive():
            return messages.pop(0)
        return receive

    chunks = [b"abc", b"", b"defgh", b"ij"]
    for size in (10, None):
        body = asyncio.run(read_body(receiver(list(chunks)), size))
        assert isinstance(body, bytearray) and body == b"abcdefghij"
    assert asyncio.run(read_body(receiver([b"abc"]), 10)) == b"abc"  # shorter than declared: what came
    with pytest.raises(APIError, match="longer than its Content-Length of 4"):
        asyncio.run(read_body(receiver(list(chunks)), 4))
    with pytest.raises(APIError, match="client closed"):
        asyncio.run(read_body(receiver(list(chunks), disconnect=True), 10))


@pytest.mark.parametrize("text", ["1,\u0665", "1,1_0", "1,+2", "1,-2", "5" * 5000, "1,0x10"])
def test_a_prompt_of_ids_without_a_tokenizer_takes_ascii_digits_only(text):
    """``dsi serve --synthetic``'s prompts ("1,2,3"): int() alone reads "٥" as 5 and "1_0" as 10 (issue 64)."""
    from dsi.errors import ConfigError
    from dsi.server.codec import IdsCodec

    codec = IdsCodec(50)
    assert codec.encode(" 1, 2,3 ,") == [1, 2, 3]
    assert codec.encode("1 2\n3  4") == [1, 2, 3, 4]  # a word-level tokenizer's text (vllm bench serve's prompts)
    assert codec.decode([1, 2, 3]) == "1,2,3"
    with pytest.raises(ConfigError, match="a prompt is token ids \\(ASCII digits\\) separated by commas or spaces"):
        codec.encode(text)


@pytest.mark.parametrize("option, value, message", [
    ("max_concurrent", 257, "max_concurrent=257 must be an integer in [1, 256] (engine slots)"),
    ("max_concurrent", 10**12, "max_concurrent=1000000000000 must be an integer in [1, 256]"),
    ("max_queue", 4097, "max_queue=4097 must be an integer in [0, 4096]"),
    ("max_queue", True, "max_queue=True must be an integer in [0, 4096]"),
])
def test_the_servers_slots_and_queue_are_bounded(option, value, message):
    """Each slot is a decoder and a thread, each queued request a body being read: a bound, named (issue 64)."""
    from dsi.errors import ConfigError
    from dsi.server import ServeConfig

    with pytest.raises(ConfigError, match=re.escape(message)):
        ServeConfig(**{option: value})
