"""CallableLM sessions, forward_rows cache reuse, WithLatency timing and cancellation."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from dsi.errors import ConfigError, ContextLengthError, ModelError, TaskCancelled
from dsi.models import CallableLM, WithLatency, common_prefix_length, extend_rows, forward_rows, synthetic_pair
from dsi.models.base import context_limit
from tests.bad_ids import bad_ids


def counting_model(vocab=6):
    calls = []

    def next_logits(ctx):
        calls.append(ctx)
        return np.arange(vocab, dtype=float) * (len(ctx) % 3)

    return CallableLM(next_logits, vocab), calls


def test_common_prefix_length():
    assert common_prefix_length((1, 2, 3), (1, 2, 4)) == 2
    assert common_prefix_length((), (1,)) == 0
    assert common_prefix_length((1, 2), (1, 2, 3)) == 2


def test_forward_rows_reuses_the_cache_and_truncates():
    model, calls = counting_model()
    session = model.new_session()
    rows = forward_rows(session, (1, 2, 3), 2)
    assert rows.shape == (2, 6) and len(calls) == 3
    calls.clear()
    forward_rows(session, (1, 2, 3, 4, 5), 1)  # shares (1, 2, 3): only two new tokens run
    assert calls == [(1, 2, 3, 4), (1, 2, 3, 4, 5)]
    calls.clear()
    forward_rows(session, (1, 2, 5), 1)  # diverges at position 2: truncate to (1, 2)
    assert calls == [(1, 2, 5)] and session.tokens == (1, 2, 5)
    calls.clear()
    forward_rows(session, (1, 2, 5), 2)  # asking for 2 rows recomputes the last 2 positions
    assert calls == [(1, 2), (1, 2, 5)]
    with pytest.raises(ConfigError, match="num_rows=4"):
        forward_rows(session, (1, 2, 5), 4)


def test_callable_session_cancel_leaves_session_unchanged():
    flag = threading.Event()

    def next_logits(ctx):
        if len(ctx) == 3:
            flag.set()
        return np.zeros(8)

    session = CallableLM(next_logits, 8).new_session()
    session.extend([1])
    with pytest.raises(TaskCancelled):
        session.extend([2, 3, 4, 5], flag)
    assert session.tokens == (1,)


def test_with_latency_charges_ttft_then_tpot():
    model = WithLatency(CallableLM(lambda ctx: np.zeros(8), 8), ttft=0.05, tpot=0.01)
    session = model.new_session()
    t0 = time.perf_counter()
    session.extend([1, 2, 3])
    t1 = time.perf_counter()
    session.extend([4, 5, 6, 7])
    t2 = time.perf_counter()
    assert t1 - t0 >= 0.05 and t2 - t1 >= 0.01  # lower bounds only: never assert an upper time
    assert (t1 - t0) > (t2 - t1)


def test_with_latency_cancel_restores_the_session():
    model = WithLatency(CallableLM(lambda ctx: np.zeros(4), 4), ttft=0.0, tpot=20.0)
    session = model.new_session()
    session.extend([1])
    flag = threading.Event()
    threading.Timer(0.05, flag.set).start()
    t0 = time.monotonic()
    with pytest.raises(TaskCancelled):
        session.extend([2, 3], flag)
    assert time.monotonic() - t0 < 5.0
    assert session.tokens == (1,)


@pytest.mark.parametrize("bad", [-1, "fast", float("nan")])
def test_with_latency_rejects_bad_latencies(bad):
    with pytest.raises(ConfigError, match="ttft="):
        WithLatency(CallableLM(lambda ctx: np.zeros(4), 4), ttft=bad, tpot=0.1)


@pytest.mark.parametrize("acceptance", [0.0, 0.3, 0.9, 1.0])
def test_synthetic_pair_greedy_agreement_matches_acceptance(acceptance):
    target, drafter = synthetic_pair(acceptance, vocab_size=32, seed=5)
    rng = np.random.default_rng(0)
    agree = 0
    n = 2000
    for _ in range(n):
        ctx = tuple(int(t) for t in rng.integers(0, 32, size=rng.integers(1, 6)))
        agree += int(np.argmax(target.next_logits(ctx)) == np.argmax(drafter.next_logits(ctx)))
    assert abs(agree / n - acceptance) < 0.04


def test_synthetic_pair_with_latency_and_bad_acceptance():
    target, drafter = synthetic_pair(0.5, target_tpot=0.02, drafter_tpot=0.002)
    assert isinstance(target, WithLatency) and target.tpot == 0.02 and drafter.ttft == 0.002
    with pytest.raises(ConfigError, match="acceptance=1.5"):
        synthetic_pair(1.5)


def test_callable_max_context_is_declared_enforced_and_validated():
    model = CallableLM(lambda ctx: np.zeros(4), 4, max_context=5)
    assert context_limit(model) == 5 and "max_context=5" in repr(model)
    session = model.new_session()
    session.extend([1, 2, 3])
    with pytest.raises(ContextLengthError, match="6 tokens exceed max_context=5"):
        session.extend([1, 2, 3])
    assert session.tokens == (1, 2, 3)  # refused before anything ran
    session.extend([1, 2])
    assert context_limit(CallableLM(lambda ctx: np.zeros(4), 4)) is None
    for bad in (0, -3, 2.5, True, "16"):
        with pytest.raises(ConfigError, match=f"max_context={bad!r} must be None"):
            CallableLM(lambda ctx: np.zeros(4), 4, max_context=bad)


def test_wrappers_declare_the_wrapped_models_context_and_bad_declarations_are_named():
    from dsi.models import ReplayLM

    inner = CallableLM(lambda ctx: np.zeros(4), 4, max_context=7)
    assert context_limit(WithLatency(inner, 0.0, 0.0)) == 7
    assert context_limit(ReplayLM(WithLatency(inner, 0.0, 0.0), {})) == 7
    assert context_limit(WithLatency(CallableLM(lambda ctx: np.zeros(4), 4), 0.0, 0.0)) is None

    class Odd:
        vocab_size, max_context = 4, "lots"

    with pytest.raises(ModelError, match="declares max_context='lots'; it must be None or an integer >= 1"):
        context_limit(Odd())


def test_greedy_rows_of_a_session_with_nan_logits_are_a_model_error():
    class NaNSession:
        tokens = ()

        def extend(self, tokens, cancel=None):
            return np.array([[0.0, np.nan, 1.0]] * len(tokens))

    with pytest.raises(ModelError, match="NaN logits"):
        extend_rows(NaNSession(), [1, 2], None, 1, greedy=True)
    assert np.isnan(extend_rows(NaNSession(), [1, 2], None, 1, greedy=False)).any()  # sampling checks its rows


@pytest.mark.parametrize("tokens, message", bad_ids(6, "tokens"))
def test_callable_sessions_refuse_bad_ids_before_the_function_sees_them(tokens, message):
    model, calls = counting_model()
    session = model.new_session()
    session.extend([1, 2])
    calls.clear()
    with pytest.raises(ConfigError, match=message):
        session.extend(tokens)
    assert calls == [] and session.tokens == (1, 2)


def test_callable_sessions_take_numpy_ids_and_check_lengths():
    model, calls = counting_model()
    session = model.new_session()
    rows = session.extend(np.array([1, 2, 3], dtype=np.int32))
    assert session.tokens == (1, 2, 3) and all(type(t) is int for ctx in calls for t in ctx)
    session.truncate(np.int64(1))
    np.testing.assert_array_equal(session.extend([np.int64(2), np.uint8(3)]), rows[1:])
    for length in (1.5, True, None, -1, 4):
        with pytest.raises(ConfigError, match=rf"truncate length={length!r} must be an integer in \[0, 3\]"):
            session.truncate(length)
    for num_rows in (0, 4, 1.5, True):
        with pytest.raises(ConfigError, match=rf"num_rows={num_rows!r} must be an integer in \[1, len\(tokens\)=3\]"):
            extend_rows(session, [1, 2, 3], None, num_rows)
        with pytest.raises(ConfigError, match=rf"num_rows={num_rows!r} must be an integer in \[1, len\(context\)=3\]"):
            forward_rows(session, (1, 2, 3), num_rows)
    assert session.tokens == (1, 2, 3)


@pytest.mark.parametrize("kwargs, message", [
    (dict(acceptance=True), r"acceptance=True must be a number in \[0, 1\]"),
    (dict(acceptance=0.5, seed=-1), r"seed=-1 must be an integer >= 0"),
    (dict(acceptance=0.5, seed=1.5), r"seed=1.5 must be an integer >= 0"),
])
def test_synthetic_pair_refuses_what_would_fail_later(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        synthetic_pair(**kwargs)


def test_a_latency_session_reads_rows_within_its_forward_and_a_plain_session_after_it():
    """extend_rows' ``read``: a latency model runs it inside its forward (a cancel set by the read stops the
    forward, which leaves the session as it was); any other session reads the finished forward's rows."""
    import threading

    from dsi.errors import TaskCancelled
    from dsi.models.base import extend_rows
    from dsi.models.emulated.latency import WithLatency
    from dsi.models.emulated.synthetic import synthetic_pair

    target, _ = synthetic_pair(0.5, vocab_size=16)
    plain = target.new_session()
    want = np.argmax(plain.extend([1, 2, 3]), axis=1)
    plain.truncate(0)
    assert extend_rows(plain, [1, 2, 3], None, 2, True, read=lambda ids: ids.tolist()) == want[1:].tolist()
    timed = WithLatency(target, 0.0, 0.0).new_session()
    assert extend_rows(timed, [1, 2, 3], None, 3, False, read=lambda rows: rows.shape) == (3, 16)
    cancel = threading.Event()

    def read_then_cancel(rows):
        cancel.set()  # as if a rejection came while the forward's result was being read
        return rows

    with pytest.raises(TaskCancelled):
        extend_rows(timed, [4, 5], cancel, 1, True, read=read_then_cancel)
    assert timed.tokens == (1, 2, 3)  # restored
    cancel.clear()
    plain.truncate(3)
    assert extend_rows(plain, [4, 5], cancel, 1, True, read=read_then_cancel) is not None  # read after: no cancel
    assert plain.tokens == (1, 2, 3, 4, 5)
