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


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": [5, 6, 7], "logprobs": 10**30}, "logprobs"),
    ("/v1/completions", {"prompt": [5, 6, 7], "logprobs": 10**6, "echo": True, "max_tokens": 0}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 10**6},
     "top_logprobs"),
])
def test_logprobs_beyond_the_vocabulary_name_their_field_where_the_whole_vocabulary_is_allowed(servers, tiny_pair,
                                                                                                path, body, param):
    """With --max-logprobs -1 the vocabulary is the bound: a 400 naming the field (it named the prompt, issue 64)."""
    target, _ = tiny_pair
    r = httpx.post(servers["full"][0] + path, json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_value"
    assert f"{param}={body[param]} is more than the vocabulary's {target.vocab_size} tokens" in error["message"]


@pytest.fixture(scope="module")
def dsi_server(tiny_pair):
    """A DSI server (two target servers, k = 2): it scores prompts as one task on a target server."""
    from dsi.server import ServeConfig, create_app

    target, drafter = tiny_pair
    app = create_app(target, drafter, ServeConfig(method="dsi", lookahead=2, num_target_servers=2, model_name=MODEL,
                                                  speculation_by_load=False))  # every request speculates
    with running_server(app) as running:
        yield running.url


def test_a_dsi_server_scores_prompts_on_a_target_server(dsi_server, tiny_pair):
    target, _ = tiny_pair
    prompt = target.encode("def add(a, b):\n    return")
    r = post(dsi_server, prompt=prompt, max_tokens=1, temperature=0, prompt_logprobs=2)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    local = local_logprobs(target, prompt)
    for p in range(1, len(prompt)):
        entry = {int(k): v["logprob"] for k, v in choice["prompt_logprobs"][p].items()}
        for token, value in entry.items():
            assert value == pytest.approx(local[p - 1, token], abs=1e-5)
        assert max(entry, key=entry.get) == int(np.argmax(local[p - 1]))
    assert choice["text"] == target.decode([int(np.argmax(local[-1]))])


@pytest.mark.parametrize("body, generated", [
    ({"echo": True, "logprobs": 1, "max_tokens": 1}, 1),
    ({"echo": True, "logprobs": 1, "max_tokens": 0}, 0),
    ({"prompt_logprobs": 1, "max_tokens": 1}, 1),
])
def test_a_scored_prompt_reports_the_one_forward_that_ran_with_measured_times(dsi_server, tiny_pair, body, generated):
    """Answered from one target forward over the prompt, on a DSI server: its dsi object says what ran
    (non-SI: no drafts, one target server, no lookahead), with measured times; usage counts the tokens
    given (issue 64: it said "dsi", 1 server, lookahead null and 0.0 s)."""
    target, _ = tiny_pair
    prompt = target.encode("def add(a, b):\n    return")
    r = post(dsi_server, prompt=prompt, temperature=0, **body)
    assert r.status_code == 200, r.text
    answer = r.json()
    info = answer["dsi"]
    assert info["method"] == "ar" and info["lookahead"] is None and info["num_target_servers"] == 1
    assert info["drafted_tokens"] == info["verify_tasks"] == 0
    assert info["wall_time_s"] > 0 and 0 < info["target_utilisation"] <= 1
    if generated:
        assert 0 < info["time_to_first_token_s"] <= info["wall_time_s"]
    else:
        assert info["time_to_first_token_s"] is None  # no token: none came first
    assert answer["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": generated,
                               "total_tokens": len(prompt) + generated}
    # a generation after the prompt's forward counts that forward's time too, and says what generated
    r = post(dsi_server, prompt=prompt, temperature=0, prompt_logprobs=1, max_tokens=3)
    info = r.json()["dsi"]
    assert info["method"] == "dsi" and info["num_target_servers"] == 2
    assert 0 < info["time_to_first_token_s"] <= info["wall_time_s"]


@pytest.mark.parametrize("where", ["ar", "dsi"])
def test_echo_with_logprobs_puts_the_prompts_own_logprobs_first(servers, dsi_server, tiny_pair, where):
    target, _ = tiny_pair
    url = servers["full"][0] if where == "ar" else dsi_server
    prompt = target.encode("for i in range(10):")
    # tokens named by id: two of a row's top tokens may have the same text (a byte of a character)
    plain = post(url, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, return_tokens_as_token_ids=True)
    echoed = post(url, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True,
                  return_tokens_as_token_ids=True)
    assert plain.status_code == 200 and echoed.status_code == 200, echoed.text
    generated, both = plain.json()["choices"][0], echoed.json()["choices"][0]
    assert both["text"] == target.decode(prompt) + generated["text"]
    lp = both["logprobs"]
    n = len(prompt)
    assert len(lp["tokens"]) == n + 3 and lp["tokens"][:n] == [f"token_id:{t}" for t in prompt]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
    local = local_logprobs(target, prompt)
    for p in range(1, n):  # raw log-probabilities of each prompt token after the ones before it
        assert lp["token_logprobs"][p] == pytest.approx(local[p - 1, prompt[p]], abs=1e-5)
        best = sorted(range(target.vocab_size), key=lambda t: (-local[p - 1, t], t))[:2]
        assert list(lp["top_logprobs"][p]) == [f"token_id:{t}" for t in best]
        assert list(lp["top_logprobs"][p].values()) == pytest.approx([local[p - 1, t] for t in best], abs=1e-5)
    # then the completion's, as without echo (up to float noise: the rows were computed in other chunks)
    assert lp["tokens"][n:] == generated["logprobs"]["tokens"]
    assert lp["token_logprobs"][n:] == pytest.approx(generated["logprobs"]["token_logprobs"], abs=1e-5)
    for ours, theirs in zip(lp["top_logprobs"][n:], generated["logprobs"]["top_logprobs"], strict=True):
        assert list(ours) == list(theirs) and list(ours.values()) == pytest.approx(list(theirs.values()), abs=1e-5)
    # offsets index the text (also with tokens named by id): the completion's start after the echoed prompt
    shift = len(target.decode(prompt))
    assert lp["text_offset"][n:] == [o + shift for o in generated["logprobs"]["text_offset"]]


def test_echo_with_max_tokens_zero_scores_the_prompt_only(servers, tiny_pair):
    target, _ = tiny_pair
    url = servers["full"][0]
    prompt = target.encode("import numpy as np")
    r = post(url, prompt=prompt, max_tokens=0, echo=True, logprobs=1, return_tokens_as_token_ids=True)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["text"] == target.decode(prompt) and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(prompt)
    lp = choice["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in prompt]  # vLLM's names: exact without a tokenizer
    local = local_logprobs(target, prompt)
    for p in range(1, len(prompt)):
        [(name, value)] = lp["top_logprobs"][p].items()
        assert name == f"token_id:{int(np.argmax(local[p - 1]))}"
        assert value == pytest.approx(local[p - 1].max(), abs=1e-5)
    # echo without logprobs and max_tokens=0: the prompt back, nothing run
    r = post(url, prompt="hello there", max_tokens=0, echo=True)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello there"


def test_streamed_logprobs_name_token_ids(servers, tiny_pair):
    """What a dsi drafting on this server reads: each streamed token's id and its top N by id."""
    target, _ = tiny_pair
    url = servers["full"][0]
    prompt = target.encode("def main():")
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 3, "stream": True,
            "ignore_eos": True, "return_tokens_as_token_ids": True}) as r:
        chunks = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    import json

    ids = []
    for chunk in chunks[:-1]:
        lp = json.loads(chunk)["choices"][0].get("logprobs")
        if lp:
            ids += [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
            assert all(all(k.startswith("token_id:") for k in top) and len(top) == 3 for top in lp["top_logprobs"])
    assert chunks[-1] == "[DONE]"
    context = list(prompt)
    for token in ids:  # the greedy chain of the target
        assert token == int(np.argmax(local_logprobs(target, context)[-1]))
        context.append(token)
    assert len(ids) == 5


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 0}, "max_tokens"),  # only with echo
    ({"max_tokens": 0, "echo": True, "stream": True}, "stream"),
    ({"max_tokens": 2, "echo": True, "logprobs": 1, "stream": True}, "stream"),
    ({"max_tokens": 2, "echo": True, "logprobs": 1, "n": 2, "temperature": 1.0}, "n"),
])
def test_echo_refusals_name_the_parameter(servers, body, param):
    r = post(servers["full"][0], prompt=[5, 6, 7], **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_chat_refuses_max_tokens_zero(servers):
    r = httpx.post(servers["full"][0] + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
