"""``dsi bench``: non-SI vs SI vs DSI on emulated-latency synthetic pairs (see dsi.evaluate.bench)."""

from __future__ import annotations

import argparse
import sys

from dsi.cli.args import COUNT, DRAFT_TREE, SERVERS, ENGINE_URL, Number, input_file, output_file
from dsi.errors import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    from dsi.evaluate.bench import POLICY_SCENARIOS, SCENARIOS
    from dsi.evaluate.gpu_class import GPU_SCENARIOS, REQUESTS, TRANSPORTS

    p = subparsers.add_parser(
        "bench",
        help="benchmark non-SI, SI and DSI on synthetic pairs with emulated latencies",
        description="Runs non-SI, SI and DSI in one process on WithLatency synthetic pairs and "
        "reports median wall times, speedups and DSI's wall time against the ideal.",
    )
    p.add_argument(
        "--scenario", action="append", choices=sorted([*POLICY_SCENARIOS, *GPU_SCENARIOS]), metavar="NAME",
        help="scenario to run (repeatable; default: all of the mode's). Without --windows one of: "
             f"{', '.join(SCENARIOS)}; with --windows also: "
             f"{', '.join(n for n in POLICY_SCENARIOS if n not in SCENARIOS)}; with --gpu-class: "
             f"{', '.join(GPU_SCENARIOS)}",
    )
    p.add_argument("--gpu-class", action="store_true",
                   help="the engine at accelerator forward times (target / drafter ms in the scenario's name) over "
                        "a 152,064-token vocabulary whose forwards cost the host next to nothing: non-SI, SI (k=4) "
                        "and DSI (lookahead auto, SP=4) against the event simulator's ideal for each run's own "
                        "accept pattern, per --transport and --request, with DSI's host CPU time per token split "
                        "into engine, transport and servers (docs/benchmarks.md)")
    p.add_argument("--transport", action="append", choices=TRANSPORTS, metavar="NAME", dest="transports",
                   help=f"with --gpu-class: DSI's transport (repeatable; one of {', '.join(TRANSPORTS)}; "
                        "default threads and processes)")
    p.add_argument("--json-schema", metavar="FILE", type=input_file,
                   help="with --gpu-class: every request constrained to JSON valid under the schema in FILE, on the "
                        "embedded pair's Qwen2.5 vocabulary (its tokenizer is read from the GGUF, fetched on first use)")
    p.add_argument("--sp", type=SERVERS, default=None,
                   help="with --gpu-class: DSI's target servers (default 4; a machine with few cores hosts fewer)")
    p.add_argument("--request", action="append", choices=list(REQUESTS), metavar="KIND",
                   help="with --gpu-class: greedy, sampled (T=0.7, seed 1) or nucleus (Qwen2.5-Instruct's "
                        "sampling: T=0.7, top_p 0.8, top_k 20, repetition_penalty 1.05, seed 1) requests "
                        "(repeatable; default greedy and sampled)")
    p.add_argument("--windows", action="store_true",
                   help="compare DSI's window policies instead: every fixed k in 1..10 and event-driven "
                        "windows (--lookahead auto), with the best fixed k and k = 5 as references")
    p.add_argument("--draft-tree", type=DRAFT_TREE, default="off", metavar="off|auto[:F]|W",
                   help="SI and DSI with their windows as draft trees of this shape (auto, or one width for every "
                        "position such as 2; not with --windows). The synthetic drafter's second choices are random, "
                        "so this measures what a tree costs where its side children rarely win (default off)")
    p.add_argument("--target-servers", metavar="URL[,URL...]",
                   help="run the one --scenario with its target servers as these HTTP engines, each a 'dsi serve "
                        "--synthetic SCENARIO' (on other machines, to measure what the network costs); SP = their "
                        "number; DSI/ideal then includes the engines' and the network's cost (docs/engines.md)")
    p.add_argument("--drafter-server", metavar="URL", type=ENGINE_URL,
                   help="and draft on this engine, a 'dsi serve --synthetic SCENARIO --synthetic-role drafter'")
    p.add_argument("--tokens", type=Number(int, 2), default=100, help="new tokens per generation (default 100)")
    p.add_argument("--repeats", type=COUNT, default=3, help="runs per method; medians are reported (default 3)")
    p.add_argument("--out", type=output_file, metavar="FILE", help="also write the JSON report to this file")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run)


