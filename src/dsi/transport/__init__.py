"""Target-server transports behind one pool interface (:mod:`dsi.transport.base`).

:func:`make_pool` is the single place that maps a transport name to its pool class; each
transport module is imported only when chosen, so Ray stays optional.

- ``threads``: servers are threads of this process sharing the model's weights; options
  ``devices`` (server i on ``devices[i % len(devices)]``, for models whose ``new_session``
  takes a ``device``), ``restart_dead``, ``liveness``;
- ``processes``: servers are spawned processes (:mod:`dsi.transport.processes`), options
  ``devices``, ``threads_per_server``, ``restart_dead``, ``start_timeout``, ``liveness``, ``recipe``;
- ``ray``: servers are Ray actors (:mod:`dsi.transport.ray`), the same options plus ``address``,
  ``num_cpus``, ``num_gpus``, ``resources``, ``node_ids``, ``placement``, ``channel``,
  ``actor_options``, ``init_options``.

Every pool runs 1 to :data:`MAX_SERVERS` (256) servers; one that cannot start them all stops those it
started and raises (a :class:`~dsi.errors.WorkerError` naming the server, where the cause is not dsi's).
"""

from __future__ import annotations

from typing import Any

from dsi.errors import ConfigError
from dsi.transport.base import MAX_SERVERS, EventSink, TargetPool  # noqa: F401 - MAX_SERVERS: the public limit

TRANSPORTS = ("threads", "processes", "ray")


def make_pool(transport: str, target: Any, num_servers: int, on_event: EventSink, **options: Any) -> TargetPool:
    """Start ``num_servers`` target servers of ``target`` on ``transport``."""
    if transport == "threads":
        from dsi.transport.threads import OPTIONS, ThreadTargetPool

        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ConfigError(f"transport='threads' got unknown options {unknown}; allowed: {sorted(OPTIONS)}")
        return ThreadTargetPool(target, num_servers, on_event, **options)
    if transport == "processes":
        from dsi.transport.processes import make_process_pool

        return make_process_pool(target, num_servers, on_event, **options)
    if transport == "ray":
        from dsi.transport.ray import make_ray_pool

        return make_ray_pool(target, num_servers, on_event, **options)
    raise ConfigError(f"transport={transport!r} must be one of {', '.join(TRANSPORTS)}")
