"""Synthetic target/drafter pairs with a chosen acceptance rate, for tests and benchmarks.

The target's logits are a seeded pseudo-random function of the whole context. For each context
the drafter either copies the target's logits exactly (with probability ``acceptance``, decided
by a hash of the context, so the same context always gets the same answer) or shifts them by
one token, which moves the argmax elsewhere. Hence the greedy acceptance rate is
``acceptance`` in expectation; in sampling mode it is a little higher (the shifted distribution
still overlaps the target's).

Both are plain picklable callables wrapped in :class:`CallableLM`, so they also run in other
processes. Optional ``*_ttft`` / ``*_tpot`` arguments wrap them in :class:`WithLatency`.
"""

from __future__ import annotations

import numpy as np

from dsi.errors import ConfigError
from dsi.models.base import check_int, check_token_ids
from dsi.models.costs import ForwardCosts
from dsi.models.emulated.callable import CallableLM
from dsi.models.emulated.latency import WithLatency

_MASK = (1 << 63) - 1


def _context_key(context: tuple[int, ...]) -> int:
    return hash(context) & _MASK  # ints and tuples of ints hash identically in every process


class SyntheticTarget:
    """``next_logits`` of a synthetic target: Gaussian logits seeded by (seed, context)."""

    def __init__(self, vocab_size: int, seed: int, sharpness: float = 2.5) -> None:
        self.vocab_size = vocab_size
        self.seed = seed
        self.sharpness = sharpness

    def __call__(self, context: tuple[int, ...]) -> np.ndarray:
        rng = np.random.default_rng([self.seed, _context_key(context)])
        return self.sharpness * rng.standard_normal(self.vocab_size)  # [V]


class SyntheticDrafter:
    """``next_logits`` of a drafter that agrees with ``target`` with probability ``acceptance``."""

    def __init__(self, target: SyntheticTarget, acceptance: float, seed: int) -> None:
        self.target = target
        self.acceptance = acceptance
        self.seed = seed

    def agrees(self, context: tuple[int, ...]) -> bool:
        rng = np.random.default_rng([self.seed, 1, _context_key(context)])
        return bool(rng.random() < self.acceptance)

    def __call__(self, context: tuple[int, ...]) -> np.ndarray:
        logits = self.target(context)  # [V]
        if self.agrees(context):
            return logits
        return np.roll(logits, 1)  # argmax moves to the next token id


def synthetic_pair(
    acceptance: float,
    *,
    vocab_size: int = 32,
    seed: int = 0,
    target_ttft: float | None = None,
    target_tpot: float | None = None,
    drafter_ttft: float | None = None,
    drafter_tpot: float | None = None,
    target_cv: float = 0.0,
):
    """Build ``(target, drafter)`` over ``vocab_size`` tokens with greedy acceptance ``acceptance``.

    Latencies in seconds: give ``*_tpot`` (and optionally ``*_ttft``, default equal to tpot) to
    wrap a model in :class:`WithLatency`; ``target_cv > 0`` makes every target forward's latency
    random (lognormal, mean ``target_tpot``, coefficient of variation ``target_cv``).
    """
    if not isinstance(acceptance, int | float) or isinstance(acceptance, bool) or not 0.0 <= acceptance <= 1.0:
        raise ConfigError(f"acceptance={acceptance!r} must be a number in [0, 1]")
    vocab_size = check_int(vocab_size, "vocab_size", 2)
    seed = check_int(seed, "seed", 0)  # numpy seeds the generators with it: a non-negative integer
    target_fn = SyntheticTarget(vocab_size, seed)
    drafter_fn = SyntheticDrafter(target_fn, float(acceptance), seed + 1)
    target = CallableLM(target_fn, vocab_size, name=f"synthetic-target(seed={seed})")
    drafter = CallableLM(drafter_fn, vocab_size, name=f"synthetic-drafter(a={acceptance})")
    if target_tpot is not None:
        target = WithLatency(target, target_tpot if target_ttft is None else target_ttft, target_tpot,
                             cv=target_cv, seed=seed)
    if drafter_tpot is not None:
        drafter = WithLatency(drafter, drafter_tpot if drafter_ttft is None else drafter_ttft, drafter_tpot)
    return target, drafter


# ---- a pair over a real vocabulary whose forwards cost next to nothing on the host -------------------------------