def _collect(args: argparse.Namespace, scenarios: dict, runner, runs_per_scenario: int, desc: str,
             extra_rounds: int = 0) -> dict | None:
    """Run ``runner`` on the chosen scenarios with a progress bar; write --out; print --json.
    Returns the report for the table, or None when it was printed as JSON."""
    from tqdm import tqdm

    from dsi.evaluate.bench import machine_info
    from dsi.cli.output import dumps, print_json

    names = args.scenario or list(scenarios)
    bar = tqdm(total=len(names) * (args.repeats + extra_rounds) * runs_per_scenario, desc=desc, unit="run", file=sys.stderr,
               disable=args.no_progress or args.json)
    rows = []
    try:
        for name in names:
            rows.append(runner(scenarios[name], args.tokens, args.repeats, progress=bar.update))
    finally:
        bar.close()
    report = {"machine": machine_info(), "results": rows}
    if args.out:
        with open(args.out, "w") as f:
            f.write(dumps(report, indent=2) + "\n")
    if args.json:
        print_json(report)
        return None
    return report


def run(args: argparse.Namespace) -> int:
    from dsi.evaluate.bench import SCENARIOS, run_scenario
    from dsi.cli.output import format_table

    if args.gpu_class:
        return run_gpu_class(args)
    if args.transports or args.request or args.sp is not None or args.json_schema:
        raise ConfigError("--transport, --request, --sp and --json-schema go with --gpu-class")
    if args.windows:
        if args.draft_tree != "off":
            raise ConfigError(f"--draft-tree={args.draft_tree} compares trees with chains at each scenario's k; "
                              "--windows compares window policies of chains: use one or the other")
        return run_windows(args)
    unknown = [n for n in args.scenario or [] if n not in SCENARIOS]
    if unknown:
        raise ConfigError(f"--scenario {unknown[0]} needs --windows; without it: {', '.join(SCENARIOS)}")
    if args.draft_tree != "off":
        from dsi.engine.config import check_draft_tree

        check_draft_tree("dsi", args.draft_tree)  # a shape DSI takes too, before anything runs
    tree = None if args.draft_tree == "off" else args.draft_tree
    urls, drafter_url = synthetic_engines(args)
    report = _collect(args, SCENARIOS, lambda *a, **kw: run_scenario(*a, **kw, draft_tree=tree, target_servers=urls,
                                                                        drafter_server=drafter_url),
                      runs_per_scenario=3, desc="bench")
    if report is None:
        return 0
    rows = report["results"]
    headers = ["scenario", "tgt ms", "dft ms", "a", "k", "SP", "non-SI s", "SI s", "DSI s",
               "DSI/non-SI", "DSI/SI", "DSI/ideal", "acc", "preempt", "same"]
    table = []
    for r in rows:
        s, m = r["scenario"], r["median_wall_s"]
        table.append([
            s["name"], s["target_ms"], s["drafter_ms"], s["acceptance"], s["lookahead"], s["servers"],
            m["ar"], m["si"], m["dsi"], f"{r['speedup_dsi_vs_ar']:.2f}x", f"{r['speedup_dsi_vs_si']:.2f}x",
            "n/a" if r["dsi_over_ideal"] is None else f"{r['dsi_over_ideal']:.3f}",
            r["acceptance_rate"], r["dsi_preempted_tasks"], "yes" if r["identical_outputs"] else "NO",
        ])
    print(format_table(headers, table))
    if tree is not None:
        print(f"SI and DSI with draft tree {tree} (side children that won in DSI: "
              f"{', '.join(str(r['dsi_tree_side_accepts']) for r in rows)})")
    print(f"\n{args.tokens} new tokens, median of {args.repeats} runs per method; "
          "speedups are wall-time ratios (higher is better for DSI); DSI/ideal: lower is better, 1.0 = no overhead.")
    return 0


def synthetic_engines(args: argparse.Namespace) -> tuple[list[str] | None, str | None]:
    """``--target-servers`` and ``--drafter-server``, each engine checked to serve the scenario's synthetic
    model in its role (its model card's ``dsi.synthetic``), before anything runs."""
    from dsi.cli.generate import target_servers
    from dsi.models.engines.target import Connection, check_url, model_cards

    urls = target_servers(args)
    if urls is None and args.drafter_server is None:
        return None, None
    if args.windows:
        raise ConfigError("--target-servers / --drafter-server run one scenario's methods over engines; "
                          "drop --windows")
    if not args.scenario or len(args.scenario) != 1:
        raise ConfigError("--target-servers / --drafter-server need one --scenario: the one the engines serve "
                          "('dsi serve --synthetic SCENARIO')")
    scenario = args.scenario[0]
    for url, role in [*((u, "target") for u in urls or []), *([(args.drafter_server, "drafter")]
                                                              if args.drafter_server else [])]:
        conn = Connection(check_url(url, role), role=role)
        try:
            served = (model_cards(conn, url, role)[0].get("dsi") or {}).get("synthetic")
        finally:
            conn.close()
        if served != {"scenario": scenario, "role": role}:
            raise ConfigError(f"{role} server {url} serves {served or 'no synthetic model'}, not scenario "
                              f"{scenario!r}'s {role}: start it with 'dsi serve --synthetic {scenario}"
                              f"{' --synthetic-role drafter' if role == 'drafter' else ''}'")
    return urls, args.drafter_server


