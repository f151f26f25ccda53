"""A vLLM logits processor that makes a request's coupled draw inside the engine (``dsi.coupling``).

dsi verifies a sampled window on a vLLM engine as one batch of prefixes (``dsi.models.engines.prefixes``), each
prompt generating one token. With this processor loaded (``--logits-processors
dsi_vllm.processor:CoupledDraws``), a request whose ``vllm_xargs`` carry ``dsi_seed`` has its row replaced by
the one-hot row of its coupled draw (:func:`dsi_vllm.draws.draw`) at ``position``, the length of its prompt and
output so far (the row decides the token after them). vLLM then returns that token (dsi sends the request with
``temperature: 0``), so a verification answers each row with one token id instead of a row of the vocabulary.
A request without those arguments is left alone; bad ones are a 400 naming the argument
(:meth:`CoupledDraws.validate_params`).

Penalties, ``logit_bias``, ``min_tokens`` and constraints are not made here: dsi sends such requests the way
that moves whole rows. This module imports only torch and vLLM.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from dsi_vllm.draws import draw, draw_args


class CoupledDraws(LogitsProcessor):
    """Replaces the row of each request that asks for a coupled draw by the one-hot row of that draw (see the
    module doc). Not argmax-invariant: vLLM applies it before its greedy sampling."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        draw_args(getattr(sampling_params, "extra_args", None))

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        # batch index -> (the draw's arguments, the prompt's token ids, the output's token ids as vLLM updates them)
        self.requests: dict[int, tuple[dict, list[int] | None, list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def state(params: Any, prompt: list[int] | None, output: list[int]) -> tuple | None:
            args = draw_args(getattr(params, "extra_args", None))
            return None if args is None else (args, prompt, output)

        process_dict_updates(self.requests, batch_update, state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (args, prompt, output) in self.requests.items():
            if index >= logits.shape[0]:
                continue
            if "probe" in args:
                token = args["probe"] % logits.shape[1]
            else:
                position = len(prompt or ()) + len(output)
                token = draw(logits[index], args["seed"], position, args["temperature"], args["top_k"],
                             args["top_p"], args["min_p"])
            logits[index] = -math.inf
            logits[index, token] = 0.0
        return logits
