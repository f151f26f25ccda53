"""Thread pool failures on the same footing as processes and Ray: a server thread that cannot make
its session is dead (its task re-queued, ServerDied reported); a task whose forward raises is a
TaskFailed and the thread serves on."""

from __future__ import annotations

import itertools
import queue
import threading

import numpy as np
import pytest

import dsi
from dsi.errors import WorkerError
from dsi.models import CallableLM, synthetic_pair
from dsi.sampling import SamplingParams
from dsi.transport.base import ServerDied, TaskFailed, TaskResult, VerifyTask
from dsi.transport.threads import ThreadTargetPool

GREEDY = SamplingParams()


class BrokenSessions:
    """A model whose first ``broken`` sessions cannot be created."""

    def __init__(self, model, broken: int) -> None:
        self.model = model
        self._count = itertools.count()
        self._broken = broken
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def new_session(self):
        with self._lock:
            n = next(self._count)
        if n < self._broken:
            raise MemoryError("no memory for a cache")
        return self.model.new_session()


def test_a_thread_without_session_is_dead_and_the_request_completes(no_thread_leak):
    target, drafter = synthetic_pair(0.7, vocab_size=24, seed=2)
    params = SamplingParams(temperature=1.0, seed=3)
    reference = dsi.generate(target=target, drafter=drafter, prompt=[1, 2], max_new_tokens=30, sampling=params,
                             num_target_servers=3).tokens
    done = []
    worker = threading.Thread(target=lambda: done.append(dsi.generate(
        target=BrokenSessions(target, 1), drafter=drafter, prompt=[1, 2], max_new_tokens=30,
        sampling=params, num_target_servers=3)), name="test-generate", daemon=True)
    worker.start()
    worker.join(20.0)  # a task handed to the dead thread would wait forever
    assert done, "generation hung on a dead server thread"
    out = done[0]
    assert out.tokens == reference
    assert out.stats.extra["dead_servers"] == 1


def test_every_thread_dead_fails_fast(no_thread_leak):
    target, drafter = synthetic_pair(0.7, vocab_size=24, seed=2)
    with pytest.raises(WorkerError, match="no target server is alive"):
        dsi.generate(target=BrokenSessions(target, 2), drafter=drafter, prompt=[1, 2], max_new_tokens=30,
                     num_target_servers=2, transport_options={"restart_dead": False})


def test_dead_threads_are_replaced_and_the_request_completes(no_thread_leak):
    target, drafter = synthetic_pair(0.7, vocab_size=24, seed=2)
    reference = dsi.generate(target=target, prompt=[1, 2], max_new_tokens=30, method="ar").tokens
    out = dsi.generate(target=BrokenSessions(target, 2), drafter=drafter, prompt=[1, 2], max_new_tokens=30,
                       num_target_servers=2)  # both first sessions fail; both replacements serve
    assert out.tokens == reference
    assert out.stats.extra["dead_servers"] == 2


class GatedBrokenSessions(BrokenSessions):
    """BrokenSessions whose broken sessions fail only once ``gate`` opens (a task is handed to them first)."""

    def __init__(self, model, broken: int) -> None:
        super().__init__(model, broken)
        self.gate = threading.Event()

    def new_session(self):
        with self._lock:
            n = next(self._count)
        if n < self._broken:
            self.gate.wait(5)
            raise MemoryError("no memory for a cache")
        return self.model.new_session()


def test_servers_dying_before_their_session_do_not_make_the_task_poison(no_thread_leak):
    """A task handed to servers still making their sessions, which then fail, never ran on them: it is
    re-queued as often as that happens and answered by a replacement, not failed as a poison task."""
    target, _ = synthetic_pair(0.7, vocab_size=24, seed=2)
    model = GatedBrokenSessions(target, 2)
    events = queue.SimpleQueue()
    with ThreadTargetPool(model, 2, events.put) as pool:
        pool.submit(VerifyTask(0, (1, 2), 1, GREEDY))  # on server 0 (or 1) while it makes its session
        model.gate.set()  # both sessions fail now: the task was on the first, then on the other
        seen = []
        while not seen or not isinstance(seen[-1], TaskResult | TaskFailed):
            seen.append(events.get(timeout=10))
    assert [type(e) for e in seen] == [ServerDied, ServerDied, TaskResult]
    logits = target.new_session().extend([1, 2])
    assert seen[-1].tokens.tolist() == [int(np.argmax(logits[-1]))]


def test_a_server_that_never_gets_a_session_is_given_up_after_max_restarts(no_thread_leak):
    from dsi.transport.dispatch import MAX_RESTARTS

    target, drafter = synthetic_pair(0.7, vocab_size=24, seed=2)
    with pytest.raises(WorkerError, match="no target server is alive"):
        dsi.generate(target=BrokenSessions(target, 10**6), drafter=drafter, prompt=[1, 2], max_new_tokens=30,
                     num_target_servers=2)
    events = queue.SimpleQueue()
    pool = ThreadTargetPool(BrokenSessions(target, 10**6), 2, events.put)
    deaths = []
    while len(deaths) < 2 * (MAX_RESTARTS + 1):
        deaths.append(events.get(timeout=5))
    assert all(isinstance(d, ServerDied) for d in deaths)
    assert [d.restarting for d in deaths].count(False) == 2  # each server's last death is final
    assert pool.alive_servers() == 0
    pool.close()


def test_a_task_error_is_task_failed_and_the_thread_serves_on(no_thread_leak):
    def next_logits(ctx):
        if ctx[-1] == 0:
            raise ValueError("bad token")
        return np.eye(4)[len(ctx) % 4]

    events = queue.SimpleQueue()
    with ThreadTargetPool(CallableLM(next_logits, 4), 1, events.put) as pool:
        pool.submit(VerifyTask(0, (1, 0), 1, GREEDY))
        failed = events.get(timeout=5)
        pool.submit(VerifyTask(1, (1, 2), 1, GREEDY))
        result = events.get(timeout=5)
        assert pool.alive_servers() == 1
    assert isinstance(failed, TaskFailed) and "bad token" in failed.error
    assert isinstance(result, TaskResult) and result.tokens.tolist() == [2]
    assert not isinstance(failed, ServerDied)
