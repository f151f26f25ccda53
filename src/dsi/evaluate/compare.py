"""Run non-SI, SI and DSI on the same prompts and compare them: the engine of ``dsi demo``.

For each prompt every method generates greedily from the same token ids; we record wall time,
tokens/s, acceptance and preemptions, and check that SI and DSI produced exactly non-SI's
tokens. Decoders are built once and warmed up, so model loading and first-call allocation are
not timed. Consecutive configurations that differ only in their lookahead share one decoder (the
lookahead is read per request): DSI's target servers (processes, Ray actors) are slow to start.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from dsi.engine.api import build_decoder, make_request
from dsi.sampling import SamplingParams

CODE_PROMPTS = (
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "def is_prime(n: int) -> bool:\n",
    "# Python: read a CSV file and print the average of the 'price' column\nimport csv\n\n",
    "def quicksort(arr):\n",
)
PROSE_PROMPTS = (
    "The three most important ideas in computer science are",
    "Once upon a time, in a small village by the sea,",
    "Speculative decoding makes language models faster because",
)


def method_label(method: str, lookahead: int | str | None = None, servers: int = 1) -> str:
    """The name of a configuration in tables: "non-SI", "SI k=4", "DSI k=auto SP=2"."""
    if method == "ar":
        return "non-SI"
    if method == "si":
        return f"SI k={lookahead}"
    return f"DSI k={lookahead} SP={servers}"


@dataclass(frozen=True)
class MethodConfig:
    method: str  # "ar" | "si" | "dsi"
    lookahead: int = 5
    servers: int = 1
    threads: int | None = None  # torch threads per worker for HF models (None: leave as is)
    transport: str = "threads"
    transport_options: tuple = ()  # (key, value) pairs passed to build_decoder's transport_options
    draft_tree: str | None = None  # SI / DSI windows as draft trees (dsi.trees): "auto", "3,2,1"; None: chains

    @property
    def label(self) -> str:
        tree = f" tree={self.draft_tree}" if self.draft_tree not in (None, "off") else ""
        if self.method != "dsi":
            return method_label(self.method, self.lookahead) + tree
        where = "" if self.transport == "threads" else f" {self.transport}"
        server_threads = dict(self.transport_options).get("threads_per_server")
        if server_threads is not None:  # a split of CPU cores: t threads per server, d for the drafter
            where += f" t={server_threads} d={self.threads}"
        return method_label("dsi", self.lookahead, self.servers) + tree + where

    @property
    def workers(self) -> tuple:
        """What its decoder's workers depend on: configs equal in this can share a decoder."""
        return self.method, self.servers, self.threads, self.transport, self.transport_options, self.draft_tree


@dataclass
class MethodRun:
    config: MethodConfig
    wall_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    stats: dict = field(default_factory=dict)  # of the last run
    spans: list[tuple[float, float]] = field(default_factory=list)  # time.perf_counter() of each run
    all_stats: list[dict] = field(default_factory=list)  # of every run

    @property
    def median_s(self) -> float:
        return statistics.median(self.wall_s)


def set_threads(model, threads: int | None, default: int | None) -> None:
    """``threads`` for this config, or the model's own setting (``default``) when it gives none, so
    that a config's threads never leak into the next one."""
    if hasattr(model, "threads"):
        model.threads = threads if threads is not None else default


