"""Process transport: each target server in its own *spawned* process (never forked: torch).

The child gets the model as a picklable recipe (:mod:`dsi.transport.recipes`): synthetic and
callable models travel whole, an ``HFModel`` is re-loaded from its source directory with the
server's device and torch thread count. Parent and child talk over one ``multiprocessing.Pipe``
per server: a task goes down as one pickled frame; the answer comes back as pickle protocol 5
with numpy arrays as raw out-of-band frames (no copy into the pickle), the large ones (a sampled
chain's law) through a shared ring per server (:mod:`dsi.transport.arena`; the pipe where there is
none). One listener thread per server in the parent blocks on the pipe
(:class:`~dsi.transport.remote.RemotePool`).

Cancellation: each server has one shared-memory slot (``RawValue('q')``); to stop task t the parent
writes t into it, and the task's flag (:class:`TaskCancelFlag`) reads "set" when the slot holds
its own id, so a cancel can never hit the next task and nothing has to be cleared. Forwards check
the flag between steps (layers for HF models); ``wait`` polls it every :data:`POLL_S`. Not a
``multiprocessing.Event``: its ``set()`` blocks forever once a child was killed while waiting on it
or checking it (the Condition inside waits for the dead sleeper), which hung ``close`` after a
server was killed. A plain shared integer has no lock a dead child can hold.

Failures: a child that dies closes its end of the pipe; the listener sees EOF at once, and the
pool re-queues its task and starts a replacement (see :mod:`dsi.transport.remote`). A child past
its task's liveness deadline (a stopped process, a wedged call) is killed and treated the same way.
An answer that does not unpickle in the parent fails its task only; a malformed frame loses the
server. Children are daemonic and also exit when the parent's end of the pipe closes, so none
outlives the parent.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from dsi.allocator import tune_allocator
from dsi.constraints import register_vocabulary
from dsi.errors import ConfigError, ModelError, WorkerError
from dsi.models.base import LanguageModel
from dsi.transport.arena import Arena
from dsi.transport.base import EventSink, VerifyTask, check_num_servers
from dsi.transport.recipes import ModelRecipe, build_with_threads, model_recipe
from dsi.transport.remote import RemotePool, ServerLost, check_options, per_server, read_answer
from dsi.transport.wire import (
    HANDSHAKE_TIMEOUT_S, MalformedFrame, UndecodableMessage, answer, deadline_for, recv_message, send_message,
    shutdown,
)

log = logging.getLogger(__name__)

OPTIONS = ("devices", "threads_per_server", "restart_dead", "start_timeout", "liveness", "recipe")

POLL_S = 0.001  # how often TaskCancelFlag.wait looks at the shared slot


# ---- the child ------------------------------------------------------------------------------------------
class TaskCancelFlag:
    """The cancel flag of task ``task_id`` in a server process (the ``CancelFlag`` protocol)."""

    def __init__(self, slot: Any, task_id: int) -> None:
        self._slot = slot  # RawValue("q") shared with the parent: the id of the task to stop
        self._task_id = task_id

    def is_set(self) -> bool:
        return self._slot.value == self._task_id

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.perf_counter() + timeout
        while not self.is_set():
            if deadline is None:
                time.sleep(POLL_S)
                continue
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return False
            time.sleep(min(POLL_S, remaining))
        return True


def serve(recipe: ModelRecipe, conn: Connection, cancel_slot: Any, server_id: int, threads: int | None,
          arena_at: tuple[str, int, int] | None = None) -> None:
    """Main function of a server process: build the model, then answer tasks until told to stop (large
    arrays of the answers through the parent's shared ring at ``arena_at``, its :attr:`Arena.where`, where it maps)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which stops us
    arena = Arena.attach(*arena_at) if arena_at is not None else None
    try:
        tune_allocator()
        model = build_with_threads(recipe, threads)
        register_vocabulary(model)  # constraints arrive as their vocabulary's digest (dsi.constraints)
        session = model.new_session()
    except BaseException as exc:
        send_message(conn, ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return
    send_message(conn, ("ready", int(model.vocab_size), os.getpid()))
    try:
        while True:
            try:
                task = recv_message(conn, arena)
            except (EOFError, OSError):
                return  # the parent is gone
            except (MalformedFrame, UndecodableMessage) as exc:  # the parent sees EOF and replaces us
                print(f"dsi target server {server_id}: unreadable task ({exc}); exiting", file=sys.stderr)
                return
            if task is None:
                return
            event = answer(session, task, server_id, TaskCancelFlag(cancel_slot, task.task_id))
            try:
                send_message(conn, event, arena)
            except (EOFError, OSError):
                return
    finally:
        session.close()


# ---- the parent's handle on one child --------------------------------------------------------------------
def _exit_reason(code: int | None, pid: int | None) -> str:
    if code is None:
        return f"its pipe closed (process {pid} still running)"
    if code < 0:
        try:
            return f"process {pid} killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"process {pid} killed by signal {-code}"
    return f"process {pid} exited with code {code}"


class ProcessServer:
    """One spawned server process, its pipe and its cancel slot."""

    def __init__(self, ctx: Any, recipe: ModelRecipe, server_id: int, threads: int | None, vocab_size: int) -> None:
        self.server_id = server_id
        self.vocab_size = vocab_size
        self.cancel_slot = ctx.RawValue("q", -1)
        self.arena = Arena.create()  # None: everything through the pipe
        arena_at = None if self.arena is None else self.arena.where
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=serve, args=(recipe, child_conn, self.cancel_slot, server_id, threads, arena_at),
            name=f"dsi-target-{server_id}", daemon=True,
        )
        try:
            self.process.start()
        except BaseException:  # no process (a process limit, memory): nothing of this server is left behind
            if self.arena is not None:
                self.arena.unlink()
            self.conn.close()
            raise
        finally:
            child_conn.close()  # the child holds the only other end: its death means EOF here
        self.pid = self.process.pid
        self._stopped = False
        # join / is_alive reap the child with waitpid; from two threads at once (the listener
        # asking why the pipe closed, close() stopping it) one of them gets ECHILD and the child
        # looks alive forever. Every reaping call goes through this lock.
        self._reap_lock = threading.Lock()

    def _join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the process to end; True if it has."""
        with self._reap_lock:
            self.process.join(timeout)
            return not self.process.is_alive()

    def exit_reason(self) -> str:
        with self._reap_lock:
            self.process.join(1.0)
            code = self.process.exitcode
        return _exit_reason(code, self.pid)

    def wait_ready(self, timeout: float) -> None:
        try:
            self._wait_ready(timeout)
        finally:
            if self.arena is not None:
                self.arena.unlink()  # the child has mapped it by now, or never will

    def _wait_ready(self, timeout: float) -> None:
        if not self.conn.poll(timeout):
            raise WorkerError(f"target server process {self.server_id} did not start within {timeout:.0f} s")
        try:
            with deadline_for(self.conn, HANDSHAKE_TIMEOUT_S, "ready message"):
                message = recv_message(self.conn)
            if not (isinstance(message, tuple) and message and message[0] in ("ready", "error")):
                raise MalformedFrame(f"expected a ready message, got {type(message).__name__}")
        except (TimeoutError, MalformedFrame, UndecodableMessage) as exc:
            raise WorkerError(f"target server {self.server_id} sent no readable ready message: {exc}") from None
        except (EOFError, OSError):
            raise WorkerError(f"target server {self.server_id} died while starting: {self.exit_reason()} "
                              f"(its stderr above says why; a script that uses transport='processes' must "
                              f"start it under `if __name__ == '__main__':`, because each server process "
                              f"re-imports the main module)") from None
        if message[0] == "error":
            error = ModelError(f"target server {self.server_id} could not build its model: {message[1]}")
            error.add_note(f"the server process's traceback:\n{message[2]}")  # shown where the error is
            raise error
        _, vocab, self.pid = message
        if vocab != self.vocab_size:
            raise ModelError(f"target server {self.server_id} built a model with vocab_size={vocab}; "
                             f"expected {self.vocab_size}")

    def send(self, task: VerifyTask) -> None:
        try:
            send_message(self.conn, task, self.arena)  # with how far the arena's answers were read
        except (OSError, ValueError) as exc:
            raise ServerLost(str(exc)) from exc

    def receive(self) -> object:
        try:
            return read_answer(self.conn, f"process {self.pid}", self.arena)
        except (EOFError, OSError):
            raise ServerLost(self.exit_reason()) from None

    def cancel(self, task_id: int) -> None:
        self.cancel_slot.value = task_id

    def request_stop(self) -> None:
        try:
            send_message(self.conn, None)
        except (OSError, ValueError):
            pass

    def stop(self, timeout: float) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.arena is not None:
            self.arena.unlink()
        if self._join(timeout):
            return
        log.warning("target server process %d did not stop within %.1f s; terminating it", self.pid, timeout)
        self.process.terminate()
        if not self._join(2.0):
            self.process.kill()
            self._join(2.0)
        # the pipe is left to the listener thread, which leaves at its EOF; it closes when collected

    def kill(self) -> None:
        self._stopped = True
        if self.arena is not None:
            self.arena.unlink()
        self.process.kill()  # SIGKILL ends a stopped (SIGSTOP) process too
        shutdown(self.conn)  # the listener wakes now, not when the kernel gets round to the exit
        self._join(5.0)


class ProcessTargetPool(RemotePool):
    """``num_servers`` target servers, each a spawned process with its own copy of the model.

    Options: ``devices`` (one device string, or one per server, cycled: HF models only),
    ``threads_per_server`` (torch intra-op threads in each child), ``restart_dead`` (start a
    replacement for a server that died; default True), ``start_timeout`` (seconds to build the
    models), ``liveness`` (the liveness deadline: see :class:`~dsi.transport.liveness.LivenessPolicy`),
    ``recipe`` (how to build the model in a child, instead of :func:`model_recipe`).
    """

    def __init__(
        self,
        model: LanguageModel,
        num_servers: int,
        on_event: EventSink,
        *,
        devices: str | list[str] | None = None,
        threads_per_server: int | None = None,
        restart_dead: bool = True,
        start_timeout: float = 600.0,
        liveness: object = None,
        recipe: ModelRecipe | None = None,
    ) -> None:
        check_num_servers(num_servers)
        if threads_per_server is not None and (
            not isinstance(threads_per_server, int) or isinstance(threads_per_server, bool) or threads_per_server < 1
        ):
            raise ConfigError(f"{threads_per_server=} must be an integer >= 1 (or None)")
        base = recipe if recipe is not None else model_recipe(model)
        recipes = [base.placed(d, threads_per_server) for d in per_server("devices", devices, num_servers)]
        ctx = multiprocessing.get_context("spawn")
        vocab = int(model.vocab_size)

        def launch(server_id: int) -> ProcessServer:
            return ProcessServer(ctx, recipes[server_id], server_id, threads_per_server, vocab)

        super().__init__(launch, num_servers, on_event, restart_dead=restart_dead,
                         start_timeout=start_timeout, liveness=liveness, name="process")

    def server_pids(self) -> list[int | None]:
        """The pid of each server's current process (for monitoring and failure-injection tests)."""
        return [h.pid for h in self.handles]  # type: ignore[attr-defined]


def make_process_pool(model: LanguageModel, num_servers: int, on_event: EventSink, **options: Any) -> ProcessTargetPool:
    check_options("processes", options, OPTIONS)
    return ProcessTargetPool(model, num_servers, on_event, **options)
