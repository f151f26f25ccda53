"""dsi plan's library: inputs from measure files and flags, and the choice of (k, SP)."""

from __future__ import annotations

import json

import pytest

from dsi.errors import ConfigError
from dsi.sim.events import simulate
from dsi.sim.offline import required_sp
from dsi.sim.plan import make_plan, read_measure_file, resolve_inputs


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return read_measure_file(path)


def latency(model, role, ttft, tpot):
    return {"kind": "latency", "model": model, "role": role, "ttft_ms": ttft, "tpot_ms": tpot, "device": "cpu"}


def test_two_latency_files_without_roles_the_slower_is_the_target(tmp_path):
    files = [write(tmp_path, "d.json", latency("small", None, 9.0, 3.0)),
             write(tmp_path, "t.json", latency("big", None, 80.0, 30.0))]  # fmt: skip
    inputs = resolve_inputs(files=files, acceptance=0.8)
    assert (inputs.target_tpot_ms, inputs.target_ttft_ms) == (30.0, 80.0)
    assert (inputs.drafter_tpot_ms, inputs.drafter_ttft_ms) == (3.0, 9.0)


def test_roles_names_acceptance_file_and_flag_overrides(tmp_path):
    files = [
        write(
            tmp_path,
            "a.json",
            {"kind": "acceptance", "target": "big", "drafter": "small", "acceptance": 0.7, "drafter_tpot_ms": 4.0},
        ),  # fmt: skip
        write(tmp_path, "t.json", latency("big", None, 50.0, 20.0)),  # matched by name
    ]
    inputs = resolve_inputs(files=files)
    assert (inputs.target_tpot_ms, inputs.drafter_tpot_ms, inputs.acceptance) == (20.0, 4.0, 0.7)
    assert inputs.drafter_ttft_ms == 4.0  # defaults to its TPOT
    inputs = resolve_inputs(files=files, acceptance=0.9, target_tpot_ms=25.0)
    assert (inputs.target_tpot_ms, inputs.acceptance) == (25.0, 0.9)
    explicit = [write(tmp_path, "r.json", latency("x", "drafter", 2.0, 1.0))]
    assert resolve_inputs(files=explicit, target_tpot_ms=10.0, acceptance=0.5).drafter_tpot_ms == 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(target_tpot_ms=30.0, acceptance=0.8), "missing --drafter-tpot"),
        (dict(target_tpot_ms=30.0, drafter_tpot_ms=3.0), "missing --acceptance"),
        (dict(target_tpot_ms=30.0, drafter_tpot_ms=30.0, acceptance=0.8), "must be below target-tpot"),
        (dict(target_tpot_ms=30.0, drafter_tpot_ms=-3.0, acceptance=0.8), "drafter-tpot=-3.0 ms must be >= 0"),
        (dict(target_tpot_ms=30.0, drafter_tpot_ms=3.0, acceptance=0.8, target_ttft_ms=-1.0), "target-ttft=-1.0"),
        (dict(target_tpot_ms=30.0, drafter_tpot_ms=3.0, acceptance=1.5), "acceptance=1.5 must be in [0, 1]"),
    ],
)
def test_input_errors(kwargs, message):
    with pytest.raises(ConfigError) as info:
        resolve_inputs(**kwargs)
    assert message in str(info.value)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_measure_file(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="is not JSON"):
        read_measure_file(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match='needs "kind"'):
        write(tmp_path, "k.json", {"kind": "speed"})
    lone = [write(tmp_path, "l.json", latency("m", None, 1.0, 1.0))]
    with pytest.raises(ConfigError, match="has no role"):
        resolve_inputs(files=lone, acceptance=0.5)


def test_plan_is_the_fastest_candidate_within_the_budget():
    inputs = resolve_inputs(target_tpot_ms=30.0, drafter_tpot_ms=3.0, acceptance=0.8)
    plan = make_plan(inputs, max_servers=4, max_lookahead=8, tokens=80, repeats=8, seed=1)
    assert len(plan.candidates) == 8
    assert all(c.num_servers == min(4, required_sp(3.0, 30.0, c.lookahead)) for c in plan.candidates)
    assert plan.best.latency_ms == min(c.latency_ms for c in plan.candidates)
    again = simulate("dsi", target_tpot=30.0, drafter_tpot=3.0, lookahead=plan.best.lookahead,
                     num_servers=plan.best.num_servers, tokens=80, acceptance=0.8, repeats=8, seed=1)  # fmt: skip
    assert plan.best.latency_ms == pytest.approx(again.mean)
    assert plan.min_lookahead_for_budget == 3
    assert plan.nonsi_per_token_ms == pytest.approx(30.0)
    assert plan.speedup_vs_nonsi > plan.speedup_vs_si > 1
    data = plan.to_dict()
    assert data["gpus"] == plan.best.num_servers + 1
    assert data["num_target_servers"] <= 4


def test_the_plan_compares_draft_trees_with_chains_by_their_rescue_rate():
    """No rescue: a tree is its chain (SI's ``auto`` tree drafts the chain's k drafts, DSI's windows go out as
    the chain's do), so the same time; every rejection rescued: trees win in both. In between, SI gains more
    than DSI, whose rejections still cost a restart (docs/results.md section 15)."""
    inputs = resolve_inputs(target_tpot_ms=20.0, drafter_tpot_ms=2.0, acceptance=0.6)
    common = dict(max_servers=3, max_lookahead=8, tokens=60, repeats=6, seed=1)
    gains = {}
    for rate in (0.0, 0.5, 1.0):
        trees = make_plan(inputs, **common, side_rescue=rate).trees
        assert trees.side_rescue == rate
        gains[rate] = (trees.si_gain, trees.dsi_gain)
    assert gains[0.0] == pytest.approx((1.0, 1.0), abs=1e-9)
    assert gains[1.0][0] > gains[0.5][0] > 1.05 and gains[1.0][1] > gains[0.5][1] > 1.0
    assert gains[0.5][0] > gains[0.5][1]
    assert make_plan(inputs, **common).trees is None and "trees" in make_plan(inputs, **common).to_dict()
    with pytest.raises(ConfigError, match="side-rescue=1.5 must be a probability"):
        make_plan(inputs, **common, side_rescue=1.5)
