"""The model interface the engines run on: a language model hands out sessions, and a session
is one token sequence with its KV cache.

A session is extended with new tokens and returns the next-token logits of every position it
just processed; it can be truncated back to a prefix (rolling back the cache). Each target
server and the drafter own one session each, so several sessions of one model may run at once
in different threads (sharing the model's read-only weights).

Cancellation is cooperative: ``extend`` receives a flag (anything with ``is_set()`` and
``wait(timeout)``, e.g. ``threading.Event``) and checks it between steps (tokens, layers, sleep
slices). On cancellation it raises :class:`dsi.errors.TaskCancelled` and leaves the session
exactly as it was before the call.

Every id, length and text a caller passes is checked in Python before a tokenizer, torch or llama.cpp
sees it (:func:`check_token_ids`, :func:`check_int`, :func:`check_text`): a bad one is a
:class:`dsi.errors.ConfigError` naming it and what is allowed, never a crash in native code.

A model may declare the most tokens one of its sessions can hold as ``max_context`` (an int, or
None for no limit; see :func:`context_limit`); a session asked to go beyond it raises
:class:`dsi.errors.ContextLengthError` before running anything.

Callers usually need only a few rows of a forward (the last one when drafting, the k+1 rows a
verification decides), in greedy decoding only their argmax, and with top-k sampling only each
row's k largest logits (``top``: a session that declares ``takes_top = True`` may return the other
logits as ``-inf``; the processed law is the same, see :mod:`dsi.models.engines.target`). :func:`extend_rows` asks for
exactly that. A session may implement it itself (``extend_rows``, see
:class:`RowSelectingSession`) to skip the output layer for other rows and to take the argmax where
the logits are (on a GPU only the token ids then travel to the host); for any other session it is
done here from ``extend``'s full rows, with the same result.

This module knows nothing about torch, sampling or the algorithm.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dsi.errors import ConfigError, DraftUnavailable, ModelError, shown


class CancelFlag(Protocol):
    """What a forward may check to notice it should stop (``threading.Event`` fits)."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


@runtime_checkable
class ModelSession(Protocol):
    """One token sequence and its cache."""

    @property
    def tokens(self) -> tuple[int, ...]:
        """The tokens processed so far (the cached prefix)."""
        ...

    def extend(self, tokens: Sequence[int], cancel: CancelFlag | None = None) -> np.ndarray:
        """Process ``tokens`` after the current sequence in one forward.

        Returns next-token logits, ``[len(tokens), vocab_size]``: row i is the distribution of the
        token following ``self.tokens + tokens[: i + 1]``. Raises ``TaskCancelled`` if ``cancel``
        is set during the forward, leaving the session unchanged.
        """
        ...

    def truncate(self, length: int) -> None:
        """Drop everything after the first ``length`` tokens (``0 <= length <= len(tokens)``)."""
        ...

    def close(self) -> None:
        """Release the session's resources (cache memory)."""
        ...


@runtime_checkable
class RowSelectingSession(Protocol):
    """Optional fast path of a session (see :func:`extend_rows`)."""

    def extend_rows(
        self, tokens: Sequence[int], cancel: CancelFlag | None, num_rows: int, greedy: bool
    ) -> np.ndarray:
        """``extend(tokens, cancel)[-num_rows:]``, or with ``greedy`` the argmax of each of those
        rows as int64 token ids ``[num_rows]`` (first index on ties)."""
        ...


@runtime_checkable
class LanguageModel(Protocol):
    """A causal language model that hands out independent sessions."""

    @property
    def vocab_size(self) -> int: ...

    def new_session(self) -> ModelSession: ...


# ---- argument checks: what a caller passes is checked here, before any tokenizer, torch or llama.cpp sees it
# (llama.cpp indexes its vocabulary with std::vector::at, so an id outside it aborts the whole process)


def check_int(value: object, name: str, low: int, high: int | None = None) -> int:
    """``value`` as a Python int in ``[low, high]`` (``high`` None: no upper bound); numpy integers are
    accepted, bool, float, str, None... are not. :class:`ConfigError` naming the value otherwise."""
    if isinstance(value, int | np.integer) and not isinstance(value, bool):
        value = int(value)
        if value >= low and (high is None or value <= high):
            return value
    allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise ConfigError(f"{name}={_short(value)} must be an integer {allowed}")


