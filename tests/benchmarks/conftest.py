"""Fixture of the benchmark tests: a program of benchmarks/ run as its ``--dry-run`` (benchmarks/_common.py),
in a process of its own, and the JSON report it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def dry_run(tmp_path):
    """``dry_run(program, *args, timeout=...)``: ``python benchmarks/PROGRAM --dry-run ARGS --out FILE``, which
    must exit 0; returns the JSON it wrote to FILE. Nothing is downloaded (``HF_HUB_OFFLINE``), and method="auto"
    caches its choices where the test session's (tests/conftest.py) go."""

    def run(program: str, *args: str, timeout: float = 120) -> dict:
        out = tmp_path / "report.json"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / program), *args, "--dry-run", "--out", str(out)],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{program} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        report = json.loads(out.read_text())
        last = json.loads(done.stdout.strip().splitlines()[-1])  # the one JSON line a program ends with
        assert isinstance(last, dict)
        return report

    return run

