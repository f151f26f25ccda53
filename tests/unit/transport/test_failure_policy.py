"""The failure policy every pool shares: unreadable answers, out-of-turn answers, poison tasks,
restart budgets and liveness deadlines (on fake remote servers and on the thread pool)."""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest

from dsi.errors import ConfigError
from dsi.models import CallableLM
from dsi.sampling import SamplingParams
from dsi.transport.base import ServerDied, TaskFailed, TaskResult, VerifyTask
from dsi.transport.dispatch import MAX_RESTARTS, MAX_TASK_DEATHS
from dsi.transport.liveness import ForwardRates, LivenessPolicy
from dsi.transport.remote import STOPPED, BadAnswer, RemotePool, ServerLost
from dsi.transport.threads import ThreadTargetPool

GREEDY = SamplingParams()


class FakeServer:
    """A remote server whose answers the test scripts: each task's answer is ``script(task)``, which
    returns an event or raises (BadAnswer, ServerLost, anything)."""

    def __init__(self, script) -> None:
        self.script = script
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.killed = threading.Event()

    def wait_ready(self, timeout):
        pass

    def send(self, task):
        self.inbox.put(task)

    def receive(self):
        task = self.inbox.get()
        if task is STOPPED or self.killed.is_set():
            return STOPPED
        return self.script(task)

    def cancel(self, task_id):
        pass

    def request_stop(self):
        self.inbox.put(STOPPED)

    def stop(self, timeout):
        self.inbox.put(STOPPED)

    def kill(self):
        self.killed.set()
        self.inbox.put(STOPPED)


def result(task, server=0):
    return TaskResult(task.task_id, server, np.zeros(task.num_rows, np.int64), None, 0.001)


def next_events(events, count, timeout=5.0):
    return [events.get(timeout=timeout) for _ in range(count)]


def test_an_unreadable_answer_fails_its_task_and_the_server_serves_on():
    def script(task):
        if task.task_id == 0:
            raise BadAnswer("UndecodableMessage: TypeError: __init__() missing 1 required keyword-only argument")
        return result(task)

    events = queue.SimpleQueue()
    with RemotePool(lambda s: FakeServer(script), 1, events.put, liveness=False) as pool:
        pool.submit(VerifyTask(0, (1,), 1, GREEDY))
        failed = events.get(timeout=5)
        pool.submit(VerifyTask(1, (1, 2), 1, GREEDY))
        answered = events.get(timeout=5)
        assert pool.alive_servers() == 1
    assert isinstance(failed, TaskFailed) and failed.task_id == 0 and "could not be read" in failed.error
    assert isinstance(answered, TaskResult) and answered.task_id == 1


@pytest.mark.parametrize("failure", [RuntimeError("a bug in a handle"), KeyError("x"), ServerLost("EOF")])
def test_any_receive_failure_loses_the_server_and_reruns_its_task_never_a_silent_listener(failure):
    launched = []

    def launch(server):
        def script(task):
            if len(launched) <= 2 and server == 0:  # only the first server 0 breaks
                raise failure
            return result(task, server)
        handle = FakeServer(script)
        launched.append(handle)
        return handle

    events = queue.SimpleQueue()
    with RemotePool(launch, 2, events.put, liveness=False) as pool:
        pool.submit(VerifyTask(0, (1,), 1, GREEDY))  # goes to server 0, which breaks
        seen = next_events(events, 2)  # in either order: the rerun may answer before the death is told
    [died] = [e for e in seen if isinstance(e, ServerDied)]
    [answered] = [e for e in seen if isinstance(e, TaskResult)]
    assert isinstance(died, ServerDied) and died.server_id == 0 and died.restarting
    assert isinstance(answered, TaskResult) and answered.task_id == 0 and answered.server_id == 1


def test_an_answer_out_of_turn_loses_the_server():
    def script(task):
        return TaskResult(task.task_id + 100, 0, np.zeros(1, np.int64), None, 0.0)  # another task's answer

    events = queue.SimpleQueue()
    with RemotePool(lambda s: FakeServer(script), 1, events.put, restart_dead=False, liveness=False) as pool:
        pool.submit(VerifyTask(0, (1,), 1, GREEDY))
        died = events.get(timeout=5)
        assert isinstance(died, ServerDied) and "while running task 0" in died.error
        assert pool.alive_servers() == 0


