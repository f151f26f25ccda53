"""Sampled verification over vLLM with a large vocabulary: whole rows against draws made inside the engine.

Two vLLM engines (prefix caching, block 32, one CPU thread each, ``--max-logprobs -1``, dsi_vllm's processor
loaded: ``--logits-processors dsi_vllm.processor:CoupledDraws``) serve a random fp32 Llama with ``--vocab`` ids
(Qwen2.5's 151,936 by default) whose layers after the first write ``--depth-scale`` x their outputs (so its first
layer alone, run here as the drafter, agrees with it often: benchmarks/engine_long_context.py). After a random
prompt of ``--context`` tokens, ``--tokens`` new tokens by non-SI, SI (k = ``--lookahead``, first engine) and
DSI (lookahead ``--lookahead``, SP 2), each:

- greedy (argmax rows: one id a row);
- sampled at T = 1 with whole rows (``EngineTarget(engine_draws=False)``: every verification moves its rows,
  ``logprobs: -1``, and the standard rule decides): ``--rows-tokens`` new tokens, in the first repeat only (a
  row of 152k ids takes vLLM seconds to write as JSON: 24 tokens of each method took over 15 minutes here);
- sampled at T = 1 with the engines' draws (coupled draws, :mod:`dsi.coupling`: one token a row).

Reports per configuration the median of ``--repeats`` (methods alternating, seeds 0..) of the tokens per second
after the first verification (whose tokens come with the prefill), the acceptance, and the bytes the engines
sent back per verified draft (HTTP bodies, counted in dsi's connection). Every greedy output is checked against
the local non-SI greedy output, and every output with draws against the local non-SI output with coupled draws
of the same seed.

    python benchmarks/engine_sampled_draws.py --out docs/data/engine_sampled_draws-2026-12-07.json

Needs the vLLM venv (``bash packaging/vllm-venv.sh``). Prints a table, then one JSON line. ``--dry-run``: one layer
of width 128, the test vocabulary, 4 new tokens, one repeat.
"""

from __future__ import annotations

import argparse
import statistics
import threading

from _common import add_options, emit, need_vllm, parse, scratch, shrink
from engine_long_context import first_layer_pair, run

from tests.engine_servers import start_all, start_vllm

METHODS = ("ar", "si", "dsi")
WAYS = ("greedy", "sampled, whole rows", "sampled, engine draws")


