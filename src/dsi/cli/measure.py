"""``dsi measure``: the inputs of the DSI paper's simulations, measured on real models.

- ``dsi measure latency --model MODEL``: TTFT = one forward over the prompt; TPOT =
  (generate time - TTFT) / (new tokens - 1), greedy with the KV cache, after a warm-up (as the
  paper measured it: Timor et al., ICLR 2025). Exactly ``--max-new-tokens`` tokens are generated
  per prompt (EOS does not stop a latency run, so every prompt contributes the same number of steps).
- ``dsi measure acceptance --target MODEL --drafter MODEL``: the paper's method. The target
  generates greedily (stopping at EOS); at every prefix the drafter predicts one token (greedy).
  The match flags are cut into runs of consecutive matches, split at each mismatch (the last run
  is kept when the generation ends on a match; no empty run is added after a final mismatch).
  With m the mean run length, acceptance a = 1 - 1/(1 + m). The plain per-token match rate is
  reported too. The same passes give the target's and the drafter's TTFT/TPOT. A drafter with
  another tokenizer guesses as it drafts (``--vocab-mode``, :mod:`dsi.models.vocab.bridge`): through
  its own greedy text re-tokenized for the target, so its "TPOT" is its cost per guessed target token.

The measuring functions below work on any :class:`~dsi.models.base.LanguageModel` (no torch);
only the command functions load models (:mod:`dsi.models.loading`; torch only for the hf backend).
JSON written with ``--json`` / ``--out`` is what ``dsi plan --from FILE`` reads.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dsi.cli.args import COUNT, ENGINE_URL, Number, output_file
from dsi.cli.backend import add_backend_args, choose, describe, forward_plan, hf_dtype, max_model_len
from dsi.cli.output import dumps, format_table, print_json
from dsi.errors import ConfigError
from dsi.models.base import LanguageModel, extend_rows, greedy_guess

PROMPT_SETS: dict[str, list[str]] = {
    "code": [
        "def fibonacci(n):",
        "def is_prime(n: int) -> bool:\n    \"\"\"Return True if n is a prime number.\"\"\"\n",
        "# Python: read a CSV file and print the average of the 'price' column\nimport csv\n\n",
        "def binary_search(items, target):\n    \"\"\"Return the index of target in the sorted list items, or -1.\"\"\"\n",
        "class Stack:\n    \"\"\"A simple LIFO stack.\"\"\"\n\n    def __init__(self):\n",
        "def merge_sort(arr):",
        "// JavaScript: debounce a function\nfunction debounce(fn, ms) {\n",
        "def word_count(text: str) -> dict[str, int]:\n    \"\"\"Count how often each word occurs in text.\"\"\"\n",
    ],
    "prose": [
        "The history of the printing press begins",
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain in simple terms why the sky is blue.",
        "The three most important things to know before adopting a dog are",
        "Summarize the causes of the French Revolution in a paragraph.",
        "Dear hiring manager, I am writing to apply for",
        "A good night's sleep matters because",
        "Describe the water cycle to a ten-year-old.",
    ],
}


# ----------------------------------------------------------------------------------------------
# Prompts


def load_prompts(spec: str) -> list[str]:
    """``code`` / ``prose`` (built-in sets) or a file: one JSON object ``{"prompt": ...}`` per line
    (JSON Lines) or one plain-text prompt per line. Blank lines are skipped."""
    if spec in PROMPT_SETS:
        return list(PROMPT_SETS[spec])
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(f"--prompts {spec!r} is neither a built-in set ({', '.join(PROMPT_SETS)}) nor a file")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise ConfigError(f"{path}:{number}: invalid JSON ({exc})") from exc
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ConfigError(f"{path}:{number}: a JSON line must be an object with a string 'prompt'")
            prompts.append(obj["prompt"])
        else:
            prompts.append(line)
    if not prompts:
        raise ConfigError(f"--prompts file {str(path)!r} holds no prompts")
    return prompts


# ----------------------------------------------------------------------------------------------
# Measurements (any LanguageModel)

Clock = Callable[[], float]


@dataclass(frozen=True)
class Timed:
    """One greedy pass: the tokens and the time of the prefill and of the whole generation."""

    tokens: tuple[int, ...]  # new tokens
    ttft_s: float
    total_s: float

    @property
    def tpot_s(self) -> float | None:
        n = len(self.tokens)
        return (self.total_s - self.ttft_s) / (n - 1) if n > 1 else None


def greedy_timed(
    model: LanguageModel,
    prompt: Sequence[int],
    max_new_tokens: int,
    eos: Sequence[int] = (),
    clock: Clock = time.perf_counter,
) -> Timed:
    """Greedy decoding with one session: prefill, then one forward per new token, each asking only for
    its last row's argmax (:func:`dsi.models.base.extend_rows`, as the engines ask: an engine then
    returns one log-probability a row).

    Stops after ``max_new_tokens`` or after a token in ``eos`` (included in the output).
    """
    if max_new_tokens < 1:
        raise ConfigError(f"{max_new_tokens=} must be >= 1")
    if not prompt:
        raise ConfigError("the prompt must hold at least one token")
    session = model.new_session()
    try:
        start = clock()
        token = int(extend_rows(session, list(prompt), None, 1, greedy=True)[-1])
        ttft = clock() - start
        out = [token]
        while len(out) < max_new_tokens and token not in eos:
            token = int(extend_rows(session, [token], None, 1, greedy=True)[-1])
            out.append(token)
        total = clock() - start
    finally:
        session.close()
    return Timed(tuple(out), ttft, total)


def drafter_predictions(
    drafter: LanguageModel, prompt: Sequence[int], target_tokens: Sequence[int], clock: Clock = time.perf_counter
) -> Timed:
    """The drafter's greedy guess at every prefix ``prompt + target_tokens[:i]`` (i = 0..n-1).

    One session walks along the target's tokens, so this is also a timed greedy-like pass
    (prefill, then one token per step) of the drafter.
    """
    session = drafter.new_session()
    context = list(prompt)
    try:
        start = clock()
        guesses = [greedy_guess(session, context)]
        ttft = clock() - start
        for token in target_tokens[:-1]:
            context.append(token)
            guesses.append(greedy_guess(session, context))
        total = clock() - start
    finally:
        session.close()
    return Timed(tuple(guesses), ttft, total)


def run_lengths(matches: Sequence[bool]) -> list[int]:
    """Lengths of the runs of consecutive matches, split at each mismatch.

    ``[M, M, X, M] -> [2, 1]``; ``[X, X] -> [0, 0]``; ``[M, X] -> [1]`` (no empty run is opened
    after a mismatch at the very end); ``[] -> []``.
    """
    runs, current = [], 0
    for match in matches:
        if match:
            current += 1
        else:
            runs.append(current)
            current = 0
    if matches and matches[-1]:
        runs.append(current)
    return runs


def acceptance_from_runs(runs: Sequence[int]) -> float:
    """The paper's acceptance rate: a = 1 - 1/(1 + m), m = mean run length."""
    if not runs:
        raise ConfigError("no positions were compared; generate at least one token")
    return 1.0 - 1.0 / (1.0 + float(np.mean(runs)))


