"""The per-request arguments (``vllm_xargs``) by which dsi asks an engine running :mod:`dsi_vllm.processor` for a
coupled draw: shared by the processor (:mod:`dsi_vllm.draws`) and dsi's engine client (``dsi.models.engines.draws``).

- ``dsi_seed``: the request's seed, an integer in [0, 2**63); its presence asks for a draw;
- ``dsi_temperature`` (> 0, default 1), ``dsi_top_k`` (integer >= 0, 0: off), ``dsi_top_p`` (in (0, 1], default 1),
  ``dsi_min_p`` (in [0, 1], default 0): the processing of the law drawn from;
- ``dsi_probe``: a token id the processor answers with, instead of a draw (how dsi finds out that it runs).
"""

SEED, TEMPERATURE, TOP_K, TOP_P, MIN_P, PROBE = ("dsi_seed", "dsi_temperature", "dsi_top_k", "dsi_top_p",
                                                 "dsi_min_p", "dsi_probe")
