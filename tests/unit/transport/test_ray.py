"""Ray pool on a two-node loopback cluster: cancellation of a running forward (direct channel, and
Ray calls with a control concurrency group), placement by node id and by custom resource, lost
actors (re-queue, restart, idle death, all dead), falling back to Ray calls when an actor's port
cannot be reached, and a pool that starts (and shuts down) its own local Ray."""

from __future__ import annotations

import queue
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from dsi.errors import ConfigError, WorkerError
from dsi.models import CallableLM, WithLatency
from dsi.models.emulated.synthetic import SyntheticTarget
from dsi.sampling import SamplingParams
from dsi.transport import make_pool
from dsi.transport.base import ServerDied, TaskAborted, TaskResult, VerifyTask
from tests.transport_support import RAY_ENV, node_ids, ray_cluster, wait_gone

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

GREEDY = SamplingParams()
VOCAB = 16


def model(ttft: float = 0.0, tpot: float = 0.0):
    lm = CallableLM(SyntheticTarget(VOCAB, seed=5), VOCAB, name="synthetic")
    return WithLatency(lm, ttft, tpot) if ttft or tpot else lm


def next_event(events, timeout=20.0):
    return events.get(timeout=timeout)


@pytest.fixture(scope="module")
def cluster():
    return ray_cluster()


@pytest.fixture
def events():
    return queue.SimpleQueue()


@pytest.mark.parametrize("channel", ["direct", "ray"])
def test_cancel_reaches_a_running_forward_and_the_actor_serves_on(cluster, events, channel):
    pool = make_pool("ray", model(ttft=30.0, tpot=0.0), 1, events.put, channel=channel)
    assert [h.channel for h in pool.handles] == [channel]
    try:
        pool.submit(VerifyTask(7, (1, 2, 3), 1, GREEDY))
        time.sleep(0.5)
        started = time.monotonic()
        pool.cancel([7])
        event = next_event(events)
        assert isinstance(event, TaskAborted) and event.task_id == 7
        assert time.monotonic() - started < 2.0  # the forward would have taken 30 s
        pool.submit(VerifyTask(8, (1, 2, 3), 1, GREEDY))  # the server is free again
        pool.cancel([8])  # at once: it may reach the actor before the task starts
        started = time.monotonic()
        event = next_event(events)
        assert isinstance(event, TaskAborted) and event.task_id == 8
        assert time.monotonic() - started < 2.0
    finally:
        pool.close()


def test_servers_placed_on_both_nodes_by_node_id_and_on_one_by_resource(cluster, events):
    nodes = node_ids()
    assert len(nodes) == 2
    pool = make_pool("ray", model(), 2, events.put, node_ids=nodes, start_timeout=60)
    try:
        assert pool.server_nodes() == nodes
        for i in range(2):
            pool.submit(VerifyTask(i, (1, 2, 3 + i), 2, GREEDY))
        results = [next_event(events) for _ in range(2)]
        assert {r.server_id for r in results} == {0, 1}
        ref = SyntheticTarget(VOCAB, 5)
        for r in results:
            ctx = (1, 2, 3 + r.task_id)
            assert r.tokens.tolist() == [int(np.argmax(ref(ctx[:2]))), int(np.argmax(ref(ctx)))]
    finally:
        pool.close()
    worker = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("worker_slot")]
    pool = make_pool("ray", model(), 2, events.put, resources={"worker_slot": 0.1}, num_cpus=0, start_timeout=60)
    try:
        assert pool.server_nodes() == worker * 2
    finally:
        pool.close()


@pytest.mark.parametrize("channel", ["direct", "ray"])
def test_a_killed_busy_actor_s_task_is_rerun_and_restart_dead_replaces_it(cluster, events, channel):
    pool = make_pool("ray", model(ttft=1.0, tpot=1.0), 2, events.put, restart_dead=True, channel=channel)
    try:
        pool.submit(VerifyTask(0, (1, 2), 1, GREEDY))
        time.sleep(0.3)
        [busy] = pool.busy_servers()
        old = pool.actors()[busy]
        ray.kill(old)
        died = next_event(events)
        assert isinstance(died, ServerDied) and died.server_id == busy and died.restarting
        result = next_event(events)
        assert isinstance(result, TaskResult) and result.task_id == 0 and result.server_id == 1 - busy
        deadline = time.monotonic() + 30
        while pool.actors()[busy] is old and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.actors()[busy] is not old
        for i in range(1, 3):
            pool.submit(VerifyTask(i, (1, 2, i), 1, GREEDY))
        assert {next_event(events).server_id for _ in range(2)} == {0, 1}
        pids = [h.pid for h in pool.handles]
    finally:
        pool.close()
    assert wait_gone(pids) == []  # close killed the actors' worker processes


def test_an_idle_actor_s_death_is_seen_at_once_on_the_direct_channel(cluster, events):
    pool = make_pool("ray", model(), 2, events.put, restart_dead=False)
    try:
        ray.kill(pool.actors()[1])
        died = next_event(events, timeout=10)
        assert isinstance(died, ServerDied) and died.server_id == 1 and "ActorDiedError" in died.error
        assert pool.alive_servers() == 1
    finally:
        pool.close()


