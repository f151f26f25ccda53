"""What a sampled request's laws cost the host, by request and prompt length: a drafter's draw from its row
(``dsi.sampling.draft_from_logits``: the processors, the law, the draw), a 5-row verification's laws on the host
(``process_rows``), and what a verification decided on a GPU still does on the host (the ids the processors touch,
row by row: ``touched_ids`` over ``chain_counts``; ``models/hf/device_laws.py`` gathers and processes only those).
Over random float32 rows of Qwen2.5's 151,936 ids, the allocator tuned as the engine tunes it
(``dsi.allocator``), median of ``--repeats``.

    python benchmarks/law_cost.py

Requests: ``sampled`` (T 0.7), ``nucleus`` (Qwen2.5-Instruct's sampling: T 0.7, top_k 20, top_p 0.8,
repetition_penalty 1.05) and ``top-p`` (T 0.7, top_p 0.9: the nucleus without top-k). ``--dry-run``: a
4,096-id vocabulary, prompts of 10 and 100 tokens, 3 repeats.
"""

from __future__ import annotations

import argparse

from _common import add_options, emit, median_seconds, parse, shrink

import numpy as np

from dsi.allocator import tune_allocator
from dsi.sampling import Prefix, SamplingParams, chain_counts, draft_from_logits, process_rows, touched_ids

REQUESTS = {
    "sampled": SamplingParams(temperature=0.7, seed=1),
    "nucleus": SamplingParams(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05, seed=1),
    "top-p": SamplingParams(temperature=0.7, top_p=0.9, seed=1),
}
ROWS = 5  # a verification of k = 4


def measure(vocab: int, prompt: int, repeats: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    row = (rng.standard_normal(vocab) * 8).astype(np.float32)  # peaked, as a trained model's rows are
    rows = np.stack([row] * ROWS)
    tokens = tuple(int(t) for t in rng.integers(0, vocab, prompt + ROWS))  # the prompt, then the output
    out = []
    for name, params in REQUESTS.items():
        position = iter(range(10**9))
        draft = median_seconds(lambda: draft_from_logits(row, params, prompt + next(position), Prefix(tokens, prompt)),
                               repeats, warmup=1)
        laws = median_seconds(lambda: process_rows(rows, params, tokens, prompt), repeats, warmup=1)
        touched = median_seconds(lambda: [touched_ids(params, c, frozenset(), vocab)
                                          for c in chain_counts(params, tokens, prompt, ROWS, vocab)], repeats, warmup=1)
        out.append({"request": name, "prompt": prompt, "vocab": vocab, "draft_ms": 1e3 * draft,
                    "verification_laws_ms": 1e3 * laws, "device_host_part_ms": 1e3 * touched})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--prompts", type=int, nargs="+", default=[100, 4000, 16000], help="prompt lengths")
    parser.add_argument("--repeats", type=int, default=30)
    add_options(parser, "a 4,096-id vocabulary, prompts of 10 and 100 tokens, 3 repeats")
    args = parse(parser)
    shrink(args, vocab=4096, prompts=[10, 100], repeats=3)
    tuned = tune_allocator()
    rows = [r for prompt in args.prompts for r in measure(args.vocab, prompt, args.repeats)]
    print(f"host ms over {args.vocab} ids, median of {args.repeats} (allocator tuned: {tuned})")
    print(f"| request | prompt tokens | a draft | a {ROWS}-row verification's laws | its host part decided on a GPU |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['request']} | {r['prompt']} | {r['draft_ms']:.3f} | {r['verification_laws_ms']:.3f} | "
              f"{r['device_host_part_ms']:.3f} |")
    emit({"benchmark": "law_cost", "vocab": args.vocab, "repeats": args.repeats, "allocator_tuned": tuned,
          "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
