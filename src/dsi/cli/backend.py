"""``--backend``, ``--dtype``, ``--device`` and ``--threads``: which engine runs the models, shared by
``dsi generate``, ``demo``, ``serve``, ``measure`` and ``selftest``.

A thin layer over :func:`dsi.models.loading.choose_backend`: the CLI resolves the backend once
(from the models, the devices of the drafter and of the target servers, and an explicit
``--dtype``) so it can say which one runs and why. ``--dtype`` and ``--device`` default to unset,
which is what lets ``--backend auto`` pick llama.cpp for GGUF models on the CPU.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from dsi.cli.args import COUNT, Number
from dsi.errors import ConfigError
from dsi.models.loading import BACKEND_CHOICES, BackendChoice


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
                        "docs/results.md section 11; docs/architecture.md, 'Deterministic inference')")
    g.add_argument("--max-model-len", "--n-ctx", dest="max_model_len", type=Number(int, 2), default=None, metavar="N",
                   help="llama.cpp: the most tokens a session holds (its KV cells; default: the GGUF's training "
                        "context, at most 4096); the hf backend uses the model's own context length")
    g.add_argument("--threads", type=COUNT, default=None,
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


def max_model_len(args: argparse.Namespace) -> int | None:
    """``--max-model-len`` (llama.cpp's ``n_ctx``; parsed as an integer >= 2), checked against the backend."""
    value = getattr(args, "max_model_len", None)
    choice = getattr(args, "backend_choice", None)
    if value is not None and choice is not None and choice.backend != "llama.cpp":
        raise ConfigError(f"--max-model-len={value} applies to the llama.cpp backend; the {choice.backend} backend "
                          f"was chosen ({choice.reason}) and uses the model's own context length")
    return value
