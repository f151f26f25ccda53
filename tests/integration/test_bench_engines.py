"""``dsi bench`` over engines: ``dsi serve --synthetic SCENARIO`` serves a scenario's synthetic model
with its emulated latency (a real server process), and ``dsi bench --target-servers / --drafter-server``
runs that scenario with its target servers and drafter as those engines; engines serving something
else are refused before anything runs."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("fastapi")

from tests.engine_servers import EngineProcess, free_port  # noqa: E402


def start_synthetic(scenario: str, role: str = "target") -> EngineProcess:
    port = free_port()
    return EngineProcess([sys.executable, "-m", "dsi.cli.main", "serve", "--synthetic", scenario, "--synthetic-role",
                          role, "--method", "ar", "--max-logprobs", "-1", "--port", str(port)], port)


@pytest.fixture(scope="module")
def engines():
    started = []
    try:
        for scenario, role in (("default", "target"), ("default", "target"), ("default", "drafter"),
                               ("half-accept", "target")):
            started.append(start_synthetic(scenario, role))
        yield started
    finally:
        for e in started:
            e.stop()


def test_bench_over_synthetic_engines(engines, capsys):
    from dsi.cli.main import main

    a, b, drafter, _ = engines
    argv = ["bench", "--scenario", "default", "--tokens", "16", "--repeats", "1", "--json", "--no-progress",
            "--target-servers", f"{a.url},{b.url}", "--drafter-server", drafter.url]
    assert main(argv) == 0
    [row] = json.loads(capsys.readouterr().out)["results"]
    assert row["identical_outputs"]  # non-SI, SI and DSI over the engines: the same tokens
    assert row["scenario"]["servers"] == 2 and row["tokens"] == 16
    assert row["dsi_over_ideal"] is not None and row["dsi_over_ideal"] > 0.5
    # the same run here, in one process, gives those tokens too: the engines serve the scenario's models
    assert main(argv[:8]) == 0
    [local] = json.loads(capsys.readouterr().out)["results"]
    assert local["identical_outputs"] and local["acceptance_rate"] == pytest.approx(row["acceptance_rate"], abs=0.2)


@pytest.mark.parametrize("extra, says", [
    (["--scenario", "default", "--target-servers", "{other}"], "serves {'scenario': 'half-accept', 'role': 'target'}"),
    (["--scenario", "default", "--target-servers", "{drafter}"], "not scenario 'default''s target"),
    (["--scenario", "default", "--target-servers", "{a}", "--drafter-server", "{a}"], "not scenario 'default''s drafter"),
    (["--target-servers", "{a}"], "need one --scenario"),
])
def test_bench_refuses_engines_serving_something_else(engines, capsys, extra, says):
    from dsi.cli.main import main

    a, _, drafter, other = engines
    names = {"a": a.url, "drafter": drafter.url, "other": other.url}
    argv = ["bench", "--tokens", "4", "--repeats", "1", "--no-progress", *[x.format(**names) for x in extra]]
    assert main(argv) == 2
    assert says in capsys.readouterr().err


def test_a_synthetic_engine_scores_comma_separated_ids(engines):
    import httpx

    r = httpx.post(engines[0].url + "/completions", timeout=30,
                   json={"prompt": "1,2,3", "max_tokens": 2, "temperature": 0, "logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "synthetic-default-target" and body["usage"]["prompt_tokens"] == 3
    choice = body["choices"][0]
    assert [int(t) for t in choice["text"].split(",")] == [int(t) for t in choice["logprobs"]["tokens"]]


def test_a_speculative_front_over_an_emulated_batching_engine_gives_the_engines_own_output():
    """``dsi serve --synthetic S --synthetic-steps TOKEN_MS``: an emulated batching engine (its slots' forwards share
    steps); a speculative ``dsi serve --synthetic S --target-servers`` in front of it verifies there. Greedy: the
    front's answers are the engine's own generation's, whichever way speculation by load (asked for: over engines it
    is off by default) runs."""
    import httpx

    port = free_port()
    engine = EngineProcess([sys.executable, "-m", "dsi.cli.main", "serve", "--synthetic", "default", "--method", "ar",
                            "--synthetic-steps", "0.2", "--max-concurrent", "8", "--port", str(port)], port)
    try:
        port = free_port()
        front = EngineProcess([sys.executable, "-m", "dsi.cli.main", "serve", "--synthetic", "default", "--method",
                               "dsi", "--sp", "2", "--lookahead", "3", "--max-concurrent", "2",
                               "--speculation-by-load", "on", "--target-servers",
                               engine.url, "--port", str(port)], port)
        try:
            prompts = ["1,2,3", "4 5 6 7", "9,8"]
            own = [httpx.post(engine.url + "/completions", timeout=60, json={
                "prompt": p, "max_tokens": 24, "temperature": 0}).json()["choices"][0]["text"] for p in prompts]
            answers = [httpx.post(front.url + "/completions", timeout=60, json={
                "prompt": p, "max_tokens": 24, "temperature": 0}).json() for p in prompts * 2]
            card = httpx.get(front.url + "/models", timeout=10).json()["data"][0]["dsi"]
        finally:
            front.stop()
    finally:
        engine.stop()
    assert [a["choices"][0]["text"] for a in answers] == own * 2
    assert {a["dsi"]["load"]["way"] for a in answers} <= {"speculative", "plain"}
    assert answers[0]["dsi"]["load"]["way"] == "speculative" and answers[0]["dsi"]["drafted_tokens"] > 0
    assert card["method"] == "dsi" and card["synthetic"] == {"scenario": "default", "role": "target"}
