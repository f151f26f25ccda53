"""Structured output: a constraint per request, as a mask on the target's law at every position.

A :class:`Constraint` says what the output must be: text matching a JSON schema, any JSON object, a regular
expression, one of a few choices, or a grammar (Lark, or llama.cpp's GBNF). Bound to the target's vocabulary
(:func:`bind`, done by the engine when a request starts), it becomes a :class:`BoundConstraint`, which
:mod:`dsi.sampling` applies as one more processor before temperature: after output tokens ``y``, every token the
grammar does not allow next gets logit ``-inf``, so the law is the target's, masked to the grammar and
renormalised. EOS is allowed only where the grammar may end, and once it is complete EOS is the only token left,
so the request ends there.

Because the mask is a function of the output before a row (as the penalties are), every path that processes a
row applies it with the row's own prefix: non-SI, the drafter's drafts (it drafts under the constraint, so its
drafts stay valid), each verified row of SI's and DSI's windows and of a draft tree's paths, on every transport.
So constrained SI and DSI are exactly constrained non-SI: token for token greedy, in law when sampling. A row
whose prefix the grammar already refused (after a draft that will be rejected at its own row) decides nothing,
and is left unmasked.

Masks come from llguidance (chosen by measurement: docs/results.md#which-library): a grammar is compiled once
per vocabulary, each thread keeps a matcher that it rolls back to the common prefix and advances, and recent
masks are cached by prefix (the drafter, the servers and the engine ask for the same rows).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dsi.errors import ConfigError, ModelError

KINDS = ("json_schema", "json_object", "regex", "choice", "lark", "gbnf")
# JSON as json.dumps writes it: ", " and ": " between items, no other whitespace. Free whitespace lets a model
# (small ones above all) emit spaces and newlines until its tokens run out (vLLM's `disable_any_whitespace`);
# a schema's own "x-guidance" options override this.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# recent masks, by constraint and output prefix, for all constraints together (a mask is V bools: 256 of 152k ids
# are 39 MB); and the grammars compiled (a request holds its own while it runs)
_MASKS_KEPT = 256
_COMPILED_KEPT = 64
# What one constraint may cost (docs/serving.md, "What one request may cost"): its text, and llguidance's own
# budgets, fixed here rather than left to the library's defaults. Fuel is llguidance's unit of work (about 50k a
# millisecond to build the lexer, 14k a millisecond per mask); a grammar over a budget is refused when it is compiled
# (ConfigError: a 400), a mask step over one fails its request (ModelError), never a silently unconstrained output.
MAX_SOURCE_CHARS = 512 * 1024  # 128 tools of 8 parameters (tool_choice "required") are 103k characters, 39 ms
LIMITS = {
    "max_grammar_size": 500_000,  # symbols in the grammar's productions
    "max_items_in_row": 2_000,  # alternatives of one production
    "initial_lexer_fuel": 1_000_000,  # building the lexer: about 20 ms
    "step_lexer_fuel": 200_000,  # one mask's lexer work: about 15 ms
    "step_max_items": 50_000,  # one mask's parser items: about 2.5 ms
    "max_lexer_states": 250_000,  # lexer states kept (1-2 kB each)
}


@dataclass(frozen=True)
class Constraint:
    """What a request's output must be. Build one with :meth:`json_schema`, :meth:`json_object`, :meth:`regex`,
    :meth:`choice` or :meth:`grammar`; ``source`` is the schema (JSON text), the pattern, the choices (a JSON list)
    or the grammar's text."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"constraint kind {self.kind!r} must be one of {', '.join(KINDS)}")
        if not isinstance(self.source, str):
            raise ConfigError(f"a {self.kind} constraint's source must be text, got {type(self.source).__name__}")
        if len(self.source) > MAX_SOURCE_CHARS:
            raise ConfigError(f"a {self.kind} constraint of {len(self.source):,} characters is longer than the "
                              f"{MAX_SOURCE_CHARS:,} allowed")

    @classmethod
    def json_schema(cls, schema: dict | str) -> Constraint:
        """Output that parses as JSON and validates against ``schema`` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError) as exc:  # (also a number of over 4300 digits, deep nesting)
                raise ConfigError(f"the JSON schema is not JSON: {str(exc) or type(exc).__name__}") from None
        if not isinstance(schema, dict):
            raise ConfigError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema))  # its own key order: properties are generated in it

    @classmethod
    def json_object(cls) -> Constraint:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """Output that matches ``pattern`` as a whole (Rust regex syntax, as llguidance reads it)."""
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Constraint:
        """Exactly one of ``options`` (strings)."""
        options = list(options)
        if not options or not all(isinstance(o, str) and o for o in options):
            raise ConfigError(f"choice needs a non-empty list of non-empty strings, got {options!r}")
        return cls("choice", json.dumps(options))

    @classmethod
    def grammar(cls, text: str, syntax: str = "lark") -> Constraint:
        """Output in the language of a grammar: ``syntax`` ``"lark"`` (llguidance's Lark dialect) or ``"gbnf"``
        (llama.cpp's)."""
        if syntax not in ("lark", "gbnf"):
            raise ConfigError(f"grammar syntax={syntax!r} must be 'lark' or 'gbnf'")
        return cls(syntax, text)

    def llguidance_grammar(self) -> str:
        """The constraint as a grammar llguidance compiles."""
        matcher = _llguidance().LLMatcher
        if self.kind == "json_schema":
            return matcher.grammar_from_json_schema(json.loads(self.source), defaults=JSON_LAYOUT)
        if self.kind == "json_object":
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        if self.kind == "regex":
            return matcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            return matcher.grammar_from_regex("(" + "|".join(re.escape(o) for o in json.loads(self.source)) + ")")
        if self.kind == "gbnf":
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                return matcher.grammar_from_lark(gbnf_to_lark(self.source))
            except Exception as exc:  # noqa: BLE001 - the converter's own errors, quoted
                raise ConfigError(f"the GBNF grammar could not be read: {exc}") from None
        return matcher.grammar_from_lark(self.source)


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # a dependency of dsi: only a broken install lacks it
        raise ConfigError(f"structured output needs llguidance (pip install llguidance): {exc}") from exc
    return llguidance


@dataclass(frozen=True, eq=False)
class TokenTable:
    """A vocabulary as a grammar reads it: the bytes each token id stands for (``b""`` for ids no text comes
    from: padding rows, control tokens) and the ids that end the output. ``digest`` names it."""

    tokens: tuple[bytes, ...]
    eos: tuple[int, ...]
    digest: str = field(default="")

    def __post_init__(self) -> None:
        if not self.eos or not all(0 <= e < len(self.tokens) for e in self.eos):
            raise ConfigError(f"a constrained vocabulary needs its EOS ids within [0, {len(self.tokens)}), "
                              f"got {self.eos!r}")
        if not self.digest:
            h = hashlib.blake2b(digest_size=16)
            for t in self.tokens:
                h.update(len(t).to_bytes(4, "little") + t)
            h.update(repr(self.eos).encode())
            object.__setattr__(self, "digest", h.hexdigest())

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def of_tokenizer(cls, tokenizer: Any, vocab_size: int, eos: Sequence[int]) -> TokenTable:
        """The table of a Hugging Face tokenizer for rows of ``vocab_size`` ids (ids past the tokenizer: ``b""``)."""
        tokens = []
        byte_decoder = _byte_decoder()
        pieces = tokenizer.convert_ids_to_tokens(list(range(min(len(tokenizer), vocab_size))))
        special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        # byte-level BPE (GPT-2, Qwen, Llama 3) spells a space "Ġ"; SentencePiece spells it "▁" and keeps UTF-8 text
        byte_level = any(piece and "\u0120" in piece for piece in pieces)
        for i, piece in enumerate(pieces):
            if piece is None or i in special:
                tokens.append(b"")
            elif byte_level and all(ch in byte_decoder for ch in piece):
                tokens.append(bytes(byte_decoder[ch] for ch in piece))
            elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):  # SentencePiece byte fallback
                tokens.append(bytes([int(piece[3:5], 16)]))
            else:  # SentencePiece pieces: "▁" is a space
                tokens.append(piece.replace("\u2581", " ").encode("utf-8"))
        tokens += [b""] * (vocab_size - len(tokens))
        return cls(tuple(tokens), tuple(int(e) for e in eos))


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = visible[:]
    n = 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(visible, chars, strict=True)}


