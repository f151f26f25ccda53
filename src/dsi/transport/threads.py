"""Thread transport: SP target servers as threads in this process, sharing the model's weights.

Each server thread owns one session (its own KV cache) of the shared model. Torch kernels
release the GIL, so forwards on different threads overlap. Cancellation sets the running
task's flag, which the model checks between steps; the thread is free again as soon as the
forward notices. ``close`` stops and joins every thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable

from dsi.errors import ConfigError, TaskCancelled, WorkerError
from dsi.models.base import LanguageModel
from dsi.transport.base import EventSink, TaskAborted, TaskFailed, VerifyTask
from dsi.transport.dispatch import Dispatcher
from dsi.transport.server import run_verify_task

log = logging.getLogger(__name__)

_STOP = None


class ThreadTargetPool:
    """``num_servers`` target servers, each a thread with its own session of ``model``."""

    def __init__(self, model: LanguageModel, num_servers: int, on_event: EventSink) -> None:
        if not isinstance(num_servers, int) or num_servers < 1:
            raise ConfigError(f"{num_servers=} must be an integer >= 1")
        self._model = model
        self._on_event = on_event
        self._lock = threading.Lock()
        self._dispatch = Dispatcher(num_servers)
        self._cancel_flags: dict[int, threading.Event] = {}
        self._inboxes = [queue.SimpleQueue() for _ in range(num_servers)]
        self._closed = False
        self._threads = [
            threading.Thread(target=self._serve, args=(i,), name=f"dsi-target-{i}", daemon=True)
            for i in range(num_servers)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def num_servers(self) -> int:
        return len(self._threads)

    def alive_servers(self) -> int:
        return sum(t.is_alive() for t in self._threads)

    def submit(self, task: VerifyTask) -> None:
        with self._lock:
            if self._closed:
                raise WorkerError("the target pool is closed")
            server = self._dispatch.place(task)
            if server is not None:
                self._hand_over(server, task)

    def cancel(self, task_ids: Iterable[int]) -> None:
        with self._lock:
            for server in self._dispatch.cancel(task_ids):
                self._cancel_flags[server].set()

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._dispatch.queue.clear()
            for flag in self._cancel_flags.values():
                flag.set()
            for inbox in self._inboxes:
                inbox.put(_STOP)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("target server thread %s did not stop within %.1f s", thread.name, timeout)

    def __enter__(self) -> ThreadTargetPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _hand_over(self, server: int, task: VerifyTask) -> None:
        """Give ``task`` to ``server`` (lock held)."""
        flag = threading.Event()
        self._cancel_flags[server] = flag
        self._inboxes[server].put((task, flag))

    def _serve(self, server: int) -> None:
        session = self._model.new_session()
        try:
            while True:
                item = self._inboxes[server].get()
                if item is _STOP:
                    return
                task, flag = item
                start = time.perf_counter()
                event: object
                try:
                    event = run_verify_task(session, task, server, flag)
                except TaskCancelled:
                    event = TaskAborted(task.task_id, server, time.perf_counter() - start)
                except Exception as exc:  # reported to the orchestrator, which raises it
                    log.exception("target server %d failed on task %d", server, task.task_id)
                    event = TaskFailed(task.task_id, server, f"{type(exc).__name__}: {exc}", exc)
                with self._lock:
                    next_task = None if self._closed else self._dispatch.finish(server)
                    if next_task is not None:
                        self._hand_over(server, next_task)
                self._on_event(event)
        finally:
            session.close()
