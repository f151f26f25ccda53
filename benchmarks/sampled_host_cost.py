"""What a sampled request costs the host per token, apart from the models' forwards: the drafter's law over
the whole vocabulary and its draw, the target's law and the decision, in the engines on emulated latencies.

Synthetic models (``CallableLM``) over a vocabulary of ``--vocab`` ids (Qwen's 151,936 by default) serve
float32 rows from a fixed bank (the row after a context is picked by a hash of its last three tokens; the
drafter's is the target's with 100 ids raised), so a run's cost is the host's work and the emulated waits.
Each allocator setting runs in a fresh interpreter (``DSI_TUNE_ALLOCATOR=1`` and ``=0``: docs/results.md
section 28 says why it matters).

- **per token**: ``draft_from_logits`` (a drafted token: its law and draw) and a sampled decision on a
  target row (its law, ``decide``, the residual's draw on a rejection), median ms over ``--draws``;
- **engines**: ms of wall time per generated token (median over ``--seeds`` texts of ``--tokens``), T = 0.7:
  SI k = 4 chain and ``branches:0.05``, DSI SP = 4 (event-driven) chain and ``auto:0.1``, with no latency
  (the host's work alone) and GPU-like latencies (target 20 ms, drafter 2 ms per forward).

    python benchmarks/sampled_host_cost.py --out docs/data/sampled_host_cost-2026-12-04.json

Run it with ``PYTHONPATH=<an older checkout>/src`` to time that code with the same program.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np

ENGINE_CONFIGS = [  # (label, method, lookahead, servers, draft tree)
    ("SI chain", "si", 4, 1, None),
    ("SI branches:0.05", "si", 4, 1, "branches:0.05"),
    ("DSI SP=4 chain", "dsi", "auto", 4, None),
    ("DSI SP=4 auto:0.1", "dsi", "auto", 4, "auto:0.1"),
]
LATENCIES = {"none": None, "gpu-like": (0.020, 0.002)}


def bank(vocab: int, rows: int = 64) -> np.ndarray:
    return (np.random.default_rng(0).standard_normal((rows, vocab)) * 2.5).astype(np.float32)  # [rows, V]


def models(vocab: int, latency: tuple[float, float] | None):
    from dsi.models import WithLatency
    from dsi.models.callable import CallableLM

    rows = bank(vocab)

    def pick(context: tuple[int, ...]) -> int:
        return zlib.crc32(repr(context[-3:]).encode()) % len(rows)

    def drafter_row(context: tuple[int, ...]) -> np.ndarray:
        row = rows[pick(context)].copy()
        row[:100] += 0.5
        return row

    target = CallableLM(lambda context: rows[pick(context)], vocab, "synthetic-target")
    drafter = CallableLM(drafter_row, vocab, "synthetic-drafter")
    if latency is None:
        return target, drafter
    return (WithLatency(target, ttft=latency[0], tpot=latency[0]),
            WithLatency(drafter, ttft=latency[1], tpot=latency[1]))


def per_token(vocab: int, draws: int) -> dict:
    from dsi.sampling import SamplingParams, decide, draft_from_logits, process_logits

    params = SamplingParams(temperature=0.7, seed=1)
    rows = bank(vocab, 8)

    def timed(step) -> float:
        times = []
        for i in range(draws):
            start = time.perf_counter()
            step(i)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    kept = []  # the drafts' laws stay alive, as a window's do

    def draft(i: int) -> None:
        kept.append(draft_from_logits(rows[i % 8], params, i))
        del kept[:-8]

    q = process_logits(rows[1], params)

    def verify(i: int) -> None:
        p = process_logits(rows[i % 8], params)
        kept.append(decide(p, i % 50, q, params, i))
        del kept[:-8]

    return {"draft_ms": timed(draft), "decide_ms": timed(verify)}


def engines(vocab: int, tokens: int, seeds: int) -> dict:
    import dsi

    out = {}
    for latency_name, latency in LATENCIES.items():
        target, drafter = models(vocab, latency)
        for label, method, k, servers, tree in ENGINE_CONFIGS:
            per = []
            for seed in range(seeds):
                result = dsi.generate(target=target, drafter=drafter, prompt=[1, 2, 3], method=method,
                                      lookahead=k, num_target_servers=servers, draft_tree=tree,
                                      max_new_tokens=tokens,
                                      sampling=dsi.SamplingParams(temperature=0.7, seed=seed))
                per.append(result.stats.wall_time_s / len(result.tokens) * 1e3)
            out[f"{label}, {latency_name}"] = statistics.median(per)
    return out


def child(args: argparse.Namespace) -> None:
    record = {"per_token": per_token(args.vocab, args.draws), "engines": engines(args.vocab, args.tokens, args.seeds)}
    print(json.dumps(record))


def run_child(argv: list[str], tune: str) -> dict:
    env = dict(os.environ, DSI_TUNE_ALLOCATOR=tune)
    proc = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True, env=env,
                          check=False)
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--draws", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3, help="fresh interpreters per allocator setting, "
                        "alternating; the median of their numbers is reported")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    argv = ["--vocab", str(args.vocab), "--tokens", str(args.tokens), "--seeds", str(args.seeds),
            "--draws", str(args.draws)]
    runs: dict[str, list[dict]] = {"1": [], "0": []}
    for _ in range(args.repeats):
        for tune in runs:
            runs[tune].append(run_child(argv, tune))
    medians = {}
    for tune, records in runs.items():
        flat = [{**r["per_token"], **r["engines"]} for r in records]
        medians[tune] = {key: statistics.median(f[key] for f in flat) for key in flat[0]}
    import dsi

    print(f"dsi at {Path(dsi.__file__).parent}; V = {args.vocab}, T = 0.7, median of {args.repeats} interpreters")
    print(f"{'ms':<34} {'tuned':>8} {'default':>8} {'default/tuned':>14}")
    for key in medians["1"]:
        on, off = medians["1"][key], medians["0"][key]
        print(f"{key:<34} {on:>8.3f} {off:>8.3f} {off / on:>14.2f}")
    record = {"benchmark": "sampled_host_cost", "dsi": str(Path(dsi.__file__).parent), "vocab": args.vocab,
              "tokens": args.tokens, "seeds": args.seeds, "draws": args.draws, "repeats": args.repeats,
              "tuned": medians["1"], "default": medians["0"], "runs": runs}
    print(json.dumps(record))
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
