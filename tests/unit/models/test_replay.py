"""ReplayLM: real forwards of one pair, greedy decisions of another (dsi.models.emulated.replay)."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import dsi
from dsi.errors import ConfigError, ContextLengthError, TaskCancelled
from dsi.models import CallableLM, WithLatency, synthetic_pair
from dsi.models.emulated.replay import (
    ReplayLM,
    accept_pattern,
    load_recording,
    record_decisions,
    replay_pair,
    save_recording,
)
from tests.conftest import random_lm

PROMPTS = ([1, 2, 3], [7, 7], [4, 0, 9, 2])


def recorded_pair(tokens=30, acceptance=0.7, seed=0):
    target, drafter = synthetic_pair(acceptance, vocab_size=16, seed=seed)
    recs = []
    for prompt in PROMPTS:
        out = dsi.generate(target=target, prompt=prompt, method="ar", max_new_tokens=tokens)
        recs.append(record_decisions(drafter, prompt, out.tokens))
    return target, drafter, recs


def test_a_recording_holds_the_drafters_greedy_guess_at_every_prefix():
    target, drafter, recs = recorded_pair()
    for rec in recs:
        for i, guess in enumerate(rec.drafter):
            assert guess == int(np.argmax(drafter.next_logits(rec.prompt + rec.target[:i])))
        pattern = rec.accept_pattern
        assert 0 < sum(pattern) < len(pattern)  # both matches and misses, so replay is tested on both


@pytest.mark.parametrize("servers", [1, 3])
def test_replay_reproduces_the_real_pairs_outputs_and_decisions(servers, no_thread_leak):
    """Other models underneath (different weights, same interface) take exactly the recorded
    decisions: every method's output is the recorded target output, and SI's accept/reject
    counts are the real pair's."""
    target, drafter, recs = recorded_pair()
    stand_in_target, stand_in_drafter = random_lm(16, seed=101), random_lm(16, seed=202)
    r_target, r_drafter = replay_pair(stand_in_target, stand_in_drafter, recs)
    for rec in recs:
        n = len(rec.target)
        real_si = dsi.generate(target=target, drafter=drafter, prompt=list(rec.prompt), method="si",
                               max_new_tokens=n, lookahead=3)
        for method in ("ar", "si", "dsi"):
            out = dsi.generate(target=r_target, drafter=r_drafter if method != "ar" else None,
                               prompt=list(rec.prompt), method=method, max_new_tokens=n, lookahead=3,
                               num_target_servers=servers)
            assert tuple(out.tokens) == rec.target, method
            if method == "si":
                s, r = out.stats, real_si.stats
                assert (s.accepted_tokens, s.rejections, s.bonus_tokens) == (r.accepted_tokens, r.rejections,
                                                                            r.bonus_tokens)
            if method == "dsi":  # which positions end up bonus tokens depends on timing
                s, pattern = out.stats, rec.accept_pattern
                assert s.accepted_tokens + s.rejections + s.bonus_tokens == n
                assert s.accepted_tokens <= sum(pattern) and s.rejections <= n - sum(pattern)


def test_replay_runs_the_inner_forward_and_keeps_its_cancellation():
    inner = WithLatency(random_lm(8, seed=3), ttft=0.0, tpot=0.2)
    model = ReplayLM(inner, {(1,): 5, (1, 5): 6})
    session = model.new_session()
    rows = session.extend([1])
    assert rows.shape == (1, 8) and int(rows[0].argmax()) == 5
    flag = threading.Event()
    threading.Timer(0.02, flag.set).start()
    with pytest.raises(TaskCancelled):
        session.extend([5], cancel=flag)  # the inner 0.2 s forward is cut short
    assert session.tokens == (1,)  # restored by the inner session
    rows = session.extend([5, 2])
    assert [int(r.argmax()) for r in rows] == [6, 0]  # recorded, then the fallback
    session.close()


def test_recordings_round_trip_and_bad_files_are_named(tmp_path):
    _, _, recs = recorded_pair(tokens=8)
    path = tmp_path / "rec.json"
    save_recording(path, recs, {"target": "t", "drafter": "d"})
    loaded, meta = load_recording(path)
    assert loaded == recs and meta == {"target": "t", "drafter": "d"}
    with pytest.raises(ConfigError, match="does not exist"):
        load_recording(tmp_path / "missing.json")
    (tmp_path / "old.json").write_text(json.dumps({"version": 99, "prompts": []}))
    with pytest.raises(ConfigError, match="version 99"):
        load_recording(tmp_path / "old.json")
    (tmp_path / "bad.json").write_text(json.dumps({"version": 1, "prompts": [{"prompt": [1], "target": [2]}]}))
    with pytest.raises(ConfigError, match="not a dsi recording"):
        load_recording(tmp_path / "bad.json")
    (tmp_path / "short.json").write_text(json.dumps(
        {"version": 1, "prompts": [{"prompt": [1], "target": [2, 3], "drafter": [2]}]}))
    with pytest.raises(ConfigError, match="equally long"):
        load_recording(tmp_path / "short.json")


def test_recorded_tokens_outside_the_vocabulary_are_refused():
    with pytest.raises(ConfigError, match=r"outside the vocabulary \[0, 8\)"):
        ReplayLM(random_lm(8, seed=1), {(1,): 8})


def test_replay_fast_path_gives_the_recorded_ids_and_runs_the_inner_forward():
    """extend_rows(greedy) returns the recorded choices without building logit rows, and still
    runs (and caches) the inner model's forward."""
    from dsi.models.base import extend_rows

    model = ReplayLM(random_lm(8, seed=3), {(1,): 5, (1, 5): 6, (1, 5, 6): 2})
    session = model.new_session()
    ids = extend_rows(session, [1, 5, 6], None, 2, greedy=True)
    assert ids.dtype == np.int64 and ids.tolist() == [6, 2]
    assert session.tokens == (1, 5, 6)
    rows = extend_rows(session, [7], None, 1)  # off the recording: the fallback, as a one-hot row
    assert rows.shape == (1, 8) and int(rows[0].argmax()) == 0 and rows.sum() == 1.0


def test_accept_pattern_stops_at_the_drafters_context_and_a_recording_says_why_it_cannot():
    target, drafter = synthetic_pair(0.7, vocab_size=16, seed=3)
    prompt = [1, 2, 3, 4]
    output = dsi.generate(target=target, prompt=prompt, method="ar", max_new_tokens=12).tokens
    full = record_decisions(drafter, prompt, output).accept_pattern
    short = CallableLM(drafter.next_logits, 16, max_context=8)  # guesses output[i] for i <= 8 - 4
    assert accept_pattern(short, prompt, output) == full[:5] + [False] * 7
    assert accept_pattern(drafter, prompt, output) == full
    assert accept_pattern(CallableLM(drafter.next_logits, 16, max_context=3), prompt, output) == [False] * 12
    with pytest.raises(ContextLengthError, match="max_context=8 cannot hold the prompt of 4 tokens and 11 output"):
        record_decisions(short, prompt, output)
    assert record_decisions(short, prompt, output[:5]).accept_pattern == full[:5]
