"""Draft trees against chains when sampling (issue 24's first benchmark, at T = 0.7): tokens committed per
target verification at the same draft budget B, measured by running SI on the embedded pair.

A sampled run is not decided by a greedy recording, so this one runs the engine: SI with k = B on the
embedded pair (llama.cpp; ``--drafter smollm2-135m-instruct`` for the pair of another vocabulary), the
chain against the ``--trees`` (any ``--draft-tree`` values; by default ``auto`` and ``branches`` at a
fixed floor of 0.1, and ``branches:0.05``), on the code and prose prompt sets, seeds 0..S-1 per prompt.
A fixed floor keeps this machine's row price (which makes a priced ``auto`` the chain here) out of a count
of what a verification buys. SI verifies once per iteration, so tokens / verification is what a target
forward buys; the committed tokens of different shapes differ (a side win draws the next token as SI's
bonus), each with the target's law.

    python benchmarks/tree_sampled_acceptance.py --engine --out docs/data/tree_sampled_acceptance_engine-2026-12-03.json

Sampled runs of different shapes commit different texts after their first side win, so a few runs' tokens per
verification mostly measure how easy each text was (docs/results-log.md#2026-12-03).
The default mode therefore measures the expected tokens per verification, paired: along the target's own
sampled text (non-SI, each prompt and seed), every ``--stride``-th position starts one SI iteration of each
shape (the real drafter drafting exactly as the engine does: ``TreeDrafter`` and ``grow``, the DRAFT
uniforms of the seed), the target computes every node's row (one tree forward over all the shapes' trees),
and the iteration's expected committed tokens are exact given those rows
(:func:`dsi.engine.trees.expected_tree_tokens`: one token, plus each node's probability of being reached).
The chain is the trees' own main path, so the ratio compares the same drafts at the same positions:

    python benchmarks/tree_sampled_acceptance.py --out docs/data/tree_sampled_expected-2026-12-03.json

Prints a table and one JSON line. ``--dry-run`` (either mode): a tiny random GGUF pair (tests/tiny_gguf.py), the
code set's first prompt, one seed of 8 tokens, B = 4.
"""

from __future__ import annotations

import argparse
import sys
import time

from _common import add_options, emit, parse, shrink, tiny_pair

BUDGETS = (4, 8, 16)
TREES = ("auto:0.1", "branches:0.1", "branches:0.05")


def main() -> int:
    import dsi
    from dsi.cli.measure import PROMPT_SETS
    from dsi.models.vocab.bridge import bridge_drafter, shares_vocabulary
    from dsi.models.vocab.merges import MERGE_LOOKAHEAD
    from dsi.models.loading import load_pair

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per set")
    parser.add_argument("--seeds", type=int, default=2, help="seeds per prompt")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS), help="draft budgets B (SI k = B)")
    parser.add_argument("--trees", nargs="+", default=list(TREES), metavar="TREE", help="--draft-tree values to "
                        "compare with the chain")
    parser.add_argument("--sets", nargs="+", choices=("code", "prose"), default=["code", "prose"])
    parser.add_argument("--engine", action="store_true", help="run SI itself and count its tokens per verification "
                        "(different texts per shape) instead of the paired expected count")
    parser.add_argument("--stride", type=int, default=3, help="expected mode: an iteration starts at every "
                        "stride-th position of the target's text")
    parser.add_argument("--merges", type=int, default=MERGE_LOOKAHEAD, help="a drafter of another vocabulary: "
                        "shared tokens per position whose merged tokens its law reaches (dsi.models.vocab.merges; 0: "
                        "plain TLI)")
    add_options(parser, "a tiny random GGUF pair, 1 prompt x 1 seed x 8 tokens of the code set, B = 4")
    args = parse(parser)
    if shrink(args, tokens=8, prompts=1, seeds=1, budgets=[4], sets=["code"]):
        args.target, args.drafter = tiny_pair("llama.cpp")
    start = time.perf_counter()
    target, drafter = load_pair(args.target, args.drafter, backend="llama.cpp", progress=False)
    if not shares_vocabulary(target, drafter):  # another tokenizer: the token intersection (its law over target ids)
        drafter = bridge_drafter(target, drafter, "intersection", merges=args.merges)
    if not args.engine:
        return expected_main(args, target, drafter, start)
    results = []
    shapes = ["off", *args.trees]
    for name in args.sets:
        prompts = [target.encode(p) for p in PROMPT_SETS[name][: args.prompts]]
        for budget in args.budgets:
            row = {"prompts": name, "budget": budget}
            for shape in shapes:
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
                              "acceptance": accepted / max(drafted, 1),
                              "nodes_per_verification": drafted / verifications}
                print(f"{name} B={budget} {shape}: {tokens / verifications:.2f} tokens / verification "
                      f"({side} side wins)", file=sys.stderr, flush=True)
            results.append(row)
    print(f"{args.target} / {args.drafter}, llama.cpp, T = {args.temperature}, SI k = B, {args.prompts} prompts x "
          f"{args.seeds} seeds x {args.tokens} tokens per set ({time.perf_counter() - start:.0f} s)")
    print_table(results, args.trees, lambda r: (r["off"]["tokens_per_verification"], r["off"]["acceptance"]))
    emit({"benchmark": "tree_sampled_acceptance", "target": args.target, "drafter": args.drafter,
          "merges": args.merges,
          "temperature": args.temperature, "tokens": args.tokens, "prompts_per_set": args.prompts,
          "seeds": args.seeds, "results": results}, args.out)
    return 0


