"""A byte ring in shared memory beside a connection: large arrays go from a server to the pool on this
machine without crossing the socket.

A socket pair moves a 600 KB law (one float32 row over 152k ids) in many small writes and reads, each a
wake-up on both sides: about 1.5 ms of CPU a message on a 2-core machine, where a copy in and a copy out of
shared memory cost about 0.1 ms. So a server process (the *writer*) places each large out-of-band buffer of a
message in the ring and the frame carries its position; the pool's listener (the *reader*) copies it out and
counts it consumed.

- The ring is a file in ``/dev/shm`` (Linux) that the pool creates, reserves (``posix_fallocate``: a full
  ``/dev/shm``, as in a small container, is found here, never as a SIGBUS later) and maps; the server maps it by
  its path, and the pool unlinks it once the server is ready. A ring that cannot be made or mapped is simply not
  used: every buffer then travels through the socket as before.
- Positions grow without bound (a buffer at position ``p`` lies at ``p % size``, never across the end). The
  writer takes space only up to what the reader has acknowledged consuming. Acknowledgements ride on the
  reader's own messages (every task it sends), so both sides order their memory through the socket's system
  calls (no lock that a killed process could hold, no reliance on the CPU's memory model). A writer without
  room sends the buffer through the socket: it never waits.
- A frame naming a position the reader did not expect (out of order, out of the ring) is a broken frame
  (:class:`~dsi.transport.wire.MalformedFrame`): the reader drops the server, as for any broken framing.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import tempfile
import threading

log = logging.getLogger(__name__)

ARENA_BYTES = 8 << 20  # per server: thirteen float32 laws over 152k ids
ARENA_MIN_BYTES = 64 << 10  # smaller buffers go through the socket: a copy through shared memory saves nothing
SHM_DIR = "/dev/shm"
_PREFIX = "dsi-arena-"


class Arena:
    """One end of a shared byte ring: the reader (the pool, which creates it) or the writer (a server)."""

    def __init__(self, path: str, size: int, mapping: mmap.mmap, writer: bool, min_bytes: int) -> None:
        self.path = path
        self.size = size
        self.writer = writer
        self.min_bytes = min_bytes  # smaller buffers go through the socket
        self._map = mapping
        self._view = memoryview(mapping)
        self._lock = threading.Lock()
        self._head = 0  # writer: where the next buffer may go
        self._acked = 0  # writer: what the reader has said it consumed
        self.consumed = 0  # reader: the end of the last buffer copied out (sent back as the acknowledgement)
        self.placed = 0  # buffers that went through the ring (statistics, tests)

    # ---- making and attaching -------------------------------------------------------------------------
    @property
    def where(self) -> tuple[str, int, int]:
        """What the writer's :meth:`attach` takes (path, size, smallest buffer placed)."""
        return self.path, self.size, self.min_bytes

    @classmethod
    def create(cls, size: int | None = None) -> Arena | None:
        """A new ring of ``size`` bytes (default :data:`ARENA_BYTES`) for the reader; None where shared memory
        cannot hold it (the caller then sends everything through its socket)."""
        size = ARENA_BYTES if size is None else size
        if not os.path.isdir(SHM_DIR) or not hasattr(os, "posix_fallocate"):
            return None
        _remove_stale()
        try:
            fd, path = tempfile.mkstemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=SHM_DIR)
        except OSError as exc:
            log.debug("no shared-memory arena: %s", exc)
            return None
        try:
            os.posix_fallocate(fd, 0, size)  # reserved now: a full /dev/shm fails here, not as a SIGBUS later
            mapping = mmap.mmap(fd, size)
        except OSError as exc:
            log.debug("no shared-memory arena of %d bytes in %s: %s", size, SHM_DIR, exc)
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        finally:
            os.close(fd)
        return cls(path, size, mapping, writer=False, min_bytes=ARENA_MIN_BYTES)

    @classmethod
    def attach(cls, path: str, size: int, min_bytes: int = ARENA_MIN_BYTES) -> Arena | None:
        """The writer's end of the ring at ``path`` (None if it cannot be mapped, e.g. on another machine)."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size != size:
                return None
            return cls(path, size, mmap.mmap(fd, size), writer=True, min_bytes=min_bytes)
        except OSError:
            return None
        finally:
            os.close(fd)

    def unlink(self) -> None:
        """Remove the ring's name (both ends keep their mappings); idempotent."""
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def close(self) -> None:
        self.unlink()
        self._view.release()
        with contextlib.suppress(BufferError):  # a buffer still exported: the mapping goes with the object
            self._map.close()

    # ---- the writer -----------------------------------------------------------------------------------
    def place(self, raw: memoryview) -> int:
        """Copy ``raw`` into the ring; its position, or -1 if the ring has no room for it now."""
        n = raw.nbytes
        if n > self.size:
            return -1
        with self._lock:
            position = self._head
            if position % self.size + n > self.size:  # never across the end: start the next lap
                position += self.size - position % self.size
            if position + n - self._acked > self.size:
                return -1
            start = position % self.size
            self._view[start:start + n] = raw.cast("B")
            self._head = position + n
            self.placed += 1
            return position

    def acknowledge(self, consumed: int) -> None:
        """The reader consumed the ring up to ``consumed``: its space may be written again."""
        with self._lock:
            if self._acked < consumed <= self._head:
                self._acked = consumed

    # ---- the reader -----------------------------------------------------------------------------------
    def take(self, position: int, size: int) -> bytearray:
        """A copy of the buffer of ``size`` bytes at ``position``; ``ValueError`` if the writer could not have
        put it there (before what was consumed, across the ring's end, or past a lap ahead)."""
        start = position % self.size if position >= 0 else -1
        if position < self.consumed or start + size > self.size or position + size - self.consumed > self.size:
            raise ValueError(f"a buffer of {size} bytes at arena position {position} is outside the ring "
                             f"(consumed to {self.consumed}, {self.size} bytes)")
        out = bytearray(self._view[start:start + size])
        self.consumed = position + size
        self.placed += 1
        return out


def _remove_stale() -> None:
    """Unlink the rings of processes that are gone (a pool killed before its server was ready leaves one)."""
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(_PREFIX)]
    except OSError:
        return
    for name in names:
        pid = name[len(_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, name))
        except OSError:  # alive, another user's
            pass
