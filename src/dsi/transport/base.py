"""The target-pool seam: what the DSI orchestrator asks of a pool of target servers.

A pool runs :class:`VerifyTask` s on ``num_servers`` target servers and reports back through
the ``on_event`` callback it was built with (from its own threads): a :class:`TaskResult`, a
:class:`TaskAborted` (a running task stopped by ``cancel``) or a :class:`TaskFailed` per task,
and a :class:`ServerDied` when a server is lost (its running task, if any, is re-queued on the
remaining servers; ``alive_servers`` counts the servers still serving or being restarted;
``idle_servers`` those with nothing to do, on which a task submitted now would start at once:
the event-driven DSI orchestrator sends a window exactly then). Each task runs on at most one server. ``cancel`` drops queued tasks silently and asks running ones to
stop between steps. Transports (threads, processes, Ray) implement this protocol; the engine
never knows which one it talks to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dsi.errors import ConfigError, DSIError, WorkerError
from dsi.logprobs import LogprobRows, ReadLogprobs
from dsi.models.base import common_prefix_length, top_hint
from dsi.sampling import LazyLaws, ReadLaws, SamplingParams
from dsi.trees import DraftTree


MAX_SERVERS = 256
"""The most target servers one pool runs (``num_target_servers``, ``--sp``). DSI keeps at most about
``target forward / (k x drafter step)`` servers busy at once (Equation 1 of the paper), under 100 for any
drafter worth using even at k = 1; each server is a thread, process or actor with its own session (KV cache)
and, off threads, its own copy of the model. 256 leaves room above any useful SP while a typo (``10**12``)
is refused before anything is allocated."""


def check_num_servers(value: object, name: str = "num_servers") -> int:
    """``value`` if it is a number of target servers in ``[1, MAX_SERVERS]``; :class:`ConfigError`
    naming ``name``, the value and the limit otherwise (checked before any per-server allocation)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}={value!r} must be an integer >= 1")
    if value > MAX_SERVERS:
        shown = value if value < 10**15 else f"{value:.3g}"
        raise ConfigError(f"{name}={shown} must be at most {MAX_SERVERS} (dsi.transport.MAX_SERVERS, the most target "
                          "servers a pool runs; DSI keeps at most about target forward / (k x drafter step) busy)")
    return value


def start_failed(what: str, total: int, exc: BaseException) -> BaseException:
    """The error of a pool of ``total`` servers that could not start ``what`` (``"server thread 3"``) and has
    stopped everything it had started: dsi's own errors as they are (they name the server), anything else (no
    thread, no process, no actor) as a :class:`~dsi.errors.WorkerError` naming it (raise it ``from exc``)."""
    if isinstance(exc, DSIError) or not isinstance(exc, Exception):
        return exc
    return WorkerError(f"the target pool of {total} servers could not start {what} ({type(exc).__name__}: {exc}); "
                       "it stopped every server it had started")


