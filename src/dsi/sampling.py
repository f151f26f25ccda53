"""Pure verification math: logit processing, greedy and stochastic acceptance, residual and
bonus sampling, and the counter-based random numbers that make outputs independent of timing.

Notation follows speculative sampling (Leviathan et al. 2023; Chen et al. 2023) and the DSI
paper: ``p`` is the target's next-token distribution, ``q`` the drafter's, ``x`` a draft token.

Glossary:
- accepted token: a draft token ``x`` kept with probability ``min(1, p(x) / q(x))`` (greedy:
  kept iff ``x == argmax p``).
- correction token: drawn from ``normalize(max(0, p - q))`` after a rejection (greedy:
  ``argmax p``).
- bonus token: drawn from ``p`` itself where no draft exists (greedy: ``argmax p``).

Logit processing (:func:`process_logits`) is a function of a row and of the tokens before it
(:class:`Prefix`): penalties, ``logit_bias`` and ``min_tokens`` see the committed tokens and the
drafts before that row, so every verification row, drafter row and non-SI row gets the law it would
get in plain decoding. The order follows vLLM's sampler (``vllm/v1/sample/sampler.py``): min_tokens,
logit_bias, repetition / frequency / presence penalties, then temperature, min_p, top-k, top-p.

Every uniform is a pure function of (seed, absolute token position, purpose), so a fixed seed
gives the same tokens for any number of target servers, transport or arrival order. Nothing
here knows about models, threads or engines.
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import IntEnum
from functools import lru_cache

import numpy as np

from dsi.constraints import BoundConstraint, Constraint
from dsi.coupling import coupled_draw
from dsi.errors import ConfigError, DraftUnavailable, ModelError, require
from dsi.errors import shown as _shown

_MAX_SEED = 2**63 - 1
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value
MAX_PENALTY = 2.0  # OpenAI's bound on |presence_penalty| and |frequency_penalty|
MAX_TOKEN_ID_DIGITS = 10  # a logit_bias key given as text (JSON's keys): every vocabulary's ids are below 10**10
_TOKEN_ID_TEXT = re.compile(f"[0-9]{{1,{MAX_TOKEN_ID_DIGITS}}}")


def _number(value: object) -> bool:
    """A finite int or float that a float can hold (numpy could not use a larger int, and
    ``math.isfinite`` would overflow converting it)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    return abs(value) <= sys.float_info.max if isinstance(value, int) else math.isfinite(value)