_GOLDEN = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of ``x`` (in Python ints, the same in every process)."""
    x = (x + _GOLDEN) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class LogitBank:
    """``size`` rows of Gaussian logits over ``vocab_size`` ids (float32, as a model's output layer gives them),
    each with an argmax of its own, built from ``seed`` on first use in each process (a pickle carries the
    recipe, not the rows: a 152,064-id bank of 64 rows is 39 MB)."""

    def __init__(self, vocab_size: int, size: int = 64, seed: int = 0, sharpness: float = 2.5) -> None:
        self.vocab_size = check_int(vocab_size, "vocab_size", 2)
        self.size = check_int(size, "bank size", 2, vocab_size)
        self.seed = check_int(seed, "seed", 0)
        self.sharpness = sharpness
        self._rows: np.ndarray | None = None
        self._argmax: np.ndarray | None = None

    def _build(self) -> None:
        rng = np.random.default_rng([self.seed, 7])
        rows = (self.sharpness * rng.standard_normal((self.size, self.vocab_size), dtype=np.float32)).astype(np.float32)
        tops = rng.choice(self.vocab_size, size=self.size, replace=False)  # a distinct argmax per row
        for i, top in enumerate(tops):
            j = int(np.argmax(rows[i]))
            rows[i, [j, top]] = rows[i, [top, j]]
        rows.flags.writeable = False  # rows are handed out as views
        self._rows, self._argmax = rows, tops.astype(np.int64)

    @property
    def rows(self) -> np.ndarray:
        if self._rows is None:
            self._build()
        return self._rows  # [size, V] float32, read-only

    @property
    def argmax(self) -> np.ndarray:
        if self._argmax is None:
            self._build()
        return self._argmax  # [size] int64

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_rows": None, "_argmax": None}


class BankedLM:
    """A language model whose next-token logits after a context are a row of a :class:`LogitBank`, picked by a hash
    of the context and ``seed``; as a drafter (``agree_with`` a target of the same bank and ``acceptance``), it
    gives the target's row with probability ``acceptance`` (decided by a hash of the context) and another row,
    with another argmax, otherwise. A forward looks rows up, and greedy forwards return the rows' argmax from a
    table: the host work of a model whose forwards run on an accelerator (wrap it in :class:`WithLatency` for
    their time)."""

    def __init__(self, bank: LogitBank, seed: int, acceptance: float | None = None, agree_seed: int = 0,
                 name: str = "banked") -> None:
        self.bank = bank
        self.seed = seed
        self.acceptance = acceptance  # None: a target; else a drafter agreeing with the target of ``seed``
        self.agree_seed = agree_seed
        self.name = name
        self.vocabulary = None  # a dsi.constraints.TokenTable for structured output (None: no text to constrain)

    def token_table(self):
        """The vocabulary a constraint masks (:func:`dsi.constraints.token_table`), as given to :attr:`vocabulary`."""
        from dsi.errors import ConfigError

        if self.vocabulary is None:
            raise ConfigError(f"{self!r} has no vocabulary to constrain: set its .vocabulary (a TokenTable)")
        return self.vocabulary

    @property
    def vocab_size(self) -> int:
        return self.bank.vocab_size

    def forward_costs(self) -> ForwardCosts:
        """Nothing a draft tree should weigh: its time is its :class:`WithLatency`'s."""
        return ForwardCosts(one_token_s=0.0, per_row_s=0.0)

    def row_index(self, key: int) -> int:
        """The bank row after a context whose rolling key is ``key``."""
        size = self.bank.size
        row = _mix(self.seed ^ key) % size
        if self.acceptance is None:
            return row
        if (_mix(self.agree_seed ^ key) >> 11) * (1.0 / 9007199254740992.0) < self.acceptance:
            return row
        return (row + 1 + _mix(key ^ _GOLDEN) % (size - 1)) % size  # another row: another argmax

    def new_session(self) -> BankedSession:
        return BankedSession(self)

    def __repr__(self) -> str:
        role = "target" if self.acceptance is None else f"drafter(a={self.acceptance})"
        return f"BankedLM({role}, vocab_size={self.vocab_size}, bank={self.bank.size}, seed={self.seed})"


class BankedSession:
    """One token sequence of a :class:`BankedLM`: its tokens and a rolling key per prefix (the cache)."""

    def __init__(self, model: BankedLM) -> None:
        self._model = model
        self._tokens: list[int] = []
        self._keys: list[int] = [0]  # _keys[i]: the key of the first i tokens

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    def _rows_of(self, tokens, cancel) -> list[int]:
        tokens = check_token_ids(tokens, self._model.vocab_size, "tokens", self._model.name)
        if cancel is not None and cancel.is_set():
            from dsi.errors import TaskCancelled

            raise TaskCancelled("forward cancelled")
        keys = self._keys
        for token in tokens:
            keys.append(_mix(keys[-1] ^ (token + 1)))
        self._tokens.extend(tokens)
        return [self._model.row_index(key) for key in keys[-len(tokens):]]

    def extend(self, tokens, cancel=None) -> np.ndarray:
        return self._model.bank.rows[self._rows_of(tokens, cancel)]  # [n, V] float32

    def extend_rows(self, tokens, cancel, num_rows: int, greedy: bool) -> np.ndarray:
        picked = self._rows_of(tokens, cancel)[-num_rows:]
        if greedy:
            return self._model.bank.argmax[picked]  # [num_rows] int64
        if len(picked) == 1:
            return self._model.bank.rows[picked[0]:picked[0] + 1]  # [1, V]: a read-only view, no copy
        return self._model.bank.rows[picked]  # [num_rows, V]

    def truncate(self, length: int) -> None:
        length = check_int(length, "truncate length", 0, len(self._tokens))
        del self._tokens[length:]
        del self._keys[length + 1:]

    def close(self) -> None:
        self.truncate(0)


def banked_pair(
    acceptance: float,
    *,
    vocab_size: int = 152064,
    seed: int = 0,
    bank: int = 64,
    target_tpot: float | None = None,
    drafter_tpot: float | None = None,
):
    """``(target, drafter)`` of :class:`BankedLM` over ``vocab_size`` ids (default: Qwen2.5's padded vocabulary)
    with greedy acceptance ``acceptance``, each wrapped in :class:`WithLatency` when its ``*_tpot`` (seconds) is
    given: the engine's host path at accelerator forward times (``dsi bench --gpu-class``)."""
    if not isinstance(acceptance, int | float) or isinstance(acceptance, bool) or not 0.0 <= acceptance <= 1.0:
        raise ConfigError(f"acceptance={acceptance!r} must be a number in [0, 1]")
    seed = check_int(seed, "seed", 0)
    rows = LogitBank(vocab_size, bank, seed)
    target = BankedLM(rows, seed, name=f"banked-target(seed={seed})")
    drafter = BankedLM(rows, seed, float(acceptance), agree_seed=seed + 1, name=f"banked-drafter(a={acceptance})")
    if target_tpot is not None:
        target = WithLatency(target, target_tpot, target_tpot, seed=seed)
    if drafter_tpot is not None:
        drafter = WithLatency(drafter, drafter_tpot, drafter_tpot)
    return target, drafter
