"""Figure 1 of the paper: speedups over the (c, a) plane from the offline simulator.

Grid as the authors': ``c`` and ``a`` on ``linspace(0, 1, ndim + 1)``, ``c`` raised to at least
0.01 (so it runs 0.01, 0.05, ..., 1; ``c = 1`` is the edge case of a drafter as slow as the
target) and ``a`` clipped to [0.01, 0.99]; lookaheads ``k = 1..ndim``. For each (c, a) each
method takes its best ``k`` (lowest mean cost over the repeats). As in the authors' code, only
``(c, a, k)`` that satisfy Equation 1 with at most ``max_sp`` target servers are simulated, for
every method. SI uses one target server, so ``si_all_k=True`` lets it pick any ``k`` instead;
then at ``c = 0.01`` (where Equation 1 forces ``k >= 15`` on DSI) SI wins a few cells by about 1%.

Panels (each a ratio of times, > 1 means the second method is faster):
``nonsi_si`` = non-SI / SI, ``si_dsi`` = SI / DSI, ``nonsi_dsi`` = non-SI / DSI and
``min_dsi`` = min(SI, non-SI) / DSI. Ratios below 1 (slowdowns) are drawn in red.

A cell where no ``k`` in ``1..ndim`` meets Equation 1 with ``max_sp`` servers (``c = 0.01`` needs
``k >= 15`` with 7) has no valid configuration: its mean costs are NaN, its ``k`` and servers the
sentinel 0, and every panel that reads it is NaN there, drawn as a grey "no valid k" cell and
counted as such (``cells_no_valid_k``), never as a slowdown. With ``si_all_k`` SI has a ``k`` in
every cell, so ``nonsi_si`` is filled there while the DSI panels stay blank.

The fifth panel, ``fixed_auto`` = best fixed k / event-driven, compares DSI's two policies in the
*event simulator* (both sides; the offline simulator has no event-driven policy): per cell, DSI
with the best fixed ``k`` in ``1..ndim``, each with ``min(max_sp, Equation 1)`` servers (tasks
queue when Equation 1 asks for more), against the event-driven policy (``lookahead="auto"``)
with ``max_sp`` servers, on the same ``event_repeats`` acceptance patterns of ``event_tokens``
tokens (fewer than the other panels: the event simulator runs one configuration at a time).
The best fixed ``k`` is found exactly but without simulating every ``k``: with TTFT = TPOT,
``c <= T``, no preemption delay and FIFO queueing, each epoch of a fixed-``k`` run has a lower
bound in closed form (:func:`fixed_k_lower_bounds`: drafting, and queueing behind the earlier
tasks of the epoch), so lookaheads are simulated in increasing order of that bound until the
bound reaches the best time found (tests check the result equals simulating every ``k``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dsi.errors import ConfigError
from dsi.sim.events import random_matches, simulate
from dsi.sim.files import figure_class, prepare_out_dir, write_csv
from dsi.sim.offline import required_sp_array, simulate_many

PANELS: dict[str, str] = {
    "nonsi_si": "non-SI / SI",
    "si_dsi": "SI / DSI",
    "nonsi_dsi": "non-SI / DSI",
    "min_dsi": "min(SI, non-SI) / DSI",
    "fixed_auto": "DSI: best fixed k / event-driven",
}
EVENT_PANEL = "fixed_auto"
FORMATS = ("png", "pdf")
EVENT_TOKENS = 100  # defaults of the event-simulator panel (it runs one configuration at a time)
EVENT_REPEATS = 2


def check_panels(panels) -> tuple[str, ...]:
    panels = tuple(panels) if panels else tuple(PANELS)
    for panel in panels:
        if panel not in PANELS:
            raise ConfigError(f"panel={panel!r} is unknown; choose from {', '.join(PANELS)}")
    return panels


def grid(ndim: int = 20, c_min: float = 0.01, a_min: float = 0.01, a_max: float = 0.99):
    """``(c_values [ndim+1], a_values [ndim+1], lookaheads [ndim])`` of Figure 1."""
    if not isinstance(ndim, int) or isinstance(ndim, bool) or ndim < 2:
        raise ConfigError(f"ndim={ndim!r} must be an integer >= 2")
    c = np.maximum(np.linspace(0.0, 1.0, ndim + 1), c_min)
    a = np.clip(np.linspace(0.0, 1.0, ndim + 1), a_min, a_max)
    return c, a, np.arange(1, ndim + 1)


@dataclass(frozen=True)
class HeatmapResult:
    c: np.ndarray  # [nc]
    a: np.ndarray  # [na]
    lookaheads: np.ndarray  # [nk]
    nonsi: float
    si: np.ndarray  # [nc, na] best mean cost (NaN where SI has no valid k; with si_all_k never)
    k_si: np.ndarray  # [nc, na] its k (0: none)
    dsi: np.ndarray  # [nc, na] best mean cost over Eq. 1-valid k (NaN if none)
    k_dsi: np.ndarray  # [nc, na] its k (0: none)
    sp_dsi: np.ndarray  # [nc, na] Equation 1 servers of the chosen k (0: none)
    configs: int  # (c, a, k) simulated
    valid_dsi_configs: int
    si_all_k: bool
    tokens: int
    repeats: int
    seed: int
    max_sp: int
    seconds: float  # simulation wall time (no plotting)
    # the event-simulator panel (None when not computed)
    ev_fixed: np.ndarray | None = None  # [nc, na] best fixed-k DSI mean time
    ev_k_fixed: np.ndarray | None = None  # [nc, na] its k
    ev_sp_fixed: np.ndarray | None = None  # [nc, na] its servers: min(max_sp, Equation 1)
    ev_auto: np.ndarray | None = None  # [nc, na] event-driven DSI mean time, max_sp servers
    ev_window: np.ndarray | None = None  # [nc, na] its mean window (drafts)
    event_tokens: int = 0
    event_repeats: int = 0
    event_simulations: int = 0  # event-simulator configurations run (fixed k and auto)
    event_seconds: float = 0.0

    @property
    def no_valid_k(self) -> np.ndarray:
        """``[nc, na]`` True where no ``k`` in ``1..ndim`` meets Equation 1 with ``max_sp`` servers (DSI blank)."""
        return np.isnan(self.dsi)

    @property
    def panels(self) -> tuple[str, ...]:
        """The panels this result holds."""
        return tuple(p for p in PANELS if p != EVENT_PANEL or self.ev_auto is not None)

    def ratio(self, panel: str) -> np.ndarray:
        """``[nc, na]`` ratio of the panel; NaN where a method it reads has no valid ``k``."""
        check_panels([panel])
        if panel == EVENT_PANEL:
            if self.ev_auto is None:
                raise ConfigError(f"panel {EVENT_PANEL!r} was not computed (event_panel=False)")
            return self.ev_fixed / self.ev_auto
        if panel == "nonsi_si":
            return self.nonsi / self.si
        if panel == "si_dsi":
            return self.si / self.dsi
        if panel == "nonsi_dsi":
            return self.nonsi / self.dsi
        return np.minimum(self.si, self.nonsi) / self.dsi

    def rows(self) -> list[dict]:
        ratios = {p: self.ratio(p) for p in self.panels}
        out = []
        for i, c in enumerate(self.c):
            for j, a in enumerate(self.a):
                row = {
                    "c": float(c),
                    "a": float(a),
                    "nonsi": self.nonsi,
                    "si": float(self.si[i, j]),
                    "k_si": int(self.k_si[i, j]),  # 0 (and NaN costs): no valid k
                    "dsi": float(self.dsi[i, j]),
                    "k_dsi": int(self.k_dsi[i, j]),
                    "sp_dsi": int(self.sp_dsi[i, j]),
                }
                if self.ev_auto is not None:
                    row.update(
                        ev_fixed=float(self.ev_fixed[i, j]),
                        ev_k_fixed=int(self.ev_k_fixed[i, j]),
                        ev_sp_fixed=int(self.ev_sp_fixed[i, j]),
                        ev_auto=float(self.ev_auto[i, j]),
                        ev_window=float(self.ev_window[i, j]),
                    )
                row.update({p: float(r[i, j]) for p, r in ratios.items()})
                out.append(row)
        return out

    def summary(self) -> dict:
        """Counts and extremes; cells without a valid ``k`` are counted apart (``cells_no_valid_k``: DSI,
        ``cells_si_no_valid_k``: SI), not as slower, and the extremes skip them (None if a panel has none)."""
        si_valid = ~np.isnan(self.si)
        si_slower = si_valid & (self.si > self.nonsi)
        return {
            "ndim": len(self.lookaheads),
            "cells": int(self.si.size),
            "configs": self.configs,
            "valid_dsi_configs": self.valid_dsi_configs,
            "si_all_k": self.si_all_k,
            "tokens": self.tokens,
            "repeats": self.repeats,
            "seed": self.seed,
            "max_sp": self.max_sp,
            "simulation_seconds": self.seconds,
            "cells_no_valid_k": int(self.no_valid_k.sum()),
            "cells_si_no_valid_k": int((~si_valid).sum()),
            "cells_si_slower_than_nonsi": int(si_slower.sum()),
            # of the cells where SI has a valid k
            "fraction_si_slower_than_nonsi": float(si_slower.sum() / si_valid.sum()) if si_valid.any() else None,
            "cells_dsi_slower_than_si": int(np.sum(self.dsi > self.si)),
            "cells_dsi_slower_than_nonsi": int(np.sum(self.dsi > self.nonsi)),
            **{f"min_{p}": _extreme(np.min, self.ratio(p)) for p in self.panels},
            **{f"max_{p}": _extreme(np.max, self.ratio(p)) for p in self.panels},
            **self._event_summary(),
        }

    def _event_summary(self) -> dict:
        if self.ev_auto is None:
            return {"event_panel": False}
        r = self.ratio(EVENT_PANEL)
        return {
            "event_panel": True,
            "event_tokens": self.event_tokens,
            "event_repeats": self.event_repeats,
            "event_simulations": self.event_simulations,
            "event_seconds": self.event_seconds,
            "cells_event_driven_faster": int(np.sum(r > 1 + 1e-9)),
            "cells_event_driven_slower": int(np.sum(r < 1 - 1e-9)),
            "median_fixed_auto": float(np.median(r)),
        }


def _extreme(reduce, values: np.ndarray) -> float | None:
    """``reduce`` over the non-NaN values; None when there are none."""
    kept = values[~np.isnan(values)]
    return float(reduce(kept)) if kept.size else None


def _epochs(patterns) -> tuple[np.ndarray, np.ndarray, int]:
    """The epochs of fixed-lookahead DSI on ``patterns``: draft offsets ``j`` of their ends (first
    rejection, or the last position) and tokens ``L`` left at their starts, for the epochs with
    ``j >= 1``; and the number of epochs with ``j = 0``."""
    offsets, lefts, zero = [], [], 0
    for pattern in patterns:
        n, i = len(pattern), 0
        misses = np.flatnonzero(~np.asarray(pattern, dtype=bool)).tolist()
        m = 0
        while i < n:
            while m < len(misses) and misses[m] < i:
                m += 1
            left = n - i
            j = min(misses[m] - i, left - 1) if m < len(misses) else left - 1
            if j > 0:
                offsets.append(j)
                lefts.append(left)
            else:
                zero += 1
            i += j + 1
    return np.array(offsets, dtype=np.int64), np.array(lefts, dtype=np.int64), zero


def fixed_k_lower_bounds(patterns, c_vals, ks, servers=None) -> np.ndarray:
    """``[nc, nk]`` lower bounds of the mean time of fixed-``k`` DSI (target forward T = 1).

    Event simulator with TTFT = TPOT, ``c <= 1``, no preemption delay and a FIFO queue. An epoch
    that starts with ``L`` tokens left and ends at draft offset ``j`` (its first rejection, or
    ``L - 1``) costs exactly 1 if ``j = 0``; otherwise position ``j`` is decided by window
    ``m = ceil(j / k)``, sent after ``min(m k, L)`` drafts and the ``m + 1``-th task of the epoch:
    with ``S`` servers, all free at a restart, it cannot start before ``floor(m / S)`` target
    forwards have passed (``s_{i+S} >= s_i + T`` in FIFO order). So the epoch costs at least
    ``max(min(m k, L) c, floor(m / S)) + 1``, exactly ``min(m k, L) c + 1`` with unlimited
    servers (``servers=None``; docs/simulator.md section 3). ``servers``: ``[nc, nk]``.
    """
    ks = np.asarray(ks, dtype=np.int64)
    c_vals = np.asarray(c_vals, dtype=np.float64)
    offsets, lefts, zero = _epochs(patterns)
    count = len(patterns)
    windows = -(-offsets[:, None] // ks[None, :])  # [E, nk] the deciding window m
    drafts = np.minimum(windows * ks[None, :], lefts[:, None])  # [E, nk] drafts in its context
    out = np.empty((len(c_vals), len(ks)))
    for i, c in enumerate(c_vals):
        ready = drafts * c
        if servers is not None:
            ready = np.maximum(ready, windows // np.asarray(servers[i])[None, :])
        out[i] = (zero + len(offsets) + ready.sum(axis=0)) / count
    return out


def event_panel(
    c_vals: np.ndarray,
    a_vals: np.ndarray,
    ks: np.ndarray,
    *,
    tokens: int = EVENT_TOKENS,
    repeats: int = EVENT_REPEATS,
    seed: int = 42,
    max_sp: int = 7,
    exhaustive: bool = False,
) -> dict:
    """Per (c, a): best fixed-k DSI and event-driven DSI in the event simulator (target forward = 1).

    Fixed ``k`` in ``ks`` with ``min(max_sp, Equation 1)`` servers; event-driven with ``max_sp``.
    Both read the same ``repeats`` patterns per ``a`` (from ``seed``). ``exhaustive`` simulates
    every ``k`` instead of stopping at the lower bound (same result; for tests).
    """
    c_vals = np.asarray(c_vals, dtype=np.float64)
    if np.any(c_vals > 1):
        raise ConfigError(f"the event panel's lower bound needs c <= 1 (the drafter no slower than the target); "
                          f"got c={c_vals.max():g}")
    ks = np.asarray(ks)
    shape = (len(c_vals), len(a_vals))
    fixed, auto, window = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    k_fixed, sp_fixed = np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=np.int64)
    runs = 0
    C, K = np.meshgrid(c_vals, ks, indexing="ij")
    need_all = required_sp_array(C.ravel(), 1.0, K.ravel()).reshape(C.shape)  # [nc, nk] Equation 1
    servers_all = np.minimum(max_sp, need_all)
    for j, a in enumerate(a_vals):
        patterns = random_matches(float(a), tokens, repeats=repeats, seed=seed)
        bounds = fixed_k_lower_bounds(patterns, c_vals, ks, servers_all)  # [nc, nk]
        for i, c in enumerate(c_vals):
            kw = dict(target_tpot=1.0, drafter_tpot=float(c), matches=patterns)
            need, servers = need_all[i], servers_all[i]
            best, best_at = np.inf, -1
            k1 = np.flatnonzero(ks == 1)
            if not exhaustive and k1.size and need[k1[0]] <= max_sp:
                # max_sp meets Equation 1 for k = 1: the event-driven policy never waits for a
                # server, so it sends every draft alone, as k = 1 does (identical runs, tested)
                best_at = int(k1[0])
                ev = simulate("dsi", lookahead=1, num_servers=int(servers[best_at]), **kw)
                best = ev.mean
            else:
                ev = simulate("dsi", lookahead="auto", num_servers=max_sp, **kw)
            runs += 1
            auto[i, j], window[i, j] = ev.mean, ev.mean_window
            for idx in np.argsort(bounds[i], kind="stable"):
                if idx == best_at:
                    continue
                if not exhaustive and bounds[i, idx] >= best - 1e-9 * max(1.0, best):
                    break  # no remaining k can be faster
                mean = simulate("dsi", lookahead=int(ks[idx]), num_servers=int(servers[idx]), **kw).mean
                runs += 1
                if mean < best - 1e-9 or (mean <= best + 1e-9 and ks[idx] < ks[best_at]):
                    best, best_at = mean, idx
            fixed[i, j], k_fixed[i, j], sp_fixed[i, j] = best, ks[best_at], servers[best_at]
    return {"ev_fixed": fixed, "ev_k_fixed": k_fixed, "ev_sp_fixed": sp_fixed, "ev_auto": auto, "ev_window": window,
            "event_simulations": runs}  # fmt: skip


_event_panel = event_panel  # compute_heatmap's flag of the same name shadows it


def compute_heatmap(
    ndim: int = 20,
    *,
    tokens: int = 1000,
    repeats: int = 5,
    seed: int = 42,
    max_sp: int = 7,
    rng: str = "pcg64",
    si_all_k: bool = False,
    progress: bool = False,
    event_panel: bool = True,
    event_tokens: int = EVENT_TOKENS,
    event_repeats: int = EVENT_REPEATS,
) -> HeatmapResult:
    """Simulate every (c, a, k) of the grid at once and keep each method's best k per cell.

    With ``event_panel`` also the event simulator's ``fixed_auto`` panel, on ``event_tokens``
    tokens x ``event_repeats`` repeats (see :func:`event_panel`).
    """
    if not isinstance(max_sp, int) or isinstance(max_sp, bool) or max_sp < 1:
        raise ConfigError(f"max_sp={max_sp!r} must be an integer >= 1")
    for name, value in (("event_tokens", event_tokens), ("event_repeats", event_repeats)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name}={value!r} must be an integer >= 1")
    c_vals, a_vals, ks = grid(ndim)
    C, A, K = np.meshgrid(c_vals, a_vals, ks, indexing="ij")  # [nc, na, nk]
    start = time.perf_counter()
    si, dsi = simulate_many(
        C.ravel(), A.ravel(), K.ravel(), tokens=tokens, repeats=repeats, seed=seed, rng=rng, progress=progress
    )  # [N, R] each
    seconds = time.perf_counter() - start
    shape = C.shape
    si_mean = si.mean(axis=1).reshape(shape)
    dsi_mean = dsi.mean(axis=1).reshape(shape)
    sp_need = required_sp_array(C.ravel(), 1.0, K.ravel()).reshape(shape)
    valid = sp_need <= max_sp
    dsi_valid = np.where(valid, dsi_mean, np.inf)
    si_pick = si_mean if si_all_k else np.where(valid, si_mean, np.inf)
    k_si_idx = np.argmin(si_pick, axis=2)  # [nc, na]
    k_dsi_idx = np.argmin(dsi_valid, axis=2)
    best_si = np.take_along_axis(si_pick, k_si_idx[..., None], axis=2)[..., 0]
    best_dsi = np.take_along_axis(dsi_valid, k_dsi_idx[..., None], axis=2)[..., 0]
    si_none, dsi_none = ~np.isfinite(best_si), ~np.isfinite(best_dsi)  # [nc, na] no valid k (inf above)
    best_si, best_dsi = np.where(si_none, np.nan, best_si), np.where(dsi_none, np.nan, best_dsi)
    sp_dsi = np.take_along_axis(sp_need, k_dsi_idx[..., None], axis=2)[..., 0]
    events: dict = {}
    if event_panel:
        start = time.perf_counter()
        events = _event_panel(c_vals, a_vals, ks, tokens=event_tokens, repeats=event_repeats, seed=seed, max_sp=max_sp)
        events.update(event_tokens=event_tokens, event_repeats=event_repeats,
                      event_seconds=time.perf_counter() - start)  # fmt: skip
    return HeatmapResult(
        c=c_vals,
        a=a_vals,
        lookaheads=ks,
        nonsi=float(tokens),
        si=best_si,
        k_si=np.where(si_none, 0, ks[k_si_idx]),
        dsi=best_dsi,
        k_dsi=np.where(dsi_none, 0, ks[k_dsi_idx]),
        sp_dsi=np.where(dsi_none, 0, sp_dsi),
        configs=int(C.size),
        valid_dsi_configs=int(valid.sum()),
        si_all_k=si_all_k,
        tokens=tokens,
        repeats=repeats,
        seed=seed,
        max_sp=max_sp,
        seconds=seconds,
        **events,
    )


NO_VALID_K_COLOUR = "0.85"  # light grey: cells with no valid configuration


def ratio_layers(ratio: np.ndarray) -> tuple[np.ma.MaskedArray, np.ma.MaskedArray, np.ndarray]:
    """A panel's ratio ``[..]`` split into what the figure draws: speedups (>= 1), slowdowns (< 1),
    and the cells with no valid configuration (NaN), which are in neither (grey, "no valid k")."""
    blank = np.isnan(ratio)
    faster = np.ma.masked_where(blank | (ratio < 1), ratio)
    slower = np.ma.masked_where(blank | (ratio >= 1), ratio)
    return faster, slower, blank


def plot_heatmap(result: HeatmapResult, out_dir: Path, panels=None, formats=FORMATS, dpi: int = 110) -> list[Path]:
    """Draw the panels (:func:`heatmap_figure`) and save one file per format."""
    for fmt in formats:
        if fmt not in FORMATS:
            raise ConfigError(f"format={fmt!r} must be one of {', '.join(FORMATS)}")
    fig = heatmap_figure(result, panels)
    written = []
    for fmt in formats:
        path = Path(out_dir) / f"heatmap.{fmt}"
        fig.savefig(path, dpi=dpi)
        written.append(path)
    return written


def heatmap_figure(result: HeatmapResult, panels=None):
    """The panels side by side (2 x 2 for four, 3 x 2 for five), a matplotlib ``Figure``."""
    panels = check_panels(panels) if panels else result.panels
    Figure = figure_class()
    from matplotlib import colormaps
    from matplotlib.colors import ListedColormap, LogNorm, Normalize

    ncols = 1 if len(panels) == 1 else 3 if len(panels) > 4 else 2
    nrows = (len(panels) + ncols - 1) // ncols
    fig = Figure(figsize=(5.2 * ncols, 4.2 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    up, down = colormaps["viridis"], colormaps["Reds_r"]
    for ax, panel in zip(axes, panels, strict=False):
        ratio = result.ratio(panel).T  # [na, nc]: rows = a (y), columns = c (x)
        faster, slower, blank = ratio_layers(ratio)
        top = max(1.01, float(faster.max()) if faster.count() else 1.0)
        norm = LogNorm(1.0, top) if top > 4 else Normalize(1.0, top)
        mesh = ax.pcolormesh(result.c, result.a, faster, cmap=up, norm=norm, shading="nearest")
        bar = fig.colorbar(mesh, ax=ax, label="speedup (x)")
        if isinstance(norm, LogNorm):
            ticks = [t for t in (1, 1.5, 2, 3, 5, 10, 20, 50, 100) if t <= top]
            bar.set_ticks(ticks, labels=[f"{t:g}" for t in ticks])
            bar.minorticks_off()
        if slower.count():
            low = float(slower.min())
            # ratios just below 1 stay clearly red (not white): 1 maps to 2/3 of the colormap
            ax.pcolormesh(result.c, result.a, slower, cmap=down, vmin=low, vmax=1 + 0.5 * (1 - low), shading="nearest")
            ax.plot([], [], "s", color=down(0.3), label=f"slowdown (< 1; min {low:.2f})")
        if blank.any():
            grey = np.ma.masked_where(~blank, np.zeros(blank.shape))
            ax.pcolormesh(result.c, result.a, grey, cmap=ListedColormap([NO_VALID_K_COLOUR]), shading="nearest")
            ax.plot([], [], "s", color=NO_VALID_K_COLOUR,
                    label=f"no valid k (Equation 1: SP > {result.max_sp} for every k <= {len(result.lookaheads)})")
        if slower.count() or blank.any():
            ax.legend(loc="lower left", fontsize=7, framealpha=0.8)
        title = PANELS[panel]
        if panel == EVENT_PANEL:
            title += (
                f"\n(event simulator, {result.event_tokens} tokens x {result.event_repeats} repeats, "
                f"SP {result.max_sp}; k in 1..{len(result.lookaheads)})"
            )
        ax.set_title(title, fontsize=10 if panel == EVENT_PANEL else None)
        ax.set_xlabel("c = drafter latency / target latency")
        ax.set_ylabel("a = acceptance rate")
    fig.suptitle(
        f"Offline simulator, {result.tokens} tokens x {result.repeats} repeats, best k in 1..{len(result.lookaheads)}, "
        f"DSI with SP <= {result.max_sp}"
        + ("; last panel: event simulator" if EVENT_PANEL in panels else ""),
        fontsize=9,
    )
    return fig


def write_heatmap(result: HeatmapResult, out_dir, panels=None, plot: bool = True, formats=FORMATS) -> list[Path]:
    """CSV (always) and the figure (``plot``) under ``out_dir``; returns the files written."""
    panels = check_panels(panels) if panels else result.panels
    for panel in panels:
        if panel not in result.panels:
            raise ConfigError(f"panel {panel!r} was not computed (the event panel was switched off)")
    out = prepare_out_dir(out_dir)
    files = [write_csv(out / "heatmap.csv", result.rows())]
    if plot:
        files += plot_heatmap(result, out, panels, formats)
    return files
