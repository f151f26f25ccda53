"""``dsi serve``'s app under a real uvicorn on 127.0.0.1, driven by the official ``openai`` client
and by raw HTTP, on tiny random Hugging Face models (target and drafter differ, so drafts are
rejected and tasks preempted)."""

from __future__ import annotations

import concurrent.futures
import json
import math
import re

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from dsi.cli.main import main  # noqa: E402
from tests.unit.server.conftest import running_server  # noqa: E402

pytestmark = pytest.mark.hf

KEY = "test-key"
MODEL = "tiny"
ENGINE = ["--method", "dsi", "--sp", "2", "--lookahead", "3", "--dtype", "fp32"]


@pytest.fixture(scope="module")
def server(tiny_pair):
    from dsi.server import ServeConfig, create_app

    target, drafter = tiny_pair
    config = ServeConfig(method="dsi", lookahead=3, num_target_servers=2, max_concurrent=4, max_queue=64,
                         api_key=KEY, model_name=MODEL, max_tokens=16,
                         speculation_by_load=False)  # DSI's own path through the API: every request speculates
    app = create_app(target, drafter, config)
    with running_server(app) as running:
        yield running.url, app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def generate_json(capsys, tiny_dirs, *argv):
    target, drafter = tiny_dirs
    code = main(["generate", "--target", target, "--drafter", drafter, *ENGINE, "--json", *argv])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def metrics(url) -> dict:
    """{(name, labels): value} of every sample on /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def streamed_text(chunks, chat=False):
    text, final = [], []
    for chunk in chunks:
        if chunk.choices:
            choice = chunk.choices[0]
            text.append((choice.delta.content or "") if chat else choice.text)
            if choice.finish_reason:
                final.append(choice.finish_reason)
        last = chunk
    return "".join(text), final, last


def test_models_and_health(server, client):
    url, _ = server
    [card] = client.models.list().data
    assert card.id == MODEL and card.max_model_len == 256 and card.dsi["method"] == "dsi"
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["slots"] == 4
    # 4 DSI slots of 2 target servers each, every one in service
    assert health["target_servers"] == {"configured": 8, "in_service": 8, "lost": 0, "readmissions": 0}
    metrics = httpx.get(url + "/metrics").text
    assert "dsi_target_servers_configured 8.0" in metrics and "dsi_target_servers_in_service 8.0" in metrics
    assert "dsi_target_servers_lost 0.0" in metrics and "dsi_target_server_readmissions_total 0.0" in metrics


@pytest.mark.parametrize("stream", [False, True])
def test_completion_greedy_equals_dsi_generate(client, capsys, tiny_dirs, stream):
    prompt = "def fibonacci(n):"
    ref = generate_json(capsys, tiny_dirs, "--prompt", prompt, "--max-new-tokens", "12")
    ar = generate_json(capsys, tiny_dirs, "--prompt", prompt, "--max-new-tokens", "12", "--method", "ar", "--sp", "1")
    assert ar["token_ids"] == ref["token_ids"]  # lossless: DSI is the target's own greedy output
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    if not stream:
        r = client.completions.create(**kwargs)
        text, finish, usage, info = r.choices[0].text, r.choices[0].finish_reason, r.usage, r.dsi
    else:
        chunks = client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
        text, [finish], last = streamed_text(chunks)
        assert last.choices == []
        usage, info = last.usage, last.dsi
    assert text == ref["text"]
    assert finish == ref["finish_reason"]
    assert usage.prompt_tokens == ref["prompt_tokens"] and usage.completion_tokens == len(ref["token_ids"])
    assert info["method"] == "dsi" and info["drafted_tokens"] >= info["accepted_tokens"] >= 0
    assert 0.0 <= info["acceptance_rate"] <= 1.0 and info["verify_tasks"] >= 1 and info["wall_time_s"] > 0


@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_equals_dsi_generate_chat(client, capsys, tiny_dirs, stream):
    ref = generate_json(capsys, tiny_dirs, "--prompt", "héllo wörld", "--chat", "--max-new-tokens", "10")
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "héllo wörld"}], max_tokens=10, temperature=0)
    if stream:
        text, [finish], last = streamed_text(client.chat.completions.create(**kwargs, stream=True), chat=True)
        usage = last.usage  # without include_usage, usage rides on the final chunk
    else:
        r = client.chat.completions.create(**kwargs)
        text, finish, usage = r.choices[0].message.content, r.choices[0].finish_reason, r.usage
        assert r.choices[0].message.role == "assistant"
    assert text == ref["text"] and finish == ref["finish_reason"]
    assert usage.prompt_tokens == ref["prompt_tokens"] and usage.completion_tokens == len(ref["token_ids"])


def test_seeded_sampling_is_reproducible_and_equals_generate(client, capsys, tiny_dirs):
    kwargs = dict(model=MODEL, prompt="The quick brown", max_tokens=12, temperature=1.0)
    a = client.completions.create(**kwargs, seed=7).choices[0].text
    b = "".join(c.choices[0].text for c in client.completions.create(**kwargs, seed=7, stream=True) if c.choices)
    c = client.completions.create(**kwargs, seed=8).choices[0].text
    assert a == b != c
    ref = generate_json(capsys, tiny_dirs, "--prompt", "The quick brown", "--max-new-tokens", "12",
                        "--temperature", "1.0", "--seed", "7")
    assert a == ref["text"]
    top_k = client.completions.create(**kwargs, seed=7, extra_body={"top_k": 3}).choices[0].text
    ref_k = generate_json(capsys, tiny_dirs, "--prompt", "The quick brown", "--max-new-tokens", "12",
                          "--temperature", "1.0", "--seed", "7", "--top-k", "3")
    assert top_k == ref_k["text"]


def test_token_id_prompt_and_echo(client, tiny_pair):
    target, _ = tiny_pair
    ids = target.encode("for i in range")
    by_text = client.completions.create(model=MODEL, prompt="for i in range", max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert by_ids.choices[0].text == target.decode(ids) + by_text.choices[0].text
    streamed = client.completions.create(model=MODEL, prompt="for i in range", max_tokens=6, temperature=0,
                                         echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "for i in range" + by_text.choices[0].text


def expected_text(target, ids, max_tokens):
    import dsi

    result = dsi.generate(target=target, prompt=ids, method="ar", max_new_tokens=max_tokens,
                          eos_token_id=list(target.eos_token_ids))
    return target.decode(result.tokens), len(result.tokens)


def test_sixteen_concurrent_clients_all_complete_and_correct(server, client, tiny_pair):
    url, _ = server
    target, _ = tiny_pair
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    jobs = []
    for i in range(16):
        chat, stream = i % 2 == 1, i % 4 >= 2
        prompt = f"{words[i % 8]} {i} héllo"
        ids = target.encode(prompt, chat=chat)
        jobs.append((chat, stream, prompt, *expected_text(target, ids, 8 + i % 5)))
    before = metrics(url)

    def run(job):
        chat, stream, prompt, _, n_expected = job
        kwargs = dict(model=MODEL, max_tokens=8 + jobs.index(job) % 5, temperature=0)
        if chat:
            kwargs["messages"] = [{"role": "user", "content": prompt}]
            if stream:
                return streamed_text(client.chat.completions.create(**kwargs, stream=True), chat=True)[0]
            return client.chat.completions.create(**kwargs).choices[0].message.content
        if stream:
            return streamed_text(client.completions.create(prompt=prompt, **kwargs, stream=True))[0]
        return client.completions.create(prompt=prompt, **kwargs).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(run, jobs, timeout=120))
    assert texts == [job[3] for job in jobs]  # every response complete, correct and in its own place
    after = metrics(url)
    done = sum(after.get(("dsi_requests_total", (("endpoint", e), ("status", "200"))), 0)
               - before.get(("dsi_requests_total", (("endpoint", e), ("status", "200"))), 0)
               for e in ("/v1/completions", "/v1/chat/completions"))
    assert done == 16
    assert after[("dsi_generated_tokens_total", ())] - before[("dsi_generated_tokens_total", ())] == \
        sum(job[4] for job in jobs)
    assert after[("dsi_queue_length", ())] == 0 and after[("dsi_running_requests", ())] == 0
    assert after[("dsi_queue_time_seconds_count", ())] - before[("dsi_queue_time_seconds_count", ())] == 16


def test_metrics_series_track_one_request_exactly(server, client):
    url, _ = server
    before = metrics(url)
    r = client.completions.create(model=MODEL, prompt="print(i)", max_tokens=14, temperature=0)
    after = metrics(url)
    n, info = r.usage.completion_tokens, r.dsi

    def delta(name, labels=()):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert delta("dsi_requests_total", (("endpoint", "/v1/completions"), ("status", "200"))) == 1
    assert delta("dsi_request_finish_total", (("reason", r.choices[0].finish_reason),)) == 1
    assert delta("dsi_generated_tokens_total") == n and delta("dsi_prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("dsi_time_to_first_token_seconds_count") == 1
    assert delta("dsi_inter_token_latency_seconds_count") == n - 1
    assert delta("dsi_request_latency_seconds_count") == 1
    assert delta("dsi_drafted_tokens_total") == info["drafted_tokens"]
    assert delta("dsi_accepted_tokens_total") == info["accepted_tokens"]
    assert delta("dsi_verify_tasks_total") == info["verify_tasks"] >= 1
    assert delta("dsi_preempted_tasks_total") == info["preempted_tasks"]
    assert delta("dsi_cancelled_tasks_total") == info["cancelled_tasks"]
    assert delta("dsi_wasted_target_seconds_total") == pytest.approx(info["wasted_target_s"])
    assert delta("dsi_acceptance_rate_count") == 1
    assert delta("dsi_acceptance_rate_sum") == pytest.approx(info["acceptance_rate"])
    assert delta("dsi_mean_accepted_length_sum") == pytest.approx(info["mean_accepted_length"])
    assert delta("dsi_target_utilisation_sum") == pytest.approx(info["target_utilisation"])
    busy, capacity = after[("dsi_target_busy_seconds_total", ())], after[("dsi_target_capacity_seconds_total", ())]
    assert 0 < busy <= capacity  # pool utilisation in (0, 1]
    assert 0 < info["target_utilisation"] <= 1
    assert after[("dsi_engine_slots", ())] == 4


# each processor as the openai client sends it, and the dsi generate flags of the same request (after
# the flags of the request without it)
SEEDED = ["--temperature", "1", "--seed", "3"]
PROCESSED = {
    "presence_penalty": (dict(presence_penalty=1.5), [], ["--presence-penalty", "1.5"]),
    "frequency_penalty": (dict(frequency_penalty=1.2), [], ["--frequency-penalty", "1.2"]),
    "logit_bias": (dict(logit_bias={"17": 8.0, "42": 6.0}), [], ["--logit-bias", "17=8,42=6"]),
    "repetition_penalty": (dict(extra_body={"repetition_penalty": 1.6}), [], ["--repetition-penalty", "1.6"]),
    "min_p": (dict(temperature=1.0, seed=3, extra_body={"min_p": 0.9}), SEEDED, ["--min-p", "0.9"]),
    # the bias makes the stop id likely at once: min_tokens holds it back for 3 tokens
    "min_tokens and stop_token_ids": (dict(logit_bias={"17": 8.0}, extra_body={"min_tokens": 3, "stop_token_ids": [17]}),
                                      ["--logit-bias", "17=8"], ["--min-tokens", "3", "--stop-token-ids", "17"]),
    "ignore_eos": (dict(extra_body={"ignore_eos": True}), [], ["--ignore-eos"]),
}


@pytest.mark.parametrize("field", list(PROCESSED))
@pytest.mark.parametrize("stream", [False, True])
def test_each_logit_processor_through_the_openai_client_equals_dsi_generate(client, capsys, tiny_dirs, field, stream):
    options, base, flags = PROCESSED[field]
    prompt = "def fibonacci(n):"
    ref = generate_json(capsys, tiny_dirs, "--prompt", prompt, "--max-new-tokens", "10", *base, *flags)
    without = generate_json(capsys, tiny_dirs, "--prompt", prompt, "--max-new-tokens", "10", *base)
    if field != "ignore_eos":  # the tiny model writes no EOS in 10 tokens: ignore_eos changes nothing here
        assert ref["token_ids"] != without["token_ids"], "the processor changes the output"
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=10, **{"temperature": 0, **options})
    if stream:
        text, [finish], _ = streamed_text(client.completions.create(**kwargs, stream=True))
    else:
        r = client.completions.create(**kwargs)
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    assert text == ref["text"] and finish == ref["finish_reason"]
    if field == "min_tokens and stop_token_ids":
        assert len(ref["token_ids"]) == 4 and ref["token_ids"][-1] == 17 and ref["finish_reason"] == "stop"


def _pieces(tiny_pair, entries):
    """(text, logprob, [top texts]) of ``dsi generate --json``'s logprob entries."""
    tokenizer = tiny_pair[0].tokenizer
    text = lambda t: tokenizer.decode([t])  # noqa: E731
    return [(text(e["token"]), e["logprob"], [text(i) for i, _ in e["top"]]) for e in entries]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_are_the_rows_that_decided_each_token(client, capsys, tiny_dirs, tiny_pair, stream):
    prompt = "def fibonacci(n):"
    ref = generate_json(capsys, tiny_dirs, "--prompt", prompt, "--max-new-tokens", "10", "--logprobs", "3",
                        "--temperature", "1", "--seed", "4")
    ar = generate_json(capsys, tiny_dirs, "--prompt", prompt, "--max-new-tokens", "10", "--logprobs", "3",
                       "--temperature", "1", "--seed", "4", "--method", "ar", "--sp", "1")
    want = _pieces(tiny_pair, ref["logprobs"])
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=10, temperature=1.0, seed=4, logprobs=3)
    if stream:
        chunks = [c for c in client.completions.create(**kwargs, stream=True) if c.choices and c.choices[0].logprobs]
        tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
        values = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
        tops = [list(d) for c in chunks for d in c.choices[0].logprobs.top_logprobs]
        offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
        text = "".join(c.choices[0].text for c in chunks)
    else:
        choice = client.completions.create(**kwargs).choices[0]
        lp, text = choice.logprobs, choice.text
        tokens, values, tops, offsets = lp.tokens, lp.token_logprobs, [list(d) for d in lp.top_logprobs], lp.text_offset
    # each token's own text (a byte of a UTF-8 character alone is U+FFFD, as in vLLM and OpenAI)
    assert tokens == [w[0] for w in want] and text == ref["text"]
    assert values == pytest.approx([w[1] for w in want], abs=1e-5)
    assert tops == [list(dict.fromkeys(w[2])) for w in want]  # keyed by text: tokens spelled alike share a key
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    # DSI's numbers are non-SI's at every token (sampled tokens differ between methods, not their rows)
    for entry in ar["logprobs"]:
        assert entry["top"][0][1] >= entry["logprob"] - 1e-6


