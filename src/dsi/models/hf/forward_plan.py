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
- **Inputs made on the host** (:class:`ForwardInputs`): a forward's ids, positions, cache positions and
  visibility are written with numpy into one buffer (pinned on a GPU) and cross in one copy that the host does
  not wait for; the additive mask and the greedy ids (:func:`greedy_ids`) are made on the device, inside the
  forward's graph where there is one. A replayed forward thus costs the host one copy in, one graph launch and
  the copy of what it reads out, where building its inputs with torch took about fifteen kernel launches.
- **CUDA graphs** (:class:`GraphSet`): one graph per padded size, attention span and session, captured at its
  first use after one eager warm-up forward, on the inputs' buffers of its shape, which each forward rewrites.
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
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
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
    """How an :class:`~dsi.models.hf.model.HFModel`'s sessions run their forwards.

    ``kv_cache``: ``"dynamic"`` (transformers' ``DynamicCache``: grows and crops) or ``"static"``
    (:class:`PositionedCache`, preallocated). ``kv_cache_len``: the positions a static cache holds (None: the
    model's context, at most :data:`DEFAULT_KV_CACHE_LEN`); a session past it gets a ``ContextLengthError``.
    ``cuda_graphs``: capture each forward's padded shape as a CUDA graph (needs the static cache).
    ``device_decisions``: decide sampled chain verifications on the model's device (:mod:`dsi.models.hf.device_laws`:
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


def visibility(start: int, size: int, real: int, span: int, allowed: np.ndarray | None,
               out: np.ndarray | None = None) -> np.ndarray:
    """``[size, span]`` bool (into ``out`` where given): which of the first ``span`` cache positions (at least
    ``start + size``) each of a forward's ``size`` queries (``real`` of them real, written at ``start ..``) may
    attend to. Real queries: ``allowed`` (``[real, start + real]``, a tree's mask) or causal; padding queries: the
    context before ``start`` and themselves only."""
    mask = np.empty((size, span), dtype=bool) if out is None else out
    writes = np.arange(start, start + size)
    np.less_equal(np.arange(span)[None, :], writes[:, None], out=mask)  # causal over this forward and before it
    if size > real:
        mask[real:, start:] = False
        mask[np.arange(real, size), writes[real:]] = True  # a padding query sees itself, never a real new token
    if allowed is not None:
        mask[:real, : start + real] = allowed
        mask[:real, start + real:] = False
    return mask


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``visible`` ([q, kv] bool) as the additive ``[1, 1, q, kv]`` mask transformers takes as it is."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def greedy_ids(rows: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (``[rows]`` int64, where the rows are), ``-1`` for a row with a NaN: torch's argmax
    takes a NaN for the largest value (on the CPU and on CUDA alike), so the value at the argmax is NaN exactly
    where a row has one, and no second pass over the rows looks for it."""
    top = rows.argmax(dim=-1)
    return top.masked_fill_(torch.isnan(rows.gather(-1, top[:, None])[:, 0]), -1)


class ForwardInputs:
    """One static forward's inputs in one buffer, so that they cross to the device in one copy: its ids, position
    ids and cache positions (``int64 [size]`` each), then the visibility (``bool [size, span]``, made additive on
    the device, inside the forward's graph where there is one). :meth:`fill` writes them on the host through
    numpy views; :meth:`send` copies the buffer to the device, on a GPU from pinned memory without waiting for it
    (the next :meth:`fill` waits for that copy to have landed). On a CPU the host buffer is the device's.

    The device views (:attr:`ids`, :attr:`positions`, :attr:`write_at`, :attr:`visible`) stay where they are: a
    graph captured on them reads what each :meth:`send` writes."""

    def __init__(self, size: int, span: int, device: torch.device) -> None:
        self.size, self.span = size, span
        ints = 3 * size * 8
        nbytes = ints + size * span
        on_gpu = device.type == "cuda"
        self._host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_gpu)
        self._device = torch.empty(nbytes, dtype=torch.uint8, device=device) if on_gpu else self._host
        self._sent = torch.cuda.Event() if on_gpu else None
        self._in_flight = False
        host = self._host.numpy()
        self._ids, self._positions, self._write_at = host[:ints].view(np.int64).reshape(3, size)
        self._visible = host[ints:].view(np.bool_).reshape(size, span)
        columns = self._device[:ints].view(torch.int64).view(3, size)
        self.ids, self.positions = columns[0][None], columns[1][None]  # [1, size] each
        self.write_at = columns[2]  # [size]
        self.visible = self._device[ints:].view(torch.bool).view(size, span)

    def fill(self, new: list[int], start: int, positions: list[int] | None = None,
             allowed: np.ndarray | None = None) -> None:
        """A forward of ``new`` (padded with id 0 to :attr:`size`) written at ``start ..``, at ``positions`` (the
        real tokens'; default and for padding: where each is written), its real queries seeing ``allowed`` or the
        causal context (:func:`visibility`)."""
        if self._in_flight:
            self._sent.synchronize()  # the last send's copy has read the host buffer
            self._in_flight = False
        real = len(new)
        self._ids[:real] = new
        self._ids[real:] = 0
        self._write_at[:] = np.arange(start, start + self.size)
        self._positions[:] = self._write_at
        if positions is not None:
            self._positions[:real] = positions
        visibility(start, self.size, real, self.span, allowed, out=self._visible)

    def send(self) -> None:
        """The filled buffer to the device (on the current stream; nothing to do on a CPU)."""
        if self._device is not self._host:
            self._device.copy_(self._host, non_blocking=True)
            self._sent.record()
            self._in_flight = True


