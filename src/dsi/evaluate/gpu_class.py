"""``dsi bench --gpu-class``: the engine where accelerators put it, forwards of a few milliseconds over a
real vocabulary, against an ideal engine that costs nothing on the host.

A scenario fixes the target's and the drafter's forward times (``WithLatency``) over a
:func:`~dsi.models.emulated.synthetic.banked_pair` of 152,064 ids (Qwen2.5's vocabulary): each forward looks its rows up
in a bank and greedy forwards return a precomputed argmax, so the pair's own host work is microseconds, as a
model whose forwards run on a GPU. Non-SI, SI (fixed ``k``) and DSI (event-driven windows, ``SP`` servers) run
in one process, interleaved ``repeats`` times after one untimed warm-up each, greedy and sampled, DSI on each
transport asked for (threads, processes, Ray). Every decoder is built once and serves every repeat, as a
server's would.

The *ideal* of each method is the event simulator's time (:func:`dsi.sim.events.simulate`) for the same
latencies and the run's own accept pattern: the drafter's draft at each position of the output, given the output
before it (greedy: its argmax; sampled: its draw with the request's seed), against the token committed there. So
``wall / ideal`` is what the engine's host path costs, and ``DSI / SI`` can be set beside the simulator's.

Host time per token, in CPU time (Linux: the kernel's per-thread ``schedstat``; None elsewhere), split by who
spends it during DSI's timed runs:

- ``engine``: the request's thread (the orchestrator) and the drafter's thread, without the pool's ``submit``
  and ``cancel`` calls;
- ``transport``: those calls, and this process's transport threads (the remote pools' listeners);
- ``servers``: the target servers (threads or processes; Ray's actors are counted where their pid is known):
  their forwards' own host work, reading rows into what the decisions need, and their side of the transport.

Non-SI's and SI's host time per token is this process's CPU time during their runs (they run nowhere else).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from dsi.engine.api import build_decoder, make_request
from dsi.errors import ConfigError
from dsi.models.emulated.synthetic import banked_pair
from dsi.sampling import Prefix, SamplingParams, draft_from_logits

VOCAB = 152064  # Qwen2.5's padded vocabulary
PROMPT = (1, 2, 3, 4)
TRANSPORTS = ("threads", "processes", "ray")
REQUESTS: dict[str, SamplingParams] = {
    "greedy": SamplingParams(),
    "sampled": SamplingParams(temperature=0.7, seed=1),
    # Qwen2.5-Instruct's generation_config: top-p and top-k filter every law a draft or a verification reads
    "nucleus": SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, seed=1),
}


@dataclass(frozen=True)
class GpuScenario:
    name: str
    target_ms: float
    drafter_ms: float
    acceptance: float = 0.8
    si_lookahead: int = 4
    servers: int = 4
    note: str = ""


GPU_SCENARIOS: dict[str, GpuScenario] = {
    s.name: s
    for s in [
        GpuScenario("gpu-20/2", 20.0, 2.0, note="eager forwards of a mid-size pair"),
        GpuScenario("gpu-7/1", 7.0, 1.0, note="a 14B bf16 target at the H200's bandwidth, a 0.5-1.5B drafter"),
        GpuScenario("gpu-3/0.4", 3.0, 0.4, note="a 3-7B target and a 0.5B drafter with captured graphs"),
    ]
}


# ---- CPU time by thread and process (Linux) ----------------------------------------------------------------
def _schedstat_ns(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def process_cpu_ns(pid: int) -> int | None:
    """Summed on-CPU time of every thread of process ``pid``."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for tid in tids:
        total += _schedstat_ns(f"/proc/{pid}/task/{tid}/schedstat") or 0
    return total


def _threads_cpu_ns(prefixes: Sequence[str]) -> int:
    """Summed on-CPU time of this process's threads whose names start with one of ``prefixes``."""
    pid = os.getpid()
    total = 0
    for thread in threading.enumerate():
        tid = getattr(thread, "native_id", None)
        if tid is not None and thread.name.startswith(tuple(prefixes)):
            total += _schedstat_ns(f"/proc/{pid}/task/{tid}/schedstat") or 0
    return total


