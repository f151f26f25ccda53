"""Fixed-lookahead results are exactly what they were before the event-driven policy was added.

``data/fixed_k_baseline.json`` was recorded with the event simulator as it was before
``lookahead="auto"``, ``max_window`` and ``latency_cv`` existed (a grid of DSI configurations
with c in {0.05, 0.2, 0.5, 0.9}, a in {0, 0.5, 0.9, 1}, k in {1, 2, 5}, SP in {1, 2, None}, plus
TTFT, preemption delay, newest-first queue, SI and non-SI). Every statistic must be equal, not
merely close.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from dsi.sim.events import simulate

DATA = json.loads((Path(__file__).parent / "data" / "fixed_k_baseline.json").read_text())


@pytest.mark.parametrize("record", DATA["records"], ids=lambda r: f"{r['method']}-{r['kwargs']}")
def test_fixed_k_outputs_are_unchanged(record):
    result = simulate(record["method"], **DATA["common"], **record["kwargs"])
    got = [[asdict(run)[f] for f in DATA["fields"]] for run in result.runs]
    assert got == record["runs"]


def test_the_baseline_covers_the_grid():
    dsi = [r for r in DATA["records"] if r["method"] == "dsi"]
    assert len(dsi) >= 4 * 4 * 3 * 3
    assert {r["kwargs"]["lookahead"] for r in dsi} == {1, 2, 3, 5}
    assert any(r["kwargs"].get("preempt_delay") for r in dsi)
    assert {r["method"] for r in DATA["records"]} == {"dsi", "si", "ar"}
