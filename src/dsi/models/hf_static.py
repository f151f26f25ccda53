"""The hf backend's fast forward path: a static KV cache per session, padded shapes, and captured CUDA graphs.

A dynamic cache grows with every forward and is cropped on a rollback; each forward's shapes are new, so a GPU
runs it as hundreds of small kernel launches with the host in between. Here:

- **A static cache** (:class:`PositionedCache`): every layer's keys and values are preallocated to
  ``kv_cache_len`` positions at the session's first forward. A forward writes its new keys and values *at the
  positions it is given* (``index_copy_`` at :attr:`PositionedCache.write_at`), the session keeps the length on
  the host, and a rollback only moves that length: nothing is copied or freed. Attention reads the buffer (its
  span, below) under an explicit mask (a key is visible to a query only at or before its position, or, in a
  draft tree, along its ancestors), so positions past the session's length, stale or never written, are never
  read.
- **An attention span** (:func:`attended`): a forward's attention reads the cache's first positions only, up to
  the end of what it writes (with graphs, rounded up to a power of two, at least :data:`ATTEND_MIN`, so that a
  session's graphs are few): a grouped-query model repeats its keys and values for every head it attends over,
  so a forward over the whole preallocated cache (4,096 positions by default) read and wrote several times the
  keys and values it needed (on the CPU, a 5-token forward of the 1.5B target's architecture took 1.8 times as
  long: docs/results.md, "The static cache on a CPU").
- **Padded shapes**: with graphs on, a forward of ``n`` new tokens runs as one of ``n`` rounded up to a power of
  two (at most :data:`GRAPH_MAX_TOKENS`; longer ones, a prompt's, run as they are). The padding tokens come after
  the real ones, each visible only to itself and the real context, and are written past the session's length, so
  the real rows are what an unpadded forward gives.
- **CUDA graphs** (:class:`GraphSet`): one graph per padded size, attention span and session, captured at its
  first use after one eager warm-up forward, replayed with the inputs copied into its static buffers.
  Captures in one process take turns (:data:`_CAPTURE_LOCK`: PyTorch supports one capture underway at a time,
  and target servers as threads and the drafter beside them reach their first forwards together). Cancellation
  is checked between replays (a replay takes milliseconds). Where a graph cannot be captured (not a
  CUDA device, a model whose forward synchronises with the host), the forward runs eagerly on the same padded
  shapes and spans, and the model says so once.

What is *not* here: sampling and decisions (a session returns rows or argmax ids; see :mod:`dsi.sampling`).
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

from dsi.errors import ConfigError
from dsi.models.base import check_int

logger = logging.getLogger(__name__)

KV_CACHES = ("dynamic", "static")
DEFAULT_KV_CACHE_LEN = 4096  # positions a static cache holds when neither the user nor the model says fewer
GRAPH_MAX_TOKENS = 64  # forwards of more new tokens (prompts) run eagerly, unpadded
ATTEND_MIN = 256  # with graphs, the fewest cache positions a forward attends over (spans double from there)


@dataclass(frozen=True)
class ForwardPlan:
    """How an :class:`~dsi.models.hf.HFModel`'s sessions run their forwards.

    ``kv_cache``: ``"dynamic"`` (transformers' ``DynamicCache``: grows and crops) or ``"static"``
    (:class:`PositionedCache`, preallocated). ``kv_cache_len``: the positions a static cache holds (None: the
    model's context, at most :data:`DEFAULT_KV_CACHE_LEN`); a session past it gets a ``ContextLengthError``.
    ``cuda_graphs``: capture each forward's padded shape as a CUDA graph (needs the static cache).
    ``device_decisions``: decide sampled chain verifications on the model's device (:mod:`dsi.models.device_laws`:
    only the drafts' probabilities and one law cross to the host); None (the default): where the model is on a
    GPU."""

    kv_cache: str = "dynamic"
    kv_cache_len: int | None = None
    cuda_graphs: bool = False
    device_decisions: bool | None = None

    def __post_init__(self) -> None:
        if self.kv_cache not in KV_CACHES:
            raise ConfigError(f"kv_cache={self.kv_cache!r} must be one of {', '.join(KV_CACHES)}")
        if self.kv_cache_len is not None:
            object.__setattr__(self, "kv_cache_len", check_int(self.kv_cache_len, "kv_cache_len", 1))
        if self.kv_cache_len is not None and self.kv_cache != "static":
            raise ConfigError(f"kv_cache_len={self.kv_cache_len} sizes a static cache; pass kv_cache='static'")
        if not isinstance(self.cuda_graphs, bool):
            raise ConfigError(f"cuda_graphs={self.cuda_graphs!r} must be True or False")
        if self.device_decisions is not None and not isinstance(self.device_decisions, bool):
            raise ConfigError(f"device_decisions={self.device_decisions!r} must be True, False or None (on a GPU)")
        if self.cuda_graphs and self.kv_cache != "static":
            raise ConfigError("cuda_graphs=True needs kv_cache='static': a graph replays fixed buffers")

    @property
    def static(self) -> bool:
        return self.kv_cache == "static"

    def cache_len(self, max_context: int | None) -> int:
        """The positions a static cache holds for a model of ``max_context`` positions."""
        length = DEFAULT_KV_CACHE_LEN if self.kv_cache_len is None else self.kv_cache_len
        return length if max_context is None else min(length, max_context)


def has_sliding_layers(config: Any) -> bool:
    """Whether some layer of a model of ``config`` attends to a window only: per ``layer_types`` where the config
    lists them, else wherever it sets a ``sliding_window`` without turning it off (Mistral's configs)."""
    text = config.get_text_config()
    layer_types = getattr(text, "layer_types", None)
    use = getattr(text, "use_sliding_window", None)
    if layer_types:
        return bool(use) or any(t != "full_attention" for t in layer_types)
    return bool(use) or (getattr(text, "sliding_window", None) is not None and use is not False)


def check_full_attention(config: Any, name: str) -> None:
    """A static cache here holds every position of every layer under a mask of its own: refuse sliding-window
    layers (whose mask it would replace) with a ConfigError that says what to use instead."""
    if has_sliding_layers(config):
        raise ConfigError(f"kv_cache='static' needs every layer of {name} to attend to the whole context; it has "
                          "sliding-window layers: use kv_cache='dynamic'")


def padded_size(n: int, graphs: bool) -> int:
    """The number of tokens a forward of ``n`` new tokens runs with: ``n`` rounded up to a power of two with
    graphs on (up to :data:`GRAPH_MAX_TOKENS`), else ``n``."""
    if not graphs or n > GRAPH_MAX_TOKENS:
        return n
    size = 1
    while size < n:
        size *= 2
    return size


def attended(end: int, max_len: int, graphs: bool) -> int:
    """The cache positions a forward attends over when it writes up to position ``end`` (exclusive) of a cache of
    ``max_len``: ``end``, or with graphs ``end`` rounded up to a power of two, at least :data:`ATTEND_MIN` (a
    graph per span: a handful per session, and at most twice the positions needed); never past ``max_len``."""
    if not graphs:
        return min(end, max_len)
    span = ATTEND_MIN
    while span < end:
        span *= 2
    return min(span, max_len)


# ---- the cache ---------------------------------------------------------------------------------------------
@functools.cache
def _positioned_class() -> type:
    """The transformers ``Cache`` subclass of :class:`PositionedCache` (made once, at the first static session, so
    that transformers is imported only where the hf backend is used)."""
    from transformers.cache_utils import Cache, StaticLayer

    class PositionedLayer(StaticLayer):
        """A static layer that writes at the positions its cache names (no running counter to keep in step)."""

        def __init__(self, max_cache_len: int, owner: PositionedCache) -> None:
            super().__init__(max_cache_len=max_cache_len)
            self._owner = owner

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            index = self._owner.write_at
            self.keys.index_copy_(2, index, key_states)
            self.values.index_copy_(2, index, value_states)
            span = self._owner.attend  # attention reads these first positions only (views: nothing is copied)
            return self.keys[:, :, :span], self.values[:, :, :span]

        def get_seq_length(self) -> int:
            return self._owner.length

        def crop(self, tokens_to_remove: int) -> None:  # the session moves the length itself
            raise RuntimeError("a positioned cache is truncated by its session's length, not cropped")

    class Positioned(Cache, PositionedCache):
        def __init__(self, config: Any, max_len: int, device: torch.device) -> None:
            layers = config.get_text_config().num_hidden_layers
            super().__init__(layers=[PositionedLayer(max_len, self) for _ in range(layers)])
            self.max_len = max_len
            self.length = 0
            self.attend = max_len
            self.write_at = torch.zeros(1, dtype=torch.long, device=device)

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return self.length

        def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
            return self.attend, 0

    return Positioned


class PositionedCache:
    """Built by :func:`new_positioned_cache`: a transformers ``Cache`` of :data:`length` valid positions out of
    ``max_len`` preallocated ones, whose layers write each forward's keys and values at :attr:`write_at` and give
    attention the first :attr:`attend` positions."""

    write_at: torch.Tensor
    length: int
    max_len: int
    attend: int


def new_positioned_cache(config: Any, max_len: int, device: torch.device) -> Any:
    """A :class:`PositionedCache` of ``max_len`` positions for a model of ``config``."""
    return _positioned_class()(config, max_len, device)


def visibility(start: int, size: int, real: int, span: int, allowed: torch.Tensor | None,
               device: torch.device) -> torch.Tensor:
    """``[size, span]`` bool: which of the first ``span`` cache positions (at least ``start + size``) each of a
    forward's ``size`` queries (``real`` of them real, written at ``start ..``) may attend to. Real queries:
    ``allowed`` (``[real, start + real]``, a tree's mask) or causal; padding queries: the context before ``start``
    and themselves only."""
    keys = torch.arange(span, device=device)
    writes = torch.arange(start, start + size, device=device)
    mask = keys[None, :] <= writes[:, None]  # causal over what this forward writes and everything before
    if size > real:
        mask[real:, start:] = False
        mask[real:].scatter_(1, writes[real:, None], True)  # a padding query sees itself, never a real new token
    if allowed is not None:
        mask[:real, : start + real] = allowed.to(device)
        mask[:real, start + real:] = False
    return mask


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``visible`` ([q, kv] bool) as the additive ``[1, 1, q, kv]`` mask transformers takes as it is."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


# ---- CUDA graphs ---------------------------------------------------------------------------------------------
# One capture underway at a time in a process: PyTorch's capture state (its RNG's and the caching allocator's
# bookkeeping of a capture's pool) is global, and it never meant two captures to overlap. Other threads' eager
# forwards and replays on their own streams go on during a capture (captures are "thread_local").
_CAPTURE_LOCK = threading.Lock()


@dataclass
class _Graph:
    graph: Any
    ids: torch.Tensor  # [1, size]
    positions: torch.Tensor  # [1, size]
    write_at: torch.Tensor  # [size]
    mask: torch.Tensor  # [1, 1, size, span]
    logits: torch.Tensor  # [1, size, V]: what a replay leaves


class GraphSet:
    """One session's captured forwards, by padded size and attention span (the mask's last two dimensions; the
    cache's :attr:`~PositionedCache.attend` is that span when ``run`` is called). ``run`` replays the graph of the
    inputs' shape (capturing it first: one eager forward as its warm-up, then the capture), or returns None where
    graphs cannot run here (the caller then runs the forward eagerly); a failed capture is logged once per model
    and not tried again."""

    _warned: set[int] = set()
    _warn_lock = threading.Lock()

    def __init__(self, owner: Any, cache: Any, stream: Any) -> None:
        self._owner = owner
        self._cache = cache
        self._stream = stream
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = None
        self.disabled = owner.device.type != "cuda"
        if self.disabled:
            self._say_once("CUDA graphs need a CUDA device; %s runs its forwards eagerly (on the same padded shapes)")
        self.captures = 0

    def _say_once(self, message: str, *args: Any) -> None:
        with GraphSet._warn_lock:
            if id(self._owner) in GraphSet._warned:
                return
            GraphSet._warned.add(id(self._owner))
        logger.warning(message, self._owner.name, *args)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, write_at: torch.Tensor,
            mask: torch.Tensor) -> torch.Tensor | None:
        if self.disabled:
            return None
        key = tuple(mask.shape[-2:])  # (size, span)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(ids, positions, write_at, mask)
            if graph is None:
                return None
            self._graphs[key] = graph
        graph.ids.copy_(ids)
        graph.positions.copy_(positions)
        graph.write_at.copy_(write_at)
        graph.mask.copy_(mask)
        previous = self._cache.write_at
        self._cache.write_at = graph.write_at
        try:
            graph.graph.replay()
        finally:
            self._cache.write_at = previous
        return graph.logits

    def _capture(self, ids: torch.Tensor, positions: torch.Tensor, write_at: torch.Tensor,
                 mask: torch.Tensor) -> _Graph | None:
        owner, cache = self._owner, self._cache
        inputs = (ids.clone(), positions.clone(), write_at.clone(), mask.clone())
        previous = cache.write_at
        cache.write_at = inputs[2]
        try:
            with _CAPTURE_LOCK:
                owner._run_model(inputs[0], cache, None, attention_mask=inputs[3], position_ids=inputs[1])  # warm-up
                torch.cuda.current_stream(owner.device).synchronize()
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                    out = owner._run_model(inputs[0], cache, None, attention_mask=inputs[3], position_ids=inputs[1])
            captured = _Graph(graph, *inputs, out.logits)
        except Exception as exc:  # noqa: BLE001 - any capture failure: eager from now on, said once
            self.disabled = True
            self._say_once("%s: a CUDA graph could not be captured (%s: %s); its forwards run eagerly",
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return None
        finally:
            cache.write_at = previous
        self.captures += 1
        return captured
