"""The event-driven window policy (dsi.windows): pacing estimates and when a window is sent."""

from __future__ import annotations

import pytest

from dsi.windows import WindowPacer, window_end


def test_without_estimates_a_window_goes_out_with_one_draft():
    assert WindowPacer().min_window(3) == 1
    assert window_end(1, 1, 50, idle_servers=1, min_window=1, max_window=None, drafter_done=False) == 1


@pytest.mark.parametrize("target_s, drafter_s, servers, expected", [
    (0.020, 0.002, 1, 10), (0.020, 0.002, 2, 5), (0.020, 0.002, 7, 2), (0.020, 0.003, 2, 4), (0.001, 0.002, 3, 1),
])
def test_min_window_is_equation_1_from_the_estimates(target_s, drafter_s, servers, expected):
    pacer = WindowPacer()
    pacer.add_target(target_s)
    pacer.add_drafter(drafter_s)
    assert pacer.min_window(servers) == expected


def test_estimates_follow_the_latest_samples():
    pacer = WindowPacer()
    pacer.add_target(0.010)
    for _ in range(40):
        pacer.add_target(0.040)
    assert pacer.target_s == pytest.approx(0.040, rel=1e-3)
    pacer.add_drafter(0.0)  # a zero sample (no time measured) is ignored
    assert pacer.drafter_s is None


def test_a_low_acceptance_lowers_the_floor_to_what_fits_before_the_next_rejection():
    pacer = WindowPacer()
    pacer.add_target(0.020)
    pacer.add_drafter(0.001)  # Equation 1 alone: 20 with one server, 7 with 3, 4 with 5
    assert (pacer.min_window(1), pacer.min_window(3), pacer.min_window(5)) == (20, 7, 4)
    for accepted in [True, False] * 30:  # acceptance 0.5: a rejection every 2 drafts on average
        pacer.add_decision(accepted)
    assert pacer.acceptance == pytest.approx(0.5, abs=0.02)
    # 1.5 x 2 = 3 positions likely decided before a rejection, over the servers beside the zero-draft task
    assert (pacer.min_window(1), pacer.min_window(3), pacer.min_window(5)) == (3, 2, 1)
    for _ in range(300):
        pacer.add_decision(True)  # an acceptance near 1: Equation 1 rules again
    assert pacer.min_window(3) == 7


def test_window_end_waits_for_an_idle_server_and_enough_drafts():
    kw = dict(min_window=4, max_window=None, drafter_done=False)
    assert window_end(1, 9, 50, idle_servers=0, **kw) is None  # every server busy: drafts pile up
    assert window_end(1, 3, 50, idle_servers=2, **kw) is None  # too few drafts yet
    assert window_end(1, 9, 50, idle_servers=1, **kw) == 9  # all undispatched drafts at once
    assert window_end(10, 9, 50, idle_servers=1, **kw) is None  # nothing new since the last window


def test_window_end_sends_the_last_drafts_without_waiting_for_more():
    assert window_end(5, 6, 50, idle_servers=1, min_window=4, max_window=None, drafter_done=True) == 6
    assert window_end(5, 7, 6, idle_servers=1, min_window=4, max_window=None, drafter_done=False) == 6  # horizon


def test_max_window_caps_the_window_and_lowers_the_floor():
    assert window_end(1, 20, 50, idle_servers=1, min_window=4, max_window=6, drafter_done=False) == 6
    assert window_end(1, 2, 50, idle_servers=1, min_window=4, max_window=2, drafter_done=False) == 2
