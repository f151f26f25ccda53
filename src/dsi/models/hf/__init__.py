"""The Hugging Face backend: any transformers causal LM behind the session interface.

Owns four modules, one concern each:

- :mod:`~dsi.models.hf.model`: :class:`HFModel` and its sessions (a transformers cache each, cancellation
  inside a forward, devices, dtypes, replicas, the tokenizer helpers);
- :mod:`~dsi.models.hf.forward_plan`: the fast forward path (:class:`ForwardPlan`: a static KV cache,
  padded shapes, captured CUDA graphs);
- :mod:`~dsi.models.hf.device_laws`: a verification's decisions, draws and logprobs read on the device;
- :mod:`~dsi.models.hf.checkpoint`: the checkpoint directory a MODEL loads from (a GGUF converted once).
  It needs no torch.

A backend: it imports the interface (:mod:`dsi.models.base`) and where models come from, never the
engines over HTTP, the vocabulary bridge or the emulated models. ``HFModel`` and ``ForwardPlan`` are
imported from here lazily, so that importing this package (or its checkpoint module) loads no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"HFModel": "dsi.models.hf.model", "ForwardPlan": "dsi.models.hf.forward_plan"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