def test_chat_logprobs_with_top_logprobs(client, capsys, tiny_dirs, tiny_pair):
    ref = generate_json(capsys, tiny_dirs, "--prompt", "hello", "--chat", "--max-new-tokens", "6", "--logprobs", "2")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    want = _pieces(tiny_pair, ref["logprobs"])
    assert [c.token for c in content] == [w[0] for w in want]
    assert [c.logprob for c in content] == pytest.approx([w[1] for w in want], abs=1e-5)
    assert [[t.token for t in c.top_logprobs] for c in content] == [w[2] for w in want]
    assert all(bytes(c.bytes).decode("utf-8") == c.token for c in content)
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_draft_trees_in_generate_and_serve_keep_the_target_s_greedy_text(capsys, tiny_pair, tiny_dirs):
    """``--draft-tree`` on the hf backend (a tree's paths verified on one session) and a server started with a
    tree: the target's own greedy tokens; the model card says which tree the slots run."""
    from dsi.server import ServeConfig, create_app

    prompt = "def fibonacci(n):"
    ar = generate_json(capsys, tiny_dirs, "--prompt", prompt, "--max-new-tokens", "12", "--method", "ar", "--sp", "1")
    for method, tree in (("si", "2,2"), ("dsi", "2")):  # (random tiny models are never 10% sure: auto never branches)
        out = generate_json(capsys, tiny_dirs, "--prompt", prompt, "--max-new-tokens", "12", "--method", method,
                            "--sp", "1" if method == "si" else "2", "--draft-tree", tree)
        assert out["token_ids"] == ar["token_ids"], (method, tree)
        assert out["stats"]["draft_tree"] == tree
        # SI verifies a tree every iteration but the last (one token left: nothing to draft); DSI's windows here may
        # all be preempted by the zero-draft tasks (the random pair agrees on almost nothing)
        assert method == "dsi" or out["stats"]["tree_windows"] == out["stats"]["verify_tasks"] - 1
    target, drafter = tiny_pair
    config = ServeConfig(method="dsi", lookahead=3, model_name=MODEL, max_tokens=12, draft_tree="2")
    with running_server(create_app(target, drafter, config)) as running:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
        answer = httpx.post(running.url + "/v1/completions", json=body, timeout=60).json()
        card = httpx.get(running.url + "/v1/models", timeout=10).json()["data"][0]
    assert answer["choices"][0]["text"] == ar["text"]
    assert card["dsi"]["draft_tree"] == "2"


