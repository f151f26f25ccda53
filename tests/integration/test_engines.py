"""Target servers that are inference engines over HTTP (:mod:`dsi.models.engines.target`): real ``dsi serve
--method ar`` processes and real vLLM servers on 127.0.0.1, serving a tiny random fp32 Llama (head
size 32, which vLLM's CPU attention supports).

- greedy SI and DSI over the engines equal the local non-SI token for token (fixed k, event-driven
  windows, SP 1-3, more servers than engines), and vLLM's own greedy output;
- seeded sampling over the engines gives the tokens the same method gives locally (whole-vocabulary
  rows, and top-k rows with only k entries), and the law rebuilt from a response is the local one;
- a request the engines' answers would not determine is refused before it starts;
- faults on real engines: one killed or stopped mid-request (the request completes, correct, on the
  other), one that starts answering garbage, an unreachable URL, another model, every engine gone;
  closing the decoder leaves no connection open.

The vLLM tests need the venv of ``packaging/vllm-venv.sh`` (CI builds it) and are slow (a vLLM
server takes about 40 s to start here); they skip with the reason when it is missing.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.request

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")

import dsi  # noqa: E402
from dsi.errors import ConfigError, ContextLengthError, WorkerError  # noqa: E402
from dsi.models.engines.target import EngineTarget  # noqa: E402
from dsi.sampling import SamplingParams, process_logits  # noqa: E402
from tests.engine_models import (  # noqa: E402,F401
    PROMPTS,
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
    FAST_LIVENESS,
    RelayProxy,
    Strike,
    StrikeAfter,
    answered_requests,
    start_all,
    start_dsi_serve,
    start_vllm,
    vllm_python,
)

pytestmark = pytest.mark.hf



CONFIGS = [
    ("si", 3, None), ("dsi", 3, None), ("dsi", 3, 1), ("dsi", 2, 3), ("dsi", "auto", None), ("dsi", "auto", 3),
]


@pytest.mark.parametrize("method, k, sp", CONFIGS, ids=[f"{m}-k{k}-sp{sp}" for m, k, sp in CONFIGS])
def test_greedy_over_engines_equals_local_non_si(engines, local, prompts, reference, method, k, sp):
    target, drafter, same = local
    urls = [e.url for e in engines]
    for i, prompt in enumerate(prompts):
        for draft in (drafter, same):  # rejections and preemptions; then every draft accepted
            r = dsi.generate(target=target, drafter=draft, prompt=prompt, method=method, lookahead=k,
                             num_target_servers=sp, max_new_tokens=TOKENS, target_servers=urls)
            assert r.tokens == reference[i], (i, draft)
    assert r.stats.accepted_tokens > 0


@pytest.mark.slow
def test_vllms_own_greedy_output_is_the_local_non_si(vllm_engines, prompts, reference):
    for prompt, expected in zip(prompts, reference, strict=True):
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
                           "return_token_ids": True, "ignore_eos": True}).encode()
        request = urllib.request.Request(vllm_engines[0].url + "/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.load(response)
        assert answer["choices"][0]["token_ids"] == expected


@pytest.mark.parametrize("top_k", [0, 5])
@pytest.mark.parametrize("method, k", [("si", 3), ("dsi", "auto")])
def test_seeded_sampling_over_engines_gives_the_local_tokens(engines, local, prompts, method, k, top_k):
    target, drafter, _ = local
    urls = [e.url for e in engines]
    for seed in range(3):
        params = SamplingParams(temperature=1.0, top_k=top_k, seed=seed)
        kwargs = dict(target=target, drafter=drafter, prompt=prompts[seed], method=method, lookahead=k,
                      max_new_tokens=TOKENS, sampling=params)
        here = dsi.generate(num_target_servers=2, **kwargs)
        there = dsi.generate(target_servers=urls, **kwargs)
        assert there.tokens == here.tokens, seed


@pytest.mark.parametrize("params", [
    SamplingParams(presence_penalty=1.0, repetition_penalty=1.3, logit_bias={7: 3.0}),
    SamplingParams(temperature=1.0, top_k=5, seed=4, frequency_penalty=0.8, min_p=0.05, min_tokens=4),
], ids=["greedy", "sampling"])
def test_processed_rows_over_engines_give_the_local_tokens(engines, local, prompts, params):
    """Penalties, bias and min_tokens are applied here, to the whole rows the engines return."""
    target, drafter, _ = local
    urls = [e.url for e in engines]
    kwargs = dict(target=target, drafter=drafter, prompt=prompts[1], method="dsi", lookahead=3,
                  max_new_tokens=TOKENS, sampling=params)
    here = dsi.generate(num_target_servers=2, **kwargs)
    assert here.tokens != dsi.generate(**{**kwargs, "sampling": SamplingParams(temperature=params.temperature,
                                                                                 top_k=params.top_k, seed=params.seed)},
                                       num_target_servers=2).tokens
    assert dsi.generate(target_servers=urls, **kwargs).tokens == here.tokens
    # logprobs from the engines' whole rows: the local numbers (float32 rows over HTTP)
    there = dsi.generate(target_servers=urls, logprobs=3, **kwargs)
    local = dsi.generate(num_target_servers=2, logprobs=3, **kwargs)
    assert there.tokens == local.tokens
    for a, b in zip(there.logprobs, local.logprobs, strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [i for i, _ in a.top] == [i for i, _ in b.top]


def test_the_law_rebuilt_from_an_engines_rows_is_the_local_law(dsi_engines, local, prompts):
    target = local[0]
    engines = EngineTarget([dsi_engines[0].url], reference=target)
    context = prompts[0] + prompts[1]
    session = engines.new_session()
    mine = target.new_session()
    try:
        local_rows = np.asarray(mine.extend(context), np.float64)[-4:]
        for top, params in [(None, SamplingParams(temperature=0.7, top_p=0.9, seed=0)),
                            (5, SamplingParams(temperature=1.3, top_k=5, seed=0))]:
            session.truncate(0)
            rows = session.extend_rows(context, None, 4, False, top=top)
            if top is not None:
                assert (np.isfinite(rows).sum(axis=1) <= top + 1).all()  # only what was asked travelled
            for row, want in zip(rows, local_rows, strict=True):
                np.testing.assert_allclose(process_logits(row, params), process_logits(want, params), atol=1e-6)
    finally:
        session.close()
        mine.close()


def test_sampling_an_engine_cannot_determine_is_refused_before_it_starts(dirs, local, prompts):
    from dsi.server import ServeConfig, create_app
    from tests.unit.server.conftest import running_server

    target, drafter, _ = local
    app = create_app(target, None, ServeConfig(method="ar", model_name="tiny"))  # vLLM's default: 20 logprobs
    with running_server(app) as capped:
        urls = [capped.url + "/v1"]
        with pytest.raises(ConfigError, match=r"top_k=0 .* not exact.* top_k.*--max-logprobs -1"):
            dsi.generate(target=target, drafter=drafter, prompt=prompts[0], method="dsi", max_new_tokens=4,
                         sampling=SamplingParams(temperature=1.0, seed=0), target_servers=urls)
        with pytest.raises(ConfigError, match=r"logprobs over target server\(s\) .* need whole rows.*--max-logprobs -1"):
            dsi.generate(target=target, drafter=drafter, prompt=prompts[0], method="dsi", max_new_tokens=4,
                         logprobs=2, target_servers=urls)
        for processed in (SamplingParams(presence_penalty=0.5), SamplingParams(temperature=1.0, top_k=4, logit_bias={1: 2})):
            # a penalty or bias may lift a token from below the top the engine returns: whole rows only
            with pytest.raises(ConfigError, match=r"penalties, logit_bias, min_tokens or a structured-output constraint .* not exact.*--max-logprobs -1"):
                dsi.generate(target=target, drafter=drafter, prompt=prompts[0], method="si", max_new_tokens=4,
                             sampling=processed, target_servers=urls)
        params = SamplingParams(temperature=1.0, top_k=4, seed=1)  # within its limit: exact
        there = dsi.generate(target=target, drafter=drafter, prompt=prompts[0], method="dsi", max_new_tokens=12,
                             sampling=params, target_servers=urls)
        here = dsi.generate(target=target, drafter=drafter, prompt=prompts[0], method="dsi", max_new_tokens=12,
                            sampling=params, num_target_servers=1)
        assert there.tokens == here.tokens
        # top_k over the engine's own limit: its 400 fails the request (a 4xx is the request's fault,
        # not the server's), naming the engine and its answer
        with pytest.raises(WorkerError, match=r"answered 400: prompt_logprobs=25: .* more than this server allows"):
            dsi.generate(target=target, drafter=drafter, prompt=prompts[0], method="dsi", max_new_tokens=4,
                         sampling=SamplingParams(temperature=1.0, top_k=25, seed=0), target_servers=urls)


def test_an_unreachable_url_is_refused_at_start(local, dsi_engines):
    from tests.engine_servers import free_port

    target, drafter, _ = local
    nobody = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(ConfigError, match=f"target server {nobody} cannot be used"):
        dsi.build_decoder(target=target, drafter=drafter, target_servers=[dsi_engines[0].url, nobody])
    with pytest.raises(ConfigError, match="must end in /v1"):
        dsi.build_decoder(target=target, drafter=drafter, target_servers=["http://127.0.0.1:8000"])


@pytest.mark.parametrize("method", ["ar", "si", "dsi"])
def test_a_request_past_the_engines_context_is_refused_before_any_verification(dsi_engines, local, prompts, method):
    """An engine's context (its max_model_len, less the two positions a verification adds) counts before the
    work, as the local model's does: the request is refused at once, no engine is asked."""
    target, drafter, _ = local
    engines = EngineTarget([e.url for e in dsi_engines], reference=target)
    room = engines.max_context - len(prompts[0])
    assert engines.max_context < target.max_context  # the engine's limit is the binding one
    before = [answered_requests(e) for e in dsi_engines]
    with dsi.build_decoder(target=engines, drafter=drafter if method != "ar" else None, method=method,
                           lookahead=2, target_servers=True) as decoder:
        with pytest.raises(ContextLengthError, match=f"max_new_tokens={room + 5} exceeds .*max_context="
                                                     f"{engines.max_context}"):
            decoder.generate(dsi.engine.api.make_request(prompts[0], room + 5, SamplingParams(), None,
                                                         target.vocab_size))
    assert [answered_requests(e) for e in dsi_engines] == before