@dataclass
class LatencyStats:
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)

    def add(self, timed: Timed) -> None:
        self.ttft_ms.append(timed.ttft_s * 1e3)
        if timed.tpot_s is not None:
            self.tpot_ms.append(timed.tpot_s * 1e3)

    def summary(self, prefix: str = "") -> dict[str, float | None]:
        def mean(v: list[float]) -> float | None:
            return float(np.mean(v)) if v else None

        return {f"{prefix}ttft_ms": mean(self.ttft_ms), f"{prefix}tpot_ms": mean(self.tpot_ms)}


def warm_up(model: LanguageModel, prompt: Sequence[int], steps: int = 4) -> None:
    """One untimed short generation (first-call allocations, lazy kernels, page faults)."""
    greedy_timed(model, prompt[:16], steps)


def measure_latency(model: LanguageModel, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> dict[str, Any]:
    """Mean TTFT and TPOT over ``prompts`` (exactly ``max_new_tokens`` greedy tokens each)."""
    if max_new_tokens < 2:
        raise ConfigError(f"{max_new_tokens=} must be >= 2 to measure TPOT")
    warm_up(model, prompts[0])
    stats = LatencyStats()
    rows = []
    for ids in prompts:
        timed = greedy_timed(model, ids, max_new_tokens)
        stats.add(timed)
        rows.append({"prompt_tokens": len(ids), "new_tokens": len(timed.tokens),
                     "ttft_ms": timed.ttft_s * 1e3, "tpot_ms": (timed.tpot_s or 0.0) * 1e3})
    return {**stats.summary(), "per_prompt": rows}


def measure_acceptance(
    target: LanguageModel,
    drafter: LanguageModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos: Sequence[int] = (),
) -> dict[str, Any]:
    """The paper's acceptance measurement plus both models' TTFT/TPOT (see the module docstring)."""
    warm_up(target, prompts[0])
    warm_up(drafter, prompts[0])
    t_stats, d_stats = LatencyStats(), LatencyStats()
    runs: list[int] = []
    matches = positions = 0
    rows = []
    for ids in prompts:
        target_pass = greedy_timed(target, ids, max_new_tokens, eos)
        drafter_pass = drafter_predictions(drafter, ids, target_pass.tokens)
        t_stats.add(target_pass)
        d_stats.add(drafter_pass)
        flags = [d == t for d, t in zip(drafter_pass.tokens, target_pass.tokens, strict=True)]
        runs.extend(run_lengths(flags))
        matches += sum(flags)
        positions += len(flags)
        rows.append({"prompt_tokens": len(ids), "new_tokens": len(flags), "matches": sum(flags),
                     "runs": run_lengths(flags)})
    mean_run = float(np.mean(runs)) if runs else 0.0
    return {
        "acceptance": acceptance_from_runs(runs),
        "match_rate": matches / positions,
        "mean_run_length": mean_run,
        "positions": positions,
        **t_stats.summary("target_"),
        **d_stats.summary("drafter_"),
        "per_prompt": rows,
    }


# ----------------------------------------------------------------------------------------------
# CLI


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "measure",
        help="measure latency (TTFT/TPOT) and acceptance rates of real models",
        description="Measure the inputs of DSI's performance model on real models, as the paper did.",
    )
    sub = parser.add_subparsers(dest="measure_command", metavar="WHAT")
    parser.set_defaults(func=lambda args: _usage(parser))

    def common(p: argparse.ArgumentParser, max_new: int, tokens_help: str) -> None:
        p.add_argument("--prompts", default="code",
                       help="built-in set (code, prose) or a file: JSON lines {\"prompt\": ...} or one prompt per line "
                            "(default: code)")
        p.add_argument("--num-prompts", type=COUNT, default=None, metavar="N", help="use only the first N prompts")
        p.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
        add_backend_args(p, threads_help="threads of the model: torch's intra-op threads (hf; default: the number "
                                         "of cores) or llama.cpp's threads per session (default: the backend's)")
        p.add_argument("--max-new-tokens", type=Number(int, 2), default=max_new, metavar="N",
                       help=f"{tokens_help} (default {max_new})")
        p.add_argument("--out", type=output_file, default=None, metavar="FILE",
                       help="also write the JSON result to FILE")
        p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")

    lat = sub.add_parser("latency", help="TTFT and TPOT of one model",
                         description="TTFT = one forward over the prompt; TPOT = (generate time - TTFT) / "
                                     "(new tokens - 1); greedy, after a warm-up.")
    lat.add_argument("--model", required=True, metavar="MODEL",
                     help="the model to time (required): a checkpoint directory, a .gguf file, a hub id, or an "
                          "embedded model's name such as qwen2.5-coder-1.5b-instruct (alias default-target), "
                          "qwen2.5-coder-0.5b-instruct (default-drafter) or smollm2-135m-instruct")
    lat.add_argument("--role", choices=["target", "drafter"], default=None, help="label the result for dsi plan")
    lat.add_argument("--target-servers", metavar="URL",
                     help="measure the engine at URL serving --model as DSI verifies on it (a scoring request per "
                          "forward: docs/engines.md); --model is the local copy it is checked against")
    lat.add_argument("--drafter-server", metavar="URL", type=ENGINE_URL,
                     help="measure the engine at URL serving --model as DSI drafts on it (streamed tokens)")
    common(lat, 32, "new tokens per prompt, exactly: EOS does not stop a latency run")
    lat.set_defaults(func=run_latency)

    acc = sub.add_parser("acceptance", help="acceptance rate of a target/drafter pair (the paper's method)",
                         description="The target generates greedily; at each prefix the drafter predicts one "
                                     "token; a = 1 - 1/(1 + mean run length of consecutive matches).")
    acc.add_argument("--target", default="default-target", metavar="MODEL",
                     help="target MODEL: a checkpoint directory, a .gguf file, a hub id or an embedded model's name "
                          "(default: the embedded target, qwen2.5-coder-1.5b-instruct)")
    acc.add_argument("--drafter", default="default-drafter", metavar="MODEL",
                     help="drafter MODEL (default: the embedded drafter, qwen2.5-coder-0.5b-instruct); it may have "
                          "another tokenizer (--vocab-mode)")
    acc.add_argument("--vocab-mode", choices=["auto", "shared", "string", "intersection"], default="auto",
                     help="how a drafter of another vocabulary guesses: 'auto' (default) and 'string' through its "
                          "own greedy text re-tokenized for the target, 'intersection' through the tokens both "
                          "vocabularies share; 'shared' requires one vocabulary")
    acc.add_argument("--target-servers", metavar="URL", help="the target's rows from the engine at URL (docs/engines.md)")
    acc.add_argument("--drafter-server", metavar="URL", type=ENGINE_URL,
                     help="the drafter's guesses streamed from the engine at URL")
    common(acc, 64, "new tokens per prompt at most: the target's greedy generation stops at EOS")
    acc.set_defaults(func=run_acceptance)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _prompt_ids(model: Any, args: argparse.Namespace) -> list[list[int]]:
    texts = load_prompts(args.prompts)
    if args.num_prompts is not None:
        texts = texts[: args.num_prompts]
    ids = [model.encode(text, chat=args.chat) for text in texts]
    for one in ids:
        if not one:
            raise ConfigError("a prompt encodes to zero tokens")
        model.check_length(len(one), args.max_new_tokens)
    return ids


