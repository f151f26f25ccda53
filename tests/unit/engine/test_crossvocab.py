"""A drafter with another tokenizer (dsi.models.vocab.bridge) keeps greedy SI and DSI exact.

Greedy SI (k = 1, 3) and DSI (k = 3 and "auto", 1 and 2 target servers, threads; one processes and
one Ray case) with a drafter of another vocabulary give the target's own non-SI tokens, in every
translating mode, on prompts whose re-tokenization is unstable (a word's prefix tokenized otherwise
than the word, characters of several bytes cut by token boundaries, emoji, CJK, specials written
as text), for several pairs of tiny tokenizers built in-test (tests/tiny_vocab.py). The drafters
are tiny random Llamas (almost always wrong) and "oracles" that write the target's greedy text in
their own tokens (so multi-token drafts are accepted), with or without deliberate mistakes.

Also: a translation forced between one vocabulary, the stats (mode, intersection, re-encodes,
roll-backs), cancellation leaving a session's tokens unchanged, string mode refused for sampling
before anything runs, and the rule that string mode never proposes a target token the drafter's
next bytes could still change ("hel" while "lo" may follow to make "hello").
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pytest

import dsi
from dsi.engine.api import build_decoder, make_request
from dsi.errors import ConfigError, DraftUnavailable, TaskCancelled
from dsi.models import CallableLM
from dsi.models.base import forward_rows
from dsi.models.vocab.bridge import CrossVocabularyDrafter
from dsi.models.vocab.vocabulary import Intersection
from dsi.sampling import SamplingParams
from tests import tiny_vocab
from tests.conftest import random_lm
from tests.tiny_vocab import TextFollower, pieces_vocabulary

GREEDY = SamplingParams()
N = 16  # new tokens per generation
CONFIGS = [("si", 1, 1), ("si", 3, 1), ("dsi", 3, 1), ("dsi", 3, 2), ("dsi", "auto", 1), ("dsi", "auto", 2)]
PROMPT_TEXTS = ["hello", " hel", "naïve café 日本", "👍🏽🇫🇷 héllo", "<|im_start|>user\nhello<|im_end|>"]


def needs_hf():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")


def expected_mode(mode: str, greedy: bool = True) -> str:
    if mode == "auto":
        return "string" if greedy else "intersection"
    return mode


def every_few_bytes(at: int) -> bool:
    """A deliberate wrong guess of the oracle drafters at these byte offsets."""
    return at % 11 == 5


@dataclass
class Case:
    target: object
    drafter: object
    prompts: list[list[int]]
    refs: list[list[int]]  # the target's own greedy tokens after each prompt (non-SI)
    intersection: int
    fluent: bool = False  # the target writes whole UTF-8 text (string mode can draft several tokens)


def make_case(target, target_name: str, drafter_name: str, *, mistakes=None, texts=PROMPT_TEXTS,
              fluent: bool = False) -> Case:
    """``target`` with an oracle drafter over ``drafter_name`` that knows the target's greedy texts."""
    vocab = tiny_vocab.vocabulary(target_name)
    prompts = [tiny_vocab.encode(target_name, t) for t in texts]
    longer = [dsi.generate(target=target, prompt=p, method="ar", max_new_tokens=N + 12).tokens for p in prompts]
    drafter = tiny_vocab.oracle_lm(drafter_name, [vocab.spelling(p + r) for p, r in zip(prompts, longer, strict=True)],
                                   mistakes=mistakes)
    inter = Intersection.of(vocab, tiny_vocab.vocabulary(drafter_name)).size
    return Case(target, drafter, prompts, [r[:N] for r in longer], inter, fluent)


SCRIPT = "the quick brown fox jumps over the lazy dog. hello world, wondering helicopter vocabulary tokens"

PAIRS = {
    # random Llama over a multilingual BPE (its text: random bytes, characters cut anywhere) <- bytes,
    # with mistakes (rejections, roll-backs, re-encodes)
    "llama-multilingual<-bytes": lambda: make_case(tiny_vocab.hf_model("multilingual", 0), "multilingual", "bytes",
                                                   mistakes=every_few_bytes),
    # random Llama over a word-level BPE with other specials <- multilingual BPE, always right
    "llama-words<-multilingual": lambda: make_case(tiny_vocab.hf_model("words", 0), "words", "multilingual"),
    # a target that writes English text in its own (canonical) tokens <- tests/tiny_hf's BPE
    "script-words<-tiny_hf": lambda: make_case(
        tiny_vocab.script_lm("words", SCRIPT), "words", "tiny_hf", mistakes=every_few_bytes,
        texts=["the", "the quick bro", "the quick brown fox jumps over the lazy dog. hel", "the quick brown fox "],
        fluent=True),
}


@pytest.fixture(scope="module", params=list(PAIRS))
def pair(request):
    needs_hf()
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield PAIRS[request.param]()
    finally:
        torch.set_num_threads(before)


def run_all(case: Case, mode: str, configs=CONFIGS, sampling=GREEDY, **options):
    """Generate after every prompt with every config; yield (config, prompt index, result)."""
    for method, lookahead, servers in configs:
        decoder = build_decoder(target=case.target, drafter=case.drafter, method=method, lookahead=lookahead,
                                num_target_servers=servers, vocab_mode=mode, **options)
        try:
            for i, prompt in enumerate(case.prompts):
                request = make_request(prompt, N, sampling, None, case.target.vocab_size)
                yield (method, lookahead, servers), i, decoder.generate(request)
        finally:
            decoder.close()


