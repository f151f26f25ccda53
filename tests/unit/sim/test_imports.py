"""The simulator is numpy only: importing it (or its CLI module) must not load torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

MODULES = ["dsi.sim", "dsi.sim.offline", "dsi.sim.events", "dsi.sim.analytic", "dsi.sim.heatmap",
           "dsi.sim.table", "dsi.sim.plan", "dsi.sim.replay", "dsi.cli.sim"]  # fmt: skip


@pytest.mark.parametrize("heavy", ["torch", "transformers", "ray", "matplotlib"])
def test_sim_imports_no_heavy_dependency(heavy):
    code = (
        f"import importlib, sys\nfor m in {MODULES!r}: importlib.import_module(m)\n"
        f"assert {heavy!r} not in sys.modules, 'loaded {heavy}'\nprint('ok')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
