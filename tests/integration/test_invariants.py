"""DSI's invariants, checked on a trace of every submitted and applied verification task."""

from __future__ import annotations

import pytest

import dsi
from dsi.engine.api import make_request
from dsi.engine.dsi import DSIDecoder
from dsi.models import WithLatency, synthetic_pair
from dsi.transport.threads import ThreadTargetPool
from tests.conftest import Jitter


def traced_run(acceptance, lookahead, servers, sampling, tokens=60, seed=0, jitter=0.002):
    target, drafter = synthetic_pair(acceptance, vocab_size=16, seed=seed)
    target = Jitter(target, jitter, seed)
    decoder = DSIDecoder(
        drafter, lookahead, lambda sink: ThreadTargetPool(target, servers, sink), trace=True
    )
    try:
        request = make_request([1, 2, 3], tokens, sampling, None, 16)
        result = decoder.generate(request)
    finally:
        decoder.close()
    return result, decoder.trace


@pytest.mark.parametrize("acceptance, lookahead, servers", [(0.5, 2, 3), (0.8, 4, 7), (0.3, 1, 2), (0.9, 3, 1),
                                                       (0.5, "auto", 3), (0.9, "auto", 1), (0.8, "auto", 7)])
@pytest.mark.parametrize("greedy", [True, False])
def test_only_results_on_committed_contexts_are_applied(acceptance, lookahead, servers, greedy, no_thread_leak):
    sampling = dsi.SamplingParams() if greedy else dsi.SamplingParams(temperature=1.0, seed=3)
    result, trace = traced_run(acceptance, lookahead, servers, sampling)
    final = (1, 2, 3) + tuple(result.tokens)
    contexts = {task_id: ctx for kind, task_id, ctx in trace if kind == "submit"}
    applied = [(task_id, position) for kind, task_id, position in trace if kind == "apply"]
    assert [p for _, p in applied] == list(range(3, len(final)))  # every position once, in order
    for task_id, position in applied:
        ctx = contexts[task_id]
        # the row used was computed on a context that is entirely committed up to this position
        assert len(ctx) >= position
        assert final[:position] == ctx[:position]
    # every task whose context contains a rejected token was made stale and never applied
    used = {t for t, _ in applied}
    for task_id, ctx in contexts.items():
        if final[: len(ctx)] != ctx[: len(final)]:
            first_wrong = next(i for i, (a, b) in enumerate(zip(final, ctx)) if a != b)
            assert all(t != task_id or p <= first_wrong for t, p in applied)
    if lookahead == "auto" and servers == 1:
        # a window goes only to an idle server: with one server, at most one task is in flight
        # besides the result being decided (its server is idle before its result is read), so a
        # rejection preempts at most one task
        assert result.stats.preempted_tasks <= result.stats.rejections
    elif result.stats.rejections:
        assert result.stats.preempted_tasks > 0
        assert set(contexts) - used