class _TableTokenizer:
    """What llguidance's TokenizerWrapper reads from a :class:`TokenTable`."""

    def __init__(self, table: TokenTable) -> None:
        self.tokens = list(table.tokens)
        self.eos_token_id = table.eos[0]
        self.bos_token_id = None
        self.special_token_ids = [i for i, t in enumerate(table.tokens) if not t]
        self._llt = None

    def __call__(self, text: bytes) -> list[int]:  # greedy, longest match first: only used for forced text
        return self._llt.greedy_tokenize(text.decode("utf-8", "replace")) if self._llt is not None else []


class _Compiled:
    """One grammar compiled for one vocabulary, its per-thread matchers, and its recent masks."""

    def __init__(self, constraint: Constraint, table: TokenTable) -> None:
        llg = _llguidance()
        self.kind = constraint.kind
        # compiled once, within LIMITS; a thread's matcher is a copy of this one (20 us, where compiling a
        # schema of many tools takes tens of milliseconds)
        self._prototype = llg.LLMatcher(_lltokenizer(table), constraint.llguidance_grammar(), log_level=0,
                                        limits=llg.LLParserLimits(**LIMITS))
        if self._prototype.is_error():
            raise ConfigError(f"the {constraint.kind} constraint is not valid: {self._prototype.get_error()}")
        self.vocab = len(table)
        self.eos = frozenset(table.eos)
        self.serial = next(_serials)  # names its masks in the shared cache
        self._local = threading.local()
        self._everything = np.ones(self.vocab, dtype=bool)
        self._everything.flags.writeable = False

    def _matcher(self) -> tuple[Any, list[int]]:
        """This thread's matcher and the tokens it has consumed (a new one where there is none)."""
        state = getattr(self._local, "state", None)
        if state is None:
            with _compiled_lock:
                state = self._local.state = (self._prototype.deep_copy(), [])
        return state

    def _failed(self, matcher: Any, output: tuple[int, ...]) -> ModelError:
        """The error of a matcher that stopped on a budget (or inside llguidance): the request fails."""
        self._local.state = None
        return ModelError(f"the {self.kind} constraint could not be followed after {len(output)} output tokens "
                          f"(dsi.constraints.LIMITS): {matcher.get_error().splitlines()[0]}")

    def allowed(self, output: tuple[int, ...]) -> np.ndarray:
        key = (self.serial, output)
        with _compiled_lock:
            mask = _masks.get(key)
            if mask is not None:
                _masks.move_to_end(key)
                return mask
        matcher, consumed = self._matcher()
        common = 0
        for a, b in zip(consumed, output):
            if a != b:
                break
            common += 1
        if common < len(consumed):
            if not matcher.rollback(len(consumed) - common) or matcher.is_error():
                self._local.state = None  # an error is for good: a new matcher
                matcher, consumed = self._matcher()
                common = 0
            del consumed[common:]
        for token in output[common:]:
            # past an EOS, or a token the grammar refuses (the matcher stays where it was): the row decides
            # nothing (module doc)
            if token in self.eos or matcher.is_stopped() or matcher.try_consume_tokens([int(token)]) != 1:
                if matcher.is_error():
                    raise self._failed(matcher, output)
                return self._everything
            consumed.append(int(token))
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        if matcher.is_error():
            raise self._failed(matcher, output)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool)
        mask.flags.writeable = False
        with _compiled_lock:
            _masks[key] = mask
            if len(_masks) > _MASKS_KEPT:
                _masks.popitem(last=False)
        return mask


