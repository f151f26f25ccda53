"""Which server gets a task: the FIFO queue and the cache-affinity choice every transport uses.

A task goes to an idle server if there is one, preferring the server whose last sequence
shares the longest prefix with the task's context (it has the most KV cache to reuse);
otherwise it waits in a FIFO queue and the next server to finish takes it. Cancelled tasks
leave the queue at once. :class:`Dispatcher` is not thread-safe by itself: the pool holds its
lock around calls. :class:`DispatchingPool` is that locked use, shared by the thread pool and
the remote (process, Ray) pools.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from dsi.errors import WorkerError
from dsi.models.base import common_prefix_length
from dsi.transport.base import VerifyTask


class Dispatcher:
    def __init__(self, num_servers: int) -> None:
        self.running: dict[int, VerifyTask | None] = {i: None for i in range(num_servers)}
        self.last_context: dict[int, Sequence[int]] = {i: () for i in range(num_servers)}
        self.queue: deque[VerifyTask] = deque()
        self.dead: set[int] = set()

    def idle_servers(self) -> list[int]:
        return [s for s, task in self.running.items() if task is None and s not in self.dead]

    def place(self, task: VerifyTask) -> int | None:
        """Assign ``task`` to the best idle server and return its id, or queue it (None)."""
        idle = self.idle_servers()
        if not idle:
            self.queue.append(task)
            return None
        server = max(idle, key=lambda s: (common_prefix_length(self.last_context[s], task.context), -s))
        self._start(server, task)
        return server

    def finish(self, server: int) -> VerifyTask | None:
        """Mark ``server`` idle; hand it the next queued task (returned) if any."""
        self.running[server] = None
        if server in self.dead or not self.queue:
            return None
        task = self.queue.popleft()
        self._start(server, task)
        return task

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

    def _start(self, server: int, task: VerifyTask) -> None:
        self.running[server] = task
        self.last_context[server] = task.context


class DispatchingPool:
    """Submitting and re-queueing under the pool's lock, for every pool built on a Dispatcher.

    A subclass sets ``_lock``, ``_dispatch``, ``_closed`` and ``_name`` (for messages) and
    implements ``num_servers``, ``_alive()`` (servers in service; lock held) and
    ``_hand_over(server, task)`` (start ``task`` on the idle ``server``; lock held).
    """

    def submit(self, task: VerifyTask) -> None:
        with self._lock:
            if self._closed:
                raise WorkerError(f"the {self._name} target pool is closed")
            if self._alive() == 0:
                raise WorkerError(f"no target server is alive: all {self.num_servers} {self._name} servers died")
            server = self._dispatch.place(task)
            if server is not None:
                self._hand_over(server, task)

    def idle_servers(self) -> int:
        """Servers in service with nothing to do: a task submitted now starts at once on one."""
        with self._lock:
            return 0 if self._dispatch.queue else len(self._dispatch.idle_servers())

    def _requeue(self, task: VerifyTask) -> None:
        """Put a lost server's task first in line (lock held)."""
        if self._dispatch.idle_servers():
            server = self._dispatch.place(task)
            if server is not None:
                self._hand_over(server, task)
        else:
            self._dispatch.queue.appendleft(task)
