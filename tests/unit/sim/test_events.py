"""The event simulator: hand-computed runs, replay semantics, queueing, preemption, TTFT, errors."""

from __future__ import annotations

import numpy as np
import pytest

from dsi.errors import ConfigError
from dsi.sim.analytic import nonsi_time
from dsi.sim.events import random_matches, simulate


def ideal_dsi_latency(matches, k, c, T=1.0):
    """Closed form of one run in the ideal regime (TTFT = TPOT, c <= T, no queueing, no delay).

    An epoch restarted with L tokens left ends at the first rejected offset j (or at L - 1),
    decided at T (j = 0, the zero-draft task) or min(ceil(j / k) k, L) c + T (window ceil(j/k)).
    """
    n, i, total = len(matches), 0, 0.0
    while i < n:
        left, j = n - i, 0
        while j < left - 1 and matches[i + j]:
            j += 1
        total += T if j == 0 else min(-(-j // k) * k, left) * c + T
        i += j + 1
    return total


def dsi(matches, **kw):
    args = dict(target_tpot=1.0, drafter_tpot=0.1, lookahead=2, num_servers=None)
    args.update(kw)
    return simulate("dsi", matches=matches, **args)


# ---- hand-computed runs -------------------------------------------------------------------------
def test_hand_computed_dsi_run():
    # k = 2, c = 0.1, T = 1. Epoch 0: zero-draft decides position 0 at 1.0 (match); window 1
    # (drafts 0-1, sent at 0.2) decides 1 (match) and 2 (mismatch) at 1.2; windows 2 and 3
    # (sent at 0.4 and 0.6) are preempted at 1.2. Epoch 1 from position 3: zero-draft at 2.2,
    # window 1 (sent at 1.4) decides 4 and 5 at 2.4.
    run = dsi([True, True, False, True, True, True]).runs[0]
    assert run.latency == pytest.approx(2.4)
    assert run.rejections == 1
    assert run.accepted == 5
    assert run.fully_accepted_windows == 2
    assert run.tasks == 6
    assert run.preempted_tasks == 2
    assert run.wasted_target_time == pytest.approx((1.2 - 0.4) + (1.2 - 0.6))
    assert run.target_busy == pytest.approx(1 + 1 + 0.8 + 0.6 + 1 + 1)
    assert run.servers_used == 4
    assert run.utilisation == pytest.approx(5.4 / (4 * 2.4))
    assert run.queue_wait == 0.0


def test_all_matches_is_one_epoch_and_no_match_is_non_si():
    n, k, c = 10, 3, 0.1
    assert dsi([True] * n, lookahead=k).mean == pytest.approx(3 * k * c + 1)  # windows 1-3 decide 1..9
    assert dsi([False] * n, lookahead=k).mean == pytest.approx(n * 1.0)
    assert dsi([True] * n, lookahead=4).mean == pytest.approx(n * c + 1)  # final partial window waits for drafting


@pytest.mark.parametrize(("c", "a", "k", "n"), [(0.1, 0.9, 5, 120), (0.3, 0.5, 2, 40), (0.05, 0.7, 10, 90),
                                                (0.5, 0.2, 1, 30), (0.2, 0.8, 3, 57), (0.25, 0.6, 4, 33)])  # fmt: skip
def test_every_run_matches_the_closed_form_in_the_ideal_regime(c, a, k, n):
    patterns = random_matches(a, n, repeats=15, seed=11)
    result = dsi(patterns, drafter_tpot=c, lookahead=k)
    for pattern, latency in zip(patterns, result.per_repeat, strict=True):
        assert latency == pytest.approx(ideal_dsi_latency(pattern, k, c), abs=1e-9)


def test_enough_servers_means_no_queueing_and_the_same_latency():
    patterns = random_matches(0.8, 80, repeats=5, seed=2)
    unlimited = dsi(patterns, drafter_tpot=0.1, lookahead=3, num_servers=None)
    enough = dsi(patterns, drafter_tpot=0.1, lookahead=3, num_servers=5)  # Equation 1: 4, +1 for the final window
    assert enough.per_repeat == pytest.approx(unlimited.per_repeat)
    assert enough.queue_wait == 0.0


def test_hand_computed_si_run():
    # k = 2: iteration 1 drafts 0-1 (0.2) + target (1.2): mismatch at 1 -> 2 tokens; iteration 2
    # from 2 drafts 2-3 + target (2.4): both match -> bonus, 5 tokens; iteration 3: 0 drafts, target.
    run = simulate("si", target_tpot=1.0, drafter_tpot=0.1, lookahead=2, matches=[True, False, True, True, True, True])
    assert run.mean == pytest.approx(3.4)
    assert run.runs[0].rejections == 1
    assert run.runs[0].fully_accepted_windows == 1
    assert run.runs[0].tasks == 3


def test_non_si_is_ttft_plus_tpots():
    r = simulate("ar", target_tpot=2.0, target_ttft=7.0, tokens=10)
    assert r.mean == pytest.approx(nonsi_time(10, 2.0, 7.0)) == pytest.approx(25.0)


# ---- queueing, TTFT, preemption -----------------------------------------------------------------
def test_one_server_fifo_queue_hand_computed():
    # k = 1, c = 0.1, SP = 1: windows sent at 0.1 .. 0.4 wait behind the zero-draft task.
    r = dsi([True] * 5, lookahead=1, num_servers=1)
    assert r.mean == pytest.approx(5.0)
    assert r.queue_wait == pytest.approx(0.9 + 1.8 + 2.7 + 3.6)


def test_fewer_servers_is_never_faster_with_fifo_and_queue_order_matters():
    patterns = random_matches(0.7, 60, repeats=8, seed=4)
    times = {sp: np.array(dsi(patterns, drafter_tpot=0.05, lookahead=1, num_servers=sp).per_repeat)
             for sp in (1, 2, 4, 20)}  # fmt: skip
    assert np.all(times[1] >= times[2] - 1e-9)
    assert np.all(times[2] >= times[4] - 1e-9)
    assert np.all(times[4] >= times[20] - 1e-9)
    assert times[1].mean() > times[20].mean()
    newest = np.array(dsi(patterns, drafter_tpot=0.05, lookahead=1, num_servers=2, queue="newest").per_repeat)
    assert not np.allclose(newest, times[2])


def test_a_server_pays_ttft_on_its_first_task_and_warm_servers_are_preferred():
    # every draft rejected: each zero-draft task runs on the warm server 0 (TTFT once)
    r = dsi([False] * 6, lookahead=1, target_ttft=5.0, num_servers=None)
    assert r.mean == pytest.approx(nonsi_time(6, 1.0, 5.0))
    assert r.runs[0].servers_used > 1  # windows ran (and were preempted) on other, cold servers


def test_drafter_ttft_delays_the_first_drafts():
    base = dsi([True] * 8, lookahead=2).mean
    slow = dsi([True] * 8, lookahead=2, drafter_ttft=0.5).mean
    assert slow == pytest.approx(base + 0.4)


def test_preemption_delay_holds_servers_and_counts_as_waste():
    # k = 1, c = 0.1, SP = 2. Window 1 rejects position 1 at 1.1 while windows 2 (on server 0
    # since 1.0) and 3 (on server 1 since 1.1) run. No delay: the new zero-draft task starts at
    # 1.1 and the run ends at 3.1. With a 0.5 delay both servers stay busy until 1.6, so the
    # zero-draft task and window 1 start at 1.6, window 2 at 2.6, and the run ends at 3.6.
    pattern = [True, False, True, True, True]
    fast = dsi(pattern, lookahead=1, num_servers=2).runs[0]
    slow = dsi(pattern, lookahead=1, num_servers=2, preempt_delay=0.5).runs[0]
    assert fast.latency == pytest.approx(3.1)
    assert fast.wasted_target_time == pytest.approx(0.1)
    assert slow.latency == pytest.approx(3.6)
    assert slow.wasted_target_time == pytest.approx(0.1 + 0.5 + 0.0 + 0.5)
    assert slow.preempted_tasks == fast.preempted_tasks == 3  # windows 2, 3 running and 4 queued


def test_dsi_never_slower_than_non_si_when_a_window_drafts_faster_than_a_target_forward():
    for k, c in ((1, 0.9), (3, 0.3), (5, 0.2), (10, 0.1)):
        patterns = random_matches(0.5, 50, repeats=20, seed=k)
        r = dsi(patterns, drafter_tpot=c, lookahead=k)
        assert max(r.per_repeat) <= 50.0 + 1e-9


def test_drafting_windows_slower_than_the_target_can_lose_to_non_si():
    # k c = 2.5 > T: after the zero-draft, the next decision waits for a whole window of drafts
    r = dsi([True, False] * 10, drafter_tpot=0.5, lookahead=5)
    assert r.mean > 20.0


def test_statistics_are_consistent():
    patterns = random_matches(0.8, 100, repeats=4, seed=9)
    r = dsi(patterns, drafter_tpot=0.1, lookahead=4, num_servers=3, preempt_delay=0.2)
    for run in r.runs:
        assert 0 < run.utilisation <= 1
        assert 0 <= run.wasted_target_time <= run.target_busy
        assert run.accepted + run.rejections == 100
        assert run.preempted_tasks <= run.tasks


# ---- acceptance as a rate -------------------------------------------------------------------------
def test_acceptance_rate_draws_seeded_patterns_shared_by_methods():
    kw = dict(target_tpot=1.0, drafter_tpot=0.1, lookahead=3, tokens=50, acceptance=0.7, repeats=3)
    a = simulate("dsi", seed=1, **kw)
    b = simulate("dsi", seed=1, **kw)
    c = simulate("dsi", seed=2, **kw)
    assert a.per_repeat == b.per_repeat
    assert a.per_repeat != c.per_repeat
    replay = simulate(
        "dsi", target_tpot=1.0, drafter_tpot=0.1, lookahead=3, matches=random_matches(0.7, 50, repeats=3, seed=1)
    )
    assert replay.per_repeat == a.per_repeat


# ---- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(target_tpot=-1.0, drafter_tpot=0.1, tokens=5, acceptance=0.5), "target_tpot=-1.0 must be"),
        (dict(target_tpot=1.0, drafter_tpot=-0.1, tokens=5, acceptance=0.5), "drafter_tpot=-0.1 must be"),
        (dict(target_tpot=1.0, target_ttft=-2, drafter_tpot=0.1, tokens=5, acceptance=0.5), "target_ttft=-2 must be"),
        (dict(target_tpot=1.0, drafter_tpot=0.1, tokens=5, acceptance=0.5, preempt_delay=-1), "preempt_delay=-1"),
        (dict(target_tpot=1.0, drafter_tpot=0.1, tokens=5, acceptance=1.5), "acceptance=1.5 must be in [0, 1]"),
        (dict(target_tpot=1.0, drafter_tpot=0.1, tokens=5), "give acceptance"),
        (dict(target_tpot=1.0, drafter_tpot=0.1, acceptance=0.5, matches=[True]), "either acceptance or matches"),
        (dict(target_tpot=1.0, drafter_tpot=0.1, matches=[1, 0, 1]), "matches must be a sequence of booleans"),
        (dict(target_tpot=1.0, drafter_tpot=0.1, matches=[True], tokens=3), "matches has 1 entries; tokens=3"),
        (dict(target_tpot=1.0, drafter_tpot=0.1, tokens=5, acceptance=0.5, lookahead=0), "lookahead=0 must be"),
        (dict(target_tpot=1.0, drafter_tpot=0.1, tokens=5, acceptance=0.5, num_servers=0), "num_servers=0 must be"),
        (
            dict(target_tpot=1.0, drafter_tpot=0.1, tokens=5, acceptance=0.5, queue="lifo"),
            "queue='lifo' must be one of",
        ),
        (dict(target_tpot=1.0, tokens=5, acceptance=0.5), "needs drafter_tpot"),
    ],
)
def test_errors(kwargs, message):
    with pytest.raises(ConfigError) as info:
        simulate("dsi", **kwargs)
    assert message in str(info.value)


