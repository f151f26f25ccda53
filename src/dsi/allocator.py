"""The C allocator's settings for vocabulary-sized arrays: process-wide, glibc only.

A sampled request turns every drafted token's logits, and every verified row it reads, into a law over
the whole vocabulary (Qwen's 151,936 ids: 1.2 MB in float64), and ranks and draws from it. glibc serves
an allocation that large with a fresh ``mmap`` (its threshold starts at 128 KiB and rises only to the
size of a block once freed) and hands freed heap memory back to the system past its trim threshold
(twice that). Either way the next such array starts on fresh pages, and faulting them in costs as much
as the arithmetic: on this project's 2-core machine a law made step by step took 1.2 ms with the
defaults and 0.5 ms with the settings below (docs/results-log.md#2026-12-04).

:func:`tune_allocator` keeps such blocks in the heap (``M_MMAP_THRESHOLD`` at 32 MiB, the ceiling glibc's
own dynamic threshold may reach) and keeps up to 256 MiB of freed heap for reuse (``M_TRIM_THRESHOLD``):
a process serving a model holds far more than that already. The engine's builder and every target
server call it once per process; ``DSI_TUNE_ALLOCATOR=0`` in the environment leaves the allocator as it
is. Other C libraries (musl) are left alone.
"""

from __future__ import annotations

import ctypes
import os
import threading

from dsi.errors import ConfigError

ENV = "DSI_TUNE_ALLOCATOR"
M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # blocks below this come from the heap (glibc's DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)
TRIM_THRESHOLD = 256 << 20  # freed heap kept for reuse, up to this

_OFF = ("0", "false", "no", "off")
_ON = ("", "1", "true", "yes", "on")
_lock = threading.Lock()
_applied: bool | None = None


def wanted() -> bool:
    """Whether the environment lets :func:`tune_allocator` act (``DSI_TUNE_ALLOCATOR``, on when unset)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    raise ConfigError(f"{ENV}={os.environ[ENV]!r} must be 1 (tune the C allocator for vocabulary-sized arrays, "
                      "the default) or 0 (leave it as it is)")


def tune_allocator() -> bool:
    """Apply the settings once per process; True when they are in force (False: turned off by
    ``DSI_TUNE_ALLOCATOR=0``, or a C library other than glibc)."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = wanted() and _mallopt(((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
        return _applied


def _mallopt(settings: tuple[tuple[int, int], ...]) -> bool:
    try:
        libc = ctypes.CDLL(None)  # the C library this process runs on
        libc.gnu_get_libc_version  # noqa: B018 (glibc's own symbol: mallopt's parameters are glibc's)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # no C library to open by None (Windows), or not glibc's
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return all(mallopt(parameter, value) == 1 for parameter, value in settings)
