"""A drafter with its own tokenizer, seen by the engines as a drafter over the target's vocabulary.

Timor et al., "Accelerating LLM Inference with Lossless Speculative Decoding Algorithms for
Heterogeneous Vocabularies" (ICML 2025, arXiv 2502.05202). :class:`CrossVocabularyDrafter` wraps
any drafter model and its tokenizer; its sessions hold *target* tokens, keep the drafter's own
session on the same text, and propose target tokens in one of two ways:

- **string** (SLEM, greedy decoding): the drafter continues the text greedily in its own tokens;
  the text it wrote beyond the target's context is tokenized by the target's tokenizer, and the
  first of those target tokens is the proposal. A target token is proposed only once it is
  settled: it ends before the last word of that text (:func:`~dsi.models.vocab.vocabulary.last_word_start`;
  ``" th"`` tokenizes as ``" t"``, ``"h"`` but ``" the"`` as one token, so nothing in a word is
  final until the next word begins; in a long word, once it ends :data:`LONG_WORD_BYTES` bytes
  before the text does), or the drafter's text has ended (its EOS). The drafter writes on until
  then (at most :data:`MAX_STEPS_PER_PROPOSAL` tokens).
- **intersection** (TLI, sampling and greedy): the drafter's next-token logits restricted to the
  tokens whose pieces both vocabularies share (:class:`~dsi.models.vocab.vocabulary.Intersection`), in
  the target's ids, -inf elsewhere: after softmax, the drafter's law restricted to the
  intersection and renormalized. Where a likely shared token begins a target token the drafter
  spells in two pieces (``":"`` + ``"\n"`` for ``":\n"``), part of its mass goes to that *merged*
  token by the drafter's row after it (:mod:`dsi.models.vocab.merges`; ``merges=0`` turns it off). The
  engines sample the draft from exactly that law ``q`` and verify it by ordinary rejection
  sampling, so the output keeps the target's law exactly.

Either way the engines verify every proposal against the target, so exactness never depends on
the translation: a poor translation only costs acceptances. (SLRS, string-level rejection
sampling, is not built: it needs the drafter's probability of every *string* a target token
spells, many drafter forwards per position; TLI keeps one forward per draft.)

**Keeping the drafter on the target's text.** The drafter holds the target's tokens spelled one by one
in its own tokens (:meth:`~dsi.models.vocab.vocabulary.Vocabulary.spell` of each token's bytes: the drafter's
own token where it has that piece), the prompt's too. That spelling is a function of the target's
tokens, so the drafter's row after a context is too, however the session got there: a seeded sampling
request draws the same drafts and gives the same tokens for any lookahead, SP, timing and request
history (on models whose rows do not depend on how a forward was cut; docs/architecture.md). When the
target's tokens depart from those spelled (a rejection, a new request), the drafter keeps the tokens
spelling the common prefix and spells the rest (a *re-encode* when that is more than its one token for
one new target token; counted). It also keeps the target's cuts in the drafter's context, which the
drafter follows in context: SmolLM2 drafting for Qwen agreed with the target more often this way than
with its own tokenization of the text (docs/results-log.md#2026-12-03). In string mode the drafter's own
greedy continuation is kept while the target's text follows it.

Requested modes: ``"string"``, ``"intersection"``, or ``"auto"`` (string for greedy requests,
intersection for sampling). Exactness in string mode needs greedy decoding, so a sampling request
with ``"string"`` is refused before it starts (:meth:`CrossVocabularyDrafter.check_sampling`).
This module knows nothing about the algorithm beyond the ``greedy`` flag of
:func:`dsi.models.base.extend_rows`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from dsi.errors import ConfigError, DraftUnavailable, VocabularyMismatchError
from dsi.logprobs import top_ids
from dsi.models.base import (
    CancelFlag,
    LanguageModel,
    check_int,
    check_token_ids,
    common_prefix_length,
    drafts_ids_only,
    forward_rows,
    path_tree_rows,
    tree_rows,
)
from dsi.models.vocab.merges import MergeTable, merge_candidates, merge_logits, merges_for
from dsi.models.vocab.vocabulary import Intersection, Vocabulary, last_word_start, same_vocabulary
from dsi.trees import ROOT, DraftTree

logger = logging.getLogger(__name__)

VOCAB_MODES = ("auto", "shared", "string", "intersection")
_TRANSLATING = ("auto", "string", "intersection")
# string mode: the most drafter tokens written for one proposal; a text that settles no target token
# by then (bytes the target's tokenizer cannot start a token with) gives no draft at that position
MAX_STEPS_PER_PROPOSAL = 16
# ... and inside a long word (an identifier, a language without spaces), a target token that ends this
# many bytes before the text does counts as settled too
LONG_WORD_BYTES = 12
LOOKAHEAD_ROWS_KEPT = 16  # the drafter rows a session keeps from its merges' lookahead forwards
PREFETCHED = 3  # a merges' lookahead forward also computes the rows after this many likeliest shared tokens


def check_mode_sampling(vocab_mode: str, params: Any) -> None:
    """:class:`ConfigError` if ``vocab_mode`` cannot serve ``params`` exactly: string-level drafting
    is exact for greedy decoding only."""
    if vocab_mode == "string" and not params.greedy:
        raise ConfigError(
            f"vocab_mode='string' is exact for greedy decoding only (temperature={params.temperature!r}); "
            "use vocab_mode='intersection' or 'auto' to sample with a drafter of another vocabulary")


class CrossVocabularyDrafter:
    """``drafter`` (a model over its own vocabulary) as a model over the target's ``vocab_size`` ids."""

    def __init__(self, drafter: LanguageModel, target_vocabulary: Vocabulary, drafter_vocabulary: Vocabulary,
                 *, vocab_size: int, mode: str = "auto", drafter_eos_ids: Sequence[int] = (),
                 merges: int | str = "auto") -> None:
        if mode not in _TRANSLATING:
            raise ConfigError(f"mode={mode!r} must be one of {', '.join(_TRANSLATING)}")
        check_merges(merges)
        self._merges_asked = merges
        self._merges: int | None = None if merges == "auto" else int(merges)
        self._merge_table: MergeTable | None = None
        self.drafter = drafter
        self.target_vocabulary = target_vocabulary
        self.drafter_vocabulary = drafter_vocabulary
        self.mode = mode
        self._vocab_size = vocab_size
        self.drafter_eos_ids = frozenset(int(t) for t in drafter_eos_ids)
        self.intersection = Intersection.of(target_vocabulary, drafter_vocabulary)
        if self.intersection.size == 0:
            raise VocabularyMismatchError(
                f"no token of the drafter ({drafter_vocabulary.name}) spells the same text as a token of the "
                f"target ({target_vocabulary.name}); these tokenizers cannot be bridged")
        self.name = getattr(drafter, "name", type(drafter).__name__)
        self.max_context = None  # the drafter's own limit applies to its tokens (its session raises)

    drafts_through_text = True  # its greedy guesses need its own sessions, one position at a time

    @property
    def merges(self) -> int:
        """The shared tokens per position whose merged tokens the law reaches (:mod:`dsi.models.vocab.merges`).
        ``"auto"`` resolves once, on first use (:func:`~dsi.models.vocab.merges.merges_for`):
        :data:`~dsi.models.vocab.merges.MERGE_LOOKAHEAD` where a drafter forward costs about the same for a few tokens
        as for one (a stated low row price, an accelerator), else 0 (a CPU, where the lookahead forwards cost
        more than they buy: docs/results.md#merged-tokens-and-where-a-rejected-drafts-correction-lands)."""
        if self._merges is None:
            self._merges = merges_for(self.drafter)
        return self._merges

    @property
    def merge_table(self) -> MergeTable:
        """The target tokens the drafter spells as a shared token and one more (built on first use)."""
        if self._merge_table is None:
            self._merge_table = MergeTable.of(self.target_vocabulary, self.drafter_vocabulary, self._vocab_size,
                                              sorted(self.drafter_eos_ids))
        return self._merge_table

    @property
    def wrapped_model(self) -> object:
        """The model whose forwards this one passes on (:func:`dsi.models.determinism.base_model`)."""
        return self.drafter

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def threads(self) -> int | None:
        """The wrapped drafter's threads per forward (for placement)."""
        return getattr(self.drafter, "threads", None)

    @threads.setter
    def threads(self, value: int | None) -> None:
        if hasattr(self.drafter, "threads"):
            self.drafter.threads = value

    def new_session(self) -> CrossVocabularySession:
        return CrossVocabularySession(self)

    def mode_for(self, greedy: bool) -> str:
        """The translation used for a request: ``"string"`` or ``"intersection"``."""
        if self.mode == "auto":
            return "string" if greedy else "intersection"
        return self.mode

    def check_sampling(self, params: Any) -> None:
        """Refuse a request this drafter cannot serve exactly (string mode needs greedy decoding)."""
        check_mode_sampling(self.mode, params)

    @property
    def proposes_only_ids(self) -> bool:
        """String mode proposes target ids, not rows: greedy requests draft its raw proposals
        (:func:`dsi.models.base.drafts_ids_only`); ``auto`` gives rows when asked for them."""
        return self.mode == "string"

    def request_info(self, params: Any) -> dict:
        """What the stats of a request report about the translation (``auto``: string mode where
        greedy drafting reads argmax ids, intersection rows where the drafts are processed)."""
        mode = self.mode_for(drafts_ids_only(self, params))
        info = {"vocab_mode": mode, "vocab_intersection": self.intersection.size}
        if mode == "intersection":
            info["vocab_merge_lookahead"] = self.merges
            if self.merges:
                info["vocab_merges"] = self.merge_table.size
        return info

    def __repr__(self) -> str:
        return (f"CrossVocabularyDrafter({self.drafter!r}, mode={self.mode!r}, "
                f"intersection={self.intersection.size}, merges={self._merges_asked!r})")


