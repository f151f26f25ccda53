"""What the OpenAI request fields cost under speculation: ``dsi serve`` with penalties, logit_bias
and ``logprobs: 5`` against plain requests, on the embedded pair (issue 22's benchmark).

1. **Per position** (robust on a noisy machine): on real rows of the target (151,936 logits), the
   median time of what each kind of request adds to a position (processing the row, the logprob
   row and its top-5 entry), next to the target's median one-token forward.
2. **End to end**: a ``dsi serve`` app runs in this process on 127.0.0.1 (the embedded Qwen2.5-Coder
pair on llama.cpp); for each method, the same prompts are sent, greedy, as four kinds of request, in
alternating order over ``--repeats`` rounds:

- ``plain``: no field beyond ``max_tokens`` / ``temperature: 0`` (the argmax-only path);
- ``logprobs``: ``logprobs: 5``;
- ``processed``: ``presence_penalty: 0.5``, ``frequency_penalty: 0.3``, ``logit_bias`` on 3 tokens;
- ``processed + logprobs``: both;
- ``tiny processing + logprobs``: ``presence_penalty: 1e-4``, ``logit_bias`` of 1e-4 and ``logprobs: 5``:
  the processed path with values too small to change the output, so it is the plain output (the
  table says whether it was) and the ratio is the cost of processing and logprobs alone.

Every request sets ``ignore_eos``, so each one generates exactly ``--tokens`` tokens and the kinds do
the same amount of decoding. Within a round the kinds take turns prompt by prompt (each prompt sends
every kind, the order reversed on every other prompt and round), so a slow spell of the machine
falls on all of them alike. Reported per kind: the median over rounds of the summed wall time of the
prompts (the server's own ``dsi.wall_time_s``, which leaves out HTTP), its ratio to ``plain`` of the
same round (the median, and a 90% bootstrap interval of the mean of the rounds' ratios), and the
acceptance rate (accepted / decided drafts). ``--methods`` and ``--kinds`` run a subset (``plain`` is
always run: it is what the ratios divide by). The processed outputs differ from
the plain ones (the penalties change them), so their acceptance may differ too: it says whether the
drafter, processed alike, keeps up.

    python benchmarks/request_surface_cost.py --out docs/data/request_surface_cost-2026-12-01.json

Prints a table, then one JSON line. ``--dry-run``: a tiny random GGUF pair (tests/tiny_gguf.py), 2 prompts x 4
tokens, one round.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from _common import add_options, emit, parse, shrink, tiny_pair

KINDS = {
    "plain": {},
    "logprobs": {"logprobs": 5},
    "processed": {"presence_penalty": 0.5, "frequency_penalty": 0.3, "logit_bias": {"13": 1.0, "198": -1.0, "220": 0.5}},
}
KINDS["processed + logprobs"] = {**KINDS["processed"], "logprobs": 5}
# the same processing path with values too small to move an argmax here: the output (and so the
# acceptance) stays the plain one's, so the ratio is what processing and logprobs cost, alone
KINDS["tiny processing + logprobs"] = {"presence_penalty": 1e-4, "logit_bias": {"13": 1e-4}, "logprobs": 5}
METHODS = {"si k=4": dict(method="si", lookahead=4), "dsi auto SP=1": dict(method="dsi", lookahead="auto",
                                                                          num_target_servers=1)}
METHOD_NAMES = {"si": "si k=4", "dsi": "dsi auto SP=1"}


def bootstrap_interval(values: list[float], level: float = 0.9, resamples: int = 4000) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (seeded: the same values, the same interval)."""
    import numpy as np

    data = np.asarray(values, dtype=np.float64)
    if len(data) < 2:
        return float(data.mean()), float(data.mean())
    means = np.random.default_rng(0).choice(data, size=(resamples, len(data))).mean(axis=1)
    tail = (1 - level) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def position_costs(target, prompt: str, repeats: int = 50) -> dict[str, float]:
    """Median milliseconds of each per-position step on 8 real rows of ``target``, and of its forward."""
    import time

    import numpy as np

    from dsi.logprobs import entry, logprob_rows
    from dsi.models.base import forward_rows
    from dsi.sampling import SamplingParams, greedy_tokens

    ids = target.encode(prompt)
    session = target.new_session()
    rows = np.asarray(forward_rows(session, ids, 8), dtype=np.float32)  # [8, V]
    forwards = []
    for t in range(12):  # one-token forwards, as non-SI runs them
        start = time.perf_counter()
        forward_rows(session, [*ids, t + 1], 1, greedy=True)
        forwards.append(time.perf_counter() - start)
        session.truncate(len(ids))
    session.close()
    plain, processed = SamplingParams(), SamplingParams(**{k: v for k, v in KINDS["processed"].items()})
    tokens = ids + list(range(100, 108))

    def median_ms(run) -> float:
        run()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1000 / 8  # per row

    lp = logprob_rows(rows, plain, tokens, len(ids), frozenset(), "raw")
    return {
        "target one-token forward": statistics.median(forwards) * 1000,
        "greedy, argmax of the raw row": median_ms(lambda: np.argmax(rows, axis=-1)),
        "greedy, processed (penalties + bias)": median_ms(lambda: greedy_tokens(rows, processed, tokens, len(ids))),
        "logprobs rows (raw)": median_ms(lambda: logprob_rows(rows, plain, tokens, len(ids), frozenset(), "raw")),
        "logprobs: top-5 entry": median_ms(lambda: [entry(lp[j], 0, 5) for j in range(8)]),
    }


