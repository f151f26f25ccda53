"""dsi: Distributed Speculative Inference (Timor et al., ICLR 2025).

Lossless LLM decoding in which a drafter drafts without waiting while a pool of target servers
verifies overlapping draft windows in parallel. Public API::

    import dsi
    result = dsi.generate(target=..., drafter=..., prompt=[...], max_new_tokens=64)
    result.tokens, result.stats.acceptance_rate

    with dsi.build_decoder(target=..., drafter=...) as decoder:   # workers that stay up
        result = decoder.generate(dsi.Request([...], max_new_tokens=64))
"""

from dsi.api import build_decoder, generate, make_request
from dsi.engine.config import DecoderConfig
from dsi.engine import GenerationAborted, GenerationResult, GenerationStats, Request
from dsi.errors import (
    ConfigError,
    ContextLengthError,
    DecoderClosed,
    DSIError,
    ModelError,
    VocabularyMismatchError,
    WorkerError,
)
from dsi.constraints import Constraint
from dsi.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "ContextLengthError",
    "DecoderConfig",
    "DSIError",
    "DecoderClosed",
    "GenerationAborted",
    "GenerationResult",
    "GenerationStats",
    "ModelError",
    "Request",
    "SamplingParams",
    "Constraint",
    "VocabularyMismatchError",
    "WorkerError",
    "build_decoder",
    "generate",
    "make_request",
]