def test_an_unreachable_actor_port_falls_back_to_ray_calls(cluster, events, monkeypatch):
    import dsi.transport.ray as ray_transport

    def refuse(address, authkey, timeout):
        raise ConnectionRefusedError(f"{address} unreachable")

    monkeypatch.setattr(ray_transport, "connect", refuse)
    pool = make_pool("ray", model(), 1, events.put)
    try:
        assert pool.handles[0].channel == "ray"
        pool.submit(VerifyTask(0, (1, 2), 1, GREEDY))
        assert isinstance(next_event(events), TaskResult)
    finally:
        pool.close()


def test_all_actors_dead_fails_fast(cluster, events):
    pool = make_pool("ray", model(ttft=0.5, tpot=0.5), 2, events.put, restart_dead=False)
    try:
        for i in range(2):
            pool.submit(VerifyTask(i, (1, i), 1, GREEDY))
        time.sleep(0.2)
        for actor in pool.actors():
            ray.kill(actor)
        assert isinstance(next_event(events), ServerDied) and isinstance(next_event(events), ServerDied)
        assert pool.alive_servers() == 0
        with pytest.raises(WorkerError, match="no target server is alive"):
            pool.submit(VerifyTask(5, (1,), 1, GREEDY))
    finally:
        pool.close()


def test_bad_options_are_config_errors(events):
    with pytest.raises(ConfigError, match="unknown options"):
        make_pool("ray", model(), 1, events.put, gpus=1)
    with pytest.raises(ConfigError, match="placement"):
        make_pool("ray", model(), 1, events.put, placement="pack")
    with pytest.raises(ConfigError, match="not both"):
        make_pool("ray", model(), 1, events.put, placement="spread", node_ids=["x"])
    with pytest.raises(ConfigError, match="channel"):
        make_pool("ray", model(), 1, events.put, channel="grpc")


def test_a_pool_that_started_ray_shuts_it_down(tmp_path):
    script = textwrap.dedent("""
        import os, queue, psutil, ray
        from dsi.models import synthetic_pair
        from dsi.transport import make_pool
        from dsi.transport.base import VerifyTask
        from dsi.sampling import SamplingParams
        target, _ = synthetic_pair(0.5, vocab_size=8)
        events = queue.SimpleQueue()
        pool = make_pool("ray", target, 2, events.put, init_options={"num_cpus": 1})
        assert ray.is_initialized()
        pool.submit(VerifyTask(0, (1, 2), 1, SamplingParams()))
        assert events.get(timeout=30).task_id == 0
        pool.close()
        assert not ray.is_initialized()
        print("children", len(psutil.Process().children(recursive=True)))
    """)
    env = dict(__import__("os").environ, **RAY_ENV)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "children 0" in proc.stdout, proc.stdout


def test_large_answers_come_through_the_shared_ring_from_an_actor_on_the_driver_s_node(cluster, events, monkeypatch):
    """The direct channel's shared ring (dsi.transport.arena) where the actor shares the driver's machine; an
    actor on another node (here: the loopback cluster's second node) answers through its socket; both the same."""
    from dsi.transport import arena as arena_module
    from dsi.transport.threads import ThreadTargetPool
    from tests.transport_support import assert_same_result, law_model, law_tasks, run_tasks

    monkeypatch.setattr(arena_module, "ARENA_MIN_BYTES", 1024)  # the actor learns it from the driver
    with ThreadTargetPool(law_model(), 1, events.put) as pool:
        want = run_tasks(pool, events, law_tasks(0))
    here = ray.get_runtime_context().get_node_id()
    for nodes in ([here], [n for n in node_ids() if n != here]):
        pool = make_pool("ray", law_model(), 1, events.put, node_ids=nodes, start_timeout=60)
        try:
            got = run_tasks(pool, events, law_tasks(0))
            ring = pool.handles[0]._arena
            if nodes == [here]:
                assert ring is not None and ring.placed >= 5
            else:
                assert ring is None
        finally:
            pool.close()
        for a, b in zip(got, want, strict=True):
            assert_same_result(a, b)


def test_a_constrained_task_reaches_an_actor_as_its_vocabulary_s_digest_and_is_masked_there(cluster, events):
    """Structured output over Ray: the actor registers its model's vocabulary (dsi.constraints.register_vocabulary),
    so a bound constraint travels as a digest; its laws are the thread pool's, masked to the grammar."""
    from dsi.constraints import Constraint, TokenTable, bind
    from dsi.models.emulated.synthetic import banked_pair
    from dsi.transport.threads import ThreadTargetPool
    from tests.transport_support import assert_same_result, run_tasks

    target, _ = banked_pair(0.8, vocab_size=64)
    target.vocabulary = TokenTable(tuple(bytes([97 + i % 26]) for i in range(63)) + (b"",), (63,))  # letters; EOS
    constraint = bind(Constraint.regex("[abc]+"), target)
    params = SamplingParams(temperature=1.0, seed=5, constraint=constraint)
    tasks = [VerifyTask(i, (1, 2, 0, 1), 3, params, prompt_len=2, draft_probs=(0.5, 0.5)) for i in range(3)]
    with ThreadTargetPool(target, 1, events.put) as pool:
        want = run_tasks(pool, events, tasks)
    pool = make_pool("ray", target, 1, events.put, start_timeout=60)
    try:
        got = run_tasks(pool, events, tasks)
    finally:
        pool.close()
    for a, b in zip(got, want, strict=True):
        assert_same_result(a, b)
    law = want[0].probs.laws[max(want[0].probs.laws)]
    abc = {i for i in range(63) if i % 26 < 3}  # the ids that spell a, b or c
    assert abc & set(np.flatnonzero(law)) and set(np.flatnonzero(law)) <= abc | {63}  # (EOS where it may end)