@pytest.mark.parametrize("lookahead", [1, 2, 3])
def test_no_window_is_sent_past_the_end_of_the_output(lookahead, no_thread_leak):
    """A window whose every position lies beyond max_new_tokens would waste a target forward."""
    result, trace = traced_run(1.0, lookahead, 2, dsi.SamplingParams(), tokens=12)
    contexts = [ctx for kind, _, ctx in trace if kind == "submit"]
    assert result.stats.rejections == 0
    # the longest useful context ends one token before the last output position
    assert max(len(ctx) for ctx in contexts) == 3 + 12 - 1
    assert result.stats.verify_tasks == 1 + -(-11 // lookahead)  # zero-draft task + windows over 11 drafts


@pytest.mark.parametrize("lookahead", [3, "auto"])
def test_zero_draft_task_starts_every_segment(lookahead, no_thread_leak):
    result, trace = traced_run(0.6, lookahead, 4, dsi.SamplingParams(), tokens=50)
    submits = [ctx for kind, _, ctx in trace if kind == "submit"]
    final = (1, 2, 3) + tuple(result.tokens)
    committed_lengths = set(range(3, len(final)))
    # a zero-draft task (context entirely committed, ending right after a restart) exists for
    # the start and for each rejection
    zero_draft = [ctx for ctx in submits if final[: len(ctx)] == ctx and len(ctx) in committed_lengths]
    assert len(zero_draft) >= result.stats.rejections + 1


def test_dsi_is_never_slower_than_non_si_and_beats_si_with_emulated_latencies(no_thread_leak):
    """Ratios in one run, with generous margins (the benchmark measures them precisely)."""
    times = {}
    for acceptance in (0.0, 0.7):
        target, drafter = synthetic_pair(acceptance, vocab_size=16, seed=1, target_tpot=0.02, drafter_tpot=0.002)
        for method, lookahead in (("ar", 3), ("si", 3), ("dsi", 3), ("dsi", "auto")):
            out = dsi.generate(
                target=target, drafter=drafter, prompt=[1, 2], method=method, max_new_tokens=30,
                lookahead=lookahead, num_target_servers=5,
            )
            times[(acceptance, method, lookahead)] = out.stats.wall_time_s
    for k in (3, "auto"):
        assert times[(0.0, "dsi", k)] < 1.3 * times[(0.0, "ar", 3)]
        assert times[(0.7, "dsi", k)] < times[(0.7, "si", 3)]
        assert times[(0.7, "dsi", k)] < 0.8 * times[(0.7, "ar", 3)]


def test_stats_are_consistent(no_thread_leak):
    result, _ = traced_run(0.7, 3, 3, dsi.SamplingParams(), tokens=80)
    s = result.stats
    assert s.new_tokens == 80 == len(result.tokens)
    assert s.accepted_tokens + s.rejections + s.bonus_tokens == 80
    assert s.drafted_tokens >= s.accepted_tokens + s.rejections
    assert 0.0 < s.acceptance_rate < 1.0
    assert s.mean_accepted_length == pytest.approx(s.accepted_tokens / (s.rejections + 1))
    assert s.verify_tasks >= s.rejections + 1
    assert s.wasted_target_s <= s.target_busy_s
    assert 0.0 < s.target_utilisation <= 1.0
    d = result.to_dict()
    assert d["stats"]["acceptance_rate"] == s.acceptance_rate and d["token_ids"] == result.tokens


def test_generation_can_be_aborted(no_thread_leak):
    import threading

    target, drafter = synthetic_pair(0.5, target_tpot=0.01, drafter_tpot=0.001)
    abort = threading.Event()
    seen = []

    def on_tokens(tokens):
        seen.extend(tokens)
        if len(seen) >= 5:
            abort.set()

    with pytest.raises(dsi.GenerationAborted):
        dsi.generate(target=target, drafter=drafter, prompt=[1], max_new_tokens=500, on_tokens=on_tokens, abort=abort)
    assert 5 <= len(seen) < 500


def test_a_preempted_running_forward_frees_its_server(no_thread_leak):
    """Never-accepting drafter, slow target with one server: each rejection must abort the
    running stale window at once, so DSI keeps pace with non-SI instead of queueing."""
    target, drafter = synthetic_pair(0.0, vocab_size=16, seed=2)
    target = WithLatency(target, ttft=0.01, tpot=0.01)
    out = dsi.generate(target=target, drafter=drafter, prompt=[1], max_new_tokens=15, lookahead=1, num_target_servers=1)
    ref = dsi.generate(target=target, prompt=[1], method="ar", max_new_tokens=15)
    assert out.tokens == ref.tokens
    assert out.stats.preempted_tasks > 0
    assert out.stats.wall_time_s < 2.0 * ref.stats.wall_time_s


def _task_accounting(stats, trace):
    submitted = {task_id for kind, task_id, _ in trace if kind == "submit"}
    used = {task_id for kind, task_id, _ in trace if kind == "apply"}
    assert len(submitted) == stats.verify_tasks
    return len(used), stats.preempted_tasks, stats.cancelled_tasks


@pytest.mark.parametrize("acceptance, lookahead, servers", [(0.5, 2, 3), (0.8, 1, 4), (0.3, 1, 2), (0.9, 3, 1),
                                                       (0.5, "auto", 3), (0.9, "auto", 1)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_task_is_used_preempted_or_cancelled_exactly_once(acceptance, lookahead, servers, seed, no_thread_leak):
    """Telemetry adds up: each verification task's result is applied, or the task is counted as
    preempted (stale after a rejection: dropped, stopped, or its early result discarded), or as
    cancelled when the generation ended. Jitter makes later windows' results arrive first."""
    result, trace = traced_run(acceptance, lookahead, servers, dsi.SamplingParams(), seed=seed, jitter=0.004)
    used, preempted, cancelled = _task_accounting(result.stats, trace)
    assert used + preempted + cancelled == result.stats.verify_tasks
    assert result.stats.wasted_target_s <= result.stats.target_busy_s


def test_tasks_outstanding_at_an_abort_are_counted_as_cancelled(no_thread_leak):
    import threading

    target, drafter = synthetic_pair(0.9, vocab_size=16, seed=4, target_tpot=0.02, drafter_tpot=0.001)
    decoder = DSIDecoder(drafter, 2, lambda sink: ThreadTargetPool(target, 3, sink), trace=True)
    abort = threading.Event()
    try:
        request = make_request([1, 2, 3], 400, dsi.SamplingParams(), None, 16)
        with pytest.raises(dsi.GenerationAborted) as info:
            decoder.generate(request, on_tokens=lambda tokens: abort.set(), abort=abort)
    finally:
        decoder.close()
    stats = info.value.stats
    used, preempted, cancelled = _task_accounting(stats, decoder.trace)
    assert cancelled > 0  # the drafter runs ahead, so windows are in flight when the abort lands
    assert used + preempted + cancelled == stats.verify_tasks


def test_late_answers_to_a_previous_request_are_not_charged_to_the_next(no_thread_leak):
    """Tasks cancelled when one request ends answer later, possibly while the next request on the
    same decoder runs; their target time belongs to neither request's useful work and must not
    show up as the next request's waste (an always-accepting drafter wastes nothing)."""
    import threading

    target, drafter = synthetic_pair(1.0, vocab_size=16, seed=5, target_tpot=0.03, drafter_tpot=0.001)
    decoder = DSIDecoder(drafter, 2, lambda sink: ThreadTargetPool(target, 3, sink))
    try:
        abort = threading.Event()
        with pytest.raises(dsi.GenerationAborted) as info:
            decoder.generate(make_request([1, 2], 400, dsi.SamplingParams(), None, 16),
                             on_tokens=lambda tokens: abort.set(), abort=abort)
        assert info.value.stats.cancelled_tasks > 0  # forwards still running when the abort landed
        second = decoder.generate(make_request([3, 4], 12, dsi.SamplingParams(), None, 16))
    finally:
        decoder.close()
    s = second.stats
    assert s.rejections == 0 and s.preempted_tasks == 0
    assert s.wasted_target_s == 0.0
    assert s.target_forwards <= s.verify_tasks
