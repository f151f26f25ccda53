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
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dsi.errors import ConfigError
from dsi.sim.files import figure_class, prepare_out_dir, write_csv
from dsi.sim.offline import required_sp_array, simulate_many

PANELS: dict[str, str] = {
    "nonsi_si": "non-SI / SI",
    "si_dsi": "SI / DSI",
    "nonsi_dsi": "non-SI / DSI",
    "min_dsi": "min(SI, non-SI) / DSI",
}
FORMATS = ("png", "pdf")


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
    si: np.ndarray  # [nc, na] best mean cost
    k_si: np.ndarray  # [nc, na]
    dsi: np.ndarray  # [nc, na] best mean cost over Eq. 1-valid k (nan if none)
    k_dsi: np.ndarray  # [nc, na]
    sp_dsi: np.ndarray  # [nc, na] Equation 1 servers of the chosen k
    configs: int  # (c, a, k) simulated
    valid_dsi_configs: int
    si_all_k: bool
    tokens: int
    repeats: int
    seed: int
    max_sp: int
    seconds: float  # simulation wall time (no plotting)

    def ratio(self, panel: str) -> np.ndarray:
        """``[nc, na]`` ratio of the panel."""
        check_panels([panel])
        if panel == "nonsi_si":
            return self.nonsi / self.si
        if panel == "si_dsi":
            return self.si / self.dsi
        if panel == "nonsi_dsi":
            return self.nonsi / self.dsi
        return np.minimum(self.si, self.nonsi) / self.dsi

    def rows(self) -> list[dict]:
        ratios = {p: self.ratio(p) for p in PANELS}
        out = []
        for i, c in enumerate(self.c):
            for j, a in enumerate(self.a):
                out.append(
                    {
                        "c": float(c),
                        "a": float(a),
                        "nonsi": self.nonsi,
                        "si": float(self.si[i, j]),
                        "k_si": int(self.k_si[i, j]),
                        "dsi": float(self.dsi[i, j]),
                        "k_dsi": int(self.k_dsi[i, j]),
                        "sp_dsi": int(self.sp_dsi[i, j]),
                        **{p: float(r[i, j]) for p, r in ratios.items()},
                    }
                )
        return out

    def summary(self) -> dict:
        si_slower = self.si > self.nonsi
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
            "cells_si_slower_than_nonsi": int(si_slower.sum()),
            "fraction_si_slower_than_nonsi": float(si_slower.mean()),
            "cells_dsi_slower_than_si": int(np.sum(self.dsi > self.si)),
            "cells_dsi_slower_than_nonsi": int(np.sum(self.dsi > self.nonsi)),
            **{f"min_{p}": float(np.nanmin(self.ratio(p))) for p in PANELS},
            **{f"max_{p}": float(np.nanmax(self.ratio(p))) for p in PANELS},
        }


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
) -> HeatmapResult:
    """Simulate every (c, a, k) of the grid at once and keep each method's best k per cell."""
    if not isinstance(max_sp, int) or isinstance(max_sp, bool) or max_sp < 1:
        raise ConfigError(f"max_sp={max_sp!r} must be an integer >= 1")
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
    best_dsi = np.where(np.isfinite(best_dsi), best_dsi, np.nan)
    return HeatmapResult(
        c=c_vals,
        a=a_vals,
        lookaheads=ks,
        nonsi=float(tokens),
        si=best_si,
        k_si=ks[k_si_idx],
        dsi=best_dsi,
        k_dsi=ks[k_dsi_idx],
        sp_dsi=np.take_along_axis(sp_need, k_dsi_idx[..., None], axis=2)[..., 0],
        configs=int(C.size),
        valid_dsi_configs=int(valid.sum()),
        si_all_k=si_all_k,
        tokens=tokens,
        repeats=repeats,
        seed=seed,
        max_sp=max_sp,
        seconds=seconds,
    )


def plot_heatmap(result: HeatmapResult, out_dir: Path, panels=None, formats=FORMATS, dpi: int = 110) -> list[Path]:
    """Draw the panels side by side (2 x 2 for four) and save one file per format."""
    panels = check_panels(panels)
    for fmt in formats:
        if fmt not in FORMATS:
            raise ConfigError(f"format={fmt!r} must be one of {', '.join(FORMATS)}")
    Figure = figure_class()
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm, Normalize

    ncols = 2 if len(panels) > 1 else 1
    nrows = (len(panels) + ncols - 1) // ncols
    fig = Figure(figsize=(5.2 * ncols, 4.2 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    up, down = colormaps["viridis"], colormaps["Reds_r"]
    for ax, panel in zip(axes, panels, strict=False):
        ratio = result.ratio(panel).T  # [na, nc]: rows = a (y), columns = c (x)
        faster = np.ma.masked_where(~(ratio >= 1), ratio)
        slower = np.ma.masked_where(~(ratio < 1), ratio)
        top = max(1.01, float(np.nanmax(ratio)))
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
            ax.legend(loc="lower left", fontsize=7, framealpha=0.8)
        ax.set_title(PANELS[panel])
        ax.set_xlabel("c = drafter latency / target latency")
        ax.set_ylabel("a = acceptance rate")
    fig.suptitle(
        f"Offline simulator, {result.tokens} tokens x {result.repeats} repeats, best k in 1..{len(result.lookaheads)}, "
        f"DSI with SP <= {result.max_sp}",
        fontsize=9,
    )
    written = []
    for fmt in formats:
        path = Path(out_dir) / f"heatmap.{fmt}"
        fig.savefig(path, dpi=dpi)
        written.append(path)
    return written


def write_heatmap(result: HeatmapResult, out_dir, panels=None, plot: bool = True, formats=FORMATS) -> list[Path]:
    """CSV (always) and the figure (``plot``) under ``out_dir``; returns the files written."""
    panels = check_panels(panels)
    out = prepare_out_dir(out_dir)
    files = [write_csv(out / "heatmap.csv", result.rows())]
    if plot:
        files += plot_heatmap(result, out, panels, formats)
    return files
