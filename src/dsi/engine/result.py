"""What a generation returns: the new tokens and the run's statistics."""

from __future__ import annotations

from dataclasses import dataclass

from dsi.engine.stats import GenerationStats


@dataclass(frozen=True)
class GenerationResult:
    tokens: list[int]  # new tokens only (an EOS committed by the target is included)
    stats: GenerationStats

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason

    def to_dict(self) -> dict:
        return {"token_ids": list(self.tokens), "finish_reason": self.finish_reason, "stats": self.stats.to_dict()}
