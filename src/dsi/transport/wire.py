"""What travels between the pool and a remote target server (a spawned process, a Ray actor).

- Framing (:func:`send_message` / :func:`recv_message`) over a ``multiprocessing.connection``
  ``Connection`` (a pipe, or a TCP socket): pickle protocol 5 with numpy arrays sent *out of
  band* as raw frames, so a ``[rows, V]`` probability block is written straight from the array's
  memory and read into one fresh writable buffer, with no copy through the pickle stream.
- :func:`answer`: a server's step on one task (the event it sends back).
- :func:`listen` / :func:`connect`: an authenticated TCP connection (HMAC challenge with a random
  key, as ``multiprocessing.connection`` does) between the driver and a Ray actor, with TCP
  keep-alive so a lost node shows up as a closed connection within seconds.
"""

from __future__ import annotations

import pickle
import socket
import struct
import time
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge
from typing import Any

from dsi.errors import TaskCancelled
from dsi.models.base import CancelFlag, ModelSession
from dsi.transport.base import TaskAborted, TaskFailed, VerifyTask
from dsi.transport.server import run_verify_task

_COUNT = struct.Struct("<I")


def send_message(conn: Connection, obj: object) -> None:
    """Send ``obj`` as one pickle frame followed by one raw frame per contiguous array buffer."""
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    sizes = struct.pack(f"<{len(raws)}Q", *(r.nbytes for r in raws))
    conn.send_bytes(_COUNT.pack(len(raws)) + sizes + payload)
    for raw in raws:
        conn.send_bytes(raw)


def recv_message(conn: Connection) -> Any:
    """Receive what :func:`send_message` sent; arrays land in fresh writable buffers."""
    frame = conn.recv_bytes()
    (count,) = _COUNT.unpack_from(frame)
    sizes = struct.unpack_from(f"<{count}Q", frame, _COUNT.size)
    payload = memoryview(frame)[_COUNT.size + 8 * count:]
    buffers = []
    for size in sizes:
        buf = bytearray(size)
        if size:
            conn.recv_bytes_into(buf)
        else:
            conn.recv_bytes()
        buffers.append(buf)
    return pickle.loads(payload, buffers=buffers)


def picklable_or_none(exc: BaseException) -> BaseException | None:
    """``exc`` if it can travel back to the pool's process, else None (its text still does)."""
    try:
        pickle.dumps(exc)
        return exc
    except Exception:
        return None


def answer(session: ModelSession, task: VerifyTask, server_id: int, cancel: CancelFlag) -> object:
    """Run ``task`` on ``session``: a TaskResult, or TaskAborted (cancelled), or TaskFailed."""
    start = time.perf_counter()
    try:
        return run_verify_task(session, task, server_id, cancel)
    except TaskCancelled:
        return TaskAborted(task.task_id, server_id, time.perf_counter() - start)
    except Exception as exc:
        return TaskFailed(task.task_id, server_id, f"{type(exc).__name__}: {exc}", picklable_or_none(exc))


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):  # Linux; elsewhere the system defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def listen(host: str, authkey: bytes) -> Listener:
    """A TCP listener on ``host`` (a free port) that accepts only clients knowing ``authkey``."""
    return Listener((host, 0), family="AF_INET", authkey=authkey)


def accept(listener: Listener) -> Connection:
    """The next authenticated connection (blocks)."""
    conn = listener.accept()
    view = socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM)  # a dup of the fd
    try:
        _keepalive(view)  # options belong to the socket, shared by every fd on it
    finally:
        view.close()
    return conn


def connect(address: tuple[str, int], authkey: bytes, timeout: float) -> Connection:
    """Connect to a :func:`listen` er within ``timeout`` s and authenticate both ways."""
    sock = socket.create_connection(address, timeout=timeout)
    try:
        _keepalive(sock)
        sock.settimeout(None)  # Connection needs a blocking fd
        conn = Connection(sock.detach())
    except BaseException:
        sock.close()
        raise
    try:
        answer_challenge(conn, authkey)
        deliver_challenge(conn, authkey)
    except BaseException:
        conn.close()
        raise
    return conn