@pytest.mark.hf
@pytest.mark.parametrize("mode", ["auto", "string", "intersection"])
def test_greedy_with_a_drafter_of_another_tokenizer_equals_non_si(pair, mode, no_thread_leak):
    accepted = drafted = multi = 0
    for config, i, out in run_all(pair, mode):
        assert out.tokens == pair.refs[i], (config, i)
        extra = out.stats.extra
        assert extra["vocab_mode"] == expected_mode(mode), config
        assert extra["vocab_intersection"] == pair.intersection
        drafted += out.stats.drafted_tokens
        accepted += out.stats.accepted_tokens
        if config[0] == "si" and out.stats.accepted_tokens > out.stats.verify_tasks:
            multi += 1  # some window of SI had two or more drafts accepted
    assert accepted >= 20 and drafted >= accepted, (accepted, drafted)  # drafts accepted (rejections: below)
    if pair.fluent and expected_mode(mode) == "string":
        assert multi > 0


@pytest.mark.hf
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("mode", ["auto", "string", "intersection"])
def test_greedy_with_a_random_llama_of_another_tokenizer_equals_non_si(mode, no_thread_leak):
    """A random drafter (a Llama over the byte tokenizer; 48 positions keep string mode's look-ahead
    short) is almost always wrong: every draft is rejected and the output is still the target's."""
    needs_hf()
    target = tiny_vocab.hf_model("words", 0)
    case = make_case(target, "words", "bytes", texts=PROMPT_TEXTS[1:4])
    case.drafter = tiny_vocab.hf_model("bytes", 1, positions=48)
    rejections = 0
    for config, i, out in run_all(case, mode, [("si", 3, 1), ("dsi", 3, 2), ("dsi", "auto", 2)]):
        assert out.tokens == case.refs[i], (config, i)
        assert out.stats.extra["vocab_mode"] == expected_mode(mode)
        assert out.stats.extra["drafter_reencodes"] >= 1
        rejections += out.stats.rejections
    assert rejections > 0


@pytest.mark.hf
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("mode", ["string", "intersection"])
def test_a_translation_forced_between_one_vocabulary_equals_non_si(mode, no_thread_leak):
    needs_hf()
    target = tiny_vocab.hf_model("words", 0)
    oracle = make_case(target, "words", "words", mistakes=every_few_bytes, texts=PROMPT_TEXTS[:3])
    random_drafter = tiny_vocab.hf_model("words", 1, positions=48)  # a short look-ahead in string mode
    accepted = 0
    for drafter in (oracle.drafter, random_drafter):
        case = Case(target, drafter, oracle.prompts, oracle.refs, len(target.tokenizer))
        for config, i, out in run_all(case, mode, [("si", 3, 1), ("dsi", "auto", 2)]):
            assert out.tokens == case.refs[i], (config, i)
            assert out.stats.extra["vocab_mode"] == mode
            assert out.stats.extra["vocab_intersection"] == len(target.tokenizer)
            accepted += out.stats.accepted_tokens
    assert accepted > 0


@pytest.mark.hf
@pytest.mark.usefixtures("one_torch_thread")
def test_a_drafter_of_the_same_vocabulary_is_not_wrapped_under_auto(no_thread_leak):
    needs_hf()
    target, drafter = tiny_vocab.hf_model("words", 0), tiny_vocab.hf_model("words", 1)
    prompt = tiny_vocab.encode("words", "hello")
    out = dsi.generate(target=target, drafter=drafter, prompt=prompt, method="si", lookahead=3, max_new_tokens=8)
    assert out.tokens == dsi.generate(target=target, prompt=prompt, method="ar", max_new_tokens=8).tokens
    assert "vocab_mode" not in out.stats.extra and "drafter_reencodes" not in out.stats.extra


# ---- counters ------------------------------------------------------------------------------------------


@pytest.mark.hf
@pytest.mark.usefixtures("one_torch_thread")
def test_re_encodes_and_roll_backs_are_counted_only_where_the_texts_depart(no_thread_leak):
    """An oracle that is always right never has to take back a token: its text is the target's,
    so it is spelled in its tokens once (the prompt) and never rolled back. With mistakes, the
    target's corrections make it roll back and re-spell."""
    needs_hf()
    target = tiny_vocab.hf_model("multilingual", 0)
    right = make_case(target, "multilingual", "bytes", texts=["naïve café 日本"])
    wrong = make_case(target, "multilingual", "bytes", texts=["naïve café 日本"], mistakes=lambda at: at % 5 == 0)
    out = dsi.generate(target=target, drafter=right.drafter, prompt=right.prompts[0], method="si", lookahead=3,
                       max_new_tokens=N)
    assert out.tokens == right.refs[0]
    extra = out.stats.extra
    assert (extra["drafter_reencodes"], extra["drafter_rolled_back_tokens"]) == (1, 0), extra
    assert out.stats.rejections == 0 and out.stats.accepted_tokens > 0
    for method, lookahead in [("si", 3), ("dsi", 3), ("dsi", "auto")]:
        out = dsi.generate(target=target, drafter=wrong.drafter, prompt=wrong.prompts[0], method=method,
                           lookahead=lookahead, num_target_servers=2, max_new_tokens=N)
        assert out.tokens == wrong.refs[0]
        extra = out.stats.extra
        assert out.stats.rejections > 0
        assert extra["drafter_reencodes"] > 1 and extra["drafter_rolled_back_tokens"] > 0, (method, extra)
        assert extra["drafter_model_forwards"] > 0  # (one drafter token may settle several target drafts)


