"""The prepared GPU run (benchmarks/gpu_check.sh) end to end on the CPU, with tiny configurations of
the same architectures (DRY_RUN=1), so that the script cannot rot between the rare GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
# slow: the two dry runs take about 70 s of the default run's 15 minutes; CI's slow suite runs them
pytestmark = [pytest.mark.hf, pytest.mark.slow]


def test_gpu_check_dry_run_measures_every_part(tmp_path):
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # at most 8 files come back from a lent machine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["forwards.json", "machine.txt", "pair_graphs.json",
                                                          "report.md", "run.log", "target14b.json",
                                                          "target14b_graphs.json"]
    assert "torch" in (tmp_path / "machine.txt").read_text()
    forwards = json.loads((tmp_path / "forwards.json").read_text())
    assert [r["config"] for r in forwards["rows"]] == ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct",
                                                       "qwen2.5-14b-instruct"]
    for row in forwards["rows"]:
        assert set(row["plans"]) == {"dynamic", "static", "graphs"} and row["weights_gb"] > 0 and row["read_ms"] > 0
        assert all(p["1_ms"] > 0 and p["5_ms"] > 0 for p in row["plans"].values())
    assert forwards["bandwidth_gb_s"] > 0
    for part, target, graphs in (("pair_graphs", "qwen2.5-coder-1.5b-instruct", True),
                                 ("target14b_graphs", "qwen2.5-14b-instruct", True),
                                 ("target14b", "qwen2.5-14b-instruct", False)):
        report = json.loads((tmp_path / f"{part}.json").read_text())
        assert report["config"]["pair"][0] == target and not report["skipped"]
        assert report["config"]["cuda_graphs"] is graphs
        rows = report["rows"]
        transports = {r["transport"] for r in rows.values() if r["method"] == "dsi"}
        assert transports == {"threads", "processes"}
        assert {r["method"] for r in rows.values()} == {"ar", "si", "dsi"}
        for label, row in rows.items():
            assert row["identical"], label  # every method reproduces the recorded greedy output
            if row["method"] != "ar":
                assert row["engine_over_ideal"] > 0 and row["acceptance_rate"] > 0.5, label
            if row["method"] == "dsi":
                assert row["target_forward_in_run_s"] > 0 and row["drafter_forward_in_run_s"] > 0, label
        assert set(report["latencies_s"]["1"]) == {"drafter", "target"}
    log = (tmp_path / "run.log").read_text()
    parts = [line for line in log.splitlines() if line.startswith("== part ")]
    assert parts == ["== part f: forwards", "== part pair_graphs", "== part target14b_graphs", "== part target14b"]
    part_b = log[log.index("== part target14b_graphs"): log.index("== part target14b\n")]
    assert "vocabularies 152064 / 151936" in part_b and "DSI k=auto SP=1 processes" in part_b
    assert log.rstrip().endswith("gpu_check exit 0")
    report = (tmp_path / "report.md").read_text()  # benchmarks/gpu_report.py on this folder
    assert "Missing" not in report and "Issue 51's goals:" in report
    assert len([line for line in report.splitlines() if line.startswith("| non-SI | ")]) == 3  # a row per part
    assert "| the drafter's step with graphs at most 3 ms |" in report and "not measured" not in report
    # a CPU captures no graph: the report says so, and no goal "with graphs" is called met or missed
    assert "**Graphs fell back to eager forwards** in part pair_graphs" in report
    assert "| the drafter's step with graphs at most 3 ms | eager, not graphs: no graph was captured | - |" in report


def test_gpu_check_cpu_dry_run_splits_cores_between_drafter_and_servers(tmp_path):
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "benchmarks/gpu_check_cpu.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "cpu_cores.json").read_text())
    split = report["rows"]["DSI k=4 SP=1 processes t=1 d=1"]
    assert split["identical"] and split["server_threads"] == 1 and split["threads"] == 1
    assert split["engine_over_ideal"] > 0
    assert set(report["latencies_s"]) >= {"1", "2"}  # thread scaling measured alone
