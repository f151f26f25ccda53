"""``dsi serve``: an OpenAI-compatible HTTP server over DSI decoders (FastAPI + uvicorn).

Modules: :mod:`~dsi.server.app` (the app factory and endpoints), :mod:`~dsi.server.protocol`
(the OpenAI request / response models), :mod:`~dsi.server.scheduler` (engine slots and the
bounded FIFO queue), :mod:`~dsi.server.jobs` (one request between the event loop and a slot
thread: streaming, stop strings, cancellation), :mod:`~dsi.server.codec` (tokenizer side),
:mod:`~dsi.server.metrics` (Prometheus), :mod:`~dsi.server.config` (the settings),
:mod:`~dsi.server.limits` (body size, content type), :mod:`~dsi.server.prepare` (parsing,
validation and tokenisation off the event loop). Needs the ``server`` extra (fastapi, uvicorn,
prometheus_client); importing this package imports them.
"""

from dsi.server.app import create_app
from dsi.server.config import ServeConfig

__all__ = ["ServeConfig", "create_app"]
