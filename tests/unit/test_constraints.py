"""Structured output (dsi.constraints): the constraint's checks, the masks llguidance gives along an output, the
vocabulary of a real tokenizer, and constrained decoding through every method: greedy SI and DSI (windows, SP,
trees, jittered latencies) token for token equal to constrained non-SI, the exact masked law (enumerated in
float64 against the decoders' own rows), and a grammar that ends the output with EOS."""

from __future__ import annotations

import itertools
import pickle
import re

import numpy as np
import pytest

import dsi
from dsi.constraints import BoundConstraint, Constraint, TokenTable, bind
from dsi.engine.api import build_decoder, make_request
from dsi.errors import ConfigError, ModelError, WorkerError
from dsi.sampling import Prefix, SamplingParams, process_logits
from tests.conftest import Jitter, exact_sequence_law, random_lm

# a character vocabulary: 0-9 digits, then letters and JSON's punctuation; the last id is EOS (no text)
CHARS = [*"0123456789", *"abc", *'{}":, ']
EOS = len(CHARS)
TABLE = TokenTable(tuple(c.encode() for c in CHARS) + (b"",), (EOS,))
VOCAB = len(TABLE)


def text(tokens) -> str:
    return "".join(CHARS[t] for t in tokens if t != EOS)


def bound(constraint: Constraint) -> BoundConstraint:
    return BoundConstraint(constraint, TABLE)


@pytest.mark.parametrize("build, message", [
    (lambda: Constraint("yaml"), "constraint kind 'yaml' must be one of"),
    (lambda: Constraint.json_schema("{not json"), "the JSON schema is not JSON"),
    (lambda: Constraint.json_schema([1, 2]), "a JSON schema must be an object"),
    (lambda: Constraint.choice([]), "choice needs a non-empty list"),
    (lambda: Constraint.grammar("start: 'a'", syntax="ebnf"), "grammar syntax='ebnf' must be 'lark' or 'gbnf'"),
    (lambda: bound(Constraint.regex("a[12")), "(?s)the regex constraint is not valid: .*unclosed character class"),
    (lambda: bound(Constraint.grammar("start: foo")), "the lark constraint is not valid"),
    (lambda: SamplingParams(constraint="json"), "constraint='json' must be a dsi.Constraint"),
    (lambda: SamplingParams(constraint=Constraint.json_object(), ignore_eos=True), "ignore_eos=True with a constr"),
    (lambda: TokenTable((b"a",), (3,)), "needs its EOS ids within"),
])
def test_bad_constraints_are_config_errors_that_quote_the_library(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


def _allowed(constraint: BoundConstraint, output: str) -> str:
    mask = constraint.allowed([CHARS.index(c) for c in output])
    return "".join(CHARS[i] for i in np.flatnonzero(mask) if i != EOS) + ("<eos>" if mask[EOS] else "")


def test_masks_follow_the_output_and_allow_eos_only_where_the_grammar_may_end():
    regex = bound(Constraint.regex("a[0-2]+b"))
    assert _allowed(regex, "") == "a"
    assert _allowed(regex, "a") == "012"
    assert _allowed(regex, "a1") == "012b"
    assert _allowed(regex, "a12b") == "<eos>"  # complete: only EOS is left
    assert _allowed(regex, "a1") == "012b"  # rolled back to an earlier prefix
    assert _allowed(regex, "b") == "".join(CHARS) + "<eos>"  # a refused prefix: its row decides nothing
    choice = bound(Constraint.choice(["ab", "c1"]))
    assert _allowed(choice, "") == "ac" and _allowed(choice, "c") == "1" and _allowed(choice, "ab") == "<eos>"
    gbnf = bound(Constraint.grammar('root ::= "a" [0-9] "b"?', syntax="gbnf"))
    assert _allowed(gbnf, "a") == "0123456789" and _allowed(gbnf, "a5") == "b<eos>"
    schema = bound(Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                           "required": ["a"], "additionalProperties": False}))
    assert _allowed(schema, "") == "{"
    assert _allowed(schema, '{"a":') == " "  # json.dumps' layout: ": " between a key and its value
    assert "1" in _allowed(schema, '{"a": ') and "}" not in _allowed(schema, '{"a": ')
    assert _allowed(schema, '{"a": 12}') == "<eos>"


