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
    than DSI, whose rejections still cost a restart (docs/results.md#method-auto-and-the-planner-with-trees)."""
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


# ---- the plan and Equation 1's advice agree (issue 49, item 8.2) --------------------------------
def test_among_equal_times_the_plan_takes_the_lookahead_that_does_not_queue():
    """c = 0.1, a = 0.8, 4 servers: k = 2 (Equation 1 wants 5 servers) and k = 3 (wants 4) take the
    same time, k = 2 with 695 ms of queueing. The plan used to be k = 2 while its advice said
    "lookahead >= 3 avoids queueing"."""
    inputs = resolve_inputs(target_tpot_ms=50.0, drafter_tpot_ms=5.0, acceptance=0.8)
    plan = make_plan(inputs, max_servers=4, max_lookahead=6, tokens=100, repeats=2, seed=0)
    k2, k3 = plan.candidates[1], plan.candidates[2]
    assert k2.latency_ms == k3.latency_ms and k2.num_servers == k3.num_servers == 4  # the tie
    assert k2.queue_wait_ms == pytest.approx(695.0) and k3.queue_wait_ms == 0.0
    assert plan.min_lookahead_for_budget == 3
    assert plan.best == k3 and plan.best.meets_equation1 and plan.fastest_meeting_equation1 == k3
    assert plan.ties == (k2,)  # as fast, but second in the order: fewer servers, less queueing, smaller k
    assert plan.ranked[:2] == (k3, k2)
    assert [row.fixed for row in plan.by_servers if row.num_servers == 4] == [k3]  # the same rule per servers
    data = plan.to_dict()
    assert data["lookahead"] == 3 and data["equation1"]["met"] is True
    assert data["equation1"]["fastest_meeting_it"]["lookahead"] == 3
    assert [c["lookahead"] for c in data["ties"]] == [2]


def test_a_plan_that_queues_says_what_the_fastest_lookahead_without_queueing_costs():
    """Vicuna-13B-like pair, 7 servers: Equation 1 wants k >= 3, but k = 1 (which queues) is faster."""
    inputs = resolve_inputs(target_tpot_ms=37.7, drafter_tpot_ms=2.5, acceptance=0.63)
    plan = make_plan(inputs, max_servers=7, max_lookahead=6, tokens=60, repeats=6, seed=0)
    assert plan.min_lookahead_for_budget == 3
    assert plan.best.lookahead < 3 and not plan.best.meets_equation1 and plan.best.queue_wait_ms > 0
    alt = plan.fastest_meeting_equation1
    assert alt.lookahead >= 3 and alt.meets_equation1
    assert alt == min((c for c in plan.candidates if c.lookahead >= 3), key=lambda c: c.latency_ms)
    assert alt.latency_ms > plan.best.latency_ms * (1 + 1e-9)  # strictly slower: no tie to break
    assert plan.to_dict()["equation1"]["met"] is False
