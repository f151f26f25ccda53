"""Vocabularies as byte strings (dsi.models.vocab.vocabulary) and choosing how a drafter is bridged
(dsi.models.vocab.bridge.bridge_drafter).

Pieces read from byte-level tokenizers are the bytes ``decode`` gives for whole characters;
``spell`` gives back any byte string, invalid or partial UTF-8 included; ``tokens_of_prefix``
never spells past its data; an intersection pairs tokens spelling the same bytes and restricts a
drafter's logits to them; ``bridge_drafter`` keeps a drafter of the same vocabulary, wraps one of
another, and refuses what cannot be bridged with errors that say why.
"""

from __future__ import annotations

import numpy as np
import pytest

from dsi.errors import ConfigError, VocabularyMismatchError
from dsi.models import CallableLM
from dsi.models.vocab.bridge import CrossVocabularyDrafter, bridge_drafter
from dsi.models.vocab.vocabulary import Intersection, Vocabulary, same_vocabulary
from tests import tiny_vocab
from tests.tiny_vocab import UNSTABLE_TEXTS, PiecesTokenizer, pieces_vocabulary

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

HF_NAMES = ["bytes", "words", "multilingual", "tiny_hf"]


def hf_vocab(name: str) -> Vocabulary:
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    return tiny_vocab.vocabulary(name)


def hf_tokenizer(name: str):
    hf_vocab(name)
    return tiny_vocab.tokenizer(name)


# ---- pieces -------------------------------------------------------------------------------------------


@pytest.mark.hf
@pytest.mark.parametrize("name", HF_NAMES)
def test_byte_level_pieces_are_the_bytes_decode_gives_for_whole_characters(name):
    tok, vocab = hf_tokenizer(name), hf_vocab(name)
    assert len(vocab) == len(tok)
    whole = partial = 0
    for token, piece in enumerate(vocab.pieces):
        assert piece, f"token {token} ({tok.convert_ids_to_tokens(token)!r}) has no piece"
        try:
            text = piece.decode("utf-8")
        except UnicodeDecodeError:
            partial += 1  # a piece of a character: decode() cannot show its bytes
            continue
        whole += 1
        assert tok.decode([token]) == text, token
    # every single byte is a token of its own in a byte-level vocabulary (so any bytes are spellable)
    assert all(bytes([b]) in vocab.by_piece for b in range(256))
    assert whole > 0 and partial > 0  # both kinds of token exist (bytes 0x80-0xff at least)


@pytest.mark.hf
@pytest.mark.parametrize("name", HF_NAMES)
@pytest.mark.parametrize("text", UNSTABLE_TEXTS)
def test_the_tokens_of_a_text_spell_its_bytes(name, text):
    tok, vocab = hf_tokenizer(name), hf_vocab(name)
    ids = tok.encode(text, add_special_tokens=False)
    assert vocab.spelling(ids) == text.encode("utf-8")
    assert vocab.spell(text.encode("utf-8")) == ids  # whole text: the tokenizer's own tokens
    assert vocab.tokens_of_prefix(text.encode("utf-8")) == ids