def main() -> int:
    import httpx

    from dsi.evaluate.compare import CODE_PROMPTS
    from dsi.models.loading import load_pair
    from dsi.server import ServeConfig, create_app
    from tests.unit.server.conftest import running_server

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", choices=sorted(METHOD_NAMES), default=sorted(METHOD_NAMES))
    parser.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS))
    add_options(parser, "a tiny random GGUF pair, 2 prompts x 4 tokens, one round")
    args = parse(parser)
    if shrink(args, prompts=2, tokens=4, repeats=1):
        args.target, args.drafter = tiny_pair("llama.cpp")
    kinds = ["plain", *[k for k in args.kinds if k != "plain"]]
    target, drafter = load_pair(args.target, args.drafter, backend="llama.cpp", progress=False)
    prompts = CODE_PROMPTS[: args.prompts]
    per_position = position_costs(target, prompts[0])
    rows = []
    for label in [METHOD_NAMES[m] for m in sorted(args.methods, reverse=True)]:
        config = ServeConfig(model_name="m", max_tokens=args.tokens, max_concurrent=1, **METHODS[label])
        seconds: dict[str, list[float]] = {k: [] for k in kinds}
        ratios: dict[str, list[float]] = {k: [] for k in kinds}
        accepted = {k: [0, 0] for k in kinds}
        texts: dict[str, dict[str, str]] = {k: {} for k in kinds}
        with running_server(create_app(target, drafter, config)) as server:
            client = httpx.Client(base_url=server.url, timeout=600)
            warm = {"prompt": prompts[0], "max_tokens": 4, "temperature": 0}
            client.post("/v1/completions", json=warm).raise_for_status()
            for rep in range(args.repeats):
                totals = dict.fromkeys(kinds, 0.0)
                for i, prompt in enumerate(prompts):
                    order = kinds if (rep + i) % 2 == 0 else list(reversed(kinds))
                    for kind in order:
                        body = {"prompt": prompt, "max_tokens": args.tokens, "temperature": 0, "ignore_eos": True,
                                **KINDS[kind]}
                        answer = client.post("/v1/completions", json=body)
                        answer.raise_for_status()
                        info = answer.json()["dsi"]
                        texts[kind][prompt] = answer.json()["choices"][0]["text"]
                        totals[kind] += info["wall_time_s"]
                        accepted[kind][0] += info["accepted_tokens"]
                        accepted[kind][1] += info["accepted_tokens"] + info["rejections"]
                for kind in kinds:
                    seconds[kind].append(totals[kind])
                    ratios[kind].append(totals[kind] / totals["plain"])
                print(f"{label} round {rep + 1}: " + ", ".join(f"{k} {totals[k]:.2f} s" for k in kinds),
                      file=sys.stderr, flush=True)
            client.close()
        for kind in kinds:
            done, decided = accepted[kind]
            low, high = bootstrap_interval(ratios[kind])
            rows.append({"method": label, "kind": kind, "seconds": statistics.median(seconds[kind]),
                         "ratio_to_plain": statistics.median(ratios[kind]), "round_ratios": ratios[kind],
                         "mean_ratio_90": [low, high],
                         "acceptance": done / decided if decided else None,
                         "same_output_as_plain": texts[kind] == texts["plain"]})
    forward = per_position.pop("target one-token forward")
    print(f"per position, on the target's rows ({target.vocab_size} logits); its one-token forward: {forward:.2f} ms")
    print("| what a position adds | ms | / forward |")
    print("|---|---|---|")
    for what, ms in per_position.items():
        print(f"| {what} | {ms:.3f} | {ms / forward:.4f} |")
    print()
    print(f"{args.target} / {args.drafter}, llama.cpp, dsi serve in-process, greedy, {len(prompts)} prompts x "
          f"{args.tokens} tokens, median of {args.repeats} rounds")
    print("| method | request | s (sum of prompts) | / plain (median) | mean / plain, 90% interval | acceptance "
          "| plain's output |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        low, high = r["mean_ratio_90"]
        print(f"| {r['method']} | {r['kind']} | {r['seconds']:.2f} | {r['ratio_to_plain']:.3f} | "
              f"{low:.3f}-{high:.3f} | {r['acceptance']:.3f} | {'yes' if r['same_output_as_plain'] else 'no'} |")
    emit({"benchmark": "request_surface_cost", "target": args.target, "drafter": args.drafter,
          "prompts": len(prompts), "tokens": args.tokens, "repeats": args.repeats,
          "target_forward_ms": forward, "per_position_ms": per_position, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
