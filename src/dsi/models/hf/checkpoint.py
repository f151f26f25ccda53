"""A transformers checkpoint directory for a :class:`~dsi.models.sources.ModelSource`: what the
Hugging Face backend loads.

- a checkpoint directory is used as it is;
- a hub id is downloaded (or, with ``HF_HUB_OFFLINE`` set, found in the local Hugging Face cache);
- a ``.gguf`` file is converted once to bf16 safetensors plus tokenizer files in the cache
  (:func:`dsi.models.cache.cache_dir`), so later loads read safetensors (about a second) instead of
  dequantizing the GGUF (about a minute for 1.5B parameters);
- an embedded model's verified GGUF (:mod:`dsi.models.embedded`: the default Qwen pair, the
  SmolLM2 drafter) likewise, into ``models/<name>/``, with the model's pinned EOS tokens in its
  generation config. The same code converts the Qwen2 GGUFs (Q4_K_M) and SmolLM2's Llama GGUF
  (Q4_1, tied embeddings, GPT-2 style tokenizer): transformers' GGUF loader reads both.

The conversion happens only when the Hugging Face backend is actually used; the llama.cpp backend
reads the GGUF directly. torch and transformers are imported only inside the conversion.
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
from typing import Any

from dsi.errors import ModelError
from dsi.models import embedded
from dsi.models.cache import MARKER, cache_dir, read_marker
from dsi.models.sources import ModelSource, resolve_source

logger = logging.getLogger(__name__)

Converter = Callable[[Path, Path, bool], None]


def hub_offline() -> bool:
    """True if ``HF_HUB_OFFLINE`` (or the older ``TRANSFORMERS_OFFLINE``) asks for no hub access."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in {"1", "true", "yes", "on"}:
            return True
    return False


def import_hf() -> tuple[Any, Any]:
    """``(torch, transformers)``, or :class:`ModelError` naming the extra to install."""
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise ModelError(f"the Hugging Face backend needs torch and transformers: pip install 'dsi[hf]' ({exc})") from exc
    return torch, transformers


# ----------------------------------------------------------------------------------------------
# Source -> checkpoint directory


def checkpoint_dir(source: ModelSource, *, progress: bool = True, converter: Converter | None = None) -> Path:
    """The local transformers checkpoint directory of ``source`` (see the module docstring)."""
    if source.kind == "directory":
        return source.directory
    if source.kind == "hub":
        return _hub_snapshot(source.hub_id)
    if source.kind == "embedded":
        return ensure_embedded(source.embedded, progress=progress, converter=converter)
    return converted_gguf_dir(source.gguf, progress=progress, converter=converter)


def resolve_model_dir(spec: str | os.PathLike[str], *, progress: bool = True) -> Path:
    """The local checkpoint directory for a MODEL string: :func:`checkpoint_dir` of its source."""
    return checkpoint_dir(resolve_source(spec), progress=progress)


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
# The embedded models, converted


def embedded_dir(name: str) -> Path:
    """Where the converted checkpoint of the embedded model ``name`` lives in the cache."""
    return cache_dir() / "models" / embedded.get(name).name


def is_converted(name: str | None = None) -> bool:
    """True if the embedded model ``name`` (default: both of the default pair) is converted in the cache,
    from the pinned GGUF."""
    models = [embedded.get(name)] if name is not None else list(embedded.PAIR)
    for m in models:
        marker = read_marker(embedded_dir(m.name))
        if marker is None or marker.get("sha256") != m.sha256:
            return False
    return True


def ensure_embedded_pair(progress: bool = True, keep_downloads: bool = False) -> tuple[Path, Path]:
    """Fetch, verify and convert the default pair if needed; return ``(target_dir, drafter_dir)``."""
    return (
        ensure_embedded(embedded.TARGET.name, progress=progress, keep_downloads=keep_downloads),
        ensure_embedded(embedded.DRAFTER.name, progress=progress, keep_downloads=keep_downloads),
    )


def ensure_embedded(
    name: str,
    *,
    progress: bool = True,
    keep_downloads: bool = False,
    downloader: Callable[[embedded.EmbeddedModel, int, Path], None] | None = None,
    converter: Converter | None = None,
) -> Path:
    """The converted checkpoint directory of one embedded model, building it on first use.

    The verified GGUF comes from :func:`dsi.models.embedded.ensure_gguf` (and stays in the cache);
    ``converter(gguf, out_dir, progress)`` defaults to transformers' GGUF loader; tests pass fakes.
    """
    m = embedded.get(name)
    out = embedded_dir(m.name)
    if is_converted(m.name):
        return out
    gguf = embedded.ensure_gguf(m.name, progress=progress, keep_downloads=keep_downloads, downloader=downloader)
    return ensure_converted(gguf, out, progress=progress, converter=converter or _convert_embedded(m),
                            marker={"sha256": m.sha256, "name": m.name, "role": m.role})


def _convert_embedded(m: embedded.EmbeddedModel) -> Converter:
    """transformers' GGUF conversion, then ``m.eos_token_ids`` as the generation config's EOS list.

    The GGUFs name only ``<|im_end|>`` as EOS. For the Qwen pair the list is the upstream
    Qwen2.5-Coder-Instruct generation config's, which also stops at ``<|endoftext|>`` (what raw,
    non-chat completions end with); for SmolLM2 it is the end-of-generation set llama.cpp derives
    from the GGUF (``<|im_end|>``, ``<|endoftext|>``, ``<reponame>``), so both backends stop alike.
    """

    def convert(gguf: Path, out: Path, progress: bool) -> None:
        convert_gguf(gguf, out, progress)
        path = out / "generation_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        config["eos_token_id"] = list(m.eos_token_ids)
        path.write_text(json.dumps(config, indent=2) + "\n")

    return convert


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


def converted_gguf_dir(gguf_path: Path, *, progress: bool = True, converter: Converter | None = None) -> Path:
    """The cached safetensors directory of a user's ``.gguf`` file, converting it on first use."""
    gguf_path = Path(gguf_path).expanduser()
    out = cache_dir() / "converted" / gguf_cache_key(gguf_path)
    return ensure_converted(gguf_path, out, progress=progress, converter=converter)


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


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Dequantize a GGUF checkpoint with transformers and save bf16 safetensors + tokenizer files.

    Writes into ``out_dir`` (which must not exist yet); the caller moves it into place.
    Needs the ``gguf`` and ``accelerate`` packages (the ``hf`` extra).
    """
    from tqdm.auto import tqdm

    torch, transformers = import_hf()
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