def run_windows(args: argparse.Namespace) -> int:
    from dsi.evaluate.bench import POLICY_SCENARIOS, run_window_policies
    from dsi.cli.output import format_table

    report = _collect(args, POLICY_SCENARIOS, run_window_policies, runs_per_scenario=11, desc="bench --windows")
    if report is None:
        return 0
    rows = report["results"]
    headers = ["scenario", "tgt ms", "dft ms", "a", "SP", "best k", "best k s", "k=5 s", "auto s",
               "auto/best", "auto/k=5", "window", "auto/ideal", "same"]
    table = []
    for r in rows:
        s = r["scenario"]
        table.append([
            s["name"] + (f" (cv {s['target_cv']})" if s["target_cv"] else ""), s["target_ms"], s["drafter_ms"],
            s["acceptance"], s["servers"], r["best_k"], r["best_fixed_s"], r["k5_s"], r["auto_s"],
            f"{r['auto_over_best_fixed']:.3f}", f"{r['auto_over_k5']:.3f}", f"{r['auto_mean_window']:.1f}",
            "n/a" if r["auto_over_ideal"] is None else f"{r['auto_over_ideal']:.3f}",
            "yes" if r["identical_outputs"] else "NO",
        ])
    print(format_table(headers, table))
    print(f"\n{args.tokens} new tokens, median of {args.repeats} runs per policy; auto = event-driven windows; "
          "window: its mean drafts per window; ideal: the event simulator's time for the same policy and pattern.")
    return 0


def run_gpu_class(args: argparse.Namespace) -> int:
    import dataclasses
    from functools import partial

    from dsi.cli.output import format_table
    from dsi.evaluate.gpu_class import GPU_SCENARIOS, run_gpu_scenario

    if args.windows or args.draft_tree != "off" or args.target_servers or args.drafter_server:
        raise ConfigError("--gpu-class runs its own scenarios on chains in this process: drop --windows, "
                          "--draft-tree, --target-servers and --drafter-server")
    unknown = [n for n in args.scenario or [] if n not in GPU_SCENARIOS]
    if unknown:
        raise ConfigError(f"--scenario {unknown[0]} is not a --gpu-class scenario: {', '.join(GPU_SCENARIOS)}")
    transports = list(dict.fromkeys(args.transports or ["threads", "processes"]))
    requests = list(dict.fromkeys(args.request or ["greedy", "sampled"]))
    constraint = None
    if args.json_schema:
        from dsi.cli.generate import _read_text
        from dsi.constraints import BoundConstraint, Constraint
        from dsi.evaluate.gpu_class import embedded_vocabulary

        constraint = BoundConstraint(Constraint.json_schema(_read_text(args.json_schema, "--json-schema")),
                                     embedded_vocabulary())
    runner = partial(run_gpu_scenario, transports=transports, requests=requests, constraint=constraint)
    scenarios = GPU_SCENARIOS if args.sp is None else {
        name: dataclasses.replace(s, servers=args.sp) for name, s in GPU_SCENARIOS.items()}
    report = _collect(args, scenarios, lambda *a, **kw: {"rows": runner(*a, **kw)},
                      runs_per_scenario=len(requests) * (2 + len(transports)), desc="bench --gpu-class",
                      extra_rounds=1)  # a warm-up round
    if report is None:
        return 0
    headers = ["scenario", "SP", "request", "transport", "non-SI/ideal", "SI/ideal", "DSI/ideal", "DSI/non-SI", "DSI/SI",
               "ideal DSI/SI",
               "engine ms/tok", "transport ms/tok", "servers ms/tok", "non-SI ms/tok", "SI ms/tok", "same"]
    table = []
    for scenario in report["results"]:
        for r in scenario["rows"]:
            host = r["host_ms_per_token"] or {}
            table.append([
                r["scenario"]["name"], r["scenario"]["servers"], r["request"], r["transport"], f"{r['ar_over_ideal']:.3f}",
                f"{r['si_over_ideal']:.3f}", f"{r['dsi_over_ideal']:.3f}", f"{r['dsi_over_ar']:.2f}",
                f"{r['dsi_over_si']:.2f}",
                f"{r['ideal_dsi_over_si']:.2f}",
                *(f"{host[part]:.3f}" if part in host else "n/a" for part in ("engine", "transport", "servers")),
                f"{r['cpu_ms_per_token']['ar']:.3f}", f"{r['cpu_ms_per_token']['si']:.3f}",
                "yes" if r["identical_outputs"] else "NO",
            ])
    print(format_table(headers, table))
    print(f"\n{args.tokens} new tokens, median of {args.repeats} runs per method after a warm-up; X/ideal: wall time "
          "over the event simulator's for the run's own accept pattern (1.0 = no host cost); ms/tok: DSI's host CPU "
          "time per token by part (Linux), and non-SI's and SI's (all of this process's CPU time during their runs).")
    return 0
