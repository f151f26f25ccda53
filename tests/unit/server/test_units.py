"""Pieces of the server without HTTP: stop strings, the FIFO scheduler, request parsing."""

from __future__ import annotations

import asyncio

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
    (b'{"prompt": "x", "n": 2}', "n"),
    (b'{"prompt": "x", "best_of": 2}', "best_of"),
    (b'{"prompt": "x", "logprobs": 1}', "logprobs"),
    (b'{"prompt": "x", "suffix": "y"}', "suffix"),
    (b'{"prompt": "x", "presence_penalty": 0.5}', "presence_penalty"),
    (b'{"prompt": ["a", "b"]}', "prompt"),
])
def test_unsupported_options_are_400(body, param):
    error = unsupported_option(parse_request(CompletionRequest, body))
    assert error is not None and error.status == 400 and error.param == param


def test_supported_defaults_pass():
    req = parse_request(CompletionRequest, b'{"prompt": ["one"], "n": 1, "best_of": 1, "logprobs": null}')
    assert unsupported_option(req) is None and req.single_prompt() == "one"
