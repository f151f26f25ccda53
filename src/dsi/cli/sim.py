"""``dsi simulate``, ``dsi heatmap``, ``dsi table``, ``dsi plan``: thin layers over :mod:`dsi.sim`.

Nothing heavy is imported at module level (the simulator is numpy only; matplotlib is imported
when a figure is drawn, the engine when ``dsi table`` runs its engine column).
"""

from __future__ import annotations

import argparse
import sys

from dsi.cli.args import (COUNT, LOOKAHEAD, NON_NEGATIVE, POSITIVE, PROBABILITY, SEED, SERVERS, Number, ascii_int,
                          input_file, output_dir)
from dsi.cli.output import format_table, print_json
from dsi.errors import ConfigError

DRAFTER_COST = Number(float, 0, 1, low_open=True, high_open=True)  # c: drafter latency / target's


def register(subparsers: argparse._SubParsersAction) -> None:
    _register_simulate(subparsers)
    _register_heatmap(subparsers)
    _register_table(subparsers)
    _register_plan(subparsers)


def _info(args: argparse.Namespace, text: str) -> None:
    """Progress for people: stderr, silent with --json."""
    if not args.json:
        print(text, file=sys.stderr, flush=True)


# ---- simulate -----------------------------------------------------------------------------------
def _register_simulate(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="simulate non-SI, SI and DSI for one configuration (offline and event simulators)",
        description=(
            "Simulate non-SI, SI and DSI for one (c, a, k): the offline simulator of the paper "
            "(time units, target forward = 1) and the event simulator of the real algorithm "
            "(TTFT/TPOT, queueing, preemption). --lookahead auto is DSI's event-driven policy (a "
            "window whenever a target server is idle, with every draft made since the previous "
            "one): event simulator only, compared with SI at its best k in 1..20."
        ),
    )
    p.add_argument("--c", type=DRAFTER_COST, required=True, help="drafter latency / target latency, in (0, 1)")
    p.add_argument("--a", type=PROBABILITY, required=True, help="acceptance rate, in [0, 1]")
    p.add_argument(
        "--lookahead",
        "-k",
        type=LOOKAHEAD,
        nargs="+",
        required=True,
        metavar="K",
        help="drafts per verification window (k >= 1), or 'auto' (event-driven DSI); several: one row each",
    )
    p.add_argument(
        "--sp", type=SERVERS, default=7,
        help="target servers for DSI, 1 to 256 (default 7; with a k it must meet Equation 1)"
    )
    p.add_argument("--tokens", type=COUNT, default=1000, help="tokens to generate (default 1000)")
    p.add_argument("--repeats", type=COUNT, default=5, help="repeats (default 5)")
    p.add_argument("--seed", type=SEED, default=42, help="random seed (default 42)")
    p.add_argument(
        "--rng",
        choices=("pcg64", "legacy"),
        default="pcg64",
        help="offline sample stream: pcg64 (default) or legacy (the authors' exact stream)",
    )
    e = p.add_argument_group("event simulator (time units; default: target 1, drafter c)")
    e.add_argument("--target-tpot", type=POSITIVE, default=1.0,
                   help="target time per output token, > 0: the event simulator's unit (default 1)")
    e.add_argument("--target-ttft", type=POSITIVE, default=None,
                   help="target time to first token, > 0 (default: its TPOT)")
    e.add_argument("--drafter-tpot", type=NON_NEGATIVE, default=None,
                   help="drafter time per token (default: c x target TPOT)")
    e.add_argument("--drafter-ttft", type=NON_NEGATIVE, default=None,
                   help="drafter time to first token (default: its TPOT)")
    e.add_argument("--preempt-delay", type=NON_NEGATIVE, default=0.0,
                   help="time a preempted server needs to stop (default 0)")
    e.add_argument("--queue", choices=("fifo", "newest"), default="fifo", help="task queue order (default fifo)")
    e.add_argument(
        "--max-window", type=COUNT, default=None, metavar="N", help="with --lookahead auto: at most N drafts per window"
    )
    e.add_argument(
        "--latency-cv",
        type=NON_NEGATIVE,
        default=0.0,
        metavar="X",
        help="random target forward times: lognormal factors of mean 1 and this coefficient of variation (default 0)",
    )
    e.add_argument("--no-events", action="store_true", help="offline simulator only")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_simulate)


