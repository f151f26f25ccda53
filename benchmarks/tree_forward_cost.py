"""What a draft tree's verification costs on one device: a target forward over a tree of n nodes (one
forward with the tree attention mask, ``HFSession.tree_rows``) against a chain of n tokens, one extension
per root-to-leaf path, and one token (issue 24's GPU rows; part of benchmarks/gpu_check.sh).

Random weights of a real architecture (``benchmarks/configs/NAME``), after a prefix of 128 tokens kept in
the cache (each timed forward starts from it). Trees are the ``2`` shape (two children at every depth:
n/2 + 1 paths). Median of ``--repeats`` forwards, synchronised.

    python benchmarks/tree_forward_cost.py --config qwen2.5-coder-1.5b-instruct --device cuda:0 --dtype bf16

Prints a table and one JSON line (``--out`` writes it too); ``--dry-run``: the architecture at two layers of
width 32 (benchmarks/tiny_configs.py), trees of 4 and 8 nodes, one repeat. Where a tree of 16-64 nodes costs about one
token's forward (a memory-bound GPU), side children are free to verify; where it costs n tokens (a CPU),
they cost what they compute.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _common import add_options, emit, median_seconds, parse, shrink, tiny_configs

CONFIGS = Path(__file__).resolve().parent / "configs"
SIZES = (4, 8, 16, 32, 64)
PREFIX = 128


def timed(run, device: str, repeats: int) -> float:
    """The median seconds of ``repeats`` synchronised calls of ``run``, after one not counted."""
    return median_seconds(run, repeats, device, warmup=1)


def main() -> int:
    from dsi.models.base import forward_rows, path_tree_rows, tree_rows
    from dsi.models.emulated.replay import random_weights_model
    from dsi.trees import Widths, grow

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--configs-dir", default=str(CONFIGS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    add_options(parser, "the architecture at 2 layers of width 32, trees of 4 and 8 nodes, one repeat")
    args = parse(parser)
    if shrink(args, sizes=[4, 8], repeats=1):
        args.configs_dir = str(tiny_configs())
    model = random_weights_model(Path(args.configs_dir) / args.config, args.dtype, args.device)
    vocab = model.vocab_size
    prefix = [(7 * i + 3) % vocab for i in range(PREFIX)]
    session = model.new_session()
    forward_rows(session, prefix, 1)

    def back_to_prefix() -> None:
        session.truncate(PREFIX)

    def run(fn):
        def once():
            back_to_prefix()
            fn()
        return once

    one = timed(run(lambda: forward_rows(session, prefix + [5], 1)), args.device, args.repeats)
    rows = []
    for n in args.sizes:
        tree = grow(Widths((2,)), n, lambda path: (11 + len(path), [(11 + len(path), 0.6), (13 + len(path), 0.3)]))
        chain = [(5 * i + 1) % vocab for i in range(n)]
        chain_s = timed(run(lambda: forward_rows(session, prefix + chain, n + 1)), args.device, args.repeats)
        tree_s = timed(run(lambda: tree_rows(session, prefix, tree)), args.device, args.repeats)
        paths_s = timed(run(lambda: path_tree_rows(session, prefix, tree)), args.device, args.repeats)
        rows.append({"nodes": n, "paths": len(tree.paths()), "chain_ms": 1e3 * chain_s, "tree_ms": 1e3 * tree_s,
                     "paths_ms": 1e3 * paths_s, "tree_over_one": tree_s / one, "tree_over_chain": tree_s / chain_s})
    print(f"{args.config} (random weights), {args.device}, {args.dtype}; after {PREFIX} cached tokens; "
          f"one token: {1e3 * one:.2f} ms; median of {args.repeats}")
    print("| nodes | paths | chain ms | tree ms (one forward) | tree ms (a forward per path) | tree / one token | "
          "tree / chain |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['nodes']} | {r['paths']} | {r['chain_ms']:.2f} | {r['tree_ms']:.2f} | {r['paths_ms']:.2f} | "
              f"{r['tree_over_one']:.2f} | {r['tree_over_chain']:.2f} |")
    emit({"benchmark": "tree_forward_cost", "config": args.config, "device": args.device, "dtype": args.dtype,
          "prefix": PREFIX, "one_token_ms": 1e3 * one, "repeats": args.repeats, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