@pytest.mark.hf
def test_specials_spell_their_text_and_start_ids_are_empty_for_these_tokenizers():
    chat, words = hf_vocab("bytes"), hf_vocab("words")
    assert chat.piece(hf_tokenizer("bytes").convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"
    assert words.piece(hf_tokenizer("words").eos_token_id) == b"</s>"
    assert chat.start_ids == () and words.start_ids == ()
    assert chat.piece(10**6) == b"" and chat.piece(-1) == b""


@pytest.mark.hf
@pytest.mark.hf
def test_tokenizers_whose_decoders_join_tokens_spell_words_with_the_space_between_them():
    """WordLevel (no decoder: decode joins with spaces) and WordPiece (``##`` continuations join without):
    a word spells " word", so the pieces of a text's tokens spell the decoded text (after the space the
    tokenizer puts before its first word, which encoding undoes as for SentencePiece)."""
    pytest.importorskip("tokenizers")
    for tok, text in ((tiny_vocab.word_level_tokenizer(), "w1 w52 w7"),
                      (tiny_vocab.word_piece_tokenizer(), "the cats sat on a mat playing")):
        vocab = Vocabulary.from_tokenizer(tok, len(tok))
        ids = tok.encode(text, add_special_tokens=False)
        assert vocab.spelling(ids) == b" " + tok.decode(ids).encode()
        assert vocab.spell((" " + text).encode()) == ids
    wp = Vocabulary.from_tokenizer(tiny_vocab.word_piece_tokenizer(), 14)
    assert wp.piece(4) == b"ing" and wp.piece(3) == b" play" and wp.piece(0) == b"[UNK]"


def test_from_tokenizer_pads_or_cuts_to_the_model_s_rows():
    tok = hf_tokenizer("bytes")
    padded = Vocabulary.from_tokenizer(tok, len(tok) + 5)
    assert len(padded) == len(tok) + 5 and padded.pieces[-5:] == (None,) * 5
    assert padded.piece(len(tok) + 1) == b""
    cut = Vocabulary.from_tokenizer(tok, 100)
    assert len(cut) == 100 and cut.pieces == hf_vocab("bytes").pieces[:100]


def test_bad_ids_data_and_sizes_are_config_errors_naming_them():
    vocab = Vocabulary([b"a", b"b", None], lambda text: [], name="abc")
    assert vocab.piece(np.int64(1)) == b"b" and vocab.piece(7) == b"" and vocab.piece(-1) == b""  # unknown: empty
    for bad in (1.5, "a", None, True, [1]):
        with pytest.raises(ConfigError, match=r"token=.* is not a token id: an integer in \[0, 3\) of abc"):
            vocab.piece(bad)
    with pytest.raises(ConfigError, match=r"token=1.5 \(float\) is not a token id"):
        vocab.spelling([1.5])
    for bad in ("ab", None, [97]):
        with pytest.raises(ConfigError, match=r"data=.* must be bytes"):
            vocab.spell(bad)
        with pytest.raises(ConfigError, match=r"data=.* must be bytes"):
            vocab.tokens_of_prefix(bad)
    assert vocab.spell(bytearray(b"ab")) == [0, 1]
    tok = hf_tokenizer("bytes")
    for size in (-1, 2.5, True):
        with pytest.raises(ConfigError, match=rf"size={size!r} must be an integer >= 0"):
            Vocabulary.from_tokenizer(tok, size)


def test_from_tokenizer_without_a_tokenizer_is_a_config_error():
    with pytest.raises(ConfigError, match="tokenizer is needed"):
        Vocabulary.from_tokenizer(None)


def test_a_tokenizer_without_a_byte_level_decoder_falls_back_to_decode():
    tok = PiecesTokenizer(["a", "b", "ab", "日", ""])
    vocab = Vocabulary.from_tokenizer(tok)
    assert vocab.pieces == (b"a", b"b", b"ab", "日".encode(), None)
    assert vocab.by_piece == {b"a": 0, b"b": 1, b"ab": 2, "日".encode(): 3}


# ---- spell and tokens_of_prefix ------------------------------------------------------------------------

# text made of the characters the tokenizers cut differently, and raw bytes anywhere in it
_chars = st.sampled_from(list("helowrd ., \n") + ["ï", "é", "日", "本", "語", "🙂", "🚀", "👍🏽", "🇫🇷", "<|im_end|>"])
_texts = st.lists(_chars, max_size=12).map("".join)
_bytes = st.one_of(
    st.binary(max_size=24),
    _texts.map(lambda t: t.encode("utf-8")),
    st.tuples(_texts, st.integers(0, 60)).map(lambda p: p[0].encode("utf-8")[: p[1]]),  # cut anywhere
    st.tuples(_texts, st.binary(max_size=3), _texts).map(lambda p: p[0].encode() + p[1] + p[2].encode()),
)


@pytest.mark.hf
@pytest.mark.parametrize("name", HF_NAMES)
@settings(max_examples=150, deadline=None)
@given(data=_bytes)
def test_spell_round_trips_any_bytes(name, data):
    vocab = hf_vocab(name)
    tokens = vocab.spell(data)
    assert tokens is not None
    assert vocab.spelling(tokens) == data
    assert all(vocab.piece(t) for t in tokens)  # no token that spells nothing


@pytest.mark.hf
@pytest.mark.parametrize("name", HF_NAMES)
@settings(max_examples=150, deadline=None)
@given(data=_bytes)
def test_tokens_of_prefix_never_spell_beyond_the_data(name, data):
    vocab = hf_vocab(name)
    tokens = vocab.tokens_of_prefix(data)
    spelled = vocab.spelling(tokens)
    assert data.startswith(spelled)
    try:
        whole = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start == 0 and exc.reason != "unexpected end of data":
            return  # the rest of a cut character first: spelled by pieces (test_..._rest_of_a_cut_character)
        whole = data[: exc.start].decode("utf-8")
    assert len(spelled) <= len(whole.encode("utf-8"))  # nothing from past the first broken character


def test_tokens_of_prefix_spell_the_rest_of_a_cut_character_then_text():
    vocab = pieces_vocabulary([b"a", b"\x99", b"\x99\x82", b"\x82", "日".encode()])
    assert vocab.tokens_of_prefix(b"\x99\x82a") == [2, 0]  # the longest piece first, then the text
    assert vocab.tokens_of_prefix(b"\x82\x99") == [3, 1]
    assert vocab.tokens_of_prefix("日".encode()[:2]) == []  # unfinished: wait for its last byte
    assert vocab.tokens_of_prefix(b"\xff") == []  # no piece spells it


@pytest.mark.parametrize("data, expected", [
    (b"", []),
    ("日".encode()[:2], None),  # no single-byte tokens for these bytes here
    (b"ab", [2]),
    (b"ba", [1, 0]),
    (b"abc", None),  # c is no piece
])
def test_spell_without_single_byte_tokens(data, expected):
    vocab = pieces_vocabulary([b"a", b"b", b"ab", "日".encode()])
    assert vocab.spell(data) == expected


@pytest.mark.hf
@pytest.mark.parametrize("data", ["日".encode()[:1], "日".encode()[:2], "🙂".encode()[1:], b"\xff\xfe", b"a\xf0\x9f",
                                  "naïve".encode()[:3], "👍🏽".encode()[:6], b"\xed\xa0\x80" + "é".encode()])
def test_spell_of_partial_characters_uses_byte_tokens(data):
    for name in HF_NAMES:
        vocab = hf_vocab(name)
        tokens = vocab.spell(data)
        assert tokens is not None and vocab.spelling(tokens) == data, name


@pytest.mark.hf
def test_tokens_of_prefix_stop_before_a_broken_character():
    vocab = hf_vocab("multilingual")
    text = "naïve 日本".encode()
    for cut in range(len(text) + 1):
        tokens = vocab.tokens_of_prefix(text[:cut])
        assert text[:cut].startswith(vocab.spelling(tokens))
    assert vocab.tokens_of_prefix("日".encode()[:2]) == []


# ---- intersections --------------------------------------------------------------------------------------

PAIRS = [("bytes", "words"), ("words", "multilingual"), ("multilingual", "tiny_hf"), ("bytes", "multilingual")]


@pytest.mark.hf
@pytest.mark.parametrize("target, drafter", PAIRS)
def test_intersection_pairs_tokens_that_spell_the_same_bytes(target, drafter):
    t, d = hf_vocab(target), hf_vocab(drafter)
    inter = Intersection.of(t, d)
    assert inter.size == len(set(t.by_piece) & set(d.by_piece)) > 0
    for ti, di in zip(inter.target_ids.tolist(), inter.drafter_ids.tolist(), strict=True):
        assert t.piece(ti) == d.piece(di) != b""
    assert len(set(inter.target_ids.tolist())) == inter.size == len(set(inter.drafter_ids.tolist()))
    back = Intersection.of(d, t)  # symmetric: the same pairs, roles swapped
    assert back.size == inter.size
    assert sorted(zip(back.drafter_ids.tolist(), back.target_ids.tolist(), strict=True)) == sorted(
        zip(inter.target_ids.tolist(), inter.drafter_ids.tolist(), strict=True))


def test_intersection_of_written_vocabularies():
    t = pieces_vocabulary([b"a", b"b", b"ab", b"c"])
    d = pieces_vocabulary([b"b", b"a", b"ba", b"c", b"d"])
    inter = Intersection.of(t, d)
    assert inter.target_ids.tolist() == [0, 1, 3] and inter.drafter_ids.tolist() == [1, 0, 3]
    assert Intersection.of(d, t).size == 3
    assert Intersection.of(t, pieces_vocabulary([b"x", b"y"])).size == 0


@pytest.mark.hf
@pytest.mark.parametrize("target, drafter", PAIRS[:2])
def test_target_logits_are_the_drafter_s_on_the_intersection_and_minus_inf_elsewhere(target, drafter):
    t, d = hf_vocab(target), hf_vocab(drafter)
    inter = Intersection.of(t, d)
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        row = rng.normal(size=len(d)).astype(dtype)  # [V_d]
        out = inter.target_logits(row, len(t) + 3)  # [V_t + 3]: padded logit rows too
        assert out.shape == (len(t) + 3,) and out.dtype == np.result_type(dtype, np.float32)
        np.testing.assert_array_equal(out[inter.target_ids], row[inter.drafter_ids])
        off = np.ones(out.size, dtype=bool)
        off[inter.target_ids] = False
        assert np.all(np.isneginf(out[off]))
        # after softmax: the drafter's law restricted to the intersection, renormalized
        law = np.exp(row.astype(np.float64) - row.max())
        law /= law.sum()
        restricted = np.zeros(out.size)
        restricted[inter.target_ids] = law[inter.drafter_ids] / law[inter.drafter_ids].sum()
        soft = np.exp(out.astype(np.float64) - out.max())
        np.testing.assert_allclose(soft / soft.sum(), restricted, rtol=1e-6, atol=1e-12)


# ---- same_vocabulary and bridge_drafter ------------------------------------------------------------------


def lm(size: int, tokenizer=None, name: str = "lm") -> CallableLM:
    model = CallableLM(lambda ctx: np.zeros(size), size, name=name)
    if tokenizer is not None:
        model.tokenizer = tokenizer
    return model


@pytest.mark.hf
def test_same_vocabulary_compares_token_ids():
    fresh = tiny_vocab.byte_tokenizer.__wrapped__()  # an equal tokenizer, another object
    assert same_vocabulary(hf_tokenizer("bytes"), hf_tokenizer("bytes"))
    assert same_vocabulary(hf_tokenizer("bytes"), fresh)
    assert not same_vocabulary(hf_tokenizer("bytes"), hf_tokenizer("multilingual"))


@pytest.mark.hf
def test_bridge_keeps_a_drafter_of_the_same_vocabulary_under_auto_and_shared():
    tok = hf_tokenizer("words")
    target = lm(len(tok), tok, "t")
    drafter = lm(len(tok), tiny_vocab.word_tokenizer.__wrapped__(), "d")
    assert bridge_drafter(target, drafter, "auto") is drafter
    assert bridge_drafter(target, drafter, "shared") is drafter
    no_tokenizers = lm(len(tok))
    assert bridge_drafter(lm(len(tok)), no_tokenizers) is no_tokenizers  # equal sizes, nothing to compare


@pytest.mark.hf
@pytest.mark.parametrize("mode", ["string", "intersection"])
def test_bridge_wraps_a_drafter_of_the_same_vocabulary_when_a_translation_is_forced(mode):
    tok = hf_tokenizer("words")
    drafter = lm(len(tok), tok, "d")
    wrapped = bridge_drafter(lm(len(tok), tok, "t"), drafter, mode)
    assert isinstance(wrapped, CrossVocabularyDrafter) and wrapped.drafter is drafter
    assert wrapped.mode == mode and wrapped.vocab_size == len(tok)
    assert wrapped.intersection.size == len(tok)
    assert wrapped.drafter_eos_ids == {tok.eos_token_id}


@pytest.mark.hf
@pytest.mark.parametrize("mode", ["auto", "string", "intersection"])
def test_bridge_wraps_a_drafter_of_another_vocabulary(mode):
    t_tok, d_tok = hf_tokenizer("multilingual"), hf_tokenizer("words")
    target, drafter = lm(len(t_tok) + 4, t_tok, "t"), lm(len(d_tok), d_tok, "d")  # padded target rows
    wrapped = bridge_drafter(target, drafter, mode)
    assert isinstance(wrapped, CrossVocabularyDrafter)
    assert wrapped.mode == mode and wrapped.vocab_size == target.vocab_size
    assert len(wrapped.target_vocabulary) == target.vocab_size
    assert wrapped.intersection.size == Intersection.of(hf_vocab("multilingual"), hf_vocab("words")).size
    assert wrapped.drafter_eos_ids == {d_tok.eos_token_id}
    assert wrapped.mode_for(True) == ("intersection" if mode == "intersection" else "string")
    assert wrapped.mode_for(False) == ("string" if mode == "string" else "intersection")
    # tokenizers passed explicitly take the place of missing attributes
    explicit = bridge_drafter(lm(len(t_tok)), lm(len(d_tok)), mode, target_tokenizer=t_tok, drafter_tokenizer=d_tok)
    assert explicit.intersection.size == wrapped.intersection.size


@pytest.mark.hf
def test_shared_with_different_vocabularies_is_a_vocabulary_mismatch():
    t_tok, d_tok = hf_tokenizer("multilingual"), hf_tokenizer("words")
    with pytest.raises(VocabularyMismatchError, match=r"vocab_size=395 differs from target vocab_size=380.*"
                                                      r"vocab_mode='shared'.*vocab_mode='auto'"):
        bridge_drafter(lm(len(t_tok), t_tok), lm(len(d_tok), d_tok), "shared")
    # the same number of ids, mapped differently
    same_size = PiecesTokenizer([chr(0x100 + i) for i in range(len(t_tok))])
    with pytest.raises(VocabularyMismatchError, match="different ids.*vocab_mode='shared'"):
        bridge_drafter(lm(len(t_tok), t_tok), lm(len(t_tok), same_size), "shared")


@pytest.mark.parametrize("mode", ["auto", "string", "intersection"])
@pytest.mark.parametrize("missing", ["target", "drafter"])
def test_a_missing_tokenizer_is_a_vocabulary_mismatch_that_says_which(mode, missing):
    tok = PiecesTokenizer(["a", "b", "c"])
    target = lm(3) if missing == "target" else lm(3, tok)
    drafter = lm(4) if missing == "drafter" else lm(4, PiecesTokenizer(["a", "b", "c", "d"]))
    with pytest.raises(VocabularyMismatchError, match=rf"vocab_size=4 differs from target vocab_size=3.*"
                                                      rf"the {missing} model has none"):
        bridge_drafter(target, drafter, mode)


@pytest.mark.parametrize("mode", ["string", "intersection"])
def test_a_forced_translation_without_tokenizers_is_a_vocabulary_mismatch(mode):
    with pytest.raises(VocabularyMismatchError, match=rf"vocab_mode='{mode}' translates text.*target model has none"):
        bridge_drafter(lm(3), lm(3), mode)


def test_vocabularies_that_share_no_piece_cannot_be_bridged():
    with pytest.raises(VocabularyMismatchError, match="cannot be bridged"):
        bridge_drafter(lm(2, PiecesTokenizer(["a", "b"])), lm(2, PiecesTokenizer(["x", "y"])), "auto")


@pytest.mark.parametrize("bad", ["bogus", "", None, "SHARED"])
def test_a_bad_vocab_mode_is_a_config_error_naming_it(bad):
    import dsi

    with pytest.raises(ConfigError, match=rf"vocab_mode={bad!r}".replace("(", r"\(")):
        bridge_drafter(lm(3), lm(3), bad)
    with pytest.raises(ConfigError, match=rf"vocab_mode={bad!r}"):
        dsi.build_decoder(target=lm(3), drafter=lm(3), vocab_mode=bad)
    with pytest.raises(ConfigError, match=rf"vocab_mode={bad!r}"):
        dsi.generate(target=lm(3), drafter=lm(3), prompt=[0], max_new_tokens=1, vocab_mode=bad)


def test_the_wrapper_itself_takes_translating_modes_only():
    with pytest.raises(ConfigError, match="mode='shared'"):
        CrossVocabularyDrafter(lm(3), pieces_vocabulary([b"a"]), pieces_vocabulary([b"a"]), vocab_size=3,
                               mode="shared")


# ---- where a text is final, and tokenizers that add a space -------------------------------------------


@pytest.mark.parametrize("data, start", [
    (b" th", 0),  # one unfinished word: nothing is final
    (b" the quick", 4),  # " the" is final once " quick" began
    (b"def f(x):", 7),  # punctuation runs are pieces of their own
    (b"a\n    return", 5),  # GPT-2 keeps one space for the word: "\n   " then " return"
    (b"x = 10", 3),
    (b"\x99\x82abc de", 5),  # the rest of a cut character is final
    ("日本語".encode(), 0),
])
def test_last_word_start(data, start):
    from dsi.models.vocab.vocabulary import last_word_start

    assert last_word_start(data) == start


@pytest.mark.hf
def test_a_tokenizer_that_adds_a_space_before_every_text_is_undone():
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer(add_prefix_space=True)
    bpe.train_from_iterator(["the quick brown fox"] * 20, vocab_size=300, min_frequency=1, special_tokens=["<s>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<s>")
    vocab = Vocabulary.from_tokenizer(tok)
    assert vocab.spelling(tok.encode("quick", add_special_tokens=False)) == b" quick"  # the added space
    tokens = vocab.tokens_of_prefix(b" quick brown")
    assert vocab.spelling(tokens) == b" quick brown" and len(tokens) == 2
    for data in (b" quick brown", b"quick brown", b"the fox"):
        assert vocab.spelling(vocab.spell(data)) == data
    assert vocab.spelling(vocab.tokens_of_prefix(b"quick fox")) == b"quick fox"  # no space to start with
