"""Process pool: framing, results equal to threads, cancellation of a running forward, lost
servers (re-queue, restart, all dead), start failures, and no process left after close."""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import time

import numpy as np
import pytest

from dsi.errors import ConfigError, ModelError, WorkerError
from dsi.models import CallableLM, WithLatency
from dsi.models.emulated.synthetic import SyntheticTarget
from dsi.sampling import SamplingParams
from dsi.transport import make_pool
from dsi.transport.base import ServerDied, TaskAborted, TaskResult, VerifyTask
from dsi.transport.processes import ProcessTargetPool, recv_message, send_message
from dsi.transport.threads import ThreadTargetPool
from tests.transport_support import dsi_children, wait_gone

GREEDY = SamplingParams()
SAMPLING = SamplingParams(temperature=0.8, top_k=10)
VOCAB = 16


def model(ttft: float = 0.0, tpot: float = 0.0):
    lm = CallableLM(SyntheticTarget(VOCAB, seed=5), VOCAB, name="synthetic")
    return WithLatency(lm, ttft, tpot) if ttft or tpot else lm


def next_event(events, timeout=10.0, skip=()):
    while True:
        event = events.get(timeout=timeout)
        if not isinstance(event, skip):
            return event


class SlowTarget(SyntheticTarget):
    """Synthetic logits, ``seconds`` per position (CallableLM checks the cancel flag per position)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(VOCAB, seed=5)
        self.seconds = seconds

    def __call__(self, context):
        time.sleep(self.seconds)
        return super().__call__(context)


class FailingRecipe:
    """A recipe whose build fails in the child (module-level: picklable by reference)."""

    uses_device = False

    def build(self):
        raise RuntimeError("no weights here")

    def placed(self, device, threads):
        return self


@pytest.fixture
def events():
    return queue.SimpleQueue()


def test_framing_sends_arrays_out_of_band_and_intact():
    parent, child = multiprocessing.Pipe()
    arrays = {
        "probs": np.random.default_rng(0).random((3, 5)),  # [rows, V] float64
        "tokens": np.arange(4, dtype=np.int64),
        "empty": np.empty((0, 7), dtype=np.float32),
        "strided": np.arange(20.0)[::2],  # not contiguous: pickled in band
    }
    send_message(parent, (1, arrays, "text"))
    number, got, text = recv_message(child)
    assert (number, text) == (1, "text")
    for name, array in arrays.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape
        np.testing.assert_array_equal(got[name], array)
    got["probs"][0, 0] = 5.0  # writable buffers


def test_results_equal_the_thread_pool(events):
    tasks = [VerifyTask(0, (1, 2, 3, 4), 3, GREEDY), VerifyTask(1, (4, 3, 2), 2, SAMPLING)]
    answers = {}
    for name, pool_class in (("threads", ThreadTargetPool), ("processes", ProcessTargetPool)):
        with pool_class(model(), 2, events.put) as pool:
            for task in tasks:
                pool.submit(task)
            got = sorted((next_event(events) for _ in tasks), key=lambda e: e.task_id)
        answers[name] = got
    for ref, out in zip(answers["threads"], answers["processes"], strict=True):
        assert isinstance(out, TaskResult)
        np.testing.assert_array_equal(out.tokens, ref.tokens)
        assert (out.probs is None) == (ref.probs is None)
        if ref.probs is not None:
            np.testing.assert_array_equal(out.probs, ref.probs)
    assert not dsi_children()


def test_cancel_stops_a_running_forward_within_one_step_and_the_server_serves_on(events):
    slow = CallableLM(SlowTarget(0.05), VOCAB)
    with ProcessTargetPool(slow, 1, events.put) as pool:
        pool.submit(VerifyTask(7, tuple(i % VOCAB for i in range(1, 200)), 1, GREEDY))  # 199 positions: 10 s
        time.sleep(0.5)
        assert pool.busy_servers() == [0]
        started = time.monotonic()
        pool.cancel([7])
        event = next_event(events)
        assert isinstance(event, TaskAborted) and event.task_id == 7
        assert time.monotonic() - started < 1.0  # one step is 0.05 s
        assert event.compute_s > 0.3
        pool.submit(VerifyTask(8, (1, 2, 3), 2, GREEDY))
        result = next_event(events)
    assert isinstance(result, TaskResult) and result.task_id == 8
    expected = [np.argmax(SyntheticTarget(VOCAB, 5)(c)) for c in [(1, 2), (1, 2, 3)]]
    assert result.tokens.tolist() == expected  # the aborted forward left the session consistent


def test_a_killed_busy_server_s_task_is_rerun_on_another_server(events):
    with ProcessTargetPool(model(ttft=1.0, tpot=1.0), 2, events.put, restart_dead=False) as pool:
        pool.submit(VerifyTask(0, (1, 2), 1, GREEDY))
        time.sleep(0.3)
        [busy] = pool.busy_servers()
        victim = pool.server_pids()[busy]
        os.kill(victim, signal.SIGKILL)
        died = next_event(events)
        assert isinstance(died, ServerDied) and died.server_id == busy and not died.restarting
        assert "SIGKILL" in died.error
        result = next_event(events)
        assert isinstance(result, TaskResult) and result.task_id == 0 and result.server_id == 1 - busy
        assert pool.alive_servers() == 1
        pids = pool.server_pids()
    assert wait_gone(pids) == []


def test_restart_dead_replaces_a_killed_server(events):
    with ProcessTargetPool(model(), 2, events.put, restart_dead=True) as pool:
        old = pool.server_pids()[0]
        os.kill(old, signal.SIGKILL)
        died = next_event(events)
        assert isinstance(died, ServerDied) and died.server_id == 0 and died.restarting
        assert pool.alive_servers() == 2  # the replacement counts while it starts
        deadline = time.monotonic() + 20
        while pool.server_pids()[0] == old and time.monotonic() < deadline:
            time.sleep(0.05)
        new = pool.server_pids()[0]
        assert new != old
        slow = [VerifyTask(i, (1, 2, i), 1, GREEDY) for i in range(4)]
        for task in slow:
            pool.submit(task)
        servers = {next_event(events).server_id for _ in slow}
        assert 0 in servers  # the replacement serves
        pids = pool.server_pids()
    assert wait_gone(pids + [old]) == []


def test_when_every_server_is_dead_submit_fails_at_once(events):
    pool = ProcessTargetPool(model(), 2, events.put, restart_dead=False)
    pids = pool.server_pids()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    deaths = [next_event(events), next_event(events)]
    assert all(isinstance(e, ServerDied) for e in deaths)
    assert pool.alive_servers() == 0
    started = time.monotonic()
    with pytest.raises(WorkerError, match="no target server is alive"):
        pool.submit(VerifyTask(0, (1,), 1, GREEDY))
    assert time.monotonic() - started < 1.0
    pool.close()
    assert wait_gone(pids) == []


def test_close_stops_every_process_even_mid_forward(events):
    pool = ProcessTargetPool(model(ttft=30.0, tpot=30.0), 3, events.put)
    for i in range(3):
        pool.submit(VerifyTask(i, (1, i), 1, GREEDY))
    time.sleep(0.3)
    pids = pool.server_pids()
    started = time.monotonic()
    pool.close()
    assert time.monotonic() - started < 5.0
    assert wait_gone(pids, timeout=2.0) == []
    assert not dsi_children()
    with pytest.raises(WorkerError, match="closed"):
        pool.submit(VerifyTask(9, (1,), 1, GREEDY))


def test_a_server_that_cannot_build_its_model_fails_the_pool_with_its_message(events):
    with pytest.raises(ModelError, match="no weights here"):
        ProcessTargetPool(model(), 2, events.put, recipe=FailingRecipe())
    assert wait_gone(dsi_children(), timeout=5.0) == []


def test_bad_options_are_config_errors_before_any_process_starts(events):
    unpicklable = CallableLM(lambda ctx: np.zeros(4), 4)
    with pytest.raises(ConfigError, match="cannot be sent to another process"):
        make_pool("processes", unpicklable, 2, events.put)
    with pytest.raises(ConfigError, match="unknown options"):
        make_pool("processes", model(), 2, events.put, gpus=1)
    with pytest.raises(ConfigError, match="has no device setting"):
        make_pool("processes", model(), 2, events.put, devices=["cuda:0", "cuda:1"])
    with pytest.raises(ConfigError, match="threads_per_server"):
        make_pool("processes", model(), 2, events.put, threads_per_server=0)
    assert not dsi_children()