# ---- the other transports -------------------------------------------------------------------------------


def transport_case() -> Case:
    """A picklable random target over the byte tokenizer's ids (servers rebuild it from a pickle) and
    an oracle drafter over the word tokenizer, in the parent."""
    target = random_lm(len(tiny_vocab.byte_tokenizer()), seed=5, sharpness=2.0)
    target.tokenizer = tiny_vocab.byte_tokenizer()
    return make_case(target, "bytes", "words", mistakes=every_few_bytes, texts=PROMPT_TEXTS[:3])


@pytest.mark.hf
def test_greedy_across_vocabularies_over_processes_equals_non_si(no_thread_leak):
    needs_hf()
    from tests.transport_support import dsi_children

    case = transport_case()
    accepted = 0
    for config, i, out in run_all(case, "auto", [("dsi", 3, 2), ("dsi", "auto", 1)], transport="processes"):
        assert out.tokens == case.refs[i], (config, i)
        assert out.stats.extra["vocab_mode"] == "string"
        accepted += out.stats.accepted_tokens
    assert accepted > 0
    assert not dsi_children()


@pytest.mark.hf
@pytest.mark.ray
def test_greedy_across_vocabularies_over_ray_equals_non_si(no_thread_leak):
    needs_hf()
    from tests.transport_support import ray_cluster

    ray_cluster()
    case = transport_case()
    for config, i, out in run_all(case, "string", [("dsi", 3, 2)], transport="ray"):
        assert out.tokens == case.refs[i], (config, i)
        assert out.stats.extra["vocab_mode"] == "string"


# ---- sampling is refused in string mode ------------------------------------------------------------------


class Counting:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, context):
        self.calls += 1
        return self.fn(context)


T_PIECES = [b"a", b"b", b"ab", b"c"]
D_PIECES = [b"b", b"a", b"ba", b"c", b"d", None]  # id 5: the drafter's EOS (spells nothing)


def endless(context):
    """A random drafter over D_PIECES that never ends its text and writes only what the target
    can tokenize ("a", "b", "ba", "c")."""
    row = random_lm(6, seed=4).next_logits(context)
    row[4:] = -np.inf
    return row


def written_pair(mode: str, drafter_fn=None, target_fn=None):
    """Target over T_PIECES, drafter over D_PIECES (:func:`endless` unless given), the wrapped drafter."""
    target = CallableLM(Counting(target_fn or random_lm(4, seed=3).next_logits), 4, name="target")
    drafter = CallableLM(drafter_fn or endless, 6, name="drafter")
    wrapped = CrossVocabularyDrafter(drafter, pieces_vocabulary(T_PIECES, "t"), pieces_vocabulary(D_PIECES, "d"),
                                     vocab_size=4, mode=mode, drafter_eos_ids=[5])
    return target, wrapped


@pytest.mark.parametrize("method, lookahead", [("si", 2), ("dsi", 2), ("dsi", "auto")])
def test_string_mode_refuses_sampling_before_generating(method, lookahead, no_thread_leak):
    target, wrapped = written_pair("string")
    with pytest.raises(ConfigError, match=r"vocab_mode='string' is exact for greedy decoding only "
                                          r"\(temperature=0.7\).*vocab_mode='intersection' or 'auto'"):
        dsi.generate(target=target, drafter=wrapped, prompt=[0, 3], method=method, lookahead=lookahead,
                     max_new_tokens=4, sampling=SamplingParams(temperature=0.7))
    assert target.next_logits.calls == 0  # refused before any forward
    # the same decoder serves greedy requests
    decoder = build_decoder(target=target, drafter=wrapped, method=method, lookahead=lookahead)
    try:
        with pytest.raises(ConfigError, match="greedy decoding only"):
            decoder.generate(make_request([0, 3], 4, SamplingParams(temperature=1.0, seed=1), None, 4))
        out = decoder.generate(make_request([0, 3], 4, GREEDY, None, 4))
        ref = dsi.generate(target=target, prompt=[0, 3], method="ar", max_new_tokens=4).tokens
        assert out.tokens == ref and out.stats.extra["vocab_mode"] == "string"
    finally:
        decoder.close()


@pytest.mark.parametrize("method, lookahead", [("si", 2), ("dsi", "auto")])
def test_auto_mode_samples_through_the_intersection_and_greedy_through_text(method, lookahead, no_thread_leak):
    target, wrapped = written_pair("auto")
    decoder = build_decoder(target=target, drafter=wrapped, method=method, lookahead=lookahead)
    try:
        sampled = decoder.generate(make_request([0, 3], 6, SamplingParams(temperature=1.0, seed=3), None, 4))
        greedy = decoder.generate(make_request([0, 3], 6, GREEDY, None, 4))
    finally:
        decoder.close()
    assert sampled.stats.extra["vocab_mode"] == "intersection" and sampled.stats.extra["vocab_intersection"] == 3
    assert greedy.stats.extra["vocab_mode"] == "string"
    assert greedy.tokens == dsi.generate(target=target, prompt=[0, 3], method="ar", max_new_tokens=6).tokens
    # sampled: the law is the target's (tests/stats/test_chi_square_crossvocab.py); for a fixed seed, the
    # same tokens for any number of target servers
    sampling = SamplingParams(temperature=1.0, seed=3)
    outputs = {tuple(dsi.generate(target=target, drafter=wrapped, prompt=[0, 3], lookahead=2, num_target_servers=s,
                                  max_new_tokens=6, sampling=sampling).tokens) for s in (1, 3)}
    assert len(outputs) == 1, outputs


