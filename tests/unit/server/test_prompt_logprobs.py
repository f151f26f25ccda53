"""``dsi serve``'s ``prompt_logprobs`` (vLLM's extension of ``/v1/completions``), which makes a ``dsi
serve --method ar`` a target server for another dsi: the shape vLLM answers in, values equal to the
target's own log-softmax, dsi's ``prompt_logprobs_from``, the slot's cache reused across requests,
and clear refusals."""

from __future__ import annotations

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")

from tests.unit.server.conftest import running_server  # noqa: E402

pytestmark = pytest.mark.hf

MODEL = "tiny"


def local_logprobs(target, tokens) -> np.ndarray:
    """[len(tokens), V]: the target's log-softmax after tokens[:p + 1], computed alone."""
    session = target.new_session()
    try:
        rows = np.asarray(session.extend(list(tokens)), np.float64)
    finally:
        session.close()
    return rows - np.logaddexp.reduce(rows, axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def servers(tiny_pair):
    """Two ``--method ar`` servers over the tiny target: the whole vocabulary allowed, and vLLM's default cap."""
    from dsi.server import ServeConfig, create_app

    target, _ = tiny_pair
    full = create_app(target, None, ServeConfig(method="ar", model_name=MODEL, max_logprobs=-1))
    capped = create_app(target, None, ServeConfig(method="ar", model_name=MODEL))
    with running_server(full) as a, running_server(capped) as b:
        yield {"full": (a.url, full), "capped": (b.url, capped)}


def post(url, **body):
    return httpx.post(url + "/v1/completions", json={"model": MODEL, **body}, timeout=60)


def test_prompt_logprobs_have_vllms_shape_and_the_targets_values(servers, tiny_pair):
    target, _ = tiny_pair
    url = servers["full"][0]
    prompt = target.encode("def add(a, b):\n    return")
    r = post(url, prompt=prompt, max_tokens=1, temperature=0, prompt_logprobs=3)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    rows = choice["prompt_logprobs"]
    assert len(rows) == len(prompt) and rows[0] is None
    local = local_logprobs(target, prompt)
    for p in range(1, len(prompt)):
        entry = {int(k): v for k, v in rows[p].items()}
        top3 = sorted(range(target.vocab_size), key=lambda t: -local[p - 1, t])[:3]
        assert set(top3) <= set(entry) and set(entry) <= set(top3) | {prompt[p]}
        for token, value in entry.items():
            assert value["logprob"] == pytest.approx(local[p - 1, token], abs=1e-5)
            assert value["rank"] == 1 + int((local[p - 1] > local[p - 1, token] + 1e-6).sum())
            assert value["decoded_token"] == target.decode([token])
        assert entry[prompt[p]]["rank"] >= 1
    # the one completion token is the greedy token after the whole prompt (what non-SI gives first)
    assert choice["text"] == target.decode([int(np.argmax(local[-1]))])
    assert choice["finish_reason"] == "length"


def test_whole_vocabulary_rows_and_prompt_logprobs_from(servers, tiny_pair):
    target, _ = tiny_pair
    url = servers["full"][0]
    prompt = target.encode("for i in range(10):")
    r = post(url, prompt=prompt, max_tokens=1, temperature=0, prompt_logprobs=-1, prompt_logprobs_from=len(prompt) - 2)
    assert r.status_code == 200, r.text
    rows = r.json()["choices"][0]["prompt_logprobs"]
    first = len(prompt) - 2
    assert rows[:first] == [None] * first
    local = local_logprobs(target, prompt)
    for p in range(first, len(prompt)):
        assert len(rows[p]) == target.vocab_size
        ranks = sorted(v["rank"] for v in rows[p].values())
        assert ranks == list(range(1, target.vocab_size + 1))
        values = np.array([rows[p][str(t)]["logprob"] for t in range(target.vocab_size)])
        np.testing.assert_allclose(values, local[p - 1], atol=1e-5)


def test_the_slots_cache_is_reused_so_a_longer_context_costs_only_its_new_tokens(servers, tiny_pair):
    target, _ = tiny_pair
    url, app = servers["full"]
    [slot] = app.state.dsi.scheduler.slots
    session = slot.decoder._session
    fed: list[int] = []
    original = session.extend_rows

    def recording(tokens, *args, **kwargs):
        fed.append(len(tokens))
        return original(tokens, *args, **kwargs)

    session.extend_rows = recording
    try:
        base = target.encode("def fibonacci(n):\n    if n < 2:")
        assert post(url, prompt=base, max_tokens=1, temperature=0, prompt_logprobs=1,
                    prompt_logprobs_from=len(base) - 1).status_code == 200
        longer = base + target.encode(" return n")
        r = post(url, prompt=longer, max_tokens=1, temperature=0, prompt_logprobs=1, prompt_logprobs_from=len(base))
        assert r.status_code == 200, r.text
    finally:
        del session.extend_rows
    # only what the first request had not computed, plus its last token again: a cache holds keys and
    # values, not logits, and the row after the whole base is asked for
    assert fed[-1] == len(longer) - len(base) + 1
    local = local_logprobs(target, longer)
    rows = r.json()["choices"][0]["prompt_logprobs"]
    for p in range(len(base), len(longer)):
        token = max(rows[p], key=lambda k: rows[p][k]["logprob"])
        assert int(token) == int(np.argmax(local[p - 1]))


@pytest.mark.parametrize("body, param", [
    ({"prompt_logprobs": 21}, "prompt_logprobs"),  # over vLLM's default cap of 20
    ({"prompt_logprobs": -1}, "prompt_logprobs"),  # the whole vocabulary needs --max-logprobs -1
    ({"prompt_logprobs": 2, "stream": True}, "stream"),
    ({"prompt_logprobs_from": 2}, "prompt_logprobs_from"),  # without prompt_logprobs
    ({"prompt_logprobs": 2, "prompt_logprobs_from": 99}, "prompt_logprobs_from"),
])
def test_refusals_name_the_parameter(servers, body, param):
    r = post(servers["capped"][0], prompt=[5, 6, 7], max_tokens=1, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert str(body.get(param, "")) in error["message"] or param in error["message"]


def test_a_server_without_a_target_session_refuses_prompt_logprobs(tiny_pair):
    from dsi.server import ServeConfig, create_app

    target, drafter = tiny_pair
    app = create_app(target, drafter, ServeConfig(method="dsi", lookahead=2, model_name=MODEL))
    with running_server(app) as running:
        r = post(running.url, prompt=[5, 6, 7], max_tokens=1, prompt_logprobs=1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    assert "--method ar or si" in r.json()["error"]["message"]
