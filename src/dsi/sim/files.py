"""Output files of the simulator commands: a writable folder, CSV tables, a lazy matplotlib."""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from dsi.errors import ConfigError


def prepare_out_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` (and parents) if needed; :class:`ConfigError` unless it is a writable folder."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"output directory {str(out)!r} is not a directory") from None
    except OSError as exc:
        raise ConfigError(f"output directory {str(out)!r} cannot be created: {exc.strerror or exc}") from None
    if not out.is_dir():
        raise ConfigError(f"output directory {str(out)!r} is not a directory")
    if not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"output directory {str(out)!r} is not writable")
    return out


def write_csv(path: Path, rows: Sequence[Mapping[str, object]]) -> Path:
    """Write dict rows (same keys, in order) as CSV; floats with full precision."""
    if not rows:
        raise ConfigError(f"nothing to write to {path}")
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def figure_class():
    """matplotlib's ``Figure`` (no pyplot, no global backend change), or an error naming the extra."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError(
            "plotting needs matplotlib: pip install 'dsi[plot]' (or pass --no-plot for CSV only)"
        ) from None
    return Figure
