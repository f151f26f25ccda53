"""Can DSI beat SI when the drafter and the target servers share the same CPU cores?

On a small CPU machine DSI has no spare hardware for its target servers: every core a server
uses is taken from the drafter, and DSI's time is bounded below by the drafter's time on what is
left (see docs/results.md#transformers-in-detail-and-why-dsi-cannot-win-on-shared-cores). This benchmark
measures the most favourable split we know:

- SI with every worker on all ``--threads`` torch threads (the reference);
- DSI with the drafter on all ``--threads`` threads and one target server in its own process on
  one thread at ``SCHED_IDLE`` priority (Linux), so the server only runs on cycles the drafter
  leaves idle and never slows the drafter's critical path. Run it with
  ``OMP_WAIT_POLICY=PASSIVE`` so that the drafter's idle OpenMP threads sleep instead of spinning
  (otherwise the idle-priority server never runs).

Greedy, the embedded pair (or --target/--drafter), times are sums over prompts of the median
over --repeats; outputs are compared with SI's, and where they differ the target's logit margin
at the first differing token says whether it was a floating-point near-tie (bf16 forwards over
different numbers of positions round differently; see docs/results.md).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/shared_cpu.py --si-k 6 --dsi-k 5 8

Prints a table, then one JSON line (``--out`` writes it too). ``--dry-run``: a tiny random pair (fp32), 2 prompts
x 6 tokens, SI k = 2 and DSI k = 2, one repeat.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys

from _common import add_options, emit, parse, shrink, tiny_pair

from dsi.engine.api import build_decoder, make_request
from dsi.evaluate.compare import CODE_PROMPTS, NEAR_TIE_MARGIN, first_divergence
from dsi.models.loading import load_pair
from dsi.sampling import SamplingParams


def timed_total(decoder, prompts, tokens, repeats, vocab) -> tuple[float, list[list[int]]]:
    decoder.generate(make_request(prompts[0], 4, SamplingParams(), None, vocab))  # warm-up
    total, outputs = 0.0, []
    for ids in prompts:
        walls = []
        for _ in range(repeats):
            out = decoder.generate(make_request(ids, tokens, SamplingParams(), None, vocab))
            walls.append(out.stats.wall_time_s)
        total += statistics.median(walls)
        outputs.append(out.tokens)
    return total, outputs


def agreement(target, prompts, reference, outputs, dtype) -> str:
    """"yes", "near-tie (margin m)" or "NO (margin m)" for outputs against the reference."""
    margins = []
    for ids, ref, out in zip(prompts, reference, outputs, strict=True):
        where = first_divergence(target, ids, ref, out)
        if where is not None:
            margins.append(abs(where["margin"]) if where["margin"] is not None else float("inf"))
    if not margins:
        return "yes"
    worst = max(margins)
    return f"{'near-tie' if worst <= NEAR_TIE_MARGIN[dtype] else 'NO'} (margin {worst:.3f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="torch threads of SI and of DSI's drafter")
    p.add_argument("--si-k", type=int, nargs="+", default=[6])
    p.add_argument("--dsi-k", type=int, nargs="+", default=[5, 8])
    add_options(p, "a tiny random pair (fp32), 2 prompts x 6 tokens, SI k=2, DSI k=2, one repeat")
    args = parse(p)
    if shrink(args, dtype="fp32", tokens=6, prompts=2, repeats=1, si_k=[2], dsi_k=[2]):
        args.target, args.drafter = tiny_pair()
    if not hasattr(os, "SCHED_IDLE"):
        print("SCHED_IDLE needs Linux", file=sys.stderr)
        return 2

    target, drafter = load_pair(args.target, args.drafter, dtype=args.dtype, progress=True)
    target.threads = drafter.threads = args.threads
    prompts = [target.encode(t) for t in CODE_PROMPTS[: args.prompts]]
    rows, reference = {}, None
    for k in args.si_k:
        decoder = build_decoder(target=target, drafter=drafter, method="si", lookahead=k)
        try:
            total, outputs = timed_total(decoder, prompts, args.tokens, args.repeats, target.vocab_size)
        finally:
            decoder.close()
        reference = reference or outputs
        rows[f"SI k={k}"] = {"total_s": total, "identical": agreement(target, prompts, reference, outputs, args.dtype)}
    for k in args.dsi_k:
        decoder = build_decoder(target=target, drafter=drafter, method="dsi", lookahead=k, num_target_servers=1,
                                transport="processes", transport_options={"threads_per_server": 1})
        try:
            for child in multiprocessing.active_children():  # the target server process
                os.sched_setscheduler(child.pid, os.SCHED_IDLE, os.sched_param(0))
            total, outputs = timed_total(decoder, prompts, args.tokens, args.repeats, target.vocab_size)
        finally:
            decoder.close()
        rows[f"DSI k={k} (idle server)"] = {
            "total_s": total, "identical": agreement(target, prompts, reference, outputs, args.dtype)}
    best_si = min(r["total_s"] for label, r in rows.items() if label.startswith("SI"))
    print(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, {args.threads} threads, "
          f"{args.prompts} prompts x {args.tokens} tokens, median of {args.repeats}")
    for label, r in rows.items():
        print(f"{label:<24} {r['total_s']:7.2f} s  vs best SI {best_si / r['total_s']:.2f}x  "
              f"identical to SI: {r['identical']}")
    emit({"config": vars(args), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
