"""Every program of benchmarks/ runs its dry run here (tiny models, a few tokens: benchmarks/_common.py), so that
none rots between the rare real runs; each test checks what the program's JSON report says."""

from __future__ import annotations

import math


def positive(value) -> bool:
    """A finite number above 0 (a time, a rate, a ratio of them)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
