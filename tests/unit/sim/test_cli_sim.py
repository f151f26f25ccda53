"""The sim commands through dsi.cli.main.main: JSON round trips, human output, errors."""

from __future__ import annotations

import csv
import json

import pytest

from dsi.cli.main import main
from dsi.sim.offline import simulate_offline


def run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_json(capsys):
    data = run_json(capsys, ["simulate", "--c", "0.1", "--a", "0.9", "--lookahead", "5", "--rng", "legacy", "--json"])
    assert data["si"]["mean"] == pytest.approx(322.24)
    assert data["dsi"]["mean"] == pytest.approx(219.18)
    assert data["nonsi"]["mean"] == 1000.0
    assert data["dsi"]["speedup_vs_si"] == pytest.approx(322.24 / 219.18)
    assert data["si"]["speedup_vs_nonsi"] == pytest.approx(1000 / 322.24)
    assert data["config"]["required_sp"] == 2
    ev = data["dsi"]["event"]
    assert ev["mean"] < data["si"]["event"]["mean"] < data["nonsi"]["event"]["mean"] == 1000.0
    assert 0 < ev["utilisation"] < 1 and ev["wasted_target_time"] > 0
    assert len(data["dsi"]["per_repeat"]) == 5


def test_simulate_matches_the_library_and_event_options_apply(capsys):
    argv = ["simulate", "--c", "0.2", "--a", "0.7", "-k", "3", "--tokens", "100", "--repeats", "3", "--seed", "4",
            "--sp", "2", "--target-ttft", "5", "--preempt-delay", "0.1", "--json"]  # fmt: skip
    data = run_json(capsys, argv)
    lib = simulate_offline(0.2, 0.7, 3, tokens=100, repeats=3, seed=4, sp=2)
    assert data["dsi"]["per_repeat"] == pytest.approx(lib.dsi.tolist())
    assert data["nonsi"]["event"]["mean"] == pytest.approx(5 + 99)  # target TTFT 5, TPOT 1
    data2 = run_json(capsys, argv[:-5] + ["--json"])
    assert data["dsi"]["event"]["mean"] > data2["dsi"]["event"]["mean"]


