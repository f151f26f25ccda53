"""What a forward of a model costs by the rows it computes, and so what one more verified row (a draft
tree's side child) costs relative to a one-token forward: the price ``draft_tree="auto"`` weighs before
it branches (:func:`dsi.trees.floor_for_price`).

A forward over ``n`` new tokens costs about ``one_token_s + (n - 1) * per_row_s``. On a GPU, up to its
compute bound, ``per_row_s`` is near 0 and side children are free; on a CPU a forward is mostly per-token
work (llama.cpp, the embedded 1.5B on 2 cores: 47 ms for one token, 194 ms for six), so a side child costs
most of what the rescue it may bring saves.

- A model may state its costs: ``forward_costs() -> ForwardCosts | None``. The latency model
  (:class:`~dsi.models.WithLatency`: its TPOT and ``token_s``) and :class:`~dsi.models.CallableLM` (a
  function of the context: no hardware, so nothing for a tree to weigh) do; a replayed model states its
  inner model's costs where that one does.
- Otherwise :func:`measure_forward_costs` times forwards of 1 and of ``1 + EXTRA_ROWS`` tokens after a short
  prefix on a scratch session (after one untimed batched forward; the median of ``REPEATS``), once per model
  object in this process: about 1.5 s for the embedded 1.5B on llama.cpp on 2 CPU cores.
"""

from __future__ import annotations

import statistics
import threading
import time
import weakref
from dataclasses import dataclass

PREFIX_TOKENS = 16  # the context the timed forwards extend (a cache to attend to, as a verification has)
EXTRA_ROWS = 8  # the second timed forward computes 1 + EXTRA_ROWS tokens
REPEATS = 3


@dataclass(frozen=True)
class ForwardCosts:
    """A forward over ``n`` new tokens costs ``one_token_s + (n - 1) * per_row_s`` seconds; ``measured``:
    timed here rather than stated by the model."""

    one_token_s: float
    per_row_s: float
    measured: bool = False

    @property
    def row_price(self) -> float:
        """One more row as a fraction of a one-token forward, in [0, 1] (0 where forwards cost nothing)."""
        if self.one_token_s <= 0.0:
            return 0.0
        return min(1.0, max(0.0, self.per_row_s / self.one_token_s))


def stated_costs(model: object) -> ForwardCosts | None:
    """What ``model`` says its forwards cost (``forward_costs()``), or None where it does not say."""
    state = getattr(model, "forward_costs", None)
    return state() if callable(state) else None


_measured: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def forward_costs(model: object, measure: bool = True) -> ForwardCosts | None:
    """``model``'s forward costs: stated, or (``measure``) timed once per model object and remembered;
    None where neither can be had (a model whose sessions fail on the probe)."""
    stated = stated_costs(model)
    if stated is not None or not measure:
        return stated
    with _lock:
        try:
            known = _measured.get(model)
        except TypeError:  # not weakly referable: measured every time
            known = None
        if known is None:
            known = measure_forward_costs(model)
            if known is not None:
                try:
                    _measured[model] = known
                except TypeError:
                    pass
    return known


def measure_forward_costs(model: object, repeats: int = REPEATS) -> ForwardCosts | None:
    """Time forwards of 1 and ``1 + EXTRA_ROWS`` new tokens after a ``PREFIX_TOKENS``-token prefix on a scratch
    session of ``model`` (alternating, median of ``repeats`` each). None if its sessions cannot run the probe
    (a context shorter than the probe, a failing backend)."""
    vocab = int(model.vocab_size)  # type: ignore[attr-defined]
    tokens = [1 + i % max(1, vocab - 1) for i in range(PREFIX_TOKENS + 1 + EXTRA_ROWS)]
    try:
        session = model.new_session()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - a probe: a model that cannot open one has no measured price
        return None
    one, many = [], []
    try:
        session.extend(tokens[:PREFIX_TOKENS])
        session.extend(tokens[PREFIX_TOKENS:])  # untimed: a first batched forward may set kernels up
        session.truncate(PREFIX_TOKENS)
        for _ in range(repeats):
            for count, times in ((1, one), (1 + EXTRA_ROWS, many)):
                began = time.perf_counter()
                session.extend(tokens[PREFIX_TOKENS:PREFIX_TOKENS + count])
                times.append(time.perf_counter() - began)
                session.truncate(PREFIX_TOKENS)
    except Exception:  # noqa: BLE001 - as above
        return None
    finally:
        session.close()
    t1, tn = statistics.median(one), statistics.median(many)
    return ForwardCosts(one_token_s=t1, per_row_s=max(0.0, (tn - t1) / EXTRA_ROWS), measured=True)