def _this_thread_cpu_ns() -> int | None:
    return _schedstat_ns(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/schedstat")


class _TimedPool:
    """The decoder's pool with the time spent in its ``submit`` and ``cancel`` calls counted (the transport's
    part of the orchestrator's thread)."""

    def __init__(self, pool) -> None:
        self._pool = pool
        self.calls_s = 0.0

    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.calls_s += time.perf_counter() - start

    def submit(self, task) -> None:
        with self._counted():
            self._pool.submit(task)

    def cancel(self, task_ids) -> None:
        with self._counted():
            self._pool.cancel(task_ids)

    def __getattr__(self, name: str):
        return getattr(self._pool, name)


def _server_pids(pool) -> list[int]:
    return [pid for pid in (getattr(h, "pid", None) for h in getattr(pool, "handles", ())) if pid]


@dataclass
class _HostClock:
    """CPU time of each part while one DSI request runs."""

    pool: _TimedPool
    transport_threads: tuple[str, ...]

    def read(self) -> dict[str, int] | None:
        me = _this_thread_cpu_ns()
        if me is None:
            return None
        servers = sum(process_cpu_ns(pid) or 0 for pid in _server_pids(self.pool._pool))
        return {
            "orchestrator": me,
            "drafter": _threads_cpu_ns(["dsi-drafter"]),
            "transport_threads": _threads_cpu_ns(self.transport_threads),
            "server_threads": _threads_cpu_ns(["dsi-target-"]),
            "server_processes": servers,
            "pool_calls": int(self.pool.calls_s * 1e9),
        }

    @staticmethod
    def split(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
        d = {key: after[key] - before[key] for key in before}
        return {
            "engine": (d["orchestrator"] - d["pool_calls"] + d["drafter"]) / 1e9,
            "transport": (d["pool_calls"] + d["transport_threads"]) / 1e9,
            "servers": (d["server_threads"] + d["server_processes"]) / 1e9,
        }


# ---- accept patterns and ideals ----------------------------------------------------------------------------
def accept_pattern(drafter, prompt: Sequence[int], output: Sequence[int], params: SamplingParams,
                   stops: frozenset[int] = frozenset()) -> list[bool]:
    """Whether the drafter's draft at each position of ``output`` (after ``prompt`` + the output before it) is the
    token committed there: its argmax (greedy) or its draw with the request's seed at that absolute position (a
    rejected draft's correction never equals it: the residual has no mass there)."""
    session = drafter.new_session()
    try:
        context = list(prompt)
        row = session.extend(context)[-1]
        pattern = []
        for token in output:
            guess, _ = draft_from_logits(row, params, len(context), Prefix(context, len(prompt), stops))
            pattern.append(guess == token)
            context.append(token)
            row = session.extend([token])[-1]
        return pattern
    finally:
        session.close()


def ideal_seconds(method: str, scenario: GpuScenario, pattern: list[bool]) -> float:
    """The event simulator's time of ``method`` for the scenario's latencies and ``pattern`` (no host cost)."""
    from dsi.sim.events import simulate

    t, d = scenario.target_ms / 1000, scenario.drafter_ms / 1000
    lookahead = {"ar": 1, "si": scenario.si_lookahead, "dsi": "auto"}[method]
    return float(simulate(method, target_tpot=t, drafter_tpot=d, lookahead=lookahead,
                          num_servers=scenario.servers if method == "dsi" else 1, matches=pattern).mean)


# ---- the run -----------------------------------------------------------------------------------------------
def _decoders(scenario: GpuScenario, transports: Sequence[str], seed: int,
              vocabulary: Any = None) -> tuple[dict, object, object]:
    target, drafter = banked_pair(scenario.acceptance, vocab_size=VOCAB, seed=seed,
                                  target_tpot=scenario.target_ms / 1000, drafter_tpot=scenario.drafter_ms / 1000)
    for model in (target, drafter):  # a constraint's vocabulary: the servers rebuild it with their model
        model.wrapped_model.vocabulary = vocabulary
    decoders = {"ar": build_decoder(target=target, method="ar"),
                "si": build_decoder(target=target, drafter=drafter, method="si", lookahead=scenario.si_lookahead)}
    try:
        for transport in transports:
            decoders[f"dsi-{transport}"] = build_decoder(target=target, drafter=drafter, method="dsi",
                                                         lookahead="auto", num_target_servers=scenario.servers,
                                                         transport=transport)
    except BaseException:
        for decoder in decoders.values():
            decoder.close()
        raise
    return decoders, target, drafter


def run_gpu_scenario(
    scenario: GpuScenario, tokens: int = 96, repeats: int = 3, *, transports: Sequence[str] = ("threads", "processes"),
    requests: Sequence[str] = ("greedy", "sampled"), seed: int = 0, progress: Callable[[], None] | None = None,
    constraint: Any = None,
) -> list[dict]:
    """One row per (request kind, transport): each method's median wall time over its ideal, DSI / SI beside
    the simulator's, and DSI's host CPU time per token by part (see the module docstring). ``constraint``: a
    :class:`~dsi.constraints.BoundConstraint` on a 152,064-id vocabulary every request carries (structured output;
    its EOS ends the requests)."""
    unknown = [t for t in transports if t not in TRANSPORTS]
    if unknown:
        raise ConfigError(f"transport {unknown[0]!r} must be one of {', '.join(TRANSPORTS)}")
    unknown = [r for r in requests if r not in REQUESTS]
    if unknown:
        raise ConfigError(f"request kind {unknown[0]!r} must be one of {', '.join(REQUESTS)}")
    decoders, target, drafter = _decoders(scenario, transports, seed, None if constraint is None else constraint.table)
    if constraint is not None:
        from dsi.constraints import bind

        constraint = bind(constraint.constraint, target)  # made from the model: it travels as its digest
    clocks = {}
    for transport in transports:
        decoder = decoders[f"dsi-{transport}"]
        decoder.pool = timed = _TimedPool(decoder.pool)
        clocks[transport] = _HostClock(timed, (f"dsi-{'process' if transport == 'processes' else transport}-",))
    rows = []
    try:
        stops = frozenset(constraint.table.eos) if constraint is not None else frozenset()
        for kind in requests:
            params = REQUESTS[kind] if constraint is None else replace(REQUESTS[kind], constraint=constraint)
            walls: dict[str, list[float]] = {name: [] for name in decoders}
            host: dict[str, list[dict[str, float]]] = {t: [] for t in transports}
            cpu: dict[str, list[float]] = {"ar": [], "si": []}  # this process's CPU time (all of their work)
            outputs: dict[str, list[list[int]]] = {name: [] for name in decoders}
            for repeat in range(repeats + 1):  # the first round warms every decoder up, untimed
                for name, decoder in decoders.items():
                    clock = clocks.get(name.removeprefix("dsi-")) if name.startswith("dsi-") else None
                    before = clock.read() if clock is not None else None
                    cpu_before = time.process_time()
                    result = decoder.generate(make_request(PROMPT, tokens, params, sorted(stops) or None, VOCAB))
                    cpu_s = time.process_time() - cpu_before
                    after = clock.read() if clock is not None else None
                    outputs[name].append(result.tokens)
                    if repeat:
                        walls[name].append(result.stats.wall_time_s)
                        if name in cpu:
                            cpu[name].append(cpu_s)
                        if before is not None and after is not None:
                            host[name.removeprefix("dsi-")].append(_HostClock.split(before, after))
                    if progress:
                        progress()
            med = {name: statistics.median(v) for name, v in walls.items()}
            # each method's ideal from its own output's accept pattern (sampled SI and DSI draw other tokens
            # than non-SI, and than each other: the same law, other uniforms)
            ideal = {"ar": ideal_seconds("ar", scenario, [False] * len(outputs["ar"][0]))}
            ideal["si"] = ideal_seconds("si", scenario, accept_pattern(drafter, PROMPT, outputs["si"][0], params,
                                                                       stops))
            dsi_output = outputs[f"dsi-{transports[0]}"][0] if transports else None
            pattern = accept_pattern(drafter, PROMPT, dsi_output, params, stops) if dsi_output is not None else []
            if transports:
                ideal["dsi"] = ideal_seconds("dsi", scenario, pattern)
            for transport in transports:
                name = f"dsi-{transport}"
                made = len(outputs[name][0]) or 1  # a constraint's EOS may end a request early
                split = ({part: statistics.median(run[part] for run in host[transport]) / made * 1e3
                          for part in ("engine", "transport", "servers")} if host[transport] else None)
                # greedy: every method gives non-SI's tokens; sampled: DSI the same tokens on every transport and
                # in every run (the seed's), SI and non-SI the same in every run
                same = all(o == outputs["ar"][0] for o in outputs["ar"]) and all(
                    o == outputs["si"][0] for o in outputs["si"]) and all(o == dsi_output for o in outputs[name])
                if params.greedy:
                    same = same and outputs["si"][0] == outputs["ar"][0] == dsi_output
                rows.append({
                    "scenario": asdict(scenario), "request": kind, "transport": transport, "tokens": tokens,
                    "constraint": None if constraint is None else constraint.constraint.kind,
                    "output_tokens": len(dsi_output) if dsi_output is not None else None,
                    "repeats": repeats, "vocab_size": VOCAB,
                    "median_wall_s": {"ar": med["ar"], "si": med["si"], "dsi": med[name]},
                    "ideal_s": ideal,
                    "ar_over_ideal": med["ar"] / ideal["ar"], "si_over_ideal": med["si"] / ideal["si"],
                    "dsi_over_ideal": med[name] / ideal["dsi"],
                    "dsi_over_si": med["si"] / med[name], "ideal_dsi_over_si": ideal["si"] / ideal["dsi"],
                    "dsi_over_ar": med["ar"] / med[name],  # DSI's speedup over non-SI
                    "host_ms_per_token": split,
                    "cpu_ms_per_token": {m: statistics.median(v) / (len(outputs[m][0]) or 1) * 1e3
                                         for m, v in cpu.items()},
                    "identical_outputs": same,
                    "pattern_acceptance": sum(pattern) / len(pattern),
                })
    finally:
        for decoder in decoders.values():
            decoder.close()
    return rows


def embedded_vocabulary(vocab_size: int = VOCAB):
    """Qwen2.5's vocabulary (the embedded pair's tokenizer, read from its GGUF: fetched on first use) as a
    :class:`~dsi.constraints.TokenTable` for rows of ``vocab_size`` ids: what a constraint on the banked pair masks."""
    import transformers

    from dsi.constraints import TokenTable
    from dsi.models.embedded import DRAFTER, ensure_gguf

    path = ensure_gguf(DRAFTER.name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    eos = [t for t in (tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id) if t is not None]
    return TokenTable.of_tokenizer(tokenizer, vocab_size, list(dict.fromkeys(eos)))