@pytest.mark.parametrize("mode, drafted_as", [("auto", "intersection"), ("string", "string"),
                                              ("intersection", "intersection")])
@pytest.mark.parametrize("method, lookahead", [("si", 2), ("dsi", "auto")])
def test_greedy_with_penalties_across_vocabularies_equals_non_si(mode, drafted_as, method, lookahead, no_thread_leak):
    """Processed greedy rows: ``auto`` drafts from intersection rows processed alike (rows, not
    argmax ids, are asked for), string mode from its raw proposals; both equal non-SI's tokens."""
    target, wrapped = written_pair(mode)
    params = SamplingParams(presence_penalty=1.0, repetition_penalty=1.5, logit_bias={2: 0.5})
    ref = dsi.generate(target=target, prompt=[0, 3], method="ar", max_new_tokens=12, sampling=params).tokens
    assert ref != dsi.generate(target=target, prompt=[0, 3], method="ar", max_new_tokens=12).tokens
    out = dsi.generate(target=target, drafter=wrapped, prompt=[0, 3], method=method, lookahead=lookahead,
                       max_new_tokens=12, sampling=params)
    assert out.tokens == ref and out.stats.extra["vocab_mode"] == drafted_as


# ---- cancellation ------------------------------------------------------------------------------------------


class CancelAfter:
    """A cancel flag that reads set from its ``n``-th check on (0: at once)."""

    def __init__(self, n: int) -> None:
        self.n, self.checks = n, 0

    def is_set(self) -> bool:
        self.checks += 1
        return self.checks > self.n

    def wait(self, timeout=None) -> bool:
        return self.is_set()


@pytest.mark.parametrize("mode, greedy", [("string", True), ("intersection", True), ("intersection", False)])
def test_a_cancelled_call_leaves_the_session_s_tokens_unchanged(mode, greedy):
    """Cancelled at any check (before the first drafter forward, or between the forwards of one
    proposal), a call raises TaskCancelled and takes no token in; the session then goes on exactly
    as one never cancelled. (A call whose answer needs no drafter forward, e.g. a proposal already
    written ahead, checks nothing and simply answers.)"""
    _, wrapped = written_pair(mode)
    reference = wrapped.new_session()
    prompt, steps = [0, 3, 2], [1, 2, 0, 3, 3, 1]
    expected = [forward_rows(reference, prompt, 1, greedy=greedy)[-1]]
    for token in steps:
        expected.append(reference.extend_rows([token], None, 1, greedy)[-1])
    cancelled = 0
    for n in range(6):  # cancelled at the n-th check
        session = wrapped.new_session()
        try:
            got = [forward_rows(session, prompt, 1, CancelAfter(n), greedy=greedy)[-1]]
        except TaskCancelled:
            cancelled += 1
            assert session.tokens == ()
            got = [forward_rows(session, prompt, 1, greedy=greedy)[-1]]
        assert session.tokens == tuple(prompt)
        for token in steps:
            before = session.tokens
            try:
                got.append(session.extend_rows([token], CancelAfter(n), 1, greedy)[-1])
            except TaskCancelled:
                cancelled += 1
                assert session.tokens == before  # nothing taken in
                got.append(session.extend_rows([token], None, 1, greedy)[-1])
            assert session.tokens == before + (token,)
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_array_equal(a, b)
    assert cancelled > 6


def test_a_dsi_drafter_cancelled_mid_proposal_keeps_the_output(no_thread_leak):
    """DSI cancels the drafter's forwards on every rejection; with a slow drafter of another
    vocabulary many proposals are cut in the middle, and the output is still non-SI's."""
    def drafter_fn(context):
        time.sleep(0.002)
        return endless(context)

    target, wrapped = written_pair("string", drafter_fn=drafter_fn)
    ref = dsi.generate(target=target, prompt=[0, 3], method="ar", max_new_tokens=12).tokens
    for lookahead in (2, "auto"):
        out = dsi.generate(target=target, drafter=wrapped, prompt=[0, 3], lookahead=lookahead,
                           num_target_servers=2, max_new_tokens=12)
        assert out.tokens == ref


# ---- string mode proposes settled tokens only -------------------------------------------------------------


def hello_drafter(text: bytes):
    """A drafter over pieces "x", "hel", "lo", " world", " " (and an EOS spelling nothing) writing ``text``,
    piece by longest piece; the pieces it wrote are recorded."""
    pieces = [b"x", b"hel", b"lo", b" world", b" ", None]
    vocab = pieces_vocabulary(pieces, "hello-drafter")
    follow = TextFollower(vocab, [text], canonical=False, eos=5, fallback=0)
    written = []

    def next_logits(context):
        row = follow(context)
        written.append(pieces[int(np.argmax(row))])
        return row

    return CallableLM(next_logits, len(pieces)), vocab, written