def test_the_server_reports_processed_logprobs_when_started_so(tiny_pair):
    from dsi.server import ServeConfig, create_app

    target, drafter = tiny_pair
    config = ServeConfig(method="si", lookahead=3, model_name=MODEL, max_tokens=8, logprobs_mode="processed")
    with running_server(create_app(target, drafter, config)) as running:
        body = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 6, "temperature": 0.7, "top_k": 3,
                "seed": 1, "logprobs": True, "top_logprobs": 5}
        content = httpx.post(running.url + "/v1/chat/completions", json=body,
                             timeout=60).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 6
    for item in content:  # the law drawn from: top_k=3 leaves 3 tokens, the others are impossible
        values = [t["logprob"] for t in item["top_logprobs"]]
        assert len(values) == 5 and sum(math.exp(v) for v in values[:3]) == pytest.approx(1.0, abs=1e-5)
        assert values[3:] == [-9999.0, -9999.0] and item["logprob"] in values[:3]


def test_n_choices_are_independent_seeded_samples_and_usage_counts_them_all(client):
    from dsi.sampling import choice_seed

    kwargs = dict(model=MODEL, prompt="The quick brown", max_tokens=8, temperature=1.0, seed=11)
    r = client.completions.create(**kwargs, n=3, logprobs=1)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) > 1  # independent samples
    for i, c in enumerate(r.choices):  # choice i is the n = 1 request with seed choice_seed(11, i)
        alone = client.completions.create(**{**kwargs, "seed": choice_seed(11, i)}).choices[0]
        assert c.text == alone.text and c.finish_reason == alone.finish_reason
        assert len(c.logprobs.tokens) == 8
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == client.completions.create(
        **kwargs).usage.prompt_tokens
    chunks = list(client.completions.create(**kwargs, n=3, stream=True, stream_options={"include_usage": True}))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert streamed == texts
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1, 2] and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_n_greedy_choices_are_copies_of_one_run_and_chat_takes_n(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                       temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content and r.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, temperature=0, n=2, stream=True))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(2)]
    assert streamed == [r.choices[0].message.content] * 2
    assert chunks[-1].usage.completion_tokens == 12  # without include_usage: on the last choice's final chunk