def iter_compare(
    target,
    drafter,
    prompt_ids: Sequence[Sequence[int]],
    configs: Sequence[MethodConfig],
    *,
    max_new_tokens: int = 64,
    repeats: int = 1,
    eos_token_id=None,
    warmup_tokens: int = 4,
    fresh_warmup_tokens: int | None = None,
    progress: Callable[[], None] | None = None,
    sampling: SamplingParams | None = None,
    cold: bool = False,
) -> Iterator[tuple[MethodConfig, list[MethodRun]]]:
    """Run each config in turn; after each, yield it with its runs (one :class:`MethodRun` per prompt).

    ``sampling``: the requests' parameters (default greedy). A decoder keeps its sessions' caches
    between requests, so repeats of a prompt reuse its cached prefix; with ``cold`` every timed run
    gets a decoder of its own instead (as ``transformers.generate`` starts every call), first run
    for two tokens after a one-token prompt that starts none of the prompts (its workers and
    sessions start outside the timed call). Before its timed runs a config generates
    ``warmup_tokens`` on the first prompt, or ``fresh_warmup_tokens`` (default ``warmup_tokens``)
    where its decoder was built for it: a benchmark on a GPU passes the timed length, since new
    workers' first request of that length allocates what later ones reuse (CUDA's caching
    allocator), which must not fall inside one config's timed runs only
    (docs/results.md#2026-12-04-event-driven-windows-a-warm-rerun-one-forward-trees). A caller that stops
    iterating early closes the decoder in use.
    """
    params = sampling if sampling is not None else SamplingParams()
    firsts = {ids[0] for ids in prompt_ids}
    flush = next(([t] for ids in prompt_ids for t in reversed(ids) if t not in firsts), None)
    decoder, workers = None, None
    own = {id(m): getattr(m, "threads", None) for m in (target, drafter)}

    def build(config: MethodConfig):
        built = build_decoder(
            target=target, drafter=drafter, method=config.method, lookahead=config.lookahead,
            num_target_servers=config.servers, transport=config.transport,
            transport_options=dict(config.transport_options), draft_tree=config.draft_tree,
        )
        if cold and flush is not None:
            built.generate(make_request(flush, 2, params, None, target.vocab_size))
        return built

    try:
        for config in configs:
            set_threads(target, config.threads, own[id(target)])
            set_threads(drafter, config.threads, own[id(drafter)])
            fresh = decoder is None or config.workers != workers or cold
            if fresh:
                if decoder is not None:
                    decoder.close()
                    decoder = None
                decoder = build(config)
                workers = config.workers
            if config.method != "ar":
                decoder.lookahead = config.lookahead
            if warmup_tokens:
                fresh_n = warmup_tokens if fresh_warmup_tokens is None else fresh_warmup_tokens
                n = fresh_n if fresh and not cold else warmup_tokens
                decoder.generate(make_request(prompt_ids[0], n, params, None, target.vocab_size))
            runs = []
            for ids in prompt_ids:
                run = MethodRun(config)
                for _ in range(repeats):
                    if cold:
                        decoder.close()
                        decoder = None
                        decoder = build(config)
                    request = make_request(ids, max_new_tokens, params, eos_token_id, target.vocab_size)
                    start = time.perf_counter()
                    out = decoder.generate(request)
                    run.spans.append((start, time.perf_counter()))
                    run.wall_s.append(out.stats.wall_time_s)
                    run.tokens = out.tokens
                    run.stats = out.stats.to_dict()
                    run.all_stats.append(run.stats)
                    if progress:
                        progress()
                runs.append(run)
            yield config, runs
    finally:
        if decoder is not None:
            decoder.close()
        for model in (target, drafter):
            set_threads(model, None, own[id(model)])


def compare(target, drafter, prompt_ids: Sequence[Sequence[int]], configs: Sequence[MethodConfig],
            **options) -> list[dict[str, MethodRun]]:
    """For each prompt, a ``{label: MethodRun}`` dict with every config's runs (``options``: those of
    :func:`iter_compare`)."""
    results: list[dict[str, MethodRun]] = [{} for _ in prompt_ids]
    for config, runs in iter_compare(target, drafter, prompt_ids, configs, **options):
        for i, run in enumerate(runs):
            results[i][config.label] = run
    return results


# Largest logit gap between the two competing tokens that we attribute to floating point: a
# verification forward over k+1 positions and a one-token forward round differently, and in
# bf16/fp16 that can flip the argmax of a near-tie. Keyed by the hf backend's
# dtype, or by "llama.cpp" (quantized kernels: one-token and batched forwards take different
# paths; the bf16 margin until measured otherwise).
NEAR_TIE_MARGIN = {"bf16": 0.25, "fp16": 0.25, "fp32": 1e-3, "llama.cpp": 0.25}


def first_divergence(target, prompt: Sequence[int], reference: Sequence[int], other: Sequence[int]) -> dict | None:
    """Where ``other`` first departs from ``reference`` and the target's logit margin there.

    The margin is logit(reference token) - logit(other token) from one fresh forward of the
    target on the common prefix; a margin near zero means the two tokens were (numerically) tied.
    """
    n = min(len(reference), len(other))
    index = next((i for i in range(n) if reference[i] != other[i]), None)
    if index is None:
        return None if len(reference) == len(other) else {"index": n, "margin": None}
    session = target.new_session()
    try:
        row = session.extend(list(prompt) + list(reference[:index]))[-1]  # [V]
    finally:
        session.close()
    return {"index": index, "margin": float(row[reference[index]] - row[other[index]])}


def summarize(results: list[dict[str, MethodRun]], baseline: str = "non-SI") -> list[dict]:
    """One row per (prompt, method): median latency, tokens/s, speedups, identical outputs."""
    rows = []
    for i, runs in enumerate(results):
        base = runs.get(baseline)
        si_times = [r.median_s for label, r in runs.items() if r.config.method == "si"]
        best_si = min(si_times) if si_times else None
        for label, run in runs.items():
            n = len(run.tokens)
            rows.append({
                "prompt": i,
                "method": label,
                "latency_s": run.median_s,
                "new_tokens": n,
                "tokens_per_s": n / run.median_s if run.median_s > 0 else 0.0,
                "speedup_vs_nonsi": base.median_s / run.median_s if base else None,
                "speedup_vs_si": best_si / run.median_s if best_si else None,
                "acceptance_rate": run.stats.get("acceptance_rate", 0.0),
                "preempted_tasks": run.stats.get("preempted_tasks", 0),
                "identical": run.tokens == base.tokens if base else None,
                "stats": run.stats,
            })
    return rows
