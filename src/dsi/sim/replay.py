"""Recover a greedy run's per-position match pattern, to replay it in :mod:`dsi.sim.events`.

For a greedy run the drafter's token at output position ``i`` equals the target's iff both
argmaxes agree on the context ``prompt + tokens[:i]`` (a later draft of the same epoch is only
decided when every earlier one matched, so that is the context it was drafted on). Replaying
the pattern through the event simulator with the run's latencies gives the run's *ideal* time.

Works on any model that is, or wraps (``.model``, as :class:`dsi.models.WithLatency` does), a
callable model exposing ``next_logits(context) -> logits`` (:class:`dsi.models.CallableLM`).
Pure numpy; it imports no model backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dsi.errors import ConfigError

_MAX_WRAPPERS = 16


def next_logits_fn(model: object):
    """The innermost ``next_logits`` callable of ``model``, unwrapping ``.model`` attributes."""
    current = model
    for _ in range(_MAX_WRAPPERS):
        fn = getattr(current, "next_logits", None)
        if callable(fn):
            return fn
        current = getattr(current, "model", None)
        if current is None:
            break
    raise ConfigError(
        f"{model!r} exposes no next_logits(context) (directly or through .model); the match "
        "pattern needs callable models such as dsi.models.CallableLM"
    )


def greedy_match_pattern(
    target: object, drafter: object, prompt: Sequence[int], tokens: Sequence[int], *, check: bool = True
) -> list[bool]:
    """``matches[i]``: does the drafter's argmax equal the target's on ``prompt + tokens[:i]``?

    With ``check`` (default) every token must be the target's argmax on its context (the run
    was greedy and lossless); otherwise :class:`ConfigError` names the first position that is not.
    """
    target_fn, drafter_fn = next_logits_fn(target), next_logits_fn(drafter)
    context = [int(t) for t in prompt]
    matches = []
    for i, token in enumerate(tokens):
        ctx = tuple(context)
        target_token = int(np.argmax(target_fn(ctx)))
        if check and target_token != int(token):
            raise ConfigError(
                f"tokens[{i}]={int(token)} is not the target's greedy token {target_token}; "
                "a match pattern needs the target's greedy output"
            )
        matches.append(int(np.argmax(drafter_fn(ctx))) == target_token)
        context.append(int(token))
    return matches
