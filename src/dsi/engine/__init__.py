"""Orchestration over abstract models and target pools: non-SI (ar), SI (si) and DSI (dsi).

The engine imports no model backend and no transport other than through their interfaces
(:mod:`dsi.models.base`, :mod:`dsi.transport.base`); the thread pool is built in
:mod:`dsi.engine.api`, whose :func:`~dsi.engine.api.build_decoder` builds a decoder of one of the
engine's methods. ``method="auto"`` lives above the engine, in :mod:`dsi.api`.
"""

from dsi.engine.api import Decoder, build_decoder, make_request
from dsi.engine.config import ENGINE_METHODS
from dsi.engine.request import GenerationAborted, Request
from dsi.engine.result import GenerationResult
from dsi.engine.stats import GenerationStats

__all__ = [
    "ENGINE_METHODS",
    "Decoder",
    "GenerationAborted",
    "GenerationResult",
    "GenerationStats",
    "Request",
    "build_decoder",
    "make_request",
]
