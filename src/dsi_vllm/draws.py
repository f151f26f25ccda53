"""A coupled draw made from a torch logit row: the law dsi's host would make of the row, drawn with keyed noise.

What :mod:`dsi_vllm.processor` computes inside vLLM for each row that asks for it, in torch (dsi is not installed
there). :func:`law` follows ``dsi.sampling._distribution`` (temperature, min_p, top-k, top-p, in that order and in
float32) and :func:`draw` ``dsi.coupling.coupled_draw``; tests/unit/test_coupling.py checks both against dsi's.

The request's arguments are :mod:`dsi_vllm.protocol`'s.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dsi_vllm.noise import gumbel_from_bits, uniform_bits
from dsi_vllm.protocol import MIN_P, PROBE, SEED, TEMPERATURE, TOP_K, TOP_P

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def draw_args(extra: dict | None) -> dict | None:
    """The draw a request asks for (its ``vllm_xargs``), checked: None where it asks for none; ValueError naming
    the argument and what it allows otherwise (vLLM answers a 400)."""
    if not extra or (SEED not in extra and PROBE not in extra):
        return None
    if PROBE in extra:
        probe = extra[PROBE]
        if not _is_int(probe) or probe < 0:
            raise ValueError(f"{PROBE}={probe!r} must be a token id (an integer >= 0)")
        return {"probe": probe}
    seed = extra[SEED]
    if not _is_int(seed) or not 0 <= seed < 2**63:
        raise ValueError(f"{SEED}={seed!r} must be an integer in [0, 2**63)")
    temperature = extra.get(TEMPERATURE, 1.0)
    if not _is_number(temperature) or temperature <= 0:
        raise ValueError(f"{TEMPERATURE}={temperature!r} must be a finite number > 0")
    top_k = extra.get(TOP_K, 0)
    if not _is_int(top_k) or top_k < 0:
        raise ValueError(f"{TOP_K}={top_k!r} must be an integer >= 0 (0 disables top-k)")
    top_p = extra.get(TOP_P, 1.0)
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"{TOP_P}={top_p!r} must be in (0, 1]")
    min_p = extra.get(MIN_P, 0.0)
    if not _is_number(min_p) or not 0 <= min_p <= 1:
        raise ValueError(f"{MIN_P}={min_p!r} must be in [0, 1]")
    return {"seed": seed, "temperature": float(temperature), "top_k": top_k, "top_p": float(top_p),
            "min_p": float(min_p)}


def law(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The processed law of a logit row ``[V]``: float32, as ``dsi.sampling._distribution`` makes it (the
    maximum shifted to 0, scaled by ``1 / T``, min_p, top-k with ties to the k-th kept, ``exp``, normalised,
    then top-p over the ids ordered by their logits, ties in id order)."""
    row = row.to(torch.float32)
    top = row.max()
    if torch.isposinf(top):  # the limit as those logits grow: they share the mass equally
        row = torch.where(torch.isposinf(row), 0.0, -math.inf)
        top = torch.zeros((), dtype=torch.float32)
    x = row - top
    if 2.0 / _FLOAT32_MAX <= temperature <= 0.5 / _FLOAT32_TINY:
        if temperature != 1.0:
            x = x * torch.tensor(1.0 / temperature, dtype=torch.float32)
    else:
        x = (x.to(torch.float64) / temperature).to(torch.float32)
    if min_p > 0.0:
        x = torch.where(x < math.log(min_p), -math.inf, x)
    if 0 < top_k < x.numel():
        kth = torch.topk(x, top_k).values[-1]
        x = torch.where(x < kth, -math.inf, x)
    p = torch.exp(x)
    p = p / p.sum()
    if top_p < 1.0:
        ids = torch.nonzero(p > 0).flatten()
        order = ids[torch.sort(-row[ids], stable=True).indices]
        mass = torch.cumsum(p[order].to(torch.float64), 0)
        keep = int(torch.searchsorted(mass, torch.tensor([top_p], dtype=torch.float64)).item())
        kept = order[: keep + 1]
        nucleus = torch.zeros_like(p)
        nucleus[kept] = p[kept]
        p = nucleus / nucleus.sum()
    return p


def draw(row: torch.Tensor, seed: int, position: int, temperature: float, top_k: int, top_p: float,
         min_p: float) -> int:
    """The coupled draw of ``row``'s processed law at ``(seed, position)``: the id of positive probability
    maximising ``log p + G`` (``dsi.coupling.coupled_draw``)."""
    p = law(row, temperature, top_k, top_p, min_p)
    ids = torch.nonzero(p > 0).flatten()
    if not ids.numel():
        return int(torch.argmax(row).item())  # a row of NaN: vLLM's own argmax, which dsi's checks then refuse
    noise = gumbel_from_bits(uniform_bits(ids.to(torch.int64), seed, position).to(torch.float64), torch.log)
    scores = torch.log(p[ids].to(torch.float64)) + noise
    return int(ids[torch.argmax(scores)].item())
