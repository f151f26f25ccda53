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
  target's own sample: ``sum_{top M} p`` (recursive rejection with point-mass drafts);
- ``exactW``: ``coupledW`` without its one approximation: a draft ``x`` is rejected with probability
  ``1 - min(1, p(x) / q(x))``, not the average ``Z = sum (p - q)+``, and the correction is then drawn from
  the residual ``(p - q)+ / Z``, so ``E_x[min(1, p(x)/q(x)) + (1 - min(1, p(x)/q(x))) sum_{s in S(x)} (p(s) -
  q(s))+ / Z]``;
- ``oracleW``: the same with ``S(x)`` the ``W - 1`` tokens of most residual mass (other than ``x``), chosen
  knowing the target's law: no choice of ``W - 1`` side children beside the sampled draft accepts more at a
  position (the chain-coupled rule is optimal for its nodes, docs/architecture.md), so ``oracleW - exactW`` is
  all that choosing side children otherwise than by the drafter's ranking could add.

It also reports where a rejection's correction lands: the share of the residual's mass ``(p - q)+ / Z`` on
the drafter's rank 1, 2-3, 4-10, 11-100 and beyond (averaged over positions by their rejection probability
``Z``): side children drawn from the drafter's top ranks rescue at most the first buckets.

    python benchmarks/tree_sampled_rules.py
    python benchmarks/tree_sampled_rules.py --drafter smollm2-135m-instruct \
        --out docs/data/tree_sampled_rules_smollm2-2026-12-04.json
    python benchmarks/tree_sampled_rules.py --drafter smollm2-135m-instruct --merges 0 \
        --out docs/data/tree_sampled_rules_smollm2_tli-2026-12-04.json

Prints the means per prompt set and one JSON line. A drafter of another vocabulary drafts through the token
intersection (its law over the target's ids), as the engines run it.
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
    rejected = float(excess.sum())  # Z: the probability that the sampled draft is rejected
    by_excess = np.argsort(-excess, kind="stable")[:8]
    for width in (2, 3):
        exact = oracle = mass = 0.0
        for x in order[:6]:
            keep = min(1.0, float(p[x] / q[x])) if q[x] > 0 else 0.0
            ranked = [t for t in order if t != x][: width - 1]
            best = [t for t in by_excess if t != x][: width - 1]
            rescue = (1.0 - keep) / rejected if rejected > 0 else 0.0
            exact += q[x] * (keep + rescue * excess[ranked].sum())
            oracle += q[x] * (keep + rescue * excess[best].sum())
            mass += q[x]
        # the drafts beyond the drafter's top 6: their own acceptance, the top-ranked or best side children
        tail = order[:6]
        rest_keep = both - float(np.minimum(p, q)[tail].sum())  # sum over x not in the top 6 of q(x) min(1, p/q)
        rest_reject = (1.0 - mass) - rest_keep
        scale = rest_reject / rejected if rejected > 0 else 0.0
        exact += rest_keep + scale * excess[order[: width - 1]].sum()
        oracle += rest_keep + scale * excess[by_excess[: width - 1]].sum()
        out[f"exact{width}"] = float(exact)
        out[f"oracle{width}"] = float(oracle)
    return out


RANK_BUCKETS = ((1, 1), (2, 3), (4, 10), (11, 100), (101, None))


def residual_by_rank(p: np.ndarray, q: np.ndarray) -> tuple[float, list[float]]:
    """The rejection probability ``Z`` and the residual's mass per bucket of the drafter's ranks
    (:data:`RANK_BUCKETS`), each bucket's share of ``(p - q)+`` (zeros when nothing is rejected)."""
    excess = np.maximum(p - q, 0.0)
    rejected = float(excess.sum())
    if rejected <= 0:
        return 0.0, [0.0] * len(RANK_BUCKETS)
    ranked = excess[np.argsort(-q, kind="stable")]
    shares = [float(ranked[lo - 1: hi].sum() / rejected) for lo, hi in RANK_BUCKETS]
    return rejected, shares


def main() -> int:
    from dsi.cli.measure import PROMPT_SETS
    from dsi.evaluate.bench import emit_record
    from dsi.models.crossvocab import bridge_drafter, shares_vocabulary
    from dsi.models.merges import MERGE_LOOKAHEAD
    from dsi.models.loading import load_pair
    from dsi.sampling import SamplingParams, bonus, process_logits

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=3, help="prompts per set")
    parser.add_argument("--seeds", type=int, default=2, help="seeds per prompt")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--merges", type=int, default=MERGE_LOOKAHEAD, help="a drafter of another vocabulary: "
                        "shared tokens per position whose merged tokens its law reaches (dsi.models.merges; 0: "
                        "plain TLI)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    start = time.perf_counter()
    target, drafter = load_pair(args.target, args.drafter, backend="llama.cpp", progress=False)
    if not shares_vocabulary(target, drafter):  # another tokenizer: the token intersection (its law over target ids)
        drafter = bridge_drafter(target, drafter, "intersection", merges=args.merges)
    results, residuals = {}, {}
    for name in ("code", "prose"):
        sums: dict[str, list[float]] = {}
        weighted = np.zeros(len(RANK_BUCKETS))
        rejections = 0.0
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
                    rejected, shares = residual_by_rank(p, q)
                    weighted += rejected * np.asarray(shares)
                    rejections += rejected
                    token = bonus(p, params, len(prompt) + i)  # the target's own sample: non-SI's text
                    p_row, q_row = target_session.extend([token])[-1], drafter_session.extend([token])[-1]
                target_session.close()
                drafter_session.close()
        results[name] = {rule: float(np.mean(values)) for rule, values in sums.items()}
        residuals[name] = [float(v) for v in weighted / max(rejections, 1e-300)]
        print(f"{name}: " + ", ".join(f"{rule} {value:.3f}" for rule, value in results[name].items()),
              file=sys.stderr, flush=True)
    print(f"{args.target} / {args.drafter}, llama.cpp, T = {args.temperature}, {args.prompts} prompts x {args.seeds} "
          f"seeds x {args.tokens} positions per set ({time.perf_counter() - start:.0f} s)")
    rules = list(results["code"])
    print("| prompts | " + " | ".join(rules) + " |")
    print("|---|" + "---|" * len(rules))
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(f"{row[r]:.3f}" for r in rules) + " |")
    buckets = [f"{lo}" if lo == hi else f"{lo}-{hi}" if hi else f">{lo - 1}" for lo, hi in RANK_BUCKETS]
    print("\nWhere a rejected draft's correction lands, by the drafter's rank (share of the residual's mass):")
    print("| prompts | " + " | ".join(buckets) + " |")
    print("|---|" + "---|" * len(buckets))
    for name, shares in residuals.items():
        print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in shares) + " |")
    emit_record({"benchmark": "tree_sampled_rules", "target": args.target, "drafter": args.drafter,
                 "merges": args.merges,
                 "temperature": args.temperature, "tokens": args.tokens, "prompts_per_set": args.prompts,
                 "seeds": args.seeds, "results": results, "residual_by_rank": residuals,
                 "rank_buckets": buckets}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
