"""Loading a MODEL (or a target/drafter pair) with a backend: Hugging Face transformers or llama.cpp.

Where a model comes from (an embedded short name, a directory, a ``.gguf`` file, a hub id) is
resolved by :mod:`dsi.models.sources`, the same for every backend. This module only picks the
engine that runs it and calls that backend's loader:

- ``backend="hf"``: :meth:`dsi.models.hf.model.HFModel.load` (torch; any checkpoint; a GGUF is
  converted once to safetensors);
- ``backend="llama.cpp"``: :meth:`dsi.models.llamacpp.LlamaCppModel.load` (the
  ``llama-cpp-python`` binding; reads a GGUF as it is; CPU only);
- ``backend="auto"`` (the default): :func:`choose_backend`.

**The rule of ``auto``** (docs/models.md, "The llama.cpp backend"): llama.cpp when every model of
the pair is a GGUF (a ``.gguf`` file, a directory holding only one, or the embedded pair),
everything runs on the CPU (no device other than ``cpu`` asked for), no ``dtype`` was asked for
(llama.cpp runs the GGUF's own weights) and the binding is installed; otherwise hf. So a
transformers checkpoint or a hub id, a CUDA device, or an explicit dtype gives hf.

Impossible combinations are :class:`~dsi.errors.ConfigError` saying what is allowed. No backend is
imported at module level, so the CLI can import this cheaply.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dsi.errors import ConfigError, ModelError, VocabularyMismatchError
from dsi.models.determinism import check_deterministic
from dsi.models.sources import ModelSource, gguf_file, resolve_source

if TYPE_CHECKING:  # torch is imported only when the hf backend loads
    from dsi.models.hf.forward_plan import ForwardPlan

logger = logging.getLogger(__name__)

BACKENDS = ("hf", "llama.cpp")
BACKEND_CHOICES = ("auto", *BACKENDS)
BINDING = "llama_cpp"  # the module of the llama-cpp-python distribution
INSTALL_LLAMA = "pip install 'dsi[llama]'"


def binding_available() -> bool:
    """True if the llama.cpp binding can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec(BINDING) is not None
    except (ImportError, ValueError):
        return False


def check_backend(backend: str) -> str:
    """``backend`` if it is one of :data:`BACKEND_CHOICES`, else :class:`ConfigError`."""
    if backend not in BACKEND_CHOICES:
        raise ConfigError(f"backend={backend!r} must be one of {', '.join(BACKEND_CHOICES)}")
    return backend


def _on_cpu(device: object) -> bool:
    return device is None or str(device).strip().lower() == "cpu"


@dataclass(frozen=True)
class BackendChoice:
    """The backend that runs a model (or a pair), and why (shown in logs and the CLI)."""

    backend: str
    reason: str


def choose_backend(
    sources: Sequence[ModelSource],
    backend: str = "auto",
    *,
    devices: Sequence[str | None] = (),
    dtype: str | None = None,
    binding: bool | None = None,
) -> BackendChoice:
    """The backend for ``sources`` (one model, or a target and a drafter) placed on ``devices``.

    ``backend="hf"`` or ``"llama.cpp"`` is checked against the sources and options; ``"auto"``
    follows the rule in the module docstring. ``binding`` says whether the llama.cpp binding is
    installed (default: :func:`binding_available`); tests pass it.
    """
    check_backend(backend)
    if binding is None:
        binding = binding_available()
    if backend == "hf":
        return BackendChoice("hf", "asked for")
    if backend == "llama.cpp":
        check_llamacpp(sources, devices=devices, dtype=dtype, binding=binding)
        return BackendChoice("llama.cpp", "asked for")
    off_cpu = [str(d) for d in devices if not _on_cpu(d)]
    if off_cpu:
        return BackendChoice("hf", f"device {off_cpu[0]} asked for (the llama.cpp backend runs on the CPU only)")
    if dtype is not None:
        return BackendChoice("hf", f"dtype={dtype!r} asked for (llama.cpp runs the GGUF's own weights)")
    no_gguf = [s for s in sources if s.kind not in ("embedded", "gguf")]
    if no_gguf:
        return BackendChoice("hf", f"{no_gguf[0].describe()} is a transformers checkpoint")
    if not binding:
        return BackendChoice("hf", f"GGUF models, but the llama.cpp binding is not installed ({INSTALL_LLAMA} "
                                   "for the faster CPU backend)")
    return BackendChoice("llama.cpp", "GGUF models on the CPU")


