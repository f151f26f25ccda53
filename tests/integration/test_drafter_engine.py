"""The drafter as an inference engine over HTTP (:mod:`dsi.models.engines.drafter`): its tokens streamed
from a real ``dsi serve --method ar`` (in this process, or a process of its own for the faults) or a
real vLLM server (slow), on tiny random fp32 Llamas.

- greedy SI and DSI drafting on the engine equal the local non-SI token for token, with a drafter that
  is often wrong and one that is always right; the right one drafts a whole request from one stream;
- seeded sampling with top_k <= the rows' top gives the tokens of the same method with the local
  drafter (the draft law q is the drafter's own);
- the seed's simplest configuration: two target engines and a drafter engine, by Python, by
  ``dsi generate`` and behind ``dsi serve``;
- clear errors at start (unreachable, another model, with non-SI or deterministic), and faults: a
  drafter engine killed mid-request ends that request with an error naming it, a frozen one is caught
  by the drafter's liveness deadline, and the decoder serves on once the engine is back; closing the
  decoder leaves no connection open.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")

import dsi  # noqa: E402
from dsi.engine.api import make_request  # noqa: E402
from dsi.errors import ConfigError, WorkerError  # noqa: E402
from dsi.sampling import SamplingParams  # noqa: E402
from tests.engine_models import PROMPTS, TOKENS, dirs, local, prompts, reference  # noqa: E402,F401
from tests.engine_servers import (FAST_LIVENESS, LocalHTTP, Strike, free_port, start_dsi_serve, start_vllm,  # noqa: E402
                                  vllm_python)
from tests.unit.server.conftest import running_server  # noqa: E402

pytestmark = pytest.mark.hf



def serve_ar(model, name="tiny"):
    """A ``dsi serve --method ar`` of ``model`` in this process (a real uvicorn server on 127.0.0.1)."""
    from dsi.server import ServeConfig, create_app

    return running_server(create_app(model, None, ServeConfig(method="ar", model_name=name, max_logprobs=-1)))


@pytest.fixture(scope="module")
def drafter_engines(local):
    """``{"wrong": url, "right": url}``: engines serving the small drafter, and the target's weights as a drafter."""
    _, drafter, same = local
    with serve_ar(drafter) as wrong, serve_ar(same) as right:
        yield {"wrong": wrong.url + "/v1", "right": right.url + "/v1"}


CONFIGS = [("si", 3, None), ("dsi", 3, 2), ("dsi", "auto", 2), pytest.param("dsi", 2, 3, marks=pytest.mark.slow)]


@pytest.mark.parametrize("method, k, sp", CONFIGS, ids=["si-k3", "dsi-k3-sp2", "dsi-kauto-sp2", "dsi-k2-sp3"])
def test_greedy_drafting_on_an_engine_equals_local_non_si(drafter_engines, local, prompts, reference, method, k, sp):
    target, drafter, same = local
    for i, prompt in enumerate(prompts):
        for which, reference_drafter in (("wrong", drafter), ("right", same)):
            r = dsi.generate(target=target, drafter=reference_drafter, prompt=prompt, method=method, lookahead=k,
                             num_target_servers=sp, max_new_tokens=TOKENS, drafter_server=drafter_engines[which])
            assert r.tokens == reference[i], (i, which)
            streams = r.stats.extra["drafter_streams"]
            assert streams >= 1 and r.stats.extra["drafter_stream_tokens"] >= r.stats.drafted_tokens
    # the drafter that is always right drafted the whole request from one stream: no request per token
    assert r.stats.acceptance_rate == 1.0 and streams == 1


@pytest.mark.parametrize("method, k", [("si", 3), ("dsi", "auto")])
def test_seeded_sampling_drafting_on_an_engine_gives_the_local_drafters_tokens(drafter_engines, local, prompts,
                                                                               method, k):
    """With top_k <= the rows' top (20) the engine's rows give the drafter's whole processed law, so the
    drafts, and with them the sampled output, are the local drafter's."""
    target, drafter, _ = local
    streams = 0
    for seed in range(2):
        params = SamplingParams(temperature=0.8, top_k=5, seed=seed)
        kwargs = dict(target=target, drafter=drafter, prompt=prompts[seed], method=method, lookahead=k,
                      max_new_tokens=16, sampling=params, num_target_servers=None if method == "si" else 2)
        here = dsi.generate(**kwargs)
        there = dsi.generate(drafter_server=drafter_engines["wrong"], **kwargs)
        assert there.tokens == here.tokens, seed
        if method == "si":  # (DSI's drafter runs ahead as far as timing lets it)
            assert there.stats.drafted_tokens == here.stats.drafted_tokens
        streams += there.stats.extra["drafter_streams"]
    assert streams > 2  # a sampled draft other than the engine's greedy token opened a new stream