def _bias_items(bias: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted ``(token id, bias)`` pairs; accepts a mapping (JSON's string keys too)
    or pairs. Raises :class:`ConfigError` naming a bad entry."""
    if isinstance(bias, Mapping):
        items: Iterable = bias.items()
    elif isinstance(bias, list | tuple):
        items = bias
    else:
        raise ConfigError(f"logit_bias={_shown(bias)} must map token ids to biases, e.g. {{50256: -100}}")
    out: dict[int, float] = {}
    for item in items:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise ConfigError(f"logit_bias entry {_shown(item)} must be a (token id, bias) pair")
        key, value = item
        token = key
        if isinstance(key, str):  # JSON's keys: ASCII digits only ("²" and "٥" are digits to str.isdigit)
            if _TOKEN_ID_TEXT.fullmatch(key) is None:
                raise ConfigError(f"logit_bias key {_shown(key)} must be a token id: 1 to {MAX_TOKEN_ID_DIGITS} "
                                  "ASCII digits (0-9), e.g. \"50256\"")
            token = int(key)
        if not (isinstance(token, int) and not isinstance(token, bool) and token >= 0):
            raise ConfigError(f"logit_bias key {_shown(key)} must be a token id (an integer >= 0)")
        if not (_number(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise ConfigError(f"logit_bias[{_shown(token)}]={_shown(value)} must be a number in "
                              f"[{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        out[token] = float(value)
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. ``temperature == 0`` means greedy (argmax) decoding.

    ``top_k == 0`` disables top-k; ``top_p == 1.0`` disables nucleus filtering; ``min_p == 0``
    disables min-p. The same processing is applied to target and drafter distributions, which keeps
    acceptance high; the output law is the processed *target* law whatever the drafter's processing.

    Every finite ``temperature > 0`` is sampling, however small: a temperature so small that
    ``logits / temperature`` overflows (e.g. 1e-320) gives the limit of the softmax as the
    temperature goes to 0, all the mass on the largest logits (shared equally by exact ties),
    i.e. greedy decoding up to ties (see :func:`process_logits`). It is not rewritten to 0: target
    and drafter go through the same :func:`process_logits`, so either choice is lossless, and
    keeping it keeps the parameters the caller gave (and their uniform draw among exact ties).

    Processors of the logits before temperature (OpenAI / vLLM semantics; greedy decoding takes the
    argmax of the processed row):

    - ``presence_penalty`` / ``frequency_penalty`` in [-2, 2]: subtract ``presence`` from the logit of
      every token generated so far, and ``frequency`` times its count (the output only, not the prompt).
    - ``repetition_penalty`` > 0 (1 disables it): a token seen in the prompt or the output has its
      logit divided by it if positive, multiplied by it otherwise (vLLM, transformers).
    - ``logit_bias``: ``{token id: bias}`` with biases in [-100, 100], added to the logits (target ids;
      stored as sorted pairs).
    - ``min_tokens``: EOS and ``stop_token_ids`` get probability 0 until that many tokens are generated.
    - ``stop_token_ids`` end generation like EOS; ``ignore_eos`` makes EOS an ordinary token (the
      request's stop set is built from them by :func:`dsi.engine.api.make_request`).
    - ``constraint``: structured output (:mod:`dsi.constraints`): every token the grammar does not allow
      after the output so far gets probability 0 (applied last among these processors). A
      :class:`~dsi.constraints.Constraint` is bound to the target's vocabulary when the request starts.

    ``coupled`` (sampling only): draws share keyed Gumbel noise (:mod:`dsi.coupling`): every committed token is
    the target's own draw, so one seed gives the same tokens whatever method, drafter or timing decodes it, and a
    target server that draws where its rows are answers a row with one token; drafts are accepted less often
    than by the standard rule (``min(1, p / q)`` and a residual draw), which is the default.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    constraint: Constraint | BoundConstraint | None = None
    coupled: bool = False

    def __post_init__(self) -> None:
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        require(
            _number(t) and t >= 0,
            f"temperature={_shown(t)} must be a finite number >= 0 (0 means greedy)",
        )
        require(
            isinstance(k, int) and not isinstance(k, bool) and k >= 0,
            f"top_k={_shown(k)} must be an integer >= 0 (0 disables top-k)",
        )
        require(
            isinstance(p, int | float) and not isinstance(p, bool) and 0.0 < p <= 1.0,
            f"top_p={_shown(p)} must be in (0, 1] (1 disables nucleus filtering)",
        )
        require(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= _MAX_SEED,
            f"seed={_shown(s)} must be an integer in [0, 2**63 - 1]",
        )
        require(_number(self.min_p) and 0.0 <= self.min_p <= 1.0,
                f"min_p={_shown(self.min_p)} must be in [0, 1] (0 disables min-p)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            require(_number(value) and -MAX_PENALTY <= value <= MAX_PENALTY,
                    f"{name}={_shown(value)} must be a number in [-2, 2] (0 disables it)")
        rp = self.repetition_penalty
        require(_number(rp) and rp > 0, f"repetition_penalty={_shown(rp)} must be a number > 0 (1 disables it)")
        m = self.min_tokens
        require(isinstance(m, int) and not isinstance(m, bool) and m >= 0,
                f"min_tokens={_shown(m)} must be an integer >= 0")
        require(isinstance(self.ignore_eos, bool), f"ignore_eos={_shown(self.ignore_eos)} must be true or false")
        require(isinstance(self.coupled, bool), f"coupled={_shown(self.coupled)} must be true or false")
        object.__setattr__(self, "logit_bias", _bias_items(self.logit_bias))
        stops = self.stop_token_ids
        require(isinstance(stops, list | tuple | set | frozenset)
                and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in stops),
                f"stop_token_ids={_shown(stops)} must be a list of token ids (integers >= 0)")
        object.__setattr__(self, "stop_token_ids", tuple(sorted(set(stops))))
        require(self.constraint is None or isinstance(self.constraint, Constraint | BoundConstraint),
                f"constraint={self.constraint!r} must be a dsi.Constraint (Constraint.json_schema(...), "
                ".regex(...), ...) or None")
        require(self.constraint is None or not self.ignore_eos,
                "ignore_eos=True with a constraint: the grammar ends the output with EOS")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_prefix(self) -> bool:
        """Whether processing a row needs the tokens before it (penalties, ``min_tokens``)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or self.min_tokens > 0 or self.constraint is not None)

    @property
    def coupled_draws(self) -> bool:
        """Sampling with coupled draws (:mod:`dsi.coupling`): a position's token is the target law's draw."""
        return self.coupled and not self.greedy

    @property
    def moves_argmax(self) -> bool:
        """Whether processing can change a row's argmax (or its top-k): penalties, bias, ``min_tokens``."""
        return self.uses_prefix or bool(self.logit_bias)

    @property
    def raw_argmax(self) -> bool:
        """Greedy, and each token is the argmax of the raw row: a model may hand out argmax ids only."""
        return self.greedy and not self.moves_argmax


@dataclass(frozen=True)
class Prefix:
    """What the logit processors see before a row: every token before it (prompt and generated,
    drafts included for a verification row), the prompt's length, and the ids that end generation
    (``min_tokens`` holds them back)."""

    tokens: Sequence[int]
    prompt_len: int
    stop_ids: frozenset[int] = frozenset()


class Purpose(IntEnum):
    """What a uniform is used for; part of its key so different uses never share a number."""

    DRAFT = 1  # the drafter samples its token at a position
    ACCEPT = 2  # accept/reject test of a draft token
    RESIDUAL = 3  # correction token after a rejection
    BONUS = 4  # target's own token where no draft exists (also plain decoding)


def uniform(seed: int, position: int, purpose: Purpose) -> float:
    """A uniform number in [0, 1) determined only by (seed, absolute position, purpose)."""
    digest = hashlib.blake2b(
        struct.pack("<QQQ", seed, position, int(purpose)), digest_size=8
    ).digest()
    return (int.from_bytes(digest, "little") >> 11) * (1.0 / 9007199254740992.0)  # 53 bits


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request with ``seed`` (``n`` > 1): ``seed`` itself for choice
    0 (so ``n = 1`` is unchanged), else a hash of both, in [0, 2**63 - 1]: the choices draw independent
    uniforms, and one request's choices never share their seeds with another seed's choice 0."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(struct.pack("<QQ", seed, index), digest_size=8, person=b"dsi-choice").digest()
    return int.from_bytes(digest, "little") >> 1


def check_logit_row(row: np.ndarray, what: str = "model") -> None:
    """Raise :class:`ModelError` unless ``row`` ([V]) can be turned into a distribution.

    NaN logits (a broken forward: no order, no limit) and rows whose every logit is -inf (no
    token is possible) are refused with the offending ids; +inf logits and huge finite values
    are accepted (:func:`process_logits` takes their limit).
    """
    if row.ndim != 1 or row.size == 0:
        raise ModelError(f"{what} logits have shape {row.shape}; expected one row [vocab_size]")
    top = row.max()  # one pass: the maximum is NaN when any logit is, -inf when all are
    if np.isnan(top):
        ids = np.flatnonzero(np.isnan(row))
        raise ModelError(f"{what} returned NaN logits at {ids.size} token ids (first {ids[:5].tolist()}); "
                         "a logit must be a number or -inf")
    if top == -np.inf:
        raise ModelError(f"{what} returned -inf for all {row.size} logits: no token has positive probability")


def process_logits(logits: np.ndarray, params: SamplingParams, prefix: Prefix | None = None) -> np.ndarray:
    """Turn one logit row into the sampling distribution: the processors before temperature
    (min_tokens, logit_bias, penalties; :func:`shape_logits`), then temperature, min_p, top-k, top-p.

    ``logits``: ``[vocab_size]``; ``prefix``: the tokens before the row, needed when
    ``params.uses_prefix``. Returns float64 probabilities ``[vocab_size]``: finite, non-negative,
    summing to 1, with positive mass on the first argmax of the processed logits. In greedy mode
    returns the one-hot distribution of that argmax (first index on ties).

    Extreme values take their limits, never NaN: logits of +inf share all the mass equally (the
    softmax's limit as they grow); a temperature so small that ``logits / temperature``
    overflows gives the limit as the temperature goes to 0 (all mass on the largest logits,
    equally on exact ties), computed as ``(logits - max) / temperature``; logits far below the
    maximum get probability 0. NaN logits, or all -inf, raise :class:`ModelError`
    (:func:`check_logit_row`).
    """
    row = _float_rows(logits)  # [V], as the model gave it: _distribution widens it to float64 as it divides
    check_logit_row(row)
    if params.moves_argmax:
        row = shape_logits(row, params, prefix)
    return _distribution(row, params)


def process_rows(logits: np.ndarray, params: SamplingParams, tokens: Sequence[int], prompt_len: int,
                 stop_ids: frozenset[int] = frozenset()) -> np.ndarray:
    """:func:`process_logits` of the last ``n`` rows of a forward over ``tokens`` (``logits``:
    ``[n, V]``; row j follows ``tokens[: len(tokens) - n + 1 + j]``), counting the output once and
    adding one token per row. Returns ``[n, V]`` probabilities (:data:`LAW_DTYPE`)."""
    if params.moves_argmax:
        rows = shape_rows(logits, params, tokens, prompt_len, stop_ids)  # [n, V] float64
    else:  # the raw rows, as LazyLaws reads them: no float64 copy (_distribution's law is the same bit for bit)
        rows = _float_rows(logits)
        for row in rows:
            check_logit_row(row)
    laws = [_distribution(row, params) for row in rows]
    return laws[0][None] if len(laws) == 1 else np.stack(laws)  # one row: a view, not a copy


class LazyLaws:
    """The processed laws of a forward's rows (what :func:`process_rows` gives), each computed when first read:
    ``laws[j]`` is bitwise the row :func:`process_rows` computes for it. A sampled verification reads only the
    rows its walk reaches, so a draft tree's rows off the decided path (and a chain's rows past its first
    rejection) are never processed: each processed row is a pass over the whole vocabulary in float64.

    ``logits`` ``[n, V]`` (checked by the caller, :func:`check_logit_row`); row ``j`` follows
    ``contexts[owner[j]][:lengths[j]]`` (a tree's rows: each on its own root-to-node path). Pickles as the raw
    rows, which are half the bytes of float64 laws (the processes and Ray transports)."""

    def __init__(self, logits: np.ndarray, params: SamplingParams, contexts: Sequence[Sequence[int]],
                 owner: Sequence[int], lengths: Sequence[int], prompt_len: int,
                 stop_ids: frozenset[int] = frozenset()) -> None:
        if params.greedy:
            raise ConfigError("LazyLaws holds sampled laws; a greedy verification reads argmax ids")
        if not len(logits) == len(owner) == len(lengths):
            raise ConfigError(f"{len(logits)} rows need as many owners and lengths, got {len(owner)} and "
                              f"{len(lengths)}")
        self.logits = logits
        self.params = params
        self.contexts = [tuple(int(t) for t in c) for c in contexts]
        self.owner = [int(o) for o in owner]
        self.lengths = [int(n) for n in lengths]
        self.prompt_len = prompt_len
        self.stop_ids = stop_ids
        self._laws: dict[int, np.ndarray] = {}

    @classmethod
    def of_chain(cls, logits: np.ndarray, params: SamplingParams, tokens: Sequence[int], prompt_len: int,
                 stop_ids: frozenset[int] = frozenset()) -> LazyLaws:
        """The last ``n`` rows of a forward over ``tokens`` (as in :func:`process_rows`)."""
        n = len(logits)
        return cls(logits, params, [tokens], [0] * n, [len(tokens) - n + 1 + j for j in range(n)], prompt_len,
                   stop_ids)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(np.shape(self.logits))

    def __len__(self) -> int:
        return len(self.logits)

    def computed(self) -> int:
        """How many rows were processed so far."""
        return len(self._laws)

    def __getitem__(self, index: int) -> np.ndarray:
        if not isinstance(index, int | np.integer) or isinstance(index, bool):
            raise TypeError(f"LazyLaws rows are read one at a time by an integer index, got {index!r}")
        n = len(self.logits)
        j = int(index) + n if index < 0 else int(index)
        if not 0 <= j < n:
            raise IndexError(f"row {index} of {n}")
        law = self._laws.get(j)
        if law is None:
            if self.params.moves_argmax:
                prefix = self.contexts[self.owner[j]][: self.lengths[j]]
                row = shape_rows(self.logits[j:j + 1], self.params, prefix, self.prompt_len, self.stop_ids)[0]
            else:  # the raw row, checked by the caller, in its own dtype (see _distribution)
                row = np.asarray(self.logits[j])
            law = self._laws[j] = _distribution(row, self.params)
        return law

    def prob(self, row: int, token: int) -> float:
        """The processed law of row ``row`` at ``token``."""
        return float(self[row][token])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        rows = np.stack([self[j] for j in range(len(self))]) if len(self) else np.empty((0, 0))
        return rows if dtype is None else rows.astype(dtype)

    def __getstate__(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key != "_laws"}  # the raw rows travel

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._laws = {}


def greedy_tokens(logits: np.ndarray, params: SamplingParams, tokens: Sequence[int], prompt_len: int,
                  stop_ids: frozenset[int] = frozenset()) -> np.ndarray:
    """Greedy decoding of the last ``n`` rows of a forward over ``tokens`` (as in :func:`process_rows`):
    the first argmax of each processed row, ``[n]`` int64, without building the processed rows.

    Exactly :func:`shape_rows`' argmax, sparsely: the processors move only the ids they touch
    (held stop ids, biased ids, the prefix's ids), so a row's argmax is the larger of its untouched
    maximum (the raw values, in the row's own dtype: widening to float64 keeps their order) and the
    touched ids' processed values, the lower id on a tie. A +inf logit is the first argmax, as its
    limit says."""
    rows = _float_rows(logits)  # [n, V], as the model gave them
    for row in rows:
        check_logit_row(row)
    if not params.moves_argmax:
        return np.argmax(rows, axis=-1).astype(np.int64)
    out = np.empty(rows.shape[0], dtype=np.int64)
    for j, counts in enumerate(chain_counts(params, tokens, prompt_len, rows.shape[0], rows.shape[1])):
        if params.constraint is not None:  # a mask touches most ids: the whole row
            row = np.asarray(rows[j], dtype=_shaping_dtype(rows[j], params))
            out[j] = int(np.argmax(_shape(row, params, counts, stop_ids)))
        else:
            out[j] = _sparse_argmax(rows[j], params, counts, stop_ids)
    return out


def touched_ids(params: SamplingParams, counts: _Counts | None, stop_ids: frozenset[int], vocab: int) -> np.ndarray:
    """The ids whose logits the processors before temperature change in a row after ``counts`` (ascending int64):
    the biased ids, the held stop ids, and the prompt's or output's ids the penalties touch."""
    few = [t for t, _ in params.logit_bias if t < vocab]
    if params.min_tokens and counts is not None and counts.generated < params.min_tokens:
        few += [t for t in stop_ids if 0 <= t < vocab]
    if counts is None:
        return merge_ids(np.empty(0, np.int64), few)
    if params.repetition_penalty != 1.0:
        return merge_ids(counts.seen, few)
    return merge_ids(np.unique(counts.output_ids), few)


def process_touched(values: np.ndarray, ids: np.ndarray, vocab: int, params: SamplingParams, counts: _Counts | None,
                    stop_ids: frozenset[int]) -> np.ndarray:
    """The processors before temperature on the raw logits ``values`` (float64) of the ids :func:`touched_ids`
    gave, in place: what :func:`shape_logits` makes of them, bit for bit (the same code), wherever the rest of
    the row is (a device: :mod:`dsi.models.hf.device_laws`)."""
    return _process(values, lambda which: np.searchsorted(ids, which), vocab, params, counts, stop_ids)


def _sparse_argmax(row: np.ndarray, params: SamplingParams, counts: _Counts | None, stop_ids: frozenset[int]) -> int:
    """The first argmax of ``_shape(row, ...)`` without building it."""
    vocab = row.size
    ids = touched_ids(params, counts, stop_ids, vocab)  # [m], ascending
    if not ids.size:
        return int(np.argmax(row))
    values = process_touched(row[ids].astype(np.float64), ids, vocab, params, counts, stop_ids)
    rest = row.copy()
    rest[ids] = -np.inf
    best = int(np.argmax(rest))
    best_value = float(rest[best])  # -inf when every untouched logit is
    k = int(np.argmax(values))  # the lowest touched id among the largest values
    if values[k] == -np.inf and best_value == -np.inf:
        raise _nothing_possible(params, stop_ids)
    if values[k] > best_value or (values[k] == best_value and ids[k] < best):
        return int(ids[k])
    return best


def _float_rows(logits: np.ndarray) -> np.ndarray:
    """``logits`` as the model gave them where they are floats (no copy), else as float64."""
    rows = np.asarray(logits)
    return rows if np.issubdtype(rows.dtype, np.floating) else rows.astype(np.float64)


def shape_rows(logits: np.ndarray, params: SamplingParams, tokens: Sequence[int], prompt_len: int,
               stop_ids: frozenset[int] = frozenset()) -> np.ndarray:
    """:func:`shape_logits` of the last ``n`` rows of a forward over ``tokens`` (as in
    :func:`process_rows`): ``[n, V]`` float64 logits after the processors that precede temperature,
    each row checked (:func:`check_logit_row`); the rows themselves when no processor moves them."""
    rows = np.asarray(logits, dtype=_shaping_dtype(logits, params))  # [n, V]
    for row in rows:
        check_logit_row(row)
    if not params.moves_argmax:
        return rows
    out = np.empty_like(rows)
    for j, counts in enumerate(chain_counts(params, tokens, prompt_len, rows.shape[0], rows.shape[1])):
        out[j] = _shape(rows[j], params, counts, stop_ids)
    return out


def chain_counts(params: SamplingParams, tokens: Sequence[int], prompt_len: int, n: int,
                 vocab: int) -> Iterator[_Counts | None]:
    """What the processors read of the prefix of each of the last ``n`` rows of a forward over ``tokens``, row by
    row (one object, advanced by a token a row: read it before the next; None where no processor reads it)."""
    first = len(tokens) - n + 1  # the prefix length of row 0
    counts = _Counts(tokens[:first], prompt_len, vocab) if params.uses_prefix else None
    for j in range(n):
        if j and counts is not None:
            counts.add(tokens[first + j - 1])
        yield counts


def shape_logits(logits: np.ndarray, params: SamplingParams, prefix: Prefix | None) -> np.ndarray:
    """The processors before temperature, in vLLM's order: ``min_tokens`` (EOS and stop ids to -inf
    while fewer tokens are generated), ``logit_bias`` (added), ``repetition_penalty`` (tokens of the
    prompt or output: positive logits divided, others multiplied), then ``frequency_penalty`` x count
    and ``presence_penalty`` subtracted for every token of the output. Returns a new float64 row."""
    row = np.asarray(logits, dtype=_shaping_dtype(logits, params))  # [V]
    tokens, prompt_len, stop_ids = _prefix_fields(params, prefix)
    return _shape(row, params, _Counts(tokens, prompt_len, row.size) if params.uses_prefix else None, stop_ids)


def _prefix_fields(params: SamplingParams, prefix: Prefix | None) -> tuple[Sequence[int], int, frozenset[int]]:
    """``prefix``'s tokens, prompt length and stop ids (empty without one); a missing prefix is refused
    where the processors read it."""
    if prefix is not None:
        return prefix.tokens, prefix.prompt_len, prefix.stop_ids
    if params.uses_prefix:
        raise ConfigError("penalties and min_tokens need the tokens before the row (a Prefix)")
    return (), 0, frozenset()


class _Counts:
    """Occurrences of each token id in the output, and which ids the prompt or output holds (ids
    outside the row's vocabulary, e.g. a drafter's smaller one, are not counted). Sparse: a row's
    penalties touch only these ids, so processing costs O(output) on top of one copy of the row; the
    prompt's ids are found once per prompt (:func:`_prompt_ids`), not once per row."""

    def __init__(self, tokens: Sequence[int], prompt_len: int, vocab: int) -> None:
        cut = min(prompt_len, len(tokens))
        self.vocab = vocab
        self.generated = len(tokens) - cut
        self.tail: list[int] = [int(t) for t in tokens[cut:]]  # the output itself (a constraint reads it)
        self.output: dict[int, int] = {}
        for t in tokens[cut:]:
            if 0 <= t < vocab:
                self.output[int(t)] = self.output.get(int(t), 0) + 1
        self._prompt = _prompt_ids(tuple(tokens[:cut]), vocab)
        self.seen = merge_ids(self._prompt, self.output)  # the ids the prompt or the output holds (ascending)

    @property
    def output_ids(self) -> np.ndarray:
        """The ids the output holds, in the order of :attr:`output` (int64)."""
        return np.fromiter(self.output.keys(), np.int64, len(self.output))

    def add(self, token: int) -> None:
        self.generated += 1
        self.tail.append(int(token))
        if 0 <= token < self.vocab:
            token = int(token)
            if token not in self.output:
                self.seen = merge_ids(self.seen, [token])
            self.output[token] = self.output.get(token, 0) + 1


@lru_cache(maxsize=16)
def _prompt_ids(prompt: tuple[int, ...], vocab: int) -> np.ndarray:
    """The ids ``prompt`` holds within ``vocab``: ascending, unique, int64 (read-only). Cached:
    every row and draft of a request has the same prompt, and the repetition penalty's ids of a long prompt
    found again for each took most of a row's host time (6.5 ms for a 5-row verification after 16k tokens)."""
    ids = np.unique(np.fromiter(prompt, np.int64, len(prompt)))
    ids = ids[(ids >= 0) & (ids < vocab)]
    ids.flags.writeable = False
    return ids


def merge_ids(ids: np.ndarray, more: Iterable[int]) -> np.ndarray:
    """``ids`` (ascending, unique, int64) with the ids of ``more`` it lacks, in order: one copy of ``ids``
    (none where it lacks none), not a sort of it."""
    extra = np.unique(np.fromiter(more, np.int64))
    if not extra.size:
        return ids
    at = np.searchsorted(ids, extra)
    present = ids[np.minimum(at, ids.size - 1)] == extra if ids.size else np.zeros(extra.size, dtype=bool)
    return np.insert(ids, at[~present], extra[~present])


class NothingAllowed(ConfigError):
    """A row in which a request's constraint allows none of the tokens left: on the target's row the request
    fails; on a drafter's (of another vocabulary, whose row covers only the tokens both share) there is nothing
    to draft (:func:`draft_from_logits`)."""


def _shape(row: np.ndarray, params: SamplingParams, counts: _Counts | None, stop_ids: frozenset[int]) -> np.ndarray:
    x = _process(row.copy(), lambda which: which, row.size, params, counts, stop_ids)  # [V] float64
    holding = params.min_tokens and counts is not None and counts.generated < params.min_tokens
    if params.constraint is not None and counts is not None:
        allowed = _constraint(params).allowed(counts.tail)  # [V] of the target's vocabulary
        if allowed.size >= x.size:  # a drafter's row may be shorter (one tokenizer, padded less)
            x[~allowed[: x.size]] = -np.inf
        else:  # ids past the target's vocabulary: never allowed
            x[: allowed.size][~allowed] = -np.inf
            x[allowed.size:] = -np.inf
        if x.max() == -np.inf:
            raise NothingAllowed(f"no token is possible: the {params.constraint.constraint.kind} constraint allows "
                              f"none of the tokens left after the other processors (min_tokens="
                              f"{params.min_tokens}, logit_bias={dict(params.logit_bias)!r})")
    if holding and not (x > -np.inf).any():  # only min_tokens makes a logit -inf
        raise _nothing_possible(params, stop_ids)
    return x


def _shaping_dtype(logits: np.ndarray, params: SamplingParams) -> type:
    """float64 where a processor computes on the logits (penalties, bias); with a constraint alone, which only
    sets some of them to -inf, the model's own float dtype (its law is the same: see :func:`_distribution`)."""
    dtype = np.asarray(logits).dtype
    only_masked = (params.constraint is not None and not params.logit_bias and not params.min_tokens
                   and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
                   and params.repetition_penalty == 1.0)
    return dtype.type if only_masked and np.issubdtype(dtype, np.floating) else np.float64


def _constraint(params: SamplingParams) -> BoundConstraint:
    if not isinstance(params.constraint, BoundConstraint):
        raise ConfigError("the request's constraint is not bound to the target's vocabulary yet "
                          "(dsi.constraints.bind; the decoders bind it when a request starts)")
    return params.constraint


def _process(x: np.ndarray, where, vocab: int, params: SamplingParams, counts: _Counts | None,
             stop_ids: frozenset[int]) -> np.ndarray:
    """The processors before temperature applied in place to the float64 values ``x`` of a row's ids
    (``vocab``: the row's size); ``where(ids)`` gives the positions in ``x`` of token ids (the identity
    for a whole row, a lookup for the touched ids :func:`_sparse_argmax` gathered). One code for
    both, so they agree bit for bit."""
    if params.min_tokens and counts is not None and counts.generated < params.min_tokens:
        held = [t for t in stop_ids if 0 <= t < vocab]
        if held:
            x[where(np.asarray(held, dtype=np.int64))] = -np.inf
    biased = [(t, b) for t, b in params.logit_bias if t < vocab]
    if biased:
        ids = where(np.fromiter((t for t, _ in biased), np.int64, len(biased)))
        x[ids] += np.fromiter((b for _, b in biased), np.float64, len(biased))
    if counts is not None:
        rp = params.repetition_penalty
        if rp != 1.0 and counts.seen.size:
            ids = where(counts.seen)
            v = x[ids]
            x[ids] = np.where(v > 0, v / rp, v * rp)
        if (params.frequency_penalty or params.presence_penalty) and counts.output:
            ids = where(np.fromiter(counts.output.keys(), np.int64, len(counts.output)))
            if params.frequency_penalty:
                x[ids] -= params.frequency_penalty * np.fromiter(counts.output.values(), np.float64, len(ids))
            if params.presence_penalty:
                x[ids] -= params.presence_penalty
    return x


def _nothing_possible(params: SamplingParams, stop_ids: frozenset[int]) -> ConfigError:
    return ConfigError(
        f"no token is possible after logit processing (min_tokens={params.min_tokens} holds back the stop "
        f"ids {sorted(stop_ids)[:5]}, logit_bias={dict(params.logit_bias)!r}): every logit is -inf")


LAW_DTYPE = np.float32  # processed laws: each probability within float32 rounding of the processed softmax
# temperatures whose 1 / T is a normal float32 with room to spare (outside: the scaling is done in float64)
_SCALED_T = (2.0 / float(np.finfo(np.float32).max), 0.5 / float(np.finfo(np.float32).tiny))


def _distribution(row: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Temperature, min_p, top-k and top-p of a checked row ``[V]`` (greedy: its one-hot argmax): the law as a
    float32 array (:data:`LAW_DTYPE`) summing to 1 within float32 rounding.

    This runs for every drafted token and every verified row a sampled request reads, over the whole vocabulary,
    so it is a few passes over one float32 array, in place: the logits shifted by their maximum (in the row's own
    dtype, then rounded to float32; so the maximum is exactly 0 and nothing overflows), scaled by ``1 / T``, the
    filters, ``exp`` and the normalisation. With a top-k of at most :data:`NUCLEUS_FIRST` ids, only the ids it
    keeps (:func:`_top_k`) are filtered, exponentiated and normalised, by the whole array's sum: the same law bit
    for bit, at a third less of the cost. A temperature so small (or so large) that ``1 / T`` is no normal
    float32 divides in float64 instead, which takes the limit (as T goes to 0, every logit below the maximum goes
    to -inf). Laws are compared and
    composed in float64 where a decision reads them (:func:`decide`, :func:`residual`, :func:`sample_from`), so
    the float32 law is the law every method samples from, exactly as the float64 enumeration tests check."""
    top = row.max()
    if top == np.inf:  # the limit as those logits grow: they share the mass equally
        row = np.where(np.isposinf(row), 0.0, -np.inf)
        top = 0.0
    if params.greedy:
        probs = np.zeros(row.shape, dtype=LAW_DTYPE)
        probs[int(np.argmax(row))] = 1.0
        return probs
    law = np.empty(row.shape, dtype=LAW_DTYPE)  # [V], the one array written below
    temperature = params.temperature
    candidates = None  # the ids of positive mass where top-k leaves few (in id order), for top-p
    with np.errstate(over="ignore", under="ignore"):
        np.subtract(row, top, out=law)  # <= 0, exactly 0 at the maximum; a gap beyond float32 is -inf
        if _SCALED_T[0] <= temperature <= _SCALED_T[1]:
            if temperature != 1.0:
                law *= LAW_DTYPE(1.0 / temperature)
        else:
            np.divide(law, temperature, out=law, dtype=np.float64)
        if 0 < params.top_k <= NUCLEUS_FIRST and params.top_k < law.size:  # few ids left: only they are computed
            ids, scores = _top_k(law, params.top_k)  # ties with the k-th are kept, and so the maximum
            if params.min_p > 0.0:  # relative to the most likely token (at 0): p < min_p * p_max
                kept = ~(scores < np.log(params.min_p))
                ids, scores = ids[kept], scores[kept]
            np.exp(scores, out=scores)
            law[:] = 0.0
            law[ids] = scores  # the whole-vocabulary law, zero outside the few
            scores /= law.sum()  # the whole array's sum: the same rounding as below
            law[ids] = scores
            candidates = ids[scores > 0]
        else:
            if params.min_p > 0.0:  # relative to the most likely token (at 0): p < min_p * p_max
                law[law < np.log(params.min_p)] = -np.inf
            if params.top_k and params.top_k < law.size:
                kth = np.partition(law, -params.top_k)[-params.top_k]
                law[law < kth] = -np.inf  # ties with the k-th are kept, and so the maximum
            np.exp(law, out=law)  # the maximum has 1, so the sum is in [1, V]
            law /= law.sum()
    if params.top_p < 1.0:
        kept = nucleus(row, law, params.top_p, few=params.min_p > 0.0, candidates=candidates)
        nucleus_law = np.zeros_like(law)
        nucleus_law[kept] = law[kept]
        law = nucleus_law
        law /= law.sum()
    return law


NUCLEUS_FIRST = 1024  # the likeliest ids top-p orders first; 8 times more each time their mass falls short
TOP_K_GROUPS = 1024  # ids grouped by their residue modulo this: the groups' maxima bound a top-k's k-th score


def _top_k(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ids (in id order) and the values of the entries of ``scores`` ``[V]`` at least its ``k``-th largest (ties
    with it included), as a partition of the whole array selects them. For ``k`` well under
    :data:`TOP_K_GROUPS`: the ``k``-th largest of the maxima of the groups of ids of one residue modulo
    :data:`TOP_K_GROUPS` is at most the ``k``-th largest score (``k`` groups hold a score at least it), so only the
    few scores at least that bound are partitioned: a strided maximum and one comparison over the array, where a
    partition of it took 90 us over 152k ids and masking the rest another 70."""
    size, groups = scores.size, TOP_K_GROUPS
    if 4 * k <= groups and size >= 8 * groups:
        maxima = scores[: size - size % groups].reshape(-1, groups).max(axis=0)  # [groups]
        ids = np.flatnonzero(scores >= np.partition(maxima, groups - k)[groups - k])
        values = scores[ids]
    else:  # too few groups for a useful bound: every score is a candidate
        ids, values = None, scores
    kept = values >= np.partition(values, values.size - k)[values.size - k]
    return (np.flatnonzero(kept) if ids is None else ids[kept]), values[kept]


def nucleus(row: np.ndarray, law: np.ndarray, top_p: float, few: bool = False,
            candidates: np.ndarray | None = None) -> np.ndarray:
    """The ids top-p keeps of a law ``[V]`` and the logits ``row`` ``[V]`` it was made of: the smallest prefix of
    the ids ordered by their logits, most likely first (ties in id order, so probabilities that rounding made
    equal keep the logits' order, and the first argmax comes first), whose mass, summed in float64 in that order,
    reaches ``top_p``; every id where rounding leaves the whole mass short of it; always at least one.

    Only the likeliest ids are sorted (:data:`NUCLEUS_FIRST`, every id tied with the last of them included),
    and more only where their mass falls short of ``top_p``: the same ids, in the same order and summed to the
    same numbers, as a sort of the whole vocabulary (10 ms over 152k ids), at a partition's cost. ``few``: top-k
    or min_p left few ids of positive mass, so they are the candidates (every id of zero mass has a smaller logit
    than each of them: the law is non-decreasing in the logits), without the partition; ``candidates``: those ids
    already known (in id order)."""
    size = row.size
    if few or candidates is not None:
        if candidates is None:
            candidates = np.flatnonzero(law > 0)  # in id order (a bool mask: 15 times faster than of the floats)
        if candidates.size <= NUCLEUS_FIRST:
            order, keep = _nucleus_of(row, law, candidates, top_p)
            if keep < order.size:
                return order[: keep + 1]
    count = NUCLEUS_FIRST
    while True:
        if count >= size:
            candidates = np.arange(size)
        else:
            kth = np.partition(row, size - count)[size - count]  # the count-th largest logit
            candidates = np.flatnonzero(row >= kth)  # in id order
        order, keep = _nucleus_of(row, law, candidates, top_p)
        if keep < order.size or order.size == size:
            return order[: keep + 1]
        count *= 8


def _nucleus_of(row: np.ndarray, law: np.ndarray, candidates: np.ndarray, top_p: float) -> tuple[np.ndarray, int]:
    """``candidates`` (ids in id order, a prefix of the ids ordered by their logits) most likely first (a stable
    sort: ties keep id order), and the index of the first of them at which their mass, summed in float64 in that
    order, reaches ``top_p`` (``len(candidates)`` where it falls short)."""
    order = candidates[np.argsort(-row[candidates], kind="stable")]
    return order, int(np.searchsorted(np.cumsum(law[order], dtype=np.float64), top_p, side="left"))


SAMPLE_BLOCK = 2048  # ids per block of sample_from's two-level search


def sample_from(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF sample from ``probs`` ([V], non-negative, positive sum) with uniform ``u``.

    The cumulative sum is taken in two levels: the masses of blocks of :data:`SAMPLE_BLOCK` ids (summed
    pairwise, vectorised, in the law's dtype), then the running sum inside the one block ``u`` lands in, in
    float64. That is the inverse CDF of ``probs`` as a running sum over all ids is (both round each partial sum;
    they may part only where ``u * total`` falls within rounding of a boundary), at a tenth of the cost over a
    large vocabulary.

    The token returned always has positive probability. A row with no positive finite mass
    (all zero, negative or NaN entries) raises :class:`ModelError` rather than giving a token.
    """
    probs = np.asarray(probs)
    size = probs.size
    whole = size - size % SAMPLE_BLOCK
    masses = probs[:whole].reshape(-1, SAMPLE_BLOCK).sum(axis=1)  # [blocks]
    if whole < size:
        masses = np.append(masses, probs[whole:].sum())
    cdf = np.cumsum(masses, dtype=np.float64)  # [blocks]
    total = cdf[-1]
    if not (np.isfinite(total) and total > 0.0) or (probs < 0.0).any():
        raise ModelError(f"cannot sample from a distribution of total mass {total!r} with "
                         f"{int((probs < 0.0).sum())} negative entries; it needs finite non-negative "
                         "probabilities with a positive sum")
    goal = u * total
    block = min(int(np.searchsorted(cdf, goal, side="right")), cdf.size - 1)
    start = block * SAMPLE_BLOCK
    inside = np.cumsum(probs[start:start + SAMPLE_BLOCK], dtype=np.float64)  # the block's running sum
    before = cdf[block - 1] if block else 0.0
    index = start + min(int(np.searchsorted(inside, goal - before, side="right")), inside.size - 1)
    while probs[index] <= 0.0:  # guard against landing on a zero-mass token by rounding (a positive one is before)
        index -= 1
    return index


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``normalize(max(0, p - q))``, the law of the correction token ([V] each).

    If ``p <= q`` everywhere (so a rejection had probability 0, or rounding left no mass),
    falls back to ``p``: the result always has positive mass, and only on tokens with ``p > 0``.
    """
    r = np.subtract(p, q)  # [V], the one array written below (in place: see _distribution)
    np.maximum(r, 0.0, out=r)
    total = r.sum()
    if total <= 0.0:
        return p
    r /= total
    return r


@dataclass(frozen=True)
class Decision:
    """Outcome of deciding one position: the committed token and whether the draft was kept."""

    token: int
    accepted: bool


def draft_token(q: np.ndarray, params: SamplingParams, position: int) -> int:
    """The drafter's token at absolute ``position`` from its processed distribution ``q``."""
    if params.greedy:
        return int(np.argmax(q))
    if params.coupled:
        return coupled_draw(q, params.seed, position)
    return sample_from(q, uniform(params.seed, position, Purpose.DRAFT))


def draft_from_logits(logits: np.ndarray, params: SamplingParams, position: int,
                      prefix: Prefix | None = None) -> tuple[int, np.ndarray | None]:
    """The drafter's token at ``position`` from its raw logits ``[V]``, and its processed ``q``.

    Greedy: ``(argmax of the processed logits, None)`` (no distribution needed); sampling: a draw
    from ``q``. ``prefix``: the drafter's tokens before the row (penalties, ``min_tokens``).
    """
    with drafting():
        if params.greedy:
            row = np.asarray(logits)
            if not params.moves_argmax:
                check_logit_row(row, "the drafter")
                return int(np.argmax(row)), None
            tokens, prompt_len, stop_ids = _prefix_fields(params, prefix)
            # sparse: touched ids only
            return int(greedy_tokens(row[None], params, tokens, prompt_len, stop_ids)[0]), None
        q = process_logits(logits, params, prefix)  # [V]
    return draft_token(q, params, position), q


@contextmanager
def drafting() -> Iterator[None]:
    """Processing a drafter's row: where the request's constraint allows none of its tokens (a drafter of another
    vocabulary, whose row covers only the tokens both share), there is nothing to draft
    (:class:`~dsi.errors.DraftUnavailable`: the target's own row decides the position), not a failed request."""
    try:
        yield
    except NothingAllowed as exc:
        raise DraftUnavailable(f"the drafter's row has no token the request allows: {exc}") from None


def decide_greedy(target_token: int, draft: int) -> Decision:
    """Greedy decision from the target's argmax alone: accept iff ``draft == target_token``,
    otherwise the correction is ``target_token`` (what :func:`decide` does with a greedy ``p``)."""
    return Decision(int(target_token), int(target_token) == int(draft))


def decide(
    p: np.ndarray,
    draft: int,
    q: np.ndarray | None,
    params: SamplingParams,
    position: int,
) -> Decision:
    """Accept or reject ``draft`` at absolute ``position`` given target ``p`` and drafter ``q``.

    ``p``, ``q``: processed distributions ``[V]``. Greedy: accept iff ``draft == argmax p``,
    otherwise the correction is ``argmax p``. Sampling: accept with probability
    ``min(1, p[draft] / q[draft])``, otherwise draw the correction from the residual. A draft the
    drafter could not have drawn (``q[draft] == 0``) is accepted iff ``p[draft] > 0``, so the
    committed token always has positive target probability.
    """
    if not (isinstance(draft, int | np.integer) and 0 <= draft < p.size):
        raise ConfigError(f"draft={draft!r} must be a token id in [0, {p.size})")
    if params.greedy:
        best = int(np.argmax(p))
        return Decision(best, best == draft)
    if params.coupled:  # the target's own draw decides: the draft is kept where it is that draw
        token = coupled_draw(p, params.seed, position)
        return Decision(token, token == draft)
    if q is None:
        raise ConfigError("sampling decisions need the drafter distribution q")
    if accepts(float(p[draft]), float(q[draft]), params, position):
        return Decision(draft, True)
    return Decision(correction(p, q, params, position), False)


def accepts(p_x: float, q_x: float, params: SamplingParams, position: int) -> bool:
    """Whether a sampled draft with target probability ``p_x`` and drafter probability ``q_x`` is accepted at
    absolute ``position``: its ACCEPT uniform below ``min(1, p_x / q_x)``, in float64 whatever the laws' dtype
    (a draft the drafter could not have drawn, ``q_x == 0``, is accepted iff ``p_x > 0``). A function of the two
    numbers, the seed and the position only: a target server decides it as the engine does
    (:func:`read_chain_laws`)."""
    ratio = p_x / q_x if q_x > 0.0 else (1.0 if p_x > 0.0 else 0.0)
    return uniform(params.seed, position, Purpose.ACCEPT) < ratio


def correction(p: np.ndarray, q: np.ndarray, params: SamplingParams, position: int) -> int:
    """The correction token at absolute ``position`` after a rejection: a draw from :func:`residual`."""
    return sample_from(residual(p, q), uniform(params.seed, position, Purpose.RESIDUAL))


def decide_row(laws, row: int, draft: int, q: np.ndarray | None, params: SamplingParams, position: int) -> Decision:
    """:func:`decide` on row ``row`` of a verification's sampled ``laws`` (``[n, V]`` laws, a :class:`LazyLaws` or
    a :class:`ReadLaws`), reading the row's whole law only at a rejection (its residual; coupled draws: always)."""
    if params.coupled:
        token = coupled_draw(laws[row], params.seed, position)
        return Decision(token, token == int(draft))
    if q is None:
        raise ConfigError("sampling decisions need the drafter distribution q")
    prob = getattr(laws, "prob", None)
    p_x = prob(row, draft) if prob is not None else float(laws[row][draft])
    if accepts(p_x, float(q[draft]), params, position):
        return Decision(int(draft), True)
    return Decision(correction(laws[row], q, params, position), False)


@dataclass(frozen=True)
class ReadLaws:
    """A sampled chain verification's rows as the decisions read them, taken where the rows are
    (:func:`read_chain_laws`): ``accept_probs[j]``, the target's probability of the draft row ``j`` compares, for
    the rows up to the first rejected draft; and the whole laws the decisions may read: the rejected row's (its
    residual) or, when every draft is accepted, the last row's (its draft was not drafted yet: its decision or
    bonus draw needs the law). Rows after a rejection are never read (the rejection restarts the drafts), so a
    remote server sends at most one law instead of ``n``."""

    num_rows: int
    accept_probs: np.ndarray  # [m] float64, m <= num_rows - 1
    laws: dict[int, np.ndarray]  # row -> its law [V] (LAW_DTYPE)

    def __len__(self) -> int:
        return self.num_rows

    def prob(self, row: int, token: int) -> float:
        """The target's probability of ``token`` at ``row``."""
        if row < len(self.accept_probs):
            return float(self.accept_probs[row])
        return float(self[row][token])

    def __getitem__(self, row: int) -> np.ndarray:
        law = self.laws.get(int(row))
        if law is None:
            raise ModelError(f"row {row} of a {self.num_rows}-row verification was not read by its target server "
                             f"(it sent rows {sorted(self.laws)}): the engine and the server disagree on a decision")
        return law


def read_chain_laws(laws: LazyLaws, context: Sequence[int], draft_probs: Sequence[float],
                    params: SamplingParams) -> ReadLaws:
    """What the decisions need of a sampled chain verification's ``laws`` (rows following ``context[:len - n + 1 +
    j]``): row ``j < n - 1`` compares the draft ``context[len - n + 1 + j]``, whose drafter probability is
    ``draft_probs[j]``; each is decided here (:func:`accepts`, the engine's own test on the same numbers) up to
    the first rejection. See :class:`ReadLaws`."""
    n = len(laws)
    first = len(context) - n + 1  # the absolute position row 0 decides
    probs, read = decide_chain(lambda j: float(laws[j][int(context[first + j])]), n, draft_probs, params, first)
    return ReadLaws(n, probs, {read: laws[read]})


def decide_chain(target_prob, n: int, draft_probs: Sequence[float], params: SamplingParams,
                 first: int) -> tuple[np.ndarray, int]:
    """The decisions of a sampled chain of ``n`` rows whose row ``j < n - 1`` compares a draft of drafter
    probability ``draft_probs[j]`` at absolute position ``first + j``, and ``target_prob(j)``, the target's (read
    only up to the first rejection): those target probabilities, and the row whose whole law the decisions go on
    to read (the rejected one, for its residual, or the last). One code for the host and a device
    (:mod:`dsi.models.hf.device_laws`)."""
    if len(draft_probs) != n - 1:
        raise ConfigError(f"{n} rows compare {n - 1} drafts; got {len(draft_probs)} drafter probabilities")
    probs = np.empty(n - 1, dtype=np.float64)
    for j, q_x in enumerate(draft_probs):
        probs[j] = p_x = target_prob(j)
        if not accepts(p_x, float(q_x), params, first + j):
            return probs[: j + 1], j
    return probs, n - 1


@dataclass(frozen=True)
class RowsRead:
    """How the last ``n`` rows of a forward over ``tokens`` are read (a forward's ``read``:
    :func:`dsi.models.base.extend_rows`; row ``j`` follows ``tokens[: len - n + 1 + j]``). A session whose model
    decides on its device (the hf backend on a GPU: :mod:`dsi.models.hf.device_laws`) reads :attr:`on_device` ones
    there, and only what the decisions need crosses to the host."""

    tokens: tuple[int, ...]
    params: SamplingParams
    prompt_len: int
    stop_ids: frozenset[int] = frozenset()

    @property
    def on_device(self) -> bool:
        """Whether a device may read these rows there: not for coupled draws, which the host makes
        (:mod:`dsi.coupling`)."""
        return not self.params.coupled_draws


@dataclass(frozen=True)
class ChainRead(RowsRead):
    """A target server's reading of a sampled chain verification: the argmax ids of the processed rows (which
    checks each row), and the laws processed as the decisions read them (:class:`LazyLaws`), or, with the drafts'
    drafter probabilities, decided here (:func:`read_chain_laws`: only the law a decision reads goes back; on a
    device, only the drafts' probabilities and that law cross)."""

    draft_probs: tuple[float, ...] | None = None

    @property
    def on_device(self) -> bool:
        """Whether a device can decide this chain: its drafts' probabilities came with it."""
        return self.draft_probs is not None and not self.params.greedy and super().on_device

    def __call__(self, logits: np.ndarray) -> tuple[np.ndarray, LazyLaws | ReadLaws]:
        params = self.params
        tokens = greedy_tokens(logits, params, self.tokens, self.prompt_len, self.stop_ids)  # checks rows
        laws = LazyLaws.of_chain(logits, params, self.tokens, self.prompt_len, self.stop_ids)
        if self.draft_probs is None:
            return tokens, laws
        return tokens, read_chain_laws(laws, self.tokens, self.draft_probs, params)


@dataclass(frozen=True)
class GreedyRead(RowsRead):
    """A greedy verification whose processors can move the argmax (penalties, bias, ``min_tokens``, a
    constraint): the argmax ids of the processed rows (:func:`greedy_tokens`; on a device the same ids, bit for
    bit, and only they cross)."""

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        return greedy_tokens(logits, self.params, self.tokens, self.prompt_len, self.stop_ids)


@dataclass(frozen=True)
class LastRowRead(RowsRead):
    """A reading of a forward's last row only: a draw at :attr:`position`, the one after ``tokens``."""

    @property
    def position(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class BonusRead(LastRowRead):
    """Non-SI's one sampled row: the target's own token at ``position`` (:func:`bonus`) from the row's law (on a
    device only the token crosses)."""

    def __call__(self, logits: np.ndarray) -> int:
        law = process_rows(logits[-1:], self.params, self.tokens, self.prompt_len, self.stop_ids)[0]
        return bonus(law, self.params, self.position)


@dataclass(frozen=True)
class DraftRead(LastRowRead):
    """A drafter's reading of its forward's last row: the draft at :attr:`position` and its processed law ``q``
    (None when greedy): :func:`draft_from_logits`. On a device the law is made and drawn from there
    (:func:`dsi.models.hf.device_laws.draft`): only the token and its probability cross, and the law stays there
    until a decision reads it whole (a rejection's residual)."""

    def __call__(self, logits: np.ndarray) -> tuple[int, np.ndarray | None]:
        prefix = Prefix(self.tokens, self.prompt_len, self.stop_ids)
        return draft_from_logits(np.asarray(logits)[-1], self.params, self.position, prefix)


def bonus(p: np.ndarray, params: SamplingParams, position: int) -> int:
    """The target's own token at ``position`` (no draft to test): argmax or a sample from ``p``."""
    if params.greedy:
        return int(np.argmax(p))
    if params.coupled:
        return coupled_draw(p, params.seed, position)
    return sample_from(p, uniform(params.seed, position, Purpose.BONUS))
