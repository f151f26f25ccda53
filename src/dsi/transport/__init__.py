"""Target-server transports behind one pool interface (:mod:`dsi.transport.base`).

:func:`make_pool` is the single place that maps a transport name to its pool class; each
transport module is imported only when chosen, so Ray stays optional.
"""

from __future__ import annotations

from typing import Any

from dsi.errors import ConfigError
from dsi.transport.base import EventSink, TargetPool

TRANSPORTS = ("threads",)


def make_pool(transport: str, target: Any, num_servers: int, on_event: EventSink, **options: Any) -> TargetPool:
    """Start ``num_servers`` target servers of ``target`` on ``transport``."""
    if transport == "threads":
        from dsi.transport.threads import ThreadTargetPool

        if options:
            raise ConfigError(f"transport='threads' takes no options; got {sorted(options)}")
        return ThreadTargetPool(target, num_servers, on_event)
    raise ConfigError(f"transport={transport!r} must be one of {', '.join(TRANSPORTS)}")
