"""The two backends side by side on the embedded pair: is the llama.cpp backend the fastest lossless CPU path?

Runs ``benchmarks/real_pair.py`` once per backend (each in a process of its own, one after the
other, same prompts: 3 code prompts x 64 greedy tokens, medians of --repeats), then prints one table
with, per backend, non-SI, the best SI and the best DSI: total seconds, tokens/s, speedup over that
backend's non-SI, engine / ideal (the event simulator's time from the workers' latencies measured
alone), and whether the output is identical to that backend's own non-SI ("≈" where it departs only
at a numerical near-tie: quantized llama.cpp kernels, bf16 in transformers). Last, the ratio of
the two backends' fastest lossless methods. JSON with both reports and the summary goes to --out.

    python benchmarks/backends.py --repeats 3 --out backends.json
    python benchmarks/backends.py --backends llama.cpp --repeats 1        # one backend only
    python benchmarks/backends.py --dry-run      # real_pair.py's dry run on each backend (tiny random pairs)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import add_options, emit, parse, shrink

HERE = Path(__file__).resolve().parent


def run_backend(backend: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, str(HERE / "real_pair.py"), "--backend", backend, "--prompts", str(args.prompts),
           "--tokens", str(args.tokens), "--repeats", str(args.repeats), "--out", str(out),
           "--threads", str(args.threads), "--dsi-threads", str(args.dsi_threads),
           "--si-k", *map(str, args.si_k),
           "--dsi", f"threads:{','.join(args.dsi_k)}:{','.join(map(str, args.dsi_sp))}"]
    if backend == "hf":
        cmd += ["--dtype", args.dtype] + (["--no-assisted"] if args.no_assisted else [])
    if args.dry_run:
        cmd.append("--dry-run")
    print(f"$ {' '.join(cmd)}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    report = json.loads(out.read_text())
    report["benchmark_wall_s"] = time.perf_counter() - start
    return report


def summary(backend: str, report: dict) -> list[dict]:
    rows = report["rows"]
    tokens = report["config"]["tokens"] * report["config"]["prompts"]
    base = rows["non-SI"]["total_s"]
    picked = [("non-SI", rows["non-SI"])]
    for method in ("si", "dsi"):
        best = min(((k, r) for k, r in rows.items() if r["method"] == method), key=lambda kr: kr[1]["total_s"],
                   default=None)
        if best is not None:
            picked.append(best)
    if "HF assisted" in rows:
        picked.append(("HF assisted", rows["HF assisted"]))
    out = []
    for label, r in picked:
        out.append({
            "backend": backend, "method": label, "total_s": r["total_s"], "tokens_per_s": tokens / r["total_s"],
            "vs_nonsi": base / r["total_s"], "engine_over_ideal": r.get("engine_over_ideal"),
            "identical": "yes" if r["identical"] else ("≈ near-tie" if r.get("near_tie") else "NO"),
            "acceptance": r.get("acceptance_rate"),
        })
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", default=["llama.cpp", "hf"], choices=["llama.cpp", "hf"])
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="threads of non-SI and SI (each runs alone)")
    p.add_argument("--dsi-threads", type=int, default=1, help="threads of each DSI worker (they run at once)")
    p.add_argument("--si-k", type=int, nargs="+", default=[2, 4, 6])
    p.add_argument("--dsi-k", nargs="+", default=["4", "auto"])
    p.add_argument("--dsi-sp", type=int, nargs="+", default=[1])
    p.add_argument("--dtype", default="bf16", help="hf backend's dtype")
    p.add_argument("--no-assisted", action="store_true", help="skip transformers' assisted generation (hf)")
    add_options(p, "real_pair.py's dry run on each backend (tiny random pairs), SI k=2, DSI k in {2, auto}")
    args = parse(p)
    shrink(args, repeats=1, si_k=[2], dsi_k=["2", "auto"])
    reports, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends:
            reports[backend] = run_backend(backend, args, Path(tmp) / f"{backend}.json")
            rows += summary(backend, reports[backend])
    print(f"\n{'backend':<10} {'method':<20} {'total s':>8} {'tok/s':>6} {'vs own non-SI':>13} {'eng/ideal':>9} "
          f"{'accept':>6}  identical")
    for r in rows:
        ideal = f"{r['engine_over_ideal']:9.2f}" if r["engine_over_ideal"] else f"{'-':>9}"
        accept = f"{r['acceptance']:6.2f}" if r["acceptance"] else f"{'-':>6}"
        print(f"{r['backend']:<10} {r['method']:<20} {r['total_s']:8.2f} {r['tokens_per_s']:6.1f} "
              f"{r['vs_nonsi']:12.2f}x {ideal} {accept}  {r['identical']}")
    result = {"rows": rows, "reports": reports}
    lossless = lambda r: r["identical"] != "NO" and r["method"] != "HF assisted"  # noqa: E731
    fastest = {b: min((r for r in rows if r["backend"] == b and lossless(r)), key=lambda r: r["total_s"])
               for b in args.backends}
    if len(fastest) == 2:
        ratio = fastest["hf"]["total_s"] / fastest["llama.cpp"]["total_s"]
        result["llama_cpp_fastest_over_hf_fastest"] = ratio
        print(f"\nfastest lossless: llama.cpp {fastest['llama.cpp']['method']} {fastest['llama.cpp']['total_s']:.2f} s, "
              f"hf {fastest['hf']['method']} {fastest['hf']['total_s']:.2f} s: llama.cpp is {ratio:.2f}x faster")
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
