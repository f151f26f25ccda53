"""What ``method="auto"`` costs once it has chosen: its decoder against the same method built by hand.

Two comparisons on the embedded pair (llama.cpp by default), greedy, the same prompt each run, the two
sides alternating so that drift in the machine's speed falls on both:

1. **in one process**: one loaded pair; ``dsi.build_decoder(method="auto")`` (its choice cached, so
   nothing is measured here) against ``dsi.build_decoder(method=<its pick>)``;
2. **as ``dsi generate`` runs**: ``dsi generate --method auto`` against ``dsi generate --method <pick>``,
   each a new process that loads what it needs (the auto one loads the drafter to learn the pick; a
   non-SI pick frees it before decoding).

Reports the median wall time and mean target forward of each side and their ratio (1.00 = no cost).

    python benchmarks/auto_overhead.py --repeats 7 --out docs/data/auto_overhead-2026-12-01.json

Prints a table, then one JSON line. ``--dry-run``: a tiny random pair for ``--backend``, 4 tokens, one run a
side (method="auto"'s choices cached in a temporary folder unless ``DSI_AUTOTUNE_DIR`` says where).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from _common import add_options, emit, parse, scratch, shrink, tiny_pair

PROMPT = "def fibonacci(n):"


def _median(values):
    return statistics.median(values) if values else None


def in_process(target_name: str, drafter_name: str, backend: str, tokens: int, repeats: int) -> dict:
    import dsi
    from dsi.engine.api import make_request
    from dsi.models.loading import load_pair

    target, drafter = load_pair(target_name, drafter_name, backend=backend, progress=False)
    auto = dsi.build_decoder(target=target, drafter=drafter, method="auto", num_target_servers=1)
    choice = auto.choice
    hand = dsi.build_decoder(target=target, drafter=drafter, method=choice.method, lookahead=choice.lookahead,
                             num_target_servers=choice.num_target_servers)
    request = make_request(target.encode(PROMPT), tokens, dsi.SamplingParams(), None, target.vocab_size)
    walls: dict[str, list[float]] = {"auto": [], "hand": []}
    forwards: dict[str, list[float]] = {"auto": [], "hand": []}
    outputs = {}
    for name, decoder in (("auto", auto), ("hand", hand)):  # warm-up, not counted
        decoder.generate(request)
    for i in range(repeats):
        order = (("auto", auto), ("hand", hand)) if i % 2 == 0 else (("hand", hand), ("auto", auto))
        for name, decoder in order:
            out = decoder.generate(request)
            walls[name].append(out.stats.wall_time_s)
            forwards[name].append(out.stats.mean_target_forward_s)
            outputs[name] = out.tokens
    auto.close()
    hand.close()
    return {"pick": choice.label, "cached": choice.cached, "walls": walls, "forwards": forwards,
            "identical": outputs["auto"] == outputs["hand"]}


def as_cli(target_name: str, drafter_name: str, backend: str, tokens: int, repeats: int, pick: str) -> dict:
    base = [sys.executable, "-m", "dsi.cli.main", "generate", "--target", target_name, "--drafter", drafter_name,
            "--backend", backend, "--prompt", PROMPT, "--max-new-tokens", str(tokens), "--json"]
    walls: dict[str, list[float]] = {"auto": [], "hand": []}
    forwards: dict[str, list[float]] = {"auto": [], "hand": []}
    outputs = {}
    for i in range(repeats):
        order = ("auto", "hand") if i % 2 == 0 else ("hand", "auto")
        for name in order:
            argv = base + ["--method", "auto" if name == "auto" else pick]
            proc = subprocess.run(argv, capture_output=True, text=True, check=True)
            doc = json.loads(proc.stdout)
            walls[name].append(doc["stats"]["wall_time_s"])
            forwards[name].append(doc["stats"]["mean_target_forward_s"])
            outputs[name] = doc["token_ids"]
    return {"walls": walls, "forwards": forwards, "identical": outputs["auto"] == outputs["hand"]}


def summary(run: dict) -> dict:
    med = {side: _median(run["walls"][side]) for side in ("auto", "hand")}
    fwd = {side: _median(run["forwards"][side]) for side in ("auto", "hand")}
    return {"median_wall_s": med, "median_target_forward_s": fwd, "auto_over_hand": med["auto"] / med["hand"],
            "identical": run["identical"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--backend", default="llama.cpp")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=7)
    add_options(parser, "a tiny random pair for --backend, 4 tokens, one run a side")
    args = parse(parser)
    if args.repeats < 1 or args.tokens < 1:
        parser.error("--repeats and --tokens must be >= 1")
    if shrink(args, tokens=4, repeats=1):
        args.target, args.drafter = tiny_pair(args.backend)
        os.environ.setdefault("DSI_AUTOTUNE_DIR", str(scratch()))  # dsi generate's processes inherit it
    inproc = in_process(args.target, args.drafter, args.backend, args.tokens, args.repeats)
    pick = {"non-SI": "ar", "SI": "si", "DSI": "dsi"}[inproc["pick"].split()[0]]
    cli = as_cli(args.target, args.drafter, args.backend, args.tokens, args.repeats, pick)
    rows = {"in one process": summary(inproc), "dsi generate": summary(cli)}
    print(f"auto picked {inproc['pick']} (cached: {inproc['cached']}); {args.tokens} greedy tokens, "
          f"{args.repeats} alternating runs a side, {args.backend}")
    print("| comparison | auto (median s) | by hand (median s) | auto / by hand | target forward auto / hand (ms) "
          "| same tokens |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        fa, fh = r["median_target_forward_s"]["auto"], r["median_target_forward_s"]["hand"]
        print(f"| {name} | {r['median_wall_s']['auto']:.3f} | {r['median_wall_s']['hand']:.3f} | "
              f"{r['auto_over_hand']:.3f} | {fa * 1e3:.1f} / {fh * 1e3:.1f} | {r['identical']} |")
    doc = {"pick": inproc["pick"], "tokens": args.tokens, "repeats": args.repeats, "backend": args.backend,
           "rows": rows, "runs": {"in one process": inproc, "dsi generate": cli}}
    emit(doc, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
