"""Wall-clock benchmarks of the engine on synthetic pairs with emulated latencies.

Each scenario fixes drafter and target latencies (``WithLatency``), an acceptance rate, the
lookahead k and the number of target servers SP. Non-SI, SI and DSI run in the same process,
one after another, ``repeats`` times each; we report medians and ratios measured in that run,
plus DSI's wall time against an *ideal* that has no engine overhead:

- all drafts accepted: the drafter's ``ttft + (N - 1) tpot`` plus one target forward for the
  last window;
- no draft accepted: non-SI's measured time (DSI then is the non-SI chain);
- otherwise: the event simulator's replay of the same accept pattern (when available).

:func:`run_window_policies` compares DSI's window policies on one scenario: every fixed lookahead
k = 1..10 and the event-driven windows (``lookahead="auto"``), with the event simulator's ideal for
the event-driven run. :data:`POLICY_SCENARIOS` adds to the scenarios above the paper's Table 1 rows,
a pair for which Equation 1 says k = 5 is wrong, and one whose target forwards take random times.
"""

from __future__ import annotations

import math
import platform
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from dsi.engine.api import build_decoder, run_once
from dsi.models.emulated.replay import record_decisions
from dsi.models.emulated.synthetic import synthetic_pair


def generate(*, target, prompt, max_new_tokens: int, **options):
    """One request on a decoder built for it (the engine's builder: bench measures the engine)."""
    return run_once(build_decoder(target=target, **options), prompt, max_new_tokens, vocab_size=target.vocab_size)


@dataclass(frozen=True)
class Scenario:
    name: str
    target_ms: float
    drafter_ms: float
    acceptance: float
    lookahead: int
    servers: int
    note: str = ""
    target_cv: float = 0.0  # > 0: each target forward's latency is lognormal with this coefficient of variation


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario("all-accept", 20.0, 2.0, 1.0, 5, 7, "ideal: drafter alone + one target forward"),
        Scenario("never-accept", 20.0, 2.0, 0.0, 5, 7, "ideal: non-SI"),
        Scenario("default", 20.0, 2.0, 0.9, 5, 7, "a drafter 10x faster than the target"),
        Scenario("half-accept", 20.0, 2.0, 0.5, 5, 7),
        Scenario("vicuna13b-cnndm", 37.7, 2.5, 0.63, 5, 7, "Table 1 row 1, ms"),
        Scenario("starcoder15b-humaneval", 20.6, 6.8, 0.93, 5, 4, "Table 1 row 5, ms"),
        Scenario("phi3-14b-alpaca", 49.6, 33.4, 0.87, 1, 2, "Table 1 row 10, ms"),
    ]
}


# what `dsi serve --synthetic` serves: the scenarios above, and the GPU-class latencies of `dsi bench --gpu-class`
# (dsi.evaluate.gpu_class: a 14B target at an H200's bandwidth and a small drafter; a 3-7B target with captured graphs)
# on the synthetic pair, whose drafter agrees with the target 80% of the time whatever the prompt
SERVE_SCENARIOS: dict[str, Scenario] = {
    **SCENARIOS,
    **{s.name: s for s in [
        Scenario("gpu-7/1", 7.0, 1.0, 0.8, 4, 4, "GPU-class forwards: dsi bench --gpu-class's gpu-7/1"),
        Scenario("gpu-3/0.4", 3.0, 0.4, 0.8, 4, 4, "GPU-class forwards: dsi bench --gpu-class's gpu-3/0.4"),
    ]},
}


def _table1_scenarios() -> list[Scenario]:
    from dsi.sim.table import TABLE1

    out = []
    for row in TABLE1:
        servers = min(7, math.ceil(row.target_ms / row.drafter_ms))  # Equation 1 with k = 1, at most 7
        name = f"t1-{row.target}-{row.dataset}".lower().replace(" ", "")
        out.append(Scenario(name, row.target_ms, row.drafter_ms, row.acceptance, 5, servers, "Table 1 row, ms"))
    return out


