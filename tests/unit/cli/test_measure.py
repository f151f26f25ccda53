"""``dsi measure``: run lengths, the acceptance formula, prompt files, timing, and the CLI on tiny models."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from dsi.cli import measure
from dsi.cli.main import main
from dsi.errors import ConfigError
from dsi.models.emulated.callable import CallableLM

# ----------------------------------------------------------------------------------------------
# Pure parts (no torch)


@pytest.mark.parametrize("flags, runs", [
    ("MMXM", [2, 1]),
    ("XX", [0, 0]),
    ("MX", [1]),
    ("MMM", [3]),
    ("", []),
    ("XMMXMMMX", [0, 2, 3]),
])
def test_run_lengths(flags, runs):
    assert measure.run_lengths([c == "M" for c in flags]) == runs


def test_acceptance_formula():
    assert measure.acceptance_from_runs([3]) == pytest.approx(0.75)  # m = 3 -> 1 - 1/4
    assert measure.acceptance_from_runs([0, 0]) == 0.0
    assert measure.acceptance_from_runs([1, 3]) == pytest.approx(1 - 1 / 3)
    with pytest.raises(ConfigError):
        measure.acceptance_from_runs([])


def test_load_prompts(tmp_path):
    assert measure.load_prompts("code")[0] == "def fibonacci(n):"
    assert len(measure.load_prompts("prose")) >= 5
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a b"}\n\nplain line\n{"prompt": "c\\nd"}\n')
    assert measure.load_prompts(str(f)) == ["a b", "plain line", "c\nd"]
    f.write_text('{"text": "x"}\n')
    with pytest.raises(ConfigError, match="string 'prompt'"):
        measure.load_prompts(str(f))
    f.write_text("\n\n")
    with pytest.raises(ConfigError, match="no prompts"):
        measure.load_prompts(str(f))
    with pytest.raises(ConfigError, match="neither a built-in set"):
        measure.load_prompts(str(tmp_path / "missing.txt"))


def _counting_lm(vocab: int = 10, offset: int = 1) -> CallableLM:
    """Next token = (last token + offset) mod vocab."""

    def next_logits(ctx):
        row = np.zeros(vocab)
        row[(ctx[-1] + offset) % vocab] = 5.0
        return row

    return CallableLM(next_logits, vocab)


def test_greedy_timed_uses_a_clock_and_stops_at_eos():
    ticks = itertools.count()
    timed = measure.greedy_timed(_counting_lm(), [2], 5, clock=lambda: float(next(ticks)))
    assert timed.tokens == (3, 4, 5, 6, 7)
    # clock reads: start=0, after prefill=1, end=2 -> ttft 1, total 2, tpot (2-1)/4
    assert (timed.ttft_s, timed.total_s, timed.tpot_s) == (1.0, 2.0, 0.25)
    assert measure.greedy_timed(_counting_lm(), [2], 5, eos=(4,)).tokens == (3, 4)


def test_measure_acceptance_on_known_pair():
    """Target counts +1; the drafter agrees except after token 5 (it predicts 7 instead of 6)."""

    def drafter_logits(ctx):
        row = np.zeros(10)
        row[7 if ctx[-1] == 5 else (ctx[-1] + 1) % 10] = 5.0
        return row

    result = measure.measure_acceptance(_counting_lm(), CallableLM(drafter_logits, 10), [[0], [3]], 6)
    # prompt [0]: target 1..6, drafter guesses at prefixes ...0..5 -> mismatch at the last position (after 5)
    # prompt [3]: target 4,5,6,7,8,9 -> mismatch at position 2 (after 5)
    assert result["per_prompt"][0]["runs"] == [5]
    assert result["per_prompt"][1]["runs"] == [2, 3]
    assert result["positions"] == 12
    assert result["match_rate"] == pytest.approx(10 / 12)
    assert result["mean_run_length"] == pytest.approx(10 / 3)
    assert result["acceptance"] == pytest.approx(1 - 1 / (1 + 10 / 3))
    for key in ("target_ttft_ms", "target_tpot_ms", "drafter_ttft_ms", "drafter_tpot_ms"):
        assert result[key] >= 0


def test_measure_latency_generates_exactly_n_tokens():
    result = measure.measure_latency(_counting_lm(), [[1, 2], [3]], 4)
    assert [r["new_tokens"] for r in result["per_prompt"]] == [4, 4]
    assert result["ttft_ms"] > 0 and result["tpot_ms"] > 0
    with pytest.raises(ConfigError, match="max_new_tokens=1"):
        measure.measure_latency(_counting_lm(), [[1]], 1)


def test_cli_registers_measure(capsys):
    assert main(["measure", "latency", "--help"]) == 0
    assert "--max-new-tokens" in capsys.readouterr().out
    assert main(["measure"]) == 2


# ----------------------------------------------------------------------------------------------
# The CLI on tiny Hugging Face models (torch)


def _save_tiny(path, seed: int, words: list[str]):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=len(words) + 2, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, eos_token_id=1, bos_token_id=None,
                                      pad_token_id=None)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tok = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(words)}},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                         eos_token="<eos>").save_pretrained(path)


WORDS = [f"w{i}" for i in range(40)]


@pytest.fixture
def tiny_models(tmp_path):
    _save_tiny(tmp_path / "target", 0, WORDS)
    _save_tiny(tmp_path / "drafter", 1, WORDS)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "w1 w2 w3"}\nw4 w5\n')
    return tmp_path


@pytest.mark.hf
def test_cli_latency_json(tiny_models, capsys):
    out = tiny_models / "lat.json"
    code = main(["measure", "latency", "--model", str(tiny_models / "target"), "--prompts",
                 str(tiny_models / "prompts.jsonl"), "--role", "target", "--dtype", "fp32", "--threads", "1",
                 "--max-new-tokens", "4", "--out", str(out), "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["kind"] == "latency" and printed["role"] == "target" and printed["prompts"] == 2
    assert printed["model"] == str(tiny_models / "target")
    assert (printed["dtype"], printed["device"], printed["threads"]) == ("fp32", "cpu", 1)
    assert printed["ttft_ms"] > 0 and printed["tpot_ms"] > 0
    assert [r["prompt_tokens"] for r in printed["per_prompt"]] == [3, 2]


@pytest.mark.hf
def test_cli_acceptance_self_pair_is_one(tiny_models, capsys):
    """The target as its own drafter matches everywhere: match rate 1."""
    target = str(tiny_models / "target")
    code = main(["measure", "acceptance", "--target", target, "--drafter", target, "--prompts",
                 str(tiny_models / "prompts.jsonl"), "--dtype", "fp32", "--threads", "1", "--max-new-tokens", "5",
                 "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["kind"] == "acceptance" and result["target"] == target
    assert result["match_rate"] == 1.0
    assert result["positions"] == sum(r["new_tokens"] for r in result["per_prompt"])
    # one run per prompt, as long as the generation: a = 1 - 1/(1 + mean length)
    lengths = [r["new_tokens"] for r in result["per_prompt"]]
    assert result["acceptance"] == pytest.approx(1 - 1 / (1 + np.mean(lengths)))
    for key in ("target_ttft_ms", "target_tpot_ms", "drafter_ttft_ms", "drafter_tpot_ms", "mean_run_length"):
        assert key in result


@pytest.mark.hf
def test_cli_acceptance_table_and_errors(tiny_models, capsys):
    target, drafter = str(tiny_models / "target"), str(tiny_models / "drafter")
    code = main(["measure", "acceptance", "--target", target, "--drafter", drafter, "--prompts",
                 str(tiny_models / "prompts.jsonl"), "--dtype", "fp32", "--max-new-tokens", "4"])
    assert code == 0
    out = capsys.readouterr().out
    assert "acceptance a = 1 - 1/(1+m)" in out and "match rate" in out
    code = main(["measure", "latency", "--model", str(tiny_models / "nope"), "--max-new-tokens", "4"])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err
    code = main(["measure", "latency", "--model", target, "--prompts", str(tiny_models / "prompts.jsonl"),
                 "--dtype", "fp32", "--max-new-tokens", "80"])
    assert code == 2
    assert "max_context=64" in capsys.readouterr().err


@pytest.mark.hf
def test_measured_acceptance_file_drives_dsi_plan(tiny_models, capsys):
    """Round trip: `dsi measure acceptance --out F` then `dsi plan --from F` uses F's numbers."""
    target, drafter = str(tiny_models / "target"), str(tiny_models / "drafter")
    out = tiny_models / "acc.json"
    assert main(["measure", "acceptance", "--target", target, "--drafter", drafter, "--prompts",
                 str(tiny_models / "prompts.jsonl"), "--dtype", "fp32", "--threads", "1", "--max-new-tokens", "5",
                 "--out", str(out), "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)
    # the two tiny models are the same size, so their measured latencies are in random order:
    # give the latencies as flags (flags override the file) and take the acceptance from the file
    assert main(["plan", "--from", str(out), "--target-tpot", "10", "--drafter-tpot", "1",
                 "--target-ttft", "10", "--drafter-ttft", "1", "--max-servers", "3", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    inputs = plan["inputs"]
    assert inputs["acceptance"] == pytest.approx(measured["acceptance"])
    assert (inputs["target_tpot_ms"], inputs["drafter_tpot_ms"]) == (10.0, 1.0)
    assert 1 <= plan["num_target_servers"] <= 3


# ----------------------------------------------------------------------------------------------
# Help texts that say what the commands do (issue 49, item 8.3)


def _options(*path: str) -> dict:
    """``{option string: argparse action}`` of the (sub)command ``dsi *path``."""
    import argparse

    from dsi.cli.main import build_parser

    parser = build_parser()
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return {option: action for action in parser._actions for option in action.option_strings}


def test_measure_help_names_no_default_for_the_required_model():
    model = _options("measure", "latency")["--model"]
    assert model.required and model.default is None
    assert "default" not in model.help.replace("default-target", "").replace("default-drafter", ""), model.help
    assert "(default-target" not in model.help  # the embedded names were read as defaults
    acceptance = _options("measure", "acceptance")
    assert acceptance["--target"].default == "default-target" and "default: the embedded target" in (
        acceptance["--target"].help)


def test_measure_help_says_how_many_tokens_each_kind_generates():
    """A latency run generates exactly N tokens (EOS does not stop it); an acceptance run stops at EOS."""
    assert "exactly" in _options("measure", "latency")["--max-new-tokens"].help
    assert "at most" in _options("measure", "acceptance")["--max-new-tokens"].help
    eos = 3  # the counting model's next token from [1] runs 2, 3, 4, ...: EOS comes third
    assert len(measure.greedy_timed(_counting_lm(), [1], 6).tokens) == 6
    assert len(measure.greedy_timed(_counting_lm(), [1], 6, eos=[eos]).tokens) == 2


def test_generate_help_says_n_prints_one_object_with_choices():
    """``dsi generate --n 2 --json`` prints an object ``{..., "choices": [{"index": 0, ...}, ...]}``, not a list
    (tests/unit/cli/test_generate.py::test_n_choices_are_the_runs_of_their_derived_seeds checks the output)."""
    options = _options("generate")
    for flag in ("--n", "--json"):
        text = options[flag].help
        assert "a list" not in text and '"choices"' in text, (flag, text)
