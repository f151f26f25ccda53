"""Ray transport: each target server is a Ray actor, placed by Ray's resources across nodes and GPUs.

Ray does placement (``num_cpus`` / ``num_gpus`` / custom resources / node affinity / SPREAD),
starts the actors and builds their models from a recipe (:mod:`dsi.transport.recipes`). Tasks,
results and cancels travel on one of two channels (``channel=``):

- ``"direct"`` (default): the actor listens on its node's IP (a free port, HMAC-authenticated
  with a random key sent through Ray) and the driver connects once. A reader thread in the actor
  takes tasks and cancels off the socket, a compute thread runs the forwards and sends each
  result back with :mod:`dsi.transport.wire` framing (numpy arrays as raw frames; the large ones
  through a shared ring, :mod:`dsi.transport.arena`, where the actor runs on the driver's machine). A task costs
  one socket round trip (tens of microseconds on a node) instead of a Ray actor call (about a
  millisecond); a cancel reaches the running forward through the reader thread; a dead actor
  closes the socket, so even an idle server's death is seen at once (TCP keep-alive covers a
  lost node within about 11 s). If the driver cannot reach the actor's port (e.g. a Ray Client
  ``ray://`` driver outside the cluster network) that server falls back to ``"ray"``.
- ``"ray"``: each task is an actor call ``run(task)`` returning the event (numpy arrays
  serialised by Ray: inline when small, through the shared-memory object store when large). The
  actor is *threaded* with a separate ``control`` concurrency group for ``cancel``, so a cancel
  reaches the actor while a forward runs and sets the flag the forward checks between steps
  (``ray.cancel`` does not interrupt a running actor task). Cancels are keyed by task id, so a
  late cancel never stops the next task. A dead actor shows when its call fails.

Ray itself: with ``address`` the pool connects to that cluster (``"auto"``, ``"HOST:PORT"``,
``"ray://HOST:PORT"``); without it, it uses the Ray already initialised in this process, else
starts a new local one (``ray.init(address="local")``: never some other cluster that happens to run
on this machine). ``close`` kills every actor it created and shuts Ray down if it initialised
Ray itself. Ray is imported only here (``pip install 'dsi[ray]'``).
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
from typing import Any

from dsi.allocator import tune_allocator
from dsi.constraints import register_vocabulary
from dsi.errors import ConfigError, ModelError, WorkerError
from dsi.models.base import LanguageModel
from dsi.transport.arena import Arena
from dsi.transport.base import EventSink, TaskAborted, TaskFailed, VerifyTask, check_num_servers
from dsi.transport.recipes import ModelRecipe, build_with_threads, model_recipe
from dsi.transport.remote import STOPPED, BadAnswer, RemotePool, ServerLost, check_options, per_server, read_answer
from dsi.transport.wire import (
    accept, answer, connect, listen, recv_message, restore_exception, send_message, shutdown,
)

log = logging.getLogger(__name__)

OPTIONS = (
    "address", "num_cpus", "num_gpus", "resources", "node_ids", "placement", "devices",
    "threads_per_server", "restart_dead", "start_timeout", "liveness", "recipe", "channel", "actor_options",
    "init_options",
)
CHANNELS = ("direct", "ray")
CONNECT_TIMEOUT_S = 10.0  # for the driver to reach an actor's port and authenticate before falling back to "ray"
ACCEPT_TIMEOUT_S = 60.0  # for the driver to connect to an actor's channel once it was opened


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(f"transport='ray' needs Ray: pip install 'dsi[ray]' ({exc})") from exc
    return ray


class TargetServerActor:
    """The body of one target-server actor (made a Ray actor class by :func:`actor_class`)."""

    def __init__(self, recipe: ModelRecipe, server_id: int, threads: int | None) -> None:
        self.server_id = server_id
        tune_allocator()
        self.model = build_with_threads(recipe, threads)
        register_vocabulary(self.model)  # constraints arrive as their vocabulary's digest (dsi.constraints)
        self.session = self.model.new_session()
        self._lock = threading.Lock()
        self._running: tuple[int, threading.Event] | None = None
        self._early: set[int] = set()  # cancels that arrived before their task started

    def ready(self) -> tuple[int, str, int]:
        import ray

        return int(self.model.vocab_size), ray.get_runtime_context().get_node_id(), os.getpid()

    # -- both channels -------------------------------------------------------------------------------
    def _execute(self, task: VerifyTask) -> object:
        flag = threading.Event()
        with self._lock:
            if task.task_id in self._early:
                self._early.discard(task.task_id)
                return TaskAborted(task.task_id, self.server_id, 0.0)
            self._running = (task.task_id, flag)
        try:
            return answer(self.session, task, self.server_id, flag)
        finally:
            with self._lock:
                self._running = None

    def cancel(self, task_id: int) -> None:
        with self._lock:
            if self._running is not None and self._running[0] == task_id:
                self._running[1].set()
            else:
                self._early.add(task_id)
                if len(self._early) > 1024:  # ids of tasks that finished before their cancel came
                    self._early.clear()

    # -- the "ray" channel: one actor call per task ------------------------------------------------
    def run(self, task: VerifyTask) -> object:
        return self._execute(task)

    # -- the "direct" channel: one socket ------------------------------------------------------------
    def open_channel(self, authkey: bytes, arena_at: tuple[str, int, int] | None = None) -> tuple[str, int]:
        """Listen on this node's IP for the driver; return the address to connect to. ``arena_at``: the driver's
        shared ring (path, size) where this actor runs on the driver's machine; its large answers go there."""
        import ray

        arena = Arena.attach(*arena_at) if arena_at is not None else None
        listener = listen(ray.util.get_node_ip_address(), authkey)
        threading.Thread(target=self._serve_channel, args=(listener, arena), name="dsi-channel", daemon=True).start()
        return listener.address

    def _serve_channel(self, listener: Any, arena: Arena | None) -> None:
        try:
            conn = accept(listener, ACCEPT_TIMEOUT_S)
        except (TimeoutError, OSError) as exc:  # the driver gave up on us (it falls back to Ray calls)
            log.warning("target server actor %d: no driver on the direct channel: %s", self.server_id, exc)
            return
        finally:
            listener.close()  # one driver per actor
        tasks: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._compute, args=(conn, tasks, arena), name="dsi-compute", daemon=True).start()
        try:
            while True:
                message = recv_message(conn, arena)
                if message is None:
                    break
                kind, value = message
                if kind == "task":
                    tasks.put(value)
                else:
                    self.cancel(value)
        except (EOFError, OSError):
            pass  # the driver is gone
        except Exception as exc:  # noqa: BLE001 - an unreadable message: drop the channel, the driver replaces us
            log.error("target server actor %d: unreadable message on the channel: %s: %s",
                      self.server_id, type(exc).__name__, exc)
            shutdown(conn)
        tasks.put(None)

    def _compute(self, conn: Any, tasks: queue.SimpleQueue, arena: Arena | None) -> None:
        try:
            while (task := tasks.get()) is not None:
                event = self._execute(task)
                try:
                    send_message(conn, event, arena)
                except (OSError, ValueError):
                    return
        except BaseException as exc:  # model code ended the thread: the driver must not wait for an answer
            log.error("target server actor %d: the compute thread died: %s: %s", self.server_id,
                      type(exc).__name__, exc)
            shutdown(conn)  # the driver sees the channel close, replaces this actor and re-queues the task


