"""The paper's offline simulator (docs/simulator.md section 1): non-SI, SI and DSI in time units (target = 1).

It reproduces the accounting of the authors' public simulator (``dsi/offline/simul``), not the
real algorithm's timing (that is :mod:`dsi.sim.events`). Inputs: drafter latency ``c`` (in the
target's unit, so a fraction of it when ``T = 1``), acceptance rate ``a``, lookahead ``k``, ``S`` tokens to generate,
the target latency ``T`` (``failure_cost``), ``repeats`` and ``seed``; DSI also needs ``SP``
target servers, at least Equation 1's ``ceil(T / (k c))``.

Randomness. Each window (DSI) or iteration (SI) consumes one sample ``n = min(k, G - 1)``,
``G ~ Geometric(1 - a)`` on ``{1, 2, ...}``: the number of drafts accepted. For each repeat
``r`` the stream of samples is a function of ``(seed, r, a)`` only, and SI and DSI read the same
stream (common random numbers, as in the authors' code, which re-seeds before each method).
Two generators are offered:

- ``rng="pcg64"`` (default): one uniform ``U[r, t]`` per repeat and step from
  ``np.random.default_rng(seed)``, shared by every configuration, and ``n = floor(log U /
  log a)`` (inverse CDF). A configuration's result never depends on what else is simulated
  alongside it, and a whole grid costs one ``[repeats, S]`` table of uniforms.
- ``rng="legacy"``: the authors' stream, ``np.random.RandomState(seed).geometric(1 - a,
  size=S)`` per repeat. It reproduces their published means to the last digit (seed 42,
  ``S = 1000``, 5 repeats, ``c = 0.1``, ``a = 0.9``, ``k = 5``: SI 322.24, DSI 219.18).

Speed. :func:`simulate_many` advances every (configuration, repeat) at once: one numpy step per
window, finished rows are compacted away, so the whole Figure 1 grid (8,820 configurations x 5
repeats x 1,000 tokens) takes about a second. :func:`reference_si` and :func:`reference_dsi` are
the plain loops of section 5, kept as the specification the fast path is tested against.

Rule of section 5 that changes nothing here: "immediate pruning" (a window rejected at its first
token right after a verification costs no drafting) only applies to the first window of a
segment, and that segment costs ``min(seg, new T) = T`` either way, so the fast path omits it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from dsi.errors import ConfigError

RNGS = ("pcg64", "legacy")
_EQ1_RTOL = 1e-9  # T / (k c) within this of an integer counts as that integer (float noise)


# ---- Equation 1 -------------------------------------------------------------------------------
def _ceil_tolerant(x: float) -> int:
    nearest = round(x)
    if abs(x - nearest) <= _EQ1_RTOL * max(1.0, abs(x)):
        return int(nearest)
    return int(math.ceil(x))


def required_sp(c: float, failure_cost: float = 1.0, lookahead: int = 1) -> int:
    """Equation 1: target servers needed so that no verification task waits, ``ceil(T / (k c))``.

    ``c`` and ``failure_cost`` are in the same unit (any: time units, ms). A quotient within
    1e-9 (relative) of an integer counts as that integer, so ``(c, T, k) = (0.01, 2, 10)`` gives 20
    although ``2 / (10 * 0.01)`` is 20.000000000000004 in floating point.
    """
    _check_positive("c", c)
    _check_positive("failure_cost", failure_cost)
    _check_lookahead(lookahead)
    return max(1, _ceil_tolerant(failure_cost / (lookahead * c)))


def required_sp_array(c: np.ndarray, failure_cost: float, k: np.ndarray) -> np.ndarray:
    """Vectorised :func:`required_sp` (no validation).  # [N] int64"""
    x = failure_cost / (np.asarray(k, dtype=np.float64) * np.asarray(c, dtype=np.float64))
    nearest = np.rint(x)
    close = np.abs(x - nearest) <= _EQ1_RTOL * np.maximum(1.0, np.abs(x))
    return np.maximum(1, np.where(close, nearest, np.ceil(x))).astype(np.int64)


def min_lookahead(c: float, failure_cost: float = 1.0, sp: int = 7) -> int:
    """Equation 1 solved for k: the smallest lookahead with which ``sp`` servers suffice."""
    _check_positive("c", c)
    _check_positive("failure_cost", failure_cost)
    if not _is_int(sp) or sp < 1:
        raise ConfigError(f"sp={sp!r} must be an integer >= 1")
    return max(1, _ceil_tolerant(failure_cost / (sp * c)))


# ---- validation -------------------------------------------------------------------------------
def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int | float | np.integer | np.floating) or isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be a number > 0")
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name}={value!r} must be a finite number > 0")


