"""Model backends behind one session interface (:mod:`dsi.models.base`).

``CallableLM`` and ``WithLatency`` need only numpy; the Hugging Face backend
(:mod:`dsi.models.hf`) is imported lazily because it needs torch.
"""

from dsi.models.base import LanguageModel, ModelSession, common_prefix_length, forward_rows
from dsi.models.callable import CallableLM
from dsi.models.latency import WithLatency
from dsi.models.synthetic import synthetic_pair

__all__ = [
    "CallableLM",
    "LanguageModel",
    "ModelSession",
    "WithLatency",
    "common_prefix_length",
    "forward_rows",
    "synthetic_pair",
]
