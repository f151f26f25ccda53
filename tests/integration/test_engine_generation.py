"""Plain decoding through the engines' own generation (dsi.models.engines.generation): one streamed completion a
request instead of a scoring request a token, on real engines (``dsi serve --method ar`` processes; vLLM in the slow
run).

- greedy non-SI through the engines is the local non-SI output, from one stream and one engine request, where the
  scoring way asks the engines once a token;
- a stop token ends the output and closes the stream; a continuation goes on after its committed tokens; an abort
  mid-stream gives the tokens so far; the stream's reader threads end with the request;
- an engine killed mid-stream, or one that streams garbage, is marked lost and the output is whole and exact from
  the other engine;
- requests that need rows (logprobs, penalties without draws) still score them.
"""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")

import dsi  # noqa: E402
from dsi.engine.request import GenerationAborted, Request  # noqa: E402
from dsi.models.engines.target import EngineTarget  # noqa: E402
from dsi.sampling import SamplingParams  # noqa: E402
from tests.engine_models import (  # noqa: E402,F401
    TOKENS,
    dirs,
    dsi_engines,
    engines,
    local,
    prompts,
    reference,
    vllm_engines,
)
from tests.engine_servers import (  # noqa: E402
    RelayProxy,
    answered_requests,
    start_all,
    start_dsi_serve,
)

pytestmark = pytest.mark.hf


def _plain(target, urls, **options):
    engines = EngineTarget(urls, reference=target, **options)
    return dsi.build_decoder(target=engines, method="ar", target_servers=True)


def test_greedy_plain_decoding_is_one_stream_a_request_and_the_local_output(engines, local, prompts, reference,
                                                                            no_thread_leak):
    """...and the decoder holds no session on an engine (a connection) until a request needs rows."""
    target = local[0]
    urls = [e.url for e in engines]
    for streamed in (True, False):
        with _plain(target, urls, engine_generation=streamed) as decoder:
            assert decoder._session is None
            for i, prompt in enumerate(prompts):
                before = sum(answered_requests(e) for e in engines)
                result = decoder.generate(dsi.make_request(prompt, TOKENS))
                asked = sum(answered_requests(e) for e in engines) - before
                assert result.tokens == reference[i], (streamed, i)
                if streamed:  # one completion streamed the whole output
                    assert result.stats.extra["engine_streams"] == 1
                    assert asked == 1, asked
                else:  # the scoring way: a request a token
                    assert "engine_streams" not in result.stats.extra
                    assert asked == TOKENS, asked


def test_a_stop_token_ends_the_output_where_local_non_si_ends_it(dsi_engines, local, prompts, reference,
                                                                 no_thread_leak):
    target = local[0]
    stop = reference[1][6]
    expected = dsi.generate(target=target, prompt=prompts[1], method="ar", max_new_tokens=TOKENS,
                            eos_token_id=stop)
    assert len(expected.tokens) < TOKENS  # the stop token comes before the end
    with _plain(target, [e.url for e in dsi_engines]) as decoder:
        result = decoder.generate(dsi.make_request(prompts[1], TOKENS, eos_token_id=stop))
    assert result.tokens == expected.tokens
    assert result.stats.finish_reason == "stop" and result.stats.stop_token == stop


def test_a_continuation_goes_on_after_its_committed_tokens(dsi_engines, local, prompts, reference):
    target = local[0]
    with _plain(target, [e.url for e in dsi_engines]) as decoder:
        request = Request(tuple(prompts[0]), TOKENS, committed=tuple(reference[0][:7]))
        result = decoder.generate(request)
    assert result.tokens == reference[0]


def test_an_abort_mid_stream_gives_the_tokens_so_far_and_the_decoder_serves_on(dsi_engines, local, prompts,
                                                                               reference, no_thread_leak):
    target = local[0]
    abort = threading.Event()
    seen: list[int] = []

    def on_tokens(tokens, *rest):
        seen.extend(tokens)
        if len(seen) >= 3:
            abort.set()

    with _plain(target, [e.url for e in dsi_engines]) as decoder:
        with pytest.raises(GenerationAborted) as info:
            decoder.generate(dsi.make_request(prompts[2], TOKENS), on_tokens, abort)
        got = info.value.tokens
        assert 3 <= len(got) < TOKENS and got == reference[2][:len(got)]
        assert decoder.generate(dsi.make_request(prompts[2], TOKENS)).tokens == reference[2]


def test_requests_that_need_rows_still_score_them(dsi_engines, local, prompts):
    target = local[0]
    engines = EngineTarget([e.url for e in dsi_engines], reference=target)
    assert engines.generation(SamplingParams(), logprobs=True) is None
    assert engines.generation(SamplingParams(presence_penalty=1.0)) is None
    assert engines.generation(SamplingParams(temperature=1.0, seed=1)) is None  # dsi serve makes no draws
    assert engines.generation(SamplingParams()) is not None
    with dsi.build_decoder(target=engines, method="ar", target_servers=True) as decoder:
        here = dsi.generate(target=target, prompt=prompts[0], method="ar", max_new_tokens=8, logprobs=2)
        there = decoder.generate(dsi.make_request(prompts[0], 8, logprobs=2))
    assert there.tokens == here.tokens and "engine_streams" not in there.stats.extra


