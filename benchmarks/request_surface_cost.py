"""What the OpenAI request fields cost under speculation: ``dsi serve`` with penalties, logit_bias
and ``logprobs: 5`` against plain requests, on the embedded pair (issue 22's benchmark).

A ``dsi serve`` app runs in this process on 127.0.0.1 (the embedded Qwen2.5-Coder pair on llama.cpp);
for each method, the same prompts are sent, greedy, as four kinds of request, in alternating order
over ``--repeats`` rounds:

- ``plain``: no field beyond ``max_tokens`` / ``temperature: 0`` (the argmax-only path);
- ``logprobs``: ``logprobs: 5``;
- ``processed``: ``presence_penalty: 0.5``, ``frequency_penalty: 0.3``, ``logit_bias`` on 3 tokens;
- ``processed + logprobs``: both.

Reported per kind: the median over rounds of the summed wall time of the prompts (the server's own
``dsi.wall_time_s``, which leaves out HTTP), its ratio to ``plain`` of the same round, and the
acceptance rate. The processed outputs differ from the plain ones (the penalties change them); the
acceptance says whether the drafter, processed alike, keeps up.

    python benchmarks/request_surface_cost.py --out docs/data/request_surface_cost-2026-12-01.json

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KINDS = {
    "plain": {},
    "logprobs": {"logprobs": 5},
    "processed": {"presence_penalty": 0.5, "frequency_penalty": 0.3, "logit_bias": {"13": 1.0, "198": -1.0, "220": 0.5}},
}
KINDS["processed + logprobs"] = {**KINDS["processed"], "logprobs": 5}
METHODS = {"si k=4": dict(method="si", lookahead=4), "dsi auto SP=1": dict(method="dsi", lookahead="auto",
                                                                          num_target_servers=1)}


def main() -> int:
    import httpx

    from dsi.evaluate.bench import emit_record
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
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    target, drafter = load_pair(args.target, args.drafter, backend="llama.cpp", progress=False)
    prompts = CODE_PROMPTS[: args.prompts]
    rows = []
    for label, method in METHODS.items():
        config = ServeConfig(model_name="m", max_tokens=args.tokens, max_concurrent=1, **method)
        seconds: dict[str, list[float]] = {k: [] for k in KINDS}
        ratios: dict[str, list[float]] = {k: [] for k in KINDS}
        accepted = {k: [0, 0] for k in KINDS}
        with running_server(create_app(target, drafter, config)) as server:
            client = httpx.Client(base_url=server.url, timeout=600)
            warm = {"prompt": prompts[0], "max_tokens": 4, "temperature": 0}
            client.post("/v1/completions", json=warm).raise_for_status()
            for rep in range(args.repeats):
                order = list(KINDS) if rep % 2 == 0 else list(reversed(KINDS))
                for kind in order:
                    total = 0.0
                    for prompt in prompts:
                        body = {"prompt": prompt, "max_tokens": args.tokens, "temperature": 0, **KINDS[kind]}
                        answer = client.post("/v1/completions", json=body)
                        answer.raise_for_status()
                        info = answer.json()["dsi"]
                        total += info["wall_time_s"]
                        accepted[kind][0] += info["accepted_tokens"]
                        accepted[kind][1] += info["drafted_tokens"]
                    seconds[kind].append(total)
                    print(f"{label} round {rep + 1} {kind}: {total:.2f} s", file=sys.stderr, flush=True)
                for kind in KINDS:
                    ratios[kind].append(seconds[kind][-1] / seconds["plain"][-1])
            client.close()
        for kind in KINDS:
            done, drafted = accepted[kind]
            rows.append({"method": label, "kind": kind, "seconds": statistics.median(seconds[kind]),
                         "ratio_to_plain": statistics.median(ratios[kind]),
                         "acceptance": done / drafted if drafted else None})
    print(f"{args.target} / {args.drafter}, llama.cpp, dsi serve in-process, greedy, {len(prompts)} prompts x "
          f"{args.tokens} tokens, median of {args.repeats} rounds")
    print("| method | request | s (sum of prompts) | / plain | acceptance |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['kind']} | {r['seconds']:.2f} | {r['ratio_to_plain']:.3f} | "
              f"{r['acceptance']:.3f} |")
    emit_record({"benchmark": "request_surface_cost", "target": args.target, "drafter": args.drafter,
                 "prompts": len(prompts), "tokens": args.tokens, "repeats": args.repeats, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
