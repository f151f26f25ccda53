"""``--backend``, ``--dtype``, ``--device``, ``--threads`` and the hf backend's cache and graphs: which engine runs
the models and how, shared by
``dsi generate``, ``demo``, ``serve``, ``measure`` and ``selftest``.

A thin layer over :func:`dsi.models.loading.choose_backend`: the CLI resolves the backend once
(from the models, the devices of the drafter and of the target servers, and an explicit
``--dtype``) so it can say which one runs and why. ``--dtype`` and ``--device`` default to unset,
which is what lets ``--backend auto`` pick llama.cpp for GGUF models on the CPU.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from dsi.cli.args import Number
from dsi.errors import ConfigError
from dsi.models.loading import BACKEND_CHOICES, BackendChoice

THREADS = Number(int, 1, 512)  # per worker; 512 is ggml's GGML_MAX_N_THREADS (llama.cpp refuses more)


def add_backend_args(g: argparse._ArgumentGroup | argparse.ArgumentParser, threads_help: str | None = None) -> None:
    g.add_argument("--backend", choices=BACKEND_CHOICES, default="auto",
                   help="engine that runs the models: hf (transformers, torch), llama.cpp (reads GGUF files as "
                        "they are; CPU only) or auto (default): llama.cpp for GGUF models and the embedded pair "
                        "on the CPU when llama-cpp-python is installed, otherwise hf (docs/models.md)")
    g.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default=None,
                   help="weights dtype of the hf backend (default bf16); llama.cpp runs the GGUF's own weights, so "
                        "setting it makes --backend auto pick hf")
    g.add_argument("--device", default=None,
                   help="device of the models the command loads: cpu (default), cuda or cuda:N (hf only; "
                        "asking for cuda makes --backend auto pick hf)")
    g.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="compute every token in a forward of its own, so that outputs depend on the tokens alone "
                        "(greedy SI/DSI equal to non-SI bit for bit, a seed always gives the same text, for DSI "
                        "too); default off: it cuts verification forwards into single tokens (costs measured in "
                        "docs/results.md#what-the-mode-costs; docs/architecture.md, 'Deterministic inference')")
    g.add_argument("--max-model-len", "--n-ctx", dest="max_model_len", type=Number(int, 2), default=None, metavar="N",
                   help="the most tokens a session holds: llama.cpp's KV cells (default: the GGUF's training "
                        "context, at most 4096), or the hf backend's static cache (--kv-cache static; default: "
                        "the model's context, at most 4096); a dynamic hf cache holds the model's whole context")
    g.add_argument("--kv-cache", choices=["dynamic", "static"], default=None,
                   help="hf: each session's KV cache: dynamic (default: grows, cropped on a rollback) or static "
                        "(preallocated to --max-model-len positions; a rollback moves a position; what CUDA graphs "
                        "replay) (docs/models.md, 'Static cache and CUDA graphs')")
    g.add_argument("--cuda-graphs", action="store_true",
                   help="hf on a CUDA device: capture each forward's padded shape as a CUDA graph (implies --kv-cache "
                        "static); elsewhere the forwards run eagerly, and it says so once")
    g.add_argument("--threads", type=THREADS, default=None,
                   help=threads_help or "threads per worker (drafter and each target server): torch's intra-op "
                                        "threads (hf) or llama.cpp's threads per session; default: the backend's")


def devices_of(args: argparse.Namespace) -> list[str | None]:
    """Every device the run places a model on: ``--device`` and each ``--target-devices`` entry."""
    extra = [d.strip() for d in (getattr(args, "target_devices", None) or "").split(",") if d.strip()]
    return [getattr(args, "device", None), *extra]


def choose(args: argparse.Namespace, specs: Sequence[str]) -> BackendChoice:
    """The backend for the MODELs ``specs`` with the options in ``args`` (ConfigError if impossible)."""
    from dsi.models.loading import choose_backend
    from dsi.models.sources import resolve_source

    return choose_backend([resolve_source(s) for s in specs], args.backend, devices=devices_of(args),
                          dtype=args.dtype)


def hf_dtype(args: argparse.Namespace, default: str = "bf16") -> str:
    """The dtype the hf backend runs with: ``--dtype``, else ``default``."""
    return args.dtype or default


def describe(backend: str, args: argparse.Namespace, hf_default: str = "bf16") -> str:
    """A short phrase for reports: ``llama.cpp (GGUF weights) on cpu`` or ``hf bf16 on cpu``."""
    if backend == "llama.cpp":
        return "llama.cpp (GGUF weights) on cpu"
    return f"hf {hf_dtype(args, hf_default)} on {args.device or 'cpu'}"


def _kv_cache(args: argparse.Namespace) -> str | None:
    """``--kv-cache``, with ``--cuda-graphs`` implying static (a dynamic one with graphs is refused)."""
    kv_cache = getattr(args, "kv_cache", None)
    if getattr(args, "cuda_graphs", False):
        if kv_cache == "dynamic":
            raise ConfigError("--cuda-graphs replays fixed buffers: it needs --kv-cache static (the default with it)")
        return "static"
    return kv_cache


def max_model_len(args: argparse.Namespace) -> int | None:
    """``--max-model-len`` as llama.cpp's ``n_ctx`` (parsed as an integer >= 2), checked against the backend:
    None where it sizes the hf backend's static cache instead (:func:`forward_plan`)."""
    value = getattr(args, "max_model_len", None)
    choice = getattr(args, "backend_choice", None)
    if value is not None and choice is not None and choice.backend != "llama.cpp":
        if _kv_cache(args) == "static":
            return None
        raise ConfigError(f"--max-model-len={value} sizes llama.cpp's KV cells or the hf backend's static cache "
                          f"(--kv-cache static); the {choice.backend} backend was chosen ({choice.reason}) with a "
                          "dynamic cache, which holds the model's whole context")
    return value


def forward_plan(args: argparse.Namespace):
    """The hf backend's :class:`~dsi.models.hf.forward_plan.ForwardPlan` from ``--kv-cache``, ``--cuda-graphs`` and
    ``--max-model-len``; None for llama.cpp (which refuses these options) or when none is given."""
    kv_cache = _kv_cache(args)
    graphs = bool(getattr(args, "cuda_graphs", False))
    choice = getattr(args, "backend_choice", None)
    if kv_cache is None:
        return None
    if choice is not None and choice.backend != "hf":
        raise ConfigError(f"--kv-cache and --cuda-graphs apply to the hf backend; {choice.backend} was chosen "
                          f"({choice.reason}): pass --backend hf")
    from dsi.models.hf.forward_plan import ForwardPlan

    length = getattr(args, "max_model_len", None) if kv_cache == "static" else None
    return ForwardPlan(kv_cache, length, graphs)
