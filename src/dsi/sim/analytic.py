"""Closed forms and exact expectations that the simulators are tested against.

Notation of the paper: ``c`` drafter latency and ``T`` target latency (same unit), ``a``
acceptance rate (i.i.d. per draft), ``k`` lookahead, ``S`` (or ``N``) tokens to generate.

- :func:`nonsi_time`: ``S T`` (or ``TTFT + (S - 1) TPOT``).
- :func:`si_expected_tokens_per_iteration`: ``(1 - a^(k+1)) / (1 - a)``; :func:`si_time_renewal`
  the resulting long-run estimate ``S (k c + T) / E[tokens]``.
- :func:`si_expected_time`: the exact expectation of SI in the offline simulator (which is also
  SI's expectation in the event simulator when TTFT = TPOT), by dynamic programming over the
  number of tokens left, end effects included.
- :func:`offline_dsi_expected_time`: the exact expectation of the offline simulator's DSI
  (the accounting of docs/simulator.md section 1).
- :func:`event_dsi_expected_time`: the exact expectation of the event simulator's DSI in its
  ideal regime (TTFT = TPOT, ``c <= T``, servers never queue, no preemption delay).
- :func:`proposition1_bound`: Proposition 1's upper bound on E[DSI time].
- :func:`dsi_lower_bound`: the sanity lower bound of section 5.

Why the two DSI expectations differ (see docs/simulator.md): an epoch (segment) that ends with
a rejection ``j`` drafts after the restart point costs, in the event simulator,
``D(j) = T`` for ``j = 0`` and ``min(ceil(j / k) k, L) c + T`` otherwise (window ``ceil(j/k)``'s
last row decides offset ``j``), whereas section 5 charges ``(floor(j / k) + 1) k c + T``, capped
at ``(j + 1) T``: one window more when ``j`` is a multiple of ``k``, and a cap that the real
algorithm only achieves when ``k c <= T``.
"""

from __future__ import annotations

import math

import numpy as np

from dsi.errors import ConfigError


def _check(a: float, k: int, tokens: int) -> None:
    if not 0 <= a <= 1:
        raise ConfigError(f"a={a!r} must be in [0, 1]")
    if not isinstance(k, int) or k < 1:
        raise ConfigError(f"lookahead={k!r} must be an integer >= 1")
    if not isinstance(tokens, int) or tokens < 1:
        raise ConfigError(f"tokens={tokens!r} must be an integer >= 1")


def nonsi_time(tokens: int, target_tpot: float = 1.0, target_ttft: float | None = None) -> float:
    """Non-SI: one target forward per token, ``TTFT + (tokens - 1) TPOT``."""
    ttft = target_tpot if target_ttft is None else target_ttft
    return ttft + (tokens - 1) * target_tpot


def si_expected_tokens_per_iteration(a: float, k: int) -> float:
    """Expected tokens one SI iteration commits: ``sum_{i=0..k} a^i = (1 - a^(k+1)) / (1 - a)``."""
    if not 0 <= a <= 1:
        raise ConfigError(f"a={a!r} must be in [0, 1]")
    if a == 1:
        return float(k + 1)
    return (1 - a ** (k + 1)) / (1 - a)


def si_time_renewal(c: float, a: float, k: int, tokens: int, failure_cost: float = 1.0) -> float:
    """Long-run SI time, ``S (k c + T) / E[tokens per iteration]`` (ignores the end of the run)."""
    return tokens * (k * c + failure_cost) / si_expected_tokens_per_iteration(a, k)


def _accept_law(a: float, k: int) -> np.ndarray:
    """P(n = j) for j = 0..k, n = min(k, G - 1), G ~ Geometric(1 - a).  # [k + 1]"""
    j = np.arange(k + 1, dtype=np.float64)
    p = a**j * (1 - a)
    p[k] = a**k
    return p


def si_expected_time(c: float, a: float, k: int, tokens: int, failure_cost: float = 1.0) -> float:
    """Exact E[SI cost] of the offline simulator: ``E[L] = kk c + T + sum_n P(n) E[L - n - 1]``."""
    _check(a, k, tokens)
    law = _accept_law(a, k)  # [k + 1]
    e = np.zeros(tokens + 1)  # e[L]: expected cost with L tokens left; e[0] = 0
    for left in range(1, tokens + 1):
        kk = min(k, left - 1)
        nxt = np.maximum(left - 1 - np.arange(k + 1), 0)  # [k + 1]
        e[left] = kk * c + failure_cost + float(law @ e[nxt])
    return float(e[tokens])