class ByteCount:
    """The bytes of every HTTP answer dsi's engine connections read (Connection._send), while counting."""

    def __init__(self) -> None:
        from dsi.models.engines import target

        self.bytes, self.answers, self._lock = 0, 0, threading.Lock()
        send = target.Connection._send
        counter = self

        def counted(conn, method, path, body):
            status, data = send(conn, method, path, body)
            with counter._lock:
                counter.bytes += len(data)
                counter.answers += 1
            return status, data

        target.Connection._send = counted

    def take(self) -> tuple[int, int]:
        with self._lock:
            got = (self.bytes, self.answers)
            self.bytes = self.answers = 0
        return got


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151_936, help="the model's ids (default Qwen2.5's 151,936)")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=24, help="new tokens a request (default 24)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows-tokens", type=int, default=6,
                        help="new tokens a request with whole rows, in the first repeat only (default 6)")
    parser.add_argument("--lookahead", type=int, default=4)
    parser.add_argument("--depth-scale", type=float, default=0.04)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    add_options(parser, "one layer of width 128, the test vocabulary, 4 new tokens, one repeat")
    args = parse(parser)
    shrink(args, hidden=128, layers=1, vocab=0, tokens=4, repeats=1, context=16, rows_tokens=4)
    if not need_vllm():
        return 2
    import numpy as np

    import dsi
    from dsi.models.engines.target import EngineTarget

    positions = args.context + args.tokens + args.lookahead + 64
    target_dir, target, drafter = first_layer_pair(scratch(), args.layers, args.hidden, positions, args.depth_scale,
                                                   vocab_size=args.vocab)
    servers = start_all([lambda: start_vllm(str(target_dir), max_model_len=positions, draws=True) for _ in range(2)])
    counter = ByteCount()
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, target.vocab_size, args.context)]
    local_greedy = dsi.generate(target=target, prompt=prompt, method="ar", max_new_tokens=args.tokens).tokens
    rates: dict = {}
    per_draft: dict = {}
    acceptance: dict = {}
    exact: dict = {}
    try:
        urls = [s.url for s in servers]
        engines = {"rows": EngineTarget(urls, reference=target, engine_draws=False),
                   "draws": EngineTarget(urls, reference=target)}
        assert all(e.draws for e in engines["draws"].engines.values()), "the engines do not draw"
        run(engines["draws"], drafter, "dsi", prompt[:8], 2, args.lookahead)  # warm-up
        counter.take()
        samples: dict = {}
        for repeat in range(args.repeats):
            params = {"greedy": dsi.SamplingParams(),
                      "sampled, whole rows": dsi.SamplingParams(temperature=1.0, seed=repeat),
                      "sampled, engine draws": dsi.SamplingParams(temperature=1.0, seed=repeat)}
            local_coupled = dsi.generate(target=target, prompt=prompt, method="ar", max_new_tokens=args.tokens,
                                         sampling=dsi.SamplingParams(temperature=1.0, seed=repeat,
                                                                     coupled=True)).tokens
            for way in WAYS:
                rows = way == "sampled, whole rows"
                if rows and repeat:
                    continue
                over = engines["rows" if rows else "draws"]
                for method in METHODS:
                    _, seconds, count, result = run(over, drafter, method, prompt,
                                                    args.rows_tokens if rows else args.tokens, args.lookahead,
                                                    params[way])
                    out, stats = list(result.tokens), result.stats
                    received, _ = counter.take()
                    drafts = stats.accepted_tokens + stats.rejections if method != "ar" else 0
                    verified = max(1, drafts) if method != "ar" else max(1, stats.target_forwards)
                    entry = samples.setdefault((way, method), {"rate": [], "bytes": [], "acc": []})
                    entry["rate"].append(count / seconds if seconds > 0 else float("nan"))
                    entry["bytes"].append(received / verified)
                    if method != "ar":
                        entry["acc"].append(stats.accepted_tokens / max(1, drafts))
                    key = f"{way} {method}"
                    if way == "greedy":
                        exact[key] = exact.get(key, True) and out == list(local_greedy)
                    elif way == "sampled, engine draws":
                        exact[key] = exact.get(key, True) and out == list(local_coupled)
            print(f"repeat {repeat + 1} of {args.repeats} done", flush=True)
        for (way, method), entry in samples.items():
            rates.setdefault(way, {})[method] = statistics.median(entry["rate"])
            per_draft.setdefault(way, {})[method] = statistics.median(entry["bytes"])
            if entry["acc"]:
                acceptance.setdefault(way, {})[method] = statistics.median(entry["acc"])
    finally:
        for server in servers:
            server.stop()
    print(f"\nrandom Llama (hidden {args.hidden}, {args.layers} layers, fp32, {target.vocab_size} ids), two vLLM engines "
          f"(prefix caching, block 32, one thread each, dsi_vllm's processor), the drafter here (its first layer; depth "
          f"scale {args.depth_scale}); a {args.context}-token prompt, {args.tokens} new tokens, lookahead "
          f"{args.lookahead}, DSI SP 2; median of {args.repeats} (whole rows: {args.rows_tokens} new tokens, one run)")
    print("| way | non-SI tok/s | SI tok/s | DSI tok/s | SI acceptance | DSI acceptance | bytes back per draft (SI / DSI) "
          "| bytes back per non-SI token |")
    print("|---|---|---|---|---|---|---|---|")
    for way in WAYS:
        r, b, a = rates[way], per_draft[way], acceptance.get(way, {})
        print(f"| {way} | {r['ar']:.1f} | {r['si']:.1f} | {r['dsi']:.1f} | {a.get('si', float('nan')):.2f} | "
              f"{a.get('dsi', float('nan')):.2f} | {b['si']:.0f} / {b['dsi']:.0f} | {b['ar']:.0f} |")
    print("outputs exact: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in exact.items()))
    emit({"model": {"hidden": args.hidden, "layers": args.layers, "dtype": "fp32", "vocab": target.vocab_size},
          "context": args.context, "tokens": args.tokens, "rows_tokens": args.rows_tokens, "lookahead": args.lookahead,
          "depth_scale": args.depth_scale, "repeats": args.repeats, "tokens_per_second": rates,
          "bytes_back_per_draft": per_draft, "acceptance": acceptance, "exact": exact}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