def test_simulate_table_for_people(capsys):
    assert main(["simulate", "--c", "0.1", "--a", "0.9", "-k", "5", "--tokens", "200", "--no-events"]) == 0
    out = capsys.readouterr().out
    assert "non-SI" in out and "DSI" in out and "1.00x" in out and "Equation 1: >= 2" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "--c", "1.0", "--a", "0.5", "-k", "2"], "--c=1.0 must be a number in (0, 1)"),
        (["simulate", "--c", "0", "--a", "0.5", "-k", "2"], "--c=0 must be a number in (0, 1)"),
        (["simulate", "--c", "0.1", "--a", "1.5", "-k", "2"], "--a=1.5 must be a number in [0, 1]"),
        (["simulate", "--c", "0.1", "--a", "0.5", "-k", "0"], "lookahead=0 must be an integer >= 1"),
        (["simulate", "--c", "0.1", "--a", "0.5", "-k", "1", "--sp", "3"], "needs sp >= ceil(T / (k c)) = 10"),
        (["simulate", "--c", "0.1", "--a", "0.5", "-k", "2", "--target-tpot", "-1"], "--target-tpot=-1 must be a number > 0"),
        (["heatmap", "--panel", "fastest", "--no-plot"], "panel='fastest' is unknown"),
        (["plan", "--target-tpot", "30", "--acceptance", "0.5"], "missing --drafter-tpot"),
        (["plan", "--target-tpot", "30", "--drafter-tpot", "-2", "--acceptance", "0.5"], "--drafter-tpot=-2 must be a number > 0"),
        (["table", "--rows", "12", "--no-engine"], "--rows='12' must be comma-separated row numbers in 0..9"),
    ],
)
def test_errors_exit_2_with_the_message(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith(f"dsi {argv[0]}: error:")


def test_unwritable_output_directory(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["heatmap", "--ndim", "3", "--out", str(blocker), "--no-plot"]) == 2
    assert "is a file; give a directory" in capsys.readouterr().err


def test_heatmap_json_and_files(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "hm"
    data = run_json(capsys, ["heatmap", "--ndim", "4", "--tokens", "100", "--repeats", "2", "--out", str(out),
                             "--format", "png", "--no-progress", "--json"])  # fmt: skip
    assert data["configs"] == 5 * 5 * 4 and data["cells"] == 25
    assert data["cells_dsi_slower_than_nonsi"] == 0
    assert data["simulation_seconds"] > 0
    assert sorted(p.name for p in out.iterdir()) == ["heatmap.csv", "heatmap.png"]


def test_heatmap_for_people(capsys, tmp_path):
    assert (
        main(["heatmap", "--ndim", "3", "--tokens", "50", "--out", str(tmp_path), "--no-plot", "--panel", "si_dsi"])
        == 0
    )
    out = capsys.readouterr().out
    assert "simulated 48 configurations" in out and "si_dsi" in out and "nonsi_si" not in out.split("panel")[1]


def test_heatmap_counts_cells_without_a_valid_k_apart(capsys, tmp_path):
    """``--ndim 6``: at c = 0.01 no k <= 6 meets Equation 1 with SP 7 (7 cells). They are "no valid k",
    not "SI slower than non-SI", and no panel's minimum is the 0 they used to give."""
    argv = ["heatmap", "--ndim", "6", "--tokens", "100", "--repeats", "2", "--no-event-panel", "--out",
            str(tmp_path), "--no-plot", "--no-progress"]  # fmt: skip
    data = run_json(capsys, [*argv, "--json"])
    assert data["cells"] == 49 and data["cells_no_valid_k"] == 7 and data["cells_si_no_valid_k"] == 7
    assert data["cells_si_slower_than_nonsi"] <= 42 and data["min_nonsi_si"] > 0
    with open(tmp_path / "heatmap.csv") as f:
        rows = [r for r in csv.DictReader(f) if float(r["c"]) == 0.01]
    assert len(rows) == 7 and all(r["nonsi_si"] == "nan" and r["k_si"] == "0" and r["k_dsi"] == "0" for r in rows)
    assert main(argv) == 0
    out = capsys.readouterr().out
    slower = data["cells_si_slower_than_nonsi"]
    assert f"SI slower than non-SI in {slower} of 42 cells" in out, out
    assert "no valid k in 7 of 49 cells" in out, out
    assert "0.000" not in out.split("panel")[1], out


def test_table_json_without_engine(capsys, tmp_path):
    data = run_json(capsys, ["table", "--no-engine", "--rows", "0,6", "--event-repeats", "5", "--offline-repeats", "20",
                             "--out", str(tmp_path), "--no-plot", "--json"])  # fmt: skip
    assert [r["target"] for r in data["rows"]] == ["Vicuna-13B", "Phi3-14B"]
    assert data["rows"][0]["paper_dsi_vs_si"] == 1.47
    assert data["rows"][0]["engine_dsi_vs_si"] is None
    assert data["rows"][1]["offline_dsi_vs_si"] > 1
    assert (tmp_path / "table1.md").exists() and (tmp_path / "table1.csv").exists()


def test_plan_json_and_from_files(capsys, tmp_path):
    t = tmp_path / "t.json"
    d = tmp_path / "d.json"
    t.write_text(json.dumps({"kind": "latency", "model": "big", "role": None, "ttft_ms": 40.0, "tpot_ms": 30.0}))
    d.write_text(json.dumps({"kind": "latency", "model": "small", "role": None, "ttft_ms": 4.0, "tpot_ms": 3.0}))
    argv = ["plan", "--from", str(t), "--from", str(d), "--acceptance", "0.8", "--max-servers", "3",
            "--max-lookahead", "6", "--tokens", "60", "--repeats", "5", "--json"]  # fmt: skip
    data = run_json(capsys, argv)
    assert data["inputs"]["target_tpot_ms"] == 30.0 and data["inputs"]["drafter_ttft_ms"] == 4.0
    assert data["num_target_servers"] <= 3 and 1 <= data["lookahead"] <= 6
    assert data["speedup_vs_nonsi"] > 1 and data["speedup_vs_si"] > 1
    assert data["equation1"]["min_lookahead_for_budget"] == 4
    assert data["predicted_ms_per_token"] == pytest.approx(min(c["per_token_ms"] for c in data["candidates"]))
    assert main(argv[:-1]) == 0
    assert "plan: lookahead" in capsys.readouterr().out


def test_plan_text_agrees_with_its_equation1_advice(capsys):
    """Issue 49, item 8.2: the advice said lookahead >= 3 avoids queueing, then the plan took k = 2 (queue
    wait 695 ms) at the same time as k = 3 (no wait)."""
    argv = ["plan", "--drafter-tpot", "5", "--target-tpot", "50", "--acceptance", "0.8", "--max-servers", "4",
            "--tokens", "100", "--repeats", "2"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "lookahead >= 3 avoids queueing" in out
    assert "plan: lookahead 3, 4 target server(s)" in out, out
    assert "as fast: k=2 with 4 server(s), 695 ms of queue wait" in out, out
    table = out.split("queue wait ms")[1].splitlines()[2:4]
    assert table[0].split()[:2] == ["3", "4"] and table[1].split()[:2] == ["2", "4"], table  # the plan first
    # a plan that queues because it is faster says so, with the fastest lookahead that does not
    assert main(["plan", "--drafter-tpot", "2.5", "--target-tpot", "37.7", "--acceptance", "0.63",
                 "--max-lookahead", "6", "--tokens", "60", "--repeats", "6"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "lookahead >= 3 avoids queueing" in out and "plan: lookahead 1, 7 target server(s)" in out, out
    assert "k=1 queues (Equation 1 wants 16 servers;" in out and "the fastest that does not" in out, out


@pytest.mark.parametrize("command", ["simulate", "heatmap", "table", "plan"])
def test_help(capsys, command):
    assert main([command, "--help"]) == 0
    assert "--json" in capsys.readouterr().out


def _help(capsys, command: str) -> str:
    assert main([command, "--help"]) == 0
    return " ".join(capsys.readouterr().out.split())  # argparse's line breaks undone


def test_help_texts_match_what_the_commands_do(capsys, tmp_path):
    """Issue 49, item 8.3: help that cited a file outside the repository or said what the command does not do."""
    from pathlib import Path

    table = _help(capsys, "table")
    assert "DSI.md" not in table and "Timor et al., ICLR 2025, Table 1" in table and "docs/simulator.md" in table
    assert (Path(__file__).resolve().parents[3] / "docs" / "simulator.md").exists()
    # heatmap: the grid has ndim + 1 points per axis (--ndim 3: 16 cells), not ndim x ndim
    heatmap = _help(capsys, "heatmap")
    assert "(ndim + 1) x (ndim + 1) grid" in heatmap and "ndim x ndim" not in heatmap
    data = run_json(capsys, ["heatmap", "--ndim", "3", "--tokens", "40", "--repeats", "1", "--no-event-panel",
                             "--out", str(tmp_path), "--no-plot", "--no-progress", "--json"])  # fmt: skip
    assert data["cells"] == 16
    # plan: the tie rule is stated
    assert "ties: fewer servers, then less queueing, then the smaller lookahead" in _help(capsys, "plan")
    # simulate: a target TPOT of 0 is refused as the flag's range says (it crashed with ZeroDivisionError)
    assert main(["simulate", "--c", "0.1", "--a", "0.5", "-k", "2", "--target-tpot", "0"]) == 2
    assert "--target-tpot=0 must be a number > 0" in capsys.readouterr().err
    assert main(["simulate", "--c", "0.1", "--a", "0.5", "-k", "2", "--target-ttft", "0", "--tokens", "1"]) == 2
    assert "--target-ttft=0 must be a number > 0" in capsys.readouterr().err


def test_plan_prints_measured_latencies_rounded(capsys, tmp_path):
    t = tmp_path / "t.json"
    d = tmp_path / "d.json"
    t.write_text(json.dumps({"kind": "latency", "model": "big", "ttft_ms": 150.38420399969255,
                             "tpot_ms": 53.49047520003296}))
    d.write_text(json.dumps({"kind": "latency", "model": "small", "ttft_ms": 9.123456789, "tpot_ms": 5.987654321}))
    assert main(["plan", "--from", str(t), "--from", str(d), "--acceptance", "0.8", "--max-servers", "2",
                 "--max-lookahead", "3", "--tokens", "20", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "target 53.49 ms/token (TTFT 150.38 ms), drafter 5.99 ms/token (TTFT 9.12 ms)" in out, out
