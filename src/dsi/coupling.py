"""Coupled draws: the drafter and the target draw each position with the same keyed Gumbel noise.

The rule (``SamplingParams(coupled=True)``). At absolute position ``j`` of a request with seed ``s``, every token
``x`` has Gumbel noise ``G[x]``, a function of ``(s, j, x)`` only (:mod:`dsi_vllm.noise`). A law ``p`` draws
``argmax_x log p[x] + G[x]`` (:func:`coupled_draw`): an exact draw from ``p`` (the Gumbel-max trick). The drafter
drafts its law's draw, and the target's draw decides the position: the draft is accepted iff the two are the same
token, and after a rejection the target's draw is committed. So every committed token is the target's own draw
and the drafter only predicts it:

- **lossless for any drafter**: the output is plain sampling from the target's processed law;
- **the same tokens for one seed whatever decodes it**: non-SI, SI, DSI, any lookahead, SP, drafter, tree or
  timing (a drafter-invariant rule: Daliri, Musco and Suresh, "Coupling without Communication and
  Drafter-Invariant Speculative Decoding", arXiv 2408.07978);
- **only tokens cross**: a target server that draws where the row is (an engine's logits processor,
  :mod:`dsi_vllm.processor`) answers each row with one token, where the standard rule reads the target's
  probability of each draft and a whole row for a rejection's residual.

The price is acceptance: two draws with shared noise agree with probability at least ``(1 - TV) / (1 + TV)``
(``TV``: the total variation distance between the two laws), where the standard rule (:func:`dsi.sampling.decide`)
accepts with probability ``1 - TV``. It pays where rows are dear to move (engines over HTTP with a large
vocabulary), not where they are already in memory.
"""

from __future__ import annotations

import numpy as np

from dsi.errors import ModelError
from dsi_vllm.noise import gumbel_from_bits, uniform_bits


def gumbel(seed: int, position: int, ids: np.ndarray) -> np.ndarray:
    """The Gumbel noise of the token ``ids`` (int64 ``[m]``) at ``(seed, position)``: float64 ``[m]``."""
    bits = uniform_bits(np.asarray(ids, dtype=np.int64), seed, position)
    return gumbel_from_bits(bits.astype(np.float64), np.log)


def coupled_draw(law: np.ndarray, seed: int, position: int) -> int:
    """The draw of ``law`` (``[V]`` probabilities) at ``(seed, position)``: the token of positive probability
    maximising ``log law[x] + G[x]`` (the lowest id on an exact tie). Only the ids of positive probability are
    hashed (a top-k or top-p law has few). :class:`ModelError` for a law with none."""
    law = np.asarray(law)
    ids = np.flatnonzero(law > 0)
    if not ids.size:
        raise ModelError(f"cannot draw from a law with no positive probability ({law.size} entries)")
    scores = np.log(law[ids].astype(np.float64)) + gumbel(seed, position, ids)
    return int(ids[int(np.argmax(scores))])
