"""Draft trees on this machine's CPU with a real pair (issue 24: "the embedded pair on this CPU, reported
honestly"): SI k = 5 and DSI (event-driven windows, SP = 1) with chains, with the ``auto`` tree priced by the
target's measured row cost (its floor, docs/architecture.md "What a side child costs"), and with ``auto:0.1``
(the floor before pricing), greedy, on the code and prose prompt sets.

    python benchmarks/tree_cpu_llamacpp.py --out docs/data/tree_cpu_llamacpp-2026-12-03.json

Median wall time over ``--repeats`` runs, the configurations in turn. Reports each tree against its chain, the
side children that won, the floor in force, and whether every output was non-SI's (without
``--deterministic`` llama.cpp's batched rows can flip near-ties, the chains' included: docs/results.md
section 11). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

CONFIGS = [  # (label, method, lookahead, servers, draft tree)
    ("SI k=5", "si", 5, 1, None),
    ("SI k=5 auto", "si", 5, 1, "auto"),
    ("SI k=5 auto:0.1", "si", 5, 1, "auto:0.1"),
    ("DSI SP=1", "dsi", "auto", 1, None),
    ("DSI SP=1 auto", "dsi", "auto", 1, "auto"),
    ("DSI SP=1 auto:0.1", "dsi", "auto", 1, "auto:0.1"),
]


def main() -> int:
    import dsi
    from dsi.cli.measure import PROMPT_SETS
    from dsi.evaluate.bench import emit_record
    from dsi.models.loading import load_pair

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per set")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    target, drafter = load_pair(args.target, args.drafter, backend="llama.cpp", progress=False)
    results = {}
    print("| prompts | configuration | wall s | tree / chain | side wins | floor | all = non-SI |")
    print("|---|---|---|---|---|---|---|")
    for set_name in ("code", "prose"):
        ids = [target.encode(text) for text in PROMPT_SETS[set_name][: args.prompts]]
        reference = [dsi.generate(target=target, prompt=p, method="ar", max_new_tokens=args.tokens).tokens for p in ids]
        walls: dict[str, list[float]] = {label: [] for label, *_ in CONFIGS}
        extra: dict[str, dict] = {}
        for _ in range(args.repeats):
            for label, method, k, servers, tree in CONFIGS:
                total, side, same, floor = 0.0, 0, True, None
                for prompt, want in zip(ids, reference, strict=True):
                    out = dsi.generate(target=target, drafter=drafter, prompt=prompt, method=method, lookahead=k,
                                       num_target_servers=servers, draft_tree=tree, max_new_tokens=args.tokens)
                    total += out.stats.wall_time_s
                    side += out.stats.extra.get("tree_side_accepts", 0)
                    same &= out.tokens == want
                    floor = out.stats.extra.get("tree_floor")
                walls[label].append(total)
                extra[label] = {"side": side, "same": same, "floor": floor}
        median = {label: statistics.median(v) for label, v in walls.items()}
        results[set_name] = {"median_s": median, "walls": walls, "extra": extra}
        for label, *_ in CONFIGS:
            chain = label.split(" auto")[0]
            e = extra[label]
            print(f"| {set_name} | {label} | {median[label]:.2f} | {median[chain] / median[label]:.3f} | {e['side']} | "
                  f"{e['floor']} | {'yes' if e['same'] else 'no'} |", flush=True)
    emit_record({"benchmark": "tree_cpu_llamacpp", "target": args.target, "drafter": args.drafter,
                 "prompts_per_set": args.prompts, "tokens": args.tokens, "repeats": args.repeats,
                 "results": results}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
