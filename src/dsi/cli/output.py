"""Output helpers shared by the commands: aligned tables for people, JSON for scripts."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from dsi.errors import ConfigError


def check_output_file(path: str | None, flag: str = "--out") -> None:
    """Refuse, before any work, an output file that could not be written: a directory, or a file in
    a folder that does not exist or is not writable. None: no file asked for."""
    if path is None:
        return
    target = Path(path).expanduser()
    if target.is_dir():
        raise ConfigError(f"{flag}={path!r} is a directory; give a file name")
    folder = target.parent
    if not folder.is_dir():
        raise ConfigError(f"{flag}={path!r}: the folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ConfigError(f"{flag}={path!r} is not writable")


def check_input_file(path: str, flag: str) -> None:
    """Refuse, before any work, an input file that cannot be read: missing, a directory, unreadable."""
    source = Path(path).expanduser()
    if not source.exists():
        raise ConfigError(f"{flag}={path!r} does not exist")
    if not source.is_file():
        raise ConfigError(f"{flag}={path!r} is not a file")
    if not os.access(source, os.R_OK):
        raise ConfigError(f"{flag}={path!r} is not readable")


def _default(obj: Any) -> Any:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    raise TypeError(f"cannot serialise {type(obj).__name__} to JSON")


def dumps(obj: Any, indent: int | None = None) -> str:
    return json.dumps(obj, default=_default, indent=indent, ensure_ascii=False)


def print_json(obj: Any, stream: TextIO | None = None) -> None:
    """Print one JSON document (the only thing a ``--json`` command writes to stdout)."""
    print(dumps(obj), file=stream or sys.stdout, flush=True)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table; floats get 3 significant decimals."""

    def cell(value: Any) -> str:
        if isinstance(value, float | np.floating):
            return f"{value:.3f}"
        return str(value)

    text_rows = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text_rows)) if text_rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for r in text_rows:
        lines.append("  ".join(v.rjust(w) if _numeric(v) else v.ljust(w) for v, w in zip(r, widths, strict=True)))
    return "\n".join(lines)


def _numeric(text: str) -> bool:
    try:
        float(text.rstrip("x%"))
    except ValueError:
        return False
    return True
