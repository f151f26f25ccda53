"""Two questions about target engines that only the engine can answer: how soon it stops computing a
verification dsi preempted, and whether several verifications at once on one engine help.

The same random fp32 Llama served by vLLM and by ``dsi serve --method ar``, one at a time, each on one
CPU thread (``--hidden``, ``--layers``; head size 32 or more, as vLLM's CPU attention needs).

- **Cancel.** A long verification (``--cancel-context`` tokens scored in one request, what a DSI window
  after a long prompt costs on vLLM) is preempted ``--cancel-after`` seconds in: dsi closes the
  connection. A one-token probe sent right after the cancel measures when the engine is free again:
  the engine-side stop latency is (probe done - cancel) - the probe's own time on an idle engine.
  For comparison, the same verification left to finish.
- **Batching.** ``--clients`` verifications (windows of k = 4 after a 64-token context, each client a
  session of its own, as DSI's target servers are) sent at once to one engine: median seconds per
  verification and verifications per second, against one at a time. vLLM batches concurrent
  requests into one forward; ``dsi serve`` runs them on its ``--max-concurrent`` slots (one slot:
  one at a time; a slot per client: side by side, each its own forward).

    python benchmarks/engine_cancel_and_batching.py --out docs/data/engine_cancel_batching-2026-12-02.json

Needs the vLLM venv (``bash packaging/vllm-venv.sh``). Prints two tables, then one JSON line. ``--dry-run``: one
layer of width 128, a 256-token verification cancelled after 10 ms, 1 and 2 clients, 2 rounds.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from _common import add_options, emit, need_vllm, parse, scratch, shrink

from tests.engine_servers import start_dsi_serve, start_vllm
from tests.tiny_hf import make_model_dir


def probe(engines, vocab: int) -> float:
    """Seconds for a one-row scoring of a 4-token prompt (a fresh session: nothing cached)."""
    session = engines.new_session()
    try:
        began = time.perf_counter()
        session.extend_rows([3, 4, 5, 6], None, 1, True)
        return time.perf_counter() - began
    finally:
        session.close()


def cancel_latency(engines, vocab: int, context_length: int, after: float, repeats: int) -> dict:
    import numpy as np

    from dsi.errors import TaskCancelled

    rng = np.random.default_rng(1)
    idle = statistics.median(probe(engines, vocab) for _ in range(5))
    full, stops = [], []
    for _ in range(repeats):
        context = [int(t) for t in rng.integers(3, vocab, context_length)]
        session = engines.new_session()
        try:
            began = time.perf_counter()
            session.extend_rows(context, None, 1, True)
            full.append(time.perf_counter() - began)
        finally:
            session.close()
        context = [int(t) for t in rng.integers(3, vocab, context_length)]
        session = engines.new_session()
        cancel = threading.Event()
        threading.Timer(after, cancel.set).start()
        try:
            session.extend_rows(context, cancel, 1, True)
            stops.append(None)  # finished before the cancel
            continue
        except TaskCancelled:
            cancelled_at = time.perf_counter()
        finally:
            session.close()
        probe_s = probe(engines, vocab)
        stops.append(max(0.0, time.perf_counter() - cancelled_at - idle) if probe_s is not None else None)
    measured = [s for s in stops if s is not None]
    return {"idle_probe_s": idle, "full_verification_s": statistics.median(full),
            "engine_stop_s": statistics.median(measured) if measured else None, "stops": stops}


def batching(engines, vocab: int, clients: int, rounds: int, k: int = 4, context_length: int = 64) -> dict:
    import numpy as np

    rng = np.random.default_rng(2)
    sessions = [engines.new_session() for _ in range(clients)]
    contexts = [[int(t) for t in rng.integers(3, vocab, context_length)] for _ in range(clients)]
    times: list[float] = []
    try:
        for session, context in zip(sessions, contexts, strict=True):
            session.extend_rows(context, None, 1, True)  # prefill (dsi serve then keeps it cached)
        began = time.perf_counter()
        for _ in range(rounds):
            drafts = [[int(t) for t in rng.integers(3, vocab, k)] for _ in range(clients)]

            def one(i: int) -> None:
                sessions[i].truncate(context_length)
                start = time.perf_counter()
                sessions[i].extend_rows(drafts[i], None, k + 1, True)
                times.append(time.perf_counter() - start)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        wall = time.perf_counter() - began
    finally:
        for session in sessions:
            session.close()
    return {"clients": clients, "median_verification_s": statistics.median(times),
            "verifications_per_s": clients * rounds / wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--cancel-context", type=int, default=2048)
    parser.add_argument("--cancel-after", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=8)
    add_options(parser, "one layer of width 128, a 256-token verification cancelled after 10 ms, 1 and 2 clients, "
                "2 rounds")
    args = parse(parser)
    shrink(args, hidden=128, layers=1, cancel_context=256, cancel_after=0.01, repeats=1, clients=[1, 2], rounds=2)
    if not need_vllm():
        return 2
    positions = args.cancel_context + 32
    model = make_model_dir(scratch() / "model", seed=0, layers=args.layers, hidden=args.hidden,
                           positions=positions)
    from transformers import AutoConfig

    from dsi.models.engines.target import EngineTarget

    vocab = AutoConfig.from_pretrained(model).vocab_size
    most = max(args.clients)
    results: dict = {}  # engine -> {"cancel": ..., "batching": [...]}
    # the probe of the cancel test must wait for the engine: one slot for dsi serve (with more, it would run
    # on a free one beside the cancelled request); a second dsi serve with a slot per client for batching
    for name, start, cancel in (("vllm", lambda: start_vllm(str(model), max_model_len=positions), True),
                                ("dsi serve", lambda: start_dsi_serve(str(model)), True),
                                (f"dsi serve, {most} slots",
                                 lambda: start_dsi_serve(str(model), "--max-concurrent", str(most)), False)):
        server = start()
        try:
            engines = EngineTarget([server.url], vocab_size=vocab)
            batching(engines, vocab, 1, 2)  # warm-up
            results[name] = {
                "cancel": cancel_latency(engines, vocab, args.cancel_context, args.cancel_after, args.repeats)
                if cancel else None,
                "batching": [batching(engines, vocab, c, args.rounds) for c in args.clients],
            }
        finally:
            server.stop()
    print(f"random Llama, hidden {args.hidden}, {args.layers} layers, fp32, 1 thread per engine")
    print(f"\ncancel: a {args.cancel_context}-token verification preempted after {args.cancel_after} s; "
          f"median of {args.repeats}")
    print("| engine | the verification, left to finish (s) | idle probe (s) | engine busy after the cancel (s) |")
    print("|---|---|---|---|")
    for name, r in results.items():
        c = r["cancel"]
        if c is None:
            continue
        stop = "n/a" if c["engine_stop_s"] is None else f"{c['engine_stop_s']:.3f}"
        print(f"| {name} | {c['full_verification_s']:.3f} | {c['idle_probe_s']:.4f} | {stop} |")
    print(f"\nbatching: windows of k=4 after 64 tokens, {args.rounds} rounds")
    print("| engine | clients at once | median s / verification | verifications / s |")
    print("|---|---|---|---|")
    for name, r in results.items():
        for b in r["batching"]:
            print(f"| {name} | {b['clients']} | {b['median_verification_s']:.4f} | {b['verifications_per_s']:.1f} |")
    emit({"model": {"hidden": args.hidden, "layers": args.layers, "dtype": "fp32"},
          "cancel_context": args.cancel_context, "cancel_after_s": args.cancel_after, "results": results}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
