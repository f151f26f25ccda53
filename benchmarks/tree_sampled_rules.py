"""Why sampled trees keep the chain-coupled rule (docs/architecture.md, draft trees): the acceptance of one
position under each verification rule a sampled tree could use, along the target's own sampled text.

At each position of the target's text (non-SI at T, each prompt and seed), with the target's processed law
``p`` and the drafter's ``q`` there:

- ``chain``: a sampled draft, ``sum min(p, q)``;
- ``coupledW``: the chain-coupled tree (the engine's rule): the sampled draft plus ``W - 1`` side children,
  the drafter's next likeliest tokens, followed when the chain's correction is one of them:
  ``E_x[sum min(p, q) + sum_{s in S(x)} (p(s) - q(s))+]`` over the draft ``x`` (exact over the drafter's top 6,
  its other drafts taking the top ``W - 1`` as side children);
- ``topM``: a point-mass tree, every child deterministic (the drafter's top ``M``) and the walk following the
  target's own sample: ``sum_{top M} p`` (recursive rejection with point-mass drafts).

    python benchmarks/tree_sampled_rules.py

Prints the means per prompt set and one JSON line. A drafter of another vocabulary is refused (the rows
must share ids).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rules_at(p: np.ndarray, q: np.ndarray) -> dict[str, float]:
    """Each rule's acceptance at one position (the module docstring), ``p`` and ``q`` processed laws [V]."""
    order = np.argsort(-q, kind="stable")[:8]
    both = float(np.minimum(p, q).sum())
    excess = np.maximum(p - q, 0.0)
    out = {"chain": both}
    for width in (2, 3):
        total = mass = 0.0
        for x in order[:6]:
            sides = [t for t in order if t != x][: width - 1]
            total += q[x] * (both + excess[sides].sum())
            mass += q[x]
        total += (1.0 - mass) * (both + excess[order[: width - 1]].sum())
        out[f"coupled{width}"] = float(total)
    for m in (1, 2, 3, 4):
        out[f"top{m}"] = float(p[order[:m]].sum())
    return out


def main() -> int:
    from dsi.cli.measure import PROMPT_SETS
    from dsi.evaluate.bench import emit_record
    from dsi.models.crossvocab import shares_vocabulary
    from dsi.models.loading import load_pair
    from dsi.sampling import SamplingParams, bonus, process_logits

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=3, help="prompts per set")
    parser.add_argument("--seeds", type=int, default=2, help="seeds per prompt")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    start = time.perf_counter()
    target, drafter = load_pair(args.target, args.drafter, backend="llama.cpp", progress=False)
    if not shares_vocabulary(target, drafter):
        raise SystemExit(f"{args.drafter!r} has another vocabulary than {args.target!r}: this benchmark compares "
                         "rows id by id, so it takes a drafter of the target's vocabulary")
    results = {}
    for name in ("code", "prose"):
        sums: dict[str, list[float]] = {}
        for text in PROMPT_SETS[name][: args.prompts]:
            prompt = target.encode(text)
            for seed in range(args.seeds):
                params = SamplingParams(temperature=args.temperature, seed=seed)
                target_session, drafter_session = target.new_session(), drafter.new_session()
                p_row, q_row = target_session.extend(prompt)[-1], drafter_session.extend(prompt)[-1]
                for i in range(args.tokens):
                    p, q = process_logits(p_row, params), process_logits(q_row[: p_row.size], params)
                    for rule, value in rules_at(p, q).items():
                        sums.setdefault(rule, []).append(value)
                    token = bonus(p, params, len(prompt) + i)  # the target's own sample: non-SI's text
                    p_row, q_row = target_session.extend([token])[-1], drafter_session.extend([token])[-1]
                target_session.close()
                drafter_session.close()
        results[name] = {rule: float(np.mean(values)) for rule, values in sums.items()}
        print(f"{name}: " + ", ".join(f"{rule} {value:.3f}" for rule, value in results[name].items()),
              file=sys.stderr, flush=True)
    print(f"{args.target} / {args.drafter}, llama.cpp, T = {args.temperature}, {args.prompts} prompts x {args.seeds} "
          f"seeds x {args.tokens} positions per set ({time.perf_counter() - start:.0f} s)")
    rules = list(results["code"])
    print("| prompts | " + " | ".join(rules) + " |")
    print("|---|" + "---|" * len(rules))
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(f"{row[r]:.3f}" for r in rules) + " |")
    emit_record({"benchmark": "tree_sampled_rules", "target": args.target, "drafter": args.drafter,
                 "temperature": args.temperature, "tokens": args.tokens, "prompts_per_set": args.prompts,
                 "seeds": args.seeds, "results": results}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
