"""A target model that breaks on request, for the fault-injection suite (tests/integration/test_faults.py).

:func:`faulty_target` is a synthetic target whose logits are :class:`SyntheticTarget`'s; a context
that starts with ``TRIGGER, kind, nonce`` makes the server computing it break in the way
``FAULTS[kind]`` names. ``*-once`` faults break one server once per nonce (a marker file, so that
this holds across processes and Ray workers): the re-queued task then succeeds on another server.
The others break every server that tries (a poison task). Module-level, so server processes and Ray
actors import it by reference.
"""

from __future__ import annotations

import gc
import os
import signal
import struct
import sys
import threading
import time
import types
from pathlib import Path

from dsi.models import CallableLM
from dsi.models.emulated.synthetic import SyntheticTarget

VOCAB = 32
TRIGGER = VOCAB - 1  # normal prompts never start with it
FAULTS = (
    "raise",  # an ordinary exception: the task fails
    "unpicklable",  # an exception that pickles but cannot be rebuilt (like httpx.HTTPStatusError)
    "child-only",  # an exception whose class exists only in the server's process
    "base-once",  # a BaseException that is not an Exception, once
    "base-always",
    "systemexit-once",  # SystemExit from model code, once
    "kill-once",  # SIGKILL of the server's own process, once (processes and Ray)
    "kill-always",
    "freeze-once",  # a frozen server: SIGSTOP (processes, Ray) or a wedged call (threads), once
    "garbage-once",  # a malformed frame on the server's connection, once (processes, Ray)
    "truncated-once",  # a frame shorter than its header announced, once (processes, Ray)
)
RELEASE = threading.Event()  # threads: what a wedged call waits for (the test sets it at the end)


class NeedsArguments(Exception):
    """Pickles fine; unpickling calls ``__init__`` with the message only, which fails."""

    def __init__(self, message: str, *, response: object) -> None:
        super().__init__(message)
        self.response = response


class FaultBaseException(BaseException):
    """A library's own BaseException (neither Exception nor SystemExit)."""


def _child_only_error(message: str) -> Exception:
    """An exception of a class defined in a module that only this process has."""
    module = sys.modules.get("dsi_fault_child_only")
    if module is None:
        module = types.ModuleType("dsi_fault_child_only")
        exec("class ChildOnlyError(Exception):\n    pass\n", module.__dict__)
        sys.modules[module.__name__] = module
    return module.ChildOnlyError(message)


def _connection():
    """The server's own connection to the pool (a process's pipe, a Ray actor's channel)."""
    from multiprocessing.connection import Connection

    for obj in gc.get_objects():
        if isinstance(obj, Connection) and not obj.closed and obj.writable:
            return obj
    raise RuntimeError("this server has no connection (threads transport?)")


def fault_prompt(kind: str, nonce: int, length: int = 4) -> list[int]:
    """A prompt that triggers ``kind`` (``nonce`` tells the once-faults of different requests apart)."""
    return [TRIGGER, FAULTS.index(kind), nonce % TRIGGER] + [(nonce + i) % TRIGGER for i in range(length)]


class FaultyNextLogits:
    """``SyntheticTarget`` logits, with the fault a trigger context asks for (see module doc)."""

    def __init__(self, marker_dir: str, seed: int = 5) -> None:
        self.inner = SyntheticTarget(VOCAB, seed=seed)
        self.marker_dir = marker_dir

    def _first(self, kind: str, nonce: int) -> bool:
        try:
            os.close(os.open(Path(self.marker_dir) / f"{kind}-{nonce}", os.O_CREAT | os.O_EXCL))
            return True
        except FileExistsError:
            return False

    def __call__(self, context):
        if len(context) >= 3 and context[0] == TRIGGER:
            kind, nonce = FAULTS[context[1]], context[2]
            if not kind.endswith("-once") or self._first(kind, nonce):
                self._break(kind)
        return self.inner(context)

    def _break(self, kind: str) -> None:
        if kind == "raise":
            raise RuntimeError("boom: the target model failed")
        if kind == "unpicklable":
            raise NeedsArguments("HTTP 503 from the remote model", response=object())
        if kind == "child-only":
            raise _child_only_error("an error only the server can unpickle")
        if kind.startswith("base"):
            raise FaultBaseException("a BaseException from model code")
        if kind.startswith("systemexit"):
            raise SystemExit(3)
        if kind.startswith("kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        if kind.startswith("freeze"):
            if threading.current_thread().name.startswith("dsi-target-"):
                RELEASE.wait(120)  # a wedged call in a thread server
            else:
                os.kill(os.getpid(), signal.SIGSTOP)
            return
        conn = _connection()
        if kind.startswith("garbage"):
            conn.send_bytes(b"\xff\x01")  # too short for a header
        elif kind.startswith("truncated"):
            conn.send_bytes(struct.pack("<IQ", 1, 1000) + b"payload")  # announces 1000 bytes...
            conn.send_bytes(b"only ten b")  # ...sends ten
        time.sleep(120)  # the pool drops this server; it is killed long before


def faulty_target(marker_dir: str) -> CallableLM:
    return CallableLM(FaultyNextLogits(str(marker_dir)), VOCAB, name="faulty")