def expected_main(args, target, drafter, start: float) -> int:
    """The paired expected tokens per verification (the module docstring's default mode)."""
    import numpy as np

    import dsi
    from dsi.cli.measure import PROMPT_SETS
    from dsi.engine.request import Request
    from dsi.engine.trees import TreeDrafter, _suffix_tree, expected_tree_tokens
    from dsi.models import CallableLM
    from dsi.models.base import forward_rows, tree_rows
    from dsi.sampling import process_logits
    from dsi.trees import ROOT, grow, parse_shape

    shapes = {"chain": None, **{name: parse_shape(name) for name in args.trees}}
    memo: dict[tuple[int, ...], np.ndarray] = {}
    drafter_session = drafter.new_session()

    def drafter_row(context) -> np.ndarray:
        key = tuple(int(t) for t in context)
        if key not in memo:
            memo[key] = np.asarray(forward_rows(drafter_session, key, 1)[0], dtype=np.float32)
        return memo[key]

    memo_drafter = CallableLM(drafter_row, target.vocab_size, name="the drafter, memoised")
    results = []
    for name in args.sets:
        sums = {(b, s): [0.0, 0, 0] for b in args.budgets for s in shapes}  # expected tokens, iterations, nodes
        for text in PROMPT_SETS[name][: args.prompts]:
            prompt = target.encode(text)
            for seed in range(args.seeds):
                params = dsi.SamplingParams(temperature=args.temperature, seed=seed)
                own = dsi.generate(target=target, prompt=prompt, method="ar", max_new_tokens=args.tokens,
                                   sampling=params).tokens
                request = Request(tuple(prompt), args.tokens, params, frozenset(target.eos_token_ids))
                for at in range(0, len(own) - 1, args.stride):
                    base = tuple(prompt) + tuple(own[:at])
                    grown = {}
                    for budget in args.budgets:
                        for label, shape in shapes.items():
                            grown_shape = shape if shape is not None else parse_shape("1")  # the chain: width 1
                            tree_drafter = TreeDrafter.for_shape(memo_drafter.new_session(), request, base, grown_shape)
                            tree = grow(grown_shape, budget, tree_drafter.propose, tree_drafter.propose_many,
                                        tree_drafter.probability)
                            grown[budget, label] = (tree, tree_drafter)
                    paths = sorted({tuple(t.path_tokens(leaf)) for t, _ in grown.values() for leaf in t.leaves()})
                    union, _ = _suffix_tree([list(path) for path in paths])
                    session = target.new_session()
                    rows = np.asarray(tree_rows(session, base, union), dtype=np.float64)  # [1 + n, V]
                    session.close()
                    law_at: dict[tuple[int, ...], np.ndarray] = {}

                    def law(path: tuple[int, ...]) -> np.ndarray:
                        if path not in law_at:
                            row = rows[0] if not path else rows[1 + _node(union, path)]
                            law_at[path] = process_logits(row, params)
                        return law_at[path]

                    for (budget, label), (tree, tree_drafter) in grown.items():
                        laws = [law(())] + [law(tuple(tree.path_tokens(i))) for i in range(len(tree))]
                        main_laws = {node: tree_drafter.main_law(tree, node) for node in [ROOT, *range(len(tree))]
                                     if tree.children(node)}
                        entry = sums[budget, label]
                        entry[0] += expected_tree_tokens(tree, laws, main_laws)
                        entry[1] += 1
                        entry[2] += len(tree)
                print(f"{name}: {text[:30]!r} seed {seed}: {len(memo)} drafter rows "
                      f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
        for budget in args.budgets:
            row = {"prompts": name, "budget": budget}
            for label in shapes:
                total, count, nodes = sums[budget, label]
                row[label] = {"tokens_per_verification": total / count, "nodes_per_verification": nodes / count,
                              "iterations": count}
            row["chain_acceptance"] = _acceptance(row["chain"]["tokens_per_verification"], budget)
            results.append(row)
            print(f"{name} B={budget}: chain {row['chain']['tokens_per_verification']:.3f}, " + ", ".join(
                f"{t} {row[t]['tokens_per_verification']:.3f}" for t in args.trees), file=sys.stderr, flush=True)
    drafter_session.close()
    print(f"{args.target} / {args.drafter}, llama.cpp, T = {args.temperature}, SI k = B, expected tokens per "
          f"verification, {args.prompts} prompts x {args.seeds} seeds x {args.tokens} tokens per set, an iteration "
          f"every {args.stride} positions ({time.perf_counter() - start:.0f} s)")
    print_table(results, args.trees, lambda r: (r["chain"]["tokens_per_verification"], r["chain_acceptance"]))
    emit({"benchmark": "tree_sampled_expected", "target": args.target, "drafter": args.drafter,
          "merges": args.merges,
          "temperature": args.temperature, "tokens": args.tokens, "prompts_per_set": args.prompts,
          "seeds": args.seeds, "stride": args.stride, "results": results}, args.out)
    return 0


def print_table(results: list[dict], trees: list[str], chain_of) -> None:
    """The markdown table: per set and budget, the chain's tokens per verification (``chain_of(row)`` gives them
    and its acceptance) and each tree's over the chain (its nodes per verification)."""
    print("| prompts | B | chain: tokens / verification (acceptance) | "
          + " | ".join(f"`{t}` / chain (nodes)" for t in trees) + " |")
    print("|---|---|---|" + "---|" * len(trees))
    for r in results:
        chain, acceptance = chain_of(r)
        cells = [f"{r[t]['tokens_per_verification'] / chain:.3f} ({r[t]['nodes_per_verification']:.1f})" for t in trees]
        print(f"| {r['prompts']} | {r['budget']} | {chain:.2f} ({acceptance:.2f}) | " + " | ".join(cells) + " |")


def _node(tree, path: tuple[int, ...]) -> int:
    """The node of ``tree`` whose root-to-node tokens are ``path``."""
    from dsi.trees import ROOT

    node = ROOT
    for token in path:
        node = next(c for c in tree.children(node) if tree.tokens[c] == token)
    return node


def _acceptance(tokens: float, budget: int) -> float:
    """The per-draft acceptance ``a`` at which a chain of ``budget`` drafts commits ``tokens`` a verification in
    expectation (``(1 - a^(budget + 1)) / (1 - a)``), by bisection: the chain's acceptance, comparable with
    greedy agreement."""
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if sum(mid ** i for i in range(budget + 1)) < tokens:
            low = mid
        else:
            high = mid
    return (low + high) / 2


if __name__ == "__main__":
    raise SystemExit(main())
