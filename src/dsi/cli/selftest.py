"""``dsi selftest``: check that DSI is lossless on your own target/drafter pair (:mod:`dsi.evaluate.selftest`).

Exit status 0 when every check passes, 1 when one fails, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import sys

from dsi.cli.args import COUNT, ENGINE_URL, NATURAL, POSITIVE, SEED, SERVERS, Number, input_file
from dsi.cli.backend import hf_dtype
from dsi.cli.generate import _load, add_model_args, add_processing_args, processing_from_args, target_servers
from dsi.errors import ConfigError

HF_DTYPE = "fp32"  # the hf backend's default here: exact equality needs no bf16 near-ties

DEFAULT_PROMPTS = (
    "def fibonacci(n):\n",
    "The three most important ideas in computer science are",
    "def is_prime(n: int) -> bool:\n",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "selftest", help="check that DSI and SI reproduce the target exactly on your model pair",
        description="Greedy: SI and DSI must equal non-SI token for token on the prompts. Sampling: a "
        "seeded chi-square test of DSI's next-two-token law against the target's exact law at a few "
        "prefixes. Reports acceptance rates and measured speedups; exits 1 on any failure. The hf backend "
        "runs in fp32 by default (bf16 near-ties can flip greedy tokens between a 1-token and a k-token forward).",
    )
    add_model_args(p)
    for action in p._actions:
        if action.dest == "backend":  # exact checks need exact arithmetic: llama.cpp's batched kernels round
            action.default = "hf"     # differently from its one-token ones (near-ties flip, top-k edges move)
            action.help = ("engine of the models (default hf here: an exact check needs the same arithmetic in a "
                           "1-token and a k-token forward, which llama.cpp's quantized kernels do not give; "
                           "--backend llama.cpp reports its near-ties as failures)")
        if action.dest == "dtype":
            action.help = (f"weights dtype of the hf backend (default {HF_DTYPE} here); setting it makes --backend "
                           "auto pick hf")
    p.add_argument("--prompts", type=input_file, metavar="FILE",
                   help='prompts, one per line (a line starting with " is a JSON string); default: 3 built-in')
    p.add_argument("--lookahead", "-k", type=COUNT, default=3, help="lookahead of SI and DSI (default 3)")
    p.add_argument("--sp", type=SERVERS, default=2, help="DSI target servers (default 2)")
    p.add_argument("--transport", choices=("threads", "processes", "ray"), default="threads",
                   help="target-server transport (default threads)")
    p.add_argument("--target-servers", metavar="URL[,URL...]",
                   help="check SI and DSI verifying on these engines (vLLM or dsi serve) against the local "
                        "non-SI and the local target's exact law (docs/engines.md)")
    p.add_argument("--drafter-server", metavar="URL", type=ENGINE_URL,
                   help="check SI and DSI drafting on this engine serving the drafter (vLLM or dsi serve)")
    p.add_argument("--max-new-tokens", type=COUNT, default=24, help="greedy tokens per prompt (default 24)")
    p.add_argument("--positions", type=NATURAL, default=2,
                   help="prefixes of the chi-square test (default 2; 0: skip it)")
    p.add_argument("--samples", type=COUNT, default=400,
                   help="seeded DSI runs per prefix (default 400; each generates 2 tokens)")
    p.add_argument("--temperature", type=POSITIVE, default=1.0, help="temperature of the chi-square test (default 1.0)")
    p.add_argument("--top-k", type=NATURAL, default=4, help="top-k of the chi-square test (default 4)")
    p.add_argument("--alpha", type=Number(float, 0, 1, low_open=True, high_open=True), default=1e-4,
                   help="significance level (default 1e-4)")
    p.add_argument("--seed", type=SEED, default=0, help="first seed of the chi-square runs (default 0)")
    add_processing_args(p, stopping=False)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.set_defaults(func=run_selftest_command)


def run_selftest_command(args: argparse.Namespace) -> int:
    from dsi.cli.output import format_table, print_json
    from dsi.evaluate.selftest import SelftestConfig, read_prompts, run_selftest

    config = SelftestConfig(
        lookahead=args.lookahead, num_target_servers=args.sp, transport=args.transport,
        max_new_tokens=args.max_new_tokens, positions=args.positions, samples=args.samples,
        temperature=args.temperature, top_k=args.top_k, alpha=args.alpha, seed=args.seed,
        target_servers=tuple(urls) if (urls := target_servers(args)) else None,
        drafter_server=args.drafter_server, **processing_from_args(args),
    )
    texts = read_prompts(args.prompts) if args.prompts else list(DEFAULT_PROMPTS)
    if not texts:
        raise ConfigError(f"--prompts={args.prompts!r} holds no prompt")
    target, drafter = _load(args, need_drafter=True, hf_default_dtype=HF_DTYPE)
    backend = args.backend_choice.backend
    prompts = [target.encode(t) for t in texts]
    for t, ids in zip(texts, prompts, strict=True):
        if not ids:
            raise ConfigError(f"prompt {t!r} encodes to no tokens")
        target.check_length(len(ids) + max(args.positions, 0) + 2, args.max_new_tokens)
    quiet = args.json and not sys.stderr.isatty()
    report = run_selftest(target, drafter, prompts, config,
                          progress=None if quiet else (lambda msg: print(f"selftest: {msg}", file=sys.stderr)))
    if args.json:
        print_json({"target": args.target, "drafter": args.drafter, "backend": backend,
                    "dtype": hf_dtype(args, HF_DTYPE) if backend == "hf" else None, **report.to_dict()})
        return 0 if report.passed else 1
    rows = []
    for check in report.checks:
        d = check.detail
        if "p_value" in d:
            info = (f"p={d['p_value']:.3g} (chi2={d['statistic']:.1f}, df={d['df']}, {d['samples']} seeds"
                    + (f", {d['impossible_draws']} impossible draws" if d["impossible_draws"] else "") + ")")
        else:
            info = f"{d['prompts']} prompts x {d['tokens_per_prompt']} tokens"
            if d["mismatches"]:
                m = d["mismatches"][0]
                info += (f"; {len(d['mismatches'])} differ, first: prompt {m['prompt']} at token {m['position']} "
                         f"(target top-2 margin {m['target_top2_margin']:.2g})")
        rows.append(["✓" if check.passed else "✗", check.name, info])
    print(format_table(["", "check", "detail"], rows))
    accept = ", ".join(f"{k} {v:.2f}" for k, v in report.acceptance_rate.items())
    speed = ", ".join(f"{k.upper()} {v:.2f}x" for k, v in report.speedup_vs_nonsi.items())
    print(f"\nacceptance: {accept}; greedy speedup vs non-SI: {speed} "
          f"(non-SI {report.latency_s['ar']:.2f} s over {len(prompts)} prompts)")
    print(f"models: {args.target} / {args.drafter}, {args.backend_label}, k={args.lookahead}, SP={args.sp}")
    print("selftest: PASSED" if report.passed else f"selftest: FAILED ({'; '.join(report.failures)})")
    return 0 if report.passed else 1
