"""What ``--deterministic`` costs ``dsi serve`` on serving workloads, and whether answers depend on history.

For each mode (default, ``--deterministic``) starts ``dsi serve`` (127.0.0.1, a free port) on the pair with
``--method dsi --lookahead auto --sp 2`` (the server of issue 64's lm-eval run) and runs, one request at a
time, the three workloads an evaluation or a chat client sends:

- **scoring**: lm-eval's loglikelihood requests, ``echo`` + ``logprobs: 1`` + ``max_tokens: 0`` over
  context + continuation; reports prompt tokens scored per second;
- **short**: greedy completions of ``--short-tokens`` tokens; output tokens per second;
- **chat**: greedy chat completions (a system prompt shared by every request) of ``--chat-tokens`` tokens;
  output tokens per second.

Every workload is sent twice in a row; an answer *moved* if its tokens or logprobs differ between the passes
(the second ran after the first's history; in DSI's default mode timing within a request may move them too).
Last, how far the default mode's answers are from the deterministic mode's: answers whose tokens differ, and
the largest logprob gap over their common tokens. The modes alternate over ``--repeats``
(medians of the passes' rates). Prints a table, then one JSON line.

    python benchmarks/serve_determinism.py --backend llama.cpp --repeats 2
    python benchmarks/serve_determinism.py --backend hf --dtype bf16 --repeats 1

``--dry-run``: a tiny random pair, one prompt per workload, 4 tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx
from _common import add_options, add_pair_options, emit, parse, shrink, tiny_pair
from serve_load import Server

CONTEXTS = [  # lm-eval style loglikelihood pairs: (context, continuation)
    ("Question: What is the capital of France?\nAnswer:", " Paris"),
    ("The quick brown fox jumps over the", " lazy dog"),
    ("def add(a, b):\n    return", " a + b"),
    ("In 1492, Columbus sailed across the", " Atlantic Ocean"),
    ("Water boils at 100 degrees", " Celsius at sea level"),
    ("The square root of 81 is", " 9"),
]
SHORT = ["def fibonacci(n):\n", "# print the numbers from 1 to 10\n", "The three primary colours are",
         "import json\n\ndef load(path):\n"]
SYSTEM = "You are a helpful assistant. Answer briefly and precisely."
CHAT = ["Write a Python function that reverses a string.", "What is a hash table?",
        "Explain recursion in one sentence.", "How do I read a file line by line in Python?"]


def scoring(client: httpx.Client, url: str, n: int) -> tuple[float, list]:
    tokens, seconds, answers = 0, 0.0, []
    for context, continuation in CONTEXTS[:n]:
        start = time.perf_counter()
        r = client.post(url + "/v1/completions", json={"prompt": context + continuation, "max_tokens": 0,
                                                        "echo": True, "logprobs": 1, "temperature": 0})
        seconds += time.perf_counter() - start
        r.raise_for_status()
        body = r.json()
        tokens += body["usage"]["prompt_tokens"]
        logprobs = body["choices"][0]["logprobs"]
        answers.append((logprobs["tokens"], logprobs["token_logprobs"]))
    return tokens / seconds, answers


def short(client: httpx.Client, url: str, n: int, max_tokens: int) -> tuple[float, list]:
    tokens, seconds, answers = 0, 0.0, []
    for prompt in SHORT[:n]:
        start = time.perf_counter()
        r = client.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                        "temperature": 0, "logprobs": 2})
        seconds += time.perf_counter() - start
        r.raise_for_status()
        body = r.json()
        tokens += body["usage"]["completion_tokens"]
        choice = body["choices"][0]
        answers.append((choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]))
    return tokens / seconds, answers


def chat(client: httpx.Client, url: str, n: int, max_tokens: int) -> tuple[float, list]:
    tokens, seconds, answers = 0, 0.0, []
    for question in CHAT[:n]:
        start = time.perf_counter()
        r = client.post(url + "/v1/chat/completions", json={
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "logprobs": True, "top_logprobs": 2})
        seconds += time.perf_counter() - start
        r.raise_for_status()
        body = r.json()
        tokens += body["usage"]["completion_tokens"]
        choice = body["choices"][0]
        entries = choice["logprobs"]["content"]
        answers.append(([e["token"] for e in entries], [e["logprob"] for e in entries]))
    return tokens / seconds, answers


def departure(default: list, deterministic: list) -> tuple[int, float]:
    """How far default answers are from the deterministic mode's: answers whose tokens differ, and the largest
    gap between the logprobs of one token at one position, over each pair's common token prefix."""
    texts, gap = 0, 0.0
    for (tokens_a, logprobs_a), (tokens_b, logprobs_b) in zip(default, deterministic, strict=True):
        texts += tokens_a != tokens_b
        for token_a, token_b, x, y in zip(tokens_a, tokens_b, logprobs_a, logprobs_b):
            if token_a != token_b:
                break
            if x is not None and y is not None:
                gap = max(gap, abs(x - y))
    return texts, gap


