"""The demo's advice: the planner fed with the latencies the demo measured."""

from __future__ import annotations

import pytest

from dsi.cli.advice import measured_inputs, what_dsi_needs


def row(method, latency, ttft=0.0, accept=0.0, drafter_busy=0.0, drafter_forwards=0, prompt=0, tokens=65):
    return {"prompt": prompt, "method": method, "latency_s": latency, "new_tokens": tokens, "acceptance_rate": accept,
            "stats": {"time_to_first_token_s": ttft, "drafter_busy_s": drafter_busy,
                      "drafter_forwards": drafter_forwards}}


ROWS = [
    row("non-SI", 2.0 + 64 * 0.040, ttft=2.0),  # target: 40 ms a token, 2 s prefill... per prompt
    row("SI k=2", 3.0, accept=0.9, drafter_busy=1.0, drafter_forwards=50),  # drafter 20 ms
    row("SI k=4", 2.5, accept=0.8, drafter_busy=1.5, drafter_forwards=60),  # the best SI: 25 ms
    row("DSI k=4 SP=1", 3.5, accept=0.8),
]


def test_the_plan_reads_the_target_from_non_si_and_the_drafter_from_the_best_si():
    inputs = measured_inputs(ROWS)
    assert inputs.target_tpot_ms == pytest.approx(40.0)
    assert inputs.target_ttft_ms == pytest.approx(2000.0)
    assert inputs.drafter_tpot_ms == pytest.approx(25.0)  # SI k=4 is the faster SI
    assert inputs.acceptance == pytest.approx(0.8)
    assert inputs.drafter_ttft_ms == pytest.approx(25.0 * 2000.0 / 40.0)


def test_the_advice_names_servers_lookahead_and_predicted_speedups_and_is_silent_when_dsi_wins():
    need = what_dsi_needs(ROWS, "SI k=4")
    assert 1 <= need["num_target_servers"] <= 7
    assert need["predicted_speedup_vs_si"] > 1.0 and need["predicted_speedup_vs_nonsi"] > 1.0
    sentence = need["sentence"]
    assert f"with {need['num_target_servers']} target server" in sentence and "dsi plan" in sentence
    assert f"{need['predicted_speedup_vs_si']:.2f}x SI" in sentence
    assert "40 ms" in sentence and "25 ms" in sentence and "0.80" in sentence
    assert what_dsi_needs(ROWS, "DSI k=4 SP=1") is None
    assert what_dsi_needs([r for r in ROWS if r["method"] != "non-SI"], "SI k=4") is None
