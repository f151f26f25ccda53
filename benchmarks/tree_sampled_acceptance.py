"""Draft trees against chains when sampling (issue 24's first benchmark, at T = 0.7): tokens committed per
target verification at the same draft budget B, measured by running SI on the embedded pair.

A sampled run is not decided by a greedy recording, so this one runs the engine: SI with k = B on the
embedded pair (llama.cpp), the chain and the trees ``2`` (a side child at every depth: B/2 deep) and
``auto`` (dynamic, by the drafter's confidence), on the code and prose prompt sets, seeds 0..S-1 per
prompt. SI verifies once per iteration, so tokens / verification is what a target forward buys; the
committed tokens of different shapes differ (a side win draws the next token as SI's bonus), each with
the target's law.

    python benchmarks/tree_sampled_acceptance.py --out docs/data/tree_sampled_acceptance-2026-12-01.json

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BUDGETS = (4, 8)
SHAPES = ("off", "2", "auto")


def main() -> int:
    import dsi
    from dsi.cli.measure import PROMPT_SETS
    from dsi.evaluate.bench import emit_record
    from dsi.models.loading import load_pair

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per set")
    parser.add_argument("--seeds", type=int, default=2, help="seeds per prompt")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    start = time.perf_counter()
    target, drafter = load_pair(args.target, args.drafter, backend="llama.cpp", progress=False)
    results = []
    for name in ("code", "prose"):
        prompts = [target.encode(p) for p in PROMPT_SETS[name][: args.prompts]]
        for budget in BUDGETS:
            row = {"prompts": name, "budget": budget}
            for shape in SHAPES:
                tokens = verifications = side = accepted = drafted = 0
                for prompt in prompts:
                    for seed in range(args.seeds):
                        out = dsi.generate(target=target, drafter=drafter, prompt=prompt, method="si",
                                           lookahead=budget, max_new_tokens=args.tokens,
                                           draft_tree=None if shape == "off" else shape,
                                           sampling=dsi.SamplingParams(temperature=args.temperature, seed=seed))
                        tokens += len(out.tokens)
                        verifications += out.stats.verify_tasks
                        side += out.stats.extra.get("tree_side_accepts", 0)
                        accepted += out.stats.accepted_tokens
                        drafted += out.stats.drafted_tokens
                row[shape] = {"tokens_per_verification": tokens / verifications, "side_wins": side,
                              "acceptance": accepted / max(drafted, 1)}
                print(f"{name} B={budget} {shape}: {tokens / verifications:.2f} tokens / verification "
                      f"({side} side wins)", file=sys.stderr, flush=True)
            results.append(row)
    print(f"{args.target} / {args.drafter}, llama.cpp, T = {args.temperature}, SI k = B, {args.prompts} prompts x "
          f"{args.seeds} seeds x {args.tokens} tokens per set ({time.perf_counter() - start:.0f} s)")
    print("| prompts | B | chain: tokens / verification (acceptance) | tree 2 | tree auto | best / chain |")
    print("|---|---|---|---|---|---|")
    for r in results:
        chain = r["off"]["tokens_per_verification"]
        best = max(r["2"]["tokens_per_verification"], r["auto"]["tokens_per_verification"])
        print(f"| {r['prompts']} | {r['budget']} | {chain:.2f} ({r['off']['acceptance']:.2f}) | "
              f"{r['2']['tokens_per_verification']:.2f} | {r['auto']['tokens_per_verification']:.2f} | "
              f"{best / chain:.3f} |")
    emit_record({"benchmark": "tree_sampled_acceptance", "target": args.target, "drafter": args.drafter,
                 "temperature": args.temperature, "tokens": args.tokens, "prompts_per_set": args.prompts,
                 "seeds": args.seeds, "results": results}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
