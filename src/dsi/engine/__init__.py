"""Orchestration over abstract models and target pools: non-SI (ar), SI (si) and DSI (dsi).

The engine imports no model backend and no transport other than through their interfaces
(:mod:`dsi.models.base`, :mod:`dsi.transport.base`); the thread pool is built in
:mod:`dsi.engine.api`.
"""

from dsi.engine.api import build_decoder, generate, make_request
from dsi.engine.request import GenerationAborted, Request
from dsi.engine.result import GenerationResult
from dsi.engine.stats import GenerationStats

__all__ = [
    "GenerationAborted",
    "GenerationResult",
    "GenerationStats",
    "Request",
    "build_decoder",
    "generate",
    "make_request",
]