POLICY_SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        *SCENARIOS.values(),
        *_table1_scenarios(),
        Scenario("eq1-k5-wrong", 20.0, 1.0, 0.9, 5, 2, "SP = 2, c = 0.05: Equation 1 asks k >= 10"),
        Scenario("random-target-latency", 20.0, 2.0, 0.8, 5, 4, "target forwards lognormal, CV 0.5",
                 target_cv=0.5),
    ]
}


def run_window_policies(
    scenario: Scenario, tokens: int = 100, repeats: int = 3, lookaheads=tuple(range(1, 11)), seed: int = 0,
    progress: Callable[[], None] | None = None,
) -> dict:
    """DSI with every fixed lookahead and with event-driven windows on ``scenario``: median wall
    times, the best fixed k, ratios, and the event-driven run over its simulated ideal."""
    target, drafter = scenario_pair(scenario, seed)
    prompt = SYNTHETIC_PROMPT
    walls: dict = {}
    outputs: dict = {}
    windows: dict = {}
    reference = generate(target=target, prompt=prompt, method="ar", max_new_tokens=tokens).tokens
    for policy in [*lookaheads, "auto"]:
        runs = []
        for _ in range(repeats):
            out = generate(target=target, drafter=drafter, prompt=prompt, method="dsi", max_new_tokens=tokens,
                           lookahead=policy, num_target_servers=scenario.servers)
            runs.append(out.stats.wall_time_s)
            outputs[policy] = out.tokens
            windows[policy] = out.stats.mean_window
            if progress:
                progress()
        walls[policy] = statistics.median(runs)
    best_k = min(lookaheads, key=lambda k: walls[k])
    pattern = record_decisions(drafter, prompt, reference).accept_pattern
    ideal = None
    try:
        from dsi.sim.events import simulate

        t, d = scenario.target_ms / 1000, scenario.drafter_ms / 1000
        ideal = float(simulate("dsi", target_tpot=t, drafter_tpot=d, lookahead="auto", num_servers=scenario.servers,
                               matches=pattern, latency_cv=scenario.target_cv,
                               repeats=16 if scenario.target_cv else 1).mean)
    except ImportError:
        pass
    return {
        "scenario": asdict(scenario), "tokens": tokens, "repeats": repeats,
        "median_wall_s": {str(k): v for k, v in walls.items()},
        "best_k": best_k, "best_fixed_s": walls[best_k], "k5_s": walls.get(5), "auto_s": walls["auto"],
        "auto_over_best_fixed": walls["auto"] / walls[best_k],
        "auto_over_k5": walls["auto"] / walls[5] if 5 in walls else None,
        "auto_mean_window": windows["auto"], "ideal_auto_s": ideal,
        "auto_over_ideal": walls["auto"] / ideal if ideal else None,
        "identical_outputs": all(o == reference for o in outputs.values()),
        "pattern_acceptance": sum(pattern) / len(pattern),
    }


def ideal_dsi_seconds(scenario: Scenario, tokens: int, ar_seconds: float, pattern: list[bool]) -> float | None:
    """The engine-free DSI time for this run (see the module docstring)."""
    t, d = scenario.target_ms / 1000, scenario.drafter_ms / 1000
    if all(pattern):
        return d + (tokens - 1) * d + t
    if not any(pattern):
        return ar_seconds
    try:
        from dsi.sim.events import simulate  # the simulator replays the exact accept pattern
    except ImportError:
        return None
    result = simulate(
        "dsi", target_ttft=t, target_tpot=t, drafter_ttft=d, drafter_tpot=d,
        lookahead=scenario.lookahead, num_servers=scenario.servers, tokens=tokens, matches=pattern,
    )
    return float(result.mean)


SYNTHETIC_VOCAB = 64  # the vocabulary of every scenario's synthetic pair
SYNTHETIC_PROMPT = [1, 2, 3, 4]


