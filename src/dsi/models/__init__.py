"""Models behind one session interface (:mod:`dsi.models.base`), grouped by concern.

At the top, what every model shares:

- :mod:`~dsi.models.base`: the interface (``LanguageModel`` hands out sessions; a ``ModelSession`` is one
  token sequence with its cache), :mod:`~dsi.models.costs` (what a forward costs by its rows) and
  :mod:`~dsi.models.determinism` (rows as a function of the tokens alone);
- where a model comes from, whatever runs it: :mod:`~dsi.models.sources` (a MODEL string),
  :mod:`~dsi.models.embedded` (the embedded pair's GGUF files), :mod:`~dsi.models.cache`;
- :mod:`~dsi.models.loading`: ``load_model`` / ``load_pair``, the one module that picks a backend.

The backends: :mod:`~dsi.models.llamacpp` (a GGUF run by llama.cpp) and :mod:`dsi.models.hf` (transformers,
torch). Around them, each a subpackage whose docstring says what it owns:

- :mod:`dsi.models.engines`: targets and drafters served by engines over HTTP (vLLM, ``dsi serve``);
- :mod:`dsi.models.vocab`: a drafter with another tokenizer, bridged to the target's vocabulary;
- :mod:`dsi.models.emulated`: callable, synthetic, latency-emulated and replayed models.

Imports go one way: a backend imports the interface and the sources, never the engines, the bridge or the
emulated models. The names below need only numpy; the hf backend is imported lazily because it needs torch.
"""

from dsi.models.base import LanguageModel, ModelSession, common_prefix_length, extend_rows, forward_rows
from dsi.models.emulated import CallableLM, ReplayLM, WithLatency, replay_pair, synthetic_pair

__all__ = [
    "CallableLM",
    "LanguageModel",
    "ModelSession",
    "ReplayLM",
    "WithLatency",
    "common_prefix_length",
    "extend_rows",
    "forward_rows",
    "replay_pair",
    "synthetic_pair",
]
