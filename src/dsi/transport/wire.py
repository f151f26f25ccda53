"""What travels between the pool and a remote target server (a spawned process, a Ray actor).

- Framing (:func:`send_message` / :func:`recv_message`) over a ``multiprocessing.connection``
  ``Connection`` (a pipe, or a TCP socket): pickle protocol 5 with numpy arrays sent *out of
  band* as raw frames, so a ``[rows, V]`` probability block is written straight from the array's
  memory and read into one fresh writable buffer, with no copy through the pickle stream. Between
  processes of one machine, large buffers go through a shared ring instead (:mod:`dsi.transport.arena`).
- :func:`answer`: a server's step on one task (the event it sends back).
- :func:`listen` / :func:`accept` / :func:`connect`: an authenticated TCP connection (HMAC
  challenge with a random key, as ``multiprocessing.connection`` does) between the driver and a Ray
  actor, with TCP keep-alive so a lost node shows up as a closed connection within seconds. Every
  accept, connect and handshake has a timeout: a silent peer cannot block either side.

A message that cannot be read raises one of two errors, so that a reader can tell what is still
usable: :class:`UndecodableMessage` (every frame of the message was read but its pickle does not
load, e.g. an exception class whose ``__init__`` needs arguments; the connection is still in step)
and :class:`MalformedFrame` (the framing itself is broken: the connection is out of step and must be
dropped).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import AuthenticationError, BufferTooShort
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

from dsi.errors import TaskCancelled
from dsi.models.base import CancelFlag, ModelSession
from dsi.transport.arena import Arena
from dsi.transport.base import TaskAborted, TaskFailed, VerifyTask
from dsi.transport.server import run_verify_task

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<IQ")  # buffers in the message; the sender's acknowledgement of a shared ring (arena)
MAX_BUFFERS = 1 << 16  # out-of-band buffers one message may announce (a result has two)
HANDSHAKE_TIMEOUT_S = 10.0  # for a peer to complete the authentication after connecting


class UndecodableMessage(ValueError):
    """A complete message whose pickle cannot be loaded; the connection is still in step."""


class MalformedFrame(ValueError):
    """The framing of a message is broken (truncated, inconsistent sizes); the connection is not
    usable any more."""


def send_message(conn: Connection, obj: object, arena: Arena | None = None) -> None:
    """Send ``obj`` as one pickle frame followed by one raw frame per contiguous array buffer.

    With ``arena``: a writer's end places buffers of at least its ``min_bytes`` in
    the shared ring where it has room (the frame names their positions); a reader's end sends, in the header,
    how far it has consumed the ring (its acknowledgement)."""
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    writer = arena is not None and arena.writer
    places = [arena.place(r) if writer and r.nbytes >= arena.min_bytes else -1 for r in raws]
    ack = arena.consumed if arena is not None and not arena.writer else 0
    count = len(raws)
    header = _HEAD.pack(count, ack) + struct.pack(f"<{count}Q{count}q", *(r.nbytes for r in raws), *places)
    conn.send_bytes(header + payload)
    for raw, place in zip(raws, places):
        if place < 0:
            conn.send_bytes(raw)


def recv_message(conn: Connection, arena: Arena | None = None) -> Any:
    """Receive what :func:`send_message` sent; arrays land in fresh writable buffers (copied out of the
    reader's ``arena`` where the sender placed them there; a writer's ``arena`` takes the acknowledgement).

    Raises ``EOFError`` / ``OSError`` when the peer is gone, :class:`MalformedFrame` when the framing
    is broken and :class:`UndecodableMessage` when a well-framed pickle does not load."""
    frame = conn.recv_bytes()
    try:
        count, ack = _HEAD.unpack_from(frame)
        if count > MAX_BUFFERS:
            raise MalformedFrame(f"a message announced {count} buffers (at most {MAX_BUFFERS})")
        fields = struct.unpack_from(f"<{count}Q{count}q", frame, _HEAD.size)
    except struct.error as exc:
        raise MalformedFrame(f"a {len(frame)}-byte header frame is too short: {exc}") from None
    sizes, places = fields[:count], fields[count:]
    if arena is not None and arena.writer:
        arena.acknowledge(ack)
    payload = memoryview(frame)[_HEAD.size + 16 * count:]
    buffers = []
    for size, place in zip(sizes, places):
        if place >= 0:
            if arena is None or arena.writer:
                raise MalformedFrame(f"a buffer at shared-memory position {place} came where no arena is read")
            try:
                buffers.append(arena.take(place, size))
            except ValueError as exc:
                raise MalformedFrame(str(exc)) from None
            continue
        buf = bytearray(size)
        try:
            got = conn.recv_bytes_into(buf) if size else len(conn.recv_bytes())
        except BufferTooShort:
            raise MalformedFrame(f"a buffer frame is longer than the {size} bytes announced") from None
        if got != size:
            raise MalformedFrame(f"a buffer frame has {got} bytes; {size} were announced")
        buffers.append(buf)
    try:
        return pickle.loads(payload, buffers=buffers)
    except Exception as exc:
        raise UndecodableMessage(f"{type(exc).__name__}: {exc}") from exc


@dataclass(frozen=True)
class PickledException:
    """A task's exception, pickled by the server on its own: if it does not load on the pool's side
    (its class exists only on the server), only the exception is lost, not the TaskFailed and its
    text. :func:`restore_exception` loads it."""

    data: bytes


def pickled_or_none(exc: BaseException) -> PickledException | None:
    """``exc`` pickled, if it can be rebuilt from its pickle (many exceptions pickle but cannot:
    a class whose ``__init__`` takes keyword-only arguments, e.g. ``httpx.HTTPStatusError``); else
    None (its text still travels)."""
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
        return PickledException(data)
    except Exception:
        return None


def restore_exception(event: object) -> object:
    """``event`` with a :class:`PickledException` loaded (or dropped, if it does not load here)."""
    if isinstance(event, TaskFailed) and isinstance(event.exception, PickledException):
        try:
            exc = pickle.loads(event.exception.data)
        except Exception as error:  # noqa: BLE001 - e.g. its class is not importable here
            log.warning("the exception of failed task %d could not be loaded here (%s: %s)",
                        event.task_id, type(error).__name__, error)
            exc = None
        return dataclasses.replace(event, exception=exc if isinstance(exc, BaseException) else None)
    return event


def answer(session: ModelSession, task: VerifyTask, server_id: int, cancel: CancelFlag) -> object:
    """Run ``task`` on ``session``: a TaskResult, or TaskAborted (cancelled), or TaskFailed."""
    start = time.perf_counter()
    try:
        return run_verify_task(session, task, server_id, cancel)
    except TaskCancelled:
        return TaskAborted(task.task_id, server_id, time.perf_counter() - start)
    except Exception as exc:
        return TaskFailed(task.task_id, server_id, f"{type(exc).__name__}: {exc}", pickled_or_none(exc))


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):  # Linux; elsewhere the system defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class ChannelListener:
    """A TCP listener on ``host`` (a free port) that accepts only clients knowing ``authkey``."""

    def __init__(self, host: str, authkey: bytes) -> None:
        self._authkey = authkey
        self._sock = socket.create_server((host, 0), family=socket.AF_INET, backlog=4)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]

    def accept(self, timeout: float) -> Connection:
        """The next client that connects and authenticates within ``timeout`` s; ``TimeoutError``
        if none does (a client that connects and then stays silent is dropped at the deadline)."""
        deadline = time.monotonic() + timeout
        while True:
            self._sock.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                sock, _ = self._sock.accept()
            except TimeoutError:
                raise TimeoutError(f"no client connected to {self.address} within {timeout:.1f} s") from None
            try:
                return _authenticated(sock, self._authkey, server=True,
                                      timeout=max(0.001, deadline - time.monotonic()))
            except (OSError, EOFError, AuthenticationError) as exc:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no client authenticated on {self.address} within {timeout:.1f} s "
                                       f"(the last one failed: {type(exc).__name__}: {exc})") from None

    def close(self) -> None:
        self._sock.close()


def listen(host: str, authkey: bytes) -> ChannelListener:
    """A :class:`ChannelListener` on ``host``."""
    return ChannelListener(host, authkey)


def accept(listener: ChannelListener, timeout: float) -> Connection:
    """The next authenticated connection within ``timeout`` s (else ``TimeoutError``)."""
    return listener.accept(timeout)


def connect(address: tuple[str, int], authkey: bytes, timeout: float) -> Connection:
    """Connect to a :func:`listen` er and authenticate both ways, all within ``timeout`` s
    (``TimeoutError`` otherwise: a peer that accepts and stays silent cannot block us)."""
    deadline = time.monotonic() + timeout
    sock = socket.create_connection(address, timeout=timeout)
    return _authenticated(sock, authkey, server=False, timeout=max(0.001, deadline - time.monotonic()))


def _authenticated(sock: socket.socket, authkey: bytes, *, server: bool, timeout: float) -> Connection:
    """``sock`` as a ``Connection`` after the HMAC challenge both ways, within ``timeout`` s."""
    try:
        _keepalive(sock)
        sock.settimeout(None)  # Connection needs a blocking fd
        conn = Connection(sock.detach())
    except BaseException:
        sock.close()
        raise
    try:
        with deadline_for(conn, timeout, "authentication"):
            if server:
                deliver_challenge(conn, authkey)
                answer_challenge(conn, authkey)
            else:
                answer_challenge(conn, authkey)
                deliver_challenge(conn, authkey)
    except BaseException:
        conn.close()
        raise
    return conn


def shutdown(conn: Connection) -> None:
    """Wake every thread blocked reading or writing ``conn`` (it sees EOF / an error); the fd stays
    open until its owner closes it. For sockets, which every connection here is (a duplex
    ``multiprocessing.Pipe`` is a socket pair too); anything else is left alone."""
    try:
        dup = socket.socket(fileno=os.dup(conn.fileno()))
    except (OSError, ValueError):
        return  # closed already, or not a socket
    try:
        dup.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        dup.close()


@contextlib.contextmanager
def deadline_for(conn: Connection, timeout: float, what: str) -> Iterator[None]:
    """Run the block with ``conn`` shut down after ``timeout`` s; then raise ``TimeoutError``."""
    fired = threading.Event()

    def expire() -> None:
        fired.set()
        shutdown(conn)

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    except (OSError, EOFError):
        if fired.is_set():
            raise TimeoutError(f"the peer did not complete the {what} within {timeout:.1f} s") from None
        raise
    finally:
        timer.cancel()
    if fired.is_set():
        raise TimeoutError(f"the peer did not complete the {what} within {timeout:.1f} s")
