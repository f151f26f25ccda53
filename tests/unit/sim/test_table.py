"""Table 1: the simulator columns, and the engine column through a fake engine."""

from __future__ import annotations

import csv
from types import SimpleNamespace

import numpy as np
import pytest

from dsi.errors import ConfigError
from dsi.sim.events import simulate
from dsi.sim.offline import required_sp
from dsi.sim.replay import greedy_match_pattern, next_logits_fn
from dsi.sim.table import TABLE1, build_table, event_column, offline_column, to_markdown, write_table


def test_table1_rows_are_the_papers():
    assert len(TABLE1) == 10
    assert TABLE1[0].target_ms == 37.7 and TABLE1[0].drafter_ms == 2.5 and TABLE1[0].acceptance == 0.63
    assert TABLE1[4].paper_speedup == 1.92
    assert TABLE1[0].c == pytest.approx(2.5 / 37.7)


def test_simulator_columns_pick_the_best_valid_lookahead():
    row = TABLE1[0]  # c = 0.066: k = 1 needs 16 servers
    off = offline_column(row, tokens=50, lookaheads=(1, 5, 10), max_sp=7, repeats=50, seed=1)
    assert off.dsi.lookahead in (5, 10)
    assert off.dsi.num_servers == required_sp(row.c, 1.0, off.dsi.lookahead) <= 7
    assert off.speedup > 1
    ev = event_column(row, tokens=50, lookaheads=(1, 5, 10), max_sp=7, repeats=20, seed=1)
    assert ev.dsi.num_servers <= 7
    for k in (1, 5, 10):  # the chosen one is the fastest
        sp = min(7, required_sp(row.drafter_ms, row.target_ms, k))
        t = simulate("dsi", target_tpot=37.7, drafter_tpot=2.5, lookahead=k, num_servers=sp, tokens=50,
                     acceptance=0.63, repeats=20, seed=1).mean  # fmt: skip
        assert ev.dsi.time <= t + 1e-9
    with pytest.raises(ConfigError, match="no lookahead in \\[1\\] satisfies Equation 1"):
        offline_column(row, tokens=50, lookaheads=(1,), max_sp=7, repeats=5, seed=1)


class FakeEngine:
    """Commits the target's greedy tokens and reports ``slowdown`` x the ideal time."""

    def __init__(self, slowdown: float) -> None:
        self.slowdown = slowdown
        self.calls = []

    def __call__(self, *, target, drafter, prompt, method, max_new_tokens, lookahead, num_target_servers, **kw):
        self.calls.append((method, lookahead, num_target_servers, kw["sampling"].temperature))
        fn = next_logits_fn(target)
        ctx = list(prompt)
        for _ in range(max_new_tokens):
            ctx.append(int(np.argmax(fn(tuple(ctx)))))
        tokens = ctx[len(prompt) :]
        matches = greedy_match_pattern(target, drafter, prompt, tokens)
        ideal = simulate(method, target_tpot=target.tpot, drafter_tpot=drafter.tpot, lookahead=lookahead,
                         num_servers=num_target_servers, matches=matches).mean  # fmt: skip
        return SimpleNamespace(tokens=tokens, stats=SimpleNamespace(wall_time_s=self.slowdown * ideal))


def test_engine_column_replays_each_run_as_its_ideal(tmp_path):
    fake = FakeEngine(1.25)
    table = build_table(TABLE1[4:5], offline_repeats=20, event_repeats=10, engine_repeats=2, generate=fake)
    row = table.rows[0]
    assert len(fake.calls) == 4  # 2 seeds x (SI, DSI)
    assert {c[0] for c in fake.calls} == {"si", "dsi"}
    assert all(c[3] == 0.0 for c in fake.calls)  # greedy
    assert ("dsi", row.event.dsi.lookahead, row.event.dsi.num_servers, 0.0) in fake.calls
    assert row.engine.ratio("dsi") == pytest.approx(1.25)
    assert row.engine.ratio("si") == pytest.approx(1.25)
    assert table.median_engine_over_ideal() == pytest.approx(1.25)
    files = write_table(table, tmp_path, plot=False)
    assert sorted(f.name for f in files) == ["table1.csv", "table1.md"]
    text = (tmp_path / "table1.md").read_text()
    assert "| StarCoder-15B | StarCoder-168M | HumanEval |" in text and "1.250" in text
    with open(tmp_path / "table1.csv") as f:
        rows = list(csv.DictReader(f))
    assert float(rows[0]["engine_over_ideal_dsi"]) == pytest.approx(1.25)
    assert float(rows[0]["paper_dsi_vs_si"]) == 1.92


def test_bar_chart(tmp_path):
    pytest.importorskip("matplotlib")
    table = build_table(TABLE1[6:8], offline_repeats=10, event_repeats=5, engine_repeats=1, generate=FakeEngine(1.1))
    files = write_table(table, tmp_path)
    assert (tmp_path / "table1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(files) == 3


def test_without_engine_the_column_says_so():
    table = build_table(TABLE1[:2], offline_repeats=10, event_repeats=5, engine=False)
    assert not table.has_engine and table.median_engine_over_ideal() is None
    md = to_markdown(table)
    assert md.count("| n/a | n/a | n/a |") == 2
    assert "engine column skipped" in md


def test_wrong_token_count_from_the_engine_is_an_error():
    def short(**kw):
        return SimpleNamespace(tokens=[1, 2], stats=SimpleNamespace(wall_time_s=1.0))

    with pytest.raises(ConfigError, match="the engine returned 2 tokens; expected 50"):
        build_table(TABLE1[:1], offline_repeats=5, event_repeats=3, engine_repeats=1, generate=short)