def test_chat_takes_the_processors_too(client, capsys, tiny_dirs):
    ref = generate_json(capsys, tiny_dirs, "--prompt", "hello", "--chat", "--max-new-tokens", "8",
                        "--presence-penalty", "2", "--logit-bias", "42=5")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8,
                                       temperature=0, presence_penalty=2, logit_bias={"42": 5})
    assert r.choices[0].message.content == ref["text"]


AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b'"a string"', 400, None),
    ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 422, "n"),
    ("/v1/completions", {"prompt": "x", "n": 2, "prompt_logprobs": 1}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "frobnicate": True}, 400, "frobnicate"),
    ("/v1/completions", {"prompt": ["a", "word " * 2000]}, 400, "prompt"),  # a batch's prompt beyond the context
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 300}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 999},
     400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "required"},
     400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function",
     "function": {"name": "a b"}}]}, 422, "tools.0.function.name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, 422, "logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 422, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 422, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 422, "top_p"),
    ("/v1/completions", {"prompt": "x", "seed": -3}, 422, "seed"),
    ("/v1/completions", {"max_tokens": 3}, 422, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 422, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 422, "messages.0"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 422, "messages.0.role"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 422, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, 422, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 422, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "min_p": 1.5}, 422, "min_p"),
    ("/v1/completions", {"prompt": "x", "min_tokens": -1}, 422, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 150}}, 422, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"five": 1}}, 422, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, 422, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "ignore_eos": "yes"}, 422, "ignore_eos"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),  # empty_prompt, as docs/serving.md says (and vLLM)
    ("/v1/completions", {"prompt": "x", "max_tokens": 3, "min_tokens": 4}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 17}, 400, "min_tokens"),  # over the server's default of 16
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2,
                              "min_tokens": 3}, 400, "min_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "metadata": {"k": 1}}, 422,
     "metadata.k"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "store": "yes"}, 422, "store"),
])
def test_bad_requests_get_openai_errors_naming_the_field(server, path, body, status, param):
    url, _ = server
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(url + path, headers=AUTH, timeout=10, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param and error["message"]


@pytest.mark.parametrize("path, body, message, code", [
    ("/v1/completions", {"prompt": []}, "the prompt has no tokens", "empty_prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 3, "min_tokens": 4},
     "min_tokens=4 must be <= max_tokens=3", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 17},
     "min_tokens=17 must be <= max_tokens=16 (this server's default", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2,
                              "min_tokens": 3}, "min_tokens=3 must be <= max_completion_tokens=2", "invalid_value"),
])
def test_issue_49_requests_are_refused_naming_the_values(server, path, body, message, code):
    r = httpx.post(server[0] + path, headers=AUTH, json=body, timeout=10)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert r.json()["error"]["code"] == code


