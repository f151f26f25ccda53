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

Servers that can come back. Where the model says its servers are processes of their own that may
return (``servers_can_return``: an :class:`~dsi.models.engines.target.EngineTarget`, whose servers are
engines), a dead server is not replaced at once within a budget: it is *lost*, and probed in the
background with exponential backoff (:data:`PROBE_FIRST_S` doubling to :data:`PROBE_MAX_S`) for as long
as the pool lives. A probe is a new thread making its session, which for an engine is the start check
(the model listed, and the canary once the engine was lost); the server is re-admitted when it passes.
A lost server is out of service: it takes no task and does not count as alive.
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
PROBE_FIRST_S = 0.5  # the first probe of a lost server that can come back, after its loss
PROBE_MAX_S = 30.0  # the longest wait between two probes (the wait doubles from PROBE_FIRST_S)


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
        # servers that can come back (see the module doc): lost ones are probed, never replaced within a budget
        self._readmit = bool(getattr(model, "servers_can_return", False))
        self._probing: set[int] = set()  # lost servers whose probe thread is making its session now
        self._probe_wait: dict[int, float] = {}  # lost server -> the wait before its next probe
        self._probe_timers: dict[int, threading.Timer] = {}
        self.readmissions = 0  # lost servers brought back into service by a probe
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

    def lost_servers(self) -> list[int]:
        """Servers out of service and probed until they come back (a model whose servers can return)."""
        with self._lock:
            return sorted(self._probe_wait)

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
            timers, self._probe_timers = list(self._probe_timers.values()), {}
        for timer in timers:
            timer.cancel()
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
        """A replacement (or a probe's) thread has its session: ``server`` is back in service."""
        with self._lock:
            if self._generation[server] != generation or not (server in self._restarting or server in self._probing):
                return
            probed = server in self._probing
            self._restarting.discard(server)
            self._probing.discard(server)
            if self._closed:
                return
            if probed:
                self._probe_wait.pop(server, None)
                self._probe_timers.pop(server, None)
                self.readmissions += 1
            self._reinstate(server)
            in_service = self._in_service()
        if probed:  # said at the level its loss was said at
            log.warning("target server %s passes its start check again: re-admitted; %d of %d servers in service",
                        self._server_name(server), in_service, self.num_servers)
        else:
            log.info("target server thread %d restarted", server)

    def _server_name(self, server: int) -> str:
        """``1``, or ``1 (http://host:8001/v1)`` where the server has a device (an engine's URL)."""
        return f"{server} ({self._devices[server % len(self._devices)]})" if self._devices else str(server)

    def _schedule_probe(self, server: int) -> float:
        """Probe the lost ``server`` after its current wait, doubling the next one (lock held); returns the wait."""
        wait = self._probe_wait.get(server, PROBE_FIRST_S)
        self._probe_wait[server] = min(2 * wait, PROBE_MAX_S)
        timer = threading.Timer(wait, self._probe, args=(server,))
        timer.name, timer.daemon = f"dsi-target-{server}-probe", True
        self._probe_timers[server] = timer
        timer.start()
        return wait

    def _probe(self, server: int) -> None:
        """A probe of the lost ``server``: a new thread whose session is the start check."""
        with self._lock:
            if self._closed or server not in self._probe_wait or server in self._probing:
                return
            self._probing.add(server)
            self._start_thread(server)

    def _died(self, server: int, generation: int, error: str, charged_to_task: bool) -> None:
        """The thread of ``server`` is ending (or declared frozen): re-queue its task, report it,
        start a replacement if allowed (a death that is not ``charged_to_task`` counts against the
        server's restart budget)."""
        events: list[object] = []
        with self._lock:
            if self._closed or self._generation[server] != generation:
                return
            if server in self._probing:  # a probe of a lost server: still lost, probed again later
                self._probing.discard(server)
                self._generation[server] += 1
                wait = self._schedule_probe(server)
                log.debug("target server %s is still lost (%s); next probe in %.1f s", self._server_name(server),
                          error, wait)
                return
            self._restarting.discard(server)
            task = self._dispatch.mark_dead(server)
            if task is not None:
                flag = self._cancel_flags.get(server)
                if flag is not None and flag.is_set():
                    events.append(TaskAborted(task.task_id, server, 0.0))
                else:
                    failed = self._requeue(task, server, error, charged_to_task)
                    if failed is not None:
                        events.append(failed)
                if flag is not None:
                    flag.set()  # a frozen forward that wakes up stops at its next check
            probe = self._restart_dead and self._readmit
            restart = (self._restart_dead and not probe
                       and self._may_restart(server, charged_to_task and task is not None))
            if restart:
                self._restarting.add(server)
                self._start_thread(server)
            else:
                self._generation[server] += 1  # whatever the old thread does next is not reported
                if probe:
                    wait = self._schedule_probe(server)
            self._drain_waiting()
            in_service, starting = self._in_service(), len(self._restarting)
        if probe:
            note = (f"; lost: probed in the background (first in {wait:.1f} s, then with backoff up to "
                    f"{PROBE_MAX_S:.0f} s) and re-admitted when it passes the start check again; "
                    f"{in_service} of {self.num_servers} servers in service")
        else:
            note = death_note(restart, in_service, starting, self.num_servers, self._restart_dead)
        log.error("target server %s died (%s)%s", self._server_name(server), error, note)
        for event in [ServerDied(server, error, restart), *events]:  # a lost server is probed, not restarted
            self._on_event(event)

    def _incarnation(self, server: int) -> int:
        return self._generation[server]

    def _declare_frozen(self, server: int, generation: int, reason: str) -> None:
        self._died(server, generation, reason, charged_to_task=True)
