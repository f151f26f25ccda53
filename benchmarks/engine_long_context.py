"""Long contexts end to end over two vLLM engines: non-SI, SI and DSI, with and without the prefix cache.

Two vLLM engines serve the same random fp32 Llama (``--hidden``, ``--layers``, ``--block-size``, prefix caching on,
one CPU thread each) whose layers after the first write ``--depth-scale`` x their random outputs into the
residual stream: they cost what any layer costs, and move the argmax less. The drafter runs here (hf, fp32): the
target's first layer alone, with its embeddings and head, so it costs about 1 / ``--layers`` of a target forward
and agrees with it on most tokens (about 0.75 at 0.04, at every context length: the columns differ by what a
verification costs). For each context length L, a random prompt of L tokens, then ``--tokens`` new greedy tokens
by:

- non-SI through the engines (one verification a token);
- SI (k = ``--lookahead``) verifying on the first engine;
- DSI (lookahead ``--lookahead``, SP 2: one target server per engine),

each twice: verifying the ``prompt_logprobs`` way, which recomputes the whole context on vLLM ("before",
``EngineTarget(prefix_cache=False)``), and with the sessions' rule choosing a batch of prefixes read from the
engine's prefix cache ("after", :mod:`dsi.models.engines.prefixes`). Median of ``--repeats``, methods alternating,
of the time to the first token (its verification is the prefill, the same for every method) and of the decoding
after the tokens of that verification, in tokens per second; every output is checked against the local non-SI greedy output of the same prompt.

    python benchmarks/engine_long_context.py --out docs/data/engine_long_context-2026-12-06.json

Needs the vLLM venv (``bash packaging/vllm-venv.sh``). Prints a table, then one JSON line. ``--dry-run``: one layer
of width 128, contexts of 16 and 48 tokens, 4 new tokens, one repeat.
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import add_options, emit, need_vllm, parse, scratch, shrink

from tests.engine_servers import start_vllm
from tests.tiny_hf import make_model_dir

METHODS = ("ar", "si", "dsi")


BURST_S = 0.002  # tokens committed within this of the first one came from the same verification


def run(engines, drafter, method: str, prompt: list[int], tokens: int, lookahead: int, sampling=None):
    """One request of ``method`` over ``engines`` (an EngineTarget; greedy unless ``sampling`` says): seconds to
    its first token (the first verification, which holds the prefill), seconds after that verification's tokens
    to the last one, the number of tokens in that time, and the result."""
    import dsi

    options = {} if method == "ar" else {"drafter": drafter, "lookahead": lookahead}
    decoder = dsi.build_decoder(target=engines, target_servers=True, method=method, **options)
    arrivals: list[tuple[float, int]] = []

    def on_tokens(new, *_):
        arrivals.append((time.perf_counter(), len(new)))

    try:
        began = time.perf_counter()
        out = decoder.generate(dsi.make_request(prompt, tokens, sampling, vocab_size=engines.vocab_size), on_tokens)
        ended = time.perf_counter()
    finally:
        decoder.close()
    first = [(t, n) for t, n in arrivals if t - arrivals[0][0] < BURST_S]
    return first[0][0] - began, ended - first[-1][0], tokens - sum(n for _, n in first), out


def first_layer_drafter(target_dir, drafter_dir, scale: float):
    """Scale the outputs of the layers after the first of the checkpoint at ``target_dir`` by ``scale`` (saved
    over it), and save its first layer alone, with its embeddings, norm and head, at ``drafter_dir``."""
    import torch
    import transformers

    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir).eval()
    with torch.no_grad():
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    target.save_pretrained(target_dir)
    config = transformers.AutoConfig.from_pretrained(target_dir)
    config.num_hidden_layers = 1
    drafter = transformers.AutoModelForCausalLM.from_config(config).eval()
    drafter.load_state_dict({k: v for k, v in target.state_dict().items()
                             if not k.startswith("model.layers.") or int(k.split(".")[2]) == 0})
    drafter.save_pretrained(drafter_dir)
    transformers.AutoTokenizer.from_pretrained(target_dir).save_pretrained(drafter_dir)
    return drafter_dir


def first_layer_pair(folder, layers: int, hidden: int, positions: int, depth_scale: float,
                     vocab_size: int | None = None):
    """A random fp32 Llama target (saved under ``folder``, its deeper layers scaled by ``depth_scale``) and its
    first layer as the drafter (:func:`first_layer_drafter`), both loaded here: ``(target_dir, target, drafter)``."""
    from dsi.models.loading import load_model

    target_dir = make_model_dir(folder / "target", seed=0, layers=layers, hidden=hidden, positions=positions,
                                vocab_size=vocab_size)
    drafter_dir = first_layer_drafter(target_dir, folder / "drafter", depth_scale)
    target = load_model(str(target_dir), dtype="fp32", progress=False, threads=1)
    drafter = load_model(str(drafter_dir), role="drafter", dtype="fp32", progress=False, threads=1)
    return target_dir, target, drafter


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 512, 2048, 4096])
    parser.add_argument("--tokens", type=int, default=24, help="new tokens a request (default 24)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lookahead", type=int, default=4)
    parser.add_argument("--depth-scale", type=float, default=0.04,
                        help="the target's layers after the first: their outputs x this (default 0.04)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--block-size", type=int, default=32,
                        help="vLLM's KV block size (default 32; on a CPU a multiple of 32)")
    add_options(parser, "one layer of width 128, contexts of 16 and 48 tokens, 4 new tokens, one repeat")
    args = parse(parser)
    shrink(args, hidden=128, layers=1, lengths=[16, 48], tokens=4, repeats=1)
    if not need_vllm():
        return 2
    import numpy as np

    import dsi
    from dsi.models.engines.target import EngineTarget
    from tests.engine_servers import start_all

    positions = max(args.lengths) + args.tokens + args.lookahead + 64
    target_dir, target, drafter = first_layer_pair(scratch(), args.layers, args.hidden, positions, args.depth_scale)
    vllm = ("--enable-prefix-caching", "--block-size", str(args.block_size))
    servers = start_all([lambda: start_vllm(str(target_dir), max_model_len=positions, extra=vllm)
                         for _ in range(2)])
    rng = np.random.default_rng(0)
    seconds: dict = {}  # per token after the first verification's: the decoding
    ttfts: dict = {}  # to the first token: the prefill
    exact: dict = {}
    acceptance: dict = {}
    try:
        urls = [s.url for s in servers]
        ways = {"before": EngineTarget(urls, reference=target, prefix_cache=False),
                "after": EngineTarget(urls, reference=target)}
        run(ways["after"], drafter, "dsi", [1, 2, 3, 4], 2, args.lookahead)  # warm-up
        for length in args.lengths:
            prompt = [int(t) for t in rng.integers(3, target.vocab_size, length)]
            local = dsi.generate(target=target, prompt=prompt, method="ar", max_new_tokens=args.tokens).tokens
            agreed = dsi.generate(target=target, drafter=drafter, prompt=prompt, method="si",
                                  lookahead=args.lookahead, max_new_tokens=args.tokens).stats
            acceptance[length] = agreed.accepted_tokens / max(1, agreed.accepted_tokens + agreed.rejections)
            for way, engines in ways.items():
                times, firsts = {m: [] for m in METHODS}, {m: [] for m in METHODS}
                for _ in range(args.repeats):
                    for method in METHODS:
                        ttft, rest, count, out = run(engines, drafter, method, prompt, args.tokens, args.lookahead)
                        times[method].append(rest / max(count, 1))
                        firsts[method].append(ttft)
                        exact.setdefault(f"{way} {method} {length}", True)
                        exact[f"{way} {method} {length}"] &= list(out.tokens) == list(local)
                seconds.setdefault(way, {})[length] = {m: statistics.median(t) for m, t in times.items()}
                ttfts.setdefault(way, {})[length] = {m: statistics.median(t) for m, t in firsts.items()}
                print(f"{way} {length}: " + ", ".join(f"{m} {s:.2f} s" for m, s in seconds[way][length].items()),
                      flush=True)
    finally:
        for server in servers:
            server.stop()
    print(f"\nrandom Llama (hidden {args.hidden}, {args.layers} layers, fp32), two vLLM engines (prefix caching, block "
          f"{args.block_size}, one thread each), the drafter here (its first layer; depth scale {args.depth_scale}); {args.tokens} new greedy tokens, "
          f"lookahead {args.lookahead}, DSI SP 2; median of {args.repeats}")
    print("Tokens per second after the first verification (whose tokens come with the prefill: the TTFT column, "
          "non-SI's)")
    print("| context | SI acceptance | verification | TTFT s | non-SI tok/s | SI tok/s | DSI tok/s | SI / non-SI | "
          "DSI / non-SI | outputs exact |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    speedups: dict = {}
    for length in args.lengths:
        for way in ("before", "after"):
            s = seconds[way][length]
            rate = {m: 1 / s[m] for m in METHODS}
            speedups.setdefault(way, {})[length] = {"si": s["ar"] / s["si"], "dsi": s["ar"] / s["dsi"]}
            ok = all(exact[f"{way} {m} {length}"] for m in METHODS)
            print(f"| {length} | {acceptance[length]:.2f} | {way} | {ttfts[way][length]['ar']:.3f} | {rate['ar']:.1f} | {rate['si']:.1f} | "
                  f"{rate['dsi']:.1f} | {s['ar'] / s['si']:.2f} | {s['ar'] / s['dsi']:.2f} | {'yes' if ok else 'NO'} |")
    emit({"model": {"hidden": args.hidden, "layers": args.layers, "dtype": "fp32", "positions": positions},
          "block_size": args.block_size, "tokens": args.tokens, "lookahead": args.lookahead, "depth_scale": args.depth_scale,
          "repeats": args.repeats, "decode_seconds_per_token": seconds, "ttft_seconds": ttfts, "speedup_over_non_si": speedups, "si_acceptance": acceptance,
          "exact": exact}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
