"""The dsi cache directory and its completion markers.

The bottom of the model-loading modules: :mod:`dsi.models.embedded` (the embedded pair's GGUF
files), :mod:`dsi.models.hf.checkpoint` (GGUF files converted for the Hugging Face backend) and
:mod:`dsi.evaluate.autotune` (cached method choices) keep their files under :func:`cache_dir`. A directory
or file whose work finished carries a small JSON marker written last, so an interrupted build
never looks finished. Imports nothing of dsi but the errors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

MARKER = "dsi-model.json"  # written last into a converted directory; its presence means "complete"


def cache_dir() -> Path:
    """The dsi cache: ``$DSI_CACHE_DIR``, else ``$XDG_CACHE_HOME/dsi``, else ``~/.cache/dsi``."""
    if os.environ.get("DSI_CACHE_DIR"):
        return Path(os.environ["DSI_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "dsi"
    return Path.home() / ".cache" / "dsi"


def read_marker(model_dir: Path) -> dict[str, Any] | None:
    """The marker of a converted directory, or None if the conversion never finished."""
    return read_json(Path(model_dir) / MARKER)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``, or None if it is missing or unreadable."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