def test_a_bound_constraint_pickles_as_its_vocabulary_s_digest_which_a_server_resolves(monkeypatch):
    import dsi.constraints as module

    monkeypatch.setattr(module, "_model_tables", set())
    by_hand = bound(Constraint.regex("a+"))  # a table given by hand, no model makes it: it travels whole
    whole = pickle.dumps(by_hand)
    assert pickle.loads(whole) == by_hand and b"_restore_bound" not in whole
    a = bind(Constraint.regex("a+"), Vocabulary(random_lm(VOCAB, seed=1)))  # made from a model: its digest
    data = pickle.dumps(a)
    assert b"_restore_bound" in data and len(data) < len(whole)  # the digest, not the table
    again = pickle.loads(data)
    assert again == a and hash(again) == hash(a) and again.table is TABLE
    assert bound(Constraint.regex("b+")) != a
    other = TokenTable(TABLE.tokens[:-1] + (b"x",), (EOS,))
    assert BoundConstraint(Constraint.regex("a+"), other) != a
    # a process that knows no such vocabulary (a fresh server) refuses it until its model is registered
    monkeypatch.setattr(module, "_known_tables", {})
    monkeypatch.setattr(module, "_vocabulary_sources", [])
    with pytest.raises(ModelError, match="reached a process whose models have another vocabulary"):
        pickle.loads(data)
    module.register_vocabulary(Vocabulary(random_lm(VOCAB, seed=1)))
    assert pickle.loads(data) == a


def test_a_hugging_face_tokenizer_s_table_gives_each_token_its_bytes():
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tests.tiny_hf import make_tokenizer

    tok = make_tokenizer()
    table = TokenTable.of_tokenizer(tok, len(tok) + 3, [tok.eos_token_id])
    assert len(table) == len(tok) + 3 and table.tokens[-1] == b""  # padded rows: no text
    ids = tok.encode("héllo wörld, 日本語")
    assert b"".join(table.tokens[i] for i in ids).decode("utf-8") == "héllo wörld, 日本語"
    assert table.tokens[tok.eos_token_id] == b""  # special tokens: no text


def test_a_sentencepiece_tokenizer_s_table_keeps_its_utf8_pieces_and_byte_fallbacks():
    class SentencePiece:  # what transformers' SentencePiece tokenizers give (Llama 2, Mistral, Gemma)
        all_special_ids = [0]

        def __len__(self):
            return 5

        def convert_ids_to_tokens(self, ids):
            return ["<s>", "\u2581héllo", "<0xE2>", "wörld", "a"][: len(ids)]

    table = TokenTable.of_tokenizer(SentencePiece(), 6, [0])
    assert table.tokens == (b"", " héllo".encode(), b"\xe2", "wörld".encode(), b"a", b"")


