"""``--backend`` on every model command: what auto picks, what the loader receives, and the errors.

The backends' loaders are fakes (``sys.modules`` entries for ``dsi.models.llamacpp`` and
``dsi.models.hf.model``) over a counting model, so the CLI wiring is tested without torch or llama.cpp.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from dsi.cli.main import main
from dsi.models import CallableLM, loading

VOCAB = 11


def _next(ctx):
    row = np.zeros(VOCAB)
    row[(ctx[-1] + 1) % VOCAB if ctx else 0] = 1.0  # the token after t is t + 1
    return row


class Fake(CallableLM):
    """A counting model standing for a loaded LlamaCppModel / HFModel; records how it was loaded."""

    loads: list = []
    backend = "?"

    def __init__(self, name: str, threads=None):
        super().__init__(_next, VOCAB, name=name)
        self.threads, self.tokenizer, self.eos_token_ids = threads, None, ()

    @classmethod
    def load(cls, spec, **kwargs):
        Fake.loads.append((cls.backend, Path(spec).name, kwargs))
        return cls(str(spec), kwargs.get("threads"))

    def encode(self, text, chat=False):
        return [len(text) % VOCAB]

    def check_length(self, prompt_len, max_new_tokens=0):
        pass


class FakeLlama(Fake):
    backend = "llama.cpp"


class FakeHF(Fake):
    backend = "hf"


@pytest.fixture
def models(tmp_path, monkeypatch):
    """Two .gguf files, a checkpoint directory, and fake backends (the binding counts as installed)."""
    Fake.loads = []
    monkeypatch.setitem(sys.modules, "dsi.models.llamacpp", types.SimpleNamespace(LlamaCppModel=FakeLlama))
    monkeypatch.setitem(sys.modules, "dsi.models.hf.model", types.SimpleNamespace(HFModel=FakeHF))
    monkeypatch.setattr(loading, "binding_available", lambda: True)
    for name in ("t.gguf", "d.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    return {"t": str(tmp_path / "t.gguf"), "d": str(tmp_path / "d.gguf"), "ckpt": str(tmp_path / "ckpt")}


def run(capsys, argv: list[str]) -> dict:
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def test_generate_on_gguf_files_picks_llamacpp_and_passes_threads(models, capsys):
    doc = run(capsys, ["generate", "--target", models["t"], "--drafter", models["d"], "--prompt-ids", "3",
                       "--method", "si", "--max-new-tokens", "4", "--threads", "1", "--json"])
    assert doc["token_ids"] == [4, 5, 6, 7]
    assert Fake.loads == [("llama.cpp", "t.gguf", {"n_ctx": None, "threads": 1, "name": models["t"], "role": "target",
                                                   "deterministic": None}),
                          ("llama.cpp", "d.gguf", {"n_ctx": None, "threads": 1, "name": models["d"],
                                                   "role": "drafter", "deterministic": None})]


@pytest.mark.parametrize("extra, dtype, device", [
    (["--dtype", "fp32"], "fp32", "cpu"),  # a dtype is an hf option: auto picks hf
    (["--device", "cuda:0"], "bf16", "cuda:0"),  # so is a GPU
    (["--backend", "hf"], "bf16", "cpu"),
])
def test_generate_picks_hf_when_asked_or_implied(models, capsys, extra, dtype, device):
    run(capsys, ["generate", "--target", models["t"], "--drafter", models["d"], "--prompt-ids", "3", "--method", "ar",
                 "--max-new-tokens", "2", "--json", *extra])
    assert [(b, kw["dtype"], kw["device"]) for b, _, kw in Fake.loads] == [("hf", dtype, device)]  # ar: no drafter


def test_demo_reports_the_backend(models, capsys):
    doc = run(capsys, ["demo", "--target", models["t"], "--drafter", models["d"], "--prompts", "1",
                       "--max-new-tokens", "3", "--no-auto", "--json"])
    assert (doc["backend"], doc["dtype"], doc["device"]) == ("llama.cpp", None, "cpu")
    assert doc["backend_reason"] == "GGUF models on the CPU" and doc["all_identical"] is True
    assert doc["near_tie_margin"] == 0.25
    capsys.readouterr()
    assert main(["demo", "--target", models["t"], "--drafter", models["d"], "--prompts", "1", "--max-new-tokens", "3",
                 "--no-auto"]) == 0
    assert "llama.cpp (GGUF weights) on cpu (auto: GGUF models on the CPU)" in capsys.readouterr().out


def test_measure_latency_on_llamacpp_needs_no_torch_threads(models, capsys):
    doc = run(capsys, ["measure", "latency", "--model", models["t"], "--max-new-tokens", "3", "--num-prompts", "1",
                       "--threads", "2", "--json"])
    assert (doc["backend"], doc["dtype"], doc["device"], doc["threads"]) == ("llama.cpp", None, "cpu", 2)
    assert Fake.loads[0][2]["threads"] == 2


@pytest.mark.parametrize("command", [
    ["generate", "--prompt", "x"],
    ["demo"],
    ["selftest"],
    ["serve"],
    ["measure", "acceptance"],
])
@pytest.mark.parametrize("options, message", [
    (["--backend", "llama.cpp", "--target", "{ckpt}"],
     "backend='llama.cpp' needs a .gguf file, but the transformers checkpoint directory"),
    (["--backend", "llama.cpp", "--dtype", "fp32"], "dtype='fp32' with backend='llama.cpp'"),
    (["--backend", "llama.cpp", "--device", "cuda"], "device='cuda' with backend='llama.cpp'"),
])
def test_impossible_combinations_fail_before_loading(models, capsys, command, options, message):
    argv = [*command, "--target", models["t"], "--drafter", models["d"],
            *[o.format(**models) for o in options]]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert Fake.loads == []


def test_target_devices_count_as_devices(models, capsys):
    code = main(["generate", "--target", models["t"], "--drafter", models["d"], "--prompt-ids", "3",
                 "--backend", "llama.cpp", "--target-devices", "cpu,cuda:1"])
    assert code == 2 and "device='cuda:1' with backend='llama.cpp'" in capsys.readouterr().err


def test_an_unknown_backend_is_an_argparse_error(models, capsys):
    assert main(["generate", "--prompt", "x", "--backend", "vllm"]) == 2
    assert "invalid choice: 'vllm'" in capsys.readouterr().err


def test_selftest_runs_gguf_models_on_hf_in_fp32_unless_told(models, capsys):
    """Its exact checks need the same arithmetic in a 1-token and a k-token forward: hf fp32 by default."""
    argv = ["selftest", "--target", models["t"], "--drafter", models["d"], "--max-new-tokens", "3", "--positions", "0",
            "--json"]
    doc = run(capsys, argv)
    assert (doc["backend"], doc["dtype"]) == ("hf", "fp32")
    assert [(b, kw["dtype"]) for b, _, kw in Fake.loads] == [("hf", "fp32"), ("hf", "fp32")]
    Fake.loads.clear()
    assert run(capsys, [*argv, "--backend", "llama.cpp"])["backend"] == "llama.cpp"
    assert {b for b, _, _ in Fake.loads} == {"llama.cpp"}


def test_max_model_len_reaches_llamacpp_as_n_ctx_and_is_refused_for_hf(models, capsys):
    run(capsys, ["generate", "--target", models["t"], "--drafter", models["d"], "--prompt-ids", "3",
                 "--method", "si", "--max-new-tokens", "4", "--max-model-len", "32768", "--json"])
    assert [kw["n_ctx"] for _, _, kw in Fake.loads] == [32768, 32768]
    code = main(["generate", "--target", models["t"], "--drafter", models["d"], "--prompt-ids", "3", "--method", "ar",
                 "--max-new-tokens", "2", "--backend", "hf", "--max-model-len", "8192"])
    err = capsys.readouterr().err
    assert code == 2 and "--max-model-len=8192 sizes llama.cpp's KV cells or the hf backend's static cache" in err, err
    assert "the hf backend was chosen (asked for) with a dynamic cache" in err
    assert main(["generate", "--target", models["t"], "--prompt-ids", "3", "--method", "ar", "--n-ctx", "1"]) == 2
    assert "--max-model-len=1 must be an integer >= 2" in capsys.readouterr().err