def _check_common(args: argparse.Namespace) -> None:
    load_prompts(args.prompts)  # a missing or unreadable prompt file too


def _setup_threads(threads: int | None, backend: str) -> int | None:
    """The threads the measured model runs with: torch's, set process-wide for hf; for llama.cpp,
    its sessions' own (``--threads``, or the backend's default, None here)."""
    if backend != "hf":
        return threads
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def _load_options(args: argparse.Namespace, specs: list[str]) -> tuple[dict[str, Any], str]:
    """``load_model`` / ``load_pair`` options for the backend chosen for ``specs``, and a label."""
    choice = args.backend_choice = choose(args, specs)
    hf = choice.backend == "hf"
    options = {"backend": choice.backend, "dtype": hf_dtype(args) if hf else None,
               "device": args.device if hf else None, "threads": args.threads,
               "n_ctx": max_model_len(args), "forward_plan": forward_plan(args),
               "deterministic": getattr(args, "deterministic", None)}
    return options, describe(choice.backend, args)


def _over_engines(target: Any, drafter: Any, args: argparse.Namespace) -> tuple[Any, Any, dict[str, str]]:
    """The models as the engines of ``--target-servers`` / ``--drafter-server`` serve them (the local
    ones are their references), and the URLs for the result."""
    engines: dict[str, str] = {}
    url = getattr(args, "target_servers", None)
    if url is not None:
        from dsi.models.engines.target import EngineTarget

        if "," in url:
            raise ConfigError(f"--target-servers={url!r}: dsi measure measures one engine; name one URL")
        target = EngineTarget([url], reference=target)
        engines["target_server"] = target.urls[0]
    url = getattr(args, "drafter_server", None)
    if url is not None:
        from dsi.models.engines.drafter import EngineDrafter

        drafter = EngineDrafter(url, drafter)
        engines["drafter_server"] = drafter.url
    return target, drafter, engines