@pytest.mark.hf
@pytest.mark.parametrize("text, first", [(b"xhello world", "hello"), (b"xhel", "hel"), (b"xhello", "hello")])
def test_string_mode_never_proposes_a_token_the_next_bytes_could_still_change(text, first):
    """The drafter writes "hel", then "lo": the target's word tokenizer has "hel" and "hello" as
    tokens. "hel" is not proposed while more may follow; "hello" is, once " world" follows or the
    drafter's text ends; "hel" is, when the drafter's text ends right after it."""
    pytest.importorskip("transformers")
    t_vocab = tiny_vocab.vocabulary("words")
    tok = tiny_vocab.tokenizer("words")
    ids = {s: tok.convert_tokens_to_ids(s) for s in ("hel", "hello", "Ġworld", "x")}
    assert tok.encode("hello world") == [ids["hello"], ids["Ġworld"]] and tok.encode("hel") == [ids["hel"]]
    drafter, d_vocab, written = hello_drafter(text)
    wrapped = CrossVocabularyDrafter(drafter, t_vocab, d_vocab, vocab_size=len(t_vocab), mode="string",
                                     drafter_eos_ids=[5])
    session = wrapped.new_session()
    proposals = [int(session.extend_rows([ids["x"]], None, 1, True)[0])]
    assert written[:2] == ([b"hel", None] if text == b"xhel" else [b"hel", b"lo"])
    while True:
        try:
            proposals.append(int(session.extend_rows([proposals[-1]], None, 1, True)[0]))
        except DraftUnavailable:
            break
    assert proposals[0] == ids[first]
    if first == "hello":
        assert ids["hel"] not in proposals
    assert t_vocab.spelling(proposals) == text[1:]


@pytest.mark.hf
def test_string_mode_through_the_engines_with_a_hello_drafter(no_thread_leak):
    pytest.importorskip("transformers")
    tok = tiny_vocab.tokenizer("words")
    target = tiny_vocab.script_lm("words", "xhello world hello hel world")
    drafter, d_vocab, _ = hello_drafter(b"xhello world hello hel world")
    wrapped = CrossVocabularyDrafter(drafter, tiny_vocab.vocabulary("words"), d_vocab, vocab_size=len(tok),
                                     mode="string", drafter_eos_ids=[5])
    prompt = tok.encode("x")
    ref = dsi.generate(target=target, prompt=prompt, method="ar", max_new_tokens=7).tokens
    assert tok.decode(ref).startswith("hello world hello hel world")
    for method, lookahead in [("si", 3), ("dsi", 2), ("dsi", "auto")]:
        out = dsi.generate(target=target, drafter=wrapped, prompt=prompt, method=method, lookahead=lookahead,
                           max_new_tokens=7, num_target_servers=2)
        assert out.tokens == ref
        assert out.stats.accepted_tokens >= 3, (method, out.stats)


def test_the_drafter_row_follows_a_realigned_text_of_the_same_length():
    """Regression: the drafter's row was cached by its token count only, so a re-aligned text of as
    many drafter tokens got the previous text's row."""
    pieces = [b"a", b"b"]
    drafter = CallableLM(lambda ctx: np.array([float(ctx[-1]), 0.0]), 2)  # the logit of "a" is the last id
    wrapped = CrossVocabularyDrafter(drafter, pieces_vocabulary(pieces), pieces_vocabulary(pieces), vocab_size=2,
                                     mode="intersection")
    session = wrapped.new_session()
    np.testing.assert_array_equal(session.extend([0, 1])[-1], drafter.next_logits((0, 1)))  # after "ab"
    session.truncate(1)
    np.testing.assert_array_equal(session.extend([0])[-1], drafter.next_logits((0, 0)))  # after "aa"


# ---- bounded work in string mode (a pending text that settles no target token) ------------------------------


class TooMuchDrafting(Exception):
    pass


def bounded(next_logits, limit: int = 200):
    calls = [0]

    def fn(context):
        calls[0] += 1
        if calls[0] > limit:
            raise TooMuchDrafting(f"{limit} drafter forwards for one proposal")
        return next_logits(context)

    return fn


EMOJI_T = [b"a", b"b", b"\xf0\x9f", b"\x99\x82"]  # the target cuts a character in two tokens


def completes_the_emoji(context):
    """Over single bytes: finishes a character it sees begun, else writes "a"."""
    return np.eye(256)[{0xF0: 0x9F, 0x9F: 0x99, 0x99: 0x82}.get(context[-1], ord("a"))] * 5


def writes_ff(context):
    return np.eye(256)[0xFF] * 5


def writes_z(context):
    return np.eye(256)[ord("z")] * 5


