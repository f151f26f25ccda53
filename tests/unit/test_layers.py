"""The layering rules: the core never loads torch, Ray or the web stack."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "ray", "fastapi", "uvicorn")


@pytest.mark.parametrize(
    "module",
    ["dsi", "dsi.engine", "dsi.sampling", "dsi.transport.threads", "dsi.models", "dsi.bench", "dsi.cli.main"],
)
def test_core_modules_do_not_import_heavy_dependencies(module):
    code = (
        f"import sys, {module}\n"
        f"import dsi.cli.main; dsi.cli.main.build_parser()\n"
        f"loaded = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_engine_sources_name_no_concrete_backend():
    from pathlib import Path

    import dsi.engine

    root = Path(dsi.engine.__file__).parent
    for path in root.glob("*.py"):
        text = path.read_text()
        for name in ("import torch", "import ray", "dsi.models.hf", "fastapi"):
            assert name not in text, f"{path.name} mentions {name}"
