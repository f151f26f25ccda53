"""Servers that can come back (``servers_can_return``: engines): a lost one is probed with backoff and
re-admitted when its start check passes again, and the log says what is true at each step.

The model here is a CallableLM whose sessions live on named devices, any of which can be taken down: a
session cannot be made on a device that is down, and a forward there raises ServerLost, as an engine that
refuses connections does."""

from __future__ import annotations

import logging
import queue
import threading
import time

import numpy as np
import pytest

import dsi
from dsi.errors import ServerLost
from dsi.models import CallableLM, synthetic_pair
from dsi.sampling import SamplingParams
from dsi.transport import threads
from dsi.transport.base import ServerDied, TaskResult, VerifyTask
from dsi.transport.dispatch import MAX_RESTARTS
from dsi.transport.threads import ThreadTargetPool

GREEDY = SamplingParams()


class Outage:
    """``model`` served on ``devices``; ``down`` holds the devices that refuse everything now."""

    servers_can_return = True

    def __init__(self, model, can_return: bool = True) -> None:
        self.model = model
        self.down: set[str] = set()
        self.sessions: dict[str, int] = {}  # device -> sessions made there
        self.servers_can_return = can_return
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def new_session(self, device: str | None = None):
        if device in self.down:
            raise ServerLost(f"{device}: connection refused")
        with self._lock:
            self.sessions[device] = self.sessions.get(device, 0) + 1
        return OutageSession(self, self.model.new_session(), device)


class OutageSession:
    def __init__(self, outage: Outage, inner, device: str) -> None:
        self.outage, self.inner, self.device = outage, inner, device

    @property
    def tokens(self):
        return self.inner.tokens

    def extend(self, tokens, cancel=None):
        if self.device in self.outage.down:
            raise ServerLost(f"{self.device}: connection reset")
        return self.inner.extend(tokens, cancel)

    def truncate(self, length: int) -> None:
        self.inner.truncate(length)

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def fast_probes(monkeypatch):
    monkeypatch.setattr(threads, "PROBE_FIRST_S", 0.02)
    monkeypatch.setattr(threads, "PROBE_MAX_S", 0.1)


def until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def counting(vocab: int = 8) -> CallableLM:
    return CallableLM(lambda ctx: np.eye(vocab)[(ctx[-1] + 1) % vocab], vocab)


def test_a_lost_server_is_probed_until_it_is_back_then_takes_tasks_again(no_thread_leak, fast_probes, caplog):
    model = Outage(counting())
    events = queue.SimpleQueue()
    caplog.set_level(logging.DEBUG, logger="dsi.transport.threads")
    with ThreadTargetPool(model, 2, events.put, devices=["a", "b"]) as pool:
        model.down.add("b")
        pool.submit(VerifyTask(0, (1, 2), 1, GREEDY))  # idle servers tie: server 0 ("a") takes the first
        pool.submit(VerifyTask(1, (1, 2, 3), 1, GREEDY))  # server 1 ("b") takes this one, and is lost
        seen = [events.get(timeout=5) for _ in range(3)]
        died = [e for e in seen if isinstance(e, ServerDied)]
        results = {e.task_id: e for e in seen if isinstance(e, TaskResult)}
        assert len(died) == 1 and died[0].server_id == 1 and not died[0].restarting
        assert sorted(results) == [0, 1] and results[1].server_id == 0  # its task moved to the other server
        assert results[1].tokens.tolist() == [4]
        # lost: out of service, probed (every probe fails while it is down), never given up
        sessions_then = model.sessions.get("b", 0)
        assert until(lambda: sum("still lost" in r.getMessage() for r in caplog.records) >= 3)
        assert pool.servers_in_service() == 1 and pool.alive_servers() == 1 and pool.lost_servers() == [1]
        assert pool.readmissions == 0 and model.sessions.get("b", 0) == sessions_then
        model.down.discard("b")
        assert until(lambda: pool.servers_in_service() == 2), "the server did not come back"
        assert pool.lost_servers() == [] and pool.readmissions == 1 and model.sessions["b"] == sessions_then + 1
        # back in service: two tasks at once use both servers
        pool.submit(VerifyTask(2, (5,), 1, GREEDY))
        pool.submit(VerifyTask(3, (6,), 1, GREEDY))
        again = [events.get(timeout=5) for _ in range(2)]
        assert sorted(e.server_id for e in again) == [0, 1]
        assert {e.task_id: e.tokens.tolist() for e in again} == {2: [6], 3: [7]}
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    loss = next(line for line in lines if "died" in line)
    assert "b" in loss and "lost: probed in the background" in loss and "1 of 2 servers in service" in loss
    assert "restarting" not in loss and "replacement" not in loss
    assert any("re-admitted; 2 of 2 servers in service" in line for line in lines)
    assert sum("died" in line for line in lines) == 1  # failed probes are not news at the default level


