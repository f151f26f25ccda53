"""dsi.allocator: vocabulary-sized arrays come from the heap, not fresh mmaps, once the engine is built; the
environment can turn that off, and a bad value is refused. Each case runs in a fresh interpreter (the
settings are process-wide)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from dsi.errors import ConfigError

PROBE = textwrap.dedent("""
    import ctypes, json, sys
    import numpy as np

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2

    def mapped_bytes_for(make):
        before = libc.mallinfo2().hblkhd  # bytes in blocks served by their own mmap
        array = make()
        return libc.mallinfo2().hblkhd - before, array

    if sys.argv[1] == "tune":
        from dsi.allocator import tune_allocator
        applied = tune_allocator()
    else:  # build a decoder, as every command and the server do
        import dsi
        from dsi.allocator import tune_allocator
        from dsi.models.emulated.callable import CallableLM
        target = CallableLM(lambda context: np.zeros(8), 8)
        dsi.build_decoder(target=target, drafter=target, method="si", lookahead=2).close()
        applied = tune_allocator()
    law = 151_936 * 8  # one float64 law over Qwen's vocabulary
    mapped, _ = mapped_bytes_for(lambda: np.ones(law // 8))
    print(json.dumps({"applied": applied, "mapped": mapped, "law": law}))
""")


def _probe(mode: str, env_value: str | None) -> dict:
    env = dict(os.environ)
    env.pop("DSI_TUNE_ALLOCATOR", None)
    if env_value is not None:
        env["DSI_TUNE_ALLOCATOR"] = env_value
    proc = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("mode", ["tune", "build_decoder"])
def test_a_law_sized_array_comes_from_the_heap_once_tuned(mode):
    got = _probe(mode, None)
    assert got["applied"] is True
    assert got["mapped"] < got["law"]  # no mmap of its own


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("mode", ["tune", "build_decoder"])
def test_the_environment_turns_it_off(mode):
    got = _probe(mode, "0")
    assert got["applied"] is False
    assert got["mapped"] >= got["law"]  # glibc's default: a block this large is mmapped


def test_a_bad_environment_value_is_refused(monkeypatch):
    from dsi import allocator

    monkeypatch.setenv("DSI_TUNE_ALLOCATOR", "maybe")
    with pytest.raises(ConfigError, match=r"DSI_TUNE_ALLOCATOR='maybe' must be 1 .* or 0"):
        allocator.wanted()
    monkeypatch.setenv("DSI_TUNE_ALLOCATOR", " Off ")
    assert allocator.wanted() is False
    monkeypatch.delenv("DSI_TUNE_ALLOCATOR")
    assert allocator.wanted() is True


@pytest.mark.parametrize("library", ["none to open", "not glibc"])
def test_another_c_library_is_left_alone(monkeypatch, library):
    from dsi import allocator

    calls = []

    class Musl:  # has mallopt, but not glibc's own symbol
        def mallopt(self, *args):
            calls.append(args)
            return 1

    def cdll(name):
        if library == "none to open":
            raise TypeError("expected a library name")  # ctypes.CDLL(None) on Windows
        return Musl()

    monkeypatch.setattr(allocator.ctypes, "CDLL", cdll)
    assert allocator._mallopt(((allocator.M_MMAP_THRESHOLD, allocator.MMAP_THRESHOLD),)) is False
    assert calls == []