def test_a_constraint_s_costs_are_bounded_when_compiled_and_at_every_mask(monkeypatch, no_thread_leak):
    """dsi.constraints.MAX_SOURCE_CHARS and LIMITS: a source too long, or a grammar over llguidance's budgets, is a
    ConfigError when bound; a mask step over a budget fails the request (ModelError), on every method, never an
    unconstrained output."""
    import dsi.constraints as module

    with pytest.raises(ConfigError, match=r"a regex constraint of 524,289 characters is longer than the 524,288"):
        Constraint.regex("a" * (module.MAX_SOURCE_CHARS + 1))
    schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(30)}}
    bound(Constraint.json_schema(schema))  # within the budgets
    monkeypatch.setitem(module.LIMITS, "max_grammar_size", 50)
    with pytest.raises(ConfigError, match=r"(?s)the json_schema constraint is not valid: .*too big.*limit.* 50"):
        bound(Constraint.json_schema({**schema, "title": "another"}))  # not the one compiled above
    monkeypatch.setitem(module.LIMITS, "max_grammar_size", 500_000)
    monkeypatch.setitem(module.LIMITS, "step_lexer_fuel", 1)  # compiles; its first mask is over budget
    params = SamplingParams(constraint=Constraint.regex("(a|b|c)+[0-9]"))
    target = Vocabulary(random_lm(VOCAB, seed=3))
    for method, servers in (("ar", 1), ("si", 1), ("dsi", 2)):  # DSI: its target server failed with it
        with pytest.raises((ModelError, WorkerError), match=r"the regex constraint could not be followed after 0 output tokens "
                                             r"\(dsi.constraints.LIMITS\): lexer error: too many expressions"):
            dsi.generate(target=target, drafter=None if method == "ar" else target, prompt=(3,), method=method,
                         num_target_servers=servers, max_new_tokens=4, eos_token_id=EOS, sampling=params)


class Vocabulary:
    """A model of the character vocabulary: its rows are ``inner``'s, its table is ``TABLE``."""

    def __init__(self, inner) -> None:
        self.inner = inner

    @property
    def vocab_size(self) -> int:
        return VOCAB

    def new_session(self):
        return self.inner.new_session()

    def next_logits(self, context):
        return self.inner.next_logits(context)

    def token_table(self) -> TokenTable:
        return TABLE


PATTERN = "a[0-2]{1,4}b|c[12]"


@pytest.mark.parametrize("seed", range(4))
def test_greedy_constrained_si_and_dsi_equal_constrained_non_si_and_match_the_grammar(seed, no_thread_leak):
    target = Vocabulary(random_lm(VOCAB, seed=100 + seed, sharpness=2.0))
    drafter = Vocabulary(random_lm(VOCAB, seed=200 + seed, sharpness=2.0))
    params = SamplingParams(constraint=Constraint.regex(PATTERN))
    prompt = (3, 5)
    want = dsi.generate(target=target, prompt=prompt, method="ar", max_new_tokens=8, eos_token_id=EOS,
                        sampling=params).tokens
    assert re.fullmatch(PATTERN, text(want)) and want[-1] == EOS  # the grammar ended it
    for method, lookahead, servers, tree in [("si", 3, 1, None), ("dsi", 1, 2, None), ("dsi", 3, 3, None),
                                             ("dsi", "auto", 2, None), ("si", 3, 1, "2,2"), ("dsi", 2, 2, "auto")]:
        drafter_model = Jitter(drafter, 0.002, seed=seed) if method == "dsi" else drafter
        out = dsi.generate(target=target, drafter=drafter_model, prompt=prompt, method=method, lookahead=lookahead,
                           num_target_servers=servers, max_new_tokens=8, eos_token_id=EOS, sampling=params,
                           draft_tree=tree)
        assert out.tokens == want, (method, lookahead, servers, tree)


def test_the_drafter_drafts_under_the_constraint_so_its_drafts_are_accepted_often(no_thread_leak):
    target = Vocabulary(random_lm(VOCAB, seed=7, sharpness=1.0))
    drafter = Vocabulary(random_lm(VOCAB, seed=7, sharpness=1.0))  # the same model: every valid draft is right
    out = dsi.generate(target=target, drafter=drafter, prompt=(1,), method="si", lookahead=3, max_new_tokens=8,
                       eos_token_id=EOS, sampling=SamplingParams(constraint=Constraint.regex(PATTERN)))
    assert out.stats.rejections == 0 and out.stats.accepted_tokens > 0


@pytest.mark.parametrize("method, lookahead, servers", [("si", 2, 1),
                                                       pytest.param("dsi", 2, 2, marks=pytest.mark.slow),
                                                       pytest.param("dsi", "auto", 3, marks=pytest.mark.slow)])
