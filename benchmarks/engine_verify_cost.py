"""What one verification costs on an engine, against the length of the context it verifies.

The same random fp32 Llama (``--hidden``, ``--layers``; head size 32 or more, as vLLM's CPU
attention needs) served by vLLM and by ``dsi serve --method ar``, one at a time, each on one CPU
thread. For each context length L, a dsi session (:class:`dsi.models.engines.target.EngineSession`, what a
target server of DSI runs) verifies ``--windows`` successive windows of k drafts after the same L
tokens, as DSI does while a request goes on: median seconds per verification, and its ratio to a
one-token request on the same engine.

vLLM reads no prefix cache for a request with prompt logprobs, so each verification that way ("vllm")
recomputes its whole context; as a batch of prefixes ("vllm prefix cache", :mod:`dsi.models.engines.prefixes`,
where the session's cost rule picks it) it reads the engine's prefix cache (vLLM started with
``--enable-prefix-caching --block-size B``); ``dsi serve`` keeps its slot's cache, so a window costs its own
tokens plus one.

    python benchmarks/engine_verify_cost.py --out docs/data/engine_verify_cost-2026-12-01.json

Needs the vLLM venv (``bash packaging/vllm-venv.sh``). Prints a table, then one JSON line. ``--dry-run``: one layer
of width 128, contexts of 16 and 64 tokens, 2 windows.
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import add_options, emit, need_vllm, parse, scratch, shrink

from tests.engine_servers import start_dsi_serve, start_vllm
from tests.tiny_hf import make_model_dir


def measure(url: str, vocab: int, lengths: list[int], k: int, windows: int, prefix_cache: bool = True) -> dict:
    import numpy as np

    from dsi.models.engines.target import EngineTarget

    engines = EngineTarget([url], vocab_size=vocab, prefix_cache=prefix_cache)
    ways = {}
    rng = np.random.default_rng(0)
    out = {}
    for length in lengths:
        context = [int(t) for t in rng.integers(3, vocab, length)]
        session = engines.new_session()
        try:
            session.extend_rows(context, None, 1, True)  # the request's first verification: the prefill
            times = []
            for _ in range(windows):
                drafts = [int(t) for t in rng.integers(3, vocab, k)]
                session.truncate(length)
                began = time.perf_counter()
                session.extend_rows(drafts, None, k + 1, True)
                times.append(time.perf_counter() - began)
            ways[length] = session.counters["prefix_requests"]
        finally:
            session.close()
        out[length] = statistics.median(times)
    return {"seconds": out, "prefix_requests": ways}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("-k", type=int, default=4, help="drafts per window (default 4)")
    parser.add_argument("--windows", type=int, default=7, help="verifications per length (default 7)")
    parser.add_argument("--block-size", type=int, default=32,
                        help="vLLM's KV block size (default 32; on a CPU a multiple of 32)")
    add_options(parser, "one layer of width 128, contexts of 16 and 64 tokens, 2 windows")
    args = parse(parser)
    shrink(args, hidden=128, layers=1, lengths=[16, 64], windows=2)
    if not need_vllm():
        return 2
    positions = max(args.lengths) + args.k + 16
    model = make_model_dir(scratch() / "model", seed=0, layers=args.layers, hidden=args.hidden,
                           positions=positions)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    results, ways = {}, {}
    vllm = ("--enable-prefix-caching", "--block-size", str(args.block_size))
    for names, start in ((("vllm", "vllm prefix cache"), lambda: start_vllm(str(model), max_model_len=positions,
                                                                             extra=vllm)),
                         (("dsi serve",), lambda: start_dsi_serve(str(model)))):
        server = start()
        try:
            for name in names:
                cached = name != "vllm"
                measure(server.url, vocab, args.lengths[:1], args.k, 2, cached)  # warm-up
                got = measure(server.url, vocab, args.lengths, args.k, args.windows, cached)
                results[name], ways[name] = got["seconds"], got["prefix_requests"]
        finally:
            server.stop()
    print(f"random Llama, hidden {args.hidden}, {args.layers} layers, fp32, 1 thread each; windows of k={args.k}; "
          f"median of {args.windows}; vLLM's block size {args.block_size}")
    print("| context | vLLM prompt_logprobs (s) | vLLM prefix cache (s) | windows as prefixes | dsi serve (s) |")
    print("|---|---|---|---|---|")
    for length in args.lengths:
        v, c, d = results["vllm"][length], results["vllm prefix cache"][length], results["dsi serve"][length]
        print(f"| {length} | {v:.4f} | {c:.4f} | {ways['vllm prefix cache'][length]} of {args.windows} | {d:.4f} |")
    emit({"model": {"hidden": args.hidden, "layers": args.layers, "dtype": "fp32"}, "k": args.k,
          "windows": args.windows, "block_size": args.block_size, "seconds_per_verification": results,
          "windows_as_prefixes": ways}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
