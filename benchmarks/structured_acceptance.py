"""Structured output's cost on the embedded pair (issue 52's goals): SI's acceptance and each method's tokens per
second with a JSON schema against the same prompts without it.

The embedded Qwen2.5-Coder pair (1.5B target, 0.5B drafter; llama.cpp on the CPU, or ``--backend hf``), greedy,
``--prompts`` requests asking for a JSON description of a small program, each run without a constraint and with
``--schema`` (default: benchmarks/configs/program-schema.json, five fields); non-SI, SI (k = 4) and DSI (event-driven windows, ``--sp``), medians
of ``--repeats``. Every constrained output is parsed and validated against the schema.

    python benchmarks/structured_acceptance.py --out docs/data/structured_acceptance-DATE.json

``--dry-run``: a tiny random GGUF pair (tests/tiny_gguf.py), 2 prompts x 16 tokens at most, the schema an enum of
two strings (a random model completes it in a few tokens), SP = 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from _common import add_options, emit, parse, scratch, shrink, tiny_pair

SCHEMA = Path(__file__).resolve().parent / "configs" / "program-schema.json"  # five fields: string, enum, ...
TASKS = ["a small Python module that parses CSV files", "a Rust command-line tool that counts words",
         "a Go web server that serves static files", "a Python script that resizes images",
         "a Rust library for matrix multiplication", "a Python package that talks to a REST API"]


def main() -> int:
    import dsi
    from dsi.models.loading import load_pair

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--prompts", type=int, default=len(TASKS))
    parser.add_argument("--tokens", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--sp", type=int, default=2)
    parser.add_argument("--schema", type=Path, default=SCHEMA,
                        help="a JSON schema file (default: benchmarks/configs/program-schema.json)")
    add_options(parser, "a tiny random GGUF pair, 2 prompts x 16 tokens, an enum of two strings, SP=1")
    args = parse(parser)
    pair = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
    if shrink(args, prompts=2, tokens=16, sp=1, schema=scratch() / "enum.json"):
        pair = tiny_pair("llama.cpp")
        args.schema.write_text(json.dumps({"enum": ["yes", "no"]}))
    schema = json.loads(args.schema.read_text())
    import jsonschema

    target, drafter = load_pair(*pair, backend=args.backend, progress=False)
    prompts = [target.encode(f"Describe {task} as a JSON object.", chat=True) for task in TASKS[: args.prompts]]
    methods = {"ar": dict(method="ar"), "si": dict(method="si", lookahead=4),
               "dsi": dict(method="dsi", lookahead="auto", num_target_servers=args.sp)}
    decoders = {(m, c): dsi.build_decoder(target=target, drafter=drafter, **kw)
                for m, kw in methods.items() for c in (False, True)}
    rows: dict = {}
    try:
        for (method, constrained), decoder in decoders.items():
            params = dsi.SamplingParams(constraint=dsi.Constraint.json_schema(schema) if constrained else None)
            runs = []
            for prompt in prompts:
                for _ in range(args.repeats):
                    request = dsi.engine.api.make_request(prompt, args.tokens, params, target.eos_token_ids,
                                                          target.vocab_size)
                    out = decoder.generate(request)
                    if constrained:
                        jsonschema.validate(json.loads(target.decode(out.tokens)), schema)
                    runs.append(out.stats)
            tokens = sum(s.new_tokens for s in runs)
            wall = sum(s.wall_time_s for s in runs)
            drafted = sum(s.accepted_tokens + s.rejections for s in runs)
            rows[f"{method}{'-schema' if constrained else ''}"] = {
                "method": method, "constrained": constrained, "tokens": tokens, "tokens_per_s": tokens / wall,
                "acceptance": (sum(s.accepted_tokens for s in runs) / drafted) if drafted else None,
                "median_tokens_per_s": statistics.median(s.new_tokens / s.wall_time_s for s in runs)}
    finally:
        for decoder in decoders.values():
            decoder.close()
    print(f"embedded pair ({getattr(target, 'name', '')}), greedy, {len(prompts)} prompts x {args.tokens} tokens at "
          f"most, {args.repeats} repeat(s); DSI SP={args.sp}")
    print("| method | constraint | tokens/s | speedup over non-SI | acceptance (accepted / decided drafts) |")
    print("|---|---|---|---|---|")
    for label, r in rows.items():
        base = rows["ar-schema" if r["constrained"] else "ar"]["tokens_per_s"]
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.3f}"
        print(f"| {r['method']} | {'JSON schema' if r['constrained'] else 'none'} | {r['tokens_per_s']:.1f} | "
              f"{r['tokens_per_s'] / base:.2f} | {acc} |")
    emit({"benchmark": "structured_acceptance", "schema": schema, "prompts": len(prompts),
          "max_tokens": args.tokens, "sp": args.sp, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