_compiled_lock = threading.Lock()
_tokenizers: dict[str, Any] = {}  # a table's digest -> llguidance's tokenizer for it (about 1 s to make at 152k ids)


def _lltokenizer(table: TokenTable) -> Any:
    with _compiled_lock:
        found = _tokenizers.get(table.digest)
    if found is None:
        llg = _llguidance()
        wrapper = _TableTokenizer(table)
        found = llg.LLTokenizer(llg.TokenizerWrapper(wrapper), n_vocab=len(table), eos_token=list(table.eos))
        wrapper._llt = found
        with _compiled_lock:
            found = _tokenizers.setdefault(table.digest, found)
    return found


_compiled: OrderedDict[tuple[Constraint, str], _Compiled] = OrderedDict()
_masks: OrderedDict[tuple[int, tuple[int, ...]], np.ndarray] = OrderedDict()  # (a _Compiled's serial, output)
_serials = itertools.count()


def _compile(constraint: Constraint, table: TokenTable) -> _Compiled:
    key = (constraint, table.digest)
    with _compiled_lock:
        found = _compiled.get(key)
        if found is not None:
            _compiled.move_to_end(key)
            return found
    found = _Compiled(constraint, table)  # outside the lock: a compile may take a while
    with _compiled_lock:
        found = _compiled.setdefault(key, found)
        if len(_compiled) > _COMPILED_KEPT:
            _compiled.popitem(last=False)  # its masks leave the cache as they age
    return found


