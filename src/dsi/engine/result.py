"""What a generation returns: the new tokens and the run's statistics."""

from __future__ import annotations

from dataclasses import dataclass

from dsi.engine.stats import GenerationStats
from dsi.logprobs import TokenLogprob


@dataclass(frozen=True)
class GenerationResult:
    tokens: list[int]  # new tokens only (an EOS committed by the target is included)
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for them

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason

    def to_dict(self) -> dict:
        out = {"token_ids": list(self.tokens), "finish_reason": self.finish_reason, "stats": self.stats.to_dict()}
        if self.logprobs is not None:
            out["logprobs"] = [e.to_dict() for e in self.logprobs]
        return out
