"""The shared ring beside a connection: its space accounting, its framing (what a bad position does), the
socket as the fallback, and the process pool's answers through it equal to the thread pool's, before and after
a server is killed and replaced."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import signal
import struct
import time

import numpy as np
import pytest

from dsi.transport import arena as arena_module
from dsi.transport.arena import Arena
from dsi.transport.base import ServerDied
from dsi.transport.processes import ProcessTargetPool
from dsi.transport.threads import ThreadTargetPool
from dsi.transport.wire import MalformedFrame, recv_message, send_message
from tests.transport_support import assert_same_result, law_model, law_tasks, run_tasks


def _shared_memory() -> bool:
    probe = Arena.create(4096)
    if probe is not None:
        probe.close()
    return probe is not None


pytestmark = pytest.mark.skipif(not _shared_memory(), reason="no shared memory (/dev/shm) on this machine")


@pytest.fixture
def ring():
    reader = Arena.create(4096)
    writer = Arena.attach(*reader.where)
    yield reader, writer
    writer.close()
    reader.close()


def test_a_buffer_goes_in_and_comes_out_and_space_returns_only_when_acknowledged(ring):
    reader, writer = ring
    assert not os.path.exists(reader.path) or reader.path.startswith(arena_module.SHM_DIR)
    first = memoryview(bytes(range(256)) * 8)  # 2048 bytes
    assert writer.place(first) == 0
    assert writer.place(memoryview(b"x" * 2048)) == 2048  # the ring is full now
    assert writer.place(memoryview(b"y")) == -1  # no room until the reader says it consumed something
    assert reader.take(0, 2048) == bytes(first)
    assert writer.place(memoryview(b"y")) == -1  # consumed, but not yet acknowledged
    writer.acknowledge(reader.consumed)
    # 1 byte fits at the start of the next lap, where the first buffer was
    assert writer.place(memoryview(b"y")) == 4096
    assert reader.take(2048, 2048) == b"x" * 2048 and reader.take(4096, 1) == b"y"
    assert writer.place(memoryview(b"z" * 5000)) == -1  # larger than the ring: never placed


def test_a_buffer_never_straddles_the_end_of_the_ring(ring):
    reader, writer = ring
    assert writer.place(memoryview(b"a" * 3000)) == 0
    reader.take(0, 3000)
    writer.acknowledge(reader.consumed)
    at = writer.place(memoryview(b"b" * 2000))  # 1096 bytes left before the end: it goes to the next lap
    assert at == 4096 and reader.take(at, 2000) == b"b" * 2000


@pytest.mark.parametrize("position, size, match", [
    (0, 10, "outside the ring"),  # before what was consumed
    (4000, 200, "outside the ring"),  # across the end
    (4096 * 3, 10, "outside the ring"),  # more than a lap ahead of the reader
    (-5, 10, "outside the ring"),
])
def test_the_reader_refuses_positions_the_writer_could_not_have_used(ring, position, size, match):
    reader, writer = ring
    writer.place(memoryview(b"a" * 100))
    reader.take(0, 100)
    with pytest.raises(ValueError, match=match):
        reader.take(position, size)


def test_a_frame_naming_a_bad_ring_position_is_a_malformed_frame(ring):
    reader, _ = ring
    a, b = multiprocessing.Pipe(duplex=True)
    try:
        a.send_bytes(struct.pack("<IQQq", 1, 0, 100, 4000) + pickle.dumps(None))
        with pytest.raises(MalformedFrame, match="outside the ring"):
            recv_message(b, reader)
    finally:
        a.close()
        b.close()


def test_messages_use_the_ring_while_it_has_room_and_the_socket_when_it_has_none(ring):
    reader, writer = ring
    writer.min_bytes = 512  # this test's arrays of 800 bytes go through the ring
    server, pool = multiprocessing.Pipe(duplex=True)
    try:
        arrays = [np.full(200, i, dtype=np.float32) for i in range(12)]  # 800 bytes each: 5 fill the ring
        for i, array in enumerate(arrays):
            send_message(server, ("law", i, array, np.arange(3)), writer)  # the small array: inline always
        got = [recv_message(pool, reader) for _ in arrays]
        for i, (kind, index, law, small) in enumerate(got):
            assert (kind, index) == ("law", i) and small.tolist() == [0, 1, 2]
            np.testing.assert_array_equal(law, arrays[i])
            law[0] = -1.0  # a copy: writable, and the ring is free to be written again
        assert writer.placed == 5 and reader.placed == 5  # the other 7 went through the socket
        send_message(pool, ("task",), reader)  # carries the reader's acknowledgement
        assert recv_message(server, writer) == ("task",)
        send_message(server, ("law", 99, arrays[0]), writer)
        assert writer.placed == 6
        np.testing.assert_array_equal(recv_message(pool, reader)[2], arrays[0])
    finally:
        server.close()
        pool.close()


def test_a_process_pool_s_laws_come_through_the_ring_equal_to_the_thread_pool_s_also_after_a_kill(monkeypatch):
    monkeypatch.setattr(arena_module, "ARENA_MIN_BYTES", 1024)  # the children learn it from the parent
    events: queue.SimpleQueue = queue.SimpleQueue()
    with ThreadTargetPool(law_model(), 2, events.put) as pool:
        want = run_tasks(pool, events, law_tasks(0)) + run_tasks(pool, events, law_tasks(10))
    with ProcessTargetPool(law_model(), 2, events.put, restart_dead=True) as pool:
        got = run_tasks(pool, events, law_tasks(0))
        placed = sum(h.arena.placed for h in pool.handles)
        assert placed >= 5  # every answer had a law of 1,200 bytes
        old = pool.server_pids()[0]
        os.kill(old, signal.SIGKILL)
        died = events.get(timeout=30)
        assert isinstance(died, ServerDied) and died.restarting
        deadline = time.monotonic() + 30
        while pool.server_pids()[0] == old and time.monotonic() < deadline:
            time.sleep(0.05)
        got += run_tasks(pool, events, law_tasks(10))
        assert pool.handles[0].arena.placed + pool.handles[1].arena.placed > 0
        paths = [h.arena.path for h in pool.handles]
    for a, b in zip(got, want, strict=True):
        assert_same_result(a, b)
    assert not any(os.path.exists(p) for p in paths)  # unlinked once each server was ready
