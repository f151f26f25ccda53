"""``SharedSteps``: the forwards of many sessions run in one engine's batched steps, as a continuous-batching
engine (vLLM, SGLang) runs its requests' forwards. A measuring device for serving under load on hardware one does
not have: label what it measures as emulation.

A step holds every forward waiting when it starts and lasts ``step_s`` plus ``token_s`` per token those forwards
compute (a GPU's step: a fixed cost, the weights read once, and a per-token compute cost shared by the batch). A
forward that arrives while a step runs waits for the next one, so under load a forward's time grows with the
batch's tokens, not with the number of requests. Before it starts a step, the steps' thread waits up to
:data:`GRACE_S` (at most a fifth of a step) for the forwards the last step released to come back, as an engine's
loop steps its running requests together; a forward from elsewhere (a verification over HTTP) that arrives during
a step waits for the next one, as it does in an engine. One thread runs the steps (it starts with a forward that finds
none running, and ends when no forward waits); a forward whose cancel flag is set leaves at the end of its step, as an engine's request
leaves at a step boundary.

:class:`~dsi.models.emulated.latency.WithLatency` takes one (``steps=``): its sessions' forwards then cost the steps
they join instead of their own fixed time. ``dsi serve --synthetic SCENARIO --synthetic-steps TOKEN_MS`` serves such
a model as an emulated batching engine.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from dsi.errors import ConfigError

GRACE_S = 0.002  # at most this long (and a fifth of a step) a step waits for the last one's forwards to come back


def check_seconds(name: str, value: object) -> float:
    """``value`` as float seconds, or a ConfigError naming ``name``: a number >= 0 (the emulated latencies' check)."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
        raise ConfigError(f"{name}={value!r} must be a number of seconds >= 0")
    return float(value)


@dataclass
class _Forward:
    tokens: int
    cancel: object = None  # a CancelFlag: is_set()
    done: threading.Event = field(default_factory=threading.Event)


class SharedSteps:
    """Batched steps shared by every forward that calls :meth:`join` (see the module doc); thread-safe."""

    def __init__(self, step_s: float, token_s: float) -> None:
        self.step_s = check_seconds("step_s", step_s)
        self.token_s = check_seconds("token_s", token_s)
        self._cond = threading.Condition()
        self._waiting: list[_Forward] = []
        self._thread: threading.Thread | None = None
        self.steps = 0  # steps run, and the forwards and tokens they held (for tests and reports)
        self.forwards = 0
        self.tokens = 0

    def join(self, tokens: int, cancel: object = None) -> bool:
        """Wait for the end of the step this forward of ``tokens`` computed tokens joins (the next one to start).
        Returns whether ``cancel`` was set by then."""
        forward = _Forward(int(tokens), cancel)
        with self._cond:
            self._waiting.append(forward)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dsi-emulated-steps", daemon=True)
                self._thread.start()
            self._cond.notify()
        forward.done.wait()
        return bool(cancel is not None and cancel.is_set())

    def _run(self) -> None:
        returning = 0  # forwards the last step released: an engine steps its running requests again at once
        while True:
            with self._cond:
                # wait a little for the last step's forwards to come back for their next token (a client's
                # processing between two forwards), as an engine's loop schedules its running requests together
                deadline = time.monotonic() + min(GRACE_S, 0.2 * self.step_s)
                while len(self._waiting) < returning and (left := deadline - time.monotonic()) > 0:
                    self._cond.wait(left)
                if not self._waiting:  # idle: the next forward starts a new thread
                    self._thread = None
                    return
                batch, self._waiting = self._waiting, []
            live = [f for f in batch if f.cancel is None or not f.cancel.is_set()]
            tokens = sum(f.tokens for f in live)
            if live:  # a sleep wakes within ~0.1 ms here: a step is milliseconds long
                time.sleep(self.step_s + self.token_s * tokens)
            self.steps += bool(live)
            self.forwards += len(live)
            self.tokens += tokens
            for forward in batch:
                forward.done.set()
            returning = len(live)

    def __getstate__(self) -> dict:  # a copy in another process runs its own steps
        return {"step_s": self.step_s, "token_s": self.token_s}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["step_s"], state["token_s"])

    def __repr__(self) -> str:
        return f"SharedSteps(step_s={self.step_s}, token_s={self.token_s})"
