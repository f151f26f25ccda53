"""dsi bench --gpu-class: the banked pair over a real vocabulary, each run's own accept pattern, the ideal per
method, and the host time split (dsi.evaluate.gpu_class, dsi.models.emulated.synthetic.banked_pair)."""

from __future__ import annotations

import json
import pickle
import sys

import numpy as np
import pytest

import dsi
from dsi.cli.main import main
from dsi.errors import ConfigError
from dsi.evaluate.gpu_class import GPU_SCENARIOS, GpuScenario, accept_pattern, ideal_seconds, run_gpu_scenario
from dsi.models.base import extend_rows
from dsi.models.emulated.replay import accept_pattern as greedy_accept_pattern
from dsi.models.emulated.synthetic import banked_pair
from dsi.sampling import SamplingParams

SAMPLED = SamplingParams(temperature=0.7, seed=3)


def test_the_banked_pair_is_a_cheap_model_over_a_real_vocabulary():
    target, drafter = banked_pair(0.8, vocab_size=50_000, bank=16)
    assert target.vocab_size == drafter.vocab_size == 50_000
    rows = target.bank.rows
    assert rows.shape == (16, 50_000) and rows.dtype == np.float32 and not rows.flags.writeable
    assert len(set(np.argmax(rows, axis=1).tolist())) == 16  # a distinct argmax per row
    assert np.array_equal(target.bank.argmax, np.argmax(rows, axis=1))
    session = target.new_session()
    full = session.extend([5, 6, 7])  # [3, V]
    session.truncate(1)
    assert np.array_equal(extend_rows(session, [6, 7], None, 2, True), np.argmax(full[1:], axis=1))
    session.truncate(2)
    assert np.array_equal(extend_rows(session, [7], None, 1, False), full[2:])  # the same rows after a rollback
    # a pickle carries the recipe, not the 3 MB bank; the bank rebuilds the same in another process
    data = pickle.dumps(target)
    assert len(data) < 10_000
    assert np.array_equal(pickle.loads(data).bank.rows, rows)


def test_the_banked_drafter_agrees_with_the_target_at_about_its_acceptance():
    target, drafter = banked_pair(0.8, vocab_size=20_000, bank=32, seed=4)
    out = dsi.generate(target=target, prompt=[1, 2, 3], max_new_tokens=300, method="ar").tokens
    pattern = greedy_accept_pattern(drafter, [1, 2, 3], out)
    assert 0.7 < sum(pattern) / len(pattern) < 0.9
    _, never = banked_pair(0.0, vocab_size=20_000, bank=32, seed=4)
    assert not any(greedy_accept_pattern(never, [1, 2, 3], out))  # a disagreeing row has another argmax


def test_the_greedy_pattern_is_the_replay_modules_and_the_sampled_one_counts_dsis_accepts(no_thread_leak):
    target, drafter = banked_pair(0.8, vocab_size=4_000, bank=16, seed=2)
    greedy = dsi.generate(target=target, drafter=drafter, prompt=[1, 2], max_new_tokens=60, method="dsi",
                          lookahead="auto", num_target_servers=2)
    assert accept_pattern(drafter, [1, 2], greedy.tokens, SamplingParams()) == greedy_accept_pattern(
        drafter, [1, 2], greedy.tokens)
    sampled = dsi.generate(target=target, drafter=drafter, prompt=[1, 2], max_new_tokens=60, method="dsi",
                           lookahead="auto", num_target_servers=2, sampling=SAMPLED)
    pattern = accept_pattern(drafter, [1, 2], sampled.tokens, SAMPLED)
    stats = sampled.stats
    # every accepted draft was the drafter's draw at its position; a position the pattern marks that DSI did not
    # accept had no draft (a bonus), never a rejection (a rejected draft's correction is never that draw)
    assert stats.accepted_tokens <= sum(pattern) <= stats.accepted_tokens + stats.bonus_tokens
    assert 0 < stats.rejections and sum(pattern) < len(pattern)