def test_a_poison_task_fails_after_it_took_down_max_task_deaths_servers():
    def script(task):
        raise ServerLost("the task crashed the server")

    events = queue.SimpleQueue()
    with RemotePool(lambda s: FakeServer(script), 3, events.put, liveness=False) as pool:
        pool.submit(VerifyTask(0, (1,), 1, GREEDY))
        seen = next_events(events, MAX_TASK_DEATHS + 1)
    deaths = [e for e in seen if isinstance(e, ServerDied)]
    failures = [e for e in seen if isinstance(e, TaskFailed)]
    assert len(deaths) == MAX_TASK_DEATHS and len(failures) == 1
    assert failures[0].task_id == 0 and "not retried" in failures[0].error
    assert events.empty() or not isinstance(events.get(timeout=0.5), ServerDied)  # no third server died


def test_a_frozen_server_is_replaced_at_its_liveness_deadline_and_its_task_rerun():
    frozen = threading.Event()

    def launch(server):
        def script(task):
            if task.task_id == 5 and not frozen.is_set():
                frozen.set()
                handle.killed.wait(30)  # frozen until the pool kills it
                return STOPPED
            return result(task, server)
        handle = FakeServer(script)
        return handle

    events = queue.SimpleQueue()
    policy = {"floor_s": 0.3, "factor": 2.0, "unmeasured_s": 0.5}
    with RemotePool(launch, 1, events.put, liveness=policy) as pool:
        for i in range(3):  # measured forwards: the deadline is the floor plus a little
            pool.submit(VerifyTask(i, (1, i), 1, GREEDY))
            assert isinstance(events.get(timeout=5), TaskResult)
        start = time.monotonic()
        pool.submit(VerifyTask(5, (1, 2, 3), 1, GREEDY))
        died = events.get(timeout=10)
        answered = events.get(timeout=10)
        elapsed = time.monotonic() - start
    assert isinstance(died, ServerDied) and "liveness deadline" in died.error and died.restarting
    assert isinstance(answered, TaskResult) and answered.task_id == 5  # on the replacement
    assert 0.3 <= elapsed < 5.0


def test_liveness_deadlines_scale_with_the_measured_rate_and_the_tokens_to_process():
    policy = LivenessPolicy(floor_s=2.0, factor=10.0, unmeasured_s=60.0)
    rates = ForwardRates(2)
    assert rates.deadline_s(policy, 0, 5) == 60.0  # nothing measured yet
    rates.record(0, 0.5, 5)  # 0.1 s per token on server 0
    assert rates.deadline_s(policy, 0, 5) == pytest.approx(2.0 + 10 * 0.1 * 5)
    assert rates.deadline_s(policy, 1, 1000) == pytest.approx(2.0 + 10 * 0.1 * 1000)  # pool's rate for a fresh one
    rates.forget(0)
    rates.record(1, 0.01, 1)
    assert rates.deadline_s(policy, 0, 1) == pytest.approx(2.0 + 10 * 0.01)
    assert rates.deadline_s(LivenessPolicy(enabled=False), 0, 1) is None


@pytest.mark.parametrize("value, match", [
    (0, "floor_s=0.0 must be a number > 0"), (-1.0, "must be a number > 0"), ("fast", "liveness='fast'"),
    ({"floor": 3}, "unknown fields"), ({"factor": 0}, "factor=0"), (True, "liveness=True"),
])
def test_bad_liveness_options_name_the_value(value, match):
    with pytest.raises(ConfigError, match=match):
        LivenessPolicy.from_option(value)


def test_a_thread_server_ended_by_a_base_exception_is_restarted_and_its_task_rerun(no_thread_leak):
    calls = {"n": 0}

    class Exit(BaseException):
        pass

    def next_logits(ctx):
        calls["n"] += 1
        if calls["n"] == 1:
            raise Exit("a library's own BaseException")
        return np.eye(4)[len(ctx) % 4]

    events = queue.SimpleQueue()
    with ThreadTargetPool(CallableLM(next_logits, 4), 1, events.put) as pool:
        pool.submit(VerifyTask(0, (1, 2), 1, GREEDY))
        seen = next_events(events, 2)  # either order: the rerun may answer before the death is told
        assert pool.alive_servers() == 1
    [died] = [e for e in seen if isinstance(e, ServerDied)]
    [answered] = [e for e in seen if isinstance(e, TaskResult)]
    assert died.restarting and "Exit" in died.error
    assert isinstance(answered, TaskResult) and answered.task_id == 0 and answered.tokens.tolist() == [2]