def test_constrained_sampling_follows_the_masked_renormalised_target_law(method, lookahead, servers,
                                                                         no_thread_leak):
    """Chi-square of seeded generations against the target's law masked to the grammar (enumerated in float64,
    each row processed with the output before it), through SI and DSI windows."""
    from scipy.stats import chisquare

    pattern = "[ab][0-2]|c"
    target = Vocabulary(random_lm(VOCAB, seed=21, sharpness=1.0))
    drafter = Vocabulary(random_lm(VOCAB, seed=99, sharpness=1.5))
    constraint = bound(Constraint.regex(pattern))
    base = SamplingParams(temperature=1.0, constraint=constraint)
    law = exact_sequence_law(target, (4,), 3, base, frozenset({EOS}))
    assert all(re.fullmatch(pattern, text(seq)) and seq[-1] == EOS for seq in law)  # the law is the grammar's
    row = process_logits(target.next_logits((4,)), base, Prefix((4,), 1, frozenset({EOS})))
    assert set(np.flatnonzero(row)) == {CHARS.index(c) for c in "abc"}
    decoder = build_decoder(target=target, drafter=drafter, method=method, lookahead=lookahead,
                            num_target_servers=servers)
    index = {seq: i for i, seq in enumerate(law)}
    counts = np.zeros(len(law))
    samples = 1500
    try:
        for seed in range(samples):
            params = SamplingParams(temperature=1.0, seed=seed, constraint=constraint)
            out = decoder.generate(make_request((4,), 3, params, EOS, VOCAB))
            counts[index[tuple(out.tokens)]] += 1
    finally:
        decoder.close()
    _, p_value = chisquare(counts, np.array(list(law.values())) * samples)
    assert p_value > 1e-4, (counts, np.round(np.array(list(law.values())) * samples, 1))


def test_an_unbound_constraint_is_bound_by_the_decoder_and_a_model_without_a_vocabulary_is_refused():
    target = random_lm(VOCAB, seed=1)  # no tokenizer, no table
    with pytest.raises(ConfigError, match="needs the target's tokenizer"):
        dsi.generate(target=target, prompt=(1,), method="ar", max_new_tokens=2,
                     sampling=SamplingParams(constraint=Constraint.regex("a")))
    assert bind(bound(Constraint.regex("a")), Vocabulary(target)) == bound(Constraint.regex("a"))
    with pytest.raises(ConfigError, match="bound to a vocabulary of 20 ids; the target has 7"):
        bind(bound(Constraint.regex("a")), random_lm(7, seed=1))
    params = SamplingParams(temperature=1.0, constraint=Constraint.regex("a"))
    with pytest.raises(ConfigError, match="not bound to the target's vocabulary yet"):
        process_logits(np.zeros(VOCAB), params, Prefix((1,), 1))


def test_every_combination_of_a_short_output_has_its_own_mask():
    """The masks along every output of two characters agree with the grammar: a token is allowed exactly where
    the output plus it can still be completed (checked against Python's regex on every completion)."""
    pattern = "a[0-2]b|b1"
    constraint = bound(Constraint.regex(pattern))
    letters = "ab012"

    def completable(out: str) -> bool:
        return any(re.fullmatch(pattern, out + "".join(rest)) for k in range(4)
                   for rest in itertools.product(letters, repeat=k))

    checked = 0
    for n in range(3):
        for output in itertools.product(letters, repeat=n):
            out = "".join(output)
            if not completable(out):
                continue  # refused prefixes decide nothing
            mask = constraint.allowed([CHARS.index(c) for c in out])
            for c in letters:
                assert bool(mask[CHARS.index(c)]) == completable(out + c), (out, c)
            assert bool(mask[EOS]) == bool(re.fullmatch(pattern, out)), out
            checked += 1
    assert checked == 7  # "", a, b, a0, a1, a2, b1


