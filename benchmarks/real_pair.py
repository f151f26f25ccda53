"""Real-model benchmark: non-SI, SI, DSI and transformers' assisted generation on one pair.

Greedy decoding of several code prompts with the embedded Qwen2.5-Coder 1.5B (target) / 0.5B
(drafter) pair, or any pair given with --target/--drafter. Every method runs in this one
process, one after another; for SI and DSI a few lookaheads (and for DSI server counts) are
tried and the best is reported. Each time is the median over --repeats runs. Outputs are
checked to be identical to non-SI's. Prints a table and writes JSON (--out).

Every SI and DSI row also gets an *ideal*: the time the event simulator (dsi.sim.events)
predicts for that configuration from latencies measured here on the same thread counts (prefill,
one drafter step, one target forward over k+1 tokens) and from the exact greedy accept pattern of
each prompt (the drafter's greedy guess vs non-SI's token at every position). "engine/ideal" is
the measured time over that prediction: engine overhead, GIL and, on a CPU, the cost of workers
sharing cores (the simulator gives every worker its own hardware).

    python benchmarks/real_pair.py --tokens 64 --prompts 3 --repeats 3 --out results/real_pair.json

Replay, for machines that cannot load the pair (no registry access, e.g. a lent GPU box):
``--record FILE`` saves each prompt's non-SI output and the drafter's greedy guess at every
prefix of it (a few KB); ``--replay FILE`` then runs models of the same architecture with random
weights (configs in benchmarks/configs/) whose greedy choices are the recorded ones
(dsi.models.replay), so every forward costs what the real pair's would and every accept/reject
is the real pair's. transformers' assisted generation is skipped in replay mode.

    python benchmarks/real_pair.py --record benchmarks/recordings/qwen-coder-code.json ...
    python benchmarks/real_pair.py --replay benchmarks/recordings/qwen-coder-code.json --device cuda:0
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from dsi.compare import CODE_PROMPTS, MethodConfig, compare
from dsi.models.loading import load_pair
from dsi.models.replay import load_recording, record_decisions, replay_pair, save_recording
from dsi.sim.events import simulate


def median_seconds(fn, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def worker_latencies(model, prompt, threads: int, sizes, repeats: int = 5) -> dict:
    """Median seconds of a prefill over ``prompt`` and of one forward of n tokens after it, for n
    in ``sizes``, on ``threads`` torch threads (what one worker of that configuration sees alone)."""
    saved, model.threads = model.threads, threads
    session = model.new_session()
    try:
        def prefill():
            session.truncate(0)
            session.extend(prompt)

        out = {"prefill": median_seconds(prefill, 2)}
        for n in sizes:
            def forward(n=n):
                session.extend(prompt[:n] if len(prompt) >= n else [prompt[-1]] * n)
                session.truncate(len(prompt))

            forward()  # warm-up at this size
            out[n] = median_seconds(forward, repeats)
        return out
    finally:
        session.close()
        model.threads = saved


CONFIGS = Path(__file__).resolve().parent / "configs"


def random_weights_model(config_dir: Path, dtype: str, device: str):
    """An HFModel of the architecture in ``config_dir`` with random weights (same cost per forward)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dsi.models.hf import HFModel, torch_dtype

    config = AutoConfig.from_pretrained(config_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype))
    return HFModel(model, name=f"{config_dir.name} (random weights)")


