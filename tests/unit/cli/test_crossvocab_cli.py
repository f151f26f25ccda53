"""A drafter with another tokenizer through the commands: ``dsi generate``, ``dsi selftest`` and
``dsi serve`` (``--vocab-mode``), on tiny random HF models whose tokenizers differ."""

from __future__ import annotations

import json
import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dsi.cli.main import main  # noqa: E402
from tests.tiny_vocab import save_model_dir  # noqa: E402

pytestmark = pytest.mark.hf

PROMPT = "héllo wörld, the quick 日本"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("crossvocab-models")
    target = save_model_dir("multilingual", root / "target", seed=0, layers=2)
    drafter = save_model_dir("bytes", root / "drafter", seed=1, layers=1)
    return str(target), str(drafter)


def run_json(capsys, argv):
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def generate(capsys, dirs, *argv):
    return run_json(capsys, ["generate", "--target", dirs[0], "--drafter", dirs[1], "--prompt", PROMPT, "--dtype",
                             "fp32", "--threads", "1", "--max-new-tokens", "12", "--json", *argv])


@pytest.mark.parametrize("engine", [
    ["--method", "si", "--lookahead", "3"],
    ["--method", "dsi", "--lookahead", "3", "--sp", "2"],
    ["--method", "dsi", "--lookahead", "auto", "--vocab-mode", "intersection"],
    ["--method", "si", "--lookahead", "2", "--vocab-mode", "string"],
])
def test_generate_with_a_drafter_of_another_tokenizer_equals_non_si(dirs, capsys, engine):
    reference = generate(capsys, dirs, "--method", "ar")
    doc = generate(capsys, dirs, *engine)
    assert doc["token_ids"] == reference["token_ids"] and doc["text"] == reference["text"]
    stats = doc["stats"]
    mode = engine[engine.index("--vocab-mode") + 1] if "--vocab-mode" in engine else "string"
    assert stats["vocab_mode"] == mode
    assert 0 < stats["vocab_intersection"] < 400  # the byte tokenizer's 256 bytes, minus what the target lacks
    assert stats["drafter_reencodes"] >= 1  # at least the prompt's text, spelled in the drafter's tokens


def test_sampling_with_a_drafter_of_another_tokenizer_uses_the_intersection(dirs, capsys):
    one = generate(capsys, dirs, "--method", "dsi", "--lookahead", "2", "--sp", "1", "--temperature", "0.8",
                   "--seed", "5")
    two = generate(capsys, dirs, "--method", "dsi", "--lookahead", "2", "--sp", "2", "--temperature", "0.8",
                   "--seed", "5")
    assert one["stats"]["vocab_mode"] == two["stats"]["vocab_mode"] == "intersection"
    assert one["token_ids"] == two["token_ids"]  # a fixed seed gives one output whatever the placement


def test_string_mode_with_a_temperature_is_refused_before_loading(dirs, capsys, monkeypatch):
    import dsi.models.loading as loading

    def no_load(*args, **kwargs):
        raise AssertionError("models were loaded")

    monkeypatch.setattr(loading, "load_pair", no_load)
    code = main(["generate", "--target", dirs[0], "--drafter", dirs[1], "--prompt", "x", "--method", "si",
                 "--vocab-mode", "string", "--temperature", "0.7"])
    assert code == 2
    assert "vocab_mode='string' is exact for greedy decoding only (temperature=0.7)" in capsys.readouterr().err


def test_shared_mode_refuses_a_drafter_of_another_tokenizer(dirs, capsys):
    code = main(["generate", "--target", dirs[0], "--drafter", dirs[1], "--prompt", "x", "--dtype", "fp32",
                 "--method", "si", "--vocab-mode", "shared"])
    err = capsys.readouterr().err
    assert code == 2 and "vocab_mode='shared' needs one vocabulary" in err and "'auto' lets a drafter" in err


def test_selftest_passes_with_a_drafter_of_another_tokenizer(dirs, capsys):
    doc = run_json(capsys, ["selftest", "--target", dirs[0], "--drafter", dirs[1], "--threads", "1", "--samples",
                            "300", "--temperature", "0.05", "--max-new-tokens", "12", "--positions", "1", "--json"])
    assert doc["passed"] and doc["backend"] == "hf" and doc["dtype"] == "fp32"
    assert [c["name"] for c in doc["checks"]] == ["greedy SI == non-SI", "greedy DSI == non-SI",
                                                    "DSI sampling law at prefix 1 (chi-square)"]


# ---- dsi serve -----------------------------------------------------------------------------------------


def test_serve_config_refuses_string_mode_with_a_sampling_default():
    from dsi.errors import ConfigError
    from dsi.server import ServeConfig

    with pytest.raises(ConfigError, match="vocab_mode='string' is exact for greedy decoding only"):
        ServeConfig(vocab_mode="string")  # requests without a temperature would sample (1.0)
    with pytest.raises(ConfigError, match="vocab_mode='tokens' must be one of auto, shared, string, intersection"):
        ServeConfig(vocab_mode="tokens")
    assert ServeConfig(vocab_mode="string", temperature=0.0).vocab_mode == "string"
    assert ServeConfig(vocab_mode="string", method="ar").method == "ar"  # no drafter: nothing to refuse