def test_min_tokens_up_to_max_tokens_is_served(client):
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=0,
                                  extra_body={"min_tokens": 4, "ignore_eos": False})
    assert r.usage.completion_tokens == 4


def test_store_and_metadata_are_accepted_and_change_nothing(client):
    """Some SDK integrations send OpenAI's stored-completion fields; they do not change generation."""
    messages = [{"role": "user", "content": "Say hi"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    tagged = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, store=True,
                                            metadata={"team": "evals", "run": "49"})
    assert tagged.choices[0].message.content == plain.choices[0].message.content
    r = client.completions.create(model=MODEL, prompt="def f(", max_tokens=4, temperature=0,
                                  extra_body={"store": False, "metadata": {"k": "v"}})
    assert r.usage.completion_tokens == 4


@pytest.mark.parametrize("body, message", [
    ({"prompt": "x", "max_tokens": 300}, "max_tokens=300 leaves no room for a prompt in the model's context of 256"),
    ({"prompt": "x y z " * 10, "max_tokens": 240}, "+ max_tokens=240 exceeds the model's context of 256 tokens"),
    ({"prompt": list(range(250)), "max_tokens": 10}, "the prompt of 250 tokens + max_tokens=10 exceeds"),
    ({"prompt": "x y z " * 100}, "fills the model's context of 256 tokens"),
])
def test_context_overflow_message(server, body, message):
    r = httpx.post(server[0] + "/v1/completions", headers=AUTH, json=body)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_api_key_is_required(server, headers):
    url, _ = server
    for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")]:
        r = httpx.request(method, url + path, headers=headers, json={"prompt": "x"}, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert httpx.get(url + "/health").status_code == 200  # health and metrics stay open


def test_unknown_route_is_an_openai_error(server):
    r = httpx.get(server[0] + "/v2/nothing", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_with_method_auto_every_slot_runs_the_pick_and_a_non_si_pick_lets_the_drafter_go(tiny_pair, monkeypatch):
    """Once auto has chosen, slots (and rebuilt slots) are built as the pick, without measuring again; a
    non-SI pick leaves no decoder holding the drafter, and a handed-over drafter is freed."""
    import dsi.evaluate.autotune as autotune
    import dsi.server.app as app_module
    from dsi.engine.ar import AutoregressiveDecoder
    from dsi.server import ServeConfig, create_app

    target, drafter = tiny_pair
    choice = autotune.AutoChoice("ar", 1, 1, "non-SI by test", (), {}, 0.5, 32, "k", "now")
    chosen = []
    monkeypatch.setattr(autotune, "choose_method", lambda *a, **k: chosen.append(1) or choice)
    released = []
    monkeypatch.setattr(app_module, "release", released.append)
    config = ServeConfig(method="auto", max_concurrent=2, model_name="tiny")
    app = create_app(target, drafter, config, free_unused_drafter=True)
    with running_server(app) as running:
        state = app.state.dsi
        slots = state.scheduler.slots
        assert [type(s.decoder.inner) for s in slots] == [AutoregressiveDecoder] * 2
        assert chosen == [1] and state.choice is choice  # chosen once, for the first slot
        assert state.drafter is None and released == [drafter]
        slots[1].rebuild()  # a rebuilt slot is the pick too, with no drafter
        assert type(slots[1].decoder.inner) is AutoregressiveDecoder and chosen == [1]
        reply = httpx.post(f"{running.url}/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 4,
                                                                  "ignore_eos": True})  # (a random seed: EOS may come)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4


def test_a_tree_auto_picked_is_what_every_slot_runs_and_what_the_model_card_says(tiny_pair, monkeypatch):
    import dsi.evaluate.autotune as autotune
    from dsi.engine.si import SpeculativeDecoder
    from dsi.server import ServeConfig, create_app
    from dsi.trees import Widths

    target, drafter = tiny_pair
    choice = autotune.AutoChoice("si", 3, 1, "SI k=3 tree=2 by test", (), {}, 0.5, 32, "k", "now", draft_tree="2")
    monkeypatch.setattr(autotune, "choose_method", lambda *a, **k: choice)
    plain = ServeConfig(method="ar", model_name="tiny", max_tokens=10)
    body = {"model": "tiny", "prompt": "ab", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    with running_server(create_app(target, drafter, plain)) as running:
        want = httpx.post(f"{running.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    app = create_app(target, drafter, ServeConfig(method="auto", max_concurrent=2, model_name="tiny"))
    with running_server(app) as running:
        slots = app.state.dsi.scheduler.slots
        assert all(type(s.decoder.inner) is SpeculativeDecoder and s.decoder.inner.draft_tree == Widths((2,))
                   for s in slots)
        card = httpx.get(running.url + "/v1/models", timeout=10).json()["data"][0]
        got = httpx.post(f"{running.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert card["dsi"]["draft_tree"] == "2" and card["dsi"]["auto"]["picked"] == "SI k=3 tree=2"
    assert got == want


def test_a_server_not_given_the_drafter_keeps_it_alive_for_its_owner(tiny_pair, monkeypatch):
    import dsi.evaluate.autotune as autotune
    import dsi.server.app as app_module
    from dsi.server import ServeConfig, create_app

    target, drafter = tiny_pair
    choice = autotune.AutoChoice("ar", 1, 1, "non-SI by test", (), {}, 0.5, 32, "k", "now")
    monkeypatch.setattr(autotune, "choose_method", lambda *a, **k: choice)
    monkeypatch.setattr(app_module, "release", lambda m: pytest.fail("freed a drafter it was not handed"))
    app = create_app(target, drafter, ServeConfig(method="auto", model_name="tiny"))
    with running_server(app):
        assert app.state.dsi.drafter is None


def test_models_retrieve_answers_the_served_model_and_404_for_another(server, client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.max_model_len == 256 and card.dsi["method"] == "dsi"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.body["code"] == "model_not_found" and "'gpt-4o' does not exist" in info.value.body["message"]
    r = httpx.get(server[0] + "/v1/models/" + MODEL)  # behind the API key like the listing
    assert r.status_code == 401
    counted = metrics(server[0])
    assert counted[("dsi_requests_total", (("endpoint", "/v1/models/{model}"), ("status", "200")))] >= 1


def test_the_documented_acceptance_rate_query_gives_the_responses_rate(server, client):
    """docs/serving.md: rate(dsi_accepted_tokens_total) / rate(dsi_decided_drafts_total) is the acceptance
    rate, the same figure as each response's acceptance_rate (accepted / (accepted + rejections)); the
    ratio to drafted tokens is not (drafts made past a rejection are never decided)."""
    url, _ = server
    before = metrics(url)
    infos = [client.completions.create(model=MODEL, prompt=p, max_tokens=14, temperature=0).dsi
             for p in ("print(i)", "def add(a, b):", "The quick brown fox")]
    after = metrics(url)

    def delta(name):
        return after.get((name, ()), 0.0) - before.get((name, ()), 0.0)

    accepted = sum(i["accepted_tokens"] for i in infos)
    decided = sum(i["accepted_tokens"] + i["rejections"] for i in infos)
    assert delta("dsi_accepted_tokens_total") == accepted and delta("dsi_decided_drafts_total") == decided > 0
    rates = [i["acceptance_rate"] for i in infos]
    query = delta("dsi_accepted_tokens_total") / delta("dsi_decided_drafts_total")
    weights = [i["accepted_tokens"] + i["rejections"] for i in infos]
    assert query == pytest.approx(sum(r * w for r, w in zip(rates, weights, strict=True)) / sum(weights))
    assert delta("dsi_drafted_tokens_total") >= decided  # the other ratio counts undecided drafts too


def test_a_non_si_response_reports_no_lookahead(tiny_pair):
    from dsi.server import ServeConfig, create_app

    target, _ = tiny_pair
    with running_server(create_app(target, None, ServeConfig(method="ar", model_name=MODEL, max_tokens=4))) as running:
        info = httpx.post(running.url + "/v1/completions", json={"prompt": "abc"}, timeout=60).json()["dsi"]
        card = httpx.get(running.url + "/v1/models", timeout=10).json()["data"][0]["dsi"]
    assert info["method"] == "ar" and info["lookahead"] is None and info["drafted_tokens"] == 0
    assert card["method"] == "ar" and card["lookahead"] is None  # the model card says the same (it said 5)


# ---- vLLM's /tokenize, /detokenize, /version ----------------------------------------------------


def test_tokenize_gives_the_ids_the_generation_endpoints_use(server, client, tiny_pair):
    url, _ = server
    tok = tiny_pair[0].tokenizer
    prompt = "def add(a, b):"
    r = httpx.post(url + "/tokenize", headers=AUTH, json={"model": MODEL, "prompt": prompt}, timeout=10)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer == {"count": len(answer["tokens"]), "max_model_len": 256, "tokens": tok.encode(prompt)}
    usage = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0).usage
    assert usage.prompt_tokens == answer["count"]
    bare = httpx.post(url + "/tokenize", headers=AUTH, json={"prompt": prompt, "add_special_tokens": False}).json()
    assert bare["tokens"] == tok.encode(prompt, add_special_tokens=False)
    messages = [{"role": "user", "content": "Write quicksort"}]
    chat = httpx.post(url + "/tokenize", headers=AUTH, json={"messages": messages}, timeout=10).json()
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tok.encode(text, add_special_tokens=False)
    usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0).usage
    assert usage.prompt_tokens == chat["count"]
    bare = httpx.post(url + "/tokenize", headers=AUTH, json={"messages": messages, "add_generation_prompt": False})
    text = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert bare.json()["tokens"] == tok.encode(text, add_special_tokens=False)


def test_detokenize_gives_the_text_of_ids_special_tokens_written_out(server, tiny_pair):
    url, _ = server
    tok = tiny_pair[0].tokenizer
    ids = tok.encode("héllo wörld") + [tok.eos_token_id]
    r = httpx.post(url + "/detokenize", headers=AUTH, json={"model": MODEL, "tokens": ids}, timeout=10)
    assert r.status_code == 200 and r.json() == {"prompt": tok.decode(ids)}, r.text
    assert r.json()["prompt"].endswith(tok.eos_token)  # as vLLM: special tokens are not skipped


@pytest.mark.parametrize("path, body, status, param, message", [
    ("/detokenize", {"tokens": [1, 2, 320]}, 400, "tokens", "tokens[2]=320 is outside the vocabulary [0, 320)"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "tokens[0]=-1 is outside the vocabulary [0, 320)"),
    ("/detokenize", {"tokens": [2**70]}, 400, "tokens", "is outside the vocabulary"),
    ("/detokenize", {"tokens": [1] * 257}, 400, "tokens", "257 ids, more than the model's context of 256"),
    ("/detokenize", {"tokens": [True]}, 422, "tokens.0", "valid integer"),
    ("/detokenize", {"tokens": [1], "model": "gpt-4"}, 404, "model", "does not exist"),
    ("/detokenize", {"text": "x"}, 400, "text", "unsupported parameter"),
    ("/tokenize", {"prompt": "x y z " * 100}, 400, "prompt", "exceeds the model's context of 256 tokens"),
    ("/tokenize", {"prompt": "x", "return_token_strs": True}, 400, "return_token_strs", "not supported"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, 400,
     "continue_final_message", "not supported"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model", "does not exist"),
    ("/tokenize", {}, 422, "prompt", "Field required"),
])
def test_tokenizer_endpoints_refuse_bad_requests_before_the_tokenizer(server, monkeypatch, path, body, status, param,
                                                                      message):
    """Ids outside the vocabulary are a 400 naming the first one: nothing reaches the tokenizer (or
    llama.cpp, which aborts the process on one)."""
    url, app = server
    codec = app.state.dsi.codec
    calls = []
    monkeypatch.setattr(codec, "decode", lambda ids, **kw: calls.append(list(ids)) or "")
    r = httpx.post(url + path, headers=AUTH, json=body, timeout=10)
    assert r.status_code == status and message in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == param
    assert calls == []


def test_tokenizer_endpoints_need_the_api_key_and_version_is_open(server):
    import dsi

    url, _ = server
    for path, body in [("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})]:
        for headers in [{}, {"Authorization": "Bearer wrong"}]:
            r = httpx.post(url + path, headers=headers, json=body, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(url + "/version", timeout=10)
    assert r.status_code == 200 and r.json() == {"version": dsi.__version__}
    counted = metrics(url)
    assert counted[("dsi_requests_total", (("endpoint", "/tokenize"), ("status", "401")))] >= 2
    assert counted[("dsi_requests_total", (("endpoint", "/version"), ("status", "200")))] >= 1


THING = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "tag": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
         "required": ["n", "tag", "ok"], "additionalProperties": False}


def _texts(response, stream: bool, chat: bool, n: int) -> list[str]:
    if not stream:
        return [c.message.content if chat else c.text for c in sorted(response.choices, key=lambda c: c.index)]
    parts = [""] * n
    for chunk in response:
        for c in chunk.choices:
            parts[c.index] += (c.delta.content or "") if chat else c.text
    return parts


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_in_chat_and_completions_streamed_or_not_with_several_choices(client, stream):
    """OpenAI's response_format (json_schema, json_object), vLLM's structured_outputs and guided_* fields and
    llama.cpp's grammar: every choice follows its constraint (DSI with 2 servers serves them)."""
    jsonschema = pytest.importorskip("jsonschema")
    common = dict(model=MODEL, max_tokens=80, n=2, temperature=1.0, seed=3, stream=stream)
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "a thing"}], **common,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": THING, "strict": True}})
    for text in _texts(chat, stream, True, 2):
        jsonschema.validate(json.loads(text), THING)
    if not stream:  # any object: a random model's strings may run to max_tokens ("length"); one that stopped parses
        anything = client.chat.completions.create(messages=[{"role": "user", "content": "an object"}],
                                                  **{**common, "max_tokens": 200}, response_format={"type": "json_object"})
        for choice in anything.choices:
            assert choice.message.content.startswith("{")
            if choice.finish_reason == "stop":
                assert isinstance(json.loads(choice.message.content), dict)
    for extra, check in [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": THING}}},
         lambda t: jsonschema.validate(json.loads(t), THING)),
        ({"guided_json": THING}, lambda t: jsonschema.validate(json.loads(t), THING)),
        ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
        ({"guided_regex": "[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch("[0-9]{3}-[0-9]{4}", t)),
        ({"grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
    ]:
        out = client.completions.create(prompt="x", extra_body=extra, **common)
        for text in _texts(out, stream, False, 2):
            assert check(text) is not False, (extra, text)  # jsonschema.validate returns None or raises


def test_a_schema_the_library_refuses_is_a_400_that_quotes_it(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"guided_regex": "a[12"})
    assert "unclosed character class" in str(caught.value) and caught.value.body["param"] == "guided_regex"


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"$ref": "#/$defs/digit"}, "b": {"$ref": "#/$defs/digit"}},
    "required": ["a", "b"], "additionalProperties": False,
    "$defs": {"digit": {"type": "integer", "minimum": 0, "maximum": 9}}}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: called with {}


def _streamed_calls(chunks) -> tuple[list[list[dict]], list[str | None], list[str]]:
    """Each choice's tool calls put together from a stream's deltas (id and name once, arguments in pieces),
    its finish_reason and its content."""
    calls: dict[int, dict[int, dict]] = {}
    finish: dict[int, str | None] = {}
    content: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(c.index, {}).setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = d.id or call["id"]
                call["name"] = (d.function.name if d.function else None) or call["name"]
                call["arguments"] += (d.function.arguments or "") if d.function else ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    n = max(finish) + 1
    return ([list(calls.get(i, {}).values()) for i in range(n)], [finish.get(i) for i in range(n)],
            [content.get(i, "") for i in range(n)])


def test_a_named_tool_choice_answers_one_call_of_that_function_streamed_or_not(client):
    """tool_choice naming a function: the output is its arguments, constrained to its schema, answered as a call
    (content null, finish_reason "tool_calls"); streamed, the arguments come in pieces after the call's id and
    name, and put together they are the plain answer's (greedy)."""
    jsonschema = pytest.importorskip("jsonschema")
    messages = [{"role": "user", "content": "weather?"}]
    common = dict(model=MODEL, messages=messages, tools=[WEATHER, ADD, NOW], max_tokens=40, temperature=0.0)
    for name, spec in (("get_weather", WEATHER), ("add", ADD), ("now", NOW)):
        choice = {"type": "function", "function": {"name": name}}
        plain = client.chat.completions.create(tool_choice=choice, **common).choices[0]
        assert plain.finish_reason == "tool_calls" and plain.message.content is None
        [call] = plain.message.tool_calls
        assert call.type == "function" and call.function.name == name and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments),
                            spec["function"].get("parameters", {"type": "object"}))
        [calls], [finish], [content] = _streamed_calls(
            client.chat.completions.create(tool_choice=choice, stream=True, **common))
        assert finish == "tool_calls" and content == ""
        assert calls == [{"id": calls[0]["id"], "name": name, "arguments": call.function.arguments}]
        assert calls[0]["id"].startswith("call_")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_answers_calls_of_listed_functions_on_each_choice(client, stream):
    """tool_choice "required": a list of calls, each of a listed function with arguments of its schema (a tool's
    $defs reach its $refs); parallel_tool_calls false: exactly one call. n = 2 sampled choices, streamed or not."""
    jsonschema = pytest.importorskip("jsonschema")
    specs = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in (WEATHER, ADD, NOW)}
    for parallel in (True, False):
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "call something"}], tools=[WEATHER, ADD, NOW],
            tool_choice="required", parallel_tool_calls=parallel, n=2, temperature=1.0, seed=5, max_tokens=60,
            stream=stream)
        if stream:
            every, finishes, contents = _streamed_calls(out)
        else:
            choices = sorted(out.choices, key=lambda c: c.index)
            every = [[{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                      for c in ch.message.tool_calls or []] for ch in choices]
            finishes = [ch.finish_reason for ch in choices]
            contents = [ch.message.content or "" for ch in choices]
        assert len(every) == 2
        for calls, finish, content in zip(every, finishes, contents):
            if finish != "tool_calls":  # cut by max_tokens: the text, never a call with missing arguments
                assert finish == "length" and not calls and content.startswith("[")
                continue
            assert calls and content == "" and (parallel or len(calls) == 1)
            for call in calls:
                assert call["id"].startswith("call_")
                jsonschema.validate(json.loads(call["arguments"]), specs[call["name"]])
        assert any(f == "tool_calls" for f in finishes)


def test_tool_requests_that_cannot_be_served_are_refused_naming_the_field(client):
    messages = [{"role": "user", "content": "hi"}]
    for extra, param, words in [
        ({"tools": [WEATHER]}, "tool_choice", "tool_choice 'auto' (the default with tools) needs a parser"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "send tool_choice 'required'"),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice='required' needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice",
         "names the function 'add', which is not among tools (get_weather)"),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "lists the function 'get_weather' twice"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "constrains the output to tool calls; it cannot be combined with response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/none"}}}],
          "tool_choice": "required"}, "tools", "json_schema constraint is not valid"),
    ]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, extra_body=extra)
        assert words in str(caught.value) and caught.value.body["param"] == param, (extra, caught.value.body)
    # tool_choice "none": plain text, the tools given to the template
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, tools=[WEATHER],
                                         tool_choice="none")
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content is not None


