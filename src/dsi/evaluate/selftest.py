"""Losslessness self-test of a model pair: is DSI's output really the target's?

Two checks, on the user's own target and drafter (any :class:`~dsi.models.base.LanguageModel`):

1. **Greedy equality.** For each prompt, non-SI, SI and DSI generate ``max_new_tokens`` tokens
   greedily; SI's and DSI's tokens must equal non-SI's token for token. A divergence is
   reported with its position and the target's top-2 logit margin there (a margin near 0 means
   a numerical near-tie, e.g. bf16 weights: run in fp32).
2. **Sampling law (chi-square).** At a few prefixes, DSI samples the next two tokens with
   temperature and top-k (so the law has few support points) under ``samples`` fixed seeds.
   The exact joint law of the target, ``P(t1, t2) = p(t1 | prefix) p(t2 | prefix, t1)``, comes
   from the target's own forwards (``1 + |support|`` of them). Pearson's statistic over the
   cells (cells expecting fewer than 5 draws are pooled) gives a p-value; the check fails if
   it is below ``alpha`` or if an outcome of probability 0 was drawn. The seeds are fixed, so
   the test is deterministic: a correct engine passes every time, a biased one fails every time.
   Two tokens exercise both the zero-draft window (first token) and a draft window (second).

Both checks apply the config's logit processors (penalties, ``logit_bias``, ``min_p``) when set:
greedy equality then holds for the processed argmax, and the law is the processed target law
(the second token's row counts the first as output).

It also reports acceptance rates and the measured wall-time speedups of SI and DSI over
non-SI on the greedy prompts. Nothing here knows about torch or the CLI.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from dsi.engine.api import build_decoder, make_request
from dsi.errors import ConfigError, require
from dsi.models.base import LanguageModel, forward_rows
from dsi.sampling import Prefix, SamplingParams, process_logits

METHOD_LABELS = {"ar": "non-SI", "si": "SI", "dsi": "DSI"}


@dataclass(frozen=True)
class SelftestConfig:
    lookahead: int = 3
    num_target_servers: int = 2
    transport: str = "threads"
    max_new_tokens: int = 24  # per greedy prompt
    positions: int = 2  # prefixes of the chi-square test
    samples: int = 400  # seeds per prefix
    temperature: float = 1.0
    top_k: int = 4
    alpha: float = 1e-4
    seed: int = 0  # the chi-square runs use seeds seed, seed + 1, ..., seed + samples - 1
    target_servers: tuple[str, ...] | None = None  # SI and DSI verify on these engines; non-SI and the law stay local
    drafter_server: str | None = None  # SI and DSI draft on this engine
    # logit processors of every check (greedy and chi-square), as in dsi.SamplingParams
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0

    def __post_init__(self) -> None:
        for name in ("lookahead", "num_target_servers", "max_new_tokens", "samples"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, f"{name}={value!r} must be an integer >= 1")
        require(isinstance(self.positions, int) and self.positions >= 0, f"positions={self.positions!r} must be >= 0")
        require(self.temperature > 0, f"temperature={self.temperature!r} must be > 0 (the test samples)")
        require(isinstance(self.top_k, int) and self.top_k >= 1, f"top_k={self.top_k!r} must be >= 1")
        require(0 < self.alpha < 1, f"alpha={self.alpha!r} must be in (0, 1)")
        object.__setattr__(self, "logit_bias", SamplingParams(logit_bias=self.logit_bias).logit_bias)  # validated
        self.sampling  # noqa: B018 - validates the processors, naming a bad value

    @property
    def processing(self) -> dict:
        return dict(presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                    repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias, min_p=self.min_p)

    @property
    def sampling(self) -> SamplingParams:
        return self.sampling_for(self.seed)

    def sampling_for(self, seed: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, seed=seed, **self.processing)


@dataclass
class Check:
    name: str
    passed: bool
    detail: dict = field(default_factory=dict)


@dataclass
class SelftestReport:
    config: SelftestConfig
    checks: list[Check] = field(default_factory=list)
    acceptance_rate: dict[str, float] = field(default_factory=dict)  # method -> pooled rate
    latency_s: dict[str, float] = field(default_factory=dict)  # method -> summed greedy wall time
    speedup_vs_nonsi: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def failures(self) -> list[str]:
        return [c.name for c in self.checks if not c.passed]

    def to_dict(self) -> dict:
        return {
            "passed": self.passed, "failures": self.failures, "config": asdict(self.config),
            "checks": [asdict(c) for c in self.checks], "acceptance_rate": self.acceptance_rate,
            "latency_s": self.latency_s, "speedup_vs_nonsi": self.speedup_vs_nonsi,
        }


# ---- statistics -----------------------------------------------------------------------------

def chi2_sf(x: float, df: int) -> float:
    """``P(X >= x)`` for ``X ~ chi-square(df)``: the regularised upper incomplete gamma Q(df/2, x/2)."""
    if df < 1:
        raise ValueError(f"{df=} must be >= 1")
    if x <= 0:
        return 1.0
    a, z = df / 2.0, x / 2.0
    log_prefactor = -z + a * math.log(z) - math.lgamma(a)
    if z < a + 1.0:  # series of the lower function P, then Q = 1 - P
        term = total = 1.0 / a
        n = a
        for _ in range(10_000):
            n += 1.0
            term *= z / n
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return min(1.0, max(0.0, 1.0 - total * math.exp(log_prefactor)))
    tiny = 1e-300  # continued fraction of Q (modified Lentz)
    b = z + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return min(1.0, max(0.0, h * math.exp(log_prefactor)))


def chi_square(observed: Counter, law: dict[tuple[int, ...], float], n: int, min_expected: float = 5.0) -> dict:
    """Pearson's test of ``observed`` counts (``n`` draws) against the exact ``law``.

    Cells expecting fewer than ``min_expected`` draws are pooled into one cell. Returns the
    statistic, degrees of freedom, p-value, and the draws of probability-0 outcomes.
    """
    impossible = sum(count for outcome, count in observed.items() if law.get(outcome, 0.0) <= 0.0)
    cells: list[tuple[float, int]] = []  # (expected, observed)
    pooled_e, pooled_o = 0.0, 0
    for outcome, prob in law.items():
        expected = n * prob
        if expected >= min_expected:
            cells.append((expected, observed.get(outcome, 0)))
        else:
            pooled_e += expected
            pooled_o += observed.get(outcome, 0)
    if pooled_e > 0:
        cells.append((pooled_e, pooled_o))
    statistic = sum((o - e) ** 2 / e for e, o in cells)
    df = max(1, len(cells) - 1)
    return {"statistic": statistic, "df": df, "p_value": chi2_sf(statistic, df), "cells": len(cells),
            "impossible_draws": impossible}


# ---- the checks -----------------------------------------------------------------------------

def _target_row(session, context: Sequence[int]) -> np.ndarray:
    return forward_rows(session, list(context), 1)[-1]  # [V]


def exact_two_token_law(target: LanguageModel, prefix: Sequence[int], params: SamplingParams) -> dict:
    """``{(t1, t2): P}`` of the target's next two tokens after ``prefix`` under ``params``."""
    session = target.new_session()
    try:  # the prefix is the prompt of the runs tested: penalties count the output after it
        p1 = process_logits(_target_row(session, prefix), params, Prefix(prefix, len(prefix)))  # [V]
        law = {}
        for t1 in np.flatnonzero(p1):
            context = [*prefix, int(t1)]
            p2 = process_logits(_target_row(session, context), params, Prefix(context, len(prefix)))  # [V]
            for t2 in np.flatnonzero(p2):
                law[(int(t1), int(t2))] = float(p1[t1] * p2[t2])
        return law
    finally:
        session.close()