def ideal_seconds(method, k, servers, drafter_lat, target_lat, patterns) -> float:
    """Sum over prompts of the event simulator's time for this configuration (no engine costs)."""
    total = 0.0
    for pattern in patterns:
        total += simulate(
            method, target_ttft=target_lat["prefill"], target_tpot=target_lat[k + 1],
            drafter_ttft=drafter_lat["prefill"], drafter_tpot=drafter_lat[1],
            lookahead=k, num_servers=servers, matches=pattern,
        ).mean
    return total


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
    p.add_argument("--repeats", type=int, default=3, help="runs per prompt and method; times are medians")
    p.add_argument("--si-k", type=int, nargs="+", default=[4, 6, 8])
    p.add_argument("--dsi-k", type=int, nargs="+", default=[3, 5])
    p.add_argument("--dsi-sp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--no-ideal", action="store_true", help="skip the latency measurements and the ideal")
    p.add_argument("--threads", type=int, default=2, help="torch threads of non-SI, SI and assisted generation")
    p.add_argument("--dsi-threads", type=int, default=1, help="torch threads per DSI worker")
    p.add_argument("--no-assisted", action="store_true")
    p.add_argument("--out")
    p.add_argument("--record", metavar="FILE", help="save the pair's greedy decisions for --replay")
    p.add_argument("--replay", metavar="FILE", help="replay a --record file on random-weight models of the "
                                                    "recorded pair's architectures (benchmarks/configs/NAME)")
    args = p.parse_args()

    if args.replay:
        recordings, meta = load_recording(args.replay)
        names = (meta.get("target", args.target), meta.get("drafter", args.drafter))
        models = [random_weights_model(CONFIGS / name, args.dtype, args.device) for name in names]
        target, drafter = replay_pair(*models, recordings)
        prompts = [list(r.prompt) for r in recordings]
        args.tokens = min(len(r.target) for r in recordings)
        args.no_assisted = True
        print(f"replaying {args.replay}: {len(prompts)} prompts x {args.tokens} tokens of {names[0]} / {names[1]} "
              "on random-weight models", file=sys.stderr)
    else:
        target, drafter = load_pair(args.target, args.drafter, dtype=args.dtype, device=args.device, progress=True)
        prompts = [target.encode(t) for t in CODE_PROMPTS[: args.prompts]]
    placement = (("devices", args.target_devices),) if args.target_devices else ()
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
    if not args.replay and (args.record or not args.no_ideal):
        recordings = [record_decisions(drafter, ids, res["non-SI"].tokens) for ids, res in zip(prompts, results,
                                                                                                  strict=True)]
    if args.record:
        save_recording(args.record, recordings, {"target": args.target, "drafter": args.drafter,
                                                 "dtype": args.dtype, "prompts": "CODE_PROMPTS"})
    latencies = {}
    if not args.no_ideal:
        patterns = [r.accept_pattern for r in recordings]
        sizes = sorted({k + 1 for k in args.si_k + args.dsi_k})
        for threads in sorted({args.threads, args.dsi_threads}):
            latencies[threads] = {
                "drafter": worker_latencies(drafter, prompts[0], threads, [1]),
                "target": worker_latencies(target, prompts[0], threads, [1] + sizes, repeats=3),
            }
        for config in configs:
            if config.method == "ar":
                continue
            lat = latencies[config.threads]
            ideal = ideal_seconds(config.method, config.lookahead, config.servers, lat["drafter"], lat["target"],
                                  patterns)
            rows[config.label]["ideal_s"] = ideal
            rows[config.label]["engine_over_ideal"] = rows[config.label]["total_s"] / ideal
        n = args.tokens * len(prompts)
        drafter_alone = n * latencies[args.dsi_threads]["drafter"][1]
        print(f"pattern acceptance {sum(map(sum, patterns)) / sum(map(len, patterns)):.3f}; drafter alone on "
              f"{args.dsi_threads} thread(s): {drafter_alone:.2f} s for {n} tokens (the floor of DSI's time "
              f"when the drafter has {args.dsi_threads} thread(s))")
        for threads, lat in latencies.items():
            cells = ", ".join(f"target n={k} {v * 1e3:.0f} ms" for k, v in lat["target"].items() if k != "prefill")
            print(f"{threads} thread(s): drafter step {lat['drafter'][1] * 1e3:.0f} ms, {cells}")
    base = rows["non-SI"]["total_s"]
    best = lambda m: min((r for r in rows.values() if r["method"] == m), key=lambda r: r["total_s"])
    best_si, best_dsi = best("si"), best("dsi")
    print(f"{'method':<18} {'total s':>8} {'tok/s':>6} {'vs non-SI':>9} {'vs best SI':>10} {'accept':>6} "
          f"{'ideal s':>8} {'eng/ideal':>9} identical")
    for label, r in rows.items():
        n = args.tokens * len(prompts)
        ideal = f"{r['ideal_s']:8.2f} {r['engine_over_ideal']:9.2f}" if "ideal_s" in r else f"{'-':>8} {'-':>9}"
        print(f"{label:<18} {r['total_s']:8.2f} {n / r['total_s']:6.2f} {base / r['total_s']:8.2f}x "
              f"{best_si['total_s'] / r['total_s']:9.2f}x {r.get('acceptance_rate', 0):6.2f} {ideal} "
              f"{'yes' if r['identical'] else 'NO'}")
    report = {
        "machine": {"python": platform.python_version(), "cpus": torch.get_num_threads(),
                    "torch": torch.__version__, "platform": platform.platform()},
        "config": vars(args), "rows": rows,
        "latencies_s": {str(t): {w: {str(n): v for n, v in d.items()} for w, d in lat.items()}
                        for t, lat in latencies.items()},
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
