"""Telemetry of the engines: forward counts and the time spent in them (dsi.engine.stats)."""

from __future__ import annotations

import pytest

import dsi
from dsi.models import synthetic_pair

DRAFTER_S, TARGET_S = 0.004, 0.012


@pytest.mark.parametrize("method", ["dsi", "si"])
def test_forward_times_are_counted_for_drafter_and_target(method, no_thread_leak):
    """Every forward of an emulated-latency model that runs to its end lasts at least its latency,
    so with a drafter that is always right (nothing is preempted) the mean forward times reported
    can never be below those latencies."""
    target, drafter = synthetic_pair(1.0, target_tpot=TARGET_S, drafter_tpot=DRAFTER_S)
    out = dsi.generate(target=target, drafter=drafter, prompt=[1, 2, 3], method=method, max_new_tokens=24,
                       lookahead=3, num_target_servers=2)
    s = out.stats
    assert s.drafter_forwards > 0 and s.target_forwards > 0
    assert s.mean_drafter_forward_s >= DRAFTER_S * 0.999
    assert s.mean_target_forward_s >= TARGET_S * 0.999
    assert s.drafter_busy_s == pytest.approx(s.mean_drafter_forward_s * s.drafter_forwards)
    d = s.to_dict()
    assert d["mean_drafter_forward_s"] == s.mean_drafter_forward_s and d["drafter_busy_s"] == s.drafter_busy_s


def test_non_si_counts_target_time_and_no_drafter():
    target, _ = synthetic_pair(0.7, target_tpot=TARGET_S)
    s = dsi.generate(target=target, prompt=[1, 2], method="ar", max_new_tokens=5).stats
    assert s.target_forwards == 5 and s.mean_target_forward_s >= TARGET_S * 0.999
    assert s.drafter_forwards == 0 and s.mean_drafter_forward_s == 0.0


def test_dsi_busy_times_include_preempted_forwards_and_fit_in_the_wall_time(no_thread_leak):
    target, drafter = synthetic_pair(0.5, target_tpot=TARGET_S, drafter_tpot=DRAFTER_S)
    s = dsi.generate(target=target, drafter=drafter, prompt=[1, 2, 3], max_new_tokens=30, lookahead=3,
                     num_target_servers=2).stats
    assert s.rejections > 0 and s.preempted_tasks > 0
    assert 0 < s.drafter_busy_s <= s.wall_time_s  # one drafter thread
    assert 0 < s.target_busy_s <= 2 * s.wall_time_s  # two servers
