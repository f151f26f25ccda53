"""Event simulator of the real algorithms (docs/architecture.md, "The DSI orchestrator"): DSI, SI and non-SI in seconds.

It follows the engine (:mod:`dsi.engine`) step by step, with every overhead of a real
implementation (threads, queues, Python) set to zero, so its latency is the *ideal* that the
engine's wall clock is compared with. Times may be in any one unit (seconds, ms, target = 1).

Model of time
-------------
- **Forwards.** A model session's first forward costs its TTFT (prefill of the prompt), every
  later one its TPOT, whatever the number of new tokens (the memory-bound regime). The
  drafter has one session; each target server has its own (per-server KV state: a server pays
  TTFT on its first completed task). A forward stopped by preemption leaves the session as
  it was (a cold server stays cold).
- **Acceptance.** ``matches[p]`` says whether the drafter's token at output position ``p``
  equals the target's (greedy replay of a real run), or ``matches`` is drawn i.i.d. with
  probability ``acceptance`` per position. After a restart at position ``i`` the drafter
  drafts ``i, i+1, ...``; the draft at ``j`` is accepted iff ``matches[j]`` (a later position of
  the same epoch is only reached if every earlier draft was accepted, so its context is then
  the committed one).
- **DSI.** At every (re)start the zero-draft task (context = committed) is submitted and the
  drafter starts drafting; it drafts ``tokens - i`` positions, one TPOT each, and never waits.
  Windows ``w = 1, 2, ...`` of an epoch each have an end ``last_w`` (context = committed +
  ``last_w`` drafts) and decide the relative positions ``(last_{w-1}, last_w]`` (``last_0 = 0``;
  the zero-draft task decides relative position 0; a window's last row decides the first draft
  after its context). When windows are sent is the *policy*:

  - fixed lookahead ``k``: after every ``k`` drafts window ``m`` is sent with ``last_m = m k``;
    when drafting is done the final partial window is submitted (a window that would decide
    only positions past the end is not sent);
  - event-driven (``lookahead="auto"``, the policy is :mod:`dsi.windows`,
    the engine's own): a window is sent when a target server is idle and undispatched drafts
    exist; it carries all of them, ``last_w = min(drafts, last_{w-1} + max_window, horizon)``
    where the horizon ``tokens - 1 - i`` is the last relative position still to decide, but not
    before it holds ``min_window`` drafts (Equation 1's k from running estimates of the target
    forward and the drafter step, lowered to the expected distance to the next rejection), unless
    no more drafts can join it (nothing is sent when that would not move ``last``). The checks run
    when a draft arrives (before the decisions it allows, as the engine handles a draft), when a
    server becomes free (a finished task's decisions first, so no window is sent into an epoch
    that result ends; or the preemption delay ran out) and after a restart; while every server
    is busy drafts pile up for the next window.
    Only the zero-draft task (submitted at every restart whatever the servers) and preemption
    delays ever make a task queue.

  Positions are decided strictly in order, each as soon as its deciding task has finished and
  its draft exists. Acceptance commits the draft; rejection commits the target's token, preempts
  every other task of the epoch (queued ones are dropped, running ones free their server after
  ``preempt_delay``, finished unused ones are discarded), interrupts the drafter and restarts.
- **Servers.** ``num_servers`` target servers (``None``: as many as ever needed). A task goes to
  an idle server, a warm one first (it has the prompt cached); otherwise it waits in a queue
  served ``"fifo"`` (oldest first) or ``"newest"`` (newest first).
- **SI.** Drafter and one target alternate: ``kk = min(k, tokens - 1 - i)`` drafter forwards,
  then one target forward deciding positions ``i .. i + kk`` (the correction, or the bonus
  token when all ``kk`` drafts are accepted).
- **non-SI** (``"ar"``): ``TTFT + (tokens - 1) TPOT`` of the target.
- **Latency noise.** With ``latency_cv > 0`` every target forward (TTFT or TPOT, in all three
  methods) is multiplied by an independent lognormal factor of mean 1 and coefficient of
  variation ``latency_cv``, drawn per repeat from a generator derived from ``seed``.

With TTFT = TPOT, ``c <= T``, enough servers and no delays, E[DSI latency] is given exactly by
:func:`dsi.sim.analytic.event_dsi_expected_time`; docs/simulator.md explains how and why it
differs from the offline simulator of section 5.

Statistics of a run: latency; target busy time and utilisation (busy time over servers x
latency; servers = ``num_servers``, or the number ever used when unlimited); wasted target time
(server time on tasks whose results were not used: preempted runs up to their stop plus the
preemption delay, and finished results discarded at a restart); fully accepted windows
(windows, or SI iterations, whose drafts were all accepted; for fixed ``k``: ``k`` drafts);
rejections; tasks submitted and preempted; total queueing wait; mean window (drafts per
verification window or SI iteration, zero-draft tasks excluded).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from dsi.errors import ConfigError
from dsi.windows import WindowPacer, window_end

METHODS = ("dsi", "si", "ar")
QUEUES = ("fifo", "newest")
SI_TREES = ("2", "auto")  # SI's tree shapes with rescues: within k nodes, or the chain's k drafts and side children
AUTO = "auto"  # the event-driven policy's lookahead

# event priorities at equal times: results first (servers free up before new submissions)
_TASK_DONE, _SERVER_FREE, _DRAFT = 0, 1, 2


@dataclass(frozen=True)
class RunStats:
    """One simulated generation."""

    latency: float
    target_busy: float
    utilisation: float
    wasted_target_time: float
    fully_accepted_windows: int
    accepted: int
    rejections: int
    tasks: int
    preempted_tasks: int
    queue_wait: float
    servers_used: int
    mean_window: float = 0.0  # drafts per verification window (zero-draft tasks excluded)
    side_wins: int = 0  # draft trees (DSI): rejections a side child rescued


@dataclass(frozen=True)
class EventSimResult:
    """Per-repeat runs of one configuration, and their means."""

    method: str
    tokens: int
    lookahead: int | str  # an integer k, or "auto" (the event-driven policy)
    num_servers: int | None
    runs: tuple[RunStats, ...]

    @property
    def per_repeat(self) -> tuple[float, ...]:
        return tuple(r.latency for r in self.runs)

    @property
    def mean(self) -> float:
        return float(np.mean(self.per_repeat))

    @property
    def std(self) -> float:
        return float(np.std(self.per_repeat, ddof=1)) if len(self.runs) > 1 else 0.0

    @property
    def latency_per_token(self) -> float:
        return self.mean / self.tokens

    def _avg(self, name: str) -> float:
        return float(np.mean([getattr(r, name) for r in self.runs]))

    @property
    def utilisation(self) -> float:
        return self._avg("utilisation")

    @property
    def wasted_target_time(self) -> float:
        return self._avg("wasted_target_time")

    @property
    def fully_accepted_windows(self) -> float:
        return self._avg("fully_accepted_windows")

    @property
    def rejections(self) -> float:
        return self._avg("rejections")

    @property
    def queue_wait(self) -> float:
        return self._avg("queue_wait")

    @property
    def mean_window(self) -> float:
        return self._avg("mean_window")

    def to_dict(self, runs: bool = False) -> dict:
        data = {
            "method": self.method,
            "tokens": self.tokens,
            "lookahead": self.lookahead,
            "num_servers": self.num_servers,
            "mean": self.mean,
            "std": self.std,
            "latency_per_token": self.latency_per_token,
            "per_repeat": list(self.per_repeat),
            "utilisation": self.utilisation,
            "wasted_target_time": self.wasted_target_time,
            "fully_accepted_windows": self.fully_accepted_windows,
            "rejections": self.rejections,
            "queue_wait": self.queue_wait,
            "mean_window": self.mean_window,
        }
        if runs:
            data["runs"] = [asdict(r) for r in self.runs]
        return data


# ---- validation ---------------------------------------------------------------------------------
def _latency(name: str, value: object, what: str = "a latency") -> float:
    if not isinstance(value, int | float | np.integer | np.floating) or isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be a number >= 0")
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"{name}={value!r} must be a finite number >= 0 ({what})")
    return float(value)


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}")
    return int(value)


def _as_patterns(matches) -> list[np.ndarray]:
    try:
        arr = np.asarray(matches)
        patterns = list(arr) if arr.ndim == 2 else [arr]
    except ValueError:  # ragged: patterns of different lengths
        patterns = [np.asarray(m) for m in matches]
    for pattern in patterns:
        if pattern.ndim != 1 or (pattern.size and pattern.dtype != bool):
            raise ConfigError(
                "matches must be a sequence of booleans (True: the drafter's token at that output "
                "position is the target's), or a sequence of such sequences"
            )
    return patterns


def _patterns(
    tokens: int | None, acceptance: float | None, matches, repeats: int, seed: int
) -> tuple[int, list[np.ndarray]]:
    if matches is not None:
        if acceptance is not None:
            raise ConfigError("give either acceptance or matches, not both")
        patterns = _as_patterns(matches)
        n = min(len(m) for m in patterns) if tokens is None else _positive_int("tokens", tokens)
        if n < 1:
            raise ConfigError("matches is empty; it needs one entry per output position")
        for m in patterns:
            if len(m) < n:
                raise ConfigError(f"matches has {len(m)} entries; tokens={n} needs one per output position")
        return n, [m[:n] for m in patterns]
    if acceptance is None:
        raise ConfigError("give acceptance (a rate in [0, 1]) or matches (a per-position pattern)")
    if tokens is None:
        raise ConfigError("tokens is required with acceptance")
    n = _positive_int("tokens", tokens)
    if (
        not isinstance(acceptance, int | float | np.floating)
        or isinstance(acceptance, bool)
        or not 0 <= acceptance <= 1
    ):
        raise ConfigError(f"acceptance={acceptance!r} must be in [0, 1]")
    return n, list(random_matches(acceptance, n, repeats=repeats, seed=seed))


def random_matches(acceptance: float, tokens: int, *, repeats: int = 1, seed: int = 0) -> np.ndarray:
    """I.i.d. per-position match patterns, ``[repeats, tokens]`` booleans (what ``acceptance=`` uses)."""
    return np.random.default_rng(seed).random((repeats, tokens)) < acceptance


# ---- latency noise ------------------------------------------------------------------------------
class _Noise:
    """Independent lognormal factors of mean 1 and coefficient of variation ``cv``, drawn in blocks.

    ``sigma^2 = ln(1 + cv^2)``, ``mu = -sigma^2 / 2``, so ``E[factor] = 1`` and
    ``std[factor] = cv``.
    """

    __slots__ = ("rng", "mu", "sigma", "buf", "pos")

    BLOCK = 256

    def __init__(self, cv: float, rng: np.random.Generator) -> None:
        var = math.log1p(cv * cv)
        self.sigma = math.sqrt(var)
        self.mu = -var / 2
        self.rng = rng
        self.buf: list[float] = []
        self.pos = 0

    def __call__(self) -> float:
        if self.pos >= len(self.buf):
            self.buf = self.rng.lognormal(self.mu, self.sigma, self.BLOCK).tolist()
            self.pos = 0
        factor = self.buf[self.pos]
        self.pos += 1
        return factor


# ---- DSI ----------------------------------------------------------------------------------------
class _Task:
    __slots__ = ("epoch", "index", "submitted", "start", "server", "duration", "state", "used")

    def __init__(self, epoch: int, index: int, submitted: float) -> None:
        self.epoch = epoch
        self.index = index
        self.submitted = submitted
        self.start = -1.0
        self.server = -1
        self.duration = 0.0
        self.state = "queued"  # queued | running | done | cancelled
        self.used = False  # one of its rows decided a position


class _Server:
    __slots__ = ("task", "warm")

    def __init__(self) -> None:
        self.task: _Task | None = None
        self.warm = False


class _DSIRun:
    def __init__(
        self,
        matches: np.ndarray,
        k: int | None,
        num_servers: int | None,
        target_ttft: float,
        target_tpot: float,
        drafter_ttft: float,
        drafter_tpot: float,
        queue: str,
        preempt_delay: float,
        max_window: int | None = None,
        noise: _Noise | None = None,
        rescues: np.ndarray | None = None,
        branches: bool = False,
    ) -> None:
        self.matches = matches
        self.rescues = rescues  # draft trees: a rejection at p whose correction is one of p's side children
        self.branches = branches  # "branches": a side child goes with the drafter's likeliest token after it
        self.n = len(matches)
        self.k = k  # None: the event-driven policy
        self.max_window = max_window
        self.noise = noise
        self.unlimited = num_servers is None
        self.servers = [] if num_servers is None else [_Server() for _ in range(num_servers)]
        self.t_ttft, self.t_tpot = target_ttft, target_tpot
        self.d_ttft, self.d_tpot = drafter_ttft, drafter_tpot
        self.newest_first = queue == "newest"
        self.delay = preempt_delay
        self.heap: list = []
        self.seq = itertools.count()
        self.queue: deque[_Task] = deque()
        # request state
        self.committed = 0
        self.epoch = 0
        self.base = 0
        self.drafts = 0
        self.drafter_done = False
        self.drafter_warm = False
        self.windows: dict[int, _Task] = {}
        self.lasts: list[int] = [0]  # window w's end (drafts in its context); window 0: the zero-draft task
        self.epoch_accepted = 0  # drafts accepted in this epoch
        self.bonus_first = False  # draft trees: this epoch's first position is a side child's bonus token
        self.finished_at: float | None = None
        # statistics
        self.busy = 0.0
        self.wasted = 0.0
        self.full_windows = 0
        self.accepted = 0
        self.rejections = 0
        self.tasks = 0
        self.preempted = 0
        self.queue_wait = 0.0
        self.window_count = 0  # verification windows sent (zero-draft tasks excluded)
        self.window_drafts = 0  # positions they verify, summed
        self.side_wins = 0  # draft trees: rejections a side child rescued
        self.pacer = WindowPacer()  # the event-driven policy's estimates, fed as the engine feeds its own

    def push(self, time: float, priority: int, payload) -> None:
        heapq.heappush(self.heap, (round(time, 9), priority, next(self.seq), time, payload))

    def run(self) -> RunStats:
        self.restart(0.0)
        while self.finished_at is None:
            _, priority, _, now, payload = heapq.heappop(self.heap)
            if priority == _TASK_DONE:
                self.on_task_done(now, payload)
            elif priority == _SERVER_FREE:
                self.on_server_free(now, payload)
            else:
                self.on_draft(now, payload)
        latency = self.finished_at
        self.count_full_windows()
        for server in self.servers:  # stopped at the end of the request
            task = server.task
            if task is not None and task.state == "running":
                self.busy += latency - task.start
                self.wasted += latency - task.start
        capacity = len(self.servers) * latency
        return RunStats(
            latency=latency,
            target_busy=self.busy,
            utilisation=self.busy / capacity if capacity > 0 else 0.0,
            wasted_target_time=self.wasted,
            fully_accepted_windows=self.full_windows,
            accepted=self.accepted,
            rejections=self.rejections,
            tasks=self.tasks,
            preempted_tasks=self.preempted,
            queue_wait=self.queue_wait,
            servers_used=len(self.servers),
            mean_window=self.window_drafts / self.window_count if self.window_count else 0.0,
            side_wins=self.side_wins,
        )

    # -- epochs --
    def count_full_windows(self) -> None:
        """Event-driven policy, at the end of an epoch: its windows whose drafts were all accepted."""
        if self.k is None:
            self.full_windows += bisect.bisect_right(self.lasts, self.epoch_accepted) - 1

    def restart(self, now: float, after_side: bool = False, adopt: _Task | None = None, seeded: bool = False,
                continued: bool = False) -> None:
        """A new epoch at ``committed``; ``after_side``: its first position is the target's own token after a side
        child that won, computed by ``adopt`` (a window of the old epoch still running or queued) if given.
        ``"branches"``: ``seeded``, the drafter's likeliest token after the side child is this epoch's first draft, and
        ``adopt`` may have answered already; ``continued``: ``adopt`` computed the row after that draft too,
        and decides position 1 as well (window 1)."""
        self.count_full_windows()
        for task in self.windows.values():
            if task is adopt:
                continue
            if task.state == "queued":
                task.state = "cancelled"
                self.preempted += 1
            elif task.state == "running":
                task.state = "cancelled"
                self.preempted += 1
                spent = now - task.start + self.delay
                self.busy += spent
                self.wasted += spent
                if self.delay > 0:
                    self.push(now + self.delay, _SERVER_FREE, task.server)
                else:
                    self.servers[task.server].task = None
            elif task.state == "done" and not task.used:
                self.wasted += task.duration
        if self.queue:
            self.queue = deque(t for t in self.queue if t.state == "queued")
        self.epoch += 1
        self.base = self.committed
        self.windows = {}
        self.lasts = [0]
        self.epoch_accepted = 0
        self.drafts = 1 if seeded else 0
        self.drafter_done = seeded and self.base + 1 >= self.n
        self.bonus_first = after_side
        if adopt is None:
            self.submit(0, now)  # whatever the servers: it may queue
        else:
            adopt.epoch = self.epoch
            self.windows[0] = adopt
            if continued and self.base + 1 < self.n:
                self.windows[1] = adopt
                self.lasts.append(1)
        # the drafter abandons its forward (if any) and drafts the rest of the request
        if not self.drafter_done:
            self.push(now + (self.d_tpot if self.drafter_warm else self.d_ttft), _DRAFT, self.epoch)
        self.submit_when_idle(now)  # no drafts yet: a no-op, kept for the policy's sake

    # -- drafts and windows --
    def on_draft(self, now: float, epoch: int) -> None:
        if epoch != self.epoch:
            return
        self.drafter_warm = True
        self.drafts += 1
        if self.drafts > 1:  # the engine times the gap between consecutive drafts of an epoch
            self.pacer.add_drafter(self.d_tpot)
        if self.base + self.drafts >= self.n:
            self.drafter_done = True
        else:
            self.push(now + self.d_tpot, _DRAFT, self.epoch)
        # decide first (as the engine does): this draft may complete a rejection, and then no
        # window is sent into the epoch it ends. A new draft can only unblock the decision that
        # waits for it.
        if self.committed - self.base == self.drafts - 1:
            self.apply(now)
            if self.epoch != epoch or self.finished_at is not None:
                return
        k = self.k
        if k is None:
            self.submit_when_idle(now)
        elif self.drafter_done or self.drafts >= self.lasts[-1] + k:  # else: no window is due
            while True:
                index = len(self.windows)
                first, last = self.lasts[-1] + 1, self.lasts[-1] + k
                if self.drafts >= last:
                    if first > self.n - 1 - self.base:
                        break  # it would decide only positions past the end (k = 1): not sent
                    self.submit(index, now, last)
                    continue
                if self.drafter_done and self.drafts - 1 >= first:
                    self.submit(index, now, last)  # the final, partial window
                break

    def submit_when_idle(self, now: float) -> None:
        """Event-driven policy (:func:`dsi.windows.window_end`): while a server is idle and enough
        drafts exist past the last window, send a window with all of them."""
        if self.k is not None or self.finished_at is not None:
            return
        horizon = self.n - 1 - self.base  # the last relative position still to decide
        servers = 1 << 30 if self.unlimited else len(self.servers)
        while True:
            idle = self.unlimited or any(server.task is None for server in self.servers)
            last = window_end(
                self.lasts[-1] + 1, self.drafts, horizon, idle_servers=int(idle),
                min_window=self.pacer.min_window(servers), max_window=self.max_window,
                drafter_done=self.drafter_done,
                in_flight=sum(task.state in ("queued", "running") for task in self.windows.values()),
            )
            if last is None:
                return  # every server busy (drafts pile up), or too few drafts yet
            self.submit(len(self.lasts), now, last, self.idle_server())

    def submit(self, index: int, now: float, last: int = 0, server: int | None = None) -> None:
        """Send window ``index`` (context = base + ``last`` drafts; 0: the zero-draft task)."""
        task = _Task(self.epoch, index, now)
        self.windows[index] = task
        self.tasks += 1
        if index:
            self.window_count += 1
            self.window_drafts += min(last, self.n - 1 - self.base) - self.lasts[-1]
            self.lasts.append(last)
        if server is None:
            server = self.idle_server()
        if server is None:
            self.queue.append(task)
        else:
            self.start(task, server, now)

    def idle_server(self) -> int | None:
        cold = None
        for i, server in enumerate(self.servers):
            if server.task is None:
                if server.warm:
                    return i
                if cold is None:
                    cold = i
        if cold is None and self.unlimited:
            self.servers.append(_Server())
            cold = len(self.servers) - 1
        return cold

    def start(self, task: _Task, server_id: int, now: float) -> None:
        server = self.servers[server_id]
        server.task = task
        task.state = "running"
        task.start = now
        task.server = server_id
        task.duration = self.t_tpot if server.warm else self.t_ttft
        if self.noise is not None:
            task.duration *= self.noise()
        self.queue_wait += now - task.submitted
        self.push(now + task.duration, _TASK_DONE, task)

    def on_server_free(self, now: float, server_id: int) -> None:
        self.servers[server_id].task = None
        self.dispatch(server_id, now)
        self.submit_when_idle(now)

    def dispatch(self, server_id: int, now: float) -> None:
        while self.queue:
            task = self.queue.pop() if self.newest_first else self.queue.popleft()
            if task.state == "queued":
                self.start(task, server_id, now)
                return

    def on_task_done(self, now: float, task: _Task) -> None:
        if task.state != "running":
            return  # preempted: its server was released at the preemption
        task.state = "done"
        server = self.servers[task.server]
        server.warm = True
        server.task = None
        self.busy += task.duration
        self.pacer.add_target(task.duration)
        self.dispatch(task.server, now)
        if task.epoch == self.epoch:
            self.apply(now)
        self.submit_when_idle(now)  # decisions first: a window is only sent to a live epoch

    # -- decisions --
    def apply(self, now: float) -> None:
        k = self.k
        lasts = self.lasts
        while self.finished_at is None:
            r = self.committed - self.base
            # the deciding window: the first whose end is >= r (window w decides (last_{w-1}, last_w])
            index = bisect.bisect_left(lasts, r)
            task = self.windows.get(index)
            if task is None or task.state != "done":
                return
            if r >= self.drafts:
                return  # its draft is still being computed (the drafter drafts every position)
            task.used = True
            position = self.committed
            self.committed += 1
            if r == 0 and self.bonus_first:  # after a side child that won: the target's own token, no test
                if self.committed >= self.n:
                    self.finished_at = now
                    return
                if self.matches[position]:  # the epoch's first draft is that token: its drafts hold
                    self.epoch_accepted += 1
                    continue
                self.restart(now)
                continue
            self.pacer.add_decision(bool(self.matches[position]))
            if self.matches[position]:
                self.accepted += 1
                self.epoch_accepted += 1
                if k is not None and r % k == k - 1:
                    self.full_windows += 1  # drafts (m-1)k .. mk-1 of window m all accepted
                if self.committed >= self.n:
                    self.finished_at = now
                continue
            if self.rescues is not None and self.rescues[position]:
                # a side child won: the next position is the target's own token after it (engine.dsi), in
                # the deciding result, or in the next window (which carries the sides of this window's last
                # position); one not answered yet becomes the next epoch's window 0, one not sent yet a
                # zero-draft task
                self.side_wins += 1
                self.accepted += 1
                if self.committed >= self.n:
                    self.finished_at = now
                    return
                holder = task if r < lasts[index] else self.windows.get(index + 1)
                if self.branches and self.drafts >= r + 2:
                    # "branches": the drafter's likeliest token after the side child (drafted with position r + 1) starts
                    # the new epoch, its drafts going on if the target's token there is that draft; the holder
                    # carried it, and computed the row after it, if it was in its context (window w's drafts:
                    # positions up to lasts[w] - 1)
                    held_by = index if r < lasts[index] else index + 1
                    continued = holder is not None and r + 1 <= lasts[held_by] - 1
                    self.restart(now, after_side=True, adopt=holder, seeded=True, continued=continued)
                    continue
                if holder is None or holder.state != "done":
                    self.restart(now, after_side=True, adopt=holder)
                    continue
                holder.used = True
                self.committed += 1
            else:
                self.rejections += 1
            if self.committed >= self.n:
                self.finished_at = now
                return
            self.restart(now)


# ---- SI and non-SI ------------------------------------------------------------------------------
def _si_run(
    matches: np.ndarray,
    k: int,
    target_ttft: float,
    target_tpot: float,
    drafter_ttft: float,
    drafter_tpot: float,
    noise: _Noise | None = None,
    rescues: np.ndarray | None = None,
    si_tree: str = "2",
) -> RunStats:
    """SI; with ``rescues``, each iteration's ``kk`` drafts are a tree: ``si_tree`` ``"2"`` (two children at
    every depth within ``kk`` nodes, :class:`dsi.trees.Widths`): ``ceil(kk / 2)`` main drafts (one drafter
    forward each), a side child beside each of the first ``kk // 2``; ``"auto"``
    (:class:`dsi.trees.Dynamic`): the chain's ``kk`` drafts, each position with its side children. A first
    rejection at a position with a side child that rescues it commits the side child and the target's
    token after it (the walk ends on that leaf)."""
    n = len(matches)
    side_wins = 0
    now = 0.0
    busy = 0.0
    i = 0
    drafter_warm = target_warm = False
    full = accepted = rejections = iterations = 0
    windows = window_drafts = 0
    while i < n:
        kk = min(k, n - 1 - i)
        sides = 0  # depths 0 .. sides - 1 may have side children
        if rescues is not None and si_tree == "auto":
            sides = kk
        elif rescues is not None:
            sides, kk = kk // 2, (kk + 1) // 2  # the main path of the tree "2"
        for _ in range(kk):
            now += drafter_tpot if drafter_warm else drafter_ttft
            drafter_warm = True
        if kk:
            windows += 1
            window_drafts += kk
        step = target_tpot if target_warm else target_ttft
        if noise is not None:
            step *= noise()
        target_warm = True
        now += step
        busy += step
        iterations += 1
        window = matches[i : i + kk]
        misses = np.flatnonzero(~window)
        if misses.size:
            j = int(misses[0])
            accepted += j
            if j < sides and rescues[i + j]:
                side_wins += 1
                accepted += 1
                i += j + 2
            else:
                rejections += 1
                i += j + 1
        else:
            accepted += kk
            full += kk == k
            i += kk + 1
    return RunStats(
        latency=now,
        target_busy=busy,
        utilisation=busy / now if now > 0 else 0.0,
        wasted_target_time=0.0,
        fully_accepted_windows=full,
        accepted=accepted,
        rejections=rejections,
        tasks=iterations,
        preempted_tasks=0,
        queue_wait=0.0,
        servers_used=1,
        mean_window=window_drafts / windows if windows else 0.0,
        side_wins=side_wins,
    )


def _ar_run(tokens: int, target_ttft: float, target_tpot: float, noise: _Noise | None = None) -> RunStats:
    if noise is None:
        latency = target_ttft + (tokens - 1) * target_tpot
    else:  # one forward per token, each with its own factor
        latency = target_ttft * noise()
        for _ in range(tokens - 1):
            latency += target_tpot * noise()
    return RunStats(
        latency=latency, target_busy=latency, utilisation=1.0 if latency > 0 else 0.0,
        wasted_target_time=0.0, fully_accepted_windows=0, accepted=0, rejections=0,
        tasks=tokens, preempted_tasks=0, queue_wait=0.0, servers_used=1,
    )  # fmt: skip


# ---- the entry point ----------------------------------------------------------------------------
def simulate(
    method: str = "dsi",
    *,
    target_tpot: float,
    target_ttft: float | None = None,
    drafter_tpot: float | None = None,
    drafter_ttft: float | None = None,
    lookahead: int | str = 5,
    num_servers: int | None = 7,
    tokens: int | None = None,
    acceptance: float | None = None,
    matches: Sequence[bool] | Sequence[Sequence[bool]] | np.ndarray | None = None,
    repeats: int = 1,
    seed: int = 0,
    queue: str = "fifo",
    preempt_delay: float = 0.0,
    max_window: int | None = None,
    latency_cv: float = 0.0,
    rescues: Sequence[bool] | Sequence[Sequence[bool]] | np.ndarray | None = None,
    si_tree: str = "2",
    dsi_branches: bool = False,
) -> EventSimResult:
    """Simulate ``method`` ("dsi", "si" or "ar") in the model of time of this module.

    Acceptance is either ``acceptance`` (i.i.d. per position; ``repeats`` patterns drawn from
    ``seed``, the same patterns for every method and configuration with that seed) or
    ``matches``: one per-position pattern, or a sequence of patterns (one run each), where
    ``matches[p]`` is True iff the drafter's token at output position ``p`` is the target's.
    ``tokens`` defaults to the pattern's length. TTFTs default to the TPOTs.

    ``lookahead`` is DSI's and SI's ``k``, or ``"auto"`` for DSI's event-driven policy (a window
    whenever a server is idle, carrying every undispatched draft, at most ``max_window``; SI
    needs a ``k``, non-SI ignores it). ``latency_cv > 0`` multiplies every target forward by an
    independent lognormal factor of mean 1 and that coefficient of variation (per repeat, a
    generator spawned from ``np.random.default_rng(seed)``).

    ``rescues`` (draft trees): patterns like ``matches`` (one per run),
    ``rescues[p]`` True iff a rejection at ``p`` has a correction that is one of ``p``'s side children.
    Such a rejection commits the correction, and the next position is the target's own token after it,
    from the row after that side child: in the deciding window's result (a position before its last), or
    in the next window's (which carries the side children of the previous window's last position and of
    the zero-draft task's); a next window still running becomes the new epoch's window 0, one not sent yet
    is replaced by a zero-draft task. That token is never rescued; the epoch it starts goes on if its first
    draft is that token (``matches``). No window waits for a draft it does not decide. SI spends its
    ``k`` drafts as the tree ``si_tree`` (``"2"`` or ``"auto"``, see :func:`_si_run`). Side children cost
    nothing on the target (a forward costs its TPOT whatever its tokens). ``dsi_branches``: DSI's
    ``"branches"`` tree (:mod:`dsi.engine.dsi`): the same decisions, and where the drafter drafted the
    position after the rescued one, its likeliest token after the side child starts the new epoch (its drafts go on
    if that draft is the target's token there, ``matches``), and the holding window, if that draft was in
    its context, also decides the position after it.
    """
    if method not in METHODS:
        raise ConfigError(f"method={method!r} must be one of {', '.join(METHODS)}")
    if si_tree not in SI_TREES:
        raise ConfigError(f"si_tree={si_tree!r} must be one of {', '.join(SI_TREES)} (SI's tree shapes the simulator "
                          "times)")
    if queue not in QUEUES:
        raise ConfigError(f"queue={queue!r} must be one of {', '.join(QUEUES)}")
    t_tpot = _latency("target_tpot", target_tpot)
    t_ttft = t_tpot if target_ttft is None else _latency("target_ttft", target_ttft)
    if method != "ar" and drafter_tpot is None:
        raise ConfigError(f"method={method!r} needs drafter_tpot (the drafter's time per token)")
    d_tpot = 0.0 if drafter_tpot is None else _latency("drafter_tpot", drafter_tpot)
    d_ttft = d_tpot if drafter_ttft is None else _latency("drafter_ttft", drafter_ttft)
    delay = _latency("preempt_delay", preempt_delay)
    if isinstance(lookahead, str):
        if lookahead != AUTO:
            raise ConfigError(f"lookahead={lookahead!r} must be an integer >= 1 or {AUTO!r}")
        if method == "si":
            raise ConfigError(f"lookahead={AUTO!r} is for DSI only: SI needs a lookahead k (an integer >= 1)")
        k = None
    else:
        k = _positive_int("lookahead", lookahead)
    if max_window is not None:
        if k is not None:
            raise ConfigError(f"max_window={max_window!r} is only valid with lookahead={AUTO!r}")
        max_window = _positive_int("max_window", max_window)
    cv = _latency("latency_cv", latency_cv, "a coefficient of variation")
    if num_servers is not None:
        num_servers = _positive_int("num_servers", num_servers)
    repeats = _positive_int("repeats", repeats)
    seed = _positive_int("seed", seed, minimum=0)
    if method == "ar" and matches is None and acceptance is None:
        n = _positive_int("tokens", tokens)
        patterns = [np.ones(n, dtype=bool)] * repeats
    else:
        n, patterns = _patterns(tokens, acceptance, matches, repeats, seed)
    side_patterns: list[np.ndarray | None] = [None] * len(patterns)
    if rescues is not None:
        if method == "ar":
            raise ConfigError("rescues apply to methods 'dsi' and 'si' (draft trees), not 'ar'")
        side_patterns = _as_patterns(rescues)
        if len(side_patterns) == 1:
            side_patterns = side_patterns * len(patterns)
        if len(side_patterns) != len(patterns) or any(len(r) != n for r in side_patterns):
            raise ConfigError(f"rescues must be one pattern of {n} positions or one per run ({len(patterns)}), "
                              f"as matches are; got {len(side_patterns)} of lengths "
                              f"{sorted({len(r) for r in side_patterns})}")
    noises: list[_Noise | None] = [None] * len(patterns)
    if cv > 0:
        noises = [_Noise(cv, rng) for rng in np.random.default_rng(seed).spawn(len(patterns))]
    runs = []
    for pattern, noise, sides in zip(patterns, noises, side_patterns, strict=True):
        if method == "ar":
            runs.append(_ar_run(n, t_ttft, t_tpot, noise))
        elif method == "si":
            runs.append(_si_run(pattern, k, t_ttft, t_tpot, d_ttft, d_tpot, noise, sides, si_tree))
        else:
            dsi = _DSIRun(pattern, k, num_servers, t_ttft, t_tpot, d_ttft, d_tpot, queue, delay, max_window, noise,
                          sides, dsi_branches)
            runs.append(dsi.run())
    return EventSimResult(method, n, AUTO if k is None else k, num_servers if method == "dsi" else 1, tuple(runs))
