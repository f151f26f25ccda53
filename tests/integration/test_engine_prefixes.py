"""Verification from a real vLLM engine's prefix cache (issue 62, dsi.models.engines.prefixes): the start check
finds it, a batch of prefixes gives the rows ``prompt_logprobs`` gives, and greedy and seeded SI and DSI over
two such engines give the local non-SI's and the local method's tokens, with the long windows read from the
cache; an engine that refuses a batched prompt is said once and verified the old way, exactly. Slow: vLLM
starts in about 40 s here."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import dsi  # noqa: E402
from dsi.models.engines.target import EngineSession, EngineTarget  # noqa: E402
from dsi.sampling import SamplingParams  # noqa: E402
from tests.engine_models import dirs, local  # noqa: E402,F401
from tests.engine_servers import LocalHTTP, start_vllm, vllm_python  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.slow]

BLOCK = 32  # vLLM on a CPU: a multiple of 32 (its default is 128)
LONG = 150  # prompt tokens: past it, windows of a few drafts read most of their context from the cache
NEW = 40


@pytest.fixture(scope="module")
def engines(dirs):
    if vllm_python() is None:
        pytest.skip("no vLLM venv: bash packaging/vllm-venv.sh builds it (CI does)")
    from tests.engine_servers import start_all

    servers = start_all([lambda: start_vllm(dirs["target"], extra=("--enable-prefix-caching", "--block-size",
                                                                   str(BLOCK))) for _ in range(2)])
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def long_prompt(local):
    rng = np.random.default_rng(3)
    return [int(t) for t in rng.integers(1, local[0].vocab_size, LONG)]


@pytest.fixture
def prefix_requests(monkeypatch):
    """How many verifications went as a batch of prefixes (the sessions run in this process's threads)."""
    count = [0]
    original = EngineSession._rows_from_prefixes

    def counted(self, *args, **kwargs):
        count[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(EngineSession, "_rows_from_prefixes", counted)
    return count


def test_the_start_check_finds_the_prefix_cache_and_its_rows_are_the_prompt_logprobs_rows(engines, local):
    target = local[0]
    url = engines[0].url
    cached = EngineTarget([url], reference=target)
    plain = EngineTarget([url], reference=target, prefix_cache=False)
    info = cached.engines[url]
    assert info.prefixes and info.block_size == BLOCK
    assert not plain.engines[url].prefixes
    context = [int(t) for t in np.random.default_rng(5).integers(1, target.vocab_size, 210)]
    session, reference = cached.new_session(url), plain.new_session(url)
    session.extend(context[:195])  # a first forward: nothing cached, the prompt_logprobs way
    assert session.counters["prefix_requests"] == 0
    for k, (greedy, top) in enumerate([(False, None), (False, 5), (True, None)]):
        end = 200 + 5 * k
        rows = session.extend_rows(context[end - 5:end], None, 5, greedy, top)
        reference.truncate(0)
        expected = reference.extend_rows(context[:end], None, 5, greedy, top)
        if greedy:
            assert rows.tolist() == expected.tolist()
            continue
        got = np.isfinite(rows)
        if top is None:  # whole rows
            assert got.all() and np.isfinite(expected).all()
        else:  # the top 5 (prompt_logprobs also carry the token that follows: one more entry, outside the law)
            assert (got.sum(-1) == top).all() and (got <= np.isfinite(expected)).all()
            for mine, theirs in zip(rows, expected, strict=True):
                assert set(np.argsort(-mine)[:top]) == set(np.argsort(-theirs)[:top])
        np.testing.assert_allclose(rows[got], expected[got], atol=1e-4)
        assert (rows.argmax(-1) == expected.argmax(-1)).all()
    assert session.counters["prefix_requests"] == 3 and reference.counters["prefix_requests"] == 0
    session.close()
    reference.close()


def vllm_greedy(url: str, prompt: list[int], tokens: int) -> list[int]:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                       "return_token_ids": True, "ignore_eos": True}).encode()
    request = urllib.request.Request(url + "/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)["choices"][0]["token_ids"]


@pytest.mark.parametrize("method, k", [("si", 3), ("dsi", 3), ("dsi", "auto")])
def test_greedy_si_and_dsi_from_the_prefix_cache_equal_non_si_and_vllm(engines, local, long_prompt, method, k,
                                                                        prefix_requests):
    target, _, same = local  # the target's own weights as the drafter: long windows, all accepted
    expected = dsi.generate(target=target, prompt=long_prompt, method="ar", max_new_tokens=NEW).tokens
    assert vllm_greedy(engines[0].url, long_prompt, NEW) == expected
    there = dsi.generate(target=target, drafter=same, prompt=long_prompt, method=method, lookahead=k,
                         max_new_tokens=NEW, target_servers=[e.url for e in engines])
    assert there.tokens == expected
    if k != "auto":  # (event-driven windows grow while both engines are busy: their many prefixes may cost more)
        assert prefix_requests[0] > 0, "no window was verified from the prefix cache"


@pytest.mark.parametrize("top_k", [0, 5])
def test_seeded_sampling_from_the_prefix_cache_gives_the_local_tokens(engines, local, long_prompt, top_k,
                                                                      prefix_requests):
    target, drafter, _ = local
    for seed in range(2):
        params = SamplingParams(temperature=1.0, top_k=top_k, seed=seed)
        kwargs = dict(target=target, drafter=drafter, prompt=long_prompt, method="dsi", lookahead=3,
                      max_new_tokens=NEW, sampling=params)
        here = dsi.generate(num_target_servers=2, **kwargs)
        there = dsi.generate(target_servers=[e.url for e in engines], **kwargs)
        assert there.tokens == here.tokens, seed
    assert prefix_requests[0] > 0


class RefusesBatches(LocalHTTP):
    """A real vLLM engine behind an HTTP proxy that refuses a batched prompt (400), as a gateway or an engine
    of another make may, once it relayed ``allow`` of them (0: from the start check on); with ``garble``, it
    answers them 200 with one choice left out instead. Everything else, /metrics included, is relayed."""

    def __init__(self, upstream: str, allow: int = 0, garble: bool = False) -> None:
        import http.server

        self.upstream, self.refused, self.relayed = upstream, 0, 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status: int, data: bytes, kind: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                root = proxy.upstream.removesuffix("/v1")
                with urllib.request.urlopen(root + self.path, timeout=60) as response:
                    self._send(200, response.read(), response.headers.get("Content-Type", "text/plain"))

            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                prompt = json.loads(body).get("prompt")
                batch = isinstance(prompt, list) and prompt and isinstance(prompt[0], list)
                if batch and proxy.relayed >= allow and not garble:
                    proxy.refused += 1
                    self._send(400, json.dumps({"error": {"message": "batched prompts are not served here",
                                                          "code": 400}}).encode())
                    return
                request = urllib.request.Request(proxy.upstream.removesuffix("/v1") + self.path, body,
                                                 {"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=120) as response:
                    data = response.read()
                if batch and proxy.relayed >= allow:  # garble: a choice left out
                    proxy.refused += 1
                    answer = json.loads(data)
                    answer["choices"] = answer["choices"][:-1]
                    data = json.dumps(answer).encode()
                elif batch:
                    proxy.relayed += 1
                self._send(200, data)

        self.serve(Handler)


def through(proxy: RefusesBatches, local, long_prompt, method: str, others=()) -> tuple[list[int], list[int]]:
    """The local non-SI tokens of ``long_prompt``, and ``method``'s over ``proxy`` (and the engines ``others``)
    with the target's own weights as the drafter; the proxy closed after."""
    target, _, same = local
    expected = dsi.generate(target=target, prompt=long_prompt, method="ar", max_new_tokens=NEW).tokens
    try:
        there = dsi.generate(target=target, drafter=same, prompt=long_prompt, method=method, lookahead=3,
                             max_new_tokens=NEW, target_servers=[proxy.url, *(e.url for e in others)])
    finally:
        proxy.close()
    return there.tokens, expected


def test_an_engine_that_refuses_a_batched_prompt_is_said_once_and_verified_the_old_way(engines, local, long_prompt,
                                                                                        prefix_requests, caplog):
    import logging

    proxy = RefusesBatches(engines[0].url)
    caplog.set_level(logging.WARNING, logger="dsi.models.engines.target")
    tokens, expected = through(proxy, local, long_prompt, "dsi", engines[1:])
    assert tokens == expected
    assert proxy.refused == 1  # the start check's batch: never one in a verification
    said = [r.getMessage() for r in caplog.records if "does not answer a batch of prefixes" in r.getMessage()]
    assert len(said) == 1 and proxy.url in said[0] and "each verification recomputes its context" in said[0]
    assert prefix_requests[0] > 0  # the other engine still reads its cache


def test_an_engine_that_refuses_batches_after_its_start_check_is_said_once_and_verified_the_old_way(
        engines, local, long_prompt, prefix_requests, caplog):
    import logging

    proxy = RefusesBatches(engines[0].url, allow=1)  # the start check's batch passes; every later one is refused
    caplog.set_level(logging.WARNING, logger="dsi.models.engines.target")
    tokens, expected = through(proxy, local, long_prompt, "si")
    assert tokens == expected
    assert proxy.relayed == 1 and proxy.refused == 1  # one verification refused: never a batch after it
    said = [r.getMessage() for r in caplog.records if "refuses a batch of prefixes now" in r.getMessage()]
    assert len(said) == 1 and proxy.url in said[0] and "batched prompts are not served here" in said[0]


def test_garbled_batch_answers_fail_the_engine_over_and_the_output_stays_exact(engines, local, long_prompt):
    """Whether a window after the first reaches the proxied engine follows timing (DSI gives windows to the idle
    server), so a run where none did is tried again, up to three runs; every run's output must be exact."""
    for _ in range(3):
        proxy = RefusesBatches(engines[0].url, allow=1, garble=True)  # after the start check: a choice missing
        tokens, expected = through(proxy, local, long_prompt, "dsi", engines[1:])
        assert tokens == expected
        if proxy.refused:
            break
    assert proxy.refused > 0  # garbled answers were sent, and none reached the output


def test_a_top_k_above_the_engines_logprobs_cap_fails_naming_the_engine_and_its_limit(dirs, local, long_prompt):
    if vllm_python() is None:
        pytest.skip("no vLLM venv: bash packaging/vllm-venv.sh builds it (CI does)")
    target, drafter, _ = local
    engine = start_vllm(dirs["target"], extra=("--enable-prefix-caching", "--block-size", str(BLOCK),
                                               "--max-logprobs", "4"))
    try:
        kwargs = dict(target=target, drafter=drafter, prompt=long_prompt, method="dsi", lookahead=3,
                      max_new_tokens=8, target_servers=[engine.url])
        fine = dsi.generate(sampling=SamplingParams(temperature=1.0, top_k=4, seed=1), **kwargs)
        here = dsi.generate(target=target, drafter=drafter, prompt=long_prompt, method="dsi", lookahead=3,
                            max_new_tokens=8, sampling=SamplingParams(temperature=1.0, top_k=4, seed=1))
        assert fine.tokens == here.tokens
        with pytest.raises(dsi.errors.WorkerError) as failed:  # the task fails (a 4xx): no failover, no retry
            dsi.generate(sampling=SamplingParams(temperature=1.0, top_k=5, seed=1), **kwargs)
    finally:
        engine.stop()
    message = str(failed.value)
    assert engine.url in message and "prompt_logprobs" in message and "max allowed: 4" in message
    assert not isinstance(failed.value, dsi.errors.ServerLost)