def _emit(result: dict[str, Any], args: argparse.Namespace, headers: list[str], rows: list[list[Any]],
          summary: list[tuple[str, Any]]) -> None:
    if args.out:
        Path(args.out).expanduser().write_text(dumps(result, indent=1) + "\n", encoding="utf-8")
    if args.json:
        print_json(result)
        return
    print(format_table(headers, rows))
    print()
    width = max(len(k) for k, _ in summary)
    for key, value in summary:
        print(f"{key.ljust(width)}  {value:.3f}" if isinstance(value, float) else f"{key.ljust(width)}  {value}")


def run_latency(args: argparse.Namespace) -> int:
    from dsi.models.loading import load_model

    _check_common(args)
    options, label = _load_options(args, [args.model])
    threads = _setup_threads(args.threads, options["backend"])
    if args.target_servers and args.drafter_server:
        raise ConfigError("dsi measure latency measures one model: give --target-servers or --drafter-server")
    model = load_model(args.model, role=args.role, **options)
    prompts = _prompt_ids(model, args)
    target, drafter, engines = _over_engines(model, model, args)
    measured_model = target if args.target_servers else drafter
    measured = measure_latency(measured_model, prompts, args.max_new_tokens)
    # the role the number is for (dsi plan): as labelled, else the engine's (a drafter server drafts)
    role = args.role or ("drafter" if args.drafter_server else "target")
    local = {"backend": options["backend"], "dtype": options["dtype"], "device": str(getattr(model, "device", "cpu")),
             "threads": threads}
    if engines:  # measured on the engine: its backend, dtype and threads are its own, unknown here
        engine = measured_model.engine if args.drafter_server else next(iter(measured_model.engines.values()))
        ran = {"backend": "engine", "dtype": None, "device": None, "threads": None,
               "engine": {"url": engine.url, "served_model": engine.model,
                          "kind": "dsi serve" if engine.kind == "dsi" else "openai (vLLM or another)"},
               "local_copy": local}
        where = f"the engine at {engine.url} ({ran['engine']['kind']}); local copy {label}"
    else:
        ran, where = local, f"{label} / {threads or 'default'}"
    result = {
        "kind": "latency", "model": args.model, "role": role, **engines,
        "ttft_ms": measured["ttft_ms"], "tpot_ms": measured["tpot_ms"], **ran, "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens, "per_prompt": measured["per_prompt"],
    }
    rows = [[i, r["prompt_tokens"], r["new_tokens"], r["ttft_ms"], r["tpot_ms"]]
            for i, r in enumerate(measured["per_prompt"])]
    _emit(result, args, ["prompt", "prompt tokens", "new tokens", "TTFT ms", "TPOT ms"], rows,
          [("model", args.model), ("measured on" if engines else "backend / threads", where),
           ("TTFT ms (mean)", result["ttft_ms"]), ("TPOT ms (mean)", result["tpot_ms"])])
    return 0