@pytest.mark.parametrize("transport", ["processes"])
def test_server_processes_compile_the_constraint_they_receive_and_give_the_same_tokens(transport, no_thread_leak):
    target = Vocabulary(random_lm(VOCAB, seed=101, sharpness=2.0))
    drafter = Vocabulary(random_lm(VOCAB, seed=201, sharpness=2.0))
    params = SamplingParams(constraint=Constraint.regex(PATTERN))
    want = dsi.generate(target=target, prompt=(3, 5), method="ar", max_new_tokens=8, eos_token_id=EOS,
                        sampling=params).tokens
    out = dsi.generate(target=target, drafter=drafter, prompt=(3, 5), method="dsi", lookahead=2,
                       num_target_servers=2, transport=transport, max_new_tokens=8, eos_token_id=EOS,
                       sampling=params)
    assert out.tokens == want and re.fullmatch(PATTERN, text(want))


@pytest.mark.hf
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_json_schema_on_an_hf_model_gives_output_that_parses_and_validates(tmp_path, temperature, no_thread_leak):
    """The vocabulary comes from the model's own tokenizer (byte-level BPE); SI and DSI give valid JSON too."""
    pytest.importorskip("transformers")
    import json

    jsonschema = pytest.importorskip("jsonschema")
    from dsi.models.hf.model import HFModel
    from tests.tiny_hf import make_model_dir

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "tag": {"enum": ["red", "green"]},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "tag", "ok"], "additionalProperties": False}
    target = HFModel.load(str(make_model_dir(tmp_path / "t", seed=0)), dtype="fp32", progress=False)
    drafter = HFModel.load(str(make_model_dir(tmp_path / "d", seed=1, layers=1)), dtype="fp32", progress=False)
    prompt = target.encode("Describe it as JSON:")
    for seed in range(3):
        params = SamplingParams(temperature=temperature, seed=seed, constraint=Constraint.json_schema(schema))
        for method in ("ar", "si", "dsi"):
            out = dsi.generate(target=target, drafter=None if method == "ar" else drafter, prompt=prompt,
                               method=method, max_new_tokens=60, eos_token_id=target.eos_token_ids, sampling=params)
            assert out.tokens[-1] in target.eos_token_ids, (method, target.decode(out.tokens))  # the grammar ended
            jsonschema.validate(json.loads(target.decode(out.tokens)), schema)


@pytest.mark.hf
def test_dsi_generate_takes_a_json_schema_file_a_choice_a_regex_and_a_grammar(tmp_path, capsys, no_thread_leak):
    pytest.importorskip("transformers")
    import json

    jsonschema = pytest.importorskip("jsonschema")
    from dsi.cli.main import main
    from tests.tiny_hf import make_model_dir

    target, drafter = str(make_model_dir(tmp_path / "t", seed=0)), str(make_model_dir(tmp_path / "d", seed=1, layers=1))
    schema = {"type": "object", "properties": {"tag": {"enum": ["red", "green"]}, "n": {"type": "integer",
              "minimum": 0, "maximum": 9}}, "required": ["tag", "n"], "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    (tmp_path / "yes.gbnf").write_text('root ::= "yes" | "no"')
    base = ["generate", "--target", target, "--drafter", drafter, "--dtype", "fp32", "--prompt", "x", "--json",
            "--max-new-tokens", "60", "--method", "dsi", "--sp", "2", "--temperature", "1", "--seed", "4"]
    for flags, check in [(["--json-schema", str(tmp_path / "schema.json")],
                          lambda t: jsonschema.validate(json.loads(t), schema) is None),
                         (["--choice", "red", "--choice", "green"], lambda t: t in ("red", "green")),
                         (["--regex", "[0-9]{2}-[a-c]"], lambda t: re.fullmatch("[0-9]{2}-[a-c]", t)),
                         (["--grammar", str(tmp_path / "yes.gbnf")], lambda t: t in ("yes", "no"))]:
        assert main(base + flags) == 0
        text = json.loads(capsys.readouterr().out)["text"]
        assert check(text), (flags, text)
    assert main(base + ["--regex", "a[1"]) != 0
    assert "the regex constraint is not valid" in capsys.readouterr().err
