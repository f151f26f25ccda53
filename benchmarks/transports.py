"""Transport benchmark: what a verification task costs on threads, processes and Ray, and DSI's wall
time against the ideal on each.

Two measurements per transport:

1. **Task round trip**: one server, a zero-latency synthetic target; ``--trips`` sequential
   submit -> result cycles of a 5-row task on a 100-token context. ``overhead`` is the round
   trip minus the server's own compute time (``TaskResult.compute_s``): pickling, the channel,
   thread wake-ups. Greedy tasks return 5 argmax ids; sampling tasks also return the processed
   probability rows, ``[5, V]`` float64 (``V = --vocab``, 2.5 MB at V = 64k).
2. **DSI wall / ideal**: a synthetic pair with emulated latencies (``WithLatency``: target 30 ms,
   drafter 3 ms, acceptance 0.8, k = 4, SP = 4 by default), greedy, ``--tokens`` new tokens,
   median of ``--repeats`` runs on one decoder per transport (servers started once, not timed).
   The ideal is the event simulator's replay of the same accept pattern with no engine or
   transport overhead (:func:`dsi.evaluate.bench.ideal_dsi_seconds`).

    python benchmarks/transports.py                                  # all transports here
    python benchmarks/transports.py --transports processes ray --out transports.json
    python benchmarks/transports.py --transports ray --ray-address auto   # on a running cluster
    python benchmarks/transports.py --dry-run                        # threads and processes, a few trips

Prints a table, then one JSON line; ``--out`` also writes the JSON report. Local Ray binds
127.0.0.1 only (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``) and sends no usage statistics.
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import time

import numpy as np
from _common import add_options, emit, parse, shrink

VARIANTS = {  # name -> (transport, transport_options)
    "threads": ("threads", {}),
    "processes": ("processes", {}),
    "ray": ("ray", {"channel": "direct"}),
    "ray-calls": ("ray", {"channel": "ray"}),
}
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
                 "RAY_AUTH_MODE": "disabled"}


def round_trips(transport: str, options: dict, vocab: int, trips: int) -> dict:
    """Median round trip and overhead (ms) of sequential tasks on a one-server pool."""
    from dsi.models import CallableLM
    from dsi.models.emulated.synthetic import SyntheticTarget
    from dsi.sampling import SamplingParams
    from dsi.transport import make_pool
    from dsi.transport.base import TaskResult, VerifyTask

    model = CallableLM(SyntheticTarget(vocab, seed=0), vocab, name="synthetic")
    events: queue.SimpleQueue = queue.SimpleQueue()
    pool = make_pool(transport, model, 1, events.put, **options)
    context = tuple(int(t) for t in np.random.default_rng(0).integers(0, vocab, 100))
    out = {}
    try:
        for name, params in (("greedy", SamplingParams()), ("sampling", SamplingParams(temperature=1.0))):
            rtts, overheads = [], []
            for i in range(trips + 5):
                start = time.perf_counter()
                pool.submit(VerifyTask(i, context, 5, params))
                event = events.get(timeout=60)
                rtt = time.perf_counter() - start
                if not isinstance(event, TaskResult):
                    raise RuntimeError(f"unexpected {event!r}")
                if i >= 5:  # warm-up: first prefill, imports, connections
                    rtts.append(rtt)
                    overheads.append(rtt - event.compute_s)
            out[name] = {"rtt_ms": 1e3 * statistics.median(rtts), "overhead_ms": 1e3 * statistics.median(overheads),
                         "overhead_p90_ms": 1e3 * float(np.percentile(overheads, 90))}
    finally:
        pool.close()
    return out


def dsi_vs_ideal(transport: str, options: dict, args: argparse.Namespace) -> dict:
    """DSI median wall time on ``transport`` and the engine-free ideal for the same accept pattern."""
    from dsi.evaluate.bench import Scenario, ideal_dsi_seconds
    from dsi.engine.api import build_decoder, make_request
    from dsi.models import synthetic_pair
    from dsi.models.emulated.replay import record_decisions
    from dsi.sampling import SamplingParams

    scenario = Scenario("transports", args.target_ms, args.drafter_ms, args.acceptance, args.lookahead, args.servers)
    target, drafter = synthetic_pair(args.acceptance, vocab_size=64, seed=args.seed,
                                     target_tpot=args.target_ms / 1000, drafter_tpot=args.drafter_ms / 1000)
    prompt = [1, 2, 3, 4]
    request = make_request(prompt, args.tokens, SamplingParams(), None, target.vocab_size)
    decoder = build_decoder(target=target, drafter=drafter, lookahead=args.lookahead,
                            num_target_servers=args.servers, transport=transport, transport_options=options)
    walls, tokens, stats = [], None, None
    try:
        for _ in range(args.repeats + 1):
            result = decoder.generate(request)
            walls.append(result.stats.wall_time_s)
            tokens, stats = result.tokens, result.stats
    finally:
        decoder.close()
    walls = walls[1:]  # the first request warms every server's cache of the prompt
    pattern = record_decisions(drafter, prompt, tokens).accept_pattern  # tokens: the target's greedy output
    ar_seconds = args.tokens * args.target_ms / 1000
    ideal = ideal_dsi_seconds(scenario, args.tokens, ar_seconds, pattern)
    wall = statistics.median(walls)
    return {
        "wall_s": wall, "ideal_s": ideal, "wall_over_ideal": wall / ideal if ideal else None,
        "non_si_s": ar_seconds, "speedup_vs_non_si": ar_seconds / wall,
        "acceptance_rate": stats.acceptance_rate, "preempted_tasks": stats.preempted_tasks,
        "verify_tasks": stats.verify_tasks, "tokens": list(tokens),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transports", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="ray = Ray actors with the direct socket channel, ray-calls = one Ray actor "
                        "call per task (channel='ray')")
    parser.add_argument("--trips", type=int, default=200, help="round trips per measurement (default 200)")
    parser.add_argument("--vocab", type=int, nargs="+", default=[64, 32000],
                        help="vocabulary sizes for the round-trip test (default 64 32000)")
    parser.add_argument("--target-ms", type=float, default=30.0)
    parser.add_argument("--drafter-ms", type=float, default=3.0)
    parser.add_argument("--acceptance", type=float, default=0.8)
    parser.add_argument("--lookahead", type=int, default=4)
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ray-address", default=None, help="Ray cluster to use (default: a local Ray on 127.0.0.1)")
    add_options(parser, "threads and processes, 5 round trips, 12 tokens at 5 ms / 1 ms forwards")
    args = parse(parser, argv)
    shrink(args, transports=["threads", "processes"], trips=5, vocab=[64], target_ms=5.0, drafter_ms=1.0,
           servers=2, tokens=12, repeats=1)

    uses_ray = any(VARIANTS[v][0] == "ray" for v in args.transports)
    if uses_ray:
        if args.ray_address is None:
            os.environ.update(LOCAL_RAY_ENV)
        import ray

        ray.init(address=args.ray_address or "local", include_dashboard=False,
                 **({} if args.ray_address else {"num_cpus": os.cpu_count()}))
    report = {"config": vars(args), "transports": {}}
    for variant in args.transports:
        transport, options = VARIANTS[variant]
        print(f"[{variant}] round trips...", file=sys.stderr, flush=True)
        row: dict = {"round_trip": {v: round_trips(transport, options, v, args.trips) for v in args.vocab}}
        print(f"[{variant}] DSI vs ideal...", file=sys.stderr, flush=True)
        row["dsi"] = dsi_vs_ideal(transport, options, args)
        report["transports"][variant] = row

    outputs = {t: r["dsi"].pop("tokens") for t, r in report["transports"].items()}
    report["identical_outputs"] = len({tuple(o) for o in outputs.values()}) == 1
    header = f"{'transport':<10} {'V':>6} {'greedy rtt/ovh ms':>18} {'sampling rtt/ovh ms':>20} " \
             f"{'DSI s':>7} {'ideal s':>8} {'DSI/ideal':>9} {'vs non-SI':>9}"
    print(header)
    print("-" * len(header))
    for transport, row in report["transports"].items():
        d = row["dsi"]
        for i, (vocab, rt) in enumerate(row["round_trip"].items()):
            g, s = rt["greedy"], rt["sampling"]
            tail = (f" {d['wall_s']:>7.3f} {d['ideal_s']:>8.3f} {d['wall_over_ideal']:>9.3f} "
                    f"{d['speedup_vs_non_si']:>8.2f}x") if i == 0 else ""
            print(f"{transport if i == 0 else '':<10} {vocab:>6} {g['rtt_ms']:>8.3f} / {g['overhead_ms']:<7.3f} "
                  f"{s['rtt_ms']:>9.3f} / {s['overhead_ms']:<8.3f}{tail}")
    print(f"scenario: target {args.target_ms} ms, drafter {args.drafter_ms} ms, a={args.acceptance}, "
          f"k={args.lookahead}, SP={args.servers}, {args.tokens} tokens, median of {args.repeats}; "
          f"identical outputs: {report['identical_outputs']}")
    emit(report, args.out)
    if uses_ray:
        import ray

        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