def test_a_conversation_with_earlier_calls_and_their_answers_reaches_the_template(client, tiny_tokenizer):
    """An assistant's tool_calls (content null) and the tool's answer (tool_call_id) are accepted; the template
    gets the tools and each earlier call's arguments as an object, as vLLM gives them."""
    import copy
    from types import SimpleNamespace

    from dsi.server.codec import HFCodec
    from dsi.server.protocol import ChatCompletionRequest, validate_request

    messages = [{"role": "user", "content": "weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "-3"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, tools=[WEATHER],
                                         tool_choice="none")
    assert out.choices[0].finish_reason in ("stop", "length")
    request = validate_request(ChatCompletionRequest, {"messages": messages, "tools": [WEATHER]})
    tok = copy.deepcopy(tiny_tokenizer)  # with a template that shows the tools and an earlier call's arguments
    tok.chat_template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                         "{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}({{ c.function.arguments.city }})"
                         "{% endfor %};{% endfor %}")
    codec = HFCodec(SimpleNamespace(tokenizer=tok, vocab_size=len(tok), eos_token_ids=[tok.eos_token_id],
                                    max_context=None, decode=tok.decode))
    ids = codec.encode_chat(request.template_messages(), tools=request.template_tools())
    assert tok.decode(ids) == "[get_weather]user:weather in Oslo?;assistant:(Oslo);tool:-3;"
    for bad, words in [({"role": "tool", "content": "x"}, "needs the tool_call_id"),
                       ({"role": "user", "content": None}, "a user message needs content"),
                       ({"role": "user", "content": "x", "tool_calls": []}, "tool_calls belong to assistant")]:
        with pytest.raises(openai.UnprocessableEntityError, match=words):
            client.chat.completions.create(model=MODEL, messages=[bad], max_tokens=4)
