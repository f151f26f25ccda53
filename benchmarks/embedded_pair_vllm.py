"""The embedded pair (Qwen2.5-Coder 1.5B target, 0.5B drafter; the hf checkpoints dsi converts from
the GGUF pair) through vLLM: greedy equality and what one verification costs.

1. The local non-SI greedy output (hf, fp32) of ``--prompts`` code prompts.
2. vLLM serving the target (fp32): SI (k = 4, the drafter here) verifying on it, and DSI (event-driven
   windows) verifying on it and drafting on a second vLLM serving the drafter: both must give the
   local non-SI tokens (up to near-ties between two engines' fp32 kernels, which are reported).
3. One verification (a window of k = 4 after ``--lengths`` tokens of context) on vLLM and on
   ``dsi serve --method ar`` (hf fp32) serving the same weights, one after the other.

Speed is not expected on 2 shared cores: the point is that the real pair runs exactly through the
engines, and what vLLM's skipped prefix cache costs on it.

    python benchmarks/embedded_pair_vllm.py --out docs/data/embedded_pair_vllm-2026-12-02.json

Needs the vLLM venv (``bash packaging/vllm-venv.sh``) and the embedded pair converted once
(``dsi generate --backend hf`` does it). Prints a table, then one JSON line. ``--dry-run``: a tiny random pair
(two layers of width 128: vLLM's CPU attention needs heads of 32 or more), 1 prompt x 4 tokens, a context of 16
tokens, one window.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from _common import add_options, emit, need_vllm, parse, shrink, tiny_pair

from tests.engine_servers import start_dsi_serve, start_vllm


def verify_cost(url: str, vocab: int, context: list[int], k: int, windows: int) -> float:
    """Median seconds of a window of k drafts after ``context`` (the prefill not counted)."""
    from dsi.models.engines.target import EngineTarget

    session = EngineTarget([url], vocab_size=vocab).new_session()
    try:
        session.extend_rows(context, None, 1, True)
        times = []
        for w in range(windows):
            session.truncate(len(context))
            drafts = [int(t) for t in context[w: w + k]]  # tokens of the text itself
            began = time.perf_counter()
            session.extend_rows(drafts, None, k + 1, True)
            times.append(time.perf_counter() - began)
        return statistics.median(times)
    finally:
        session.close()


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256])
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--windows", type=int, default=3)
    add_options(parser, "a tiny random pair (width 128), 1 prompt x 4 tokens, a 16-token context, one window")
    args = parse(parser)
    shrink(args, prompts=1, tokens=4, lengths=[16], windows=1)
    if not need_vllm():
        return 2
    import dsi
    from dsi.evaluate.compare import CODE_PROMPTS
    from dsi.models.engines.target import EngineTarget
    from dsi.models.hf.checkpoint import resolve_model_dir
    from dsi.models.loading import load_model, release

    if args.dry_run:
        target_dir, drafter_dir = tiny_pair(hidden=128)
    else:
        target_dir, drafter_dir = str(resolve_model_dir("default-target")), str(resolve_model_dir("default-drafter"))
    limit = 256 if args.dry_run else 1024  # the tiny pair's context (make_model_dir's positions)
    target = load_model(target_dir, dtype="fp32", backend="hf", progress=False)
    vocab = target.vocab_size
    prompts = [target.encode(p) for p in CODE_PROMPTS[: args.prompts]]
    text = target.encode(" ".join(CODE_PROMPTS) * 40)
    contexts = {n: text[:n] for n in args.lengths}
    began = time.perf_counter()
    reference = [dsi.generate(target=target, prompt=p, method="ar", max_new_tokens=args.tokens).tokens
                 for p in prompts]
    local_s = time.perf_counter() - began
    release(target)
    del target
    gc.collect()
    drafter = load_model(drafter_dir, role="drafter", dtype="fp32", backend="hf", progress=False)
    runs: dict = {"local non-SI": {"wall_s": local_s}}
    costs: dict = {}
    max_len = max(args.lengths) + 64
    engine = start_vllm(target_dir, name="target", max_model_len=max(limit, max_len))
    try:
        engines = EngineTarget([engine.url], vocab_size=vocab)
        began = time.perf_counter()
        si = [dsi.generate(target=engines, drafter=drafter, prompt=p, method="si", lookahead=args.k,
                           max_new_tokens=args.tokens, target_servers=True) for p in prompts]
        runs["SI over vLLM"] = {"wall_s": time.perf_counter() - began, "tokens": [r.tokens for r in si],
                                "first_difference": [first_difference(r.tokens, ref) for r, ref in zip(si, reference)],
                                "acceptance": statistics.mean(r.stats.acceptance_rate for r in si)}
        costs["vllm"] = {n: verify_cost(engine.url, vocab, c, args.k, args.windows) for n, c in contexts.items()}
        drafting = start_vllm(drafter_dir, name="drafter", max_model_len=limit)
        try:
            began = time.perf_counter()
            dsi_runs = [dsi.generate(target=engines, drafter=drafter, prompt=p, method="dsi", lookahead="auto",
                                     max_new_tokens=args.tokens, target_servers=True, drafter_server=drafting.url)
                        for p in prompts]
            runs["DSI over vLLM, drafter on vLLM"] = {
                "wall_s": time.perf_counter() - began, "tokens": [r.tokens for r in dsi_runs],
                "first_difference": [first_difference(r.tokens, ref) for r, ref in zip(dsi_runs, reference)],
                "acceptance": statistics.mean(r.stats.acceptance_rate for r in dsi_runs),
                "drafter_streams": sum(r.stats.extra.get("drafter_streams", 0) for r in dsi_runs)}
        finally:
            drafting.stop()
    finally:
        engine.stop()
    release(drafter)
    server = start_dsi_serve(target_dir)
    try:
        costs["dsi serve"] = {n: verify_cost(server.url, vocab, c, args.k, args.windows) for n, c in contexts.items()}
    finally:
        server.stop()
    print(f"embedded pair, fp32, {args.prompts} code prompts x {args.tokens} tokens; this 2-core machine")
    print("| run | wall (s) | same tokens as local non-SI | acceptance |")
    print("|---|---|---|---|")
    for name, r in runs.items():
        same = "-" if "tokens" not in r else (
            "yes" if r["tokens"] == reference else f"first difference at {r['first_difference']}")
        print(f"| {name} | {r['wall_s']:.1f} | {same} | {r.get('acceptance', float('nan')):.2f} |")
    print(f"\none verification (k={args.k}) after a context, median of {args.windows}")
    print("| context | vLLM (s) | dsi serve (s) | vLLM / dsi serve |")
    print("|---|---|---|---|")
    for n in args.lengths:
        v, d = costs["vllm"][n], costs["dsi serve"][n]
        print(f"| {n} | {v:.3f} | {d:.3f} | {v / d:.1f} |")
    emit({"reference": reference, "runs": runs, "seconds_per_verification": costs, "k": args.k}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