@dataclass(frozen=True)
class VerifyTask:
    """Score the last ``num_rows`` positions of ``context`` with the target.

    Row i of the answer is the target's next-token distribution after
    ``context[: len(context) - num_rows + i + 1]``.

    A *tree task* (``tree`` set, issue 24) scores a draft tree after ``context``: ``num_rows`` is
    ``1 + len(tree)``, row 0 follows ``context`` and row ``1 + i`` follows ``context`` + node i's path
    (:func:`dsi.models.base.tree_rows`); each row is processed with its own path as prefix.
    """

    task_id: int
    context: tuple[int, ...]
    num_rows: int
    sampling: SamplingParams
    prompt_len: int = 0  # how much of ``context`` is the request's prompt (penalties, min_tokens)
    stop_ids: frozenset[int] = frozenset()  # the ids that end the request (min_tokens holds them back)
    logprobs_mode: str | None = None  # also return log-probability rows in this mode (dsi.logprobs); None: no
    tree: DraftTree | None = None  # a tree task: the tree after ``context`` (None: a chain task)
    # a sampled chain task: the drafter's probability of each draft its rows compare (the last n - 1 tokens of
    # ``context``); the server then decides them itself and answers with what the decisions read
    # (dsi.sampling.ReadLaws: one law instead of n). None: the answer holds every row's law.
    draft_probs: tuple[float, ...] | None = None
    # with logprobs_mode: the most likely tokens each committed token's entry reports (a device then sends only
    # them and the tokens a decision can commit: dsi.logprobs.LogprobsRead); None: whole rows (prompt logprobs)
    logprobs_top: int | None = None
    # the request the task serves, where a server's rows depend on how its forwards were cut (not in the
    # deterministic mode, dsi.models.determinism): a server whose cache another request filled starts from an
    # empty one, as a fresh server would, so the answer does not depend on what was served before. None: any
    # cached prefix is reused
    request: int | None = None
    fresh: bool = False  # set by the dispatcher where ``request`` reuses none of the server's cache: empty it first

    def __post_init__(self) -> None:
        if self.tree is not None and self.num_rows != 1 + len(self.tree):
            raise ValueError(f"a tree task of {len(self.tree)} nodes has {1 + len(self.tree)} rows, not {self.num_rows}")
        if self.draft_probs is not None and (self.tree is not None or self.sampling.greedy
                                             or (self.logprobs_mode is not None and self.logprobs_top is None)
                                             or len(self.draft_probs) != self.num_rows - 1):
            raise ValueError(f"draft_probs go with a sampled chain task (whose logprobs, if any, are entries' top "
                             f"N), one per draft its {self.num_rows} rows compare ({self.num_rows - 1}); got "
                             f"{len(self.draft_probs)}")

    @property
    def held_context(self) -> tuple[int, ...]:
        """What a server's session holds after the task: its context (a tree task: and the tree's main
        path, which :func:`dsi.models.base.tree_rows` computes last)."""
        if self.tree is None:
            return self.context
        return self.context + tuple(self.tree.tokens[i] for i in self.tree.main_path())

    def tokens_to_compute(self, cached: Sequence[int]) -> int:
        """How many tokens a session holding ``cached`` runs for this task (the liveness watchdog's measure)."""
        fresh = len(self.context) - common_prefix_length(cached, self.context)
        return fresh + (len(self.tree) if self.tree is not None else 0)

    @property
    def ids_only(self) -> bool:
        """Whether the model may hand out argmax ids only: greedy on raw rows, and no logprobs asked."""
        return self.sampling.raw_argmax and self.logprobs_mode is None

    @property
    def row_top(self) -> int | None:
        """How many of each row's largest logits the model must return (None: all; logprobs need the
        whole row's normaliser): :func:`dsi.models.base.top_hint`."""
        return None if self.logprobs_mode is not None else top_hint(self.sampling)


@dataclass(frozen=True)
class TaskResult:
    task_id: int
    server_id: int
    tokens: np.ndarray  # [num_rows] int64, argmax of each processed row
    # [num_rows, V] processed distributions (processed as they are read: dsi.sampling.LazyLaws; a task with
    # draft_probs: only what its decisions read, dsi.sampling.ReadLaws); None when greedy
    probs: np.ndarray | LazyLaws | ReadLaws | None
    compute_s: float  # server time spent on the task
    # [num_rows, V] log-probabilities (dsi.logprobs), when the task asked; read on a device: each row's top and
    # the tokens its decision can commit (ReadLogprobs)
    logprobs: LogprobRows | ReadLogprobs | None = None


@dataclass(frozen=True)
class TaskAborted:
    task_id: int
    server_id: int
    compute_s: float  # server time spent before the cancel took effect


@dataclass(frozen=True)
class TaskFailed:
    task_id: int
    server_id: int
    error: str  # "ExceptionType: message"
    exception: BaseException | None = None


@dataclass(frozen=True)
class ServerDied:
    """Target server ``server_id`` is gone (process killed, actor crashed, thread died).

    The task it was running, if any, has been re-queued on the other servers. ``restarting``:
    the pool is starting a replacement that will take the same server id.
    """

    server_id: int
    error: str
    restarting: bool = False


PoolEvent = TaskResult | TaskAborted | TaskFailed | ServerDied
EventSink = Callable[[object], None]


class TargetPool(Protocol):
    """``num_servers`` target servers working through submitted tasks."""

    @property
    def num_servers(self) -> int: ...

    def submit(self, task: VerifyTask) -> None: ...

    def cancel(self, task_ids: Iterable[int]) -> None: ...

    def alive_servers(self) -> int: ...

    def idle_servers(self) -> int: ...

    def close(self) -> None: ...