SI_AUTO_LOOKAHEADS = range(1, 21)  # SI's k for the comparison with event-driven DSI


def _simulate_fixed(args: argparse.Namespace, k: int, common: dict) -> dict:
    """Offline simulator, closed forms and (unless --no-events) the event simulator for lookahead k."""
    from dsi.sim import analytic
    from dsi.sim.events import simulate
    from dsi.sim.offline import simulate_offline

    offline = simulate_offline(
        args.c, args.a, k, tokens=args.tokens, repeats=args.repeats, seed=args.seed, sp=args.sp, rng=args.rng
    )
    data = offline.to_dict()
    data["config"]["latency_cv"] = args.latency_cv
    data["analytic"] = {
        "nonsi": analytic.nonsi_time(args.tokens),
        "si_expected": analytic.si_expected_time(args.c, args.a, k, args.tokens),
        "si_tokens_per_iteration": analytic.si_expected_tokens_per_iteration(args.a, k),
        "dsi_offline_expected": analytic.offline_dsi_expected_time(args.c, args.a, k, args.tokens),
        "dsi_lower_bound": analytic.dsi_lower_bound(args.c, k, args.tokens),
    }
    if not args.no_events:
        events = {
            "nonsi": simulate("ar", lookahead=k, **common),
            "si": simulate("si", lookahead=k, **common),
            "dsi": simulate("dsi", lookahead=k, num_servers=args.sp, queue=args.queue,
                            preempt_delay=args.preempt_delay, **common),
        }  # fmt: skip
        _add_events(data, events)
    return data


def _simulate_auto(args: argparse.Namespace, common: dict) -> dict:
    """Event-driven DSI (event simulator only), beside non-SI and SI at its best k."""
    from dsi.sim.events import simulate

    si = min((simulate("si", lookahead=k, **common) for k in SI_AUTO_LOOKAHEADS), key=lambda r: r.mean)
    events = {
        "nonsi": simulate("ar", lookahead="auto", **common),
        "si": si,
        "dsi": simulate("dsi", lookahead="auto", max_window=args.max_window, num_servers=args.sp, queue=args.queue,
                        preempt_delay=args.preempt_delay, **common),
    }  # fmt: skip
    data = {
        "config": {
            "c": args.c,
            "a": args.a,
            "lookahead": "auto",
            "max_window": args.max_window,
            "tokens": args.tokens,
            "repeats": args.repeats,
            "seed": args.seed,
            "sp": args.sp,
            "latency_cv": args.latency_cv,
            "si_lookahead": si.lookahead,  # SI's best k in 1..20
        },
        "nonsi": {},
        "si": {"lookahead": si.lookahead},
        "dsi": {},
    }
    _add_events(data, events)
    return data


def _add_events(data: dict, events: dict) -> None:
    for method, result in events.items():
        entry = result.to_dict()
        entry["speedup_vs_nonsi"] = events["nonsi"].mean / result.mean
        entry["speedup_vs_si"] = events["si"].mean / result.mean
        data[method]["event"] = entry


