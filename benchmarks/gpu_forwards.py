"""What one forward costs on a device against what its weights allow: eager forwards on the dynamic cache, on the
static cache, and captured CUDA graphs (issue 51; part of benchmarks/gpu_check.sh).

For each architecture (random weights of ``benchmarks/configs/NAME``, built on the device) after a prefix of 128
cached tokens: the median time of a forward of 1 token (a drafter step, non-SI) and of ``--tokens`` tokens (a
verification), each run from the prefix again, per forward plan (the static ones at their default length, 4,096
positions, of which a forward attends over its span: models/hf_static.py); the weights' read time at the bandwidth measured
in the same run (a device-to-device copy of ``--copy-gb``: read and write, so bytes x 2 over its time); and, with
graphs, the first forward of each size (one eager warm-up forward and the capture) as the capture time, and the
replay of each graph alone (the device's part of a forward; the rest is the host's). On the
graphs plan, a sampled and a penalised greedy verification, and a drafter's step with its draw, decided on the
host and on the device (models/hf/device_laws.py).

    python benchmarks/gpu_forwards.py --config qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct \\
        qwen2.5-14b-instruct --device cuda:0 --dtype bf16

Prints a table and one JSON line (``--out`` writes it too). On a CPU the graphs fall back to eager forwards (the
static cache's padded shapes), and the bandwidth is the host memory's. ``--dry-run``: the 0.5B drafter's
architecture at two layers of width 32 (benchmarks/tiny_configs.py), 2 repeats, a copy of 10 MB.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path

from _common import add_options, emit, parse, shrink, timed, tiny_configs

CONFIGS = Path(__file__).resolve().parent / "configs"
PREFIX = 128
PLANS = ("dynamic", "static", "graphs")


def bandwidth(device: str, gigabytes: float) -> float:
    """Bytes a second a device-to-device copy moves (read plus write), median of 5."""
    import torch

    n = int(gigabytes * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    seconds = statistics.median(timed(lambda: dst.copy_(src), 6, device)[1:])
    return 2 * n * 2 / seconds


def measure(config_dir: Path, device: str, dtype: str, tokens: int, repeats: int) -> dict:
    from dsi.models.base import forward_rows
    from dsi.models.hf.forward_plan import ForwardPlan
    from dsi.models.emulated.replay import random_weights_model

    # the static plans at their default cache length (DEFAULT_KV_CACHE_LEN positions), as a user gets them
    plans = {"dynamic": ForwardPlan(), "static": ForwardPlan("static"), "graphs": ForwardPlan("static", cuda_graphs=True)}
    model = random_weights_model(config_dir, dtype, device)
    weights = sum(p.numel() * p.element_size() for p in model.model.parameters())
    vocab = model.vocab_size
    prefix = [(7 * i + 3) % vocab for i in range(PREFIX)]
    row: dict = {"config": config_dir.name, "weights_gb": weights / 1e9, "plans": {}}
    for name in PLANS:
        model.forward_plan = plans[name]
        session = model.new_session()
        forward_rows(session, prefix, 1)
        result = {}
        for n in (1, tokens):
            new = [(5 * i + 1) % vocab for i in range(n)]

            def once(new=new, n=n):
                session.truncate(PREFIX)
                forward_rows(session, prefix + new, n, greedy=True)

            first, *rest = timed(once, repeats + 1, device)  # the first: warm-up (with graphs: and the capture)
            result[f"{n}_ms"] = 1e3 * statistics.median(rest)
            result[f"first_{n}_ms"] = 1e3 * first
        if name == PLANS[-1]:
            result.update(sampled_verification(model, session, prefix, tokens, min(repeats, 10), device))
        graphs = getattr(session, "_graphs", None)
        result["captured"] = graphs.captures if graphs is not None else 0
        if result["captured"]:
            result.update(replay_ms(graphs, tokens, repeats, device))
        row["plans"][name] = result
        session.close()  # its cache and graphs go
    return row


def replay_ms(graphs, tokens: int, repeats: int, device: str) -> dict:
    """The device's time of the graphs a forward of 1 and of ``tokens`` tokens after the prefix replayed (the
    replay alone, on the inputs its last forward left): a forward's time less it is the host's part of it
    (making the inputs, the copies in and out, the engine's Python)."""
    from dsi.models.hf.forward_plan import padded_size

    out = {}
    for n in (1, tokens):
        size = padded_size(n, True)
        spans = [span for (s, span) in graphs._graphs if s == size]
        if spans:
            graph = graphs._graphs[(size, min(spans))].graph  # the first span: where a forward after the prefix is
            out[f"replay_{n}_ms"] = 1e3 * statistics.median(timed(graph.replay, repeats + 1, device)[1:])
    return out


def sampled_verification(model, session, prefix: list[int], tokens: int, repeats: int, device: str) -> dict:
    """A verification of ``tokens`` rows decided on the host (the rows cross, numpy processes them) and on the
    device (models/hf/device_laws.py: a few numbers cross): sampled (T 0.7, top_k 20, top_p 0.8, its drafts' drafter
    probabilities with it) and greedy with a repetition penalty; and a drafter's one-token step with its sampled
    draw (the same sampling; on the device only the token and its probability cross); and the sampled
    verification with ``logprobs=5`` (raw; on the device each row's top 5 and its draft's logprob cross).
    Forward and decisions, median ms."""
    from dataclasses import replace

    from dsi.logprobs import LogprobsRead
    from dsi.models.base import forward_rows
    from dsi.sampling import ChainRead, DraftRead, GreedyRead, SamplingParams

    vocab = model.vocab_size
    context = tuple(prefix + [(5 * i + 1) % vocab for i in range(tokens)])
    # Qwen2.5-Instruct's sampling: with top_k first, random weights' flat rows cost what a trained model's would
    nucleus = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=1)
    reads = {"sampled": (ChainRead(context, nucleus, PREFIX, frozenset(), (0.5,) * (tokens - 1)), tokens),
             "penalised": (GreedyRead(context, SamplingParams(repetition_penalty=1.2), PREFIX), tokens),
             "draft": (DraftRead(context[: PREFIX + 1], nucleus, PREFIX), 1),  # a drafter's step and its draw
             "logprobs": (LogprobsRead(ChainRead(context, nucleus, PREFIX, frozenset(), (0.5,) * (tokens - 1)),
                                       "raw", 5), tokens)}  # the sampled verification with logprobs=5
    plan = model.forward_plan
    out = {}
    for kind, (read, rows) in reads.items():
        for label, on_device in (("host", False), ("device", True)):
            model.forward_plan = replace(plan, device_decisions=on_device)

            def once(read=read, rows=rows):
                session.truncate(PREFIX)
                forward_rows(session, context if rows > 1 else read.tokens, rows, read=read)

            _, *rest = timed(once, repeats + 1, device)
            out[f"{kind}_{label}_ms"] = 1e3 * statistics.median(rest)
    model.forward_plan = plan
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", nargs="+", default=["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"])
    parser.add_argument("--configs-dir", default=str(CONFIGS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--tokens", type=int, default=5, help="a verification's tokens (default 5: k = 4)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--copy-gb", type=float, default=2.0, help="the bandwidth copy's size (default 2 GiB)")
    add_options(parser, "the 0.5B drafter's architecture at 2 layers of width 32, 2 repeats, a 10 MB copy")
    args = parse(parser)
    if shrink(args, config=["qwen2.5-coder-0.5b-instruct"], repeats=2, copy_gb=0.01):
        args.configs_dir = str(tiny_configs())
    speed = bandwidth(args.device, args.copy_gb)
    rows = []
    for name in args.config:
        try:
            rows.append(measure(Path(args.configs_dir) / name, args.device, args.dtype, args.tokens, args.repeats))
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: the other architectures still report
            print(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr)
            rows.append({"config": name, "error": f"{type(exc).__name__}: {exc}"})
        gc.collect()
    print(f"{args.device} {args.dtype}; copy bandwidth {speed / 1e9:.0f} GB/s; after {PREFIX} cached tokens; median "
          f"of {args.repeats}")
    print(f"| model | weights GB | read ms | plan | 1 token ms | x read | {args.tokens} tokens ms | first forwards ms "
          "(1, n) | graphs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['config']} | {row['error'][:60]} |||||||")
            continue
        read_ms = 1e3 * row["weights_gb"] * 1e9 / speed
        row["read_ms"] = read_ms
        for plan, r in row["plans"].items():
            print(f"| {row['config']} | {row['weights_gb']:.2f} | {read_ms:.2f} | {plan} | {r['1_ms']:.2f} | "
                  f"{r['1_ms'] / read_ms:.1f} | {r[f'{args.tokens}_ms']:.2f} | {r['first_1_ms']:.0f}, "
                  f"{r[f'first_{args.tokens}_ms']:.0f} | {r['captured']} |")
    print(f"\na {args.tokens}-row verification on the {PLANS[-1]} plan, forward and decisions, ms: rows to the host "
          "(numpy) | decided on the device; sampled (T 0.7, top_k 20, top_p 0.8), then greedy with a repetition "
          "penalty; then a one-token step with its sampled draw (the same sampling); then the sampled one with "
          "logprobs=5")
    for row in rows:
        if "error" not in row:
            last = row["plans"][PLANS[-1]]
            print(f"| {row['config']} | {last['sampled_host_ms']:.2f} | {last['sampled_device_ms']:.2f} | "
                  f"{last['penalised_host_ms']:.2f} | {last['penalised_device_ms']:.2f} | "
                  f"{last['draft_host_ms']:.2f} | {last['draft_device_ms']:.2f} | "
                  f"{last['logprobs_host_ms']:.2f} | {last['logprobs_device_ms']:.2f} |")
    emit({"benchmark": "gpu_forwards", "device": args.device, "dtype": args.dtype, "prefix": PREFIX,
          "tokens": args.tokens, "repeats": args.repeats, "bandwidth_gb_s": speed / 1e9, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