class BoundConstraint:
    """A :class:`Constraint` on one vocabulary: the processor :mod:`dsi.sampling` applies. Equal (and hashed) by
    the constraint and the vocabulary's digest.

    A table made from a model (:func:`bind`, :func:`token_table`) pickles as its digest only (a 152k-id table is a
    megabyte, and took 35 ms of CPU to pickle and load with every task sent to a server process): the receiving
    process finds it among the vocabularies it knows (:func:`register_vocabulary`: a server registers its model's;
    every table bound here is known here), and compiles the grammar once. A table made by hand travels whole."""

    def __init__(self, constraint: Constraint, table: TokenTable) -> None:
        self.constraint = constraint
        self.table = table
        _known_tables.setdefault(table.digest, table)
        self._compiled = _compile(constraint, table)  # checks the grammar now: a bad one fails the request early

    def allowed(self, output: Sequence[int]) -> np.ndarray:
        """``[V]`` bool: the tokens the grammar allows after ``output`` (the tokens generated so far)."""
        return self._compiled.allowed(tuple(int(t) for t in output))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, BoundConstraint) and self.constraint == other.constraint
                and self.table.digest == other.table.digest)

    def __hash__(self) -> int:
        return hash((self.constraint, self.table.digest))

    def __reduce__(self):
        if self.table.digest in _model_tables:  # a server rebuilds the model, and so the table
            return (_restore_bound, (self.constraint, self.table.digest, len(self.table)))
        return (BoundConstraint, (self.constraint, self.table))  # a table given by hand travels whole

    def __repr__(self) -> str:
        return f"BoundConstraint({self.constraint.kind}, vocabulary {self.table.digest[:8]} of {len(self.table)} ids)"


_known_tables: dict[str, TokenTable] = {}  # digest -> table: every table bound or registered in this process
_model_tables: set[str] = set()  # digests of tables made from a model here (a server can make them too)
_vocabulary_sources: list[Any] = []  # models whose table is made when a constraint on it arrives (servers)


def register_vocabulary(model: Any) -> None:
    """Let constraints bound elsewhere to ``model``'s vocabulary be used in this process (a target server calls it
    with its model; the table is made when the first constrained task arrives)."""
    with _compiled_lock:
        if not any(m is model for m in _vocabulary_sources):
            _vocabulary_sources.append(model)


def _restore_bound(constraint: Constraint, digest: str, size: int) -> BoundConstraint:
    table = _known_tables.get(digest)
    if table is None:
        with _compiled_lock:
            sources = list(_vocabulary_sources)
        for model in sources:
            try:
                candidate = _table_of(model)
            except ConfigError:
                continue
            _known_tables.setdefault(candidate.digest, candidate)
        table = _known_tables.get(digest)
    if table is None:
        raise ModelError(f"a {constraint.kind} constraint on a vocabulary of {size} ids (digest {digest[:8]}) reached "
                         "a process whose models have another vocabulary, or none registered "
                         "(dsi.constraints.register_vocabulary)")
    return BoundConstraint(constraint, table)


def token_table(model: Any) -> TokenTable:
    """The vocabulary of ``model`` (a target) as a grammar reads it: its own ``token_table()`` where it has one,
    else its Hugging Face tokenizer's; ConfigError for a model without either."""
    for _ in range(8):  # through wrappers (latency models, replays) to the model that has a vocabulary
        own = getattr(model, "token_table", None)
        if callable(own):
            return own()
        if getattr(model, "tokenizer", None) is not None:
            break
        inner = getattr(model, "wrapped_model", None)
        if inner is None or inner is model:
            break
        model = inner
    tokenizer = getattr(model, "tokenizer", None)
    eos = tuple(getattr(model, "eos_token_ids", ()) or ())
    vocab = int(model.vocab_size)
    if tokenizer is not None and callable(getattr(tokenizer, "token_bytes", None)) and eos:  # a GGUF's (llama.cpp)
        pieces = list(tokenizer.token_bytes())[:vocab]
        ends = set(eos)
        return TokenTable(tuple(b"" if i in ends else p for i, p in enumerate(pieces)) + (b"",) * (vocab - len(pieces)),
                          eos)
    if tokenizer is None or not hasattr(tokenizer, "convert_ids_to_tokens") or not eos:
        raise ConfigError(f"a constrained request needs the target's tokenizer and EOS ids; {model!r} has "
                          f"{'no tokenizer' if tokenizer is None else 'no EOS id'}")
    return TokenTable.of_tokenizer(tokenizer, vocab, eos)


_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its table, made once per model


def _table_of(model: Any) -> TokenTable:
    try:
        with _compiled_lock:
            found = _tables.get(model)
    except TypeError:  # a model that cannot be weakly referenced (or hashed): its table each time
        found = token_table(model)
    else:
        if found is None:
            found = token_table(model)  # a vocabulary's table takes about 0.1 s at 152k ids
            with _compiled_lock:
                _tables[model] = found
    with _compiled_lock:
        _model_tables.add(found.digest)
    return found


def bind(constraint: Constraint | BoundConstraint, model: Any) -> BoundConstraint:
    """``constraint`` on ``model``'s vocabulary (the table made once per model, the grammar compiled once per
    vocabulary and constraint)."""
    if isinstance(constraint, BoundConstraint):
        if len(constraint.table) != int(model.vocab_size):
            raise ConfigError(f"the constraint was bound to a vocabulary of {len(constraint.table)} ids; the target "
                              f"has {model.vocab_size}")
        return constraint
    return BoundConstraint(constraint, _table_of(model))