def cmd_simulate(args: argparse.Namespace) -> int:
    lookaheads = list(dict.fromkeys(args.lookahead))  # in order, without repeats
    auto = "auto" in lookaheads
    if auto and args.no_events:
        raise ConfigError("--lookahead auto is simulated by the event simulator only: drop --no-events")
    if args.max_window is not None and not auto:
        raise ConfigError(f"--max-window={args.max_window} is only valid with --lookahead auto")
    common = dict(
        target_tpot=args.target_tpot,
        target_ttft=args.target_ttft,
        drafter_tpot=args.c * args.target_tpot if args.drafter_tpot is None else args.drafter_tpot,
        drafter_ttft=args.drafter_ttft,
        tokens=args.tokens,
        acceptance=args.a,
        repeats=args.repeats,
        seed=args.seed,
        latency_cv=args.latency_cv,
    )
    if auto:  # the offline simulator's checks of c and a, for auto alone too
        from dsi.sim.offline import check_a, check_c

        check_c(args.c, 1.0)
        check_a(args.a)
    results = [_simulate_auto(args, common) if k == "auto" else _simulate_fixed(args, k, common) for k in lookaheads]
    if args.json:
        print_json(results[0] if len(results) == 1 else {"lookaheads": lookaheads, "results": results})
        return 0
    if lookaheads == [lookaheads[0]] and lookaheads[0] != "auto":
        cfg = results[0]["config"]
        print(
            f"c={cfg['c']} a={cfg['a']} k={cfg['lookahead']} SP={cfg['sp']} (Equation 1: >= {cfg['required_sp']}) "
            f"tokens={cfg['tokens']} repeats={cfg['repeats']} seed={cfg['seed']}"
        )
    else:
        print(f"c={args.c} a={args.a} SP={args.sp} tokens={args.tokens} repeats={args.repeats} seed={args.seed}")
        notes = [f"k={r['config']['lookahead']} needs SP >= {r['config']['required_sp']}" for r in results
                 if r["config"]["lookahead"] != "auto"]  # fmt: skip
        if notes:
            print("Equation 1: " + "; ".join(notes))
        if auto:
            cap = "no cap" if args.max_window is None else f"at most {args.max_window} drafts"
            print(f"auto: event-driven DSI, a window whenever a target server is idle, paced by Equation 1 and the "
                  f"acceptance ({cap}); event simulator only")
    if args.latency_cv > 0:
        print(f"target forward times vary: lognormal factors, mean 1, CV {args.latency_cv}")
    headers = ["method", "offline mean", "vs non-SI", "vs SI"]
    if not args.no_events:
        headers += ["event mean", "vs non-SI", "vs SI", "target util.", "wasted target", "window"]
    rows = []
    seen = set()
    # the non-SI row from a fixed k's results where there is one (they carry the offline figures)
    for data in sorted(results, key=lambda d: d["config"]["lookahead"] == "auto"):
        k = data["config"]["lookahead"]
        labels = [("nonsi", "non-SI")]
        if k == "auto":
            labels += [("si", f"SI k={data['si']['lookahead']} (best)"), ("dsi", "DSI auto")]
        else:
            labels += [("si", f"SI k={k}"), ("dsi", f"DSI k={k}")]
        for method, label in labels:
            if label in seen:
                continue
            seen.add(label)
            m = data[method]
            if "mean" in m:
                row = [label, m["mean"], f"{m['speedup_vs_nonsi']:.2f}x", f"{m['speedup_vs_si']:.2f}x"]
            else:
                row = [label, "-", "-", "-"]
            if not args.no_events:
                ev = m["event"]
                row += [
                    ev["mean"],
                    f"{ev['speedup_vs_nonsi']:.2f}x",
                    f"{ev['speedup_vs_si']:.2f}x",
                    f"{ev['utilisation']:.2f}",
                    ev["wasted_target_time"],
                    f"{ev['mean_window']:.2f}" if method != "nonsi" else "-",
                ]
            rows.append(row)
    print(format_table(headers, rows))
    return 0


