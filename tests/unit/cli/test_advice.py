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
    text = "\n".join(need["lines"])
    assert f"With {need['num_target_servers']} target server" in text and "dsi plan" in text
    assert f"{need['predicted_speedup_vs_si']:.2f}x SI" in text
    assert "40 ms" in text and "25 ms" in text and "0.80" in text
    assert what_dsi_needs(ROWS, "DSI k=4 SP=1") is None
    assert what_dsi_needs([r for r in ROWS if r["method"] != "non-SI"], "SI k=4") is None


def test_the_advice_is_a_few_short_lines_each_number_labelled_with_what_it_times():
    """Issue 64 item 12: not one dense sentence; the target's number says it is a one-token forward."""
    lines = what_dsi_needs(ROWS, "SI k=4")["lines"]
    assert 3 <= len(lines) <= 8 and all(len(line) <= 100 for line in lines)
    by_number = {number: next(line for line in lines if number in line) for number in ("40 ms", "25 ms", "0.80")}
    assert "one-token target forward" in by_number["40 ms"]
    assert "drafter step, one draft token" in by_number["25 ms"]
    assert "acceptance" in by_number["0.80"]


def test_the_auto_choices_contention_reason_labels_each_forward_in_short_clauses():
    """The choice's reason the demo prints under "auto: picked": the DSI forward is a verification of its mean
    window + 1 tokens, set against its estimate alone, and the one-token forward is named as such."""
    from dsi.evaluate.autotune import SI_CALIBRATION_K, AutoChoice, _why_dsi_loses

    measured = {"DSI auto SP=2": {"target_forward_s": 0.1332, "drafter_step_s": 0.030, "mean_window": 2.2},
                f"SI k={SI_CALIBRATION_K}": {"drafter_step_s": 0.020}}
    reason = "SI k=4: 1.000 s for 32 tokens; DSI's best here (DSI auto SP=2) is 1.30x slower: " + _why_dsi_loses(
        measured, 2, 0.8, target_alone_s=0.0330, slope=0.0366)
    choice = AutoChoice("si", 4, 1, reason, (), {}, 0.8, 32, "key", "now")
    lines = choice.reason_lines()
    assert len(lines) >= 4 and all(len(line) <= 110 for line in lines), lines
    verification = next(line for line in lines if "133.2 ms" in line)
    assert "verification of 3.2 tokens" in verification and "113.5 ms alone" in verification
    assert any("one-token target forward" in line and "33.0 ms" in line for line in lines)
    assert any("drafter step (one draft token)" in line and "30.0 ms" in line and "20.0 ms" in line for line in lines)
