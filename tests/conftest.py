"""Shared test helpers: small deterministic models, a latency-jitter wrapper, exact laws."""

from __future__ import annotations

import itertools
import os
import random
import sys
import threading
import time

import numpy as np
import pytest

from dsi.models import CallableLM
from dsi.models.emulated.synthetic import SyntheticTarget
from dsi.sampling import Prefix, SamplingParams, process_logits


@pytest.fixture(autouse=True, scope="session")
def _autotune_choices_in_a_temporary_directory(tmp_path_factory):
    """method="auto" caches its choices; tests keep them out of the user's cache."""
    saved = os.environ.get("DSI_AUTOTUNE_DIR")
    os.environ["DSI_AUTOTUNE_DIR"] = str(tmp_path_factory.mktemp("autotune"))
    yield
    if saved is None:
        os.environ.pop("DSI_AUTOTUNE_DIR", None)
    else:
        os.environ["DSI_AUTOTUNE_DIR"] = saved


@pytest.fixture(autouse=True)
def _torch_threads_as_they_were():
    """A test that sets torch's intra-op thread count leaves it as it found it: later tests' forwards (their
    rounding on some kernels, their timings) must not depend on the order tests run in. (Test modules import torch
    as they are collected, so the count before the first test is known.)"""
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    yield
    if before is not None and torch.get_num_threads() != before:
        torch.set_num_threads(before)


class Jitter:
    """Wrap a model so every forward sleeps a random time in [0, max_s] (seeded per session)."""

    def __init__(self, model, max_s: float, seed: int = 0) -> None:
        self.model = model
        self.max_s = max_s
        self._seeds = itertools.count(seed * 1000)
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def wrapped_model(self):
        """The model whose forwards this one passes on (what it costs, where it runs)."""
        return self.model

    def new_session(self):
        with self._lock:
            seed = next(self._seeds)
        return _JitterSession(self.model.new_session(), self.max_s, random.Random(seed))


class _JitterSession:
    def __init__(self, inner, max_s, rng):
        self._inner, self._max_s, self._rng = inner, max_s, rng

    @property
    def tokens(self):
        return self._inner.tokens

    def extend(self, tokens, cancel=None):
        time.sleep(self._rng.uniform(0.0, self._max_s))
        return self._inner.extend(tokens, cancel)

    def truncate(self, length):
        self._inner.truncate(length)

    def close(self):
        self._inner.close()


def random_lm(vocab_size: int, seed: int, sharpness: float = 1.0) -> CallableLM:
    """A model whose logits are a seeded pseudo-random function of the whole context."""
    return CallableLM(SyntheticTarget(vocab_size, seed, sharpness), vocab_size, name=f"random(seed={seed})")


def exact_sequence_law(model, prompt, length: int, params: SamplingParams,
                       stops: frozenset[int] = frozenset()) -> dict:
    """P(next ``length`` tokens = y) for every y, from the model's processed distributions (each
    row processed with the tokens before it); a sequence ends early at a token of ``stops``. ``model``: one with
    ``next_logits(context)`` (a :class:`CallableLM`), or any language model (its rows from one session)."""
    if hasattr(model, "next_logits"):
        return _exact_sequence_law(model.next_logits, prompt, length, params, stops)
    from dsi.models.base import forward_rows

    session = model.new_session()
    try:
        return _exact_sequence_law(lambda context: np.asarray(forward_rows(session, list(context), 1)[-1]), prompt,
                                   length, params, stops)
    finally:
        session.close()


def _exact_sequence_law(next_logits, prompt, length: int, params: SamplingParams, stops: frozenset[int]) -> dict:
    law = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for seq, prob in law.items():
            if seq and seq[-1] in stops:
                nxt[seq] = prob
                continue
            context = tuple(prompt) + seq
            p = process_logits(next_logits(context), params, Prefix(context, len(prompt), stops))
            p = p / p.sum(dtype=np.float64)  # the float32 law, summing to 1 in float64 (the expected counts')
            for token in np.flatnonzero(p):
                nxt[seq + (int(token),)] = prob * p[token]
        law = nxt
    return law