def test_a_wedged_thread_is_abandoned_and_its_late_answer_never_reported(no_thread_leak):
    release = threading.Event()
    wedged = threading.Event()

    def next_logits(ctx):
        if ctx[-1] == 3 and not wedged.is_set():
            wedged.set()
            release.wait(30)  # a wedged accelerator call
        return np.eye(4)[len(ctx) % 4]

    events = queue.SimpleQueue()
    pool = ThreadTargetPool(CallableLM(next_logits, 4), 1, events.put,
                            liveness={"floor_s": 0.3, "factor": 2.0, "unmeasured_s": 0.5})
    try:
        pool.submit(VerifyTask(0, (1, 2), 1, GREEDY))
        assert isinstance(events.get(timeout=5), TaskResult)
        pool.submit(VerifyTask(1, (1, 3), 1, GREEDY))
        died, answered = next_events(events, 2)
        assert isinstance(died, ServerDied) and "liveness deadline" in died.error
        assert isinstance(answered, TaskResult) and answered.task_id == 1  # rerun on the new thread
        release.set()  # the old thread's forward returns now...
        time.sleep(0.3)
        assert events.empty()  # ...and its answer is not reported
    finally:
        release.set()
        pool.close()


class IdleDying(FakeServer):
    """A server that dies as soon as it is started, before any task (unless ``serve_one``: it then
    answers its first task first)."""

    def __init__(self, serve_one: bool) -> None:
        super().__init__(result)
        self.serve_one = serve_one

    def receive(self):
        if self.serve_one:
            self.serve_one = False
            task = self.inbox.get()
            return STOPPED if task is STOPPED else result(task)
        raise ServerLost("died idle")


def deaths(events, timeout=1.0) -> list[bool]:
    found = []
    while True:
        try:
            event = events.get(timeout=timeout)
        except queue.Empty:
            return found
        if isinstance(event, ServerDied):
            found.append(event.restarting)


def test_a_crash_loop_is_stopped_after_max_restarts_and_a_served_task_clears_the_count():
    from dsi.transport.dispatch import RESTART_WINDOW_S

    assert RESTART_WINDOW_S >= 5  # the loop below happens well within it
    lives = iter([False, False, True] + [False] * 20)  # the third life serves one task first
    events = queue.SimpleQueue()
    with RemotePool(lambda s: IdleDying(next(lives)), 1, events.put, liveness=False) as pool:
        start = time.monotonic()
        while time.monotonic() - start < 5 and pool.idle_servers() == 0:  # life 3, ready and idle
            time.sleep(0.005)
        pool.submit(VerifyTask(0, (1,), 1, GREEDY))  # life 3 serves it: the count is cleared
        seen = deaths(events)
        assert pool.alive_servers() == 0
    # lives 1 and 2 die idle (2 counted); life 3 serves, clearing them; then MAX_RESTARTS more, then none
    assert seen.count(True) == 2 + MAX_RESTARTS and seen.count(False) == 1  # told from several threads: counts


def test_deaths_on_tasks_are_charged_to_the_tasks_not_to_the_server():
    def script(task):
        raise ServerLost("the task crashed the server")

    events = queue.SimpleQueue()
    with RemotePool(lambda s: FakeServer(script), 1, events.put, liveness=False) as pool:
        for task_id in range(MAX_RESTARTS + 2):  # more deaths than a crash loop may have
            deadline = time.monotonic() + 5
            while pool.idle_servers() == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            pool.submit(VerifyTask(task_id, (1,), 1, GREEDY))
            failed = [e for e in (events.get(timeout=5) for _ in range(3)) if isinstance(e, TaskFailed)]
            assert failed and failed[0].task_id == task_id  # each task failed as poison after 2 deaths
        assert pool.alive_servers() == 1  # still replaced every time



def test_a_server_that_breaks_on_every_task_never_gets_a_rerun_back_while_another_serves():
    """An engine that answers garbage dies on each task and is replaced at once; the task it took
    waits for the healthy server (busy when the task comes back) instead of going to the replacement,
    which would break again and make the task poison."""
    def launch(server):
        def script(task):
            if server == 0:
                time.sleep(0.05)
                raise ServerLost("garbage")
            time.sleep(0.3)  # still busy when server 0 dies, and while it is replaced
            return result(task, 1)
        return FakeServer(script)

    events = queue.SimpleQueue()
    with RemotePool(launch, 2, events.put, liveness=False) as pool:
        pool.submit(VerifyTask(0, (1,), 1, GREEDY))  # server 0 (the lowest idle id)
        pool.submit(VerifyTask(1, (2,), 1, GREEDY))  # server 1
        answers = []
        deadline = time.monotonic() + 10
        while len(answers) < 2 and time.monotonic() < deadline:
            event = events.get(timeout=5)
            if isinstance(event, TaskResult | TaskFailed):
                answers.append(event)
    assert sorted((type(a).__name__, a.task_id) for a in answers) == [("TaskResult", 0), ("TaskResult", 1)], answers
    assert all(a.server_id == 1 for a in answers)
