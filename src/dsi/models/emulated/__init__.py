"""Models for tests, simulation-grade benchmarks and hardware one does not have.

- :mod:`~dsi.models.emulated.callable`: :class:`CallableLM`, any next-token function as a model;
- :mod:`~dsi.models.emulated.synthetic`: :func:`synthetic_pair`, a target and drafter with a chosen
  acceptance rate;
- :mod:`~dsi.models.emulated.latency`: :class:`WithLatency`, any model whose forwards take a chosen time
  (the paper's TTFT / TPOT);
- :mod:`~dsi.models.emulated.steps`: :class:`SharedSteps`, the batched steps of an emulated batching engine that
  a :class:`WithLatency` model's sessions share (``dsi serve --synthetic-steps``);
- :mod:`~dsi.models.emulated.replay`: :class:`ReplayLM`, a real model's compute with another pair's
  recorded greedy decisions.

Numpy only (a replayed model builds its hf model lazily, the one import of a backend here). No backend
imports this package.
"""

from dsi.models.emulated.callable import CallableLM
from dsi.models.emulated.latency import WithLatency
from dsi.models.emulated.replay import ReplayLM, replay_pair
from dsi.models.emulated.synthetic import synthetic_pair

__all__ = ["CallableLM", "ReplayLM", "WithLatency", "replay_pair", "synthetic_pair"]