def check_llamacpp(
    sources: Sequence[ModelSource], *, devices: Sequence[str | None] = (), dtype: str | None = None,
    binding: bool | None = None,
) -> None:
    """Raise unless the llama.cpp backend can run ``sources`` with these options."""
    off_cpu = [str(d) for d in devices if not _on_cpu(d)]
    if off_cpu:
        raise ConfigError(f"device={off_cpu[0]!r} with backend='llama.cpp': the llama.cpp backend (CPU wheels "
                          "of llama-cpp-python) runs on the CPU only; use device 'cpu' (or leave it unset), or "
                          "backend='hf' for CUDA")
    if dtype is not None:
        raise ConfigError(f"dtype={dtype!r} with backend='llama.cpp': llama.cpp runs the GGUF's weights as they "
                          "are stored (e.g. Q4_K_M); leave dtype unset, or use backend='hf' to choose bf16/fp32/fp16")
    for s in sources:
        if not s.has_gguf:
            raise ConfigError(f"backend='llama.cpp' needs a .gguf file, but {s.describe()} has none; pass a .gguf "
                              "file (or a directory holding one), an embedded short name, or use backend='hf'")
    if binding is False or (binding is None and not binding_available()):
        raise ModelError(f"backend='llama.cpp' needs the llama-cpp-python binding: {INSTALL_LLAMA}")


def load_model(
    spec: str | os.PathLike[str],
    *,
    backend: str = "auto",
    dtype: str | None = None,
    device: str | None = None,
    role: str | None = None,
    progress: bool = True,
    threads: int | None = None,
    trust_remote_code: bool = False,
    n_ctx: int | None = None,
    deterministic: bool | None = None,
    forward_plan: ForwardPlan | None = None,
) -> Any:
    """Load one MODEL with ``backend`` (see the module docstring).

    hf: ``dtype`` (default bf16), ``device`` (default cpu), ``trust_remote_code``, ``forward_plan`` (the KV
    cache and CUDA graphs: :class:`~dsi.models.hf.forward_plan.ForwardPlan`). llama.cpp:
    ``n_ctx`` (default: the backend's). Both: ``threads`` per worker, ``role``, ``progress``, and
    ``deterministic`` (None: the backend's default; :mod:`dsi.models.determinism`).
    """
    check_deterministic(deterministic, False)
    source = resolve_source(spec)
    devices = [device]
    choice = _choice([source], backend, devices, dtype, trust_remote_code, n_ctx, forward_plan)
    return _load_one(source, choice.backend, dtype=dtype, device=device, role=role, progress=progress,
                     threads=threads, trust_remote_code=trust_remote_code, n_ctx=n_ctx, deterministic=deterministic,
                     forward_plan=forward_plan)


def load_pair(
    target_spec: str | os.PathLike[str],
    drafter_spec: str | os.PathLike[str],
    *,
    backend: str = "auto",
    dtype: str | None = None,
    device: str | None = None,
    drafter_dtype: str | None = None,
    drafter_device: str | None = None,
    progress: bool = True,
    threads: int | None = None,
    n_ctx: int | None = None,
    vocab_mode: str = "auto",
    deterministic: bool | None = None,
    forward_plan: ForwardPlan | None = None,
) -> tuple[Any, Any]:
    """Load a target and a drafter with one backend.

    With ``vocab_mode="shared"`` they must share one vocabulary (:func:`check_same_vocabulary`); any
    other mode lets a drafter of another vocabulary draft through text (:mod:`dsi.models.vocab.bridge`,
    bridged by :func:`dsi.build_decoder`), and only a drafter without a tokenizer is refused then."""
    from dsi.models.vocab.bridge import VOCAB_MODES, shares_vocabulary

    if vocab_mode not in VOCAB_MODES:
        raise ConfigError(f"vocab_mode={vocab_mode!r} must be one of {', '.join(VOCAB_MODES)}")
    check_deterministic(deterministic, False)
    sources = [resolve_source(target_spec), resolve_source(drafter_spec)]
    choice = _choice(sources, backend, [device, drafter_device], dtype or drafter_dtype, False, n_ctx, forward_plan)
    common = {"progress": progress, "threads": threads, "n_ctx": n_ctx, "deterministic": deterministic,
              "forward_plan": forward_plan}
    target = _load_one(sources[0], choice.backend, dtype=dtype, device=device, role="target", **common)
    drafter = _load_one(sources[1], choice.backend, dtype=drafter_dtype or dtype, device=drafter_device or device,
                        role="drafter", **common)
    if vocab_mode == "shared":
        check_same_vocabulary(target, drafter)
    elif not shares_vocabulary(target, drafter):
        if target.tokenizer is None or drafter.tokenizer is None:
            raise VocabularyMismatchError(
                f"{target.name} and {drafter.name} have different vocabularies ({target.vocab_size} vs "
                f"{drafter.vocab_size} ids) and {'the target' if target.tokenizer is None else 'the drafter'} has "
                "no tokenizer to translate between them")
        logger.info("%s drafts for %s across vocabularies (vocab_mode=%s)", drafter.name, target.name, vocab_mode)
    return target, drafter