def test_probes_back_off_to_their_ceiling(no_thread_leak, monkeypatch):
    monkeypatch.setattr(threads, "PROBE_FIRST_S", 0.01)
    monkeypatch.setattr(threads, "PROBE_MAX_S", 0.04)
    model = Outage(counting())
    model.down.add("a")
    waits = []
    real = threading.Timer

    def timer(wait, function, args=()):
        waits.append(wait)
        return real(wait, function, args)

    monkeypatch.setattr(threads.threading, "Timer", timer)
    with ThreadTargetPool(model, 1, lambda event: None, devices=["a"]) as pool:
        assert until(lambda: len(waits) >= 6)
        assert pool.alive_servers() == 0
    assert waits[:6] == [0.01, 0.02, 0.04, 0.04, 0.04, 0.04]


def test_closing_the_pool_stops_its_probes(no_thread_leak, fast_probes):
    model = Outage(counting())
    model.down.add("a")
    pool = ThreadTargetPool(model, 1, lambda event: None, devices=["a"])
    assert until(lambda: pool.lost_servers() == [0])
    pool.close()
    made = dict(model.sessions)
    model.down.clear()
    time.sleep(0.3)  # probes would have come back by now
    assert model.sessions == made and pool.readmissions == 0  # (no_thread_leak: no probe thread is left)


def test_dsi_output_is_exact_while_a_server_is_lost_and_after_it_is_back(no_thread_leak, fast_probes):
    target, drafter = synthetic_pair(0.7, vocab_size=24, seed=2)
    reference = dsi.generate(target=target, prompt=[1, 2], max_new_tokens=40, method="ar").tokens
    params = SamplingParams(temperature=1.0, seed=5)
    sampled = dsi.generate(target=target, drafter=drafter, prompt=[1, 2], max_new_tokens=40, sampling=params,
                           num_target_servers=2).tokens
    model = Outage(target)
    decoder = dsi.build_decoder(target=model, drafter=drafter, method="dsi", lookahead=2, num_target_servers=2,
                                transport_options={"devices": ["a", "b"]})
    try:
        def run(sampling=GREEDY):
            return decoder.generate(dsi.make_request([1, 2], 40, sampling, None, target.vocab_size)).tokens

        assert run() == reference
        model.down.add("b")
        assert run() == reference and run(params) == sampled
        assert decoder.pool.lost_servers() == [1]
        model.down.discard("b")
        assert until(lambda: decoder.pool.servers_in_service() == 2)
        made = model.sessions["b"]
        assert run() == reference and run(params) == sampled
        assert decoder.pool.readmissions == 1 and model.sessions["b"] == made  # its session serves on
    finally:
        decoder.close()


def test_without_servers_that_can_return_the_log_counts_what_is_true(no_thread_leak, caplog):
    """A server whose replacements keep failing: each line says a replacement is starting (one is), how many
    serve and how many start; the last says how many replacements failed, which the lines before showed."""
    model = Outage(counting(), can_return=False)
    model.down.add("b")
    caplog.set_level(logging.ERROR, logger="dsi.transport.threads")
    events = queue.SimpleQueue()
    with ThreadTargetPool(model, 2, events.put, devices=["a", "b"]) as pool:
        deaths = [events.get(timeout=5) for _ in range(MAX_RESTARTS + 1)]
        assert all(isinstance(d, ServerDied) and d.server_id == 1 for d in deaths)
        assert [d.restarting for d in deaths] == [True] * MAX_RESTARTS + [False]
        assert pool.servers_in_service() == 1 and pool.lost_servers() == []
    lines = [r.getMessage() for r in caplog.records if "died" in r.getMessage()]
    assert len(lines) == MAX_RESTARTS + 1
    assert all("starting a replacement; 1 of 2 servers in service, 1 starting" in line for line in lines[:-1]), lines
    assert f"its last {MAX_RESTARTS} replacements within" in lines[-1]
    assert lines[-1].endswith("1 of 2 servers in service")