class GarbledStream(RelayProxy):
    """An engine whose streamed tokens are ids outside the vocabulary (its scoring answers are honest, so it
    passes the start check)."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.streamed = 0

    def stream(self, request: dict, events: bytes) -> bytes:
        self.streamed += 1
        chunk = {"choices": [{"index": 0, "text": "", "logprobs": {"tokens": ["token_id:99999999"],
                                                                    "top_logprobs": [None]}}]}
        return f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()


def test_an_engine_streaming_garbage_is_lost_and_the_output_comes_whole_from_the_other(dsi_engines, local, prompts,
                                                                                       reference, no_thread_leak):
    target = local[0]
    liar = GarbledStream(dsi_engines[1].url)
    try:
        urls = [liar.url, dsi_engines[0].url]  # the first stream goes to the first
        engines = EngineTarget(urls, reference=target)
        with dsi.build_decoder(target=engines, method="ar", target_servers=True) as decoder:
            result = decoder.generate(dsi.make_request(prompts[0], TOKENS))
        assert result.tokens == reference[0]
        assert liar.streamed == 1 and liar.url in engines.lost
        assert "outside the vocabulary" in engines.lost[liar.url]
        assert result.stats.extra["engine_streams"] == 2
    finally:
        liar.close()


class CutStream(RelayProxy):
    """An engine whose streams stop after their first ``tokens`` events, the connection closed without
    ``[DONE]``: an engine that dies mid-stream."""

    def __init__(self, upstream: str, tokens: int) -> None:
        super().__init__(upstream)
        self.tokens, self.streamed = tokens, 0

    def stream(self, request: dict, events: bytes) -> bytes:
        self.streamed += 1
        kept = [e for e in events.split(b"\n\n") if e.startswith(b"data:") and b"[DONE]" not in e]
        return b"".join(e + b"\n\n" for e in kept[:self.tokens])


def test_an_engine_that_dies_mid_stream_is_lost_and_the_output_goes_on_whole_on_the_other(
        dsi_engines, local, prompts, reference, no_thread_leak):
    target = local[0]
    cut = CutStream(dsi_engines[1].url, tokens=5)
    try:
        engines = EngineTarget([cut.url, dsi_engines[0].url], reference=target)  # the first stream: the first
        with dsi.build_decoder(target=engines, method="ar", target_servers=True) as decoder:
            seen: list[int] = []
            result = decoder.generate(dsi.make_request(prompts[1], TOKENS), lambda t, *r: seen.extend(t))
        assert result.tokens == reference[1] and seen == reference[1]  # each token committed once
        assert cut.streamed == 1 and "before its [DONE]" in engines.lost[cut.url]
        assert result.stats.extra["engine_streams"] == 2
    finally:
        cut.close()


@pytest.mark.slow
def test_an_engine_killed_before_the_stream_is_lost_and_the_decoder_serves_on(dirs, local, prompts, reference,
                                                                              no_thread_leak):
    target = local[0]
    servers = start_all([lambda: start_dsi_serve(dirs["target"]) for _ in range(2)])
    try:
        engines = EngineTarget([e.url for e in servers], reference=target)
        with dsi.build_decoder(target=engines, method="ar", target_servers=True) as decoder:
            servers[0].stop()  # the engine the first stream goes to
            result = decoder.generate(dsi.make_request(prompts[1], TOKENS))
            assert result.tokens == reference[1]
            assert servers[0].url in engines.lost and result.stats.extra["engine_streams"] == 2
            assert decoder.generate(dsi.make_request(prompts[0], TOKENS)).tokens == reference[0]  # serves on
    finally:
        for s in servers:
            s.stop()


def test_a_server_over_engines_chooses_sis_lookahead_by_load_and_serves_the_local_text(engines, local, prompts,
                                                                                        reference):
    """dsi serve over the engines with SI and speculation by load: each request runs SI with windows whose k the
    goodput rule chose, or plain decoding through the engines' stream where it predicts no draft pays; the text is
    the local non-SI's either way, and the response, the model card and /metrics say what was chosen."""
    import httpx

    from dsi.server import ServeConfig, create_app
    from tests.unit.server.conftest import running_server

    target, drafter, _ = local
    config = ServeConfig(method="si", lookahead=4, model_name="front", speculation_by_load=True,
                         target_servers=tuple(e.url for e in engines), temperature=0.0)
    app = create_app(target, drafter, config)
    eos = set(target.eos_token_ids)
    ways, reasons, windows = [], [], 0
    with running_server(app) as front:
        for i in (0, 1, 2) * 3:  # each prompt three times on one fresh server: one answer, non-SI's
            r = httpx.post(front.url + "/v1/completions", timeout=60,
                           json={"model": "front", "prompt": prompts[i], "max_tokens": TOKENS, "temperature": 0})
            assert r.status_code == 200, r.text
            cut = next((j for j, t in enumerate(reference[i]) if t in eos), None)
            expected = reference[i] if cut is None else reference[i][:cut]
            assert r.json()["choices"][0]["text"] == target.decode(expected), i
            load = r.json()["dsi"]["load"]
            ways.append(load["way"])
            reasons.append(load["reason"])
            assert load["handoffs"] == []  # the windows follow the load: no request is handed over
            if load["way"] == "speculative":
                assert sum(load["lookaheads"].values()) >= 1 and max(map(int, load["lookaheads"])) <= 4
                windows += sum(load["lookaheads"].values())
        card = httpx.get(front.url + "/v1/models", timeout=10).json()["data"][0]["dsi"]
        metrics = httpx.get(front.url + "/metrics", timeout=10).text
    assert ways[0] == "speculative"  # SI's windows measure the engines first
    assert set(ways) <= {"speculative", "plain"}
    assert all(reason.startswith("goodput") for reason in reasons)
    assert card["lookahead_by_load"]["windows"] >= windows > 0
    line = card["lookahead_by_load"]["latency_line_s"]  # its intercept may clamp at 0 where latency grows steeply
    assert line["base"] >= 0 and line["per_position"] >= 0 and line["base"] + line["per_position"] > 0
    counted = sum(float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("dsi_lookahead_windows_total{"))
    assert counted >= windows