class HandOverSchedule:
    """A load chooser (the interface of :class:`dsi.server.load_choice.LoadChooser`) that starts request i the way
    ``plans[i % len(plans)]`` says and hands it over once at most ``at`` tokens are left. The default plans hand
    over both ways, speculative to plain and plain to speculative, after one and after two tokens."""

    PLANS = (("speculative", 2), ("plain", 2), ("speculative", 1), ("plain", 1))

    def __init__(self, plans=PLANS) -> None:
        self.plans, self.calls, self.at = tuple(plans), 0, 0

    def choose(self, running):
        from dsi.server.load_choice import Pick

        way, self.at = self.plans[self.calls % len(self.plans)]
        self.calls += 1
        return Pick(way, running, 1, "test", {})

    def handoff(self, way, running, tokens, rate, remaining, bursts=0):
        return "scheduled" if remaining <= self.at else None

    def record_rate(self, *args) -> None:
        pass


@pytest.fixture
def one_torch_thread():
    """Torch on one intra-op thread for the test (HF tests: reproducible and no oversubscription)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def no_thread_leak():
    """Fail if a dsi worker thread is still alive after the test."""
    yield
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        alive = [t.name for t in threading.enumerate() if t.name.startswith("dsi-") and t.is_alive()]
        if not alive:
            return
        time.sleep(0.01)
    pytest.fail(f"leaked threads: {alive}")


def interval_law(fn, cdf_points):
    """Exact law of fn(u) for u ~ U[0,1) when fn is constant between consecutive cdf_points."""
    points = np.unique(np.clip(np.concatenate([[0.0, 1.0], cdf_points]), 0.0, 1.0))
    law = {}
    for lo, hi in zip(points[:-1], points[1:], strict=True):
        if hi > lo:
            out = fn((lo + hi) / 2)
            law[out] = law.get(out, 0.0) + (hi - lo)
    return law


# ---- what the run computes on ------------------------------------------------------------------------------

CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def _cpu_line() -> str:
    """The CPU's model, vendor, cores and the flags that pick BLAS and ggml kernels (1: present, 0: absent)."""
    import platform

    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    shown = " ".join(f"{flag}={int(flag in flags)}" for flag in CPU_FLAGS) if flags else "flags unknown"
    model = info.get("model name") or platform.processor() or platform.machine()
    return f"cpu: {model} ({info.get('vendor_id', 'vendor unknown')}), {os.cpu_count()} cores; {shown}"


def _torch_line() -> str | None:
    import importlib.util
    import re

    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    config = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=(\w+)", config)
    mkl = re.search(r"Math Kernel Library Version ([\w.]+)", config)
    onednn = re.search(r"MKL-DNN (v[\w.]+)", config)
    capability = re.search(r"CPU capability usage: (\w+)", config)
    backend = re.search(r"ATen parallel backend: (\w+)", torch.__config__.parallel_info())
    return (f"torch {torch.__version__}: BLAS {blas.group(1) if blas else '?'}"
            f"{f' (MKL {mkl.group(1)})' if mkl else ''}, oneDNN {onednn.group(1) if onednn else 'no'}, "
            f"CPU capability {capability.group(1) if capability else '?'}, {backend.group(1) if backend else '?'} "
            f"backend, {torch.get_num_threads()} intra-op threads; MKL_CBWR={os.environ.get('MKL_CBWR', 'unset')}")


def _llama_cpp_line() -> str | None:
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return None
    try:
        import llama_cpp

        return f"llama.cpp {llama_cpp.__version__}: {llama_cpp.llama_print_system_info().decode().strip(' |')}"
    except Exception as exc:  # noqa: BLE001 - a header never stops the run
        return f"llama.cpp: system info unavailable ({type(exc).__name__}: {exc})"


def pytest_report_header(config):
    """The CPU kind and the kernels' libraries, printed once at the start: some numbers in these tests are
    the CPU's (MKL's fp32 products and ggml's repacked kernels round differently on AMD and Intel), so a
    failure report says where it ran."""
    return [line for line in (_cpu_line(), _torch_line(), _llama_cpp_line()) if line]
