"""Which server gets a task: the FIFO queue and the cache-affinity choice every transport uses.

A task goes to an idle server if there is one, preferring the server whose last sequence
shares the longest prefix with the task's context (it has the most KV cache to reuse);
otherwise it waits in a FIFO queue and the next server to finish takes it. Cancelled tasks
leave the queue at once. A task that names its request (:attr:`VerifyTask.request`) may reuse only what
that request cached: the first one on a server that another request filled runs ``fresh`` (the server
empties its cache first), so no answer depends on what the pool served before. :class:`Dispatcher` is not thread-safe by itself: the pool holds its
lock around calls. :class:`DispatchingPool` is that locked use, shared by the thread pool and
the remote (process, Ray) pools, with the failure policy they share:

- a dead server's task goes first in line again, to another server than those it died on while
  any other is in service (so a replaced server that breaks on every task, like an engine answering
  garbage, never gets that task back), unless it was running on :data:`MAX_TASK_DEATHS` servers
  that died (or, in a pool of fewer servers, died that often on all of them): such a *poison* task
  fails (a ``TaskFailed``) instead of killing every server in turn;
- a dead server is replaced. A death while running a task is charged to the task (above); any
  other (the server could not start, or died idle) counts against the server: at most
  :data:`MAX_RESTARTS` of those within :data:`RESTART_WINDOW_S` (systemd's default start limit),
  cleared once a replacement answers a task. A crash loop stops; faults that tasks trigger never
  use a server up, since a request fails at its first failed task;
- each running task has a liveness deadline (:mod:`dsi.transport.liveness`); a server past it is
  declared dead like one that crashed.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from collections.abc import Iterable, Sequence

from dsi.errors import WorkerError
from dsi.models.base import common_prefix_length
from dsi.transport.base import TaskFailed, TaskResult, VerifyTask
from dsi.transport.liveness import ForwardRates, LivenessPolicy, Watchdog

MAX_TASK_DEATHS = 2  # servers that may die running one task before the task fails instead
MAX_RESTARTS = 5  # replacements of one server id within RESTART_WINDOW_S (without an answered task between)
RESTART_WINDOW_S = 10.0


def death_note(restart: bool, in_service: int, starting: int, total: int, restart_dead: bool = True) -> str:
    """The end of the one log line a pool writes when a server dies: what happens next and what is left:
    servers taking tasks, and replacements still starting (``restart_dead``: the pool's option; off, no
    server is ever replaced)."""
    left = f"{in_service} of {total} servers in service" + (f", {starting} starting" if starting else "")
    if restart:
        return f"; starting a replacement; {left}"
    why = (f"its last {MAX_RESTARTS} replacements within {RESTART_WINDOW_S:.0f} s died before answering a task, "
           "or the pool is closing" if restart_dead else "restart_dead is off")
    return f"; not restarted ({why}); {left}"


class Dispatcher:
    def __init__(self, num_servers: int) -> None:
        self.running: dict[int, VerifyTask | None] = {i: None for i in range(num_servers)}
        self.last_context: dict[int, Sequence[int]] = {i: () for i in range(num_servers)}
        # the request whose task each server ran last (VerifyTask.request; None: none, or one that keeps caches)
        self.last_request: dict[int, int | None] = {i: None for i in range(num_servers)}
        self.queue: deque[VerifyTask] = deque()
        self.dead: set[int] = set()
        self.started: dict[int, float] = {i: 0.0 for i in range(num_servers)}  # monotonic start of the running task
        self.new_tokens: dict[int, int] = {i: 0 for i in range(num_servers)}  # tokens it processes beyond the cache
        self.deaths: dict[int, int] = {}  # task id -> servers that died running it
        self.died_on: dict[int, set[int]] = {}  # task id -> the servers it died on (it avoids them)

    def idle_servers(self) -> list[int]:
        return [s for s, task in self.running.items() if task is None and s not in self.dead]

    def may_take(self, server: int, task: VerifyTask) -> bool:
        """Whether ``server`` may run ``task``: not one it died on, unless every server in service is."""
        avoid = self.died_on.get(task.task_id)
        if not avoid or server not in avoid:
            return True
        return all(s in avoid for s in self.running if s not in self.dead)

    def place(self, task: VerifyTask) -> int | None:
        """Assign ``task`` to the best idle server and return its id (``running[id]`` is the task as it is to
        run there: :meth:`_start`), or queue it (None)."""
        idle = [s for s in self.idle_servers() if self.may_take(s, task)]
        if not idle:
            self.queue.append(task)
            return None
        server = max(idle, key=lambda s: (common_prefix_length(self.reusable(s, task), task.context), -s))
        self._start(server, task)
        return server

    def reusable(self, server: int, task: VerifyTask) -> Sequence[int]:
        """What of ``server``'s cache ``task`` may reuse: all of it, unless another request filled it and
        ``task`` belongs to a request that starts from an empty cache (:attr:`VerifyTask.request`)."""
        if task.request is not None and self.last_request[server] != task.request:
            return ()
        return self.last_context[server]

    def forget(self, server: int) -> None:
        """``server``'s cache is empty (a replacement started)."""
        self.last_context[server] = ()
        self.last_request[server] = None

    def finish(self, server: int) -> VerifyTask | None:
        """Mark ``server`` idle; hand it the next queued task (returned, as it is to run there) if any."""
        self.running[server] = None
        if server in self.dead or not self.queue:
            return None
        task = next((t for t in self.queue if self.may_take(server, t)), None)
        if task is None:
            return None
        self.queue.remove(task)
        return self._start(server, task)

    def cancel(self, task_ids: Iterable[int]) -> list[int]:
        """Drop queued tasks among ``task_ids``; return the servers running any of the others."""
        ids = set(task_ids)
        if self.queue:
            self.queue = deque(t for t in self.queue if t.task_id not in ids)
        return [s for s, t in self.running.items() if t is not None and t.task_id in ids]

    def mark_dead(self, server: int) -> VerifyTask | None:
        """Take ``server`` out of service; return the task it was running, if any."""
        self.dead.add(server)
        task, self.running[server] = self.running[server], None
        return task

    def _start(self, server: int, task: VerifyTask) -> VerifyTask:
        """Run ``task`` on ``server``; returns it as it runs there: marked ``fresh`` where it may reuse none of the
        server's cache (the first task of its request there, :meth:`reusable`), so the server empties it first."""
        cached = self.reusable(server, task)
        fresh = task.request is not None and not cached
        if task.fresh != fresh:
            task = replace(task, fresh=fresh)
        self.new_tokens[server] = task.tokens_to_compute(cached)
        self.started[server] = time.monotonic()
        self.running[server] = task
        self.last_context[server] = task.held_context
        self.last_request[server] = task.request
        return task


