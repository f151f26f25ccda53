"""benchmarks/gpu_report.py on a made-up gpu_check.sh output folder whose numbers are known: each goal's number and
verdict, tokens per second against the bandwidth limit, a wrong output never counted as the best row, and the
goals of a part that did not write read "not measured". (Its run on a real DRY_RUN folder:
tests/integration/test_gpu_check.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_report  # noqa: E402


def _plans(one: float, five: float, captured: int = 0) -> dict:
    plan = {"1_ms": one, "5_ms": five, "first_1_ms": one + 40, "first_5_ms": five + 60, "captured": captured}
    replays = {"replay_1_ms": one - 0.25, "replay_5_ms": five - 0.5}  # a graph alone: the forward less its host part
    return {"dynamic": {**plan, "1_ms": one * 3, "captured": 0}, "static": {**plan, "captured": 0},
            "graphs": {**plan, **replays}}


def _row(method: str, total: float, identical: bool = True, ideal: float | None = None) -> dict:
    row = {"method": method, "total_s": total, "per_prompt_s": [total / 3] * 3, "identical": identical,
           "acceptance_rate": 0.9, "target_forward_in_run_s": 0.012, "drafter_forward_in_run_s": 0.001}
    return row if ideal is None else {**row, "engine_over_ideal": ideal}


def _part(target: str, rows: dict) -> dict:
    return {"config": {"tokens": 64, "repeats": 2, "pair": [target, gpu_report.DRAFTER]}, "rows": rows,
            "skipped": []}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "machine.txt").write_text("python 3.12.3 torch 2.11.0+cu130\ncuda True ['NVIDIA H100 80GB HBM3']\n")
    forwards = {"dtype": "bf16", "prefix": 128, "repeats": 20, "tokens": 5, "bandwidth_gb_s": 3000.0,
                "date": "2026-12-06", "rows": [
                    {"config": gpu_report.DRAFTER, "weights_gb": 1.0, "read_ms": 0.33, "plans": _plans(0.9, 1.1, 2)},
                    {"config": gpu_report.TARGET, "weights_gb": 3.1, "read_ms": 1.0, "plans": _plans(3.2, 3.5, 2)},
                    {"config": gpu_report.TARGET_14B, "weights_gb": 29.5, "read_ms": 10.0,
                     "plans": _plans(14.0, 15.0, 2)}]}
    (tmp_path / "forwards.json").write_text(json.dumps(forwards))
    graphs = {"non-SI": _row("ar", 9.6),  # 3 x 64 tokens: 20 tokens/s
              "SI k=4": _row("si", 6.0, ideal=1.05),
              "DSI k=auto SP=1": _row("dsi", 4.0, ideal=1.10),
              "DSI k=auto SP=2": _row("dsi", 3.0, identical=False, ideal=1.0)}  # fastest, but a wrong output
    (tmp_path / "target14b_graphs.json").write_text(json.dumps(_part(gpu_report.TARGET_14B, graphs)))
    (tmp_path / "target14b.json").write_text(json.dumps(_part(gpu_report.TARGET_14B, {"non-SI": _row("ar", 38.4)})))
    return tmp_path  # pair_graphs.json: not written (cut off)


def test_each_goal_has_its_number_and_verdict(folder):
    found = gpu_report.load(folder)
    assert found["missing"] == ["pair_graphs.json"]
    got = {g.goal.split(" at ")[0]: (g.measured, g.met) for g in gpu_report.goals(found)}
    assert got["the 14B target's one-token forward with graphs"] == ("1.40x (14.00 ms against 10.00 ms)", True)
    assert got["the 1.5B target's one-token forward with graphs"] == ("3.20x (3.20 ms against 1.00 ms)", False)
    assert got["the drafter's step with graphs"] == ("0.90 ms", True)
    assert got["non-SI with graphs"] == ("4.00x (20.0 against 5.0 tokens/s)", True)
    # the best DSI row is SP=1 (SP=2's was faster, but its output was wrong): 6.0 / 4.0 and 9.6 / 4.0
    dsi = [g for g in gpu_report.goals(found) if g.goal.startswith("DSI")]
    assert [(g.measured, g.met) for g in dsi] == [("1.50x (DSI k=auto SP=1 against SI k=4)", True),
                                                  ("2.40x (DSI k=auto SP=1 against non-SI)", True)]
    assert got["that DSI row's engine / ideal"] == ("1.10", True)


def test_tokens_per_second_stand_next_to_the_bandwidth_limit(folder):
    (line, _) = gpu_report.speed_lines(gpu_report.load(folder))
    assert line["part"] == "target14b_graphs" and line["bandwidth_limit_tok_s"] == pytest.approx(100.0)
    assert line["non_si_tok_s"] == pytest.approx(20.0) and line["si_tok_s"] == pytest.approx(32.0)
    assert (line["dsi_row"], line["dsi_tok_s"]) == ("DSI k=auto SP=1", pytest.approx(48.0))


def test_a_part_that_did_not_write_leaves_its_goals_not_measured(folder):
    (folder / "target14b_graphs.json").unlink()
    (folder / "forwards.json").unlink()
    goals = gpu_report.goals(gpu_report.load(folder))
    assert [(g.measured, g.met) for g in goals] == [("not measured", None)] * len(goals) and len(goals) == 7


def test_graphs_that_fell_back_to_eager_forwards_meet_and_miss_no_goal_said_so(folder):
    """A forward measured in the graphs plan that captured no graph, and an engine part whose run.log section says
    graphs fell back (a server process's warning too), ran eagerly: their goals are neither met nor missed, they
    say so, and the report says which part fell back and why."""
    forwards = json.loads((folder / "forwards.json").read_text())
    forwards["rows"][1]["plans"]["graphs"]["captured"] = 0  # the 1.5B target: eager forwards
    (folder / "forwards.json").write_text(json.dumps(forwards))
    (folder / "run.log").write_text(
        "== part 0: tests\n5 passed\n== part f: forwards\nok\n== part target14b_graphs\n"
        "a CUDA graph could not be captured (RuntimeError: operation not permitted when stream is capturing); its "
        "forwards run eagerly\nthe same again: a CUDA graph could not be captured (RuntimeError: x); its forwards "
        "run eagerly\n== part target14b\nCUDA graphs need a CUDA device; m runs its forwards eagerly\n")
    found = gpu_report.load(folder)
    assert sorted(found["fallbacks"]) == ["target14b", "target14b_graphs"] and len(found["fallbacks"]["target14b"]) == 1
    got = {g.goal.split(" at ")[0]: (g.measured, g.met) for g in gpu_report.goals(found)}
    assert got["the 1.5B target's one-token forward with graphs"] == ("eager, not graphs: no graph was captured", None)
    assert got["the 14B target's one-token forward with graphs"] == ("1.40x (14.00 ms against 10.00 ms)", True)
    engine = [g for g in gpu_report.goals(found)][3:]
    assert [g.met for g in engine] == [None] * 4
    assert all(g.measured.endswith("eager, not graphs: the part's log says graphs fell back") for g in engine)
    assert engine[0].measured.startswith("4.00x (20.0 against 5.0 tokens/s)")
    text = gpu_report.markdown(found)
    assert "**Graphs fell back to eager forwards** in part target14b_graphs: a CUDA graph could not be captured" in text


def test_the_program_prints_the_tables_and_writes_the_goals(folder, tmp_path):
    out = tmp_path / "goals.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_report.py"), str(folder), "--json", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "Missing (a part cut off before it wrote, or failed): pair_graphs.json." in text
    assert "| qwen2.5-14b-instruct | 29.50 | 10.00 | graphs | 14.00 | 1.4 | 15.00 | 40, 60 | 13.75, 14.50 | 2 |" in text
    assert "| qwen2.5-14b-instruct | 29.50 | 10.00 | static | 14.00 | 1.4 | 15.00 | - | - | 0 |" in text
    assert "| DSI k=auto SP=2 | 3.00 | 64.0 | 3.20 | 2.00 | 0.90 | 1.00 | 12.0 | 1.0 | - | NO |" in text
    assert "| target14b_graphs | 20.0 | 32.0 (SI k=4) | 48.0 (DSI k=auto SP=1) | 100.0 |" in text
    report = json.loads(out.read_text())
    assert [g["met"] for g in report["goals"]] == [True, False, True, True, True, True, True]
    missing = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_report.py"), str(tmp_path / "nowhere")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no such folder" in missing.stderr