class CrossVocabularySession:
    """Target tokens, and the drafter's session kept on their text (see the module docstring)."""

    def __init__(self, model: CrossVocabularyDrafter) -> None:
        self._model = model
        self._target_vocab = model.target_vocabulary
        self._drafter_vocab = model.drafter_vocabulary
        self._inner = model.drafter.new_session()
        self._start = model.drafter_vocabulary.start_ids  # drafter tokens before any text (BOS)
        self._tokens: list[int] = []  # target tokens
        self._t_ends: list[int] = []  # byte length of the target text after each target token
        self._t_text = bytearray()
        self._d_tokens: list[int] = []  # drafter tokens spelling _d_text (after _start)
        self._d_ends: list[int] = []
        self._d_text = bytearray()
        self._ended = False  # the drafter's text ended (its EOS) at the end of _d_text
        # the target tokens spelled one by one at the start of _d_tokens, and the drafter tokens after each
        self._spelled_targets: list[int] = []
        self._spelled_counts: list[int] = []
        self._row: Any = None  # the drafter's output after _start + _d_tokens
        self._row_key: tuple | None = None  # (len(_d_tokens), greedy) of the row; None after any change
        # raw drafter rows after a context (start + drafter tokens) that a merges' lookahead computed
        self._lookahead: OrderedDict[tuple[int, ...], np.ndarray] = OrderedDict()
        self.counters = {"drafter_reencodes": 0, "drafter_rolled_back_tokens": 0, "drafter_model_forwards": 0,
                         "drafter_merge_forwards": 0}

    # ---- the ModelSession interface ------------------------------------------------------------
    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    def truncate(self, length: int) -> None:
        length = check_int(length, "length", 0, len(self._tokens))
        del self._tokens[length:]
        del self._t_ends[length:]
        del self._t_text[self._t_ends[-1] if self._t_ends else 0:]

    def extend(self, tokens: Sequence[int], cancel: CancelFlag | None = None) -> np.ndarray:
        """The intersection logits after each prefix, ``[len(tokens), vocab_size]`` (in every mode: logit
        rows are the intersection law's; one drafter alignment per row, so meant for short calls)."""
        tokens = check_token_ids(tokens, self._model.vocab_size, "tokens", "the target (a drafter's bridge)")
        rows = []
        saved = len(self._tokens)
        try:
            for token in tokens:
                rows.append(self._intersection_row([*self._tokens, int(token)], cancel))
                self._append([token])
        except BaseException:
            self.truncate(saved)
            raise
        return np.stack(rows)

    def extend_rows(self, tokens: Sequence[int], cancel: CancelFlag | None, num_rows: int,
                    greedy: bool) -> np.ndarray:
        """The engines' call: one row, the proposal (greedy: a target id) or the intersection logits.
        More rows are :meth:`extend`'s (greedy: the argmax of each intersection row)."""
        if num_rows != 1:
            rows = self.extend(tokens, cancel)[-num_rows:]
            return np.argmax(rows, axis=-1).astype(np.int64) if greedy else rows
        tokens = check_token_ids(tokens, self._model.vocab_size, "tokens", "the target (a drafter's bridge)")
        context = [*self._tokens, *tokens]
        if self._model.mode_for(greedy) == "string":
            text = self._t_text + self._target_vocab.spelling(tokens)
            out = np.array([self._propose(context, text, cancel)], dtype=np.int64)
        else:
            row = self._intersection_row(context, cancel)
            out = np.array([int(np.argmax(row))], dtype=np.int64) if greedy else row[None]
        self._append(tokens)  # only once nothing can fail: a cancelled call leaves the session as it was
        return out

    @property
    def one_forward_trees(self) -> bool:
        """Whether :meth:`tree_rows` computes a draft tree in one forward of the drafter (its session has
        ``tree_rows`` and computes trees in one forward)."""
        return hasattr(self._inner, "tree_rows") and getattr(self._inner, "one_forward_trees", True)

    def tree_rows(self, prefix: Sequence[int], tree: Any, cancel: CancelFlag | None = None, *, greedy: bool = False,
                  top: int | None = None) -> np.ndarray:
        """A draft tree of target tokens after ``prefix`` (:func:`dsi.models.base.tree_rows`), in **one**
        forward of the drafter: the prefix spelled as :meth:`extend_rows` spells it, each node's token spelled
        below its parent's spelling (a chain of drafter tokens; nodes whose spellings begin alike share
        those drafter nodes), and the drafter's own ``tree_rows`` computes that tree of drafter tokens. Row
        ``1 + i`` is the intersection row after node i's path, as :meth:`extend_rows` gives it. The session
        is left holding ``prefix`` + the tree's main path (its drafter side follows at the next call). Path
        by path where the drafter computes no trees in one forward, and in string mode (no trees there)."""
        prefix = [int(t) for t in prefix]
        if not self.one_forward_trees or self._model.mode_for(greedy) == "string" or not prefix:
            return path_tree_rows(self, prefix, tree, cancel, greedy=greedy, top=top)
        self._align(prefix)
        base = self._start + tuple(self._d_tokens)
        if not base:
            return path_tree_rows(self, prefix, tree, cancel, greedy=greedy, top=top)
        tokens: list[int] = []
        parents: list[int] = []
        child: dict[tuple[int, int], int] = {}  # (parent node, drafter token) -> node of the drafter tree
        ends: list[int] = []  # the drafter tree node after each target node's spelling (ROOT: the prefix's)
        for token, parent in zip(tree.tokens, tree.parents, strict=True):
            node = ROOT if parent == ROOT else ends[parent]
            for spelled in self._spell(token):
                nxt = child.get((node, spelled))
                if nxt is None:
                    nxt = child[node, spelled] = len(tokens)
                    tokens.append(spelled)
                    parents.append(node)
                node = nxt
            ends.append(node)
        rows = tree_rows(self._inner, base, DraftTree(tuple(tokens), tuple(parents)), cancel)  # [1 + m, V_d]
        self.counters["drafter_model_forwards"] += 1
        nodes = [ROOT, *ends]
        raw = [rows[1 + node] for node in nodes]
        merged = self._merged_rows(base, tokens, parents, child, nodes, raw, cancel, rows)
        out = []
        for row in merged:
            if not np.isfinite(row).any():
                raise DraftUnavailable("the drafter gives every token both vocabularies share probability 0")
            out.append(row)
        held = prefix + tree.path_tokens(tree.main_path()[-1]) if len(tree) else prefix
        keep = common_prefix_length(self._tokens, held)
        self.truncate(keep)
        self._append(held[keep:])
        stacked = np.stack(out)
        return np.argmax(stacked, axis=-1).astype(np.int64) if greedy else stacked

    def close(self) -> None:
        self._inner.close()

    # ---- target side ---------------------------------------------------------------------------
    def _append(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self._t_text += self._target_vocab.piece(int(token))
            self._tokens.append(int(token))
            self._t_ends.append(len(self._t_text))

    # ---- drafter side --------------------------------------------------------------------------
    def _cut(self, keep: int) -> None:
        """Keep the first ``keep`` drafter tokens (their text; the inner session follows lazily)."""
        if keep < len(self._d_tokens):
            self.counters["drafter_rolled_back_tokens"] += len(self._d_tokens) - keep
            del self._d_tokens[keep:]
            del self._d_ends[keep:]
            del self._d_text[self._d_ends[-1] if self._d_ends else 0:]
            while self._spelled_counts and self._spelled_counts[-1] > keep:
                self._spelled_counts.pop()
                self._spelled_targets.pop()
            self._ended = False
            self._row_key = None

    def _push(self, tokens: Sequence[int]) -> None:
        """Append drafter tokens the drafter wrote itself (string mode), after the spelled ones."""
        if tokens:
            self._row_key = None
        self._append_drafter(tokens)

    def _append_drafter(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self._d_text += self._drafter_vocab.piece(token)
            self._d_tokens.append(int(token))
            self._d_ends.append(len(self._d_text))

    def _spell(self, token: int) -> list[int]:
        """Target ``token`` in drafter tokens (none for a token that spells nothing)."""
        piece = self._target_vocab.piece(token)
        ids = self._drafter_vocab.spell(piece)
        if ids is None:
            raise DraftUnavailable(f"the drafter's vocabulary cannot spell {piece[:40]!r}")
        return ids

    def _align(self, context: list[int], text: bytes | None = None) -> None:
        """Make the drafter's tokens spell the target tokens ``context`` one by one. With ``text`` (their
        text, in string mode), a drafter text that already continues it is kept: the drafter's own
        continuation."""
        if text is not None and self._d_text.startswith(text):
            return  # the drafter already wrote this text
        spelled_before = len(self._spelled_targets)
        if context[:spelled_before] == self._spelled_targets:  # the usual case, compared at C speed
            same = spelled_before
        else:
            same = common_prefix_length(self._spelled_targets, context)
        if same == len(context) == spelled_before and len(self._d_tokens) == (
                self._spelled_counts[-1] if self._spelled_counts else 0):
            return  # exactly these tokens, spelled, and no token the drafter wrote itself after them
        count = self._spelled_counts[same - 1] if same else 0
        spelled: list[int] = []
        counts = []
        for token in context[same:]:
            spelled.extend(self._spell(int(token)))
            counts.append(count + len(spelled))
        old = self._d_tokens[count:]
        keep = common_prefix_length(old, spelled)
        if keep < len(old) or len(spelled) - keep > 1:  # not just the drafter's own token for a new target token
            self.counters["drafter_reencodes"] += 1
        self._cut(count + keep)
        del self._spelled_targets[same:]
        del self._spelled_counts[same:]
        self._append_drafter(spelled[keep:])
        if spelled[keep:]:
            self._row_key = None
        self._spelled_targets.extend(int(t) for t in context[same:])
        self._spelled_counts.extend(counts)
        self._ended = False

    def _drafter_row(self, cancel: CancelFlag | None, greedy: bool) -> Any:
        """The drafter's output after its tokens: greedy, its argmax id; else its logit row ``[V_d]``."""
        key = (len(self._d_tokens), greedy)
        if self._row_key != key:
            self._row_key = None
            context = self._start + tuple(self._d_tokens)
            if not context:
                raise DraftUnavailable("the drafter has no context to continue (empty text, no start token)")
            kept = self._lookahead.get(context) if self._lookahead and not greedy else None
            if kept is not None:  # a merges' lookahead computed this row already
                self._row = kept
            else:
                self.counters["drafter_model_forwards"] += 1
                self._row = forward_rows(self._inner, context, 1, cancel, greedy=greedy)[-1]
            self._row_key = key
        return self._row

    def _intersection_row(self, context: list[int], cancel: CancelFlag | None) -> np.ndarray:
        """The drafter's law after the target tokens ``context`` over target ids, as logits: restricted to the
        intersection, with the merged tokens of its likeliest shared tokens (:mod:`dsi.models.vocab.merges`)."""
        self._align(context)
        raw = self._drafter_row(cancel, greedy=False)
        base = self._start + tuple(self._d_tokens) if self._model.merges else ()  # the lookaheads' context
        row = self._merged_rows(base, [], [], {}, [ROOT], [raw], cancel)[0]
        if not np.isfinite(row).any():  # it gives no shared token a chance: nothing to draft here
            raise DraftUnavailable("the drafter gives every token both vocabularies share probability 0")
        return row

    def _merged_rows(self, base: tuple[int, ...], tokens: list[int], parents: list[int],
                     child: dict[tuple[int, int], int], nodes: list[int], raw: list[np.ndarray],
                     cancel: CancelFlag | None, tree_raw: np.ndarray | None = None) -> list[np.ndarray]:
        """The intersection rows (target ids) of the drafter rows ``raw`` after the nodes ``nodes`` of the
        drafter tree ``tokens``/``parents`` below ``base`` (``ROOT``: ``base`` itself; ``child`` maps
        ``(node, drafter token)`` to a node; ``tree_raw``: the tree's rows, row ``1 + i`` after node i), each
        extended by its merges. The rows after the merges' first pieces come from the tree itself, from the
        rows kept from earlier lookaheads, or else from one forward of the drafter over all of them and the
        likeliest shared tokens, whose rows are kept (the next draft reads one, most often)."""
        model = self._model
        rows = [model.intersection.target_logits(r, model.vocab_size) for r in raw]
        if not model.merges:
            return rows
        table = model.merge_table
        shared = model.intersection
        values = [np.asarray(r)[shared.drafter_ids] for r in raw]  # per row: the shared tokens' logits [n shared]
        wanted = [merge_candidates(table, r, float(v.max()), model.merges)  # per row: the candidates' drafter ids
                  for r, v in zip(raw, values, strict=True)]
        paths: dict[int, tuple[int, ...]] = {ROOT: ()}
        for node, (token, parent) in enumerate(zip(tokens, parents, strict=True)):
            paths[node] = paths[parent] + (token,)
        found: dict[tuple[int, int], np.ndarray] = {}
        missing: list[tuple[int, int]] = []
        for node, v, candidates in zip(nodes, values, wanted, strict=True):
            if not candidates:
                continue
            # the likeliest shared tokens' rows too, in the same forward: one is the next draft's row, most often
            likeliest = [int(shared.drafter_ids[i]) for i in top_ids(v, PREFETCHED)]
            for a in [*candidates, *(t for t in likeliest if t not in candidates)]:
                key = base + paths[node] + (a,)
                inside = child.get((node, a))
                kept = self._lookahead.get(key)
                if kept is not None:
                    self._lookahead.move_to_end(key)
                    found[node, a] = kept
                elif inside is not None and tree_raw is not None:
                    found[node, a] = tree_raw[1 + inside]
                else:
                    missing.append((node, a))
        if missing:
            needed: set[int] = set()  # the tree nodes on the paths to the rows looked ahead from
            for node, _ in missing:
                while node != ROOT and node not in needed:
                    needed.add(node)
                    node = parents[node]
            look_tokens, look_parents, renamed, where = [], [], {ROOT: ROOT}, {}
            for node in sorted(needed):  # a parent comes before its children
                renamed[node] = len(look_tokens)
                look_tokens.append(tokens[node])
                look_parents.append(renamed[parents[node]])
            for node, a in missing:
                where[node, a] = len(look_tokens)
                look_tokens.append(a)
                look_parents.append(renamed[node])
            look = tree_rows(self._inner, base, DraftTree(tuple(look_tokens), tuple(look_parents)), cancel)
            self.counters["drafter_model_forwards"] += 1
            self.counters["drafter_merge_forwards"] += 1
            for (node, a), at in where.items():
                found[node, a] = row_after = np.array(look[1 + at])  # a copy: the tree's rows may be many
                self._lookahead[base + paths[node] + (a,)] = row_after
            while len(self._lookahead) > LOOKAHEAD_ROWS_KEPT:
                self._lookahead.popitem(last=False)
        return [merge_logits(row, table, candidates, [found[node, a] for a in candidates])
                for row, node, candidates in zip(rows, nodes, wanted, strict=True)]

    def _propose(self, context: list[int], text: bytes | bytearray, cancel: CancelFlag | None) -> int:
        """String mode: the next target token of the drafter's greedy continuation of ``text``, the text of
        the target tokens ``context``."""
        self._align(context, text)
        steps = 0
        while True:
            pending = bytes(self._d_text[len(text):])
            proposals = self._target_vocab.tokens_of_prefix(pending)
            final = max(last_word_start(pending), len(pending) - LONG_WORD_BYTES)
            if proposals and (self._ended or len(self._target_vocab.piece(proposals[0])) <= final):
                return proposals[0]  # settled: it ends before the word more text could still change
            if self._ended:
                raise DraftUnavailable("the drafter's text has ended")
            if steps >= MAX_STEPS_PER_PROPOSAL:
                raise DraftUnavailable(f"{steps} drafter tokens settled no target token "
                                       f"(their text: {pending[:40]!r})")
            steps += 1
            token = int(self._drafter_row(cancel, greedy=True))
            piece = self._drafter_vocab.piece(token)
            if piece:
                self._push([token])
            if token in self._model.drafter_eos_ids or not piece:
                self._ended = True


def shares_vocabulary(target: LanguageModel, drafter: LanguageModel, target_tokenizer: Any = None,
                      drafter_tokenizer: Any = None) -> bool:
    """Whether ``drafter``'s tokens are the target's: the same logit size and, when both tokenizers
    are known (the arguments, else the models' ``tokenizer``), the same token -> id maps."""
    tt = target_tokenizer if target_tokenizer is not None else getattr(target, "tokenizer", None)
    dt = drafter_tokenizer if drafter_tokenizer is not None else getattr(drafter, "tokenizer", None)
    if target.vocab_size != drafter.vocab_size:
        return False
    return tt is None or dt is None or same_vocabulary(tt, dt)


def check_merges(merges: object) -> None:
    """Refuse, naming it, a ``merges`` that is neither ``"auto"`` nor an int >= 0."""
    if merges != "auto" and (isinstance(merges, bool) or not isinstance(merges, int) or merges < 0):
        raise ConfigError(f"merges={merges!r} must be 'auto' or an int >= 0 (the shared tokens per position "
                          "whose merged tokens the intersection law reaches; 0: plain TLI)")


def bridge_drafter(target: LanguageModel, drafter: LanguageModel, vocab_mode: str = "auto", *,
                   target_tokenizer: Any = None, drafter_tokenizer: Any = None,
                   merges: int | str = "auto") -> LanguageModel:
    """The drafter the engines should run: ``drafter`` itself when it shares the target's vocabulary
    (or ``vocab_mode="shared"``), else a :class:`CrossVocabularyDrafter` in ``vocab_mode``.

    Tokenizers default to the models' ``tokenizer`` attributes. ``"auto"`` translates only when the
    vocabularies differ; ``"string"`` and ``"intersection"`` translate even between equal ones.
    ``merges``: how many likely shared tokens per position the intersection law extends to their merged
    tokens (:mod:`dsi.models.vocab.merges`; 0: plain TLI; ``"auto"``: :attr:`CrossVocabularyDrafter.merges`); a
    number for a drafter that shares the target's vocabulary is refused (nothing would be merged). A
    drafter bridged already is returned as it is.
    """
    if vocab_mode not in VOCAB_MODES:
        raise ConfigError(f"vocab_mode={vocab_mode!r} must be one of {', '.join(VOCAB_MODES)}")
    check_merges(merges)
    if isinstance(drafter, CrossVocabularyDrafter):  # bridged already (e.g. once for every decoder of a server)
        if vocab_mode not in ("auto", drafter.mode):
            raise ConfigError(f"vocab_mode={vocab_mode!r} for a drafter bridged already in mode {drafter.mode!r}; "
                              "bridge the drafter's own model instead")
        if merges != "auto" and merges != drafter.merges:
            raise ConfigError(f"merges={merges!r} for a drafter bridged already with merges={drafter.merges}; "
                              "bridge the drafter's own model instead")
        return drafter
    tt = target_tokenizer if target_tokenizer is not None else getattr(target, "tokenizer", None)
    dt = drafter_tokenizer if drafter_tokenizer is not None else getattr(drafter, "tokenizer", None)
    tokenizers = tt is not None and dt is not None
    shared = shares_vocabulary(target, drafter, tt, dt)
    if vocab_mode == "shared" or (vocab_mode == "auto" and shared):
        if not shared:
            why = (f"drafter vocab_size={drafter.vocab_size} differs from target vocab_size={target.vocab_size}"
                   if target.vocab_size != drafter.vocab_size else
                   "target and drafter tokenizers map tokens to different ids")
            raise VocabularyMismatchError(f"{why}; vocab_mode='shared' needs one vocabulary (vocab_mode='auto' "
                                          "drafts across tokenizers)")
        if merges != "auto":
            raise ConfigError(f"merges={merges!r} applies to a drafter of another vocabulary (its token "
                              "intersection's law); this drafter shares the target's vocabulary and drafts its "
                              "tokens as they are: drop merges, or pass vocab_mode='intersection'")
        return drafter
    if not tokenizers:
        missing = "target" if tt is None else "drafter"
        why = (f"drafter vocab_size={drafter.vocab_size} differs from target vocab_size={target.vocab_size}"
               if not shared else f"vocab_mode={vocab_mode!r} translates text between tokenizers")
        raise VocabularyMismatchError(
            f"{why}; drafting across vocabularies needs both tokenizers, and the {missing} model has none "
            "(pass target_tokenizer= and drafter_tokenizer=, or a drafter of the target's vocabulary)")
    eos = getattr(drafter, "eos_token_ids", None)
    eos = eos() if callable(eos) else eos
    if not eos:
        eos = [getattr(dt, "eos_token_id", None)]
    model = CrossVocabularyDrafter(
        drafter,
        Vocabulary.from_tokenizer(tt, target.vocab_size, name=getattr(target, "name", None)),
        Vocabulary.from_tokenizer(dt, drafter.vocab_size, name=getattr(drafter, "name", None)),
        vocab_size=target.vocab_size, mode="auto" if vocab_mode == "auto" else vocab_mode,
        drafter_eos_ids=[t for t in eos if t is not None], merges=merges,
    )
    logger.info("drafter %s drafts across vocabularies (%s; %d shared tokens)", model.name, vocab_mode,
                model.intersection.size)
    return model