@pytest.mark.slow
def test_an_engine_serving_another_model_is_refused_at_start(dirs, local):
    target, drafter, _ = local
    other = start_dsi_serve(dirs["other"])
    try:
        with pytest.raises(ConfigError, match=f"target server {other.url}: 'tiny' does not compute the local"):
            dsi.build_decoder(target=target, drafter=drafter, target_servers=[other.url])
    finally:
        other.stop()


def connections_to(ports) -> list:
    import psutil

    return [c for c in psutil.Process().net_connections("tcp")
            if c.raddr and c.raddr.port in ports and c.status == "ESTABLISHED"]


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_an_engine_lost_mid_request_leaves_the_request_correct_on_the_other(dirs, local, prompts, reference, fault):
    target, drafter, _ = local
    engines = start_all([lambda: start_dsi_serve(dirs["target"]) for _ in range(2)])
    strike = Strike(engines[1], signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    try:
        decoder = dsi.build_decoder(target=target, drafter=drafter, method="dsi", lookahead=2,
                                    target_servers=[e.url for e in engines],
                                    transport_options={"liveness": FAST_LIVENESS})
        try:
            start = time.monotonic()
            result = decoder.generate(dsi.engine.api.make_request(prompts[0], TOKENS, SamplingParams(), None,
                                                                  target.vocab_size), strike)
            assert result.tokens == reference[0]
            assert time.monotonic() - start < 60
            assert strike.done.is_set()
            again = decoder.generate(dsi.engine.api.make_request(prompts[1], TOKENS, SamplingParams(), None,
                                                                 target.vocab_size))
            assert again.tokens == reference[1]  # the decoder serves on with the engine left
        finally:
            decoder.close()
        assert connections_to({e.port for e in engines}) == []  # closing left no connection open
    finally:
        for e in engines:
            e.stop()


LONG = 160  # tokens of a request that a lost engine must not cut short (EOS ignored: the answer has them all)
# the engine that is lost (dsi serve over its scoring channel, the default, or over HTTP only; vLLM) and the
# way in (dsi generate, a dsi serve over the engines); the vLLM victim through the CLI, as it was reported
LOSSES = [(victim, entry) for victim in ("dsi-serve-channel", "dsi-serve-http") for entry in ("cli", "server")]
LOSSES.append(("vllm", "cli"))


def start_victim(kind: str, dirs) -> object:
    if kind == "vllm":
        if vllm_python() is None:
            pytest.skip("no vLLM venv: bash packaging/vllm-venv.sh builds it (CI does)")
        return start_vllm(dirs["target"])
    return start_dsi_serve(dirs["target"], *(["--scoring-port", "off"] if kind == "dsi-serve-http" else []))


def long_reference(local, prompt) -> list[int]:
    return dsi.generate(target=local[0], prompt=prompt, method="ar", max_new_tokens=LONG).tokens  # no EOS


@pytest.mark.slow
@pytest.mark.parametrize("victim, entry", LOSSES, ids=[f"{v}-{e}" for v, e in LOSSES])
def test_an_engine_lost_mid_request_with_default_liveness_never_shortens_the_answer(
        dsi_engines, dirs, local, prompts, victim, entry, capsys):
    """Issue 49: a target engine SIGKILLed once it has answered a verification of a long request, with the
    default liveness settings, through ``dsi generate`` and through a ``dsi serve`` whose target servers are
    engines: the answer is whole and the local non-SI's (or an error), never a short one that says "stop"
    or "length". The survivor is a dsi serve engine of the module's."""
    target, drafter, _ = local
    lost = start_victim(victim, dirs)
    urls = [dsi_engines[0].url, lost.url]
    expected = long_reference(local, prompts[0])
    try:
        # the CLI makes the engines' start check after the strike is armed: its requests come first
        before = answered_requests(lost)
        EngineTarget([lost.url], reference=target)
        checks = answered_requests(lost) - before if entry == "cli" else 0
        strike = StrikeAfter(lost, signal.SIGKILL, more=2 + checks)
        if entry == "cli":
            from dsi.cli.main import main

            argv = ["generate", "--target", dirs["target"], "--drafter", dirs["drafter"], "--dtype", "fp32",
                    "--threads", "1", "--prompt", PROMPTS[0], "--max-new-tokens", str(LONG), "--method", "dsi",
                    "--lookahead", "2", "--sp", "2", "--temperature", "0", "--ignore-eos", "--json",
                    "--target-servers", ",".join(urls)]
            strike.arm()
            code = main(argv)
            ended = time.monotonic()
            captured = capsys.readouterr()
            assert code == 0, captured.err[-2000:]
            out = json.loads(captured.out)
            tokens, finish, dead = out["token_ids"], out["finish_reason"], out["stats"].get("dead_servers", 0)
        else:
            import httpx

            from dsi.server import ServeConfig, create_app
            from tests.unit.server.conftest import running_server

            config = ServeConfig(method="dsi", lookahead=2, num_target_servers=2, model_name="front",
                                 target_servers=tuple(urls), temperature=0.0)
            with running_server(create_app(target, drafter, config)) as front:
                strike.arm()
                r = httpx.post(front.url + "/v1/completions", timeout=120, json={
                    "model": "front", "prompt": prompts[0], "max_tokens": LONG, "temperature": 0,
                    "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True})
                ended = time.monotonic()
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            tokens = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
            finish, dead = choice["finish_reason"], None
            assert r.json()["usage"]["completion_tokens"] == LONG
        strike.disarm()
        assert strike.struck_at is not None and strike.struck_at < ended, "the engine was not lost mid-request"
        assert finish == "length" and len(tokens) == LONG, f"a short answer: {len(tokens)} tokens, {finish!r}"
        assert tokens == expected
        if dead is not None:
            assert dead >= 1  # the request saw the server go
    finally:
        lost.stop()


class GarbageAfter(RelayProxy):
    """A real engine behind a relaying proxy that, after ``good`` completions, answers rows of the wrong length."""

    def __init__(self, upstream: str, good: int) -> None:
        self.good, self.answered = good, 0
        super().__init__(upstream)

    def alter(self, request: dict, answer: dict) -> dict:
        self.answered += 1
        if self.answered > self.good:
            answer["choices"][0]["prompt_logprobs"] = answer["choices"][0]["prompt_logprobs"][:-1]
        return answer


@pytest.mark.slow
def test_an_engine_that_starts_answering_garbage_is_dropped_and_the_output_stays_exact(
        dsi_engines, local, prompts, reference):
    target, _, same = local
    liar = GarbageAfter(dsi_engines[1].url, good=1)  # only the canary is honest
    try:  # the liar is server 0, which takes the first window (idle servers tie: the lowest id)
        r = dsi.generate(target=target, drafter=same, prompt=prompts[2], method="dsi", lookahead=2,
                         max_new_tokens=TOKENS, target_servers=[liar.url, dsi_engines[0].url])
        assert r.tokens == reference[2]
        assert liar.answered > liar.good  # it did lie, and was not believed
    finally:
        liar.close()


@pytest.mark.slow
def test_every_engine_gone_is_a_worker_error_naming_the_url(dirs, local, prompts):
    target, drafter, _ = local
    [engine] = start_all([lambda: start_dsi_serve(dirs["target"])])
    try:
        decoder = dsi.build_decoder(target=target, drafter=drafter, method="dsi", lookahead=2,
                                    target_servers=[engine.url])
        engine.stop()
        try:
            with pytest.raises(WorkerError, match=engine.url.replace(".", r"\.")):
                decoder.generate(dsi.engine.api.make_request(prompts[0], 8, SamplingParams(), None,
                                                             target.vocab_size))
        finally:
            decoder.close()
    finally:
        engine.stop()


def test_dsi_serve_over_engines_serves_the_local_non_si_text(dsi_engines, local, prompts, reference):
    import httpx

    from dsi.server import ServeConfig, create_app
    from tests.unit.server.conftest import running_server

    target, drafter, _ = local
    config = ServeConfig(method="dsi", lookahead=3, num_target_servers=2, model_name="front",
                         target_servers=tuple(e.url for e in dsi_engines), temperature=0.0)
    app = create_app(target, drafter, config)
    with running_server(app) as front:
        card = httpx.get(front.url + "/v1/models", timeout=10).json()["data"][0]
        assert card["dsi"]["target_servers"] == [e.url for e in dsi_engines]
        r = httpx.post(front.url + "/v1/completions", timeout=60,
                       json={"model": "front", "prompt": prompts[0], "max_tokens": TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    eos = set(target.eos_token_ids)
    cut = next((i for i, t in enumerate(reference[0]) if t in eos), None)  # the server stops at EOS
    expected = reference[0] if cut is None else reference[0][:cut]
    assert r.json()["choices"][0]["text"] == target.decode(expected)
    assert r.json()["choices"][0]["finish_reason"] == ("length" if cut is None else "stop")
    assert r.json()["dsi"]["num_target_servers"] == 2


def test_generate_cli_over_engines(dsi_engines, dirs, local, prompts, reference, capsys):
    from dsi.cli.main import main

    urls = ",".join(e.url for e in dsi_engines)
    argv = ["generate", "--target", dirs["target"], "--drafter", dirs["drafter"], "--dtype", "fp32", "--threads", "1",
            "--prompt", PROMPTS[1], "--max-new-tokens", str(TOKENS), "--method", "dsi", "-k", "3", "--json",
            "--target-servers", urls]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == reference[1] and out["stats"]["num_target_servers"] == 2
    assert main([*argv, "--transport", "processes"]) == 2
    assert "--target-servers with --transport processes" in capsys.readouterr().err
    assert main([*argv, "--deterministic"]) == 2
    assert "--target-servers with --deterministic" in capsys.readouterr().err


def test_the_engine_process_log_is_clean(dsi_engines):
    """No traceback in the engines' logs from anything above (a cancelled request is not an error)."""
    for engine in dsi_engines:
        assert "Traceback" not in engine.output()



@pytest.mark.slow
def test_selftest_over_engines_passes_against_the_local_law(dsi_engines, dirs, capsys):
    """``dsi selftest --target-servers``: SI and DSI on the engines, greedy against the local non-SI and
    sampling (chi-square) against the local target's exact two-token law."""
    from dsi.cli.main import main

    code = main(["selftest", "--target", dirs["target"], "--drafter", dirs["drafter"], "--dtype", "fp32",
                 "--threads", "1", "--target-servers", ",".join(e.url for e in dsi_engines), "--positions", "1",
                 "--samples", "150", "--max-new-tokens", "8", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    names = [c["name"] for c in report["checks"]]
    assert "greedy DSI == non-SI" in names and any("chi-square" in n for n in names)
    assert all(c["passed"] for c in report["checks"])


@pytest.mark.slow
def test_a_connection_the_engine_closed_while_idle_is_reopened_not_taken_for_a_lost_server(dsi_engines, local):
    """uvicorn closes a kept-alive connection after 5 idle seconds; the next verification must go out
    on a new connection instead of killing the server (and charging its task a death)."""
    target = local[0]
    engines = EngineTarget([dsi_engines[0].url], reference=target)
    session = engines.new_session()
    try:
        first = session.extend_rows([5, 6, 7, 8], None, 2, True)
        time.sleep(6.0)
        session.truncate(0)
        again = session.extend_rows([5, 6, 7, 8], None, 2, True)
        assert list(again) == list(first)
    finally:
        session.close()
