"""What the deterministic mode costs, and what it buys: the embedded pair with it on and off.

For each method (non-SI, SI k=5, DSI event-driven SP=1) and each mode, greedy generation on the
built-in code prompts, ``--repeats`` runs each (the modes alternate run by run); reports tokens/s
(median), on / off, and whether each method's output equals non-SI's of the same mode token for token.

    python benchmarks/deterministic_cost.py --backend llama.cpp --repeats 3 --out docs/data/deterministic-llama-2026-12-01.json

Prints a table, then one JSON line. ``--dry-run``: a tiny random pair for ``--backend``, 2 prompts x 6 tokens,
one repeat.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from _common import add_options, add_pair_options, emit, parse, shrink, tiny_pair

import dsi
from dsi.engine.api import build_decoder, make_request
from dsi.evaluate.compare import CODE_PROMPTS
from dsi.models.loading import load_pair

METHODS = (("non-SI", dict(method="ar")), ("SI k=5", dict(method="si", lookahead=5)),
           ("DSI k=auto SP=1", dict(method="dsi", lookahead="auto", num_target_servers=1)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_options(parser)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    add_options(parser, "a tiny random pair for --backend, 2 prompts x 6 tokens, one repeat")
    args = parse(parser)
    if shrink(args, prompts=2, tokens=6, repeats=1):
        args.target, args.drafter = tiny_pair(args.backend)
        args.dtype = "fp32" if args.backend == "hf" else None
    target, drafter = load_pair(args.target, args.drafter, backend=args.backend, dtype=args.dtype, progress=False)
    prompts = [target.encode(p) for p in CODE_PROMPTS[: args.prompts]]
    seconds: dict[tuple[str, bool], list[float]] = {}
    outputs: dict[tuple[str, bool], list[list[int]]] = {}
    for rep in range(args.repeats):
        for mode in ((True, False) if rep % 2 == 0 else (False, True)):
            target.deterministic = drafter.deterministic = mode
            for label, config in METHODS:
                decoder = build_decoder(target=target, drafter=drafter, **config)
                try:
                    total, outs = 0.0, []
                    for ids in prompts:
                        out = decoder.generate(make_request(ids, args.tokens, dsi.SamplingParams(), None,
                                                            target.vocab_size))
                        total += out.stats.wall_time_s
                        outs.append(list(out.tokens))
                finally:
                    decoder.close()
                seconds.setdefault((label, mode), []).append(total)
                outputs[(label, mode)] = outs
                print(f"repeat {rep + 1} deterministic={mode} {label}: {total:.2f} s", file=sys.stderr, flush=True)
    tokens = args.tokens * len(prompts)
    rows = []
    for label, _ in METHODS:
        on, off = (statistics.median(seconds[(label, m)]) for m in (True, False))
        rows.append({"method": label, "tokens_per_s_on": tokens / on, "tokens_per_s_off": tokens / off,
                     "seconds_on": on, "seconds_off": off, "cost": on / off,
                     "equals_non_si_on": outputs[(label, True)] == outputs[("non-SI", True)],
                     "equals_non_si_off": outputs[(label, False)] == outputs[("non-SI", False)]})
    print(f"{args.target} / {args.drafter}, {args.backend}, greedy, {len(prompts)} prompts x {args.tokens} tokens, "
          f"median of {args.repeats}")
    print("| method | tok/s deterministic | tok/s off | time on / off | = non-SI (on) | = non-SI (off) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['tokens_per_s_on']:.2f} | {r['tokens_per_s_off']:.2f} | {r['cost']:.3f} | "
              f"{r['equals_non_si_on']} | {r['equals_non_si_off']} |")
    doc = {"target": args.target, "drafter": args.drafter, "backend": args.backend, "dtype": args.dtype,
           "prompts": len(prompts), "tokens": args.tokens, "repeats": args.repeats, "rows": rows,
           "seconds": {f"{k[0]} deterministic={k[1]}": v for k, v in seconds.items()}}
    emit(doc, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
