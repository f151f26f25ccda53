"""Model backends behind one session interface (:mod:`dsi.models.base`).

``CallableLM``, ``WithLatency`` and ``ReplayLM`` need only numpy; the Hugging Face backend
(:mod:`dsi.models.hf`) is imported lazily because it needs torch.
"""

from dsi.models.base import LanguageModel, ModelSession, common_prefix_length, extend_rows, forward_rows
from dsi.models.callable import CallableLM
from dsi.models.latency import WithLatency
from dsi.models.replay import ReplayLM, replay_pair
from dsi.models.synthetic import synthetic_pair

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
