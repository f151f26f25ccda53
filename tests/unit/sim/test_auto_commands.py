"""The event-driven policy in dsi simulate, dsi plan and dsi heatmap (library and CLI)."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from dsi.cli.main import main
from dsi.errors import ConfigError
from dsi.sim.events import random_matches, simulate
from dsi.sim.heatmap import (
    EVENT_PANEL,
    PANELS,
    compute_heatmap,
    event_panel,
    fixed_k_lower_bounds,
    grid,
    write_heatmap,
)
from dsi.sim.offline import required_sp
from dsi.sim.plan import make_plan, resolve_inputs


def run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


# ---- dsi simulate ---------------------------------------------------------------------------------
def test_simulate_auto_json_matches_the_library(capsys):
    data = run_json(capsys, ["simulate", "--c", "0.05", "--a", "0.9", "--sp", "2", "--lookahead", "auto",
                             "--tokens", "200", "--repeats", "4", "--max-window", "8", "--json"])  # fmt: skip
    assert data["config"]["lookahead"] == "auto" and data["config"]["max_window"] == 8
    ev = data["dsi"]["event"]
    lib = simulate("dsi", target_tpot=1.0, drafter_tpot=0.05, lookahead="auto", max_window=8, num_servers=2,
                   tokens=200, acceptance=0.9, repeats=4, seed=42)  # fmt: skip
    assert ev["lookahead"] == "auto" and ev["per_repeat"] == pytest.approx(list(lib.per_repeat))
    assert 1 < ev["mean_window"] <= 8
    si_k = data["si"]["lookahead"]
    assert 1 <= si_k <= 20 and data["si"]["event"]["lookahead"] == si_k
    best_si = min(simulate("si", target_tpot=1.0, drafter_tpot=0.05, lookahead=k, tokens=200, acceptance=0.9,
                           repeats=4, seed=42).mean for k in range(1, 21))  # fmt: skip
    assert data["si"]["event"]["mean"] == pytest.approx(best_si)
    assert ev["speedup_vs_si"] == pytest.approx(best_si / lib.mean)
    assert data["nonsi"]["event"]["mean"] == 200.0
    assert "mean" not in data["dsi"]  # no offline simulator for the event-driven policy


def test_simulate_several_lookaheads(capsys):
    argv = ["simulate", "--c", "0.2", "--a", "0.8", "--sp", "3", "--tokens", "100", "--repeats", "3", "--json"]
    both = run_json(capsys, [*argv[:-1], "-k", "2", "auto", "--json"])
    assert both["lookaheads"] == [2, "auto"]
    fixed, auto = both["results"]
    assert fixed == run_json(capsys, [*argv[:-1], "-k", "2", "--json"])  # the single-k object, unchanged
    assert auto["config"]["lookahead"] == "auto"
    assert main([*argv[:-1], "-k", "2", "auto"]) == 0
    out = capsys.readouterr().out
    assert "DSI k=2" in out and "DSI auto" in out and "(best)" in out and "Equation 1: k=2 needs SP >= 3" in out


def test_simulate_latency_cv(capsys):
    base = ["simulate", "--c", "0.1", "--a", "0.7", "-k", "3", "--tokens", "100", "--repeats", "20", "--json"]
    plain = run_json(capsys, base)
    noisy = run_json(capsys, [*base, "--latency-cv", "0.3"])
    assert plain["nonsi"]["event"]["std"] == 0 and noisy["nonsi"]["event"]["std"] > 0
    assert noisy["nonsi"]["event"]["mean"] == pytest.approx(100, rel=0.03)
    assert noisy["config"]["latency_cv"] == 0.3
    assert noisy["dsi"]["mean"] == plain["dsi"]["mean"]  # the offline simulator has no noise
    assert noisy["dsi"]["event"]["mean"] != plain["dsi"]["event"]["mean"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "--c", "0.1", "--a", "0.5", "-k", "3", "--max-window", "2"], "--max-window=2 is only valid"),
        (["simulate", "--c", "0.1", "--a", "0.5", "-k", "auto", "--no-events"], "drop --no-events"),
        (["simulate", "--c", "0.1", "--a", "0.5", "-k", "auto", "--max-window", "0"], "--max-window=0 must be an integer >= 1"),
        (["simulate", "--c", "0.1", "--a", "0.5", "-k", "auto", "--latency-cv", "-1"], "--latency-cv=-1 must be a number >= 0"),
        (["simulate", "--c", "1.5", "--a", "0.5", "-k", "auto"], "--c=1.5 must be a number in (0, 1)"),
        (["simulate", "--c", "0.1", "--a", "2", "-k", "auto"], "--a=2 must be a number in [0, 1]"),
        (["heatmap", "--panel", "fixed_auto", "--no-event-panel", "--no-plot"], "drop --no-event-panel"),
        (["heatmap", "--event-repeats", "0", "--no-plot", "--ndim", "2"], "--event-repeats=0 must be an integer >= 1"),
    ],
)
def test_errors(capsys, tmp_path, argv, message):
    if argv[0] == "heatmap":
        argv = [*argv, "--out", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith(f"dsi {argv[0]}: error:")


def test_lookahead_must_be_an_integer_or_auto(capsys):
    assert main(["simulate", "--c", "0.1", "--a", "0.5", "-k", "fast"]) == 2
    assert "--lookahead='fast' must be an integer >= 1 or 'auto'" in capsys.readouterr().err


# ---- dsi plan -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plan():
    inputs = resolve_inputs(target_tpot_ms=30.0, drafter_tpot_ms=3.0, acceptance=0.8)
    return make_plan(inputs, max_servers=4, max_lookahead=8, tokens=80, repeats=8, seed=1)


def test_plan_simulates_the_event_driven_policy_for_each_number_of_servers(plan):
    assert [a.num_servers for a in plan.auto_candidates] == [1, 2, 3, 4]
    for a in plan.auto_candidates:
        lib = simulate("dsi", target_tpot=30.0, drafter_tpot=3.0, lookahead="auto", num_servers=a.num_servers,
                       tokens=80, acceptance=0.8, repeats=8, seed=1)  # fmt: skip
        assert a.latency_ms == pytest.approx(lib.mean) and a.mean_window == pytest.approx(lib.mean_window)
    assert plan.event_driven.latency_ms == min(a.latency_ms for a in plan.auto_candidates)
    for row in plan.by_servers:
        same = [c for c in plan.candidates if c.num_servers == row.num_servers]
        if same:
            assert row.fixed.latency_ms == min(c.latency_ms for c in same)
            expected = "event-driven" if row.event_driven.latency_ms < row.fixed.latency_ms else "fixed k"
            assert row.better in (expected, "tie")
        else:
            assert row.fixed is None and row.better == "event-driven"
    # the fixed-k plan itself does not change
    again = make_plan(plan.inputs, max_servers=4, max_lookahead=8, tokens=80, repeats=8, seed=1, event_driven=False)
    assert again.best == plan.best and again.candidates == plan.candidates and again.auto_candidates == ()


def test_plan_json_and_text_mention_the_event_driven_policy(capsys):
    argv = ["plan", "--target-tpot", "30", "--drafter-tpot", "3", "--acceptance", "0.8", "--max-servers", "3",
            "--max-lookahead", "6", "--tokens", "60", "--repeats", "5"]  # fmt: skip
    data = run_json(capsys, [*argv, "--json"])
    ev = data["event_driven"]
    assert ev["better"] in ("event-driven", "fixed k", "tie") and 1 <= ev["num_servers"] <= 3
    assert ev["speedup_vs_plan"] == pytest.approx(data["predicted_ms_per_token"] / ev["per_token_ms"])
    assert [row["num_servers"] for row in data["by_servers"]] == [1, 2, 3]
    assert all("better" in row and "event_driven" in row for row in data["by_servers"])
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "event-driven policy" in out and "per number of target servers" in out and "better" in out


# ---- dsi heatmap --------------------------------------------------------------------------------
@pytest.mark.parametrize("a", [0.0, 0.3, 0.8, 1.0])
def test_lower_bounds_are_exact_with_unlimited_servers_and_bounds_otherwise(a):
    patterns = random_matches(a, 40, repeats=3, seed=5)
    c_vals, ks = np.array([0.01, 0.05, 0.2, 0.5, 1.0]), np.arange(1, 9)
    exact = fixed_k_lower_bounds(patterns, c_vals, ks)
    servers = np.array([[min(3, required_sp(c, 1.0, int(k))) for k in ks] for c in c_vals])
    bounds = fixed_k_lower_bounds(patterns, c_vals, ks, servers)
    assert np.all(bounds >= exact - 1e-12)
    for i, c in enumerate(c_vals):
        for j, k in enumerate(ks):
            kw = dict(target_tpot=1.0, drafter_tpot=c, lookahead=int(k), matches=patterns)
            assert simulate("dsi", num_servers=None, **kw).mean == pytest.approx(exact[i, j], abs=1e-9)
            assert simulate("dsi", num_servers=int(servers[i, j]), **kw).mean >= bounds[i, j] - 1e-9


def test_event_panel_equals_simulating_every_k():
    c, a, ks = grid(5)
    fast = event_panel(c, a, ks, tokens=60, repeats=2, seed=3, max_sp=4)
    slow = event_panel(c, a, ks, tokens=60, repeats=2, seed=3, max_sp=4, exhaustive=True)
    for key in ("ev_fixed", "ev_k_fixed", "ev_sp_fixed", "ev_auto", "ev_window"):
        np.testing.assert_array_equal(fast[key], slow[key])
    assert fast["event_simulations"] < slow["event_simulations"] == len(c) * len(a) * (len(ks) + 1)
    # one cell by hand: the best k over every lookahead, and the event-driven policy, same patterns
    i, j = 1, 3
    patterns = random_matches(a[j], 60, repeats=2, seed=3)
    kw = dict(target_tpot=1.0, drafter_tpot=c[i], matches=patterns)
    times = [simulate("dsi", lookahead=int(k), num_servers=min(4, required_sp(c[i], 1.0, int(k))), **kw).mean
             for k in ks]  # fmt: skip
    assert fast["ev_fixed"][i, j] == min(times) and fast["ev_k_fixed"][i, j] == ks[int(np.argmin(times))]
    assert fast["ev_auto"][i, j] == simulate("dsi", lookahead="auto", num_servers=4, **kw).mean


def test_heatmap_gains_the_panel_and_keeps_the_others():
    with_panel = compute_heatmap(4, tokens=100, repeats=2, seed=1, event_tokens=40, event_repeats=2)
    without = compute_heatmap(4, tokens=100, repeats=2, seed=1, event_panel=False)
    for name in ("si", "dsi", "k_si", "k_dsi", "sp_dsi"):
        np.testing.assert_array_equal(getattr(with_panel, name), getattr(without, name))
    assert without.panels == tuple(p for p in PANELS if p != EVENT_PANEL)
    assert with_panel.panels == tuple(PANELS)
    np.testing.assert_array_equal(with_panel.ratio(EVENT_PANEL), with_panel.ev_fixed / with_panel.ev_auto)
    with pytest.raises(ConfigError, match="was not computed"):
        without.ratio(EVENT_PANEL)
    summary = with_panel.summary()
    assert summary["event_panel"] and summary["event_tokens"] == 40 and summary["event_repeats"] == 2
    r = with_panel.ratio(EVENT_PANEL)
    assert summary["cells_event_driven_faster"] == int(np.sum(r > 1 + 1e-9))
    assert summary["min_fixed_auto"] == float(r.min())
    assert without.summary()["event_panel"] is False and "min_fixed_auto" not in without.summary()
    # with enough servers for k = 1 (c >= 1/7 with SP 7) the event-driven policy is k = 1 exactly
    enough = np.array([required_sp(c, 1.0, 1) <= 7 for c in with_panel.c])
    assert np.all(r[enough] == 1.0) and np.all(with_panel.ev_k_fixed[enough] == 1)


def test_heatmap_cli_json_has_the_event_panel(capsys, tmp_path):
    data = run_json(capsys, ["heatmap", "--ndim", "3", "--tokens", "60", "--repeats", "2", "--event-tokens", "30",
                             "--out", str(tmp_path), "--no-plot", "--no-progress", "--json"])  # fmt: skip
    assert data["event_panel"] is True and data["event_tokens"] == 30
    assert "min_fixed_auto" in data and "max_fixed_auto" in data and data["event_simulations"] >= 16
    with open(tmp_path / "heatmap.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 16 and float(rows[5]["fixed_auto"]) == pytest.approx(
        float(rows[5]["ev_fixed"]) / float(rows[5]["ev_auto"])
    )
    data = run_json(capsys, ["heatmap", "--ndim", "3", "--tokens", "60", "--repeats", "2", "--no-event-panel",
                             "--out", str(tmp_path), "--no-plot", "--no-progress", "--json"])  # fmt: skip
    assert data["event_panel"] is False and "min_fixed_auto" not in data
    assert main(["heatmap", "--ndim", "3", "--tokens", "60", "--event-tokens", "30", "--out", str(tmp_path),
                 "--no-plot", "--no-progress"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "fixed_auto" in out and "event-driven DSI faster than the best fixed k in" in out


def test_heatmap_figure_has_five_panels(tmp_path):
    pytest.importorskip("matplotlib")
    result = compute_heatmap(3, tokens=60, repeats=2, seed=1, event_tokens=30, event_repeats=1)
    files = write_heatmap(result, tmp_path, formats=("png",))
    assert sorted(f.name for f in files) == ["heatmap.csv", "heatmap.png"]
    without = compute_heatmap(3, tokens=60, repeats=2, seed=1, event_panel=False)
    with pytest.raises(ConfigError, match="was not computed"):
        write_heatmap(without, tmp_path / "x", panels=[EVENT_PANEL], plot=False)
    assert len(write_heatmap(without, tmp_path / "y", formats=("png",))) == 2  # four panels, no error