def check_text(text: object, name: str = "text") -> str:
    """``text`` if it is a ``str``; :class:`ConfigError` naming it otherwise (a tokenizer takes text, not ids)."""
    if not isinstance(text, str):
        raise ConfigError(f"{name}={_short(text)} ({type(text).__name__}) must be a str")
    return text


def check_token_ids(ids: object, vocab_size: int | None, name: str = "ids", of: str = "") -> list[int]:
    """``ids`` as a list of Python ints, each a token id in ``[0, vocab_size)`` (``vocab_size`` None: >= 0).

    ``ids`` may be any sequence of integers (a list, a tuple, a range, a 1-D integer numpy array;
    numpy integer elements too). :class:`ConfigError` names the first offending value, its index and
    the allowed range for: an id outside the vocabulary or negative; an element that is no integer
    (float, str, bool, None, a nested list); a str, bytes, mapping, set or scalar in place of the
    sequence; a numpy array of another dtype or shape. ``name`` names the argument, ``of`` the model."""
    where = f" of {of}" if of else ""
    allowed = f"a token id{where} is an integer " + (">= 0" if vocab_size is None else f"in [0, {vocab_size})")
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or (ids.dtype.kind not in "iu" and ids.dtype != object):
            raise ConfigError(f"{name} is a numpy array of dtype {ids.dtype} and shape {ids.shape}; "
                              f"it must be one-dimensional of integers ({allowed})")
        ids = ids.tolist()
    elif isinstance(ids, str | bytes | bytearray | Mapping | Set) or not isinstance(ids, Iterable):
        raise ConfigError(f"{name}={_short(ids)} ({type(ids).__name__}) must be a sequence of token ids, "
                          f"e.g. a list of ints ({allowed})")
    out = list(ids)
    for i, token in enumerate(out):
        if type(token) is not int:  # the common case costs one test
            if not isinstance(token, int | np.integer) or isinstance(token, bool | np.bool_):
                raise ConfigError(f"{name}[{i}]={_short(token)} ({type(token).__name__}) is not a token id; {allowed}")
            out[i] = int(token)
    if vocab_size is None:
        if out and min(out) < 0:
            i, token = next((i, t) for i, t in enumerate(out) if t < 0)
            raise ConfigError(f"{name}[{i}]={_short(token)} is negative; {allowed}")
    elif out and (min(out) < 0 or max(out) >= vocab_size):
        i, token = next((i, t) for i, t in enumerate(out) if not 0 <= t < vocab_size)
        raise ConfigError(f"{name}[{i}]={_short(token)} is outside the vocabulary [0, {vocab_size}){where}")
    return out


def _short(value: object, limit: int = 60) -> str:
    return shown(value, limit)


def encode_prompt(tokenizer: Any, name: str, text: str, *, chat: bool = False, system: str | None = None) -> list[int]:
    """Token ids of ``text`` by a Hugging Face-style ``tokenizer``; with ``chat``, of its chat template
    applied to one user message (after a ``system`` one if given). ``name`` names the model in errors."""
    check_text(text)
    if system is not None:
        check_text(system, "system")
    if not chat:
        return list(tokenizer.encode(text))
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{name}'s tokenizer has no chat template; drop --chat")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def session_counters(session: object) -> dict[str, int]:
    """A copy of the work counters a session keeps of its own (its ``counters`` dict, e.g. a drafter
    of another vocabulary counts its re-encodes), or ``{}``."""
    counters = getattr(session, "counters", None)
    return dict(counters) if isinstance(counters, dict) else {}


