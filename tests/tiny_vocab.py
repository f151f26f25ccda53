"""Tokenizers that genuinely differ, and tiny models over each, for the cross-vocabulary tests.

Everything is built in-test with the ``tokenizers`` library wrapped in
``transformers.PreTrainedTokenizerFast``; nothing is downloaded:

- :func:`byte_tokenizer`: byte-level BPE with no merges (256 single-byte tokens + the chat specials
  of :mod:`tests.tiny_hf`): every character of more than one byte spans several tokens.
- :func:`word_tokenizer`: byte-level BPE trained with many merges on a corpus of words, its own
  specials (``<s>``, ``</s>``): whole words are one token, and a word's prefix is another
  (``"hel"``, ``"help"``, ``"hello"``, ``" hello"`` -> ``" hel" "lo"``).
- :func:`multilingual_tokenizer`: byte-level BPE trained on accented, CJK and emoji text with another
  vocabulary size than :func:`tests.tiny_hf.make_tokenizer`, the chat specials.

:func:`hf_model` gives a tiny seeded random Llama (fp32) for a tokenizer as a
:class:`dsi.models.hf.model.HFModel` (``.tokenizer`` set). :func:`script_lm` and :func:`oracle_lm` give
:class:`~dsi.models.CallableLM` models over a tokenizer's ids that write a given text (the
target's own greedy text, for drafters that are often right). No tests in here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache

import numpy as np

from dsi.models import CallableLM
from dsi.models.vocab.vocabulary import Vocabulary

CHAT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
OTHER_SPECIALS = ["<s>", "</s>"]

WORDS = ("hello help helium helicopter hel world wonder wondering the then there quick brown fox jumps "
         "over lazy dog dogs speculative inference drafter target token tokens vocabulary").split()
WORD_CORPUS = [" ".join(WORDS), "".join(WORDS), " ".join(reversed(WORDS)),
               "hello, world. the quick brown fox jumps over the lazy dog."]
MULTILINGUAL_CORPUS = [
    "héllo wörld, naïve café, crème brûlée, straße, señor, coração",
    "日本語のテキストです。東京は日本の首都です。中文文本测试。",
    "emoji 🙂🚀🎉👍🏽 and flags 🇫🇷 and 🙂🙂 again 🚀",
    "Привет мир, Ελληνικά, عربى",
]

# Texts whose re-tokenization is unstable at a boundary: a prefix of a one-token word tokenizes
# differently ("hel" | "hello"), characters of several bytes (accents, CJK, emoji, a flag of two
# code points, a skin-tone modifier) that byte-level vocabularies split, specials written as text.
UNSTABLE_TEXTS = [
    "hello",
    " hel",
    "the quick brown fox",
    "naïve café 日本",
    "🙂🚀 wonder",
    "👍🏽🇫🇷 héllo",
    "<|im_start|>user\nhello<|im_end|>",
]


def _wrap(bpe, eos: str, bos: str):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=eos, bos_token=bos, pad_token=bos)


@lru_cache(maxsize=None)
def byte_tokenizer():
    """Byte-level BPE without merges: 256 single-byte tokens and the chat specials (259 ids)."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["x"], vocab_size=256 + len(CHAT_SPECIALS), min_frequency=1, special_tokens=CHAT_SPECIALS)
    return _wrap(bpe, "<|im_end|>", "<|endoftext|>")


@lru_cache(maxsize=None)
def word_tokenizer():
    """Byte-level BPE with merges enough for every word of :data:`WORDS`, specials ``<s>`` ``</s>``."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(WORD_CORPUS * 20, vocab_size=700, min_frequency=1, special_tokens=OTHER_SPECIALS)
    return _wrap(bpe, "</s>", "<s>")


@lru_cache(maxsize=None)
def multilingual_tokenizer():
    """Byte-level BPE trained on :data:`MULTILINGUAL_CORPUS` (merges inside multi-byte characters)."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(MULTILINGUAL_CORPUS * 5, vocab_size=380, min_frequency=1, special_tokens=CHAT_SPECIALS)
    return _wrap(bpe, "<|im_end|>", "<|endoftext|>")


WORD_LEVEL_WORDS = [f"w{i}" for i in range(97)]


