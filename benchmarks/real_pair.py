"""Real-model benchmark: non-SI, SI, DSI and transformers' assisted generation on one pair.

Greedy decoding of several code prompts with the embedded Qwen2.5-Coder 1.5B (target) / 0.5B
(drafter) pair, or any pair given with --target/--drafter. Every method runs in this one
process, one after another; for SI and DSI a few lookaheads (and for DSI server counts) are
tried and the best is reported. Outputs are checked to be identical to non-SI's. Prints a
table and writes JSON (--out).

    python benchmarks/real_pair.py --tokens 64 --prompts 3 --out results/real_pair.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from dsi.compare import CODE_PROMPTS, MethodConfig, compare
from dsi.models.loading import load_pair


def hf_assisted(target, drafter, prompts, tokens, repeats, threads):
    """transformers' own assisted generation (its default assistant schedule)."""
    torch.set_num_threads(threads)  # CPU only; ignored on GPU
    walls, outputs = [], []
    for ids in prompts:
        x = torch.tensor([ids], device=target.device)
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            with torch.inference_mode():
                out = target.model.generate(x, assistant_model=drafter.model, max_new_tokens=tokens,
                                            min_new_tokens=tokens, do_sample=False, pad_token_id=0)
            runs.append(time.perf_counter() - start)
        walls.append(statistics.median(runs))
        outputs.append(out[0, len(ids):].tolist())
    return walls, outputs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--device", default="cpu", help="device of the drafter (and of the target for non-SI/SI)")
    p.add_argument("--target-devices", nargs="+", default=None,
                   help="one device per DSI target server, e.g. cuda:1 cuda:2 (GPU machines)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--si-k", type=int, nargs="+", default=[3, 5])
    p.add_argument("--dsi-k", type=int, nargs="+", default=[3, 5])
    p.add_argument("--dsi-sp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--threads", type=int, default=2, help="torch threads of non-SI, SI and assisted generation")
    p.add_argument("--dsi-threads", type=int, default=1, help="torch threads per DSI worker")
    p.add_argument("--no-assisted", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()

    target, drafter = load_pair(args.target, args.drafter, dtype=args.dtype, device=args.device, progress=True)
    placement = (("devices", args.target_devices),) if args.target_devices else ()
    prompts = [target.encode(t) for t in CODE_PROMPTS[: args.prompts]]
    configs = [MethodConfig("ar", threads=args.threads)]
    configs += [MethodConfig("si", k, threads=args.threads) for k in args.si_k]
    configs += [MethodConfig("dsi", k, sp, threads=args.dsi_threads, transport_options=placement)
                for k in args.dsi_k for sp in args.dsi_sp]
    done = 0

    def tick():
        nonlocal done
        done += 1
        print(f"\r{done}/{len(configs) * len(prompts) * args.repeats} runs", end="", file=sys.stderr, flush=True)

    results = compare(target, drafter, prompts, configs, max_new_tokens=args.tokens, repeats=args.repeats,
                      eos_token_id=None, progress=tick)
    print(file=sys.stderr)
    rows = {}
    for config in configs:
        runs = [r[config.label] for r in results]
        rows[config.label] = {
            "method": config.method, "lookahead": config.lookahead, "servers": config.servers,
            "threads": config.threads, "total_s": sum(r.median_s for r in runs),
            "per_prompt_s": [r.median_s for r in runs],
            "identical": all(r.tokens == res["non-SI"].tokens for r, res in zip(runs, results, strict=True)),
            "acceptance_rate": statistics.mean(r.stats.get("acceptance_rate", 0.0) for r in runs),
            "preempted_tasks": sum(r.stats.get("preempted_tasks", 0) for r in runs),
        }
    if not args.no_assisted:
        walls, outs = hf_assisted(target, drafter, prompts, args.tokens, args.repeats, args.threads)
        rows["HF assisted"] = {
            "method": "hf-assisted", "lookahead": None, "servers": None, "threads": args.threads,
            "total_s": sum(walls), "per_prompt_s": walls,
            "identical": all(o == res["non-SI"].tokens for o, res in zip(outs, results, strict=True)),
        }
    base = rows["non-SI"]["total_s"]
    best = lambda m: min((r for r in rows.values() if r["method"] == m), key=lambda r: r["total_s"])  # noqa: E731
    best_si, best_dsi = best("si"), best("dsi")
    print(f"{'method':<18} {'total s':>8} {'tok/s':>6} {'vs non-SI':>9} {'vs best SI':>10} {'accept':>6} identical")
    for label, r in rows.items():
        n = args.tokens * len(prompts)
        print(f"{label:<18} {r['total_s']:8.2f} {n / r['total_s']:6.2f} {base / r['total_s']:8.2f}x "
              f"{best_si['total_s'] / r['total_s']:9.2f}x {r.get('acceptance_rate', 0):6.2f} "
              f"{'yes' if r['identical'] else 'NO'}")
    report = {
        "machine": {"python": platform.python_version(), "cpus": torch.get_num_threads(),
                    "torch": torch.__version__, "platform": platform.platform()},
        "config": vars(args), "rows": rows,
        "best_si": best_si, "best_dsi": best_dsi,
        "dsi_vs_si": best_si["total_s"] / best_dsi["total_s"],
        "dsi_vs_nonsi": base / best_dsi["total_s"],
        "dsi_vs_hf_assisted": rows["HF assisted"]["total_s"] / best_dsi["total_s"] if not args.no_assisted else None,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps({k: report[k] for k in ("dsi_vs_si", "dsi_vs_nonsi", "dsi_vs_hf_assisted")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