@pytest.mark.parametrize("drafter_fn, context", [
    (completes_the_emoji, [0, 2]),  # the target's text "a\xf0\x9f" ends inside a character
    (writes_ff, [0, 1]),  # the drafter writes bytes that are no UTF-8
    (writes_z, [0, 1]),  # the drafter writes text the target has no token for
], ids=["target text ends inside a character", "drafter writes invalid UTF-8", "drafter writes untokenizable text"])
def test_string_mode_proposes_within_bounded_drafter_work(drafter_fn, context):
    """A proposal (or DraftUnavailable) after a bounded number of drafter forwards; here 200."""
    drafter = CallableLM(bounded(drafter_fn), 256)
    wrapped = CrossVocabularyDrafter(drafter, pieces_vocabulary(EMOJI_T),
                                     pieces_vocabulary([bytes([i]) for i in range(256)]), vocab_size=4, mode="string")
    try:
        token = int(forward_rows(wrapped.new_session(), context, 1, greedy=True)[-1])
    except DraftUnavailable:
        assert drafter_fn is not completes_the_emoji  # there the rest of the character is a target token
        return
    assert drafter_fn is completes_the_emoji and token == EMOJI_T.index(b"\x99\x82")


@pytest.mark.parametrize("method, lookahead, tree", [("si", 3, "2,2"), ("dsi", 2, "auto"), ("dsi", 2, "branches:0.05")])
def test_draft_trees_branch_through_the_intersection_and_fall_back_to_chains_in_string_mode(
        method, lookahead, tree, no_thread_leak):
    """String mode proposes one settled target token per position, no law over alternatives: a chain,
    said in the stats; the intersection gives a law over target ids, so it branches."""
    target, wrapped = written_pair("auto")
    decoder = build_decoder(target=target, drafter=wrapped, method=method, lookahead=lookahead, draft_tree=tree)
    try:
        greedy = decoder.generate(make_request([0, 3], 8, GREEDY, None, 4))
        sampled = decoder.generate(make_request([0, 3], 8, SamplingParams(temperature=1.0, seed=5), None, 4))
    finally:
        decoder.close()
    assert greedy.tokens == dsi.generate(target=target, prompt=[0, 3], method="ar", max_new_tokens=8).tokens
    assert greedy.stats.extra["draft_tree"] == "chain" and "string mode" in greedy.stats.extra["draft_tree_fallback"]
    assert "tree_windows" not in greedy.stats.extra
    assert sampled.stats.extra["vocab_mode"] == "intersection" and sampled.stats.extra["draft_tree"] == tree
    assert sampled.stats.extra["tree_windows"] > 0


@pytest.mark.parametrize("method", ["si", "dsi"])
def test_a_word_level_drafter_in_string_mode_drafts_what_the_target_writes(method, no_thread_leak):
    """Issue 24, item 6: a tiny Llama over a WordLevel tokenizer (decode joins words with spaces) and, as
    drafter, the same weights over a permuted vocabulary under its own tokenizer: the same text, so string
    mode must accept every draft (it accepted none when a word spelled "w5" instead of " w5")."""
    needs_hf()
    import torch
    import transformers

    from dsi.models.hf.model import HFModel

    target_tok, drafter_tok = tiny_vocab.word_level_tokenizer(), tiny_vocab.word_level_tokenizer(seed=0)
    perm = [drafter_tok.convert_tokens_to_ids(w) for w in tiny_vocab.WORD_LEVEL_WORDS]  # target word i's drafter id
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      initializer_range=0.3, eos_token_id=2, bos_token_id=1)
    target_raw, drafter_raw = transformers.LlamaForCausalLM(config).eval(), transformers.LlamaForCausalLM(config).eval()
    drafter_raw.load_state_dict(target_raw.state_dict())
    order = torch.empty(100, dtype=torch.long)  # drafter row j takes the target's row of the same word
    order[:3] = torch.arange(3)
    order[torch.tensor(perm)] = torch.arange(3, 100)
    with torch.no_grad():
        drafter_raw.model.embed_tokens.weight.copy_(target_raw.model.embed_tokens.weight[order])
        drafter_raw.lm_head.weight.copy_(target_raw.lm_head.weight[order])
    target, drafter = HFModel(target_raw, target_tok, name="words"), HFModel(drafter_raw, drafter_tok, name="permuted")
    for text in ("w1 w5 w9", "w40 w2"):
        prompt = target_tok.encode(text, add_special_tokens=False)
        want = dsi.generate(target=target, prompt=prompt, method="ar", max_new_tokens=10).tokens
        out = dsi.generate(target=target, drafter=drafter, prompt=prompt, method=method, lookahead=3,
                           max_new_tokens=10, vocab_mode="string")
        assert out.tokens == want and out.stats.extra["vocab_mode"] == "string"
        assert out.stats.acceptance_rate == 1.0, text


# ---- canonical spelling: the drafter's row after a text does not depend on how the session got there ----------


SALAD_TEXTS = ["the quick brown fox", " helicopter wondering hello", "hello, world. the lazy dog jumps over"]