# ---- heatmap ------------------------------------------------------------------------------------
def _register_heatmap(subparsers) -> None:
    from dsi.sim.heatmap import EVENT_REPEATS, EVENT_TOKENS, PANELS

    p = subparsers.add_parser(
        "heatmap",
        help="Figure 1: speedups of SI and DSI over the (c, a) plane",
        description=(
            "Figure 1 of the paper from the offline simulator: for every (c, a) on an (ndim + 1) x (ndim + 1) "
            "grid, each method's best lookahead in 1..ndim (only lookaheads where Equation 1 holds with "
            "SP <= --max-sp, for SI too unless --si-all-k; a cell with none is blank and counted as "
            "'no valid k'). A fifth panel compares DSI's event-driven policy with its best fixed "
            "lookahead in the event simulator (shorter runs: --event-tokens x --event-repeats). "
            "Writes heatmap.csv, heatmap.png and heatmap.pdf (docs/simulator.md section 5)."
        ),
    )
    p.add_argument("--ndim", type=Number(int, 2), default=20,
                   help="grid points per axis minus one, and largest k (default 20)")
    p.add_argument("--out", type=output_dir, default="heatmap", help="output directory (default ./heatmap)")
    p.add_argument(
        "--panel",
        action="append",
        choices=None,
        metavar="PANEL",
        help=f"panel to draw (repeatable; default all): {', '.join(PANELS)}",
    )
    p.add_argument("--tokens", type=COUNT, default=1000, help="tokens per run (default 1000)")
    p.add_argument("--repeats", type=COUNT, default=5, help="repeats per configuration (default 5)")
    p.add_argument("--seed", type=SEED, default=42, help="random seed (default 42)")
    p.add_argument("--max-sp", type=SERVERS, default=7, help="target servers available to DSI (default 7)")
    p.add_argument("--rng", choices=("pcg64", "legacy"), default="pcg64", help="sample stream (default pcg64)")
    p.add_argument(
        "--si-all-k",
        action="store_true",
        help="let SI use every k (default: only k valid for DSI under Equation 1, as the authors)",
    )
    p.add_argument(
        "--event-tokens",
        type=COUNT,
        default=EVENT_TOKENS,
        help=f"tokens per run of the event-simulator panel fixed_auto (default {EVENT_TOKENS})",
    )
    p.add_argument(
        "--event-repeats",
        type=COUNT,
        default=EVENT_REPEATS,
        help=f"repeats of the event-simulator panel (default {EVENT_REPEATS})",
    )
    p.add_argument("--no-event-panel", action="store_true", help="skip the event-simulator panel (fixed_auto)")
    p.add_argument("--format", action="append", choices=("png", "pdf"),
                   help="figure format (repeatable; default png and pdf)")
    p.add_argument("--no-plot", action="store_true", help="write the CSV only (no matplotlib needed)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=cmd_heatmap)


def cmd_heatmap(args: argparse.Namespace) -> int:
    from dsi.sim.files import prepare_out_dir
    from dsi.sim.heatmap import EVENT_PANEL, check_panels, compute_heatmap, write_heatmap

    panels = check_panels(args.panel)
    if args.no_event_panel:
        if args.panel and EVENT_PANEL in args.panel:
            raise ConfigError(f"--panel {EVENT_PANEL} needs the event-simulator panel: drop --no-event-panel")
        panels = tuple(p for p in panels if p != EVENT_PANEL)
    prepare_out_dir(args.out)  # fail before simulating
    result = compute_heatmap(
        args.ndim,
        tokens=args.tokens,
        repeats=args.repeats,
        seed=args.seed,
        max_sp=args.max_sp,
        rng=args.rng,
        si_all_k=args.si_all_k,
        progress=not args.no_progress,
        event_panel=not args.no_event_panel,
        event_tokens=args.event_tokens,
        event_repeats=args.event_repeats,
    )
    files = write_heatmap(result, args.out, panels, plot=not args.no_plot, formats=tuple(args.format or ("png", "pdf")))
    summary = result.summary()
    summary["files"] = [str(f) for f in files]
    if args.json:
        print_json(summary)
        return 0
    print(
        f"simulated {summary['configs']} configurations ({summary['valid_dsi_configs']} valid for DSI) x "
        f"{summary['repeats']} repeats x {summary['tokens']} tokens in {summary['simulation_seconds']:.2f} s"
    )
    cells, si_cells = summary["cells"], summary["cells"] - summary["cells_si_no_valid_k"]
    print(
        f"SI slower than non-SI in {summary['cells_si_slower_than_nonsi']} of {si_cells} cells"
        f"{' with a valid k' if si_cells < cells else ''}; DSI slower than SI in "
        f"{summary['cells_dsi_slower_than_si']}, than non-SI in {summary['cells_dsi_slower_than_nonsi']}"
    )
    if summary["cells_no_valid_k"]:
        print(
            f"no valid k in {summary['cells_no_valid_k']} of {cells} cells: no k <= {summary['ndim']} meets Equation 1 "
            f"with SP <= {summary['max_sp']}; blank (grey) in the "
            + ("offline panels" if summary["cells_si_no_valid_k"] else "DSI panels (--si-all-k gives SI a k there)")
            + ", left out of the counts and ratios here"
            + ("; the event-simulator panel lets tasks queue, so it has them" if summary["event_panel"] else "")
        )
    if summary["event_panel"]:
        print(
            f"event simulator ({summary['event_tokens']} tokens x {summary['event_repeats']} repeats, "
            f"{summary['event_simulations']} runs in {summary['event_seconds']:.2f} s): event-driven DSI faster than "
            f"the best fixed k in {summary['cells_event_driven_faster']} cells, slower in "
            f"{summary['cells_event_driven_slower']}, equal in the rest"
        )
    rows = [["-" if summary[f"{m}_{p}"] is None else summary[f"{m}_{p}"] for m in ("min", "max")] for p in panels]
    print(format_table(["panel", "min ratio", "max ratio"], [[p, *r] for p, r in zip(panels, rows, strict=True)]))
    for f in files:
        print(f"wrote {f}")
    return 0


# ---- table --------------------------------------------------------------------------------------
def _register_table(subparsers) -> None:
    p = subparsers.add_parser(
        "table",
        help="Table 1: the paper's DSI/SI speedups beside the offline, event and engine results",
        description=(
            "Table 1 of the paper (Timor et al., ICLR 2025, Table 1; docs/simulator.md section 6): "
            "published DSI/SI, the offline simulator, the "
            "event simulator, and the real engine on the wall clock with latency-emulated synthetic "
            "pairs (with each run's engine/ideal ratio). Writes table1.md, table1.csv, table1.png."
        ),
    )
    p.add_argument("--out", type=output_dir, default="table1", help="output directory (default ./table1)")
    p.add_argument("--no-engine", action="store_true", help="skip the engine column (it runs on the wall clock)")
    p.add_argument("--engine-repeats", type=COUNT, default=2, help="engine runs per method and row (default 2)")
    p.add_argument("--event-repeats", type=COUNT, default=100, help="event simulator repeats (default 100)")
    p.add_argument("--offline-repeats", type=COUNT, default=200, help="offline simulator repeats (default 200)")
    p.add_argument("--tokens", type=COUNT, default=50, help="new tokens per run (default 50, as the paper)")
    p.add_argument("--rows", type=str, default=None, help="rows to run, e.g. 0,4,6 (default all ten)")
    p.add_argument("--seed", type=SEED, default=42, help="simulator seed (default 42)")
    p.add_argument("--no-plot", action="store_true", help="no bar chart (no matplotlib needed)")
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(func=cmd_table)


def _parse_rows(text: str | None, count: int) -> list[int]:
    if text is None:
        return list(range(count))
    try:
        rows = [ascii_int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--rows={text!r} must be comma-separated row numbers in 0..{count - 1}") from None
    bad = [r for r in rows if not 0 <= r < count]
    if bad or not rows:
        raise ConfigError(f"--rows={text!r} must be comma-separated row numbers in 0..{count - 1}")
    return rows


def _engine_generate():
    """The engine column's ``generate``: :func:`dsi.generate` (the simulator never imports the engine)."""
    import dsi

    return dsi.generate


def cmd_table(args: argparse.Namespace) -> int:
    from dsi.sim.files import prepare_out_dir
    from dsi.sim.table import TABLE1, build_table, to_markdown, write_table

    rows = [TABLE1[i] for i in _parse_rows(args.rows, len(TABLE1))]
    prepare_out_dir(args.out)
    table = build_table(
        rows,
        tokens=args.tokens,
        offline_repeats=args.offline_repeats,
        event_repeats=args.event_repeats,
        seed=args.seed,
        engine=not args.no_engine,
        engine_repeats=args.engine_repeats,
        generate=None if args.no_engine else _engine_generate(),
        progress=lambda text: _info(args, text),
    )
    files = write_table(table, args.out, plot=not args.no_plot)
    if args.json:
        data = table.to_dict()
        data["files"] = [str(f) for f in files]
        print_json(data)
        return 0
    print(to_markdown(table), end="")
    for f in files:
        print(f"wrote {f}")
    return 0


# ---- plan ---------------------------------------------------------------------------------------
def _register_plan(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="choose the lookahead and number of target servers for a drafter/target pair",
        description=(
            "Equation 1, then the event simulator: the fastest (lookahead, target servers) within "
            "--max-servers (ties: fewer servers, then less queueing, then the smaller lookahead; a plan "
            "that queues names the fastest lookahead that does not), with its predicted latency per "
            "token and speedups over SI and non-SI; "
            "beside it, for each number of servers, DSI's event-driven policy (no lookahead: a "
            "window whenever a target server is idle) and which of the two is faster. "
            "Inputs from flags or from JSON files written by dsi measure (--from, repeatable); "
            "flags override files."
        ),
    )
    p.add_argument("--drafter-tpot", type=POSITIVE, default=None, metavar="MS", help="drafter time per token, ms")
    p.add_argument("--target-tpot", type=POSITIVE, default=None, metavar="MS", help="target time per token, ms")
    p.add_argument("--drafter-ttft", type=NON_NEGATIVE, default=None, metavar="MS",
                   help="drafter time to first token, ms (default: its TPOT)")
    p.add_argument("--target-ttft", type=NON_NEGATIVE, default=None, metavar="MS",
                   help="target time to first token, ms (default: its TPOT)")
    p.add_argument("--acceptance", type=PROBABILITY, default=None, metavar="A", help="acceptance rate in [0, 1]")
    p.add_argument(
        "--from",
        dest="from_files",
        action="append",
        default=[],
        metavar="FILE",
        type=input_file,
        help="JSON from dsi measure (latency or acceptance); repeatable",
    )
    p.add_argument("--side-rescue", type=PROBABILITY, default=None, metavar="R",
                   help="also compare draft trees with chains (SI and DSI): R is the chance that a rejected draft's "
                        "correction is the drafter's second choice there (what a side child would rescue); "
                        "the embedded pair's recordings give 0.46 on prose, 0.77 on code "
                        "(docs/results.md#method-auto-and-the-planner-with-trees)")
    p.add_argument("--max-servers", type=SERVERS, default=7, help="target servers available (default 7)")
    p.add_argument("--max-lookahead", type=COUNT, default=20, help="largest lookahead to consider (default 20)")
    p.add_argument("--tokens", type=COUNT, default=200, help="tokens per simulated request (default 200)")
    p.add_argument("--repeats", type=COUNT, default=30, help="simulated requests per candidate (default 30)")
    p.add_argument("--seed", type=SEED, default=0, help="random seed (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from dsi.sim.plan import make_plan, read_measure_file, resolve_inputs

    files = [read_measure_file(path) for path in args.from_files]
    inputs = resolve_inputs(
        files=files,
        target_tpot_ms=args.target_tpot,
        drafter_tpot_ms=args.drafter_tpot,
        acceptance=args.acceptance,
        target_ttft_ms=args.target_ttft,
        drafter_ttft_ms=args.drafter_ttft,
    )
    plan = make_plan(
        inputs,
        max_servers=args.max_servers,
        max_lookahead=args.max_lookahead,
        tokens=args.tokens,
        repeats=args.repeats,
        seed=args.seed,
        side_rescue=args.side_rescue,
    )
    if args.json:
        print_json(plan.to_dict())
        return 0
    i, b = plan.inputs, plan.best
    print(
        f"target {i.target_tpot_ms:.2f} ms/token (TTFT {i.target_ttft_ms:.2f} ms), drafter {i.drafter_tpot_ms:.2f} "
        f"ms/token (TTFT {i.drafter_ttft_ms:.2f} ms), acceptance {i.acceptance:.3f}"
    )
    print(f"Equation 1 with {plan.max_servers} servers: lookahead >= {plan.min_lookahead_for_budget} avoids queueing")
    print(
        f"plan: lookahead {b.lookahead}, {b.num_servers} target server(s) + 1 drafter; "
        f"predicted {b.per_token_ms:.2f} ms/token over {plan.tokens} tokens "
        f"({plan.speedup_vs_si:.2f}x vs SI at k={plan.si_lookahead}: {plan.si_per_token_ms:.2f} ms/token; "
        f"{plan.speedup_vs_nonsi:.2f}x vs non-SI: {plan.nonsi_per_token_ms:.2f} ms/token)"
    )
    for c in plan.ties:
        print(f"  as fast: k={c.lookahead} with {c.num_servers} server(s), {c.queue_wait_ms:.0f} ms of queue wait "
              f"(ties go to fewer servers, then no queueing, then smaller k)")
    alt = plan.fastest_meeting_equation1
    if not b.meets_equation1:
        print(f"  k={b.lookahead} queues (Equation 1 wants {b.required_sp} servers; {b.queue_wait_ms:.0f} ms of queue "
              "wait in all) but is faster than "
              + ("every k that does not" if alt is None else
                 f"k={alt.lookahead}, the fastest that does not ({alt.num_servers} server(s), {alt.per_token_ms:.2f} "
                 f"ms/token, {100 * (alt.latency_ms / b.latency_ms - 1):.1f}% slower)"))  # fmt: skip
    best = plan.ranked[:5]
    rows = [[c.lookahead, c.num_servers, c.required_sp, c.per_token_ms, c.queue_wait_ms, c.utilisation] for c in best]
    print(format_table(["k", "servers", "Eq.1 SP", "ms/token", "queue wait ms", "utilisation"], rows))
    ev = plan.event_driven
    verdict = {"event-driven": "the event-driven policy is faster", "fixed k": "the fixed lookahead is faster",
               "tie": "a tie"}  # fmt: skip
    print(
        f"\nevent-driven policy (no lookahead: a window whenever a target server is idle, paced by Equation 1 "
        f"and the acceptance): {ev.num_servers} target "
        f"server(s), predicted {ev.per_token_ms:.2f} ms/token (mean window {ev.mean_window:.2f} drafts), "
        f"{plan.best.per_token_ms / ev.per_token_ms:.3f}x the plan's: {verdict[plan.event_driven_better]}"
    )
    rows = []
    for row in plan.by_servers:
        f, a = row.fixed, row.event_driven
        rows.append(
            [row.num_servers, "-" if f is None else f.lookahead, "-" if f is None else f.per_token_ms,
             a.per_token_ms, f"{a.mean_window:.2f}", "-" if f is None else f"{f.latency_ms / a.latency_ms:.3f}x",
             row.better]
        )  # fmt: skip
    print("per number of target servers (fixed k: the best candidate with exactly that many servers):")
    print(format_table(["servers", "best k", "ms/token", "event-driven ms/token", "window", "fixed/event",
                        "better"], rows))  # fmt: skip
    t = plan.trees
    if t is not None:
        print(f"\ndraft trees, with {t.side_rescue:.2f} of rejections rescued by a side child (forwards cost the same "
              "whatever their tokens, as on a memory-bound GPU):")
        print(format_table(["method", "chain ms/token", "tree ms/token", "chain/tree"], [
            [f"SI (k={t.si_chain[0]} / tree \"auto\" k={t.si_tree[0]})", t.si_chain[1], t.si_tree[1], f"{t.si_gain:.3f}"],
            [f"DSI event-driven (SP={t.dsi_chain[0]} / SP={t.dsi_tree[0]})", t.dsi_chain[1], t.dsi_tree[1],
             f"{t.dsi_gain:.3f}"]]))
    return 0