def run_acceptance(args: argparse.Namespace) -> int:
    from dsi.models.loading import load_pair

    _check_common(args)
    options, label = _load_options(args, [args.target, args.drafter])
    threads = _setup_threads(args.threads, options["backend"])
    from dsi.models.vocab.bridge import bridge_drafter

    target, drafter = load_pair(args.target, args.drafter, vocab_mode=args.vocab_mode, **options)
    prompts = _prompt_ids(target, args)
    eos = target.eos_token_ids
    target, drafter, engines = _over_engines(target, drafter, args)
    drafter = bridge_drafter(target, drafter, args.vocab_mode, merges=getattr(args, "merges", "auto"))  # target ids
    measured = measure_acceptance(target, drafter, prompts, args.max_new_tokens, eos)
    result = {
        "kind": "acceptance", "target": args.target, "drafter": args.drafter, **engines,
        **{k: v for k, v in measured.items() if k != "per_prompt"},
        "backend": options["backend"], "dtype": options["dtype"], "device": str(getattr(target, "device", "cpu")),
        "prompts": len(prompts), "threads": threads,
        "max_new_tokens": args.max_new_tokens, "per_prompt": measured["per_prompt"],
    }
    rows = [[i, r["prompt_tokens"], r["new_tokens"], r["matches"], len(r["runs"])]
            for i, r in enumerate(measured["per_prompt"])]
    _emit(result, args, ["prompt", "prompt tokens", "positions", "matches", "runs"], rows,
          [("target / drafter", f"{args.target} / {args.drafter}"),
           ("acceptance a = 1 - 1/(1+m)", result["acceptance"]), ("mean run length m", result["mean_run_length"]),
           ("match rate", result["match_rate"]), ("positions", result["positions"]),
           ("target TTFT / TPOT ms", f"{result['target_ttft_ms']:.1f} / {result['target_tpot_ms'] or 0:.1f}"),
           ("drafter TTFT / TPOT ms", f"{result['drafter_ttft_ms']:.1f} / {result['drafter_tpot_ms'] or 0:.1f}")])
    return 0
