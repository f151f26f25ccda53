"""When a target server counts as frozen: the liveness deadline of a running task.

A server that stops answering (a stopped process, a wedged accelerator call, a lost node that TCP
has not noticed yet) would hold its task forever. Every pool therefore gives each running task a
deadline, generous by design and derived from what the server has shown it can do:

    deadline = floor_s + factor * seconds_per_token * new_tokens

``seconds_per_token`` is the slowest rate (seconds per token processed) among the server's last
:data:`HISTORY` completed forwards, or the pool's if this server has none yet (a fresh or restarted
server); ``new_tokens`` is what the task makes the server process beyond the prefix it has cached.
A rate measured on short decode forwards overestimates long prefills (which process their tokens
in parallel), so a long prompt gets a long deadline. Before any forward completed anywhere, the
deadline is ``unmeasured_s``, enough for a cold start. Past its deadline the server is declared
dead: replaced, and its task re-queued (see :mod:`dsi.transport.dispatch`).

This module only computes deadlines; the pools run the clock (:class:`Watchdog`).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from dsi.errors import ConfigError

log = logging.getLogger(__name__)

HISTORY = 32  # completed forwards per server whose rate is remembered


@dataclass(frozen=True)
class LivenessPolicy:
    """How long a running task may take before its server is declared frozen (see module doc).

    ``floor_s``: added to every deadline; ``factor``: how many times the measured cost a task may
    take; ``unmeasured_s``: the deadline before any forward was measured; ``enabled=False``: no
    deadline at all (a frozen server then holds its task until the pool closes).
    """

    floor_s: float = 30.0
    factor: float = 10.0
    unmeasured_s: float = 600.0
    enabled: bool = True

    @classmethod
    def from_option(cls, value: object) -> LivenessPolicy:
        """The pool option ``liveness``: None (defaults), False (off), a number (``floor_s``), a
        dict of fields, or a policy."""
        if value is None:
            return cls()
        if isinstance(value, LivenessPolicy):
            return value
        if value is False:
            return cls(enabled=False)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return cls(floor_s=float(value), unmeasured_s=max(float(value), cls.unmeasured_s)).checked()
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"floor_s", "factor", "unmeasured_s", "enabled"})
            if unknown:
                raise ConfigError(f"liveness got unknown fields {unknown}; allowed: floor_s, factor, "
                                  "unmeasured_s, enabled")
            return cls(**value).checked()
        raise ConfigError(f"liveness={value!r} must be None (defaults), False (no deadline), a number of "
                          "seconds (the floor) or a dict with floor_s, factor, unmeasured_s")

    def checked(self) -> LivenessPolicy:
        for name in ("floor_s", "factor", "unmeasured_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"liveness {name}={value!r} must be a number > 0")
        return self


class ForwardRates:
    """Seconds per processed token of each server's recent forwards (not thread-safe: the pool
    holds its lock)."""

    def __init__(self, num_servers: int) -> None:
        self._rates = {s: deque(maxlen=HISTORY) for s in range(num_servers)}

    def record(self, server: int, compute_s: float, new_tokens: int) -> None:
        if compute_s >= 0:
            self._rates[server].append(compute_s / max(1, new_tokens))

    def forget(self, server: int) -> None:
        """A replaced server starts without a history of its own."""
        self._rates[server].clear()

    def rate(self, server: int) -> float | None:
        own = self._rates[server]
        if own:
            return max(own)
        pooled = [max(r) for r in self._rates.values() if r]
        return max(pooled) if pooled else None

    def deadline_s(self, policy: LivenessPolicy, server: int, new_tokens: int) -> float | None:
        """Seconds ``server`` may spend on a task processing ``new_tokens`` (None: no deadline)."""
        if not policy.enabled:
            return None
        rate = self.rate(server)
        if rate is None:
            return policy.unmeasured_s
        return policy.floor_s + policy.factor * rate * max(1, new_tokens)


class Watchdog:
    """A daemon thread that calls ``check()`` every ``period_s`` until :meth:`stop`."""

    def __init__(self, name: str, period_s: float, check: Callable[[], None]) -> None:
        self._stop = threading.Event()
        self._check = check
        self._period_s = period_s
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            try:
                self._check()
            except Exception:  # a bug here must not end the watch
                log.exception("liveness check failed")

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
