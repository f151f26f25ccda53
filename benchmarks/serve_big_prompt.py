"""A huge prompt against ``dsi serve``: is ``/health`` still answered, and how much memory does it take?

Starts ``dsi serve`` as a subprocess on 127.0.0.1 (method ``ar``, no drafter needed), then for
each case sends one request with a body of ``--mb`` megabytes while another thread polls
``/health`` every 10 ms, and reports the status of the big request, how long it took, the
slowest ``/health`` answer, and the growth of the server's peak resident memory during the
request (Linux: ``VmHWM`` of the process, reset through ``/proc/PID/clear_refs`` before each
case, minus ``VmRSS`` just before it) as a multiple of the body size. Cases: a text prompt, a
chat message and a token-id prompt, at the default body limit (expected: 413 at once) and with
``--max-body-bytes`` raised above the body (the prompt is then refused for the context: 400).

    python benchmarks/serve_big_prompt.py --tiny                 # tiny random model, built on the fly
    python benchmarks/serve_big_prompt.py --target qwen2.5-coder-0.5b-instruct --mb 20
    python benchmarks/serve_big_prompt.py --dry-run              # --tiny with bodies of 0.2 MB

Prints a table and one JSON line last (also written to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from _common import add_options, emit, parse, shrink

TEXT = "The quick brown fox jumps over the lazy dog. "


def status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def start_server(target: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "dsi.cli.main", "serve", "--target", target, "--method", "ar", "--port", "0",
            "--threads", "1", *extra]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if match := re.search(r"on (http://[^ ]+)/v1", line):
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, match.group(1)
    raise RuntimeError("dsi serve did not start:\n" + "".join(lines))


def body_of(kind: str, size: int) -> bytes:
    if kind == "ids":
        n = size // len("1000, ")
        return json.dumps({"prompt": [1000] * n, "max_tokens": 4}).encode()
    text = (TEXT * (size // len(TEXT) + 1))[:size]
    if kind == "chat":
        return json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 4}).encode()
    return json.dumps({"prompt": text, "max_tokens": 4}).encode()


def run_case(url: str, pid: int, path: str, body: bytes) -> dict:
    stop, latencies = threading.Event(), []

    def poll() -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                start = time.perf_counter()
                client.get(url + "/health")
                latencies.append(time.perf_counter() - start)
                time.sleep(0.01)

    Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset the peak RSS (VmHWM) to the current RSS
    before = status_kb(pid, "VmRSS")
    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.2)
    start = time.perf_counter()
    r = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=600)
    elapsed = time.perf_counter() - start
    time.sleep(0.2)
    stop.set()
    poller.join()
    peak = status_kb(pid, "VmHWM")
    growth = (peak - before) * 1024
    return {"status": r.status_code, "code": r.json()["error"]["code"] if r.status_code >= 400 else None,
            "request_s": round(elapsed, 3), "health_max_ms": round(1000 * max(latencies), 1),
            "health_p50_ms": round(1000 * sorted(latencies)[len(latencies) // 2], 1), "health_checks": len(latencies),
            "peak_rss_growth_mb": round(growth / 2**20, 1), "growth_x_body": round(growth / len(body), 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="MODEL of dsi serve (default with --tiny: a tiny random Llama)")
    p.add_argument("--tiny", action="store_true", help="build a tiny random model (context 256) in a temp dir")
    p.add_argument("--mb", type=float, default=20.0, help="body size in MB (default 20)")
    p.add_argument("--dtype", default="bf16", help="hf backend only")
    p.add_argument("--backend", default="hf", choices=["hf", "llama.cpp"],
                   help="dsi serve's backend (llama.cpp: a .gguf target or the embedded pair's short names)")
    p.add_argument("--cases", default="text,chat,ids",
                   help="prompts to send, in order, to each server: text, chat, ids (default text,chat,ids)")
    add_options(p, "--tiny with bodies of 0.2 MB (under the default limit: refused for the context)")
    args = parse(p)
    shrink(args, tiny=True, mb=0.2)
    size = int(args.mb * 1e6)
    with tempfile.TemporaryDirectory() as tmp:
        target = args.target
        if args.tiny or target is None:
            from tests.tiny_hf import make_model_dir

            target = str(make_model_dir(Path(tmp) / "target", seed=0, layers=2))
        rows = []
        for limit in (None, 4 * size):
            extra = ["--backend", args.backend] + (["--dtype", args.dtype] if args.backend == "hf" else [])
            extra += [] if limit is None else ["--max-body-bytes", str(limit)]
            proc, url = start_server(target, extra)
            try:
                httpx.post(url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 2}, timeout=120)
                for kind in args.cases.split(","):
                    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
                    body = body_of(kind, size)
                    row = {"limit": "default" if limit is None else limit, "prompt": kind, "body_mb": len(body) / 1e6,
                           **run_case(url, proc.pid, path, body)}
                    rows.append(row)
                    del body
            finally:
                proc.terminate()
                proc.wait(30)
    head = ("limit", "prompt", "body_mb", "status", "code", "request_s", "health_max_ms", "health_p50_ms",
            "health_checks", "peak_rss_growth_mb", "growth_x_body")
    print(" | ".join(head))
    for row in rows:
        print(" | ".join(str(row[k]) if not isinstance(row[k], float) else f"{row[k]:g}" for k in head))
    emit({"target": args.target or "tiny", "mb": args.mb, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