@pytest.mark.hf
@pytest.mark.parametrize("target_name, drafter_name", [("words", "tiny_hf"), ("bytes", "words"), ("tiny_hf", "words")])
@pytest.mark.parametrize("text", SALAD_TEXTS)
def test_the_drafter_row_after_a_text_is_the_same_whatever_the_session_did_before(target_name, drafter_name, text):
    """Regression: the drafter's tokens were the text spelled as it arrived (one target token at a time,
    or a whole prompt at once, or the rest after a roll-back), so the drafter's row after one text, and
    with it a sampled draft, followed the session's history: a seeded request drew other tokens after
    another request, or on another lookahead. Now the drafter holds the target tokens spelled one by one,
    whichever path led there."""
    needs_hf()
    target_vocab, drafter_vocab = tiny_vocab.vocabulary(target_name), tiny_vocab.vocabulary(drafter_name)
    drafter = tiny_vocab.word_salad_lm(drafter_name, seed=3)  # its row follows the drafter token ids
    wrapped = CrossVocabularyDrafter(drafter, target_vocab, drafter_vocab, vocab_size=len(target_vocab),
                                     mode="intersection")
    tokens = tiny_vocab.encode(target_name, text)
    pieces = tiny_vocab.encode(target_name, text[:5]) + tiny_vocab.encode(target_name, text[5:])  # another cut
    other = tiny_vocab.encode(target_name, "wonder over the dogs")

    def at_once(session, toks):
        return session.extend_rows(toks, None, 1, False)[-1]

    def one_by_one(session, toks):
        return [session.extend_rows([t], None, 1, False) for t in toks][-1][-1]

    def after_a_longer_text(session, toks):
        at_once(session, toks + other)
        session.truncate(len(toks) - 1)
        return session.extend_rows(toks[-1:], None, 1, False)[-1]

    def after_another_request(session, toks):
        one_by_one(session, other)
        session.truncate(0)
        return one_by_one(session, toks)

    for toks in (tokens, pieces):
        rows, spellings = {}, {}
        for path in (at_once, one_by_one, after_a_longer_text, after_another_request):
            session = wrapped.new_session()
            rows[path.__name__] = row = path(session, toks)
            spellings[path.__name__] = tuple(session._d_tokens)
            assert np.isfinite(row).any()
        canonical = tuple(t for token in toks for t in drafter_vocab.spell(target_vocab.piece(token)))
        assert set(spellings.values()) == {canonical}, spellings
        first = next(iter(rows.values()))
        for key, row in rows.items():
            np.testing.assert_array_equal(row, first, err_msg=key)


class CountingSession:
    """A drafter session (of a ``CallableLM``) with ``tree_rows`` that counts its tree forwards."""

    def __init__(self, model):
        self._inner = model.new_session()
        self.tree_forwards = 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def tree_rows(self, prefix, tree, cancel=None, *, greedy=False, top=None):
        from dsi.models.base import path_tree_rows

        self.tree_forwards += 1
        return path_tree_rows(self._inner, prefix, tree, cancel, greedy=greedy, top=top)


@pytest.mark.hf
@pytest.mark.parametrize("merges", [0, 3])
@pytest.mark.parametrize("target_name, drafter_name", [("words", "tiny_hf"), ("bytes", "words"), ("tiny_hf", "words")])
def test_a_draft_tree_through_the_intersection_is_one_drafter_forward_with_every_node_s_own_row(target_name,
                                                                                                drafter_name, merges):
    """The bridge's ``tree_rows``: every node's token spelled below its parent's spelling forms one tree of
    drafter tokens, computed in one drafter tree forward (and one more for the merges' lookahead, if any node
    needs one); each node's row is exactly the row a session reaching that path gives, and the session then
    holds the prefix and the tree's main path."""
    needs_hf()
    from dsi.models.base import tree_rows
    from dsi.trees import DraftTree

    target_vocab, drafter_vocab = tiny_vocab.vocabulary(target_name), tiny_vocab.vocabulary(drafter_name)
    drafter = tiny_vocab.word_salad_lm(drafter_name, seed=3)
    counting = CallableLM(drafter.next_logits, drafter.vocab_size)
    sessions = []
    counting.new_session = lambda: sessions.append(CountingSession(drafter)) or sessions[-1]
    wrapped = CrossVocabularyDrafter(counting, target_vocab, drafter_vocab, vocab_size=len(target_vocab),
                                     mode="intersection", merges=merges)
    enc = lambda text: tiny_vocab.encode(target_name, text)  # noqa: E731
    prefix = enc("the quick bro")
    pieces = [enc(t) for t in ("wn", "w", " fox", "n fox", " dog", "ken")]
    nodes, parents, ends = [], [], []
    for piece, parent_piece in zip(pieces, [None, None, 0, 1, 0, None]):  # a tree over the pieces' tokens
        parent = -1 if parent_piece is None else ends[parent_piece]
        for token in piece:
            siblings = [i for i, p in enumerate(parents) if p == parent]
            same = [i for i in siblings if nodes[i] == token]
            if same:
                parent = same[0]
                continue
            nodes.append(token)
            parents.append(parent)
            parent = len(nodes) - 1
        ends.append(parent)
    tree = DraftTree(tuple(nodes), tuple(parents))
    session = wrapped.new_session()
    session.extend_rows(enc("the lazy dog"), None, 1, False)  # some other text first
    before, lookaheads = sessions[0].tree_forwards, session.counters["drafter_merge_forwards"]
    rows = tree_rows(session, prefix, tree)
    lookaheads = session.counters["drafter_merge_forwards"] - lookaheads
    assert lookaheads == 0 if merges == 0 else lookaheads <= 1
    assert sessions[0].tree_forwards - before == 1 + lookaheads
    for node in range(-1, len(tree)):
        fresh = wrapped.new_session()
        path = prefix + (tree.path_tokens(node) if node >= 0 else [])
        want = fresh.extend_rows(path, None, 1, False)[-1]
        np.testing.assert_array_equal(rows[1 + node], want, err_msg=f"node {node}")
    held = prefix + tree.path_tokens(tree.main_path()[-1])
    assert session.tokens == tuple(held)
    after = session.extend_rows(enc(" over"), None, 1, False)[-1]
    np.testing.assert_array_equal(after, wrapped.new_session().extend_rows(held + enc(" over"), None, 1, False)[-1])
    greedy = tree_rows(wrapped.new_session(), prefix, tree, greedy=True)
    np.testing.assert_array_equal(greedy, np.argmax(rows, axis=-1))