def _choice(sources: list[ModelSource], backend: str, devices: list, dtype: str | None, trust_remote_code: bool,
            n_ctx: int | None, forward_plan: ForwardPlan | None = None) -> BackendChoice:
    check_backend(backend)
    if backend == "auto" and trust_remote_code:
        backend = "hf"
    if backend == "llama.cpp" and trust_remote_code:
        raise ConfigError("trust_remote_code=True with backend='llama.cpp': remote code applies to transformers "
                          "checkpoints only; use backend='hf'")
    choice = choose_backend(sources, backend, devices=devices, dtype=dtype)
    if n_ctx is not None and choice.backend != "llama.cpp":
        raise ConfigError(f"n_ctx={n_ctx!r} applies to the llama.cpp backend only (the {choice.backend} backend "
                          f"was chosen: {choice.reason}); the hf backend uses the model's own context length")
    if forward_plan is not None and choice.backend != "hf":
        raise ConfigError(f"forward_plan={forward_plan!r} applies to the hf backend only (the {choice.backend} "
                          f"backend was chosen: {choice.reason}); pass backend='hf'")
    logger.info("backend %s: %s", choice.backend, choice.reason)
    return choice


def _load_one(source: ModelSource, backend: str, *, dtype: str | None, device: str | None, role: str | None,
              progress: bool, threads: int | None, trust_remote_code: bool = False, n_ctx: int | None = None,
              deterministic: bool | None = None, forward_plan: ForwardPlan | None = None) -> Any:
    if backend == "hf":
        from dsi.models.hf.model import HFModel

        model = HFModel.load(source.spec, dtype=dtype or "bf16", device=device or "cpu", role=role,
                             progress=progress, threads=threads, trust_remote_code=trust_remote_code,
                             forward_plan=forward_plan)
        model.deterministic = deterministic
        return model
    try:
        from dsi.models.llamacpp import LlamaCppModel
    except ImportError as exc:  # the module imports its binding lazily; this is the module itself missing
        raise ModelError(f"the llama.cpp backend is not available in this installation ({exc})") from exc
    return LlamaCppModel.load(gguf_file(source, progress=progress), n_ctx=n_ctx, threads=threads,
                              name=source.name, role=role, deterministic=deterministic)


def check_same_vocabulary(target: Any, drafter: Any) -> None:
    """Raise :class:`VocabularyMismatchError` unless both models use one vocabulary.

    Compares the logit dimension and, when both have tokenizers, the token -> id maps.
    """
    hint = "vocab_mode='shared' needs one vocabulary; 'auto' lets a drafter of another family draft through text"
    if target.vocab_size != drafter.vocab_size:
        raise VocabularyMismatchError(
            f"target vocab_size={target.vocab_size} ({target.name}) != drafter vocab_size="
            f"{drafter.vocab_size} ({drafter.name}): {hint}"
        )
    if target.tokenizer is None or drafter.tokenizer is None:
        return
    tv, dv = target.tokenizer.get_vocab(), drafter.tokenizer.get_vocab()
    if tv != dv:
        differing = sorted(set(tv.items()) ^ set(dv.items()), key=lambda kv: kv[1])[:3]
        raise VocabularyMismatchError(
            f"target and drafter tokenizers differ ({len(tv)} vs {len(dv)} tokens; e.g. {differing}): {hint}"
        )


def release(model: Any) -> None:
    """Free a loaded model's weights now where its backend can (llama.cpp frees them at once; a drafter
    of another vocabulary releases the model it wraps); any other model is freed by the garbage
    collector once nothing refers to it. The model must not be used afterwards."""
    from dsi.models.vocab.bridge import CrossVocabularyDrafter
    from dsi.models.llamacpp import LlamaCppModel  # no binding is loaded by this import

    loaded = model.drafter if isinstance(model, CrossVocabularyDrafter) else model
    if isinstance(loaded, LlamaCppModel):
        loaded.close()
