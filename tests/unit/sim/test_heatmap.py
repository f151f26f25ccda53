"""Figure 1: grid, best-k selection, outputs and errors (small grids)."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from dsi.errors import ConfigError
from dsi.sim.heatmap import PANELS, check_panels, compute_heatmap, grid, write_heatmap
from dsi.sim.offline import required_sp_array, simulate_many


def test_grid_is_the_papers():
    c, a, k = grid(20)
    assert c[0] == 0.01 and c[1] == pytest.approx(0.05) and c[-1] == 1.0 and len(c) == 21
    assert a[0] == 0.01 and a[-1] == 0.99 and len(a) == 21
    np.testing.assert_array_equal(k, np.arange(1, 21))


@pytest.fixture(scope="module")
def small():
    return compute_heatmap(5, tokens=200, repeats=3, seed=1)


def test_best_k_per_method_and_equation1(small):
    c_vals, a_vals, ks = grid(5)
    C, A, K = np.meshgrid(c_vals, a_vals, ks, indexing="ij")
    si, dsi = simulate_many(C.ravel(), A.ravel(), K.ravel(), tokens=200, repeats=3, seed=1)
    si_m, dsi_m = si.mean(1).reshape(C.shape), dsi.mean(1).reshape(C.shape)
    valid = (required_sp_array(C.ravel(), 1.0, K.ravel()) <= 7).reshape(C.shape)
    i, j = 0, 3  # c = 0.01: only k >= 15 would be valid, none in 1..5
    assert not valid[i, j].any() and np.isnan(small.dsi[i, j])
    i = 2  # c = 0.4
    assert small.dsi[i, j] == pytest.approx(dsi_m[i, j][valid[i, j]].min())
    assert small.si[i, j] == pytest.approx(si_m[i, j][valid[i, j]].min())
    assert required_sp_array(np.array([c_vals[i]]), 1.0, np.array([small.k_dsi[i, j]]))[0] <= 7


def test_panels_are_the_ratios(small):
    np.testing.assert_allclose(small.ratio("nonsi_si"), 200 / small.si)
    np.testing.assert_allclose(small.ratio("si_dsi"), small.si / small.dsi)
    np.testing.assert_allclose(small.ratio("min_dsi"), np.minimum(small.si, 200) / small.dsi)
    finite = np.isfinite(small.dsi)
    assert np.all(small.ratio("nonsi_dsi")[finite] >= 1 - 1e-12)
    assert np.all(small.ratio("si_dsi")[finite] >= 1 - 1e-12)


def test_si_all_k_lets_si_pick_any_lookahead():
    both = compute_heatmap(5, tokens=100, repeats=2, seed=1, si_all_k=True)
    restricted = compute_heatmap(5, tokens=100, repeats=2, seed=1)
    assert np.all(both.si[1:] <= restricted.si[1:] + 1e-12)
    assert np.isfinite(both.si[0]).all() and np.isnan(restricted.si[0]).all()  # c = 0.01: no valid k <= 5


def test_writes_csv_png_pdf(small, tmp_path):
    pytest.importorskip("matplotlib")
    files = write_heatmap(small, tmp_path / "out")
    names = sorted(f.name for f in files)
    assert names == ["heatmap.csv", "heatmap.pdf", "heatmap.png"]
    assert (tmp_path / "out" / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "out" / "heatmap.pdf").read_bytes()[:4] == b"%PDF"
    with open(tmp_path / "out" / "heatmap.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 36
    row = rows[2 * 6 + 3]
    assert float(row["c"]) == pytest.approx(small.c[2]) and float(row["a"]) == pytest.approx(small.a[3])
    assert float(row["si_dsi"]) == pytest.approx(small.si[2, 3] / small.dsi[2, 3])


def test_errors(small, tmp_path):
    with pytest.raises(ConfigError, match="panel='speed' is unknown; choose from nonsi_si, si_dsi"):
        check_panels(["speed"])
    assert check_panels(None) == tuple(PANELS)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        write_heatmap(small, blocker, plot=False)
    with pytest.raises(ConfigError, match="cannot be created|is not a directory"):
        write_heatmap(small, blocker / "sub", plot=False)
    with pytest.raises(ConfigError, match="ndim=1 must be an integer >= 2"):
        compute_heatmap(1)


def test_missing_matplotlib_names_the_plot_extra(small, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes the import fail
    with pytest.raises(ConfigError, match=r"pip install 'dsi\[plot\]'"):
        write_heatmap(small, tmp_path)
    assert (tmp_path / "heatmap.csv").exists()  # the CSV needs no matplotlib


# ---- cells where no k meets Equation 1 (issue 49, item 8.1) -------------------------------------
NO_K_PANELS = ("nonsi_si", "si_dsi", "nonsi_dsi", "min_dsi")


def test_cells_without_a_valid_k_are_blank_in_every_offline_panel_and_counted_apart(small):
    """ndim 5, SP 7: at c = 0.01 Equation 1 needs k >= 15, so the whole column has no valid k. SI
    used to be ``inf`` there: non-SI / SI read 0 (the "worst slowdown") and the cells counted as SI
    slower than non-SI, while the other panels left them blank."""
    none = np.zeros(small.dsi.shape, dtype=bool)
    none[0] = True  # [nc, na]: c = 0.01
    np.testing.assert_array_equal(small.no_valid_k, none)
    assert np.isnan(small.si[none]).all() and np.isnan(small.dsi[none]).all()
    assert (small.k_si[none] == 0).all() and (small.k_dsi[none] == 0).all() and (small.sp_dsi[none] == 0).all()
    assert (small.k_dsi[~none] >= 1).all()
    for panel in NO_K_PANELS:
        ratio = small.ratio(panel)
        assert np.isnan(ratio[none]).all() and np.isfinite(ratio[~none]).all(), panel
    s = small.summary()
    assert s["cells_no_valid_k"] == 6 and s["cells_si_no_valid_k"] == 6
    slower = int(np.sum(small.si[~none] > 200))
    assert s["cells_si_slower_than_nonsi"] == slower
    assert s["fraction_si_slower_than_nonsi"] == pytest.approx(slower / 30)  # of the 30 cells SI has a k in
    assert s["min_nonsi_si"] == pytest.approx(float((200 / small.si[~none]).min())) and s["min_nonsi_si"] > 0
    # the event panel lets tasks queue (servers min(SP, Equation 1)), so it has a k everywhere
    assert np.isfinite(small.ratio("fixed_auto")).all()


def test_the_figure_masks_cells_without_a_valid_k_in_every_panel(small):
    from dsi.sim.heatmap import ratio_layers

    for panel in NO_K_PANELS:
        faster, slower, blank = ratio_layers(small.ratio(panel))
        np.testing.assert_array_equal(blank, small.no_valid_k)
        assert faster.mask[blank].all() and slower.mask[blank].all(), panel
        assert not np.any(slower.compressed() <= 0), panel  # no "min 0.00" slowdown
        assert faster.count() + slower.count() + blank.sum() == blank.size
    pytest.importorskip("matplotlib")
    from dsi.sim.heatmap import heatmap_figure

    fig = heatmap_figure(small)
    for ax, panel in zip(fig.axes, small.panels, strict=False):  # the panels come first, colour bars after
        labels = [t.get_text() for t in ax.get_legend().get_texts()] if ax.get_legend() else []
        if panel in NO_K_PANELS:
            assert any(label.startswith("no valid k") for label in labels), (panel, labels)
        assert not any("min 0.00" in label for label in labels), (panel, labels)


def test_si_all_k_fills_the_si_panel_where_dsi_has_no_valid_k():
    both = compute_heatmap(5, tokens=100, repeats=2, seed=1, si_all_k=True, event_panel=False)
    s = both.summary()
    assert s["cells_no_valid_k"] == 6 and s["cells_si_no_valid_k"] == 0
    assert np.isfinite(both.ratio("nonsi_si")).all() and (both.k_si >= 1).all()
    assert np.isnan(both.ratio("si_dsi")[0]).all()
