"""The client side of draws made inside an engine (dsi.models.engines.draws, dsi.coupling) without an engine:
the request a draw sends, which answers are believed, which requests an engine that draws may serve, and that a
decoder runs those with coupled draws."""

from __future__ import annotations

from dataclasses import replace

import pytest

import dsi
from dsi.engine.lifecycle import prepare_request
from dsi.errors import ConfigError, ServerLost
from dsi.models.engines import draws
from dsi.models.engines.target import EngineInfo, EngineTarget


class Conn:
    """A connection that records the request and gives a set answer."""

    def __init__(self, answer):
        self.answer, self.sent = answer, None

    def request(self, method, path, payload=None, cancel=None):
        self.sent = (method, path, payload)
        return self.answer


def choice(index, *tokens):
    return {"index": index, "text": "", "logprobs": {"tokens": list(tokens), "token_logprobs": [-1.0] * len(tokens)}}


def answer(tokens, model="m", order=None):
    order = range(len(tokens)) if order is None else order
    return {"model": model, "choices": [choice(i, f"token_id:{tokens[i]}") for i in order]}


def test_a_draw_is_one_request_of_prompts_and_its_tokens_come_back_in_prompt_order():
    conn = Conn(answer([7, 8, 9], order=[2, 0, 1]))
    params = dsi.SamplingParams(temperature=0.7, top_k=4, top_p=0.9, min_p=0.1, seed=12)
    assert draws.draw_tokens(conn, "u", "m", [[1], [1, 2], [1, 2, 3]], draws.args(params)) == [7, 8, 9]
    method, path, body = conn.sent
    assert (method, path) == ("POST", "/completions")
    assert body["prompt"] == [[1], [1, 2], [1, 2, 3]] and body["max_tokens"] == 1 and body["temperature"] == 0.0
    assert body["logprobs"] == 0 and body["return_tokens_as_token_ids"] is True
    assert "return_token_ids" not in body  # it would echo every prompt's ids: an answer growing with the context
    one = Conn(answer([6]))
    assert draws.draw_tokens(one, "u", "m", [[4, 5]], {}) == [6]
    assert one.sent[2]["prompt"] == [4, 5]  # one prompt: no batch (the start check's probe and draw)
    assert body["vllm_xargs"] == {"dsi_seed": 12, "dsi_temperature": 0.7, "dsi_top_k": 4, "dsi_top_p": 0.9,
                                  "dsi_min_p": 0.1}


@pytest.mark.parametrize("bad, what", [
    (answer([1]), "1 choices for 2 prompts"),
    (answer([1, 2], model="other"), "served model 'other'"),
    ({"model": "m", "choices": [choice(0, "token_id:1"), choice(0, "token_id:1")]}, "index is 0"),
    ({"model": "m", "choices": [choice(0), choice(1, "token_id:1")]}, "no logprobs.tokens"),
    ({"model": "m", "choices": [choice(0, "token_id:1", "token_id:2"), choice(1, "token_id:1")]}, "no logprobs"),
    ({"model": "m", "choices": [choice(0, "token_id:-1"), choice(1, "token_id:1")]}, "no logprobs"),
    ({"model": "m", "choices": [choice(0, "hello"), choice(1, "token_id:1")]}, "no logprobs"),
    ({"model": "m", "choices": [choice(0, 5), choice(1, "token_id:1")]}, "no logprobs"),
    ({"model": "m", "choices": [{"index": 0, "logprobs": None}, choice(1, "token_id:1")]}, "no logprobs"),
    ([], "not a JSON object"),
])
def test_a_draw_answer_of_another_shape_is_a_lost_server(bad, what):
    with pytest.raises(ServerLost, match="answered a draw inconsistently") as info:
        draws.draw_tokens(Conn(bad), "http://e/v1", "m", [[1], [1, 2]], {})
    assert what in str(info.value)


def engines(*infos):
    """An EngineTarget over the engines described (no connection made)."""
    target = object.__new__(EngineTarget)
    target.engines = {info.url: info for info in infos}
    target.vocab_size = 100
    return target


def info(url, full_rows=True, draws_=True):
    return EngineInfo(url, "m", "openai", 256, 100 if full_rows else None, full_rows, None if full_rows else 1, None,
                      draws=draws_)


def test_engines_that_draw_serve_any_sampling_they_process_without_whole_rows():
    drawing = engines(info("http://a/v1", full_rows=False), info("http://b/v1", full_rows=False))
    drawing.check_sampling(dsi.SamplingParams(temperature=0.8, top_p=0.9))  # no top_k needed: a token a row
    assert drawing.draws(dsi.SamplingParams(temperature=0.8, min_p=0.1))
    with pytest.raises(ConfigError, match="penalties"):  # processing the engine does not make needs whole rows
        drawing.check_sampling(dsi.SamplingParams(temperature=0.8, repetition_penalty=1.2))
    with pytest.raises(ConfigError, match="logprobs"):  # so do logprobs
        drawing.check_sampling(dsi.SamplingParams(temperature=0.8), whole_rows=True)
    mixed = engines(info("http://a/v1", full_rows=False), info("http://b/v1", full_rows=False, draws_=False))
    assert not mixed.draws(dsi.SamplingParams(temperature=0.8))
    with pytest.raises(ConfigError, match="top_k=0"):
        mixed.check_sampling(dsi.SamplingParams(temperature=0.8))


def test_a_decoder_runs_a_request_the_engines_draw_with_coupled_draws():
    drawing = engines(info("http://a/v1"))
    sampled = dsi.make_request([1, 2], 4, dsi.SamplingParams(temperature=0.9, seed=3))
    assert prepare_request(sampled, drawing).sampling == replace(sampled.sampling, coupled=True)
    for kept in (dsi.make_request([1, 2], 4, dsi.SamplingParams()),  # greedy
                 dsi.make_request([1, 2], 4, dsi.SamplingParams(temperature=0.9, frequency_penalty=0.3)),
                 dsi.make_request([1, 2], 4, dsi.SamplingParams(temperature=0.9), logprobs=2)):
        assert prepare_request(kept, drawing).sampling.coupled is False
    assert prepare_request(sampled, engines(info("http://a/v1", draws_=False))).sampling.coupled is False