@lru_cache(maxsize=None)
def word_level_tokenizer(seed: int | None = None):
    """A ``WordLevel`` model with a ``Whitespace`` pre-tokenizer and no decoder (decode joins tokens with
    spaces): ids 0-2 ``<unk>`` ``<s>`` ``</s>``, then the words ``w0``..``w96``, in order, or permuted
    with ``seed`` (issue 24, item 6)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    order = list(WORD_LEVEL_WORDS)
    if seed is not None:
        order = [order[i] for i in np.random.default_rng(seed).permutation(len(order))]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: 3 + i for i, w in enumerate(order)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@lru_cache(maxsize=None)
def word_piece_tokenizer():
    """A ``WordPiece`` model and decoder: ``##`` continuations join their word without a space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["[UNK]", "[CLS]", "[SEP]", "play", "##ing", "##ed", "the", "cat", "##s", "sat", "on", "mat", ".", "a"]
    tok = Tokenizer(models.WordPiece({p: i for i, p in enumerate(pieces)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[CLS]", eos_token="[SEP]")


TOKENIZERS: dict[str, Callable] = {
    "bytes": byte_tokenizer,
    "words": word_tokenizer,
    "multilingual": multilingual_tokenizer,
}


def tokenizer(name: str):
    """One of :data:`TOKENIZERS`, or ``"tiny_hf"`` (:func:`tests.tiny_hf.make_tokenizer`, cached)."""
    if name == "tiny_hf":
        return _tiny_hf_tokenizer()
    return TOKENIZERS[name]()


@lru_cache(maxsize=None)
def _tiny_hf_tokenizer():
    from tests.tiny_hf import make_tokenizer

    return make_tokenizer()


def vocabulary(name: str) -> Vocabulary:
    tok = tokenizer(name)
    return Vocabulary.from_tokenizer(tok, len(tok), name=name)


def hf_model(name: str, seed: int = 0, layers: int = 2, hidden: int = 32, positions: int = 512):
    """A random tiny Llama (fp32) over tokenizer ``name``'s ids as an ``HFModel`` with that tokenizer.

    ``initializer_range=0.3`` keeps the top logits apart, so incremental and batched forwards
    agree on every argmax (no near-ties)."""
    import torch
    import transformers

    from dsi.models.hf.model import HFModel

    tok = tokenizer(name)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
        initializer_range=0.3,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    return HFModel(model, tok, name=f"llama-{name}-{seed}", threads=1)


def encode(name: str, text: str) -> list[int]:
    return list(tokenizer(name).encode(text, add_special_tokens=False))


# ---- models that write a given text -------------------------------------------------------------


def longest_piece(vocab: Vocabulary, data: bytes) -> int | None:
    """The id of the longest piece of ``vocab`` that is a prefix of ``data`` (None if none)."""
    for n in range(min(len(data), 64), 0, -1):
        token = vocab.by_piece.get(bytes(data[:n]))
        if token is not None:
            return token
    return None


class TextFollower:
    """``next_logits(context)`` of a model over ``vocab``'s ids that writes one of ``texts``.

    After a context spelling a prefix of a text (the longest such text if several), the next token
    spells the following bytes: ``canonical``: the first of the tokenizer's own tokens of the rest
    (falling back to the longest piece where the rest does not start with whole UTF-8); else the
    longest piece. ``mistakes(at)`` true: at that byte offset it writes ``fallback`` instead (a
    wrong guess). After a whole text, or after a context that is no text's prefix, ``eos``. The
    chosen token gets logit ``margin``, every other 0. ``calls`` counts the calls.
    """

    def __init__(self, vocab: Vocabulary, texts: Sequence[bytes], *, canonical: bool, eos: int, fallback: int,
                 mistakes: Callable[[int], bool] | None = None, margin: float = 8.0) -> None:
        self.vocab, self.texts, self.canonical = vocab, [bytes(t) for t in texts], canonical
        self.eos, self.fallback, self.margin = eos, fallback, margin
        self.mistakes = mistakes or (lambda at: False)
        self.calls = 0

    def next_token(self, context: Sequence[int]) -> int:
        written = self.vocab.spelling(context)
        texts = [t for t in self.texts if t.startswith(written) and len(t) > len(written)]
        if not texts:
            return self.eos
        rest = max(texts, key=len)[len(written):]
        if self.mistakes(len(written)):
            return self.fallback
        token = None
        if self.canonical:
            ids = self.vocab.tokens_of_prefix(rest)
            token = ids[0] if ids else None
        if token is None:
            token = longest_piece(self.vocab, rest)
        return self.eos if token is None else token

    def __call__(self, context: tuple[int, ...]) -> np.ndarray:
        self.calls += 1
        row = np.zeros(len(self.vocab))
        row[self.next_token(context)] = self.margin
        return row


def script_lm(name: str, texts: str | bytes | Sequence[str | bytes], *, canonical: bool = True, mistakes=None,
              fallback_text: str = "Z") -> CallableLM:
    """A ``CallableLM`` over tokenizer ``name``'s ids writing ``texts`` (see :class:`TextFollower`),
    with ``.tokenizer`` set; its ``next_logits`` is the :class:`TextFollower`."""
    tok = tokenizer(name)
    vocab = vocabulary(name)
    if isinstance(texts, str | bytes):
        texts = [texts]
    data = [t.encode("utf-8") if isinstance(t, str) else bytes(t) for t in texts]
    follow = TextFollower(vocab, data, canonical=canonical, eos=tok.eos_token_id,
                          fallback=vocab.by_piece[fallback_text.encode()], mistakes=mistakes)
    lm = CallableLM(follow, len(tok), name=f"script-{name}")
    lm.tokenizer = tok
    return lm


def oracle_lm(name: str, target_texts: Sequence[bytes], *, mistakes=None) -> CallableLM:
    """A drafter over tokenizer ``name``'s ids that knows the target's greedy texts (bytes of prompt +
    continuation, one per prompt) and writes them in its longest pieces (so its tokens cut the
    text elsewhere than the target's); ``mistakes(at)``: a wrong token at byte offset ``at``."""
    return script_lm(name, target_texts, canonical=False, mistakes=mistakes)


def word_salad_lm(name: str, *, seed: int | None = None, words: Sequence[str] = WORDS, margin: float = 12.0) -> CallableLM:
    """A sampling model over tokenizer ``name``'s ids that writes words of ``words`` in any order, a space
    between them: after a context it gives logit ``margin`` to every piece that continues a word the last
    word begins (any length, so its text comes in many tokenizations), and to ``" "`` after a whole word.
    With ``seed``, a seeded pseudo-random function of the token ids is added (a drafter whose row follows
    the way its context was tokenized, not only the text). ``.tokenizer`` set."""
    from dsi.models.emulated.synthetic import SyntheticTarget

    tok = tokenizer(name)
    vocab = vocabulary(name)
    noise = SyntheticTarget(len(tok), seed, 1.0) if seed is not None else None

    def next_logits(context):
        last = vocab.spelling(context).rsplit(b" ", 1)[-1].decode("utf-8", "replace")
        row = np.array(noise(context), dtype=float) if noise is not None else np.zeros(len(tok))
        rests = [w[len(last):].encode() for w in words if w.startswith(last) and len(w) > len(last)]
        for rest in rests:
            for n in range(1, len(rest) + 1):
                token = vocab.by_piece.get(rest[:n])
                if token is not None:
                    row[token] += margin
        if last in words or not rests:
            row[vocab.by_piece[b" "]] += margin
        return row

    lm = CallableLM(next_logits, len(tok), name=f"salad-{name}")
    lm.tokenizer = tok
    return lm


def target_text(target_vocab: Vocabulary, prompt: Sequence[int], continuation: Sequence[int]) -> bytes:
    return target_vocab.spelling(list(prompt) + list(continuation))


# ---- vocabularies written down piece by piece -------------------------------------------------------


def greedy_encoder(pieces: Sequence[bytes | None]) -> Callable[[str], list[int]]:
    """Tokenize text by longest match over ``pieces`` (bytes no piece starts are skipped)."""
    lookup = {p: i for i, p in reversed(list(enumerate(pieces))) if p}
    longest = max((len(p) for p in lookup), default=0)

    def encode(text: str) -> list[int]:
        data, out, at = text.encode("utf-8"), [], 0
        while at < len(data):
            for n in range(min(longest, len(data) - at), 0, -1):
                token = lookup.get(data[at: at + n])
                if token is not None:
                    out.append(token)
                    at += n
                    break
            else:
                at += 1
        return out

    return encode


def pieces_vocabulary(pieces: Sequence[bytes | None], name: str = "pieces") -> Vocabulary:
    return Vocabulary(pieces, greedy_encoder(pieces), name=name)


class PiecesTokenizer:
    """The least a tokenizer needs for :meth:`Vocabulary.from_tokenizer` and ``bridge_drafter``
    (``len``, ``decode``, ``encode``, ``get_vocab``, ``eos_token_id``), over pieces that are whole
    UTF-8 text, tokenizing by longest match."""

    def __init__(self, texts: Sequence[str], eos_token_id: int | None = None) -> None:
        self.texts = list(texts)
        self.eos_token_id = eos_token_id
        self._encode = greedy_encoder([t.encode("utf-8") for t in self.texts])

    def __len__(self) -> int:
        return len(self.texts)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.texts[i] for i in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._encode(text)

    def get_vocab(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.texts)}


def save_model_dir(name: str, path, seed: int = 0, layers: int = 2, positions: int = 512):
    """:func:`hf_model` saved as a checkpoint directory (weights + its tokenizer), for the CLI and server."""
    from pathlib import Path

    model = hf_model(name, seed=seed, layers=layers, positions=positions)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.model.save_pretrained(path)
    model.tokenizer.save_pretrained(path)
    return path
