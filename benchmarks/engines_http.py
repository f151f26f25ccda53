"""DSI with its target servers as HTTP engines, on emulated latencies: what HTTP costs the engine.

Each target server is a ``dsi serve --method ar`` process serving a synthetic target whose forwards
take the scenario's latency (``WithLatency``, the memory-bound regime of ``dsi bench``); the drafter
runs here. For each scenario of ``dsi bench``, the same pair runs, alternating, with the target
servers as threads of this process and as HTTP engines:

- DSI wall time against the ideal (``dsi.evaluate.bench.ideal_dsi_seconds``: no engine overhead);
- DSI/SI on each placement (SI verifying on the first engine): the engines verifying through
  ``/v1/completions`` ("http") and through their scoring channel ("channel",
  :mod:`dsi.models.engines.scoring_channel`, what a dsi uses by default on a ``dsi serve``);
- DSI with the drafter as an engine too (a ``dsi serve`` of the synthetic drafter, its tokens streamed;
  the targets on their channel);
- the overhead of one verification: the round trip of a 6-token verification on an engine whose
  forwards take no time, over HTTP and over the channel, next to what docs/transports.md measured
  for threads, processes and Ray.

    python benchmarks/engines_http.py --out docs/data/engines_http-channel-2026-12-02.json

Prints a table, then one JSON line. ``--dry-run``: the scenario with the fewest servers (phi3-14b-alpaca, SP =
2), 6 tokens, one repeat, 5 round trips.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from _common import add_options, emit, parse, shrink

DEFAULT_SCENARIOS = ["default", "half-accept", "all-accept", "never-accept", "vicuna13b-cnndm", "starcoder15b-humaneval"]
VOCAB = 64
PROMPT = [1, 2, 3, 4]


def pair(scenario, seed: int = 0):
    from dsi.models.emulated.synthetic import synthetic_pair

    return synthetic_pair(scenario.acceptance, vocab_size=VOCAB, seed=seed, target_tpot=scenario.target_ms / 1000,
                          drafter_tpot=scenario.drafter_ms / 1000)


def serve(args: argparse.Namespace) -> int:
    """Child mode: one target server of a scenario (or of a zero-latency target) on ``--port``."""
    import socket

    from dsi.evaluate.bench import SCENARIOS, Scenario
    from dsi.server import ServeConfig, create_app
    from dsi.server.codec import IdsCodec
    from dsi.server.runner import make_server
    from dsi.server.scoring import bind

    scenario = SCENARIOS[args.scenario] if args.scenario != "zero" else Scenario("zero", 0.0, 0.0, 1.0, 1, 1)
    target, drafter = pair(scenario)
    model = drafter if args.role == "drafter" else target
    app = create_app(model, None, ServeConfig(method="ar", model_name="synthetic", max_logprobs=-1),
                     codec=IdsCodec(VOCAB), scoring_socket=bind("127.0.0.1", 0))
    # IPPROTO_TCP named explicitly: asyncio sets TCP_NODELAY only on sockets that say so, and without
    # it every answer on a kept-alive connection waits 40 ms for the client's delayed ACK (Nagle)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    make_server(app, graceful_s=1.0).run(sockets=[sock])
    return 0


class Engine:
    def __init__(self, scenario: str, role: str = "target") -> None:
        from dsi.models.engines.target import wait_until_serving
        from tests.engine_servers import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.proc = subprocess.Popen([sys.executable, __file__, "serve", scenario, "--port", str(self.port),
                                      "--role", role],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_until_serving(self.url, 60, self.proc)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


def round_trip_ms(url: str, target, calls: int, channel: bool) -> float:
    """Median ms of a 6-token verification on an engine whose forwards take no time, on its scoring
    channel or over HTTP."""
    from dsi.models.engines.target import EngineTarget

    engines = EngineTarget([url], reference=target, scoring_channel=channel)
    session = engines.new_session()
    assert (session.channel is not None) == channel, session
    context = list(range(1, 41))
    session.extend_rows(context, None, 1, True)
    times = []
    for i in range(calls):
        session.truncate(34)
        began = time.perf_counter()
        session.extend_rows([(i + j) % VOCAB for j in range(6)], None, 6, True)
        times.append(time.perf_counter() - began)
    session.close()
    return 1000 * statistics.median(times)


def run(scenario_name: str, tokens: int, repeats: int) -> dict:
    import dsi
    from dsi.evaluate.bench import SCENARIOS, ideal_dsi_seconds
    from dsi.models.engines.target import EngineTarget
    from dsi.models.emulated.replay import record_decisions

    scenario = SCENARIOS[scenario_name]
    target, drafter = pair(scenario)
    engines = [Engine(scenario_name) for _ in range(scenario.servers)]
    drafting = Engine(scenario_name, "drafter")  # the drafter as an engine too: its tokens streamed
    urls = [e.url for e in engines]
    try:
        walls: dict[str, list[float]] = {k: [] for k in ("ar", "si threads", "dsi threads", "si http", "dsi http",
                                                         "si channel", "dsi channel", "dsi channel+drafter")}
        over = {(placement, method): EngineTarget(urls if method == "dsi" else urls[:1], reference=target,
                                                  scoring_channel=placement != "http")
                for placement in ("http", "channel", "channel+drafter") for method in ("si", "dsi")}
        outputs = {}
        tasks = {}
        for _ in range(repeats):
            for label in walls:
                method, _, placement = label.partition(" ")
                kwargs = dict(target=target, drafter=drafter, prompt=PROMPT, method=method, max_new_tokens=tokens,
                              lookahead=scenario.lookahead, num_target_servers=scenario.servers)
                if placement in ("http", "channel", "channel+drafter"):
                    kwargs.update(target=over[placement, method], target_servers=True, num_target_servers=None)
                if placement == "channel+drafter":
                    kwargs.update(drafter_server=drafting.url)
                out = dsi.generate(**kwargs)
                walls[label].append(out.stats.wall_time_s)
                outputs[label] = out.tokens
                tasks[label] = out.stats.verify_tasks
    finally:
        for e in [*engines, drafting]:
            e.stop()
    med = {k: statistics.median(v) for k, v in walls.items()}
    pattern = record_decisions(drafter, PROMPT, outputs["ar"]).accept_pattern
    ideal = ideal_dsi_seconds(scenario, tokens, med["ar"], pattern)
    return {
        "scenario": scenario_name, "servers": scenario.servers, "tokens": tokens, "repeats": repeats,
        "median_wall_s": med, "ideal_dsi_s": ideal,
        "dsi_over_ideal_threads": med["dsi threads"] / ideal if ideal else None,
        "dsi_over_ideal_http": med["dsi http"] / ideal if ideal else None,
        "dsi_over_ideal_channel": med["dsi channel"] / ideal if ideal else None,
        "dsi_over_ideal_channel_drafter": med["dsi channel+drafter"] / ideal if ideal else None,
        "dsi_over_si_threads": med["dsi threads"] / med["si threads"],
        "dsi_over_si_http": med["dsi http"] / med["si http"],
        "dsi_over_si_channel": med["dsi channel"] / med["si channel"],
        "verify_tasks": tasks,
        "identical_outputs": len({tuple(v) for v in outputs.values()}) == 1,
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        parser = argparse.ArgumentParser()
        parser.add_argument("mode")
        parser.add_argument("scenario")
        parser.add_argument("--port", type=int, required=True)
        parser.add_argument("--role", choices=["target", "drafter"], default="target")
        return serve(parser.parse_args())
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", nargs="+", default=DEFAULT_SCENARIOS)
    parser.add_argument("--tokens", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=100, help="round trips for the per-task overhead (default 100)")
    add_options(parser, "phi3-14b-alpaca (SP = 2), 6 tokens, one repeat, 5 round trips")
    args = parse(parser)
    shrink(args, scenarios=["phi3-14b-alpaca"], tokens=6, repeats=1, calls=5)
    from dsi.evaluate.bench import SCENARIOS, Scenario

    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        print(f"unknown scenarios {unknown}; known: {sorted(SCENARIOS)}", file=sys.stderr)
        return 2
    zero_target, _ = pair(Scenario("zero", 0.0, 0.0, 1.0, 1, 1))
    zero = Engine("zero")
    try:
        overhead = {"http": round_trip_ms(zero.url, zero_target, args.calls, False),
                    "channel": round_trip_ms(zero.url, zero_target, args.calls, True)}
    finally:
        zero.stop()
    rows = [run(s, args.tokens, args.repeats) for s in args.scenarios]
    print(f"verification round trip (6 tokens, a target that takes no time, median of {args.calls}): "
          f"HTTP {overhead['http']:.2f} ms, scoring channel {overhead['channel']:.2f} ms")
    print(f"{args.tokens} tokens, median of {args.repeats}; DSI over ideal and DSI/SI wall time, threads vs engines")
    print("| scenario | SP | DSI/ideal threads | DSI/ideal HTTP | DSI/ideal channel | DSI/ideal channel, drafter too "
          "| DSI/SI threads | DSI/SI HTTP | DSI/SI channel | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def f(x):
            return "-" if x is None else f"{x:.3f}"
        print(f"| {r['scenario']} | {r['servers']} | {f(r['dsi_over_ideal_threads'])} | {f(r['dsi_over_ideal_http'])} | "
              f"{f(r['dsi_over_ideal_channel'])} | {f(r['dsi_over_ideal_channel_drafter'])} | "
              f"{f(r['dsi_over_si_threads'])} | {f(r['dsi_over_si_http'])} | {f(r['dsi_over_si_channel'])} | "
              f"{r['identical_outputs']} |")
    emit({"round_trip_ms": overhead, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