@functools.cache
def actor_class() -> Any:
    """``TargetServerActor`` as a threaded Ray actor class with a ``control`` group for cancel."""
    ray = import_ray()

    class _Actor(TargetServerActor):
        @ray.method(concurrency_group="control")
        def cancel(self, task_id: int) -> None:
            super().cancel(task_id)

        @ray.method(concurrency_group="control")
        def ready(self) -> tuple[int, str, int]:
            return super().ready()

        @ray.method(concurrency_group="control")
        def open_channel(self, authkey: bytes, arena_at: tuple[str, int, int] | None = None) -> tuple[str, int]:
            return super().open_channel(authkey, arena_at)

    _Actor.__name__ = _Actor.__qualname__ = "DSITargetServer"
    return ray.remote(concurrency_groups={"control": 1})(_Actor)


class RayServer:
    """The driver's handle on one target-server actor, over the direct or the Ray-call channel."""

    def __init__(self, ray: Any, recipe: ModelRecipe, server_id: int, threads: int | None,
                 options: dict, vocab_size: int, channel: str) -> None:
        self._ray = ray
        self.server_id = server_id
        self.vocab_size = vocab_size
        self.channel = channel
        self.node_id: str | None = None
        self.pid: int | None = None
        self.actor = actor_class().options(**options).remote(recipe, server_id, threads)
        self._conn: Any = None
        self._arena: Arena | None = None  # the direct channel's shared ring, where the actor runs on this machine
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # "ray" channel: (task, ref) in flight
        self._last_ref: Any = None
        self._stopped = False

    def wait_ready(self, timeout: float) -> None:
        ray = self._ray
        try:
            vocab, self.node_id, self.pid = ray.get(self.actor.ready.remote(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise WorkerError(f"target server actor {self.server_id} was not ready within {timeout:.0f} s "
                              "(not enough cluster resources for its num_cpus / num_gpus / resources?)") from None
        except ray.exceptions.RayActorError as exc:
            raise ModelError(f"target server actor {self.server_id} could not start: {exc}") from exc
        if vocab != self.vocab_size:
            raise ModelError(f"target server actor {self.server_id} built a model with vocab_size={vocab}; "
                             f"expected {self.vocab_size}")
        if self.channel == "direct":
            authkey = os.urandom(32)
            here = self.node_id == ray.get_runtime_context().get_node_id()
            self._arena = Arena.create() if here else None
            arena_at = None if self._arena is None else self._arena.where
            try:
                address = ray.get(self.actor.open_channel.remote(authkey, arena_at), timeout=timeout)
                self._conn = connect(tuple(address), authkey, CONNECT_TIMEOUT_S)
            except (OSError, EOFError, ray.exceptions.RayError) as exc:  # GetTimeoutError is a RayError
                log.warning("target server actor %d: no direct channel (%s: %s); using Ray calls",
                            self.server_id, type(exc).__name__, exc)
                self.channel = "ray"
            finally:
                if self._arena is not None:
                    self._arena.unlink()  # mapped by the actor by now, or never

    def send(self, task: VerifyTask) -> None:
        if self._conn is not None:
            try:
                send_message(self._conn, ("task", task), self._arena)
            except (OSError, ValueError) as exc:
                raise ServerLost(f"actor {self.server_id}: {exc}") from exc
        else:
            self._last_ref = self.actor.run.remote(task)
            self._calls.put((task, self._last_ref))

    def receive(self) -> object:
        if self._conn is not None:
            try:
                return read_answer(self._conn, f"actor {self.server_id} (pid {self.pid})", self._arena)
            except (EOFError, OSError):
                if self._stopped:
                    return STOPPED
                raise ServerLost(f"actor {self.server_id} (pid {self.pid}) closed its channel: "
                                 f"{self._death_cause()}") from None
        item = self._calls.get()
        if item is STOPPED:
            return STOPPED
        task, ref = item
        ray = self._ray
        try:
            return restore_exception(ray.get(ref))
        except ray.exceptions.RayActorError as exc:
            raise ServerLost(f"actor {self.server_id} died: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
        except ray.exceptions.RayTaskError as exc:  # run() itself raised (e.g. an unpicklable task)
            return TaskFailed(task.task_id, self.server_id, f"{type(exc).__name__}: {exc}", None)
        except ray.exceptions.RaySystemError as exc:  # e.g. the answer did not deserialize here
            raise BadAnswer(f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from None
        except ray.exceptions.RayError as exc:  # object lost, node died...
            raise ServerLost(f"actor {self.server_id} lost: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
        except Exception as exc:  # noqa: BLE001 - an answer that could not be read here
            raise BadAnswer(f"{type(exc).__name__}: {exc}") from exc

    def _death_cause(self) -> str:
        ray = self._ray
        try:  # a call on a dead actor fails at once with Ray's account of the death
            ray.get(self.actor.ready.remote(), timeout=5.0)
            return "the actor is still alive"
        except ray.exceptions.RayError as exc:
            return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"

    def cancel(self, task_id: int) -> None:
        if self._conn is not None:
            try:
                send_message(self._conn, ("cancel", task_id), self._arena)
            except (OSError, ValueError):
                pass  # a lost actor shows up in receive()
        else:
            self.actor.cancel.remote(task_id)

    def request_stop(self) -> None:
        if self._conn is not None:
            try:
                send_message(self._conn, None)
            except (OSError, ValueError):
                pass
        else:
            self._calls.put(STOPPED)

    def stop(self, timeout: float) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            if self._last_ref is not None:  # let a cancelled call return rather than kill it mid-task
                self._ray.wait([self._last_ref], timeout=min(timeout, 2.0))
            self._ray.kill(self.actor, no_restart=True)
        except Exception as exc:  # Ray already shut down, actor already gone
            log.debug("ray.kill of server %d: %s", self.server_id, exc)

    def kill(self) -> None:
        self._stopped = True
        try:
            self._ray.kill(self.actor, no_restart=True)  # Ray's raylet force-kills a worker that does not exit
        except Exception as exc:  # Ray already shut down, actor already gone
            log.debug("ray.kill of server %d: %s", self.server_id, exc)
        if self._conn is not None:
            shutdown(self._conn)  # wake the listener now
        else:
            self._calls.put(STOPPED)


class RayTargetPool(RemotePool):
    """``num_servers`` target servers, each a Ray actor built from the model's recipe.

    Resources per actor: ``num_cpus``, ``num_gpus``, ``resources`` (custom resources, dict).
    Placement: ``node_ids`` (one node id or one per server, cycled: hard node affinity) or
    ``placement="spread"`` (Ray's SPREAD strategy). ``devices`` as for processes (HF models);
    with ``num_gpus > 0`` and no ``devices`` an HF model goes to ``"cuda"`` (the GPU Ray gave the
    actor). ``channel``: ``"direct"`` (a socket per actor, default) or ``"ray"`` (actor calls).
    ``actor_options``: any further ``.options(...)`` (e.g. ``runtime_env``);
    ``init_options``: keyword arguments for ``ray.init`` when this pool initialises Ray.
    """

    def __init__(
        self,
        model: LanguageModel,
        num_servers: int,
        on_event: EventSink,
        *,
        address: str | None = None,
        num_cpus: float | None = None,
        num_gpus: float | None = None,
        resources: dict[str, float] | None = None,
        node_ids: str | list[str] | None = None,
        placement: str | None = None,
        devices: str | list[str] | None = None,
        threads_per_server: int | None = None,
        restart_dead: bool = True,
        start_timeout: float = 600.0,
        liveness: object = None,
        recipe: ModelRecipe | None = None,
        channel: str = "direct",
        actor_options: dict | None = None,
        init_options: dict | None = None,
    ) -> None:
        check_num_servers(num_servers)
        for name, value in (("num_cpus", num_cpus), ("num_gpus", num_gpus)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value < 0):
                raise ConfigError(f"{name}={value!r} must be a number >= 0 (or None)")
        if channel not in CHANNELS:
            raise ConfigError(f"{channel=} must be one of {', '.join(CHANNELS)}")
        if placement not in (None, "default", "spread"):
            raise ConfigError(f"{placement=} must be None, 'default' or 'spread'")
        if placement == "spread" and node_ids is not None:
            raise ConfigError("give either node_ids or placement='spread', not both")
        if resources is not None and not isinstance(resources, dict):
            raise ConfigError(f"{resources=} must be a dict of custom resource name -> amount")
        base = recipe if recipe is not None else model_recipe(model)
        if devices is None and num_gpus and getattr(base, "uses_device", False):
            devices = "cuda"
        recipes = [base.placed(d, threads_per_server) for d in per_server("devices", devices, num_servers)]
        nodes = per_server("node_ids", node_ids, num_servers)
        ray = import_ray()
        self._owns_ray = False
        if not ray.is_initialized():
            # address=None must not attach to whatever cluster runs on this machine: "local" starts one
            ray.init(address=address or "local", **({"include_dashboard": False} | dict(init_options or {})))
            self._owns_ray = True
        elif address is not None:
            log.info("Ray is already initialised in this process; address=%r is not used", address)
        self._ray = ray
        vocab = int(model.vocab_size)

        def launch(server_id: int) -> RayServer:
            options: dict[str, Any] = {"max_restarts": 0, "max_task_retries": 0}
            if num_cpus is not None:
                options["num_cpus"] = num_cpus
            if num_gpus is not None:
                options["num_gpus"] = num_gpus
            if resources:
                options["resources"] = dict(resources)
            if nodes[server_id] is not None:
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(nodes[server_id], soft=False)
            elif placement == "spread":
                options["scheduling_strategy"] = "SPREAD"
            options.update(actor_options or {})
            return RayServer(ray, recipes[server_id], server_id, threads_per_server, options, vocab, channel)

        try:
            super().__init__(launch, num_servers, on_event, restart_dead=restart_dead,
                             start_timeout=start_timeout, liveness=liveness, name="ray")
        except BaseException:
            self._shutdown_ray()
            raise

    def actors(self) -> list[Any]:
        """Each server's current actor handle (for monitoring and failure-injection tests)."""
        return [h.actor for h in self.handles]  # type: ignore[attr-defined]

    def server_nodes(self) -> list[str | None]:
        """The Ray node id each server's actor runs on."""
        return [h.node_id for h in self.handles]  # type: ignore[attr-defined]

    def close(self, timeout: float = 10.0) -> None:
        super().close(timeout)
        self._shutdown_ray()

    def _shutdown_ray(self) -> None:
        if self._owns_ray:
            self._owns_ray = False
            self._ray.shutdown()


def make_ray_pool(model: LanguageModel, num_servers: int, on_event: EventSink, **options: Any) -> RayTargetPool:
    check_options("ray", options, OPTIONS)
    return RayTargetPool(model, num_servers, on_event, **options)
