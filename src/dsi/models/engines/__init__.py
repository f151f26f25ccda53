"""Models served by inference engines over HTTP: vLLM's OpenAI server, or another ``dsi serve``.

- :mod:`~dsi.models.engines.target`: :class:`EngineTarget`, a target whose rows the engines compute
  (``prompt_logprobs``), one target server per engine;
- :mod:`~dsi.models.engines.prefixes`: the same rows read from a vLLM engine's prefix cache, as one batch of
  prefixes, where that computes less;
- :mod:`~dsi.models.engines.draws`: sampled rows drawn inside vLLM by dsi_vllm's processor, answered as tokens;
- :mod:`~dsi.models.engines.streams`: one streamed completion, read token by token;
- :mod:`~dsi.models.engines.generation`: plain decoding through the engines' own generation (a stream a request);
- :mod:`~dsi.models.engines.drafter`: :class:`EngineDrafter`, a drafter whose tokens one engine streams;
- :mod:`~dsi.models.engines.scoring_channel`: the binary scoring channel a ``dsi serve`` offers beside
  HTTP (rows as arrays, not JSON).

Both keep the tokenizer local (a local copy of the model, or its tokenizer) and send token ids. They
import the interface only: no backend, no vocabulary bridge, no emulated model.
"""

from dsi.models.engines.drafter import EngineDrafter, drafter_engine
from dsi.models.engines.scoring_channel import ScoringChannel
from dsi.models.engines.target import EngineTarget, wait_until_serving

__all__ = ["EngineDrafter", "EngineTarget", "ScoringChannel", "drafter_engine", "wait_until_serving"]