def run_mode(args: argparse.Namespace, deterministic: bool) -> dict:
    argv = ["--target", args.target, "--drafter", args.drafter, "--backend", args.backend, "--method", "dsi",
            "--lookahead", "auto", "--sp", "2", "--max-concurrent", "1", "--temperature", "0",
            "--speculation-by-load", "off"]  # DSI's own cost, every request speculating
    if args.dtype:
        argv += ["--dtype", args.dtype]
    if deterministic:
        argv.append("--deterministic")
    server = Server(argv, args.start_timeout)
    rates: dict[str, list[float]] = {}
    history: dict[str, bool] = {}  # answers that moved between two passes
    answers: dict[str, list] = {}
    try:
        with httpx.Client(timeout=args.request_timeout) as client:
            workloads = {"scoring": lambda: scoring(client, server.url, args.prompts),
                         "short": lambda: short(client, server.url, args.prompts, args.short_tokens),
                         "chat": lambda: chat(client, server.url, args.prompts, args.chat_tokens)}
            for name, run in workloads.items():
                first_rate, first = run()
                second_rate, second = run()  # the same requests, after the first pass's history
                rates[name] = [first_rate, second_rate]
                history[name] = first != second  # moved between the passes
                answers[name] = first
    finally:
        code = server.stop()
    return {"rates": rates, "moved_on_repeat": history, "answers": answers, "exit_code": code}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_options(parser)
    parser.add_argument("--prompts", type=int, default=4, help="requests per workload and pass")
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--chat-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    add_options(parser, "a tiny random pair, one prompt per workload, 4 tokens, one repeat")
    args = parse(parser)
    if shrink(args, prompts=1, short_tokens=4, chat_tokens=4, repeats=1):
        args.target, args.drafter = tiny_pair(args.backend)
        args.dtype = "fp32" if args.backend == "hf" else None
    if args.backend == "hf" and args.dtype is None:
        args.dtype = "bf16"
    runs: dict[str, list[dict]] = {"default": [], "deterministic": []}
    for rep in range(args.repeats):
        for deterministic in ((False, True) if rep % 2 == 0 else (True, False)):
            runs["deterministic" if deterministic else "default"].append(run_mode(args, deterministic))
    table = {}
    print(f"dsi serve --method dsi --lookahead auto --sp 2, {args.backend} {args.dtype or ''}: {args.target} / "
          f"{args.drafter}; medians over {args.repeats} run(s) x 2 passes")
    print(f"{'workload':<9} {'default':>12} {'deterministic':>14} {'det / default':>14}  moved on repeat "
          "(default, det.); default vs det.")
    for name in ("scoring", "short", "chat"):
        default = statistics.median(r for run in runs["default"] for r in run["rates"][name])
        det = statistics.median(r for run in runs["deterministic"] for r in run["rates"][name])
        moved = [any(run["moved_on_repeat"][name] for run in runs[mode]) for mode in ("default", "deterministic")]
        same = all(run["answers"][name] == runs["default"][0]["answers"][name]
                   for mode in runs for run in runs[mode])
        texts, gap = departure(runs["default"][0]["answers"][name], runs["deterministic"][0]["answers"][name])
        table[name] = {"default_tok_s": default, "deterministic_tok_s": det, "ratio": det / default,
                       "moved_on_repeat": dict(zip(("default", "deterministic"), moved, strict=True)),
                       "same_answers_in_both_modes": same, "answers_that_differ": texts,
                       "max_logprob_gap": gap}
        unit = "prompt tok/s" if name == "scoring" else "tok/s"
        print(f"{name:<9} {default:>8.1f} {unit:<4} {det:>9.1f} {det / default:>14.2f}  {moved[0]}, {moved[1]}"
              f"; {texts} answer(s) differ, logprobs up to {gap:.4f} apart")
    exits = [run["exit_code"] for mode in runs for run in runs[mode]]
    emit({"benchmark": "serve_determinism", "backend": args.backend, "dtype": args.dtype, "target": args.target,
          "drafter": args.drafter, "repeats": args.repeats, "workloads": table, "server_exit_codes": exits,
          "config": vars(args) | {"out": str(args.out) if args.out else None}}, args.out)
    return 0 if all(code == 0 for code in exits) else 1


if __name__ == "__main__":
    raise SystemExit(main())
