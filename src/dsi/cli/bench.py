"""``dsi bench``: non-SI vs SI vs DSI on emulated-latency synthetic pairs (see dsi.bench)."""

from __future__ import annotations

import argparse
import sys

from dsi.errors import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    from dsi.bench import SCENARIOS

    p = subparsers.add_parser(
        "bench",
        help="benchmark non-SI, SI and DSI on synthetic pairs with emulated latencies",
        description="Runs non-SI, SI and DSI in one process on WithLatency synthetic pairs and "
        "reports median wall times, speedups and DSI's wall time against the ideal.",
    )
    p.add_argument(
        "--scenario", action="append", choices=sorted(SCENARIOS), metavar="NAME",
        help=f"scenario to run (repeatable; default: all). One of: {', '.join(SCENARIOS)}",
    )
    p.add_argument("--tokens", type=int, default=100, help="new tokens per generation (default 100)")
    p.add_argument("--repeats", type=int, default=3, help="runs per method; medians are reported (default 3)")
    p.add_argument("--out", help="also write the JSON report to this file")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from dsi.bench import SCENARIOS, machine_info, run_scenario
    from dsi.cli.output import dumps, format_table, print_json

    if args.tokens < 2:
        raise ConfigError(f"--tokens={args.tokens} must be >= 2")
    if args.repeats < 1:
        raise ConfigError(f"--repeats={args.repeats} must be >= 1")
    names = args.scenario or list(SCENARIOS)
    bar = tqdm(total=len(names) * args.repeats * 3, desc="bench", unit="run", file=sys.stderr,
               disable=args.no_progress or args.json)
    rows = []
    try:
        for name in names:
            rows.append(run_scenario(SCENARIOS[name], args.tokens, args.repeats, progress=bar.update))
    finally:
        bar.close()
    report = {"machine": machine_info(), "results": rows}
    if args.out:
        with open(args.out, "w") as f:
            f.write(dumps(report, indent=2) + "\n")
    if args.json:
        print_json(report)
        return 0
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
    print(f"\n{args.tokens} new tokens, median of {args.repeats} runs per method; "
          "speedups are wall-time ratios (higher is better for DSI); DSI/ideal: lower is better, 1.0 = no overhead.")
    return 0