def offline_dsi_expected_time(c: float, a: float, k: int, tokens: int, failure_cost: float = 1.0) -> float:
    """Exact E[DSI cost] of the offline simulator (docs/simulator.md section 1), by DP over tokens left.

    A segment starting with ``L`` tokens left ends at the first rejected draft offset ``j``
    (probability ``a^j (1 - a)``, ``j <= L - 2``; ``j + 1`` tokens) or accepts all ``L - 1``
    drafts it may make (probability ``a^(L-1)``, ``L`` tokens). Its cost is
    ``min(drafted c + T, tokens T)`` where ``drafted`` counts the drafts of every window up to
    the one holding ``j`` (windows truncated at ``S - 1`` drafts).
    """
    _check(a, k, tokens)
    T = failure_cost
    e = np.zeros(tokens + 1)
    for left in range(1, tokens + 1):
        j = np.arange(left - 1, dtype=np.float64)  # rejection offsets 0 .. L-2  # [L-1]
        w = np.floor(j / k)  # full windows before the rejecting one
        drafted = w * k + np.minimum(k, (left - 1) - w * k)
        cost = np.minimum(drafted * c + T, (j + 1) * T)
        prob = a**j * (1 - a)
        total = float(prob @ (cost + e[left - 1 - j.astype(np.int64)]))
        all_accepted = a ** (left - 1) * min((left - 1) * c + T, left * T)
        e[left] = total + all_accepted
    return float(e[tokens])


def event_dsi_expected_time(c: float, a: float, k: int, tokens: int, failure_cost: float = 1.0) -> float:
    """Exact E[DSI latency] of :mod:`dsi.sim.events` in its ideal regime.

    Regime: TTFT = TPOT (``T`` for the target, ``c`` for the drafter), ``c <= T``, enough
    servers that no task queues, no preemption delay. An epoch restarted with ``L`` tokens left
    decides relative position ``j`` at ``D(j) = T`` (``j = 0``, the zero-draft task) or
    ``min(ceil(j / k) k, L) c + T`` (window ``ceil(j / k)``, sent when its drafts exist, or at
    the end of drafting for the final partial window). It ends at the first rejection ``j``
    (probability ``a^j (1 - a)``), or at the decision of the last position ``L - 1``.
    """
    _check(a, k, tokens)
    if c > failure_cost:
        raise ConfigError(f"c={c} must be <= failure_cost={failure_cost} for this closed form")
    T = failure_cost
    e = np.zeros(tokens + 1)
    for left in range(1, tokens + 1):
        j = np.arange(left, dtype=np.float64)  # decided offsets 0 .. L-1  # [L]
        decide_at = np.where(j == 0, T, np.minimum(np.ceil(j / k) * k, left) * c + T)  # [L]
        prob = a ** j[:-1] * (1 - a)  # rejection at 0 .. L-2
        total = float(prob @ (decide_at[:-1] + e[left - 1 - j[:-1].astype(np.int64)]))
        e[left] = total + a ** (left - 1) * decide_at[-1]  # position L-1 ends the run either way
    return float(e[tokens])


def proposition1_bound(t1: float, t2: float, p: float, tokens: int) -> float:
    """Proposition 1: ``E[DSI] <= t1 p (N - 1) + t2 ((1 - p)(N - 1) + 1)`` (drafter t1, target t2)."""
    if not 0 <= p <= 1:
        raise ConfigError(f"p={p!r} must be in [0, 1]")
    return t1 * p * (tokens - 1) + t2 * ((1 - p) * (tokens - 1) + 1)


def dsi_lower_bound(c: float, k: int, tokens: int, failure_cost: float = 1.0) -> float:
    """The offline simulator's sanity bound ``(floor(S / (k + 1)) - 1) c + T <= DSI`` (docs/simulator.md, 1)."""
    return (math.floor(tokens / (k + 1)) - 1) * c + failure_cost