def test_unknown_method():
    with pytest.raises(ConfigError, match="method='tree' must be one of dsi, si, ar"):
        simulate("tree", target_tpot=1.0, tokens=3)


def test_rescues_are_dsi_patterns_shaped_like_matches():
    with pytest.raises(ConfigError, match="si_tree='3' must be one of 2, auto"):
        simulate("si", target_tpot=1.0, drafter_tpot=0.1, lookahead=2, matches=[True], si_tree="3")
    with pytest.raises(ConfigError, match="rescues apply to methods 'dsi' and 'si'"):
        simulate("ar", target_tpot=1.0, matches=[True, False], rescues=[True, True])
    with pytest.raises(ConfigError, match="rescues must be one pattern of 3 positions"):
        simulate("dsi", target_tpot=1.0, drafter_tpot=0.1, matches=[True, False, True], rescues=[True])
    # the drafter right at 0, wrong at 1 (a side child right), right after: one side win instead of a rejection,
    # and the zero-draft task's positions are never rescued
    run = simulate("dsi", target_tpot=1.0, drafter_tpot=0.1, lookahead=2, num_servers=None,
                   matches=[True, False, True, True, False, True], rescues=[True] * 6).runs[0]
    chain = simulate("dsi", target_tpot=1.0, drafter_tpot=0.1, lookahead=2, num_servers=None,
                     matches=[True, False, True, True, False, True]).runs[0]
    assert (chain.rejections, chain.side_wins) == (2, 0)
    assert (run.rejections, run.side_wins) == (0, 2) and run.latency < chain.latency


@pytest.mark.parametrize("lookahead, servers", [(3, 1), (4, 2), (6, 4), ("auto", 1), ("auto", 2)])
def test_dsi_branches_take_autos_decisions_sooner_where_the_draft_after_a_side_child_is_right(lookahead, servers):
    """Every other draft wrong with its side child right, and the draft after that child right: ``"branches"``
    makes ``auto``'s decisions (the same side wins, no rejection), and where the holding window carried that
    draft it also decides the next position, so the request ends sooner with fewer verifications."""
    matches, rescues = [False, True] * 20, [True, False] * 20
    kwargs = dict(target_tpot=1.0, drafter_tpot=0.1, lookahead=lookahead, num_servers=servers, matches=matches,
                  rescues=rescues)
    auto = simulate("dsi", **kwargs).runs[0]
    branches = simulate("dsi", dsi_branches=True, **kwargs).runs[0]
    assert (branches.accepted, branches.rejections, branches.side_wins) == (auto.accepted, auto.rejections,
                                                                           auto.side_wins) == (20, 0, 20)
    assert branches.latency < 0.95 * auto.latency and branches.tasks < auto.tasks
