"""Simulators of DSI, SI and non-SI; pure numpy (no torch, no engine import).

- :mod:`dsi.sim.offline`: the paper's offline simulator (docs/simulator.md section 1), vectorised over
  configurations and repeats; Equation 1 (:func:`required_sp`).
- :mod:`dsi.sim.events`: an event simulator of the real algorithm (TTFT/TPOT, queueing,
  preemption; DSI with a fixed lookahead or event-driven, ``lookahead="auto"``; optional random
  target latencies), which also replays a real run's match pattern to give its ideal time.
- :mod:`dsi.sim.analytic`: closed forms and exact expectations.
- :mod:`dsi.sim.heatmap`, :mod:`dsi.sim.table`, :mod:`dsi.sim.plan`: Figure 1, Table 1, and
  the deployment planner behind ``dsi heatmap``, ``dsi table`` and ``dsi plan``.
- :mod:`dsi.sim.replay`: a greedy run's per-position match pattern.
"""

from dsi.sim.events import AUTO, EventSimResult, simulate
from dsi.sim.offline import OfflineResult, required_sp, simulate_many, simulate_offline

__all__ = [
    "AUTO",
    "EventSimResult",
    "OfflineResult",
    "required_sp",
    "simulate",
    "simulate_many",
    "simulate_offline",
]