# ---- CUDA graphs ---------------------------------------------------------------------------------------------
# One capture underway at a time in a process: PyTorch's capture state (its RNG's and the caching allocator's
# bookkeeping of a capture's pool) is global, and it never meant two captures to overlap. Other threads' eager
# forwards and replays on their own streams go on during a capture (captures are "thread_local").
_CAPTURE_LOCK = threading.Lock()


def capturable(device: torch.device) -> bool:
    """Whether forwards on ``device`` can be captured as CUDA graphs."""
    return device.type == "cuda"


@dataclass
class _Graph:
    graph: Any
    logits: torch.Tensor  # [1, size, V]: what a replay leaves
    ids: torch.Tensor  # [size]: each row's argmax (-1 for a row with a NaN), from the same replay


class GraphSet:
    """One session's captured forwards, by padded size and attention span, each on the :class:`ForwardInputs` that
    :meth:`inputs` keeps for its shape: a forward fills and sends those inputs, and :meth:`run` replays the graph
    of their shape (capturing it first: one eager call of ``body`` as its warm-up, then ``body`` captured), so
    that a replayed forward costs the host one copy in, one launch, and the copy of what it reads out.
    ``body(inputs)`` is the session's forward on ``inputs``: the logits ``[1, size, V]`` and their rows' greedy
    ids (:func:`greedy_ids`), made inside the graph. ``run`` returns None where graphs cannot run here (the caller
    then runs the forward eagerly); a failed capture is logged once per model and not tried again."""

    _warned: set[int] = set()
    _warn_lock = threading.Lock()

    def __init__(self, owner: Any, body: Any, stream: Any) -> None:
        self._owner = owner
        self._body = body
        self._stream = stream
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._inputs: dict[tuple[int, int], ForwardInputs] = {}
        self._pool = None
        self.disabled = not capturable(owner.device)
        if self.disabled:
            self._say_once("CUDA graphs need a CUDA device; %s runs its forwards eagerly (on the same padded shapes)")
        self.captures = 0
        self.capture_s = 0.0  # the host's time in this set's captures, their warm-up forwards included

    def _say_once(self, message: str, *args: Any) -> None:
        with GraphSet._warn_lock:
            if id(self._owner) in GraphSet._warned:
                return
            GraphSet._warned.add(id(self._owner))
        logger.warning(message, self._owner.name, *args)

    def inputs(self, size: int, span: int) -> ForwardInputs:
        """The inputs of a forward of ``size`` tokens attending over ``span`` positions: the same buffers at every
        call for that shape (a graph reads them where it was captured)."""
        key = (size, span)
        inputs = self._inputs.get(key)
        if inputs is None:
            inputs = self._inputs[key] = ForwardInputs(size, span, self._owner.device)
        return inputs

    def run(self, inputs: ForwardInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The logits and greedy ids of a forward on ``inputs`` (from :meth:`inputs`, filled and sent), replayed;
        None where graphs cannot run here."""
        if self.disabled:
            return None
        key = (inputs.size, inputs.span)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(inputs)
            if graph is None:
                return None
            self._graphs[key] = graph
        graph.graph.replay()
        return graph.logits, graph.ids

    def _capture(self, inputs: ForwardInputs) -> _Graph | None:
        try:
            with _CAPTURE_LOCK:
                start = time.perf_counter()
                self._body(inputs)  # the warm-up: lazily made buffers and kernels' choices, outside the capture
                torch.cuda.current_stream(self._owner.device).synchronize()
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                    logits, ids = self._body(inputs)
                took = time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001 - any capture failure: eager from now on, said once
            self.disabled = True
            self._say_once("%s: a CUDA graph could not be captured (%s: %s); its forwards run eagerly",
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return None
        self.captures += 1
        self.capture_s += took
        # what graphs cost a user at start-up, said as it is paid (a session's first forward of each shape)
        logger.info("%s: captured a CUDA graph of %d tokens over %d positions in %.0f ms (this session: %d graphs, "
                    "%.2f s)", self._owner.name, inputs.size, inputs.span, took * 1e3, self.captures, self.capture_s)
        return _Graph(graph, logits, ids)