@pytest.mark.parametrize("mode", ["auto", "string"])
def test_serve_with_a_drafter_of_another_tokenizer(dirs, mode):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from dsi.models.vocab.bridge import CrossVocabularyDrafter
    from dsi.models.loading import load_pair
    from dsi.server import ServeConfig, create_app
    from tests.unit.server.conftest import running_server

    target, drafter = load_pair(*dirs, dtype="fp32", progress=False, threads=1)
    reference = {}
    for method in ("ar", "dsi"):
        config = ServeConfig(method=method, lookahead=3, num_target_servers=2, max_concurrent=2, model_name="m",
                             max_tokens=10, temperature=0.0, vocab_mode=mode)
        app = create_app(target, drafter, config)
        state = app.state.dsi if hasattr(app.state, "dsi") else None
        with running_server(app) as running:
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 10, "temperature": 0}
            answer = httpx.post(running.url + "/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            reference[method] = answer.json()["choices"][0]["text"]
            if method == "dsi":
                sampled = httpx.post(running.url + "/v1/completions", timeout=60,
                                     json={**body, "temperature": 0.7, "seed": 1})
                if mode == "string":  # refused before it is queued, naming what would work
                    assert sampled.status_code == 422, sampled.text
                    assert "vocab_mode='string' is exact for greedy decoding only" in sampled.text
                else:
                    assert sampled.status_code == 200, sampled.text
        if state is not None and method == "dsi":
            assert isinstance(state.drafter, CrossVocabularyDrafter)
    assert reference["dsi"] == reference["ar"]


# ---- dsi measure acceptance ------------------------------------------------------------------------------


def test_measured_acceptance_of_a_drafter_of_another_tokenizer_counts_its_text_guesses():
    """An oracle drafter writing the target's own text in byte tokens matches the target almost
    everywhere once bridged; unbridged, the target's ids are refused by the byte drafter (outside its
    vocabulary), never compared as if they were its own."""
    import dsi
    from dsi.cli.measure import measure_acceptance
    from dsi.errors import ConfigError
    from dsi.models.vocab.bridge import bridge_drafter
    from tests import tiny_vocab

    text = "hello world the quick brown fox jumps over the wonder hello there"
    target = tiny_vocab.script_lm("words", text)  # word tokens: ids unlike the byte tokenizer's
    prompt = tiny_vocab.encode("words", "hello world")
    out = dsi.generate(target=target, prompt=prompt, method="ar", max_new_tokens=40).tokens
    written = tiny_vocab.vocabulary("words").spelling(prompt + out)
    drafter = tiny_vocab.oracle_lm("bytes", [written])
    eos = [tiny_vocab.tokenizer("words").eos_token_id]
    measured = measure_acceptance(target, bridge_drafter(target, drafter, "auto"), [prompt], 16, eos)
    assert measured["match_rate"] >= 0.9, measured
    with pytest.raises(ConfigError, match="outside the vocabulary"):  # unbridged: word ids are no byte ids
        measure_acceptance(target, drafter, [prompt], 16, eos)


def test_cli_measure_acceptance_with_a_drafter_of_another_tokenizer(dirs, capsys):
    doc = run_json(capsys, ["measure", "acceptance", "--target", dirs[0], "--drafter", dirs[1], "--dtype", "fp32",
                            "--num-prompts", "1", "--max-new-tokens", "8", "--json"])
    assert 0.0 <= doc["match_rate"] <= 1.0 and doc["positions"] >= 1
    code = main(["measure", "acceptance", "--target", dirs[0], "--drafter", dirs[1], "--dtype", "fp32",
                 "--num-prompts", "1", "--max-new-tokens", "8", "--vocab-mode", "shared", "--json"])
    assert code == 2 and "vocab_mode='shared' needs one vocabulary" in capsys.readouterr().err


# ---- --merges ------------------------------------------------------------------------------------------


def test_merges_reach_the_engine_and_keep_greedy_output_exact(dirs, capsys):
    """``--merges N`` sets how many likely shared tokens per position the intersection law extends to their
    merged target tokens (reported as ``vocab_merge_lookahead``); greedy output stays non-SI's either way."""
    reference = generate(capsys, dirs, "--method", "ar")
    runs = {}
    for merges in ("0", "3"):
        doc = generate(capsys, dirs, "--method", "si", "--lookahead", "3", "--vocab-mode", "intersection",
                       "--merges", merges)
        assert doc["token_ids"] == reference["token_ids"]
        runs[merges] = doc["stats"]
    assert runs["0"]["vocab_merge_lookahead"] == 0 and "vocab_merges" not in runs["0"]
    assert runs["3"]["vocab_merge_lookahead"] == 3 and runs["3"]["vocab_merges"] > 0


@pytest.mark.parametrize("value", ["-1", "three", "1.5"])
def test_a_bad_merges_value_is_refused_naming_it(dirs, capsys, value):
    code = main(["generate", "--target", dirs[0], "--drafter", dirs[1], "--prompt", "x", "--merges", value])
    err = capsys.readouterr().err
    assert code == 2 and re.search(rf"--merges='?{re.escape(value)}'? must be an integer >= 0 or 'auto'", err), err


def test_merges_with_a_drafter_of_the_targets_vocabulary_are_refused(dirs, capsys):
    code = main(["generate", "--target", dirs[0], "--drafter", dirs[0], "--prompt", "x", "--dtype", "fp32",
                 "--method", "si", "--merges", "3"])
    err = capsys.readouterr().err
    assert code == 2 and "merges=3 applies to a drafter of another vocabulary" in err


def test_serve_config_takes_merges():
    from dsi.errors import ConfigError
    from dsi.server import ServeConfig

    assert ServeConfig(merges=3).merges == 3 and ServeConfig().merges == "auto"
    for bad in (-1, "3", True, 1.5):
        with pytest.raises(ConfigError, match="must be 'auto' or an int >= 0"):
            ServeConfig(merges=bad)
