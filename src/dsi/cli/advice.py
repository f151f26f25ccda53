"""What DSI would need to win where it did not: ``dsi plan`` run on the latencies a demo measured.

The demo runs every worker on this machine's shared cores. The planner (:mod:`dsi.sim.plan`)
assumes what DSI is built for, a drafter and target servers with hardware of their own, each as fast
as this machine was alone. Fed with the forward times and acceptance the demo just measured, it
says how many such target servers, with which lookahead, would make DSI the fastest, and by how
much: a few short lines for the demo, each number labelled with what it times, and the numbers
for its JSON.
"""

from __future__ import annotations

import statistics

from dsi.sim.plan import PlanInputs, make_plan


def measured_inputs(rows: list[dict]) -> PlanInputs | None:
    """Latencies and acceptance from a demo's rows (``compare.summarize`` rows with stats): the
    target's from non-SI runs, the drafter's and the acceptance from the best SI's runs."""
    nonsi = [r for r in rows if r["method"] == "non-SI"]
    si_rows = [r for r in rows if r["method"].startswith("SI")]
    if not nonsi or not si_rows:
        return None
    si_totals: dict[str, float] = {}
    for r in si_rows:
        si_totals[r["method"]] = si_totals.get(r["method"], 0.0) + r["latency_s"]
    best_si = min(si_totals, key=si_totals.get)
    si_rows = [r for r in si_rows if r["method"] == best_si]
    ttft = [r["stats"].get("time_to_first_token_s", 0.0) for r in nonsi]
    tpot = [(r["latency_s"] - t) / (r["new_tokens"] - 1) for r, t in zip(nonsi, ttft, strict=True)
            if r["new_tokens"] > 1]
    drafter = [r["stats"]["drafter_busy_s"] / r["stats"]["drafter_forwards"] for r in si_rows
               if r["stats"].get("drafter_forwards")]
    if not tpot or not drafter or min(tpot) <= 0:
        return None
    target_tpot, target_ttft = statistics.median(tpot), statistics.median(ttft)
    drafter_tpot = statistics.median(drafter)
    return PlanInputs(
        target_tpot_ms=1e3 * target_tpot, drafter_tpot_ms=1e3 * drafter_tpot,
        acceptance=min(0.999, statistics.median(r["acceptance_rate"] for r in si_rows)),
        target_ttft_ms=1e3 * max(target_ttft, target_tpot),
        # the drafter's prefill scales like the target's (same prompt, same kind of model)
        drafter_ttft_ms=1e3 * drafter_tpot * max(1.0, target_ttft / target_tpot),
        sources=("measured by this demo",),
    )


def what_dsi_needs(rows: list[dict], fastest: str, max_servers: int = 7, tokens: int = 64) -> dict | None:
    """The plan for DSI on hardware of its own, and a few short lines saying it, each measured number
    labelled with what it times (None without the measurements; also None when DSI is already the fastest
    here)."""
    if fastest.startswith("DSI"):
        return None
    inputs = measured_inputs(rows)
    if inputs is None:
        return None
    plan = make_plan(inputs, max_servers=max_servers, tokens=tokens, repeats=20, seed=0)
    auto = plan.event_driven
    use_auto = auto is not None and auto.per_token_ms < plan.best.per_token_ms
    servers = auto.num_servers if use_auto else plan.best.num_servers
    per_token = auto.per_token_ms if use_auto else plan.best.per_token_ms
    lookahead = "auto" if use_auto else plan.best.lookahead
    vs_nonsi, vs_si = plan.nonsi_per_token_ms / per_token, plan.si_per_token_ms / per_token
    lines = [
        "DSI is not the fastest here: its drafter and target servers share this machine.",
        f"With {servers} target server{'s' if servers > 1 else ''} of {'their' if servers > 1 else 'its'} own (plus "
        "the drafter's hardware), each as fast as this machine alone,",
        f"`dsi plan` predicts DSI (k={lookahead}) at {vs_nonsi:.2f}x non-SI and {vs_si:.2f}x SI, from what was just "
        "measured:",
        f"  one-token target forward (non-SI's time per token): {inputs.target_tpot_ms:.0f} ms",
        f"  drafter step, one draft token (the best SI's): {inputs.drafter_tpot_ms:.0f} ms",
        f"  acceptance (the best SI's): {inputs.acceptance:.2f}",
    ]
    return {"lines": lines, "num_target_servers": servers, "lookahead": lookahead,
            "predicted_speedup_vs_nonsi": vs_nonsi, "predicted_speedup_vs_si": vs_si,
            "inputs": {"target_tpot_ms": inputs.target_tpot_ms, "target_ttft_ms": inputs.target_ttft_ms,
                       "drafter_tpot_ms": inputs.drafter_tpot_ms, "acceptance": inputs.acceptance}}
