"""Thread pool: results, cancellation of running forwards, one server per task, no leaks."""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest

from dsi.models import CallableLM, WithLatency
from dsi.sampling import SamplingParams
from dsi.transport.base import TaskAborted, TaskResult, VerifyTask
from dsi.transport.threads import ThreadTargetPool

GREEDY = SamplingParams()


def slow_model(seconds_per_token, vocab=8, calls=None):
    def next_logits(ctx):
        if calls is not None:
            calls.append((threading.get_ident(), ctx))
        time.sleep(seconds_per_token)
        return np.eye(vocab)[len(ctx) % vocab]

    return CallableLM(next_logits, vocab)


def test_results_carry_argmax_rows(no_thread_leak):
    events = queue.SimpleQueue()
    model = CallableLM(lambda ctx: np.eye(8)[(sum(ctx)) % 8], 8)
    with ThreadTargetPool(model, 2, events.put) as pool:
        pool.submit(VerifyTask(0, (1, 2, 3), 2, GREEDY))
        result = events.get(timeout=5)
    assert isinstance(result, TaskResult)
    assert result.tokens.tolist() == [3, 6]  # after (1, 2) and (1, 2, 3)
    assert result.probs is None


def test_sampling_results_carry_processed_probabilities(no_thread_leak):
    events = queue.SimpleQueue()
    model = CallableLM(lambda ctx: np.log(np.array([0.5, 0.3, 0.2])), 3)
    with ThreadTargetPool(model, 1, events.put) as pool:
        pool.submit(VerifyTask(0, (1,), 1, SamplingParams(temperature=1.0, top_k=2)))
        result = events.get(timeout=5)
    np.testing.assert_allclose(result.probs, [[0.625, 0.375, 0.0]])


def test_cancel_stops_a_running_forward_within_one_step(no_thread_leak):
    events = queue.SimpleQueue()
    model = WithLatency(CallableLM(lambda ctx: np.zeros(4), 4), ttft=30.0, tpot=30.0)
    with ThreadTargetPool(model, 1, events.put) as pool:
        pool.submit(VerifyTask(7, (1, 2), 1, GREEDY))
        time.sleep(0.05)
        started = time.monotonic()
        pool.cancel([7])
        event = events.get(timeout=5)
        stopped_after = time.monotonic() - started
        assert isinstance(event, TaskAborted) and event.task_id == 7
        assert stopped_after < 2.0  # the forward would have taken 30 s
    # the server was free at once: a fast model proves the next task runs


def test_cancelled_server_takes_the_next_task_and_its_cache_is_consistent(no_thread_leak):
    events = queue.SimpleQueue()
    calls = []
    model = slow_model(0.05, calls=calls)
    with ThreadTargetPool(model, 1, events.put) as pool:
        pool.submit(VerifyTask(0, tuple(i % 8 for i in range(1, 40)), 1, GREEDY))  # 39 tokens, ~2 s
        pool.submit(VerifyTask(1, (1, 2, 3), 1, GREEDY))  # queued behind it
        pool.submit(VerifyTask(2, (5,), 1, GREEDY))  # queued
        time.sleep(0.2)
        pool.cancel([0, 2])
        first = events.get(timeout=5)
        second = events.get(timeout=5)
    assert isinstance(first, TaskAborted) and first.task_id == 0
    assert isinstance(second, TaskResult) and second.task_id == 1
    assert second.tokens.tolist() == [3]  # computed on the right context
    assert all(ctx[0] != 5 for _, ctx in calls)  # the cancelled queued task never ran


def test_each_task_runs_on_exactly_one_server(no_thread_leak):
    events = queue.SimpleQueue()
    runs = []
    lock = threading.Lock()

    def next_logits(ctx):
        with lock:
            runs.append((threading.current_thread().name, ctx))
        time.sleep(0.001)
        return np.zeros(40)

    with ThreadTargetPool(CallableLM(next_logits, 40), 4, events.put) as pool:
        for i in range(40):
            pool.submit(VerifyTask(i, (i % 4, i), 1, GREEDY))
        results = [events.get(timeout=5) for _ in range(40)]
    assert sorted(r.task_id for r in results) == list(range(40))
    contexts = [ctx for _, ctx in runs if len(ctx) == 2]
    assert len(contexts) == len(set(contexts)) == 40  # no task computed twice
    assert len({name for name, _ in runs}) > 1  # and the work was spread


def test_close_joins_every_thread_and_rejects_new_work(no_thread_leak):
    pool = ThreadTargetPool(CallableLM(lambda ctx: np.zeros(4), 4), 3, lambda e: None)
    assert pool.alive_servers() == 3
    pool.close()
    assert pool.alive_servers() == 0
    with pytest.raises(Exception, match="closed"):
        pool.submit(VerifyTask(0, (1,), 1, GREEDY))


def test_devices_option_places_each_server_session(no_thread_leak):
    placed = []

    class Placeable:
        vocab_size = 4

        def new_session(self, device=None):
            placed.append(device)
            return CallableLM(lambda ctx: np.zeros(4), 4).new_session()

    pool = ThreadTargetPool(Placeable(), 3, lambda e: None, devices=["cuda:1", "cuda:2"])
    pool.close()
    assert sorted(placed) == ["cuda:1", "cuda:1", "cuda:2"]
    with pytest.raises(Exception, match="cannot place sessions on devices"):
        ThreadTargetPool(CallableLM(lambda ctx: np.zeros(4), 4), 1, lambda e: None, devices=["cuda:0"])
