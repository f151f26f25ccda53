"""Thread transport: SP target servers as threads in this process, sharing the model's weights.

Each server thread owns one session (its own KV cache) of the shared model. Torch kernels
release the GIL, so forwards on different threads overlap. Cancellation sets the running
task's flag, which the model checks between steps; the thread is free again as soon as the
forward notices. ``close`` stops and joins every thread.

Failures, on the same footing as the process and Ray transports (:mod:`dsi.transport.dispatch`):

- an ``Exception`` in a task is a ``TaskFailed`` (the thread serves on), except a
  :class:`~dsi.errors.ServerLost` (the engine behind a session is gone or answers garbage), which
  kills the server as below;
- a thread that cannot make its session, or that anything else ends (a ``BaseException`` from model
  code such as ``SystemExit``, a library's own), is dead: its task is re-queued (or failed, if it
  is poison), a ``ServerDied`` reported, and with ``restart_dead`` (the default) a new thread with a
  new session takes over the server id;
- a thread past its task's liveness deadline (:mod:`dsi.transport.liveness`; a wedged accelerator
  call) is declared dead the same way and abandoned: a thread cannot be killed, so if it ever
  returns, it finds itself replaced and leaves without a word.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable

from dsi.errors import ConfigError, ServerLost, TaskCancelled
from dsi.models.base import LanguageModel
from dsi.transport.base import (
    EventSink, ServerDied, TaskAborted, TaskFailed, VerifyTask, check_num_servers, start_failed,
)
from dsi.transport.dispatch import Dispatcher, DispatchingPool, death_note
from dsi.transport.liveness import ForwardRates, LivenessPolicy
from dsi.transport.server import run_verify_task

log = logging.getLogger(__name__)

OPTIONS = ("devices", "restart_dead", "liveness")

_STOP = None


class ThreadTargetPool(DispatchingPool):
    """``num_servers`` target servers, each a thread with its own session of ``model``.

    Options: ``devices`` (server i on ``devices[i % len(devices)]``, for models whose
    ``new_session`` takes a ``device``), ``restart_dead`` (replace a dead server thread; default
    True), ``liveness`` (see :class:`~dsi.transport.liveness.LivenessPolicy`).
    """

    def __init__(
        self, model: LanguageModel, num_servers: int, on_event: EventSink, devices: list[str] | None = None,
        *, restart_dead: bool = True, liveness: object = None,
    ) -> None:
        check_num_servers(num_servers)
        if not isinstance(restart_dead, bool):
            raise ConfigError(f"{restart_dead=} must be True or False")
        if devices:
            import inspect

            if "device" not in inspect.signature(model.new_session).parameters:
                raise ConfigError(f"devices={devices!r}: {model!r} cannot place sessions on devices")
        # server i runs on devices[i % len(devices)] (e.g. one GPU per target server)
        self._devices = list(devices or [])
        self._model = model
        self._on_event = on_event
        self._name = "thread"
        self._restart_dead = restart_dead
        self._liveness = LivenessPolicy.from_option(liveness)
        self._rates = ForwardRates(num_servers)
        self._restarts: list[list[float]] = [[] for _ in range(num_servers)]
        self._restarting: set[int] = set()  # dead servers whose replacement thread is making its session
        self._lock = threading.Lock()
        self._dispatch = Dispatcher(num_servers)
        self._cancel_flags: dict[int, threading.Event] = {}
        self._closed = False
        self._generation = [0] * num_servers  # bumped when a server's thread is replaced
        self._inboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(num_servers)]
        self._threads: list[threading.Thread] = []  # every thread started, replaced ones included
        self._watchdog = None
        what = "server thread 0"
        try:
            with self._lock:
                for server in range(num_servers):
                    what = f"server thread {server}"
                    self._start_thread(server)
            what = "its liveness watchdog"
            self._watchdog = self._start_watchdog()
        except BaseException as exc:  # no thread to be had (a thread limit, memory): stop those started
            self.close()
            error = start_failed(what, num_servers, exc)
            if error is exc:
                raise
            raise error from exc

    @property
    def num_servers(self) -> int:
        return len(self._generation)

    def alive_servers(self) -> int:
        """Servers in service or being restarted (none once closed)."""
        with self._lock:
            return 0 if self._closed else self._alive()

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
        if self._watchdog is not None:
            self._watchdog.stop()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("target server thread %s did not stop within %.1f s", thread.name, timeout)

    def __enter__(self) -> ThreadTargetPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals (lock held where noted) -------------------------------------------------------
    def _alive(self) -> int:
        return self.num_servers - len(self._dispatch.dead) + len(self._restarting)

    def _hand_over(self, server: int, task: VerifyTask) -> None:
        """Give ``task`` to ``server`` (lock held)."""
        flag = threading.Event()
        self._cancel_flags[server] = flag
        self._inboxes[server].put((task, flag))

    def _start_thread(self, server: int) -> None:
        """A new thread (and inbox) for ``server`` (lock held); an older one is abandoned."""
        self._generation[server] += 1
        generation = self._generation[server]
        self._inboxes[server] = inbox = queue.SimpleQueue()
        name = f"dsi-target-{server}" + (f"-r{generation - 1}" if generation > 1 else "")
        thread = threading.Thread(target=self._serve, args=(server, generation, inbox), name=name, daemon=True)
        thread.start()
        self._threads.append(thread)  # (close joins it: only once started)

    def _serve(self, server: int, generation: int, inbox: queue.SimpleQueue) -> None:
        try:
            if self._devices:
                session = self._model.new_session(device=self._devices[server % len(self._devices)])
            else:
                session = self._model.new_session()
        except BaseException as exc:  # noqa: BLE001 - no session, no server
            self._died(server, generation, f"{type(exc).__name__}: {exc}", charged_to_task=False)
            return
        try:
            self._revive(server, generation)
            while True:
                item = inbox.get()
                if item is _STOP:
                    return
                task, flag = item
                start = time.perf_counter()
                event: object
                try:
                    event = run_verify_task(session, task, server, flag)
                except TaskCancelled:
                    event = TaskAborted(task.task_id, server, time.perf_counter() - start)
                except ServerLost:  # the server behind this thread (an engine) is gone: a dead server
                    raise
                except Exception as exc:  # reported to the orchestrator, which raises it
                    # the request raises it (WorkerError, cause chained): the traceback only for debugging
                    log.debug("target server %d failed on task %d", server, task.task_id, exc_info=True)
                    event = TaskFailed(task.task_id, server, f"{type(exc).__name__}: {exc}", exc)
                with self._lock:
                    if self._generation[server] != generation:
                        return  # declared frozen and replaced while this forward ran: its task moved on
                    self._answered(server, event)
                    next_task = None if self._closed else self._dispatch.finish(server)
                    if next_task is not None:
                        self._hand_over(server, next_task)
                self._on_event(event)
        except BaseException as exc:  # noqa: BLE001 - not a model error (those are TaskFailed): the thread broke
            log.debug("target server thread %d died", server, exc_info=True)  # _died says it once
            self._died(server, generation, f"{type(exc).__name__}: {exc}", charged_to_task=True)
        finally:
            session.close()

    def _revive(self, server: int, generation: int) -> None:
        """A replacement thread has its session: ``server`` is back in service."""
        with self._lock:
            if server not in self._restarting or self._generation[server] != generation:
                return
            self._restarting.discard(server)
            if self._closed:
                return
            self._reinstate(server)
        log.info("target server thread %d restarted", server)

    def _died(self, server: int, generation: int, error: str, charged_to_task: bool) -> None:
        """The thread of ``server`` is ending (or declared frozen): re-queue its task, report it,
        start a replacement if allowed (a death that is not ``charged_to_task`` counts against the
        server's restart budget)."""
        events: list[object] = []
        with self._lock:
            if self._closed or self._generation[server] != generation:
                return
            self._restarting.discard(server)
            task = self._dispatch.mark_dead(server)
            if task is not None:
                flag = self._cancel_flags.get(server)
                if flag is not None and flag.is_set():
                    events.append(TaskAborted(task.task_id, server, 0.0))
                else:
                    failed = self._requeue(task, server, error)
                    if failed is not None:
                        events.append(failed)
                if flag is not None:
                    flag.set()  # a frozen forward that wakes up stops at its next check
            restart = self._restart_dead and self._may_restart(server, charged_to_task and task is not None)
            if restart:
                self._restarting.add(server)
                self._start_thread(server)
            else:
                self._generation[server] += 1  # whatever the old thread does next is not reported
            self._drain_waiting()
            left = self._alive()
        note = death_note(restart, left, self.num_servers, self._restart_dead)
        log.error("target server thread %d died (%s)%s", server, error, note)
        for event in [ServerDied(server, error, restart), *events]:
            self._on_event(event)

    def _incarnation(self, server: int) -> int:
        return self._generation[server]

    def _declare_frozen(self, server: int, generation: int, reason: str) -> None:
        self._died(server, generation, reason, charged_to_task=True)
