"""The pool logic shared by transports whose target servers live outside this process.

:class:`RemotePool` implements the pool protocol of :mod:`dsi.transport.base` over
:class:`ServerHandle` s (a spawned process, a Ray actor) that each run one task at a time. It
owns the :class:`~dsi.transport.dispatch.Dispatcher`, one *listener* thread per server (it blocks
until the server answers, hands the server its next task, then reports the event), a liveness
watchdog, and failure handling. No failure ends a listener without a verdict:

- an answer that cannot be read although the connection is in step (:class:`BadAnswer`, e.g. an
  exception that pickles but does not unpickle) is a ``TaskFailed`` of the running task; the
  server serves on;
- anything else that goes wrong receiving (the server died, a malformed frame, an unexpected
  error) means the server is lost: it is stopped and taken out of service; the task it was running
  goes back to the front of the queue (or fails, if servers keep dying on it: see
  :mod:`dsi.transport.dispatch`), and a :class:`~dsi.transport.base.ServerDied` event reports it;
- a server past its task's liveness deadline (:mod:`dsi.transport.liveness`) is lost too, and
  killed;
- with ``restart_dead`` (the default) a replacement is started in the background and takes over the
  same server id when ready;
- when no server is left, ``submit`` raises :class:`~dsi.errors.WorkerError` at once.

A transport supplies ``launch(server_id) -> ServerHandle``; everything about processes or Ray
stays in the handle. The pool knows nothing about models.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from typing import Protocol

from dsi.errors import ConfigError, ServerLost, WorkerError
from dsi.transport.base import (
    EventSink, ServerDied, TaskAborted, TaskFailed, VerifyTask, check_num_servers, start_failed,
)
from dsi.transport.dispatch import MAX_RESTARTS, Dispatcher, DispatchingPool, death_note
from dsi.transport.liveness import ForwardRates, LivenessPolicy, Watchdog
from dsi.transport.arena import Arena
from dsi.transport.wire import MalformedFrame, UndecodableMessage, recv_message, restore_exception

log = logging.getLogger(__name__)

__all__ = ["MAX_RESTARTS", "BadAnswer", "RemotePool", "ServerHandle", "ServerLost", "STOPPED", "read_answer"]


class BadAnswer(Exception):
    """The server's answer to its running task could not be read, but the connection is still in
    step: the task failed, the server is fine (raised by ``receive``)."""


STOPPED = object()  # what ``receive`` returns after ``request_stop`` on an idle server


class ServerHandle(Protocol):
    """One remote target server, running at most one task at a time."""

    def wait_ready(self, timeout: float) -> None:
        """Block until the server has built its model; raise WorkerError / ModelError if it cannot."""
        ...

    def send(self, task: VerifyTask) -> None:
        """Hand ``task`` over without waiting for it; may raise :class:`ServerLost`."""
        ...

    def receive(self) -> object:
        """Block until the running task's event (TaskResult / TaskAborted / TaskFailed), or
        :data:`STOPPED` after ``request_stop``; raise :class:`ServerLost` if the server died or its
        connection broke, :class:`BadAnswer` if its answer could not be read."""
        ...

    def cancel(self, task_id: int) -> None:
        """Ask the running task ``task_id`` to stop between steps (non-blocking)."""
        ...

    def request_stop(self) -> None:
        """Ask the server to stop after (or instead of) its current task (non-blocking)."""
        ...

    def stop(self, timeout: float) -> None:
        """Stop the server for good, forcibly after ``timeout`` s; idempotent."""
        ...

    def kill(self) -> None:
        """Stop the server at once, forcibly (it may be frozen), and wake a ``receive`` blocked on
        it (which then raises :class:`ServerLost` or returns :data:`STOPPED`); idempotent."""
        ...


def read_answer(conn: Connection, who: str, arena: Arena | None = None) -> object:
    """The next answer on a :mod:`dsi.transport.wire` connection, its read errors as a handle's
    ``receive`` reports them: a pickle that does not load is a :class:`BadAnswer`, broken framing a
    :class:`ServerLost` (``who`` names the server). ``EOFError`` / ``OSError`` pass through: each
    handle knows best why its peer is gone."""
    try:
        return restore_exception(recv_message(conn, arena))
    except UndecodableMessage as exc:
        raise BadAnswer(str(exc)) from exc
    except MalformedFrame as exc:
        raise ServerLost(f"{who} sent a malformed frame: {exc}") from None


def check_options(transport: str, options: dict, allowed: Iterable[str]) -> None:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(f"transport={transport!r} got unknown options {unknown}; allowed: {sorted(allowed)}")


def per_server(name: str, values: object, num_servers: int) -> list:
    """``values`` (None, one value, or a list of one per server / cycled) as one entry per server."""
    if values is None:
        return [None] * num_servers
    if isinstance(values, str | int | float) or not hasattr(values, "__len__"):
        return [values] * num_servers
    values = list(values)  # type: ignore[arg-type]
    if not values:
        raise ConfigError(f"{name}=[] must name at least one entry (or be omitted)")
    return [values[i % len(values)] for i in range(num_servers)]


class RemotePool(DispatchingPool):
    """A target pool over ``num_servers`` :class:`ServerHandle` s made by ``launch``."""

    def __init__(
        self,
        launch: Callable[[int], ServerHandle],
        num_servers: int,
        on_event: EventSink,
        *,
        restart_dead: bool = True,
        start_timeout: float = 600.0,
        liveness: object = None,
        name: str = "remote",
    ) -> None:
        check_num_servers(num_servers)
        if not isinstance(restart_dead, bool):
            raise ConfigError(f"{restart_dead=} must be True or False")
        if not isinstance(start_timeout, int | float) or not start_timeout > 0:
            raise ConfigError(f"{start_timeout=} must be a number of seconds > 0")
        self._launch = launch
        self._on_event = on_event
        self._restart_dead = restart_dead
        self._start_timeout = float(start_timeout)
        self._liveness = LivenessPolicy.from_option(liveness)
        self._rates = ForwardRates(num_servers)
        self._name = name
        self._lock = threading.Lock()
        self._dispatch = Dispatcher(num_servers)
        self._cancelled: set[int] = set()  # running task ids that were asked to stop
        self._restarting: dict[int, ServerHandle | None] = {}
        self._restarts: list[list[float]] = [[] for _ in range(num_servers)]
        self._lost_servers: set[int] = set()  # servers whose current handle was declared lost
        self._threads: list[threading.Thread] = []
        self._watchdog: Watchdog | None = None
        self._closed = False
        self.handles: list[ServerHandle] = []
        what = f"{name} server 0"
        try:
            for server in range(num_servers):
                what = f"{name} server {server}"
                self.handles.append(launch(server))
            deadline = time.monotonic() + self._start_timeout
            for server, handle in enumerate(self.handles):
                what = f"{name} server {server}"
                handle.wait_ready(max(0.1, deadline - time.monotonic()))
            for server, handle in enumerate(self.handles):
                what = f"the listener thread of {name} server {server}"
                self._start_listener(server, handle)
            what = "its liveness watchdog"
            self._watchdog = self._start_watchdog()
        except BaseException as exc:  # stop every server and thread started (a process, an actor, no thread)
            self._stop_started()
            error = start_failed(what, num_servers, exc)
            if error is exc:
                raise
            raise error from exc

    # ---- the pool protocol -------------------------------------------------------------------
    @property
    def num_servers(self) -> int:
        return len(self.handles)

    def alive_servers(self) -> int:
        """Servers in service or being restarted."""
        with self._lock:
            return self._alive()

    def cancel(self, task_ids: Iterable[int]) -> None:
        with self._lock:
            for server in self._dispatch.cancel(task_ids):
                task = self._dispatch.running[server]
                if task is not None and task.task_id not in self._cancelled:
                    self._cancelled.add(task.task_id)
                    self.handles[server].cancel(task.task_id)

    def close(self, timeout: float = 10.0) -> None:
        """Stop every server this pool started (forcibly after ``timeout`` s) and join its threads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._dispatch.queue.clear()
            handles = list(self.handles) + [h for h in self._restarting.values() if h is not None]
            for server, task in self._dispatch.running.items():
                if task is not None:
                    self.handles[server].cancel(task.task_id)
            for handle in handles:
                handle.request_stop()
        if self._watchdog is not None:
            self._watchdog.stop()
        deadline = time.monotonic() + timeout
        for handle in handles:
            handle.stop(max(0.0, deadline - time.monotonic()))
        for thread in list(self._threads):
            thread.join(max(0.5, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("%s pool thread %s did not stop within %.1f s", self._name, thread.name, timeout)

    def __enter__(self) -> RemotePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals (lock held where noted) -------------------------------------------------------
    def _stop_started(self) -> None:
        """A pool that failed to start: stop the servers it launched and the threads it started."""
        with self._lock:
            self._closed = True
        for handle in self.handles:
            handle.request_stop()
        for handle in self.handles:
            handle.stop(1.0)
        for thread in list(self._threads):
            thread.join(2.0)

    def _alive(self) -> int:
        return self.num_servers - len(self._dispatch.dead) + len(self._restarting)

    def _hand_over(self, server: int, task: VerifyTask) -> None:
        """Send ``task`` to ``server`` (lock held). A failed send shows up as a lost server in
        its listener, which re-queues the task."""
        try:
            self.handles[server].send(task)
        except ServerLost as exc:
            log.debug("%s server %d lost while sending task %d: %s", self._name, server, task.task_id, exc)

    def _start_listener(self, server: int, handle: ServerHandle) -> None:
        thread = threading.Thread(
            target=self._listen, args=(server, handle), name=f"dsi-{self._name}-listener-{server}", daemon=True
        )
        thread.start()
        self._threads.append(thread)  # (close joins it: only once started)

    def _listen(self, server: int, handle: ServerHandle) -> None:
        """Relay ``handle``'s answers until it stops or is lost; never leaves without a verdict."""
        while True:
            try:
                event = handle.receive()
            except BadAnswer as exc:
                event = self._bad_answer(server, handle, str(exc))
                if event is None:
                    return
            except ServerLost as exc:
                self._lost(server, handle, str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - whatever it is, the server is unusable
                log.debug("%s server %d: receiving failed", self._name, server, exc_info=True)  # _lost says it
                self._lost(server, handle, f"receiving failed: {type(exc).__name__}: {exc}")
                return
            if event is STOPPED:
                return
            with self._lock:
                if not self._current(server, handle):
                    return  # declared lost (e.g. frozen) while this answer was on its way: its task moved on
                task = self._dispatch.running[server]
                in_turn = task is not None and getattr(event, "task_id", None) == task.task_id
                if in_turn:
                    self._cancelled.discard(task.task_id)
                    self._answered(server, event)
                    next_task = None if self._closed else self._dispatch.finish(server)
                    if next_task is not None:
                        self._hand_over(server, next_task)
            if not in_turn:  # a server out of step with its tasks cannot be trusted with the next one
                running = "no task" if task is None else f"task {task.task_id}"
                self._lost(server, handle, f"it answered {type(event).__name__} "
                                           f"{getattr(event, 'task_id', '?')} while running {running}")
                return
            self._on_event(event)

    def _current(self, server: int, handle: ServerHandle) -> bool:
        """``handle`` is still ``server``'s and in service (lock held)."""
        return self.handles[server] is handle and server not in self._lost_servers

    def _bad_answer(self, server: int, handle: ServerHandle, error: str) -> TaskFailed | None:
        """An unreadable answer: the running task's TaskFailed (None if no task was running: a
        server that talks out of turn is lost)."""
        with self._lock:
            task = self._dispatch.running[server] if self._current(server, handle) else None
        if task is None:
            self._lost(server, handle, f"an unreadable message out of turn: {error}")
            return None
        log.warning("%s server %d: unreadable answer to task %d: %s", self._name, server, task.task_id, error)
        return TaskFailed(task.task_id, server, f"the answer of target server {server} could not be read: {error}")

    def _incarnation(self, server: int) -> ServerHandle:
        return self.handles[server]

    def _declare_frozen(self, server: int, handle: ServerHandle, reason: str) -> None:
        self._lost(server, handle, reason, kill=True)

    def _lost(self, server: int, handle: ServerHandle, error: str, kill: bool = False) -> None:
        events: list[object] = []
        with self._lock:
            if self._closed or not self._current(server, handle):
                return
            self._lost_servers.add(server)
            task = self._dispatch.mark_dead(server)
            if task is not None:
                if task.task_id in self._cancelled:
                    self._cancelled.discard(task.task_id)
                    events.append(TaskAborted(task.task_id, server, 0.0))
                else:
                    failed = self._requeue(task, server, error)
                    if failed is not None:
                        events.append(failed)
            restart = self._restart_dead and self._may_restart(server, charged_to_task=task is not None)
            if restart:
                self._restarting[server] = None
                thread = threading.Thread(target=self._restart, args=(server,),
                                          name=f"dsi-{self._name}-restart-{server}", daemon=True)
                self._threads.append(thread)
                thread.start()
            self._drain_waiting()
            note = death_note(restart, self._in_service(), len(self._restarting), self.num_servers, self._restart_dead)
        log.warning("%s target server %d died (%s)%s", self._name, server, error, note)
        for event in [ServerDied(server, error, restart), *events]:
            self._on_event(event)
        if kill:
            handle.kill()  # wakes its listener, which finds the handle lost and leaves
        else:
            handle.stop(1.0)

    def _restart(self, server: int) -> None:
        handle = None
        try:
            handle = self._launch(server)
            with self._lock:
                if self._closed:
                    raise WorkerError("pool closed during restart")
                self._restarting[server] = handle
            handle.wait_ready(self._start_timeout)
        except BaseException as exc:
            if handle is not None:
                handle.stop(1.0)
            with self._lock:
                self._restarting.pop(server, None)
                closed = self._closed
            if not closed:
                log.warning("%s target server %d could not be restarted: %s", self._name, server, exc)
                self._on_event(ServerDied(server, f"restart failed: {type(exc).__name__}: {exc}", False))
            return
        with self._lock:
            self._restarting.pop(server, None)
            if self._closed:
                handle.stop(1.0)
                return
            self.handles[server] = handle
            self._lost_servers.discard(server)
            self._start_listener(server, handle)
            self._reinstate(server)
        log.info("%s target server %d restarted", self._name, server)
