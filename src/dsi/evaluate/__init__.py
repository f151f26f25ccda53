"""Tools built on top of the engine: they run decoders, time them, and judge or choose.

- :mod:`dsi.evaluate.autotune`: ``method="auto"``: measure non-SI, SI and DSI where the workers
  will run, predict every candidate with the event simulator, pick and cache the fastest;
- :mod:`dsi.evaluate.compare`: non-SI vs SI vs DSI on the same prompts (``dsi demo``, benchmarks);
- :mod:`dsi.evaluate.bench`: the engine's wall clock against the simulator's ideal on
  emulated-latency synthetic pairs (``dsi bench``);
- :mod:`dsi.evaluate.selftest`: losslessness checks for any model pair (``dsi selftest``).

They import the engine (:mod:`dsi.engine`), the models and the simulator, never the public entry
:mod:`dsi.api` (which imports :mod:`dsi.evaluate.autotune` for ``method="auto"``) nor the server or
the CLI. Nothing here is imported by ``import dsi``.
"""
