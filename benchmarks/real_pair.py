"""Real-model benchmark: non-SI, SI, DSI and transformers' assisted generation on one pair.

Greedy decoding of several code prompts with the embedded Qwen2.5-Coder 1.5B (target) / 0.5B
(drafter) pair, or any pair given with --target/--drafter. Every method runs in this one
process, one after another; SI and DSI try a few lookaheads, DSI also server counts and
placements (target servers as threads of this process, or as processes of their own). Each time
is the median over --repeats runs. Outputs are checked to be identical to non-SI's. Prints a table
and writes JSON (--out), rewritten after every configuration so that a run cut short keeps what
it measured.

Every SI and DSI row also gets an *ideal*: the time the event simulator (dsi.sim.events)
predicts for that configuration from latencies measured here, each worker alone (prefill, one
drafter step, one target forward over k+1 tokens), and from the exact greedy accept pattern of
each prompt. "engine/ideal" is the measured time over that prediction: engine overhead, the GIL
and whatever the workers' sharing of hardware costs (the simulator gives every worker its own).
Next to it, each DSI row reports the mean target forward and drafter step *as they ran* in that
configuration (from the engine's telemetry), so the cost of running concurrently is visible, and,
on a GPU, the device's utilisation during the timed runs (NVML, sampled every 50 ms).

    python benchmarks/real_pair.py --tokens 64 --prompts 3 --repeats 3 --out results/real_pair.json

DSI placements: ``--dsi TRANSPORT:KS:SPS[:THREADS]`` (repeatable), e.g. ``--dsi processes:3,5,auto:1,2,4``
runs k in {3, 5, event-driven} x SP in {1, 2, 4} with each target server in its own process
(THREADS: torch threads per server process). Without --dsi, ``--dsi-k``/``--dsi-sp`` give thread
placements. ``--auto`` adds method="auto"'s pick (dsi.evaluate.autotune) and how close it is to the fastest.

Replay, for machines that cannot load the pair (no registry access, e.g. a lent GPU box):
``--record FILE`` saves each prompt's non-SI output and the drafter's greedy guess at every
prefix of it (a few KB); ``--replay FILE`` then runs models of the same architecture with random
weights (configs in benchmarks/configs/) whose greedy choices are the recorded ones
(dsi.models.emulated.replay), so every forward costs what the real pair's would and every accept/reject
is the real pair's. ``--target-config NAME`` replays the same decisions on another target
architecture (a larger one of the same tokenizer family, e.g. qwen2.5-14b-instruct). transformers'
assisted generation is skipped in replay mode.

    python benchmarks/real_pair.py --record benchmarks/recordings/qwen-coder-code.json ...
    python benchmarks/real_pair.py --replay benchmarks/recordings/qwen-coder-code.json --device cuda:0 \\
        --target-devices cuda:0 --dsi processes:3,5:1,2,4 --dsi threads:5:1,2

``--dry-run``: a tiny random pair for ``--backend`` (fp32; with ``--replay``, the recorded architectures at two
layers of width 32), 2 prompts x 6 tokens, SI k = 2 and DSI k in {2, event-driven}, one repeat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from _common import add_options, machine, median_seconds, parse, shrink, tiny_configs, tiny_pair, write_json

from dsi.evaluate.compare import CODE_PROMPTS, NEAR_TIE_MARGIN, MethodConfig, first_divergence, iter_compare
from dsi.models.loading import load_pair
from dsi.models.emulated.replay import (
    ReplayRecipe,
    load_recording,
    random_weights_model,
    record_decisions,
    recorded_choices,
    replay_pair,
    save_recording,
)
from dsi.sim.events import simulate

CONFIGS = Path(__file__).resolve().parent / "configs"


def worker_latencies(model, prompt, threads: int, sizes, repeats: int = 5) -> dict:
    """Median seconds of a prefill over ``prompt`` and of one forward of n tokens after it, for n
    in ``sizes``, on ``threads`` torch threads (what one worker of that configuration sees alone).
    Forwards ask for what the engine asks for in greedy decoding: the argmax of the rows decided."""
    from dsi.models.base import extend_rows

    saved, model.threads = model.threads, threads
    session = model.new_session()
    try:
        def prefill():
            session.truncate(0)
            extend_rows(session, prompt, None, 1, greedy=True)

        out = {"prefill": median_seconds(prefill, 2)}
        for n in sizes:
            def forward(n=n):
                extend_rows(session, prompt[:n] if len(prompt) >= n else [prompt[-1]] * n, None, n, greedy=True)
                session.truncate(len(prompt))

            forward()  # warm-up at this size
            out[n] = median_seconds(forward, repeats)
        return out
    finally:
        session.close()
        model.threads = saved


class GpuUtilisation:
    """Samples the GPU's utilisation (NVML, through torch) every ``period`` s on a thread, with
    timestamps, so that the mean over any time spans can be taken afterwards. Inert without NVML."""

    def __init__(self, device: str, period: float = 0.05) -> None:
        self.samples: list[tuple[float, float]] = []
        self.available = False
        self._stop = threading.Event()
        dev = torch.device(device)
        if dev.type != "cuda":
            return
        try:
            torch.cuda.utilization(dev)
        except Exception as exc:  # no pynvml / NVML
            print(f"GPU utilisation not sampled: {type(exc).__name__}: {exc}", file=sys.stderr)
            return
        self.available = True
        self._thread = threading.Thread(target=self._run, args=(dev, period), daemon=True)
        self._thread.start()

    def _run(self, dev, period: float) -> None:
        while not self._stop.wait(period):
            try:
                self.samples.append((time.perf_counter(), float(torch.cuda.utilization(dev))))
            except Exception:
                return

    def mean_over(self, spans) -> float | None:
        inside = [u for t, u in self.samples if any(a <= t <= b for a, b in spans)]
        return statistics.mean(inside) if inside else None

    def stop(self) -> None:
        self._stop.set()


def ideal_seconds(method, k, servers, drafter_lat, target_lat, patterns, window: float = 1.0) -> float:
    """Sum over prompts of the event simulator's time for this configuration (no engine costs).

    A verification costs the forward measured over k + 1 tokens (event-driven windows: over the
    measured size nearest to the run's mean window + 1)."""
    rows = k + 1 if isinstance(k, int) else 1 + window
    sizes = [n for n in target_lat if n != "prefill"]
    tpot = target_lat[min(sizes, key=lambda n: abs(n - rows))]
    total = 0.0
    for pattern in patterns:
        total += simulate(
            method, target_ttft=target_lat["prefill"], target_tpot=tpot,
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


def near_tie_margin(backend: str, dtype: str | None) -> float:
    """The largest logit gap at a greedy departure that counts as a numerical near-tie (dsi demo's rule)."""
    return NEAR_TIE_MARGIN.get("llama.cpp" if backend == "llama.cpp" else dtype, 1e-3)


def divergences(target, prompts, references, outputs, tie: float) -> dict:
    """``{"divergence": [...], "near_tie": bool}`` for the prompts whose ``outputs`` depart from
    ``references`` (non-SI's greedy tokens): where each departs, the target's logit margin there
    (dsi.evaluate.compare.first_divergence), and whether every departure is within ``tie`` of a tie."""
    found = [{"prompt": i, **(first_divergence(target, prompts[i], ref, out) or {})}
             for i, (ref, out) in enumerate(zip(references, outputs, strict=True)) if list(out) != list(ref)]
    return {"divergence": found,
            "near_tie": all(d.get("margin") is not None and abs(d["margin"]) <= tie for d in found)}


def parse_dsi_spec(spec: str) -> tuple[str, list[int], list[int], int | None, int | None]:
    """``TRANSPORT:KS:SPS[:THREADS[:DRAFTER_THREADS]]`` -> (transport, lookaheads, server counts,
    torch threads per server process, torch threads of the drafter)."""
    parts = spec.split(":")
    try:
        if len(parts) not in (3, 4, 5) or parts[0] not in ("threads", "processes", "ray"):
            raise ValueError
        ks = [x if x == "auto" else int(x) for x in parts[1].split(",")]
        sps = [int(x) for x in parts[2].split(",")]
        threads = int(parts[3]) if len(parts) >= 4 and parts[3] else None
        drafter_threads = int(parts[4]) if len(parts) == 5 else None
        if min([k for k in ks if k != "auto"] + sps + [threads or 1, drafter_threads or 1]) < 1:
            raise ValueError
    except ValueError:
        raise SystemExit(f"--dsi {spec!r}: expected TRANSPORT:KS:SPS[:THREADS[:DRAFTER_THREADS]] with TRANSPORT "
                         "threads, processes or ray and positive integers, e.g. processes:3,5:1,2,4") from None
    return parts[0], ks, sps, threads, drafter_threads


def median_of(runs, key: str) -> float | None:
    values = [s[key] for run in runs for s in run.all_stats if s.get(key)]
    return statistics.median(values) if values else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--backend", default="hf", choices=["hf", "llama.cpp"],
                   help="hf (transformers, --dtype) or llama.cpp (the GGUF's own weights, CPU; no assisted row)")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--device", default="cpu", help="device of the drafter (and of the target for non-SI/SI)")
    p.add_argument("--target-devices", nargs="+", default=None,
                   help="one device per DSI target server, e.g. cuda:1 cuda:2 (GPU machines)")
    p.add_argument("--tokens", type=int, default=None, help="new tokens per prompt (default 64; replay: the "
                                                              "recorded length, or fewer if given)")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="runs per prompt and method; times are medians")
    p.add_argument("--si-k", type=int, nargs="+", default=[4, 6, 8])
    p.add_argument("--dsi-k", type=int, nargs="+", default=[3, 5])
    p.add_argument("--dsi-sp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--dsi", action="append", metavar="TRANSPORT:KS:SPS[:THREADS[:DRAFTER_THREADS]]",
                   help="DSI placements to run (repeatable); default threads:DSI_K:DSI_SP. THREADS: torch "
                        "threads per server process; DRAFTER_THREADS: the drafter's (default --dsi-threads)")
    p.add_argument("--no-ideal", action="store_true", help="skip the latency measurements and the ideal")
    p.add_argument("--latency-threads", type=int, nargs="*", default=[], metavar="N",
                   help="also measure each worker alone on these torch thread counts (thread scaling)")
    p.add_argument("--threads", type=int, default=2, help="threads (torch or llama.cpp) of non-SI, SI and "
                                                          "assisted generation")
    p.add_argument("--dsi-threads", type=int, default=1,
                   help="threads of the DSI drafter and of thread-placed target servers")
    p.add_argument("--no-assisted", action="store_true")
    p.add_argument("--deadline", type=float, default=None, metavar="S",
                   help="start no new configuration after S seconds (the rest is reported as skipped)")
    p.add_argument("--no-gpu-utilisation", action="store_true", help="do not sample the GPU's utilisation (NVML)")
    p.add_argument("--auto", action="store_true",
                   help="also run method='auto' (dsi.evaluate.autotune: measured here once, then cached) next to the fixed "
                        "methods, and report how close its pick is to the fastest of them")
    p.add_argument("--retune", action="store_true", help="with --auto: measure the choice again")
    p.add_argument("--kv-cache", choices=["dynamic", "static"], default="dynamic",
                   help="hf: every model's KV cache (dsi.models.hf.forward_plan)")
    p.add_argument("--cuda-graphs", action="store_true", help="hf: captured CUDA graphs (implies --kv-cache static)")
    add_options(p, "a tiny random pair, 2 prompts x 6 tokens, SI k=2, DSI k in {2, auto} on threads, one repeat")
    p.add_argument("--record", metavar="FILE", help="save the pair's greedy decisions for --replay")
    p.add_argument("--replay", metavar="FILE", help="replay a --record file on random-weight models of the "
                                                    "recorded pair's architectures (benchmarks/configs/NAME)")
    p.add_argument("--target-config", metavar="NAME", help="replay: the target's architecture (default: the "
                                                           "recorded target's)")
    p.add_argument("--configs-dir", default=str(CONFIGS), help="replay: where architectures live (NAME/config.json)")
    args = parse(p)
    if shrink(args, tokens=6, prompts=2, repeats=1, si_k=[2], dsi=args.dsi or ["threads:2,auto:1"]):
        if args.replay:
            args.configs_dir = str(tiny_configs())
        else:
            args.target, args.drafter = tiny_pair(args.backend)
        args.dtype = "fp32"
    began = time.perf_counter()
    specs = [parse_dsi_spec(s) for s in args.dsi] if args.dsi else [("threads", args.dsi_k, args.dsi_sp, None, None)]
    if any(t == "processes" for t, *_ in specs) and not args.replay:
        print("note: process-placed servers reload the model from its source directory", file=sys.stderr)

    recipe = None
    plan = None
    if args.backend == "hf" and (args.cuda_graphs or args.kv_cache == "static"):
        from dsi.models.hf.forward_plan import ForwardPlan

        plan = ForwardPlan("static", cuda_graphs=args.cuda_graphs)
    if args.replay:
        recordings, meta = load_recording(args.replay)
        names = (args.target_config or meta.get("target", args.target), meta.get("drafter", args.drafter))
        configs_dir = Path(args.configs_dir)
        models = [random_weights_model(configs_dir / name, args.dtype, args.device, seed=i, forward_plan=plan)
                  for i, name in enumerate(names)]
        target, drafter = replay_pair(*models, recordings)
        recipe = ReplayRecipe(str((configs_dir / names[0]).resolve()), recorded_choices(recordings)[0],
                              args.dtype, args.device, vocab_size=target.vocab_size, forward_plan=plan)
        recordings = recordings[: args.prompts]
        prompts = [list(r.prompt) for r in recordings]
        recorded = min(len(r.target) for r in recordings)
        args.tokens = recorded if args.tokens is None else min(args.tokens, recorded)
        recordings = [type(r)(r.prompt, r.target[: args.tokens], r.drafter[: args.tokens]) for r in recordings]
        args.no_assisted = True
        print(f"replaying {args.replay}: {len(prompts)} prompts x {args.tokens} tokens of {meta.get('target')} / "
              f"{names[1]} on random-weight models of {names[0]} / {names[1]} (vocabularies "
              f"{models[0].vocab_size} / {models[1].vocab_size}; recorded ids all < {target.vocab_size})",
              file=sys.stderr)
    else:
        args.tokens = 64 if args.tokens is None else args.tokens
        llama = args.backend == "llama.cpp"
        if llama:  # llama.cpp runs the GGUF's own weights on the CPU; transformers' assisted generation needs HF
            args.dtype, args.no_assisted = None, True
        target, drafter = load_pair(args.target, args.drafter, backend=args.backend,
                                    dtype=None if llama else args.dtype, device=None if llama else args.device,
                                    progress=True, forward_plan=plan)
        prompts = [target.encode(t) for t in CODE_PROMPTS[: args.prompts]]
        names = (args.target, args.drafter)

    configs = [MethodConfig("ar", threads=args.threads)]
    configs += [MethodConfig("si", k, threads=args.threads) for k in args.si_k]
    for transport, ks, sps, server_threads, drafter_threads in specs:
        options: dict = {}
        if args.target_devices:
            options["devices"] = args.target_devices
        if transport != "threads":
            if recipe is not None:
                options["recipe"] = recipe
            if server_threads is not None:
                options["threads_per_server"] = server_threads
        configs += [MethodConfig("dsi", k, sp, threads=drafter_threads or args.dsi_threads, transport=transport,
                                 transport_options=tuple(options.items()))
                    for sp in sps for k in ks]  # k innermost: those configs share one pool

    choice = None
    if args.auto:
        from dsi.evaluate.autotune import choose_method

        dsi_servers = max((sp for _, _, sps, *_ in specs for sp in sps), default=1)
        first = next(c for c in configs if c.method == "dsi")  # auto places DSI as the first --dsi spec does
        options = dict(first.transport_options)
        choice = choose_method(target, drafter, transport=first.transport, transport_options=options,
                               max_servers=dsi_servers, refresh=args.retune,
                               progress=lambda m: print(f"[auto] {m}", file=sys.stderr, flush=True))
        picked = MethodConfig(choice.method, choice.lookahead, choice.num_target_servers,
                              threads=args.threads if choice.method != "dsi" else args.dsi_threads,
                              transport=first.transport if choice.method == "dsi" else "threads",
                              transport_options=first.transport_options if choice.method == "dsi" else ())
        if picked.label not in {c.label for c in configs}:
            configs.append(picked)

    report: dict = {
        "machine": machine(),
        "config": {**vars(args), "pair": list(names)}, "rows": {}, "skipped": [],
    }

    def add_ideal(row: dict) -> None:
        server_threads = row.get("server_threads") or row["threads"]
        row["ideal_s"] = ideal_seconds(row["method"], row["lookahead"], row["servers"],
                                       latencies[row["threads"]]["drafter"], latencies[server_threads]["target"],
                                       patterns, row.get("mean_window") or 1.0)
        row["engine_over_ideal"] = row["total_s"] / row["ideal_s"]

    def write() -> None:
        write_json(args.out, report)

    # latencies alone first: the ideal needs them, and a run cut short still has them
    latencies: dict = {}
    patterns = None
    if not args.no_ideal:
        if args.replay:
            patterns = [r.accept_pattern for r in recordings]
        sizes = sorted({k + 1 for k in args.si_k} | {k + 1 for _, ks, *_ in specs for k in ks if k != "auto"})
        thread_counts = {args.threads, args.dsi_threads, *args.latency_threads}
        thread_counts |= {t for spec in specs for t in spec[3:] if t is not None}
        for threads in sorted(thread_counts):
            latencies[threads] = {
                "drafter": worker_latencies(drafter, prompts[0], threads, [1]),
                "target": worker_latencies(target, prompts[0], threads, [1] + sizes, repeats=3),
            }
        report["latencies_s"] = {str(t): {w: {str(n): v for n, v in d.items()} for w, d in lat.items()}
                                 for t, lat in latencies.items()}
        for threads, lat in latencies.items():
            cells = ", ".join(f"n={k} {v * 1e3:.1f} ms" for k, v in lat["target"].items() if k != "prefill")
            print(f"alone, {threads} thread(s): drafter step {lat['drafter'][1] * 1e3:.1f} ms; target {cells}",
                  file=sys.stderr)
        write()

    gpu = GpuUtilisation("cpu" if args.no_gpu_utilisation else args.device)
    total_runs = len(configs) * len(prompts) * args.repeats
    done = 0

    def tick():
        nonlocal done
        done += 1
        print(f"\r{done}/{total_runs} runs", end="", file=sys.stderr, flush=True)

    results: list[dict] = [{} for _ in prompts]
    runner = iter_compare(target, drafter, prompts, configs, max_new_tokens=args.tokens, repeats=args.repeats,
                          fresh_warmup_tokens=args.tokens,
                          eos_token_id=None, progress=tick)
    try:
        for index, (config, runs) in enumerate(runner):
            for i, run in enumerate(runs):
                results[i][config.label] = run
            row = {
                "method": config.method, "lookahead": config.lookahead, "servers": config.servers,
                "transport": config.transport, "threads": config.threads,
                "server_threads": dict(config.transport_options).get("threads_per_server"),
                "total_s": sum(r.median_s for r in runs), "per_prompt_s": [r.median_s for r in runs],
                "identical": all(r.tokens == res["non-SI"].tokens for r, res in zip(runs, results, strict=True)),
                "acceptance_rate": statistics.mean(r.stats.get("acceptance_rate", 0.0) for r in runs),
                "preempted_tasks": sum(r.stats.get("preempted_tasks", 0) for r in runs),
                "target_forward_in_run_s": median_of(runs, "mean_target_forward_s"),
                "drafter_forward_in_run_s": median_of(runs, "mean_drafter_forward_s"),
                "mean_window": median_of(runs, "mean_window"),
                "gpu_utilisation_pct": gpu.mean_over([s for r in runs for s in r.spans]) if gpu.available else None,
            }
            if not row["identical"]:  # where, and how close the target's two best tokens were there
                row.update(divergences(target, prompts, [res["non-SI"].tokens for res in results],
                                       [r.tokens for r in runs], near_tie_margin(args.backend, args.dtype)))
            if patterns is not None and latencies and config.method != "ar":
                add_ideal(row)
            report["rows"][config.label] = row
            write()
            remaining = configs[index + 1:]
            if args.deadline is not None and remaining and time.perf_counter() - began > args.deadline:
                report["skipped"] = [c.label for c in remaining]
                print(f"\ndeadline of {args.deadline:.0f} s reached: skipping {', '.join(report['skipped'])}",
                      file=sys.stderr)
                break
    finally:
        runner.close()
        gpu.stop()
    print(file=sys.stderr)
    rows = report["rows"]
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
        patterns = [r.accept_pattern for r in recordings]
        for row in rows.values():
            if latencies and row["method"] in ("si", "dsi"):
                add_ideal(row)
    if args.record:
        save_recording(args.record, recordings, {"target": args.target, "drafter": args.drafter,
                                                 "dtype": args.dtype, "prompts": "CODE_PROMPTS"})
    n = args.tokens * len(prompts)
    if patterns:
        accept = sum(map(sum, patterns)) / sum(map(len, patterns))
        floor = n * latencies[args.dsi_threads]["drafter"][1] if latencies else None
        print(f"pattern acceptance {accept:.3f}" + (f"; drafter alone: {floor:.2f} s for {n} tokens (DSI's floor)"
                                                     if floor else ""))
    base = rows["non-SI"]["total_s"]
    best = lambda m: min((r for r in rows.values() if r["method"] == m), key=lambda r: r["total_s"], default=None)
    best_si, best_dsi = best("si"), best("dsi")
    ms = lambda v: f"{v * 1e3:6.1f}" if v else f"{'-':>6}"
    print(f"{'method':<32} {'total s':>8} {'tok/s':>6} {'vs non-SI':>9} {'vs best SI':>10} {'accept':>6} "
          f"{'ideal s':>8} {'eng/ideal':>9} {'tgt ms':>6} {'dft ms':>6} {'GPU %':>5} identical")
    for label, r in rows.items():
        ideal = f"{r['ideal_s']:8.2f} {r['engine_over_ideal']:9.2f}" if "ideal_s" in r else f"{'-':>8} {'-':>9}"
        util = r.get("gpu_utilisation_pct")
        vs_si = f"{best_si['total_s'] / r['total_s']:9.2f}x" if best_si else f"{'-':>10}"
        print(f"{label:<32} {r['total_s']:8.2f} {n / r['total_s']:6.2f} {base / r['total_s']:8.2f}x {vs_si} "
              f"{r.get('acceptance_rate', 0):6.2f} {ideal} {ms(r.get('target_forward_in_run_s'))} "
              f"{ms(r.get('drafter_forward_in_run_s'))} {f'{util:5.0f}' if util is not None else '    -'} "
              f"{'yes' if r['identical'] else ('≈ near-tie' if r.get('near_tie') else 'NO')}")
    if report["skipped"]:
        print(f"skipped (deadline): {', '.join(report['skipped'])}")
    report.update({
        "best_si": best_si, "best_dsi": best_dsi,
        "dsi_vs_si": best_si["total_s"] / best_dsi["total_s"] if best_si and best_dsi else None,
        "dsi_vs_nonsi": base / best_dsi["total_s"] if best_dsi else None,
        "dsi_vs_hf_assisted": rows["HF assisted"]["total_s"] / best_dsi["total_s"]
        if "HF assisted" in rows and best_dsi else None,
        "wall_s": time.perf_counter() - began,
    })
    if choice is not None:
        label = choice.label if choice.label in rows else next((k for k in rows if k.startswith(choice.label)), None)
        fastest = min((r for k, r in rows.items() if r["method"] != "hf-assisted"), key=lambda r: r["total_s"])
        report["auto"] = {**choice.to_dict(), "row": label,
                          "auto_over_fastest": rows[label]["total_s"] / fastest["total_s"] if label else None}
        print(f"auto picked {choice.label} ({'cached' if choice.cached else f'measured in {choice.calibration_s:.0f} s'}"
              f"): {rows[label]['total_s']:.2f} s, {report['auto']['auto_over_fastest']:.3f}x the fastest row "
              f"here; {choice.reason}")
    write()
    print(json.dumps({k: report[k] for k in ("dsi_vs_si", "dsi_vs_nonsi", "dsi_vs_hf_assisted")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