def scenario_pair(scenario: Scenario, seed: int = 0):
    """The synthetic ``(target, drafter)`` of ``scenario``, with its latencies (what ``dsi bench`` runs, and
    what ``dsi serve --synthetic`` serves)."""
    return synthetic_pair(scenario.acceptance, vocab_size=SYNTHETIC_VOCAB, seed=seed,
                          target_tpot=scenario.target_ms / 1000, drafter_tpot=scenario.drafter_ms / 1000,
                          target_cv=scenario.target_cv)


def run_scenario(
    scenario: Scenario, tokens: int = 100, repeats: int = 3, seed: int = 0,
    progress: Callable[[], None] | None = None, draft_tree: str | None = None,
    target_servers: list[str] | None = None, drafter_server: str | None = None,
) -> dict:
    """Run non-SI, SI and DSI on ``scenario``; return medians, ratios and DSI/ideal. ``draft_tree``: SI
    and DSI windows as draft trees of that shape (:mod:`dsi.trees`; the ideal stays the chain's).

    ``target_servers``: engines serving the scenario's target (``dsi serve --synthetic``): non-SI and SI
    run on the first, DSI on all of them (SP = their number), over HTTP; ``drafter_server``: SI and DSI
    draft on that engine serving the scenario's drafter. The ideal stays the engine-free one, so
    DSI/ideal then includes what the network and the engines cost."""
    if target_servers:
        scenario = replace(scenario, servers=len(target_servers))
    target, drafter = scenario_pair(scenario, seed)
    prompt = SYNTHETIC_PROMPT
    walls: dict[str, list[float]] = {"ar": [], "si": [], "dsi": []}
    outputs: dict[str, list[int]] = {}
    last_stats = {}
    for _ in range(repeats):
        for method in walls:
            remote = {}
            if target_servers:
                remote["target_servers"] = list(target_servers) if method == "dsi" else list(target_servers[:1])
            if drafter_server and method != "ar":
                remote["drafter_server"] = drafter_server
            out = generate(
                target=target, drafter=drafter, prompt=prompt, method=method, max_new_tokens=tokens,
                lookahead=scenario.lookahead, num_target_servers=scenario.servers if method == "dsi" else None,
                draft_tree=None if method == "ar" else draft_tree, **remote,
            )
            walls[method].append(out.stats.wall_time_s)
            outputs[method] = out.tokens
            last_stats[method] = out.stats
            if progress:
                progress()
    med = {m: statistics.median(v) for m, v in walls.items()}
    pattern = record_decisions(drafter, prompt, outputs["ar"]).accept_pattern
    ideal = ideal_dsi_seconds(scenario, tokens, med["ar"], pattern)
    dsi_stats = last_stats["dsi"]
    return {
        "scenario": asdict(scenario),
        "tokens": tokens,
        "repeats": repeats,
        "median_wall_s": med,
        "speedup_dsi_vs_ar": med["ar"] / med["dsi"],
        "speedup_dsi_vs_si": med["si"] / med["dsi"],
        "speedup_si_vs_ar": med["ar"] / med["si"],
        "ideal_dsi_s": ideal,
        "dsi_over_ideal": med["dsi"] / ideal if ideal else None,
        "identical_outputs": outputs["ar"] == outputs["si"] == outputs["dsi"],
        "acceptance_rate": dsi_stats.acceptance_rate,
        "pattern_acceptance": sum(pattern) / len(pattern),
        "dsi_preempted_tasks": dsi_stats.preempted_tasks,
        "dsi_wasted_target_s": dsi_stats.wasted_target_s,
        "dsi_target_utilisation": dsi_stats.target_utilisation,
        "draft_tree": draft_tree or "off",
        "dsi_tree_windows": dsi_stats.extra.get("tree_windows", 0),
        "dsi_tree_side_accepts": dsi_stats.extra.get("tree_side_accepts", 0),
    }


def machine_info() -> dict:
    import os

    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