def _margin(target: LanguageModel, context: Sequence[int]) -> float:
    """Target's top-1 minus top-2 logit after ``context`` (how close the greedy choice was)."""
    session = target.new_session()
    try:
        row = np.sort(_target_row(session, context))
        return float(row[-1] - row[-2])
    finally:
        session.close()


def run_selftest(
    target: LanguageModel,
    drafter: LanguageModel,
    prompts: Sequence[Sequence[int]],
    config: SelftestConfig = SelftestConfig(),
    progress: Callable[[str], None] | None = None,
) -> SelftestReport:
    """Run the greedy and chi-square checks on ``prompts`` (token ids); see the module docstring."""
    require(len(prompts) > 0, "selftest needs at least one prompt")
    report = SelftestReport(config)
    say = progress or (lambda _msg: None)
    greedy = SamplingParams(**config.processing)
    vocab = target.vocab_size
    decoders = {m: build_decoder(target=target, drafter=drafter, method=m, lookahead=config.lookahead,
                                 num_target_servers=config.num_target_servers, transport=config.transport,
                                 target_servers=list(config.target_servers) if config.target_servers and m != "ar"
                                 else None, drafter_server=config.drafter_server if m != "ar" else None)
                for m in ("ar", "si", "dsi")}
    try:
        outputs: dict[str, list[list[int]]] = {}
        for method, decoder in decoders.items():
            say(f"greedy {METHOD_LABELS[method]}")
            decoder.generate(make_request(prompts[0], 2, greedy, None, vocab))  # warm-up, not timed
            outputs[method], wall, accepted, decided = [], 0.0, 0, 0
            for ids in prompts:
                result = decoder.generate(make_request(ids, config.max_new_tokens, greedy, None, vocab))
                outputs[method].append(result.tokens)
                wall += result.stats.wall_time_s
                accepted += result.stats.accepted_tokens
                decided += result.stats.accepted_tokens + result.stats.rejections
            report.latency_s[method] = wall
            if method != "ar":
                report.acceptance_rate[f"{method} greedy"] = accepted / decided if decided else 0.0
        for method in ("si", "dsi"):
            report.speedup_vs_nonsi[method] = report.latency_s["ar"] / report.latency_s[method]
            mismatches = []
            for i, (ref, got) in enumerate(zip(outputs["ar"], outputs[method], strict=True)):
                if ref != got:
                    pos = next((j for j, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
                    margin = _margin(target, [*prompts[i], *ref[:pos]])
                    mismatches.append({
                        "prompt": i, "position": pos, "non_si_token": ref[pos] if pos < len(ref) else None,
                        "token": got[pos] if pos < len(got) else None, "target_top2_margin": margin,
                    })
            report.checks.append(Check(f"greedy {METHOD_LABELS[method]} == non-SI", not mismatches, {
                "prompts": len(prompts), "tokens_per_prompt": config.max_new_tokens, "mismatches": mismatches}))

        dsi = decoders["dsi"]
        accepted = decided = 0
        for j in range(config.positions):
            i = j % len(prompts)
            prefix = [*prompts[i], *outputs["ar"][i][:j]]  # prefix j: prompt j mod P plus j greedy tokens
            say(f"chi-square at prefix {j + 1}/{config.positions} ({config.samples} seeds)")
            law = exact_two_token_law(target, prefix, config.sampling)
            observed: Counter = Counter()
            for s in range(config.samples):
                params = config.sampling_for(config.seed + s)
                result = dsi.generate(make_request(prefix, 2, params, None, vocab))
                observed[tuple(result.tokens)] += 1
                accepted += result.stats.accepted_tokens
                decided += result.stats.accepted_tokens + result.stats.rejections
            test = chi_square(observed, law, config.samples)
            ok = test["p_value"] >= config.alpha and test["impossible_draws"] == 0
            report.checks.append(Check(f"DSI sampling law at prefix {j + 1} (chi-square)", ok, {
                "prompt": i, "prefix_tokens": len(prefix), "samples": config.samples, "alpha": config.alpha,
                "support": len(law), **test}))
        if config.positions:
            report.acceptance_rate["dsi sampling"] = accepted / decided if decided else 0.0
    finally:
        for decoder in decoders.values():
            decoder.close()
    return report


def read_prompts(path: str) -> list[str]:
    """Prompts from a text file: one per non-empty line; a line starting with ``"`` is a JSON
    string (for prompts with newlines, e.g. ``"def f():\\n    return"``)."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.lstrip().startswith('"'):
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{path}:{number}: not a valid JSON string ({exc.msg})") from None
                line = str(value)
            prompts.append(line)
    return prompts