class DispatchingPool:
    """Submitting, re-queueing and liveness under the pool's lock, for every pool built on a
    Dispatcher.

    A subclass sets ``_lock``, ``_dispatch``, ``_closed``, ``_name`` (for messages), ``_rates``
    (:class:`ForwardRates`), ``_liveness`` (:class:`LivenessPolicy`) and ``_restarts`` (a list, per
    server, of the monotonic times of its recent replacements), and implements ``num_servers``,
    ``_alive()`` (servers in service; lock held), ``_hand_over(server, task)`` (start ``task`` on
    the idle ``server``; lock held), ``_incarnation(server)`` (what identifies the server's current
    worker: a handle, a thread generation; lock held) and ``_declare_frozen(server, incarnation,
    reason)`` (that worker missed its liveness deadline: take it out of service).
    """

    _rates: ForwardRates
    _liveness: LivenessPolicy
    _restarts: list[list[float]]

    def submit(self, task: VerifyTask) -> None:
        with self._lock:
            if self._closed:
                raise WorkerError(f"the {self._name} target pool is closed")
            if self._alive() == 0:
                raise WorkerError(f"no target server is alive: all {self.num_servers} {self._name} servers died")
            server = self._dispatch.place(task)
            if server is not None:
                self._hand_over(server, self._dispatch.running[server])

    def idle_servers(self) -> int:
        """Servers in service with nothing to do: a task submitted now starts at once on one."""
        with self._lock:
            return 0 if self._dispatch.queue else len(self._dispatch.idle_servers())

    def busy_servers(self) -> list[int]:
        """Ids of the servers running a task now (for monitoring and failure-injection tests)."""
        with self._lock:
            return [s for s, task in self._dispatch.running.items() if task is not None]

    def _requeue(self, task: VerifyTask, server: int, error: str, charged: bool = True) -> TaskFailed | None:
        """A dead server's task: first in line again, or failed if it is poison (lock held). A death not
        ``charged`` to the task (the server never ran it: it died making its session, before the task could
        start) re-queues it without counting toward the poison limit."""
        d = self._dispatch
        deaths = d.deaths.get(task.task_id, 0) + charged
        died_on = d.died_on.setdefault(task.task_id, set())
        if charged:
            d.deaths[task.task_id] = deaths
            died_on.add(server)
        if len(d.deaths) > 4096:  # ids of long-finished tasks
            d.deaths, d.died_on = {task.task_id: deaths}, {task.task_id: died_on}
        if deaths >= MAX_TASK_DEATHS and len(died_on) >= min(MAX_TASK_DEATHS, self.num_servers):
            return TaskFailed(task.task_id, server, f"task {task.task_id} was running on {deaths} target servers "
                                                    f"that died; not retried (last: {error})")
        placed = d.place(task) if d.idle_servers() else None  # (queued by place when no server may take it)
        if placed is not None:
            self._hand_over(placed, d.running[placed])
        elif task not in d.queue:
            d.queue.appendleft(task)
        else:  # place() queued it last: a re-run goes first in line
            d.queue.remove(task)
            d.queue.appendleft(task)
        return None

    def servers_in_service(self) -> int:
        """Servers that take tasks now (not dead, restarting or lost)."""
        with self._lock:
            return 0 if self._closed else self._in_service()

    def _in_service(self) -> int:
        """Servers taking tasks now: neither dead nor still starting (lock held)."""
        return self.num_servers - len(self._dispatch.dead)

    def _drain_waiting(self) -> None:
        """After a death: hand queued tasks to idle servers that may take them now (a task that
        avoided a server may take it once no other is in service) (lock held)."""
        for server in self._dispatch.idle_servers():
            task = self._dispatch.finish(server)
            if task is not None:
                self._hand_over(server, task)

    def _may_restart(self, server: int, charged_to_task: bool) -> bool:
        """Whether to replace ``server``, counting the death against it unless ``charged_to_task``
        (it died running a task, which the poison guard bounds) (lock held)."""
        if self._closed:
            return False
        if charged_to_task:
            return True
        now = time.monotonic()
        recent = [t for t in self._restarts[server] if now - t < RESTART_WINDOW_S]
        if len(recent) >= MAX_RESTARTS:
            self._restarts[server] = recent
            return False
        self._restarts[server] = [*recent, now]
        return True

    def _reinstate(self, server: int) -> None:
        """A replacement of ``server`` is ready: back in service with an empty cache, no measured
        rate of its own, and the next queued task if any (lock held)."""
        self._dispatch.dead.discard(server)
        self._dispatch.forget(server)
        self._rates.forget(server)
        next_task = self._dispatch.finish(server)
        if next_task is not None:
            self._hand_over(server, next_task)

    def _answered(self, server: int, event: object) -> None:
        """``server`` answered its running task with ``event`` (lock held; before ``finish``): it is
        healthy, and a completed forward tells how fast it is."""
        self._restarts[server] = []
        if isinstance(event, TaskResult):
            self._rates.record(server, event.compute_s, self._dispatch.new_tokens[server])

    def _overdue(self) -> list[tuple[int, VerifyTask, float]]:
        """(server, task, deadline_s) of every running task past its liveness deadline (lock held)."""
        now = time.monotonic()
        late = []
        for server, task in self._dispatch.running.items():
            if task is None or server in self._dispatch.dead:
                continue
            deadline = self._rates.deadline_s(self._liveness, server, self._dispatch.new_tokens[server])
            if deadline is not None and now - self._dispatch.started[server] > deadline:
                late.append((server, task, deadline))
        return late

    def _start_watchdog(self) -> Watchdog | None:
        """The thread that checks the liveness deadlines (None when they are off)."""
        if not self._liveness.enabled:
            return None
        period = min(1.0, self._liveness.floor_s / 4)
        return Watchdog(f"dsi-{self._name}-watchdog", period, self._check_liveness)

    def _check_liveness(self) -> None:
        """Declare every server past its running task's deadline frozen (the watchdog's check)."""
        with self._lock:
            if self._closed:
                return
            late = [(server, self._incarnation(server), task, deadline) for server, task, deadline in self._overdue()]
        for server, incarnation, task, deadline in late:
            self._declare_frozen(server, incarnation, f"no answer to task {task.task_id} within its liveness "
                                                      f"deadline of {deadline:.1f} s (frozen?)")
