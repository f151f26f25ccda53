"""Telemetry of one generation: counters every engine fills in, and derived rates.

Glossary: a *draft* is a drafter token proposed for a position; it is *accepted* or
*rejected* when the target decides that position. A *verification task* asks one target server
to score some positions; a task is *preempted* when a rejection makes its context stale before
its result is used (dropped from a queue, stopped mid-forward, or discarded on arrival); a task
still outstanding when the generation ends (finished, stopped or aborted) is *cancelled*.
*Wasted target time* is server time spent on tasks whose results were not used.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    method: str
    new_tokens: int = 0
    drafted_tokens: int = 0  # drafts produced, including ones later abandoned
    accepted_tokens: int = 0  # drafts accepted by the target
    rejections: int = 0  # drafts rejected (each yields a correction token)
    bonus_tokens: int = 0  # target tokens committed where no draft existed
    verify_tasks: int = 0  # verification tasks submitted to target servers
    draft_windows: int = 0  # DSI: verification tasks that carried drafts (not the zero-draft ones)
    window_drafts: int = 0  # DSI: drafts those windows carried, summed
    preempted_tasks: int = 0  # tasks made stale by a rejection
    cancelled_tasks: int = 0  # tasks still outstanding when the generation ended
    target_forwards: int = 0  # target forwards run to completion or aborted
    drafter_forwards: int = 0
    target_busy_s: float = 0.0  # summed target server time
    completed_target_forwards: int = 0  # target forwards that ran to their end (not aborted)
    completed_target_s: float = 0.0  # their summed time
    drafter_busy_s: float = 0.0  # summed drafter forward time (DSI: including abandoned forwards)
    wasted_target_s: float = 0.0  # target server time on tasks whose results were not used
    num_target_servers: int = 1
    lookahead: int | str | None = None  # k, or "auto" (DSI's event-driven windows); None: non-SI (no drafts)
    wall_time_s: float = 0.0
    time_to_first_token_s: float = 0.0
    finish_reason: str = "length"  # "length" | "stop" (EOS or a stop id: stop_token) | "abort" (the caller's flag)
    stop_token: int | None = None  # with "stop": the token that ended the output (an EOS or a stop id)
    extra: dict = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over decided drafts (0 when no draft was decided)."""
        decided = self.accepted_tokens + self.rejections
        return self.accepted_tokens / decided if decided else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Mean run of consecutive accepted drafts, runs ending at a rejection or at the end."""
        if self.accepted_tokens + self.rejections == 0:
            return 0.0
        return self.accepted_tokens / (self.rejections + 1)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    @property
    def target_utilisation(self) -> float:
        """Target server busy time over (wall time x number of servers)."""
        capacity = self.wall_time_s * self.num_target_servers
        return self.target_busy_s / capacity if capacity > 0 else 0.0

    @property
    def mean_window(self) -> float:
        """DSI: mean drafts per verification window (k for a fixed lookahead, less at the ends)."""
        return self.window_drafts / self.draft_windows if self.draft_windows else 0.0

    @property
    def mean_target_forward_s(self) -> float:
        """Mean time of a target forward that ran to its end, as the servers saw it (in DSI, while
        running next to the drafter and the other servers)."""
        return self.completed_target_s / self.completed_target_forwards if self.completed_target_forwards else 0.0

    @property
    def mean_drafter_forward_s(self) -> float:
        """Mean drafter forward time (one drafted token, or a catch-up after a restart)."""
        return self.drafter_busy_s / self.drafter_forwards if self.drafter_forwards else 0.0

    def to_dict(self) -> dict:
        data = asdict(self)
        extra = data.pop("extra")
        data.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_length=self.mean_accepted_length,
            tokens_per_second=self.tokens_per_second,
            target_utilisation=self.target_utilisation,
            mean_window=self.mean_window,
            mean_target_forward_s=self.mean_target_forward_s,
            mean_drafter_forward_s=self.mean_drafter_forward_s,
        )
        data.update(extra)
        return data
