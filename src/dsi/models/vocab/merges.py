"""Merged tokens: the token-level intersection (TLI) law extended to target tokens the drafter spells in two.

TLI drafts only the tokens both vocabularies spell alike. A target token outside that intersection can
never be drafted, and a target whose tokenizer merges what the drafter writes in two pieces meets such
tokens often: SmolLM2 writes ``":"`` then ``"\\n"`` where Qwen writes ``":\\n"``, and ``"."`` ``"csv"``
where Qwen writes ``".csv"``. On Qwen's code prompts the target's own token was outside the intersection at
42 of 288 sampled positions, and those tokens held 35% of the mass a rejected draft's correction is drawn
from (docs/results.md#merged-tokens-and-where-a-rejected-drafts-correction-lands;
docs/data/tree_sampled_rules_smollm2-2026-12-04.json).

A **merge** is a target token ``T`` outside the intersection whose bytes are a shared token ``a`` followed
by one drafter token ``b`` (:class:`MergeTable`; several splits of one ``T`` are several merges). Where the
drafter's intersection law gives a likely shared token ``a`` that begins merges, the drafter is asked for its
row after ``a`` (a *lookahead*: one forward for all such ``a`` at a position, see
:func:`merge_candidates`), and ``a``'s mass is split the way the drafter would go on:

    q'(T) = sum over merges (a, b) of T of q(a) * P_drafter(b | context, a)
    q'(a) = q(a) * (1 - sum over merges (a, b) of P_drafter(b | context, a))

(:func:`merge_logits`, written as logits, so the engines' temperature and top-k/top-p act on ``q'`` as on
any row). Every other token keeps ``q``. That is a law over the target's ids for every context (it moves
mass, it never makes any), computed from the drafter's rows alone, so the engines sample a draft from it
and verify it by ordinary rejection sampling exactly as from TLI's: the output keeps the target's law
(rejection sampling is exact for any proposal law), greedy output stays the target's own, and a seed gives
the same tokens whatever the timing, the law being a function of the context. Only the acceptance moves.

The lookahead row after ``a`` is the drafter's next row whenever ``a`` is drafted, so the session keeps it
(with the rows after the likeliest shared tokens, computed in the same forward), and a chain of drafts pays
1.24-1.31 drafter forwards per position on SmolLM2 -> Qwen (of up to 6 tokens each: one forward's price on a
GPU). On a CPU a forward's cost grows with its tokens and the lookahead made a llama.cpp drafter's rows 2-2.6
times dearer, so ``merges="auto"`` (the default) looks ahead only where the drafter's rows are cheap: a
stated low row price, or a drafter on an accelerator (:func:`merges_for`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dsi.logprobs import top_ids
from dsi.models.costs import stated_costs
from dsi.models.vocab.vocabulary import Vocabulary

MERGE_LOOKAHEAD = 3  # shared tokens per position whose lookahead rows the law is extended from (0: plain TLI)
# ``merges="auto"`` looks ahead where one more token in a drafter forward costs at most this much of a one-token
# forward (a GPU; a CPU's llama.cpp drafter: a row 2-2.6 times dearer with merges,
# docs/results.md#merged-tokens-and-where-a-rejected-drafts-correction-lands)
MERGE_MAX_ROW_PRICE = 0.1
MERGE_FLOOR = 0.01  # ... each at least this fraction of the likeliest shared token's probability


def merges_for(drafter: object) -> int:
    """What ``merges="auto"`` means for ``drafter``: :data:`MERGE_LOOKAHEAD` where the drafter states a row price
    (:func:`dsi.models.costs.stated_costs`: a latency model, a ``CallableLM``) of at most
    :data:`MERGE_MAX_ROW_PRICE`, or, stating none, runs on an accelerator (a ``device`` other than the CPU, on it
    or on a model it wraps); else 0 (llama.cpp and hf on the CPU, where a forward's cost grows with its tokens).
    Never timed: the law, and so a seed's tokens, must not depend on a measurement."""
    model: object | None = drafter
    while model is not None:  # the drafter, or the first model it wraps that says
        costs = stated_costs(model)
        if costs is not None:
            return MERGE_LOOKAHEAD if costs.row_price <= MERGE_MAX_ROW_PRICE else 0
        device = getattr(model, "device", None)
        if device is not None:
            return MERGE_LOOKAHEAD if str(device).split(":")[0] not in ("cpu", "") else 0
        model = getattr(model, "wrapped_model", None)
    return 0


@dataclass(frozen=True)
class MergeTable:
    """The merges of two vocabularies: for each shared token ``a`` (by its drafter id) that begins one, the
    drafter ids ``b`` and the target ids ``T`` with ``bytes(T) == bytes(a) + bytes(b)``."""

    starters: np.ndarray  # [n] int64, drafter ids of the shared tokens that begin merges, ascending
    completions: dict[int, tuple[np.ndarray, np.ndarray]]  # a (drafter id) -> (b drafter ids, T target ids)
    target_of: dict[int, int]  # a (drafter id) -> a's target id

    @classmethod
    def of(cls, target: Vocabulary, drafter: Vocabulary, vocab_size: int,
           drafter_stop_ids: Sequence[int] = ()) -> MergeTable:
        """Every merge of ``target`` (ids below ``vocab_size``) over ``drafter``; ``b`` is never one of
        ``drafter_stop_ids`` (the drafter's EOS ends its text, it spells nothing a target token goes on with)."""
        stops = {int(t) for t in drafter_stop_ids}
        found: dict[int, tuple[list[int], list[int]]] = {}
        target_of: dict[int, int] = {}
        for piece, t in target.by_piece.items():
            if t >= vocab_size or piece in drafter.by_piece:
                continue  # a shared token is drafted as it is
            for cut in range(1, len(piece)):
                a, b = piece[:cut], piece[cut:]
                a_id, b_id = drafter.by_piece.get(a), drafter.by_piece.get(b)
                if a_id is None or b_id is None or b_id in stops or a not in target.by_piece:
                    continue
                target_of[a_id] = target.by_piece[a]
                bs, ts = found.setdefault(a_id, ([], []))
                bs.append(b_id)
                ts.append(t)
        completions = {a: (np.asarray(bs, dtype=np.int64), np.asarray(ts, dtype=np.int64))
                       for a, (bs, ts) in found.items()}
        return cls(np.asarray(sorted(completions), dtype=np.int64), completions, target_of)

    @property
    def size(self) -> int:
        """How many merges (pairs ``(a, b)``) there are."""
        return sum(int(bs.size) for bs, _ in self.completions.values())


def merge_candidates(table: MergeTable, drafter_row: np.ndarray, shared_max: float, lookahead: int,
                     floor: float = MERGE_FLOOR) -> list[int]:
    """The drafter ids of the shared tokens at most ``lookahead``, likeliest first, whose rows the law at this
    position is extended from: tokens that begin merges, with a drafter logit within ``log(floor)`` of the
    likeliest shared token's (``shared_max``) in the raw row ``drafter_row`` ``[V_drafter]``."""
    if lookahead <= 0 or table.starters.size == 0 or not np.isfinite(shared_max):
        return []
    values = np.asarray(drafter_row[table.starters], dtype=np.float64)  # [n]
    least = shared_max + np.log(floor)
    return [int(table.starters[i]) for i in top_ids(values, lookahead) if values[i] >= least]


def merge_logits(target_row: np.ndarray, table: MergeTable, candidates: Sequence[int],
                 lookahead_rows: Sequence[np.ndarray]) -> np.ndarray:
    """``target_row`` (the intersection logits ``[V_target]``, -inf outside it) with the mass of each
    candidate ``a`` (a drafter id) split between ``a`` and its merges by the
    drafter's row after ``a`` (``lookahead_rows[i]``, raw logits ``[V_drafter]``): the module docstring's
    ``q'`` as logits, in place, returned. Logits of several splits of one token add up as probabilities."""
    extra: dict[int, list[float]] = {}
    for a, row in zip(candidates, lookahead_rows, strict=True):
        row = np.asarray(row, dtype=np.float64)
        top = row.max()
        if not np.isfinite(top):
            continue  # no law after a: nothing to split by
        normaliser = top + np.log(np.exp(row - top).sum())
        b_ids, t_ids = table.completions[a]
        going_on = np.exp(row[b_ids] - normaliser)  # P(b | context, a) for each merge of a
        moved = float(going_on.sum())
        a_target = table.target_of[a]
        a_logit = float(target_row[a_target])
        for t, share in zip(t_ids.tolist(), going_on.tolist()):
            if share > 0.0:
                extra.setdefault(t, []).append(a_logit + np.log(share))
        target_row[a_target] = a_logit + np.log1p(-moved) if moved < 1.0 else -np.inf
    for t, logits in extra.items():
        target_row[t] = np.logaddexp.reduce(np.asarray(logits)) if len(logits) > 1 else logits[0]
    return target_row
