"""Load test of ``dsi serve``: N concurrent clients x M streamed requests, DSI vs non-SI side by side.

For each method, starts ``dsi serve`` as a subprocess on 127.0.0.1 (a free port), takes a greedy
reference answer for every prompt with one sequential request, then runs ``--clients`` threads
that each send ``--requests`` streamed completions (greedy, cycling over the prompts) and
records latency, time to first token (first non-empty text chunk), tokens, and errors. A
response is *lost* if it fails or has no final chunk, *corrupted* if its text differs from the
reference. Finally SIGTERM, and the server must exit 0. Prints a table and writes JSON.

    python benchmarks/serve_load.py --tiny                       # tiny random pair, built on the fly
    python benchmarks/serve_load.py --dry-run                    # --tiny, 2 clients x 1 request x 4 tokens
    python benchmarks/serve_load.py --target qwen2.5-coder-1.5b-instruct \\
        --drafter qwen2.5-coder-0.5b-instruct --dtype bf16 --clients 2 --requests 2 --max-tokens 32

Everything is bounded (client and request counts, timeouts) and loopback-only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

import httpx
from _common import add_options, emit, parse, shrink, tiny_pair

PROMPTS = [
    "def fibonacci(n):\n",
    "def is_prime(n: int) -> bool:\n",
    "# read a CSV file and print the average of the 'price' column\nimport csv\n\n",
    "def quicksort(arr):\n",
    "The three most important ideas in computer science are",
    "for i in range(10):\n",
]


class Server:
    def __init__(self, argv: list[str], start_timeout: float) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "dsi.cli.main", "serve", *argv, "--port", "0",
                                      "--host", "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env=env)
        self.log: list[str] = []
        ready = threading.Event()

        def pump() -> None:
            for line in self.proc.stderr:
                self.log.append(line)
                if "on http://" in line:
                    ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(start_timeout):
            self.proc.kill()
            raise RuntimeError("dsi serve did not start:\n" + "".join(self.log[-20:]))
        self.url = re.search(r"on (http://[^ ]+)/v1", "".join(self.log)).group(1)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


def stream_completion(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, text, finish, usage, info = None, [], None, None, None
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return {"ok": False, "status": r.status_code, "error": r.text[:200]}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"ok": False, "status": 200, "error": chunk["error"]["message"]}
            for choice in chunk["choices"]:
                if choice["text"] and ttft is None:
                    ttft = time.perf_counter() - start
                text.append(choice["text"])
                finish = choice["finish_reason"] or finish
            if chunk.get("usage"):
                usage, info = chunk["usage"], chunk.get("dsi")
    latency = time.perf_counter() - start
    return {"ok": finish is not None and usage is not None, "status": 200, "latency_s": latency,
            "ttft_s": ttft if ttft is not None else latency, "text": "".join(text), "finish": finish,
            "tokens": usage["completion_tokens"] if usage else 0, "dsi": info}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def run_method(method: str, args: argparse.Namespace, target: str, drafter: str) -> dict:
    argv = ["--target", target, "--drafter", drafter, "--dtype", args.dtype, "--method", method,
            "--lookahead", str(args.lookahead), "--sp", str(args.sp if method == "dsi" else 1),
            "--max-concurrent", str(args.max_concurrent),
            "--max-queue", str(args.clients * args.requests + 8), "--temperature", "0",
            "--speculation-by-load", "off"]  # each method as it is (serve_bench.py measures the choice by load)
    threads = args.ar_threads if method == "ar" and args.ar_threads is not None else args.threads
    if threads:
        argv += ["--threads", str(threads)]
    server = Server(argv, args.start_timeout)
    prompts = PROMPTS[: args.prompts]
    try:
        with httpx.Client(timeout=args.request_timeout) as client:
            references = {p: stream_completion(client, server.url, p, args.max_tokens) for p in prompts}
        results: list[dict] = []
        lock = threading.Lock()

        def client_loop(c: int) -> None:
            with httpx.Client(timeout=args.request_timeout) as client:
                for r in range(args.requests):
                    prompt = prompts[(c * args.requests + r) % len(prompts)]
                    try:
                        out = stream_completion(client, server.url, prompt, args.max_tokens)
                    except httpx.HTTPError as exc:
                        out = {"ok": False, "status": None, "error": f"{type(exc).__name__}: {exc}"}
                    out["corrupted"] = out["ok"] and out["text"] != references[prompt].get("text")
                    with lock:
                        results.append(out)

        start = time.perf_counter()
        threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(args.request_timeout * args.requests + 60)
        wall = time.perf_counter() - start
    finally:
        exit_code = server.stop()
    ok = [r for r in results if r["ok"]]
    sent = args.clients * args.requests
    infos = [r["dsi"] for r in ok if r.get("dsi")]
    accepted = sum(i["accepted_tokens"] for i in infos)
    decided = accepted + sum(i["rejections"] for i in infos)
    return {
        "method": method, "requests": sent, "completed": len(ok), "lost": sent - len(ok),
        "corrupted": sum(r["corrupted"] for r in results), "errors": [r.get("error") for r in results if not r["ok"]],
        "wall_s": wall, "tokens": sum(r["tokens"] for r in ok),
        "throughput_tok_s": sum(r["tokens"] for r in ok) / wall if wall > 0 else 0.0,
        "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
        "latency_p50_s": percentile([r["latency_s"] for r in ok], 0.5),
        "latency_p95_s": percentile([r["latency_s"] for r in ok], 0.95),
        "ttft_p50_s": percentile([r["ttft_s"] for r in ok], 0.5),
        "ttft_p95_s": percentile([r["ttft_s"] for r in ok], 0.95),
        "mean_latency_s": statistics.fmean([r["latency_s"] for r in ok]) if ok else float("nan"),
        "acceptance_rate": accepted / decided if decided else None,
        "preempted_tasks": sum(i["preempted_tasks"] for i in infos),
        "server_exit_code": exit_code,
        "reference_texts": {p: references[p].get("text") for p in prompts},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--tiny", action="store_true", help="build a tiny random pair in a temporary directory")
    src.add_argument("--target", help="MODEL of the target (as for dsi serve)")
    p.add_argument("--drafter", help="MODEL of the drafter (with --target)")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--methods", nargs="+", default=["dsi", "ar"], choices=["dsi", "si", "ar"])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=4, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompts", type=int, default=4, help=f"distinct prompts (max {len(PROMPTS)})")
    p.add_argument("--lookahead", type=int, default=3)
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--max-concurrent", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (0: torch's default)")
    p.add_argument("--ar-threads", type=int, default=None,
                   help="torch threads of non-SI's single worker (default: --threads)")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--start-timeout", type=float, default=300.0)
    add_options(p, "--tiny, 2 clients x 1 request x 4 tokens, 2 prompts", out_default="serve_load.json")
    args = parse(p)
    shrink(args, tiny=True, clients=2, requests=1, max_tokens=4, prompts=2)
    if not (args.tiny or args.target):
        p.error("one of the arguments --tiny --target is required")
    if not (1 <= args.clients <= 64 and 1 <= args.requests <= 100 and 1 <= args.prompts <= len(PROMPTS)):
        p.error("--clients must be in [1, 64], --requests in [1, 100], --prompts in [1, %d]" % len(PROMPTS))
    if args.target and not args.drafter:
        p.error("--target needs --drafter")
    target, drafter = tiny_pair() if args.tiny else (args.target, args.drafter)
    runs = [run_method(m, args, target, drafter) for m in args.methods]
    same = len({json.dumps(r["reference_texts"], sort_keys=True) for r in runs}) == 1
    header = ["method", "ok/sent", "lost", "corrupt", "tok/s", "req/s", "p50 s", "p95 s", "TTFT p50", "TTFT p95",
              "accept", "exit"]
    rows = [[r["method"], f"{r['completed']}/{r['requests']}", r["lost"], r["corrupted"],
             f"{r['throughput_tok_s']:.1f}", f"{r['requests_per_s']:.2f}", f"{r['latency_p50_s']:.3f}",
             f"{r['latency_p95_s']:.3f}", f"{r['ttft_p50_s']:.3f}", f"{r['ttft_p95_s']:.3f}",
             "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}", r["server_exit_code"]]
            for r in runs]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    for row in [header, *rows]:
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths, strict=True)))
    print(f"\n{'tiny random pair' if args.tiny else f'{args.target} / {args.drafter}'}, {args.dtype}; "
          f"{args.clients} clients x {args.requests} requests x {args.max_tokens} tokens; k={args.lookahead}, "
          f"SP={args.sp}, {args.max_concurrent} slots; greedy outputs identical across methods: {same}")
    emit({"config": vars(args), "identical_across_methods": same,
          "runs": [{k: v for k, v in r.items() if k != "reference_texts"} for r in runs]}, args.out)
    bad = any(r["lost"] or r["corrupted"] or r["server_exit_code"] != 0 for r in runs) or not same
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
