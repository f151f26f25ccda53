"""Thread transport: SP target servers as threads in this process, sharing the model's weights.

Each server thread owns one session (its own KV cache) of the shared model. Torch kernels
release the GIL, so forwards on different threads overlap. Cancellation sets the running
task's flag, which the model checks between steps; the thread is free again as soon as the
forward notices. ``close`` stops and joins every thread. A model error in a task is a
``TaskFailed`` (the thread serves on); a thread that cannot make its session or breaks outside a
task is dead: its task is re-queued on the others and a ``ServerDied`` reported.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable

from dsi.errors import ConfigError, TaskCancelled
from dsi.models.base import LanguageModel
from dsi.transport.base import EventSink, ServerDied, TaskAborted, TaskFailed, VerifyTask
from dsi.transport.dispatch import Dispatcher, DispatchingPool
from dsi.transport.server import run_verify_task

log = logging.getLogger(__name__)

_STOP = None


class ThreadTargetPool(DispatchingPool):
    """``num_servers`` target servers, each a thread with its own session of ``model``."""

    def __init__(
        self, model: LanguageModel, num_servers: int, on_event: EventSink, devices: list[str] | None = None
    ) -> None:
        if not isinstance(num_servers, int) or num_servers < 1:
            raise ConfigError(f"{num_servers=} must be an integer >= 1")
        if devices:
            import inspect

            if "device" not in inspect.signature(model.new_session).parameters:
                raise ConfigError(f"devices={devices!r}: {model!r} cannot place sessions on devices")
        # server i runs on devices[i % len(devices)] (e.g. one GPU per target server)
        self._devices = list(devices or [])
        self._model = model
        self._on_event = on_event
        self._name = "thread"
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
        with self._lock:
            dead = set(self._dispatch.dead)
        return sum(t.is_alive() and i not in dead for i, t in enumerate(self._threads))

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

    def _alive(self) -> int:
        return self.num_servers - len(self._dispatch.dead)

    def _hand_over(self, server: int, task: VerifyTask) -> None:
        """Give ``task`` to ``server`` (lock held)."""
        flag = threading.Event()
        self._cancel_flags[server] = flag
        self._inboxes[server].put((task, flag))

    def _serve(self, server: int) -> None:
        try:
            if self._devices:
                session = self._model.new_session(device=self._devices[server % len(self._devices)])
            else:
                session = self._model.new_session()
        except Exception as exc:
            self._died(server, exc)
            return
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
        except Exception as exc:  # not a model error (those are TaskFailed): the thread itself broke
            self._died(server, exc)
        finally:
            session.close()

    def _died(self, server: int, exc: BaseException) -> None:
        """The thread of ``server`` is ending unexpectedly: re-queue its task, report it, stop using it."""
        log.error("target server thread %d died: %s: %s", server, type(exc).__name__, exc)
        with self._lock:
            if self._closed:
                return
            task = self._dispatch.mark_dead(server)
            if task is not None:  # first in line again, on another server
                self._requeue(task)
        self._on_event(ServerDied(server, f"{type(exc).__name__}: {exc}"))
