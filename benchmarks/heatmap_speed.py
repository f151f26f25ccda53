"""How long the offline simulator takes for Figure 1's grid (simulation only, no plotting).

    python benchmarks/heatmap_speed.py [--ndim 10 20] [--runs 3] [--out FILE.json]
    python benchmarks/heatmap_speed.py --dry-run      # a grid of ndim 2, 20 tokens, once

Prints a table for people and, last, one JSON line (machine, configuration, best and median
seconds per grid). The goal of issue 4: ndim = 20 (8,820 configurations x 5 repeats x 1,000
tokens) in 3 s or less on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from _common import add_options, emit, machine, parse, shrink

from dsi.sim.heatmap import grid
from dsi.sim.offline import simulate_many


def time_grid(ndim: int, runs: int, tokens: int, repeats: int) -> list[float]:
    c, a, k = grid(ndim)
    C, A, K = np.meshgrid(c, a, k, indexing="ij")
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        simulate_many(C.ravel(), A.ravel(), K.ravel(), tokens=tokens, repeats=repeats, seed=42)
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ndim", type=int, nargs="+", default=[10, 20])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    add_options(parser, "a grid of ndim 2, 20 tokens, one run")
    args = parse(parser)
    shrink(args, ndim=[2], runs=1, tokens=20, repeats=1)
    where = {**machine(), "numpy": np.__version__,
             "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None}
    results = []
    print(f"{'ndim':>5} {'configs':>8} {'best s':>8} {'median s':>9}")
    for ndim in args.ndim:
        seconds = time_grid(ndim, args.runs, args.tokens, args.repeats)
        configs = (ndim + 1) ** 2 * ndim
        results.append({"ndim": ndim, "configs": configs, "seconds": seconds,
                        "best_s": min(seconds), "median_s": statistics.median(seconds)})  # fmt: skip
        print(f"{ndim:>5} {configs:>8} {min(seconds):>8.3f} {statistics.median(seconds):>9.3f}")
    emit({"machine": where, "tokens": args.tokens, "repeats": args.repeats, "results": results}, args.out)


if __name__ == "__main__":
    main()