def _check_lookahead(k: object) -> None:
    if not _is_int(k) or k < 1:
        raise ConfigError(f"lookahead={k!r} must be an integer >= 1")


def check_c(c: object, failure_cost: float = 1.0, allow_equal: bool = False) -> float:
    """The drafter latency ``c`` must be in (0, T): faster than the target (``allow_equal``: (0, T])."""
    interval = f"(0, {failure_cost:g}]" if allow_equal else f"(0, {failure_cost:g})"
    if not isinstance(c, int | float | np.integer | np.floating) or isinstance(c, bool):
        raise ConfigError(f"c={c!r} must be a number in {interval}")
    ok = 0 < c <= failure_cost if allow_equal else 0 < c < failure_cost
    if not ok or not math.isfinite(c):
        why = "" if allow_equal else ": the drafter must be faster than the target"
        raise ConfigError(f"c={c!r} must be in {interval}{why}")
    return float(c)


def check_a(a: object) -> float:
    if not isinstance(a, int | float | np.integer | np.floating) or isinstance(a, bool):
        raise ConfigError(f"a={a!r} must be a number in [0, 1]")
    if not 0 <= a <= 1:
        raise ConfigError(f"a={a!r} must be in [0, 1]")
    return float(a)


def _check_common(tokens: object, failure_cost: object, repeats: object, seed: object, rng: object) -> None:
    if not _is_int(tokens) or tokens < 1:
        raise ConfigError(f"tokens={tokens!r} must be an integer >= 1")
    _check_positive("failure_cost", failure_cost)
    if not _is_int(repeats) or repeats < 1:
        raise ConfigError(f"repeats={repeats!r} must be an integer >= 1")
    if not _is_int(seed) or seed < 0:
        raise ConfigError(f"seed={seed!r} must be an integer >= 0")
    if rng not in RNGS:
        raise ConfigError(f"rng={rng!r} must be one of {', '.join(RNGS)}")


