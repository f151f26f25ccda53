"""dsi bench: the engine on emulated-latency pairs, and the window-policy comparison (dsi.evaluate.bench)."""

from __future__ import annotations

import json

import pytest

from dsi.evaluate.bench import POLICY_SCENARIOS, SCENARIOS, Scenario, run_window_policies
from dsi.cli.main import main


def test_policy_scenarios_hold_every_bench_scenario_table1_and_the_new_ones():
    assert set(SCENARIOS) < set(POLICY_SCENARIOS)
    table1 = [s for s in POLICY_SCENARIOS.values() if s.name.startswith("t1-")]
    assert len(table1) == 10 and all(1 <= s.servers <= 7 for s in table1)
    assert POLICY_SCENARIOS["eq1-k5-wrong"].servers == 2
    assert POLICY_SCENARIOS["random-target-latency"].target_cv == 0.5


def test_window_policies_are_compared_on_the_same_pair(no_thread_leak):
    scenario = Scenario("tiny", 4.0, 0.5, 0.8, 5, 2)
    r = run_window_policies(scenario, tokens=24, repeats=1, lookaheads=(1, 3, 5))
    walls = r["median_wall_s"]
    assert set(walls) == {"1", "3", "5", "auto"}
    assert r["best_fixed_s"] == min(walls[k] for k in ("1", "3", "5")) == walls[str(r["best_k"])]
    assert r["auto_over_best_fixed"] == pytest.approx(walls["auto"] / r["best_fixed_s"])
    assert r["identical_outputs"]  # every policy gives non-SI's tokens
    assert r["auto_mean_window"] >= 1 and r["ideal_auto_s"] > 0


def test_cli_bench_windows_json_and_its_errors(capsys, no_thread_leak):
    code = main(["bench", "--windows", "--scenario", "all-accept", "--repeats", "1", "--tokens", "12", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["results"][0]["identical_outputs"]
    assert len(doc["results"][0]["median_wall_s"]) == 11  # k = 1..10 and auto
    assert main(["bench", "--scenario", "eq1-k5-wrong", "--repeats", "1"]) == 2
    assert "needs --windows" in capsys.readouterr().err


def test_cli_bench_with_a_draft_tree_runs_si_and_dsi_as_trees(capsys, no_thread_leak):
    code = main(["bench", "--scenario", "half-accept", "--repeats", "1", "--tokens", "12", "--draft-tree", "2",
                 "--json"])
    row = json.loads(capsys.readouterr().out)["results"][0]
    assert code == 0 and row["identical_outputs"] and row["draft_tree"] == "2" and row["dsi_tree_windows"] > 0
    assert main(["bench", "--windows", "--draft-tree", "auto"]) == 2
    assert "use one or the other" in capsys.readouterr().err
    assert main(["bench", "--scenario", "default", "--draft-tree", "3,2"]) == 2  # SI-only widths: refused for DSI
    assert "DSI branches position by position" in capsys.readouterr().err