@pytest.mark.hf
@pytest.mark.parametrize("method, lookahead", [("si", 4), ("dsi", 3)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_branches_through_the_intersection_draft_in_one_forward_and_decide_as_path_by_path(method, lookahead,
                                                                                           temperature,
                                                                                           no_thread_leak):
    """``branches`` with a drafter of another vocabulary: with a drafter that computes trees in one forward
    (``WithLatency`` of zero latency) each round of SI's tree is one drafter forward, and DSI drafts the
    token after each side child in the main path's forward; the tokens are those of the same drafter path
    by path (the rows are the same); greedy, non-SI's; sampled DSI, ``auto``'s with the same floor."""
    needs_hf()
    from dsi.models import WithLatency

    target = tiny_vocab.word_salad_lm("words")
    drafter = tiny_vocab.word_salad_lm("tiny_hf", seed=7)
    prompt = tiny_vocab.encode("words", "the quick")
    params = SamplingParams(temperature=temperature, seed=3)
    runs = {}
    for name, model in (("one forward", WithLatency(drafter, 0.0, 0.0)), ("path by path", drafter)):
        runs[name] = dsi.generate(target=target, drafter=model, prompt=prompt, max_new_tokens=24, method=method,
                                  lookahead=lookahead, draft_tree="branches:0.05", sampling=params,
                                  vocab_mode="intersection", target_tokenizer=target.tokenizer,
                                  drafter_tokenizer=drafter.tokenizer)
    one, paths = runs["one forward"], runs["path by path"]
    assert one.tokens == paths.tokens
    assert one.stats.extra["draft_tree"] == "branches:0.05" and one.stats.extra["tree_windows"] > 0
    if method == "si":
        assert one.stats.extra["drafter_model_forwards"] < paths.stats.extra["drafter_model_forwards"]
    elif temperature > 0:
        assert one.tokens == dsi.generate(target=target, drafter=drafter, prompt=prompt, max_new_tokens=24,
                                          method="dsi", lookahead=lookahead, sampling=params,
                                          draft_tree="auto:0.05", vocab_mode="intersection", target_tokenizer=target.tokenizer,
                                          drafter_tokenizer=drafter.tokenizer).tokens
    if temperature == 0.0:
        assert one.tokens == dsi.generate(target=target, prompt=prompt, max_new_tokens=24, method="ar").tokens


# ---- structured output -------------------------------------------------------------------------------------

CALL = {"type": "object", "properties": {"w": {"enum": ["the quick", "brown fox", "lazy dog"]},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["w", "n"], "additionalProperties": False}


@pytest.mark.hf
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("mode", ["auto", "string", "intersection"])
def test_a_constrained_request_with_a_drafter_of_another_tokenizer_equals_constrained_non_si(mode, no_thread_leak):
    """The constraint's mask is in the target's vocabulary: the drafter's proposals that break it are rejected
    like any wrong draft (an oracle drafter that writes the constrained text, with mistakes, in its own tokens:
    accepted drafts and rejections), and the output is constrained non-SI's, valid under the schema."""
    import json

    from dsi.constraints import Constraint

    needs_hf()
    jsonschema = pytest.importorskip("jsonschema")
    target = tiny_vocab.hf_model("words", 0)
    params = SamplingParams(constraint=Constraint.json_schema(CALL))
    vocab = tiny_vocab.vocabulary("words")
    prompts = [tiny_vocab.encode("words", t) for t in ("the", "hello world, ")]
    refs = [dsi.generate(target=target, prompt=p, method="ar", max_new_tokens=40, sampling=params).tokens
            for p in prompts]
    for ref in refs:
        assert ref[-1] in target.eos_token_ids  # the grammar ended it
        jsonschema.validate(json.loads(tiny_vocab.tokenizer("words").decode(ref[:-1])), CALL)
    drafter = tiny_vocab.oracle_lm("multilingual", [vocab.spelling(p + r) for p, r in zip(prompts, refs)],
                                   mistakes=every_few_bytes)
    accepted = rejections = 0
    for method, lookahead, servers in [("si", 3, 1), ("dsi", 3, 2), ("dsi", "auto", 2)]:
        for prompt, ref in zip(prompts, refs):
            out = dsi.generate(target=target, drafter=drafter, prompt=prompt, method=method, lookahead=lookahead,
                               num_target_servers=servers, max_new_tokens=40, sampling=params, vocab_mode=mode)
            assert out.tokens == ref, (method, lookahead, servers)
            # a constrained greedy request's rows are processed, so auto drafts through the intersection (as with
            # penalties: its rows processed alike)
            assert out.stats.extra["vocab_mode"] == ("intersection" if mode == "auto" else mode)
            accepted += out.stats.accepted_tokens
            rejections += out.stats.rejections
    assert accepted > 10 and rejections > 0
