"""Draft trees against chains on recordings of a real pair: tokens committed per target verification
at the same draft budget B (issue 24's first benchmark), greedy.

For each prompt, the target's greedy output is generated (non-SI), then the drafter runs once over
prompt + output and its most likely tokens at every output position are kept. Greedy verification
only walks along the target's output, so these recordings decide every window of a fixed tree
shape exactly (:func:`dsi.sim.trees.replay_greedy`): the chain of B drafts, and fixed widths (side
children where the drafter's second, third... choice is the target's token), B = 4, 8, 16.

    python benchmarks/tree_acceptance.py --out docs/data/tree_acceptance-2026-12-01.json

Prints a table per prompt set (chain, the best tree shape, their ratio, the chain's acceptance, and the
bound of :func:`dsi.sim.trees.best_tree_tokens`: the best tree of B nodes against the chain under Sequoia's
position-independent acceptance model, from how often the target's token is the drafter's first, second,
... choice), then one JSON line. The drafter's rankings come from one batched forward; on llama.cpp a row of a
batch can differ slightly from a one-token row (docs/results.md#where-the-logits-depend-on-the-cut), which moves a few
near-ties. ``--dry-run``: a tiny random GGUF pair (tests/tiny_gguf.py), one prompt of 8 tokens per set.
"""

from __future__ import annotations

import argparse
import sys

from _common import add_options, emit, parse, shrink, tiny_pair

BUDGETS = (4, 8, 16)
TOP = 8  # drafter tokens kept per position


def shapes(budget: int) -> dict[str, tuple[int, ...] | None]:
    """The shapes tried at ``budget``: the chain and a few fixed widths along the main path."""
    out: dict[str, tuple[int, ...] | None] = {"chain": None}
    for head in ((2,), (3,), (4,), (2, 2), (3, 2), (4, 2), (2, 2, 2), (3, 3), (4, 2, 2)):
        if sum(head) <= budget:
            widths = head + (1,) * (budget - sum(head))
            out[",".join(map(str, widths))] = widths
    out["2 everywhere"] = (2,) * (budget // 2)
    return out


def record(target, drafter, prompts: list[str], tokens: int) -> list[tuple[list[int], list[list[int]]]]:
    """(target's greedy output, drafter's ranked tokens per output position) for each prompt."""
    import numpy as np

    import dsi
    from dsi.models.base import forward_rows

    recordings = []
    for text in prompts:
        ids = target.encode(text)
        out = dsi.generate(target=target, prompt=ids, method="ar", max_new_tokens=tokens,
                           eos_token_id=list(target.eos_token_ids) or None).tokens
        session = drafter.new_session()
        rows = np.asarray(forward_rows(session, ids + out[:-1], len(out)))  # row i: after prompt + out[:i]
        session.close()
        top = np.argpartition(-rows, TOP, axis=-1)[:, :TOP]  # [n, TOP], unordered
        order = np.argsort(-np.take_along_axis(rows, top, axis=-1), axis=-1, kind="stable")
        ranked = np.take_along_axis(top, order, axis=-1)
        recordings.append((list(out), ranked.tolist()))
        print(f"recorded {len(out)} tokens of {text[:40]!r}", file=sys.stderr, flush=True)
    return recordings


def main() -> int:
    from dsi.cli.measure import PROMPT_SETS
    from dsi.models.vocab.bridge import bridge_drafter, shares_vocabulary
    from dsi.models.loading import load_pair
    from dsi.sim.trees import best_tree_tokens, rank_rates, replay_greedy
    from dsi.trees import Widths

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per set")
    add_options(parser, "a tiny random GGUF pair, one prompt of 8 tokens per set")
    args = parse(parser)
    if shrink(args, tokens=8, prompts=1):
        args.target, args.drafter = tiny_pair("llama.cpp")
    target, drafter = load_pair(args.target, args.drafter, backend="llama.cpp", progress=False)
    if not shares_vocabulary(target, drafter):  # another tokenizer: greedy string mode cannot branch, so the
        drafter = bridge_drafter(target, drafter, "intersection")  # token intersection (its law over target ids)
    results = []
    for name in ("code", "prose"):
        recordings = record(target, drafter, PROMPT_SETS[name][: args.prompts], args.tokens)
        rates = rank_rates([t for out, _ in recordings for t in out], [r for _, ranked in recordings for r in ranked],
                           TOP)  # rates[0]: the drafter's top-1 agreement
        for budget in BUDGETS:
            rows = {}
            for label, widths in shapes(budget).items():
                shape = None if widths is None else Widths(widths)
                replays = [replay_greedy(out, ranked, shape, budget) for out, ranked in recordings]
                rows[label] = sum(r.tokens for r in replays) / sum(r.windows for r in replays)
            best = max((k for k in rows if k != "chain"), key=rows.get)
            results.append({"prompts": name, "budget": budget, "greedy_agreement": rates[0],
                            "chain": rows["chain"], "best_tree": best, "best_tree_tokens": rows[best],
                            "ratio": rows[best] / rows["chain"], "shapes": rows, "rank_rates": rates,
                            "model_chain": best_tree_tokens(rates[:1], budget),
                            "model_best_tree": best_tree_tokens(rates, budget)})
    print(f"{args.target} / {args.drafter}, llama.cpp, greedy, {args.prompts} prompts x {args.tokens} tokens per set")
    print("| prompts | drafter top-1 agreement | B | chain: tokens / verification | best tree | tree | tree / chain "
          "| bound for fixed shapes: best / chain |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['prompts']} | {r['greedy_agreement']:.2f} | {r['budget']} | {r['chain']:.2f} | {r['best_tree']} | "
              f"{r['best_tree_tokens']:.2f} | {r['ratio']:.3f} | {r['model_best_tree']:.2f} / {r['model_chain']:.2f} "
              f"({r['model_best_tree'] / r['model_chain']:.3f}) |")
    emit({"benchmark": "tree_acceptance", "target": args.target, "drafter": args.drafter,
          "tokens": args.tokens, "prompts_per_set": args.prompts, "results": results}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
