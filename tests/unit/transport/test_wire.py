"""Wire framing under hostile input, and timeouts on every accept, connect and handshake."""

from __future__ import annotations

import multiprocessing
import pickle
import socket
import struct
import threading
import time

import numpy as np
import pytest

from dsi.transport.base import TaskFailed
from dsi.transport.wire import (
    MalformedFrame, PickledException, UndecodableMessage, accept, connect, listen, pickled_or_none, recv_message,
    restore_exception, send_message,
)
from tests.fault_models import NeedsArguments


@pytest.fixture
def pipe():
    a, b = multiprocessing.Pipe(duplex=True)
    yield a, b
    a.close()
    b.close()


class LoadsNowhere:
    """Pickles; its pickle names a function that does not exist, so it never loads."""

    def __reduce__(self):
        return (pickle.loads, (b"cbuiltins\nno_such_function\n.",))


@pytest.mark.parametrize("frames, match", [
    ([b"\x01"], "too short"),  # less than a header
    ([struct.pack("<IQ", 3, 0) + b"\x00" * 8], "too short"),  # announces 3 sizes, has one
    ([struct.pack("<IQ", 1 << 20, 0)], "announced 1048576 buffers"),  # absurd count: never allocated
    ([struct.pack("<IQQq", 1, 0, 4, -1) + pickle.dumps(None), b"0123456789"], "longer than the 4 bytes"),
    ([struct.pack("<IQQq", 1, 0, 100, -1) + pickle.dumps(None), b"short"], "has 5 bytes; 100 were announced"),
    ([struct.pack("<IQQq", 1, 0, 100, 0) + pickle.dumps(None)], "no arena is read"),  # a ring position, no ring
])
def test_broken_framing_is_a_malformed_frame_never_a_hang_or_a_crash(pipe, frames, match):
    a, b = pipe
    for frame in frames:
        a.send_bytes(frame)
    with pytest.raises(MalformedFrame, match=match):
        recv_message(b)


def test_a_well_framed_pickle_that_does_not_load_leaves_the_connection_in_step(pipe):
    a, b = pipe
    send_message(a, {"bad": LoadsNowhere(), "array": np.arange(4)})
    send_message(a, ("next", np.arange(3)))
    with pytest.raises(UndecodableMessage, match="no_such_function"):
        recv_message(b)
    kind, array = recv_message(b)  # the buffers of the bad message were consumed with it
    assert kind == "next" and array.tolist() == [0, 1, 2]


def test_an_exception_that_pickles_but_cannot_be_rebuilt_does_not_travel_its_text_does():
    assert pickled_or_none(NeedsArguments("HTTP 503", response=object())) is None
    travelled = pickled_or_none(ValueError("fine"))
    assert isinstance(travelled, PickledException)
    event = restore_exception(TaskFailed(1, 0, "ValueError: fine", travelled))
    assert isinstance(event.exception, ValueError) and str(event.exception) == "fine"


def test_an_exception_whose_class_exists_only_on_the_server_is_dropped_not_the_task_failure():
    unloadable = PickledException(b"cno_such_module\nNoSuchError\n(tR.")
    event = restore_exception(TaskFailed(7, 1, "NoSuchError: remote text", unloadable))
    assert event.exception is None and event.error == "NoSuchError: remote text" and event.task_id == 7


def test_authenticated_channel_round_trip():
    listener = listen("127.0.0.1", b"k" * 32)
    got = {}
    server = threading.Thread(target=lambda: got.setdefault("conn", accept(listener, 5.0)))
    server.start()
    client = connect(listener.address, b"k" * 32, 5.0)
    server.join(5.0)
    send_message(client, ("task", np.ones(3)))
    kind, array = recv_message(got["conn"])
    assert kind == "task" and array.tolist() == [1, 1, 1]
    client.close()
    got["conn"].close()
    listener.close()


def test_a_silent_server_cannot_block_connect():
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (in the kernel's backlog), never speaks
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="authentication"):
            connect(silent.getsockname()[:2], b"k" * 32, 0.5)
        assert time.monotonic() - start < 3.0
    finally:
        silent.close()


def test_a_silent_client_cannot_block_accept_and_a_wrong_key_is_refused():
    listener = listen("127.0.0.1", b"k" * 32)
    silent = socket.create_connection(listener.address)  # connects, never answers the challenge
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="no client authenticated"):
            accept(listener, 0.5)
        assert time.monotonic() - start < 3.0
        with pytest.raises(TimeoutError, match="no client connected"):
            accept(listener, 0.2)
        intruder = threading.Thread(target=lambda: pytest.raises(Exception, connect, listener.address, b"x" * 32, 2.0))
        intruder.start()
        with pytest.raises(TimeoutError):
            accept(listener, 1.0)  # the intruder fails authentication; nobody else comes
        intruder.join(5.0)
    finally:
        silent.close()
        listener.close()