def test_the_ideal_is_the_simulators_time_for_the_pattern():
    scenario = GpuScenario("t", 4.0, 1.0)
    assert ideal_seconds("ar", scenario, [False] * 10) == pytest.approx(10 * 0.004)
    all_in = ideal_seconds("dsi", scenario, [True] * 10)
    assert ideal_seconds("dsi", scenario, [False] * 10) > all_in  # rejections cost
    assert ideal_seconds("si", scenario, [True] * 10) > all_in  # SI waits for each verification


def test_a_scenario_reports_each_method_over_its_ideal_and_the_host_split(no_thread_leak):
    scenario = GpuScenario("tiny", 3.0, 0.5, servers=2)
    rows = run_gpu_scenario(scenario, tokens=24, repeats=1, transports=("threads",))
    assert [(r["request"], r["transport"]) for r in rows] == [("greedy", "threads"), ("sampled", "threads")]
    for r in rows:
        assert r["identical_outputs"]
        assert r["vocab_size"] >= 151_936
        for method in ("ar", "si", "dsi"):
            assert r["median_wall_s"][method] > 0 and r["ideal_s"][method] > 0
        assert r["dsi_over_ideal"] == pytest.approx(r["median_wall_s"]["dsi"] / r["ideal_s"]["dsi"])
        assert r["dsi_over_si"] == pytest.approx(r["median_wall_s"]["si"] / r["median_wall_s"]["dsi"])
        assert 0 < r["pattern_acceptance"] < 1
        if sys.platform.startswith("linux"):
            assert set(r["host_ms_per_token"]) == {"engine", "transport", "servers"}
            assert r["host_ms_per_token"]["engine"] > 0  # the orchestrator's own work is counted
            assert set(r["cpu_ms_per_token"]) == {"ar", "si"} and min(r["cpu_ms_per_token"].values()) > 0
    with pytest.raises(ConfigError, match="transport 'pigeons'"):
        run_gpu_scenario(scenario, transports=("pigeons",))
    with pytest.raises(ConfigError, match="request kind 'beam'"):
        run_gpu_scenario(scenario, requests=("beam",))


def test_a_nucleus_request_runs_with_its_filters_on_a_whole_vocabulary(no_thread_leak):
    from dsi.evaluate.gpu_class import REQUESTS

    params = REQUESTS["nucleus"]
    assert params.top_p < 1 and params.top_k and params.repetition_penalty != 1 and not params.greedy
    (row,) = run_gpu_scenario(GpuScenario("tiny", 3.0, 0.5, servers=2), tokens=16, repeats=1,
                              transports=("threads",), requests=("nucleus",))
    assert row["request"] == "nucleus" and row["identical_outputs"] and row["output_tokens"] == 16


def test_the_cli_runs_a_gpu_class_scenario_as_json(capsys, no_thread_leak):
    assert set(GPU_SCENARIOS) >= {"gpu-7/1", "gpu-3/0.4"}
    code = main(["bench", "--gpu-class", "--scenario", "gpu-3/0.4", "--tokens", "12", "--repeats", "1",
                 "--transport", "threads", "--request", "greedy", "--sp", "2", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    (scenario,) = report["results"]
    (row,) = scenario["rows"]
    assert row["scenario"]["name"] == "gpu-3/0.4" and row["request"] == "greedy" and row["identical_outputs"]
    assert row["scenario"]["servers"] == 2  # --sp: an SP the machine can host


@pytest.mark.parametrize("argv, fragment", [
    (["bench", "--transport", "threads"], "--transport, --request, --sp and --json-schema go with --gpu-class"),
    (["bench", "--sp", "2"], "--transport, --request, --sp and --json-schema go with --gpu-class"),
    (["bench", "--gpu-class", "--scenario", "default"], "not a --gpu-class scenario"),
    (["bench", "--gpu-class", "--windows"], "drop --windows"),
])
def test_the_cli_refuses_gpu_class_options_out_of_place(capsys, argv, fragment):
    assert main(argv) != 0
    assert fragment in capsys.readouterr().err
