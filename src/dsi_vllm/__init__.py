"""dsi's code that runs inside an inference engine's own environment (vLLM's), where dsi itself is not installed.

- :mod:`dsi_vllm.noise`: the keyed Gumbel noise of coupled draws (:mod:`dsi.coupling`), the same bits in numpy
  (dsi) and torch (the engine);
- :mod:`dsi_vllm.processor`: a vLLM logits processor that makes a sampled request's draw inside the engine, so a
  verification answers each row with one token (docs/engines.md).

Nothing here imports dsi or its dependencies: install dsi into the engine's environment without them
(``pip install --no-deps dsi``, or a checkout's ``src`` on its ``PYTHONPATH``) and start vLLM with
``--logits-processors dsi_vllm.processor:CoupledDraws``.
"""