def counter_changes(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """``after - before`` per counter."""
    return {key: value - before.get(key, 0) for key, value in after.items()}


def context_limit(model: object) -> int | None:
    """The most tokens a session of ``model`` may hold: its ``max_context``, or None (no declared limit)."""
    limit = getattr(model, "max_context", None)
    if limit is None:
        return None
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ModelError(f"{model!r} declares max_context={limit!r}; it must be None or an integer >= 1")
    return limit


def guessable_positions(model: object, prompt_len: int, output_len: int) -> int:
    """How many positions of an output of ``output_len`` tokens after a prompt of ``prompt_len`` a model can
    guess within its declared context (its guess at position i needs ``prompt_len + i`` tokens held)."""
    limit = context_limit(model)
    return output_len if limit is None else max(min(output_len, limit - prompt_len + 1), 0)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def extend_rows(
    session: ModelSession,
    tokens: Sequence[int],
    cancel: CancelFlag | None = None,
    num_rows: int | None = None,
    greedy: bool = False,
    top: int | None = None,
    read: Callable[[np.ndarray], Any] | None = None,
) -> Any:
    """``session.extend(tokens, cancel)``, keeping only what the caller will read.

    Returns the last ``num_rows`` (default: all) logit rows ``[num_rows, vocab_size]``, or with
    ``greedy`` only their argmax token ids ``[num_rows]`` int64 (first index on ties, as
    ``np.argmax``). Uses the session's own ``extend_rows`` when it has one. ``top`` (None or k >= 1):
    the caller reads only each row's ``top`` largest logits (a session with ``takes_top`` may leave
    the others ``-inf``). ``read``: what the caller makes of those rows (a draw, a verification's decisions),
    returned instead of them; a session that declares ``reads_rows = True`` runs it as part of its forward (where
    a GPU runs the sampler: a latency model times it within the forward), any other after it.
    """
    n = len(tokens) if num_rows is None else num_rows
    if not isinstance(n, int | np.integer) or isinstance(n, bool) or not 1 <= n <= len(tokens):
        raise ConfigError(f"num_rows={n!r} must be an integer in [1, len(tokens)={len(tokens)}]")
    own = getattr(session, "extend_rows", None)
    if own is not None:
        options: dict[str, Any] = {}
        if top is not None and getattr(session, "takes_top", False):
            options["top"] = top
        if read is not None and getattr(session, "reads_rows", False):
            return own(tokens, cancel, n, greedy, read=read, **options)
        rows = own(tokens, cancel, n, greedy, **options)
        return rows if read is None else read(rows)
    rows = session.extend(tokens, cancel)[-n:]  # [n, V]
    if greedy:
        if np.isnan(rows).any():  # the argmax of a row with NaN is meaningless (sampling refuses it too)
            raise ModelError(f"{session!r} returned NaN logits; a logit must be a number or -inf")
        rows = np.argmax(rows, axis=-1).astype(np.int64)
    return rows if read is None else read(rows)


def forward_rows(
    session: ModelSession,
    context: Sequence[int],
    num_rows: int,
    cancel: CancelFlag | None = None,
    *,
    greedy: bool = False,
    top: int | None = None,
    read: Callable[[np.ndarray], Any] | None = None,
) -> Any:
    """Bring ``session`` to ``context`` reusing its cache; return the last ``num_rows`` logit rows.

    The cache is truncated to the longest common prefix with ``context`` (but never beyond
    ``len(context) - num_rows``, so the rows asked for are computed) and only the rest is run.
    Row i of the result is the next-token distribution after
    ``context[: len(context) - num_rows + i + 1]``.  # [num_rows, vocab_size]
    With ``greedy``, only the argmax token id of each of those rows.  # [num_rows] int64
    ``top``, ``read``: as in :func:`extend_rows`.
    """
    if not isinstance(num_rows, int | np.integer) or isinstance(num_rows, bool) or not 1 <= num_rows <= len(context):
        raise ConfigError(f"{num_rows=} must be an integer in [1, len(context)={len(context)}]")
    keep = min(common_prefix_length(session.tokens, context), len(context) - num_rows)
    if keep < len(session.tokens):
        session.truncate(keep)
    return extend_rows(session, context[keep:], cancel, num_rows, greedy, top, read)


def tree_rows(
    session: ModelSession,
    prefix: Sequence[int],
    tree: Any,
    cancel: CancelFlag | None = None,
    *,
    greedy: bool = False,
    top: int | None = None,
) -> np.ndarray:
    """The verification rows of a draft tree (:class:`dsi.trees.DraftTree`) after ``prefix``: row 0
    follows the prefix, row ``1 + i`` follows node i's path (``[1 + n, vocab_size]``; with ``greedy``
    the argmax ids ``[1 + n]``; ``top``: as in :func:`extend_rows`). The session is left holding
    ``prefix`` + the tree's main path, the most likely accepted one.

    Uses the session's own ``tree_rows`` when it has one (a latency model charges the tree as one
    forward); else :func:`path_tree_rows`."""
    if not prefix:
        raise ConfigError("a tree is verified after a prefix of at least one token")
    own = getattr(session, "tree_rows", None)
    if own is not None:
        return own(prefix, tree, cancel, greedy=greedy, top=top)
    return path_tree_rows(session, prefix, tree, cancel, greedy=greedy, top=top)


def path_tree_rows(
    session: ModelSession,
    prefix: Sequence[int],
    tree: Any,
    cancel: CancelFlag | None = None,
    *,
    greedy: bool = False,
    top: int | None = None,
) -> np.ndarray:
    """:func:`tree_rows` on any session: one extension per root-to-leaf path, each node computed once (a
    path reuses the cache of the path before it down to their last common node), the main path last."""
    prefix = list(prefix)
    main = tree.main_path()
    paths = sorted(tree.paths(), key=lambda path: path == main)  # the main path last
    rows: list[np.ndarray | None] = [None] * (len(tree) + 1)
    for path in paths or [[]]:
        context = prefix + [tree.tokens[i] for i in path]
        keep = min(common_prefix_length(session.tokens, context), len(context) - 1)
        if rows[0] is None:
            keep = min(keep, len(prefix) - 1)  # the prefix's last token once more: the root row
        if keep < len(session.tokens):
            session.truncate(keep)
        first = max(keep, len(prefix) - 1)  # the first row wanted: the root row, or the first new node's
        got = extend_rows(session, context[keep:], cancel, len(context) - first, greedy, top)
        for offset, row in zip(range(first, len(context)), got, strict=True):
            depth = offset - len(prefix) + 1  # 0: the root row
            rows[0 if depth == 0 else 1 + path[depth - 1]] = row
    return np.stack(rows) if not greedy else np.asarray(rows, dtype=np.int64)


def greedy_guess(session: ModelSession, context: Sequence[int]) -> int:
    """The greedy next token of ``session``'s model after ``context`` (:func:`forward_rows`, reusing
    its cache), or -1 where the model has nothing to propose (:class:`~dsi.errors.DraftUnavailable`:
    a drafter of another vocabulary): no draft there, so never one the target accepts."""
    try:
        return int(forward_rows(session, context, 1, greedy=True)[-1])
    except DraftUnavailable:
        return -1


def top_hint(sampling: Any) -> int | None:
    """The ``top`` a caller sampling with ``sampling`` reads of each row: its top_k, or None (all;
    also when penalties, bias or min_tokens may lift a token from outside the raw top_k)."""
    top_k = getattr(sampling, "top_k", 0)
    if getattr(sampling, "moves_argmax", False):
        return None
    return top_k if isinstance(top_k, int) and top_k >= 1 else None


def drafts_ids_only(model: object, sampling: Any) -> bool:
    """Whether the drafter ``model`` is asked for argmax ids (``greedy`` rows) rather than logit rows:
    for greedy decoding on raw rows, and for any greedy request to a drafter that proposes ids only
    (a drafter of another vocabulary in string mode; its raw proposals are verified like any draft)."""
    return bool(sampling.raw_argmax or (sampling.greedy and getattr(model, "proposes_only_ids", False)))


def check_sampling(model: object, sampling: Any, whole_rows: bool = False) -> None:
    """Raise :class:`~dsi.errors.ConfigError` if ``model`` cannot serve ``sampling`` exactly (its own
    ``check_sampling``: a drafter of another vocabulary in string mode, engines that return only the
    top of each row; with ``whole_rows``, a target that cannot give whole rows for logprobs); no check
    for other models."""
    check = getattr(model, "check_sampling", None)
    if check is not None:
        if whole_rows:
            check(sampling, whole_rows=True)
        else:
            check(sampling)


def check_logits(row: np.ndarray, vocab_size: int, what: str) -> np.ndarray:
    """Validate one logit row from user code: shape ``[vocab_size]`` and no NaN."""
    arr = np.asarray(row)
    if arr.shape != (vocab_size,):
        raise ModelError(f"{what} returned logits of shape {arr.shape}; expected ({vocab_size},)")
    if not np.issubdtype(arr.dtype, np.number):
        raise ModelError(f"{what} returned logits of dtype {arr.dtype}; expected a float array")
    top = arr.max() if arr.size else 0.0  # one pass: a NaN anywhere makes the maximum NaN
    if np.isnan(top):
        raise ModelError(f"{what} returned NaN logits")
    if np.isposinf(top):
        raise ModelError(f"{what} returned +inf logits")
    return arr