# ---- samplers -----------------------------------------------------------------------------------
class _PCGSampler:
    """``n = min(k, floor(log U[r, t] / log a))`` with ``U`` shared by every configuration."""

    def __init__(self, a: np.ndarray, repeats: int, tokens: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        u = rng.random((tokens, repeats)) + 2.0**-54  # [S, R] in (0, 1)
        self.log_u = np.log(u)  # [S, R], < 0
        with np.errstate(divide="ignore"):
            log_a = np.log(a)  # [N]; -inf at a = 0, 0 at a = 1
            self.inv_log_a = np.where(a >= 1.0, -np.inf, 1.0 / log_a)  # a = 0 -> -0.0 -> n = 0

    def draw(self, t: int, cfg: np.ndarray, rep: np.ndarray, k: np.ndarray) -> np.ndarray:
        x = self.log_u[t][rep] * self.inv_log_a[cfg]  # [A] >= 0 (+inf when a = 1)
        np.minimum(x, k, out=x)
        return np.floor(x, out=x)


class _LegacySampler:
    """The authors' stream: ``RandomState(seed).geometric(1 - a, size=S)`` per repeat, per ``a``."""

    def __init__(self, a: np.ndarray, repeats: int, tokens: int, seed: int) -> None:
        values, self.a_index = np.unique(a, return_inverse=True)
        table = np.empty((len(values), repeats, tokens), dtype=np.float64)  # [A_distinct, R, S]
        for i, value in enumerate(values):
            if value <= 0.0:
                table[i] = 0.0
            elif value >= 1.0:
                table[i] = np.inf
            else:
                table[i] = np.random.RandomState(seed).geometric(1.0 - value, size=(repeats, tokens)) - 1
        self.table = table

    def draw(self, t: int, cfg: np.ndarray, rep: np.ndarray, k: np.ndarray) -> np.ndarray:
        return np.minimum(self.table[self.a_index[cfg], rep, t], k)


def _sampler(rng: str, a: np.ndarray, repeats: int, tokens: int, seed: int):
    cls = _LegacySampler if rng == "legacy" else _PCGSampler
    return cls(a, repeats, tokens, seed)


# ---- the fast path ------------------------------------------------------------------------------
def simulate_many(
    c: np.ndarray,
    a: np.ndarray,
    k: np.ndarray,
    *,
    tokens: int = 1000,
    failure_cost: float = 1.0,
    repeats: int = 5,
    seed: int = 42,
    rng: str = "pcg64",
    progress: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """SI and DSI costs of many configurations at once: ``(si [N, R], dsi [N, R])``.

    ``c``, ``a``, ``k`` are broadcast to one shape ``[N]``. No Equation 1 check here (the caller
    decides which DSI configurations are valid); ``c`` may be 1 (a drafter as slow as the target,
    the edge of Figure 1). Non-SI costs ``tokens * failure_cost`` for every configuration.
    """
    c, a, k = (np.atleast_1d(np.asarray(v, dtype=np.float64)) for v in (c, a, k))
    c, a, k = np.broadcast_arrays(c, a, k)
    c, a, k = c.ravel(), a.ravel(), k.ravel()
    _check_common(tokens, failure_cost, repeats, seed, rng)
    if c.size and not (np.all(c > 0) and np.all(c <= failure_cost)):
        raise ConfigError(f"every c must be in (0, {failure_cost:g}]; got min {c.min()}, max {c.max()}")
    if a.size and not (np.all(a >= 0) and np.all(a <= 1)):
        raise ConfigError(f"every a must be in [0, 1]; got min {a.min()}, max {a.max()}")
    if k.size and not (np.all(k >= 1) and np.all(k == np.floor(k))):
        bad = k[(k < 1) | (k != np.floor(k))]
        raise ConfigError(f"every lookahead k must be an integer >= 1; got {bad[0]:g}")
    n_cfg = c.size
    S, T = int(tokens), float(failure_cost)
    sampler = _sampler(rng, a, repeats, S, seed)

    rows = n_cfg * repeats
    out_si = np.zeros(rows)
    out_dsi = np.zeros(rows)
    # state of the active rows; row = cfg * repeats + rep
    idx = np.arange(rows)
    cfg, rep = idx // repeats, idx % repeats
    kr, cr = k[cfg], c[cfg]  # [A]
    si_cost, si_done = np.zeros(rows), np.zeros(rows)
    cost, done, new, seg = np.zeros(rows), np.zeros(rows), np.zeros(rows), np.zeros(rows)

    bar = _progress_bar(rows, progress)
    s1 = float(S - 1)
    for t in range(S):  # each step advances every unfinished row by >= 1 token
        if idx.size == 0:
            break
        n = sampler.draw(t, cfg, rep, kr)  # [A] accepted drafts of this window / iteration
        # SI: one iteration per step (it never needs more steps than DSI: it gains n + 1 >= DSI's gain)
        si_live = si_done < S
        kk = np.minimum(kr, (S - 1) - si_done)
        si_cost += np.where(si_live, kk * cr + T, 0.0)
        si_done += np.where(si_live, n + 1.0, 0.0)
        # DSI: one window per step
        kk = np.minimum(kr, s1 - done - new)  # >= 0
        acc = np.minimum(kk, n)
        new += acc
        seg += kk
        rejected = (acc < kk) | (kk <= 0)
        new += rejected
        cost += np.where(rejected, np.minimum(seg * cr + T, new * T), 0.0)
        done += np.where(rejected, new, 0.0)
        keep = ~rejected
        new *= keep
        seg *= keep
        finished = done >= S
        n_finished = int(np.count_nonzero(finished))
        if n_finished and (n_finished * 8 >= idx.size or t % 64 == 63):
            out_si[idx[finished]] = si_cost[finished]
            out_dsi[idx[finished]] = cost[finished]
            live = ~finished
            idx, cfg, rep, kr, cr = idx[live], cfg[live], rep[live], kr[live], cr[live]
            si_cost, si_done, cost, done, new, seg = (v[live] for v in (si_cost, si_done, cost, done, new, seg))
            bar.update(n_finished)
    if idx.size:  # only reachable if S steps did not finish a row, which cannot happen
        raise AssertionError(f"{idx.size} rows unfinished after {S} steps")
    bar.close()
    return out_si.reshape(n_cfg, repeats), out_dsi.reshape(n_cfg, repeats)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="simulating", unit="run", file=sys.stderr, leave=False)


# ---- one configuration ---------------------------------------------------------------------------
@dataclass(frozen=True)
class OfflineResult:
    """Costs in time units (target forward = ``failure_cost``) of each repeat, per method."""

    c: float
    a: float
    lookahead: int
    tokens: int
    failure_cost: float
    repeats: int
    seed: int
    sp: int | None
    rng: str
    nonsi: np.ndarray  # [R]
    si: np.ndarray  # [R]
    dsi: np.ndarray  # [R]

    @property
    def required_sp(self) -> int:
        return required_sp(self.c, self.failure_cost, self.lookahead)

    def mean(self, method: str) -> float:
        return float(np.mean(self._costs(method)))

    def _costs(self, method: str) -> np.ndarray:
        if method not in ("nonsi", "si", "dsi"):
            raise ConfigError(f"method={method!r} must be one of nonsi, si, dsi")
        return getattr(self, method)

    def to_dict(self) -> dict:
        means = {m: self.mean(m) for m in ("nonsi", "si", "dsi")}
        methods = {}
        for m in ("nonsi", "si", "dsi"):
            costs = self._costs(m)
            methods[m] = {
                "mean": means[m],
                "std": float(np.std(costs, ddof=1)) if costs.size > 1 else 0.0,
                "per_repeat": costs.tolist(),
                "speedup_vs_nonsi": means["nonsi"] / means[m],
                "speedup_vs_si": means["si"] / means[m],
            }
        return {
            "config": {
                "c": self.c,
                "a": self.a,
                "lookahead": self.lookahead,
                "tokens": self.tokens,
                "failure_cost": self.failure_cost,
                "repeats": self.repeats,
                "seed": self.seed,
                "sp": self.sp,
                "required_sp": self.required_sp,
                "rng": self.rng,
            },
            **methods,
        }


def simulate_offline(
    c: float,
    a: float,
    lookahead: int,
    *,
    tokens: int = 1000,
    failure_cost: float = 1.0,
    repeats: int = 5,
    seed: int = 42,
    sp: int | None = 7,
    rng: str = "pcg64",
) -> OfflineResult:
    """Simulate non-SI, SI and DSI for one configuration (docs/simulator.md section 1).

    ``c`` in (0, 1), ``a`` in [0, 1], ``lookahead >= 1``; ``sp`` target servers (None: as many
    as needed) must satisfy Equation 1, otherwise :class:`ConfigError` names the minimum.
    """
    _check_common(tokens, failure_cost, repeats, seed, rng)
    c = check_c(c, failure_cost)
    a = check_a(a)
    _check_lookahead(lookahead)
    if sp is not None:
        if not _is_int(sp) or sp < 1:
            raise ConfigError(f"sp={sp!r} must be an integer >= 1 (or None for unlimited)")
        need = required_sp(c, failure_cost, lookahead)
        if sp < need:
            raise ConfigError(
                f"sp={sp} target servers are too few for c={c}, lookahead={lookahead}: Equation 1 "
                f"needs sp >= ceil(T / (k c)) = {need} (or lookahead >= "
                f"{min_lookahead(c, failure_cost, sp)} with sp={sp})"
            )
    si, dsi = simulate_many(
        np.array([c]), np.array([a]), np.array([lookahead]),
        tokens=tokens, failure_cost=failure_cost, repeats=repeats, seed=seed, rng=rng,
    )  # fmt: skip
    return OfflineResult(
        c=c, a=a, lookahead=int(lookahead), tokens=int(tokens), failure_cost=float(failure_cost),
        repeats=int(repeats), seed=int(seed), sp=None if sp is None else int(sp), rng=rng,
        nonsi=np.full(repeats, tokens * float(failure_cost)), si=si[0], dsi=dsi[0],
    )  # fmt: skip


def sample_stream(a: float, lookahead: int, *, tokens: int, repeats: int, seed: int, rng: str) -> np.ndarray:
    """The samples ``n`` (accepted drafts per window/iteration) repeat r reads: ``[R, S]``."""
    sampler = _sampler(rng, np.array([float(a)]), repeats, tokens, seed)
    out = np.empty((repeats, tokens))
    zeros = np.zeros(repeats, dtype=np.int64)
    reps = np.arange(repeats)
    ks = np.full(repeats, float(lookahead))
    for t in range(tokens):
        out[:, t] = sampler.draw(t, zeros, reps, ks)
    return out


# ---- the specification: plain loops of section 5 -------------------------------------------------
def reference_si(samples: Iterator[int], c: float, k: int, tokens: int, failure_cost: float = 1.0) -> float:
    """SI cost of one repeat, literally as section 5: ``kk = min(k, left - 1)``; cost ``kk c + T``."""
    cost, left = 0.0, tokens
    while left > 0:
        kk = min(k, left - 1)
        cost += kk * c + failure_cost
        left -= int(next(samples)) + 1
    return cost


def reference_dsi(samples: Iterator[int], c: float, k: int, tokens: int, failure_cost: float = 1.0) -> float:
    """DSI cost of one repeat, literally as section 5 (segments, immediate pruning, non-SI cap)."""
    cost, done, verified = 0.0, 0, False
    while done < tokens:
        new, seg = 0, 0.0
        while True:
            kk = min(k, tokens - 1 - done - new)
            acc = min(kk, int(next(samples)))
            new += acc
            if acc > 0 or not verified:
                seg += kk * c
            if kk == 0 or acc < kk:
                seg += failure_cost
                new += 1
                verified = True
                break
            verified = False
        cost += min(seg, new * failure_cost)
        done += new
    return cost
