"""Output helpers shared by the commands: aligned tables for people, JSON for scripts."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import numpy as np

from dsi.cli.args import input_file
from dsi.errors import ConfigError


def check_input_file(path: str, flag: str) -> None:
    """Refuse, before any work, an input file that cannot be read (:func:`dsi.cli.args.input_file`),
    for a flag that may also hold something else and so is checked after parsing (``demo --prompts``)."""
    try:
        input_file(path)
    except argparse.ArgumentTypeError as exc:
        message = str(exc)
        quoted = repr(path)
        shown = f"{flag}={message}" if message.startswith(quoted) else f"{flag}={quoted}: {message}"
        raise ConfigError(shown) from None


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
