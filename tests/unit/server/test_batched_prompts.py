"""A batch of prompts in one ``/v1/completions`` request (a list of strings or of token-id lists), answered
as vLLM answers it: prompt k's choice i is choice ``k * n + i``, each exactly what the prompt alone gets,
usage summed over every prompt (each counted once) and every choice; streamed chunks carry the index.
On the tiny random Hugging Face pair under a real uvicorn, driven by the openai client and raw HTTP."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.unit.server.conftest import running_server  # noqa: E402

pytestmark = pytest.mark.hf

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_pair):
    from dsi.server import ServeConfig, create_app

    target, drafter = tiny_pair
    config = ServeConfig(method="dsi", lookahead=3, num_target_servers=2, max_concurrent=3, max_queue=16,
                         model_name=MODEL, max_tokens=8)
    with running_server(create_app(target, drafter, config)) as running:
        yield running.url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=60)


def alone(client, prompt, **kwargs):
    """The answer to ``prompt`` sent by itself."""
    return client.completions.create(model=MODEL, prompt=prompt, **kwargs)


def test_each_prompt_of_a_batch_gets_its_n_choices_numbered_prompt_times_n_plus_choice(client):
    kwargs = dict(max_tokens=6, temperature=1.0, seed=7, n=2, logprobs=1)
    prompts = ["The quick brown", "Hello there", "A"]
    r = client.completions.create(model=MODEL, prompt=prompts, **kwargs)
    assert [c.index for c in r.choices] == list(range(6))
    singles = [alone(client, p, **kwargs) for p in prompts]
    for k, single in enumerate(singles):
        for i, c in enumerate(single.choices):
            batched = r.choices[k * 2 + i]
            assert (batched.text, batched.finish_reason) == (c.text, c.finish_reason)
            assert batched.logprobs.tokens == c.logprobs.tokens
            # the same rows up to float rounding (a verification's shape varies with timing: docs/serving.md)
            assert batched.logprobs.token_logprobs == pytest.approx(c.logprobs.token_logprobs, abs=1e-5)
    # usage: each prompt once, every choice's tokens (vLLM's sums)
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_a_batch_of_token_id_lists_with_echo_and_logprobs_answers_each_prompt_as_alone(server, client):
    prompts = [[10, 20, 30], [40, 50], [60, 70, 80, 90]]
    kwargs = dict(max_tokens=3, temperature=0, echo=True, logprobs=2)
    r = client.completions.create(model=MODEL, prompt=prompts, **kwargs)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for k, prompt in enumerate(prompts):
        single = alone(client, prompt, **kwargs).choices[0]
        batched = r.choices[k]
        assert batched.text == single.text and batched.logprobs.tokens == single.logprobs.tokens
        assert batched.logprobs.token_logprobs[1:] == pytest.approx(single.logprobs.token_logprobs[1:], abs=1e-5)
        assert batched.logprobs.text_offset == single.logprobs.text_offset
        assert batched.logprobs.token_logprobs[0] is None  # the echoed prompt's first token has no row
    assert r.usage.prompt_tokens == 9
    # vLLM's prompt_logprobs on every prompt's choice
    body = {"model": MODEL, "prompt": prompts[:2], "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1}
    choices = httpx.post(server + "/v1/completions", json=body, timeout=60).json()["choices"]
    for k, prompt in enumerate(prompts[:2]):
        single = httpx.post(server + "/v1/completions", json={**body, "prompt": prompt}, timeout=60).json()
        rows, expected = choices[k]["prompt_logprobs"], single["choices"][0]["prompt_logprobs"]
        assert len(rows) == len(prompt) and rows[0] is None and expected[0] is None
        for row, want in zip(rows[1:], expected[1:], strict=True):
            assert row.keys() == want.keys()
            assert [e["logprob"] for e in row.values()] == pytest.approx([e["logprob"] for e in want.values()],
                                                                         abs=1e-5)


def test_greedy_choices_of_each_prompt_share_one_run_and_the_request_counts_its_jobs():
    from dsi.server.protocol import CompletionRequest, parse_request

    req = parse_request(CompletionRequest, b'{"prompt": [[1, 2], [3], [4]], "n": 3}')
    assert req.prompts() == [[1, 2], [3], [4]] and req.batch_size() == 3 and req.num_jobs == 9
    assert parse_request(CompletionRequest, b'{"prompt": [1, 2], "n": 2}').num_jobs == 2  # one prompt of ids
    assert parse_request(CompletionRequest, b'{"prompt": ["one"]}').num_jobs == 1


def test_a_streamed_batch_tags_every_chunk_with_its_choice_and_sums_the_usage(client):
    kwargs = dict(max_tokens=5, temperature=0.8, seed=3, n=2)
    prompts = ["The quick brown", "Hello there"]
    plain = client.completions.create(model=MODEL, prompt=prompts, **kwargs)
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, **kwargs, stream=True, echo=True,
                                            stream_options={"include_usage": True}))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(4)]
    assert texts == [prompts[i // 2] + plain.choices[i].text for i in range(4)]
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finished == [0, 1, 2, 3]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == plain.usage.model_dump()


def test_a_greedy_batch_with_n_runs_one_job_per_prompt(server, client, tiny_pair):
    body = {"model": MODEL, "prompt": ["ab", "cd"], "n": 3, "max_tokens": 4, "temperature": 0}
    r = httpx.post(server + "/v1/completions", json=body, timeout=60).json()
    texts = [c["text"] for c in r["choices"]]
    assert [c["index"] for c in r["choices"]] == list(range(6))
    assert texts == [alone(client, "ab", max_tokens=4, temperature=0).choices[0].text] * 3 + \
        [alone(client, "cd", max_tokens=4, temperature=0).choices[0].text] * 3
    assert r["usage"]["completion_tokens"] == 6 * 4  # every choice counts, as with n alone

    from dsi.server import ServeConfig
    from dsi.server.codec import HFCodec
    from dsi.server.prepare import Preparer

    target = tiny_pair[0]
    preparer = Preparer(ServeConfig(model_name=MODEL, max_tokens=8), HFCodec(target), target.vocab_size, 256)
    greedy = preparer.completion([bytearray(json.dumps(body).encode())])
    assert greedy.choices == 6 and greedy.num_jobs == len(greedy.jobs()) == 2
    assert greedy.choice_jobs() == [0] * 3 + [1] * 3
    sampled = preparer.completion([bytearray(json.dumps({**body, "temperature": 1.0}).encode())])
    assert sampled.num_jobs == len(sampled.jobs()) == 6 and sampled.choice_jobs() == list(range(6))
    assert [p.request.prompt for p in sampled.jobs()[2:4]] == [greedy.prompts[0].request.prompt,
                                                               greedy.prompts[1].request.prompt]


def test_a_bad_prompt_in_a_batch_is_a_400_naming_it(server):
    for prompt, message in ((["ab", ""], "prompt[1]"), ([[1, 2], [3, 10**6]], "prompt[1]"), ([[5], []], "prompt[1]")):
        r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "prompt" and message in error["message"], error
    r = httpx.post(server + "/v1/completions", json={"prompt": ["a", 1]}, timeout=30)  # mixed: not a batch
    assert r.status_code == 422 and r.json()["error"]["param"] == "prompt"