def test_two_target_engines_and_a_drafter_engine(drafter_engines, dirs, local, prompts, reference, capsys):
    """The seed's simplest configuration, in Python, through ``dsi generate`` and behind ``dsi serve``."""
    import httpx

    from dsi.cli.main import main
    from dsi.server import ServeConfig, create_app

    target, drafter, _ = local
    with serve_ar(target) as a, serve_ar(target) as b:
        urls = [a.url + "/v1", b.url + "/v1"]
        r = dsi.generate(target=target, drafter=drafter, prompt=prompts[0], method="dsi", lookahead="auto",
                         max_new_tokens=TOKENS, target_servers=urls, drafter_server=drafter_engines["wrong"])
        assert r.tokens == reference[0] and r.stats.num_target_servers == 2
        argv = ["generate", "--target", dirs["target"], "--drafter", dirs["drafter"], "--dtype", "fp32",
                "--threads", "1", "--prompt", PROMPTS[1], "--max-new-tokens", str(TOKENS), "--method", "dsi",
                "-k", "3", "--json", "--target-servers", ",".join(urls), "--drafter-server", drafter_engines["wrong"]]
        assert main(argv) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["token_ids"] == reference[1] and out["stats"]["drafter_streams"] >= 1
        assert main([*argv, "--method", "ar"]) == 2  # the last --method counts
        assert "--drafter-server with --method ar" in capsys.readouterr().err
        config = ServeConfig(method="dsi", lookahead=3, num_target_servers=2, model_name="front", temperature=0.0,
                             target_servers=tuple(urls), drafter_server=drafter_engines["wrong"])
        with running_server(create_app(target, drafter, config)) as front:
            card = httpx.get(front.url + "/v1/models", timeout=10).json()["data"][0]
            assert card["dsi"]["drafter_server"] == drafter_engines["wrong"]
            answer = httpx.post(front.url + "/v1/completions", timeout=60, json={
                "model": "front", "prompt": prompts[2], "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == target.decode(reference[2])


def test_drafter_engines_that_cannot_be_used_are_refused_at_start(drafter_engines, local):
    target, drafter, _ = local
    unused = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(ConfigError, match=f"drafter server {unused} cannot be used"):
        dsi.build_decoder(target=target, drafter=drafter, method="si", drafter_server=unused)
    # the engine serves the target's weights; the local drafter is the small model: another model
    with pytest.raises(ConfigError, match=r"drafter server .*: 'tiny' does not compute the local drafter's rows"):
        dsi.build_decoder(target=target, drafter=drafter, method="dsi", drafter_server=drafter_engines["right"])
    with pytest.raises(ConfigError, match="drafter_server=.* with method='ar'"):
        dsi.build_decoder(target=target, drafter=drafter, method="ar", drafter_server=drafter_engines["wrong"])
    with pytest.raises(ConfigError, match="deterministic=True cannot hold with drafter_server"):
        dsi.build_decoder(target=target, drafter=drafter, method="dsi", deterministic=True,
                          drafter_server=drafter_engines["wrong"])
    with pytest.raises(ConfigError, match="needs the local drafter too"):
        dsi.build_decoder(target=target, drafter=None, method="si", drafter_server=drafter_engines["wrong"])


def test_measure_over_engines_gives_the_local_acceptance(drafter_engines, dirs, local, capsys):
    """``dsi measure`` with the target's rows from an engine and the drafter's guesses streamed from another:
    the same greedy tokens, so the same matches, as measured locally; latency through an engine too."""
    from dsi.cli.main import main

    target = local[0]
    common = ["--dtype", "fp32", "--threads", "1", "--num-prompts", "2", "--max-new-tokens", "12", "--json"]
    with serve_ar(target) as engine:
        url = engine.url + "/v1"
        acceptance = ["measure", "acceptance", "--target", dirs["target"], "--drafter", dirs["drafter"], *common]
        assert main(acceptance) == 0
        here = json.loads(capsys.readouterr().out)
        assert main([*acceptance, "--target-servers", url, "--drafter-server", drafter_engines["wrong"]]) == 0
        there = json.loads(capsys.readouterr().out)
        assert there["target_server"] == url and there["drafter_server"] == drafter_engines["wrong"]
        assert [r["matches"] for r in there["per_prompt"]] == [r["matches"] for r in here["per_prompt"]]
        assert there["positions"] == here["positions"] > 0
        latency = ["measure", "latency", "--model", dirs["target"], *common, "--target-servers", url]
        assert main(latency) == 0
        measured = json.loads(capsys.readouterr().out)
        assert measured["target_server"] == url and measured["tpot_ms"] > 0
        # what ran is the engine: its role, and the local copy's backend only as the local copy's
        assert measured["role"] == "target" and measured["backend"] == "engine"
        assert measured["engine"] == {"url": url, "served_model": measured["engine"]["served_model"],
                                      "kind": "dsi serve"}
        assert measured["dtype"] is None and measured["threads"] is None
        assert measured["local_copy"]["dtype"] == "fp32" and measured["local_copy"]["threads"] == 1
        drafter_latency = ["measure", "latency", "--model", dirs["drafter"], *common,
                           "--drafter-server", drafter_engines["wrong"]]
        assert main(drafter_latency) == 0
        measured = json.loads(capsys.readouterr().out)
        assert measured["role"] == "drafter" and measured["engine"]["url"] == drafter_engines["wrong"]
        assert main([*latency, "--drafter-server", url]) == 2
        assert "measures one model" in capsys.readouterr().err


class GarbageStreams(LocalHTTP):
    """A real drafter engine behind a proxy whose streams send a line that is not JSON (scoring requests,
    the start-up checks, are relayed honestly)."""

    def __init__(self, upstream: str) -> None:
        import http.server
        import urllib.request

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _answer(self, data: bytes, kind: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _relay(self, body=None):
                request = urllib.request.Request(upstream + self.path.removeprefix("/v1"), body,
                                                 {"Content-Type": "application/json"}, method=self.command)
                with urllib.request.urlopen(request, timeout=60) as response:
                    self._answer(response.read(), "application/json")

            def do_GET(self):
                self._relay()

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if json.loads(body).get("stream"):
                    self._answer(b"data: {\"choices\": [{\"logprobs\": tru\n\n", "text/event-stream")
                else:
                    self._relay(body)

        self.serve(Handler)


@pytest.mark.parametrize("method", ["si", "dsi"])
def test_a_drafter_engine_that_streams_garbage_ends_the_request_with_a_clear_error(drafter_engines, local, prompts,
                                                                                   method):
    target, drafter, _ = local
    liar = GarbageStreams(drafter_engines["wrong"])
    try:
        decoder = dsi.build_decoder(target=target, drafter=drafter, method=method, lookahead=3,
                                    drafter_server=liar.url)  # its start-up checks pass: they are relayed
        try:
            with pytest.raises(WorkerError, match=f"drafter server {liar.url}: streamed a line that is not JSON"
                               .replace(".", r"\.")):
                decoder.generate(make_request(prompts[0], TOKENS, SamplingParams(), None, target.vocab_size))
        finally:
            decoder.close()
    finally:
        liar.close()


def connections_to(port: int) -> list:
    import psutil

    return [c for c in psutil.Process().net_connections("tcp")
            if c.raddr and c.raddr.port == port and c.status == "ESTABLISHED"]


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_drafter_engine_lost_mid_request_ends_it_clearly_and_the_decoder_recovers(dirs, local, prompts, reference,
                                                                                    fault):
    target, drafter, _ = local
    engine = start_dsi_serve(dirs["drafter"])
    strike = Strike(engine, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    try:
        decoder = dsi.build_decoder(target=target, drafter=drafter, method="dsi", lookahead=2,
                                    drafter_server=engine.url, transport_options={"liveness": FAST_LIVENESS})
        try:
            start = time.monotonic()
            expected = "the drafter is frozen" if fault == "stop" else f"drafter server {engine.url}"
            with pytest.raises(WorkerError, match=expected.replace(".", r"\.")):
                decoder.generate(make_request(prompts[0], 200, SamplingParams(), None, target.vocab_size), strike)
            assert time.monotonic() - start < 60 and strike.done.is_set()
            if fault == "stop":
                engine.signal(signal.SIGCONT)  # back: the decoder's next request gets a new drafter thread
                again = decoder.generate(make_request(prompts[1], TOKENS, SamplingParams(), None, target.vocab_size))
                assert again.tokens == reference[1]
            else:  # gone for good: each request fails at once, with the same clear error, and nothing hangs
                with pytest.raises(WorkerError, match=f"drafter server {engine.url}".replace(".", r"\.")):
                    decoder.generate(make_request(prompts[1], TOKENS, SamplingParams(), None, target.vocab_size))
        finally:
            decoder.close()
        assert connections_to(engine.port) == []  # closing left no connection open
    finally:
        engine.stop()


@pytest.mark.slow
def test_greedy_and_sampling_drafting_on_vllm(dirs, local, prompts, reference):
    """vLLM streams the drafter's tokens (here the target's weights, so every draft is accepted)."""
    if vllm_python() is None:
        pytest.skip("no vLLM venv: bash packaging/vllm-venv.sh builds it (CI does)")
    target, _, same = local
    engine = start_vllm(dirs["target"])
    try:
        for method, k in (("si", 3), ("dsi", "auto")):
            for i, prompt in enumerate(prompts):
                r = dsi.generate(target=target, drafter=same, prompt=prompt, method=method, lookahead=k,
                                 max_new_tokens=TOKENS, drafter_server=engine.url)
                assert r.tokens == reference[i]
                assert r.stats.acceptance_rate == 1.0 and r.stats.extra["drafter_streams"] == 1
        params = SamplingParams(temperature=0.8, top_k=5, seed=2)
        kwargs = dict(target=target, drafter=same, prompt=prompts[0], method="dsi", lookahead=3,
                      max_new_tokens=TOKENS, sampling=params)
        assert dsi.generate(drafter_server=engine.url, **kwargs).tokens == dsi.generate(**kwargs).tokens
    finally:
        engine.stop()


@pytest.mark.slow
def test_a_frozen_drafter_engine_ends_an_si_request_within_its_stall_limit(dirs, local, prompts, reference):
    """SI drafts in the request's own thread, with no liveness deadline: the stream's stall limit ends it."""
    from dsi.models.engines.drafter import EngineDrafter

    target, drafter, _ = local
    engine = start_dsi_serve(dirs["drafter"])
    strike = Strike(engine, signal.SIGSTOP)
    try:
        remote = EngineDrafter(engine.url, drafter, stall_s=3.0)
        decoder = dsi.build_decoder(target=target, drafter=remote, method="si", lookahead=3)
        try:
            start = time.monotonic()
            with pytest.raises(Exception, match=f"drafter server {engine.url}: sent no token".replace(".", r"\.")):
                decoder.generate(make_request(prompts[0], 200, SamplingParams(), None, target.vocab_size), strike)
            assert time.monotonic() - start < 30
            engine.signal(signal.SIGCONT)
            again = decoder.generate(make_request(prompts[2], TOKENS, SamplingParams(), None, target.vocab_size))
            assert again.tokens == reference[2]
        finally:
            decoder.close()
    finally:
        engine.stop()


def test_a_drafter_engine_with_top_rows_only_is_described_as_exact_for_any_sampling(local, caplog):
    """The start check of a drafter engine that gives only its top 20 log-probabilities a row says what that
    means for a drafter (drafts come from those rows, exact whatever the sampling), not a target's rule."""
    import logging

    from dsi.models.engines.drafter import EngineDrafter
    from dsi.models.engines.target import EngineTarget
    from dsi.server import ServeConfig, create_app

    drafter = local[1]
    caplog.set_level(logging.INFO, logger="dsi.models.engines.target")
    app = create_app(drafter, None, ServeConfig(method="ar", model_name="d", max_logprobs=20))
    with running_server(app) as engine:
        EngineDrafter(engine.url + "/v1", drafter)
        EngineTarget([engine.url + "/v1"], reference=drafter)  # the same engine as a target: the target's rule
    said = [r.getMessage() for r in caplog.records if "whole-vocabulary" in r.getMessage()]
    assert len(said) == 2
    assert said[0].startswith("drafter server") and "drafts are drawn from its top log-probabilities" in said[0]
    assert "needs top_k" not in said[0]
    assert said[1].startswith("target server") and "sampling then needs top_k" in said[1]
