"""``HFModel``: any transformers causal LM (``AutoModelForCausalLM``) behind the session interface.

Owns: sessions with a transformers ``DynamicCache`` each (one forward per ``extend`` returning the
logits of every new position; ``truncate`` crops the cache), cancellation *inside* a forward
(a pre-hook on every decoder layer and on the LM head checks the calling thread's cancel flag),
restoring a cache whose layers an aborted forward left at different lengths, torch threads per
worker, devices and dtypes, replicas of the weights on other devices, and the tokenizer helpers
(encode / decode / chat template / EOS / context length) the CLI needs.

Loads a MODEL through :mod:`dsi.models.sources` (where it comes from) and
:mod:`dsi.models.hf.checkpoint` (a checkpoint directory for it, converting a GGUF once). Does not
know: which backend a caller picks (:mod:`dsi.models.loading`), sampling or the algorithm.

Threads: several sessions of one ``HFModel`` may run at once in different Python threads. They
share the read-only weights; each has its own cache. The cancel flag is kept in a
``threading.local``, so the hooks (registered once per model) only see the flag of the thread
whose forward they run in. ``threads`` (torch intra-op threads per worker) is applied with
``torch.set_num_threads`` in the worker thread before each forward: with torch's OpenMP backend
that setting belongs to the calling thread (see docs/models.md for the measurements). In the
deterministic mode a CPU forward runs on one intra-op thread instead, and the thread's setting is
given back after it (:meth:`HFModel._intra_op_threads`).

Tested with transformers 5.x (5.24) and torch 2.13 (CPU); the cache argument of ``forward`` is
``cache=`` from 5.2x on and ``past_key_values=`` before, both are handled.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dsi.errors import ConfigError, ContextLengthError, ModelError, TaskCancelled
from dsi.models.base import (
    CancelFlag,
    check_int,
    check_token_ids,
    common_prefix_length,
    encode_prompt,
    path_tree_rows,
)
from dsi.models.determinism import check_deterministic
from dsi.models.hf import device_laws
from dsi.models.hf.checkpoint import checkpoint_dir
from dsi.models.hf.forward_plan import (
    GRAPH_MAX_TOKENS, ForwardInputs, ForwardPlan, GraphSet, additive_mask, attended, check_full_attention,
    greedy_ids, has_sliding_layers, new_positioned_cache, padded_size,
)
from dsi.models.sources import resolve_source

logger = logging.getLogger(__name__)
ON_DEVICE = "device"  # what a forward hands back: its rows on the model's device, for a reader that decides there
DEVICE_READERS = device_laws.READERS  # how each reader of rows decides where the rows are

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
}
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bf16"`` / ``"fp32"`` / ``"fp16"`` (or a torch dtype) as a torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES:
            raise ConfigError(f"dtype={dtype} is not supported; use one of bf16, fp32, fp16")
        return dtype
    key = str(dtype).strip().lower()
    if key not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; use one of bf16, fp32, fp16")
    return DTYPES[key]


def check_device(device: str | torch.device, dtype: str | torch.dtype = "fp32") -> torch.device:
    """Validate a device string (``cpu``, ``cuda``, ``cuda:N``) and that it supports ``dtype``."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device={device!r} is not a valid device; use cpu, cuda or cuda:N") from exc
    dt = torch_dtype(dtype)
    if dev.type == "cpu":
        if dt == torch.float16:
            raise ConfigError(f"dtype=fp16 is not supported on device={str(dev)!r}; use bf16 or fp32 on CPU")
        return dev
    if dev.type != "cuda":
        raise ConfigError(f"device={str(dev)!r} is not supported; use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ConfigError(f"device={str(dev)!r} asked for, but CUDA is not available here; use device='cpu'")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ConfigError(f"device={str(dev)!r} does not exist; this machine has cuda:0..cuda:{count - 1}")
    if dt == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"dtype=bf16 is not supported on device={str(dev)!r} ({torch.cuda.get_device_name(index)}); "
                          "use fp16 or fp32")
    return torch.device("cuda", index)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of a causal LM: the ``ModuleList`` with ``num_hidden_layers`` entries."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n = getattr(config, "num_hidden_layers", None)
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    for m in lists:
        if len(m) == n:
            return list(m)
    if lists:
        return list(max(lists, key=len))
    return []


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tokenizer.tiktoken")


def _check_causal(config: Any, model_dir: Path) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", None)
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or getattr(config, "auto_map", {}).get("AutoModelForCausalLM"):
        return
    raise ModelError(
        f"{str(model_dir)!r} is a {model_type!r} model, not a causal language model "
        f"(AutoModelForCausalLM supports e.g. llama, qwen2, gpt2, mistral, phi3)"
    )


class HFModel:
    """A transformers causal LM as a :class:`~dsi.models.base.LanguageModel`.

    ``model`` is an already-loaded ``PreTrainedModel`` (``AutoModelForCausalLM``); it is put in
    eval mode and, if ``device`` is given, moved there. ``tokenizer`` is optional (token ids
    work without it). ``threads`` sets torch's intra-op threads in every thread that runs a
    forward of this model (None: leave torch's setting alone).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        device: str | torch.device | None = None,
        name: str | None = None,
        role: str | None = None,
        threads: int | None = None,
        source_dir: str | Path | None = None,
        deterministic: bool | None = None,
        forward_plan: ForwardPlan | None = None,
    ) -> None:
        if not isinstance(model, nn.Module) or not hasattr(model, "config"):
            raise ConfigError(f"model={type(model).__name__} must be a transformers PreTrainedModel")
        if getattr(model.config, "is_encoder_decoder", False) or model.get_output_embeddings() is None:
            raise ModelError(f"{type(model).__name__} is not a causal language model (no LM head / encoder-decoder)")
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise ConfigError(f"threads={threads!r} must be an integer >= 1 (or None for torch's default)")
        if device is not None:
            model = model.to(check_device(device, model.dtype))
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.role = role
        self.threads = threads
        self.deterministic = deterministic
        self.source_dir = Path(source_dir) if source_dir is not None else None
        self.forward_plan = forward_plan if forward_plan is not None else ForwardPlan()
        head = model.get_output_embeddings()
        self._vocab_size = int(getattr(head, "out_features", 0) or model.config.get_text_config().vocab_size)
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._keep_kwarg = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        self._local = threading.local()  # .cancel: the flag of the forward running in this thread
        self._lock = threading.Lock()
        self._replicas: dict[torch.device, HFModel] = {self.device: self}
        self.layers = decoder_layers(model)
        if not self.layers:
            logger.warning("%s: no decoder layers found; cancellation is checked only before the forward", self.name)
        self._hooks = [layer.register_forward_pre_hook(self._check_cancel) for layer in self.layers]
        self._hooks.append(head.register_forward_pre_hook(self._check_cancel))

    @classmethod
    def load(
        cls,
        spec: str | Path,
        dtype: str = "bf16",
        device: str = "cpu",
        *,
        role: str | None = None,
        progress: bool = True,
        threads: int | None = None,
        trust_remote_code: bool = False,
        forward_plan: ForwardPlan | None = None,
    ) -> HFModel:
        """Load a MODEL (directory, ``.gguf``, hub id, embedded short name: :mod:`dsi.models.sources`).

        A GGUF (the embedded pair's too) is converted once to bf16 safetensors in the cache
        (:mod:`dsi.models.hf.checkpoint`). ``dtype`` and ``device`` are checked before anything is
        downloaded or converted.
        """
        torch_dtype(dtype)
        check_device(device, dtype)
        source = resolve_source(spec)
        return cls.from_checkpoint(checkpoint_dir(source, progress=progress), dtype=dtype, device=device,
                                   name=source.name, role=role, threads=threads,
                                   trust_remote_code=trust_remote_code, forward_plan=forward_plan)

    @classmethod
    def from_checkpoint(
        cls,
        model_dir: str | Path,
        *,
        dtype: str = "bf16",
        device: str = "cpu",
        name: str | None = None,
        role: str | None = None,
        threads: int | None = None,
        trust_remote_code: bool = False,
        forward_plan: ForwardPlan | None = None,
    ) -> HFModel:
        """Load a transformers checkpoint directory (weights, config, and the tokenizer if it has one)."""
        import transformers

        torch_dt = torch_dtype(dtype)
        dev = check_device(device, dtype)
        model_dir = Path(model_dir)
        try:
            config = transformers.AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, KeyError) as exc:
            raise ModelError(f"cannot read the model config in {str(model_dir)!r}: {exc}") from exc
        _check_causal(config, model_dir)
        start = time.perf_counter()
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch_dt, device_map=str(dev), trust_remote_code=trust_remote_code
            )
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ModelError(f"cannot load the weights of {str(model_dir)!r}: {exc}") from exc
        tokenizer = None
        if any((model_dir / f).is_file() for f in _TOKENIZER_FILES):
            try:
                tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                logger.warning("cannot load the tokenizer in %s (%s); token ids only", model_dir,
                               str(exc).splitlines()[0])
        else:
            logger.info("no tokenizer files in %s; token ids only", model_dir)
        logger.info("loaded %s (%s, %s) in %.2f s", model_dir, dtype, dev, time.perf_counter() - start)
        return cls(model, tokenizer, name=name or str(model_dir), role=role, threads=threads, source_dir=model_dir,
                   forward_plan=forward_plan)

    # -- the LanguageModel interface -------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Size of the logit rows (may exceed the tokenizer's length: padded embedding matrices)."""
        return self._vocab_size

    def new_session(self, device: str | torch.device | None = None) -> HFSession:
        """A new empty session, on this model's device or on a replica on ``device``."""
        if device is not None:
            return self.on(device).new_session()
        return HFSession(self)

    # -- devices and replicas ----------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> str:
        return _DTYPE_NAMES.get(self.model.dtype, str(self.model.dtype))

    def on(self, device: str | torch.device) -> HFModel:
        """This model on ``device``: itself if it is there, else a replica (made once, then reused).

        A replica is loaded from ``source_dir`` straight onto the device when known, else deep-copied.
        Sessions from replicas behave exactly like sessions from this model.
        """
        dev = check_device(device, self.model.dtype)
        with self._lock:
            if dev not in self._replicas:
                self._replicas[dev] = self._replicate(dev)
            return self._replicas[dev]

    def replicas(self, devices: Sequence[str | torch.device]) -> list[HFModel]:
        """One model per entry of ``devices`` (e.g. one per target server); equal devices share weights."""
        return [self.on(d) for d in devices]

    def _replicate(self, dev: torch.device) -> HFModel:
        if self.source_dir is not None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.source_dir, dtype=self.model.dtype, device_map=str(dev))
        else:
            # the copy must not drag this HFModel along through its hooks (bound methods)
            model = copy.deepcopy(self.model, memo={id(self): self})
            for module in model.modules():
                for key, hook in list(module._forward_pre_hooks.items()):
                    if getattr(hook, "__self__", None) is self:
                        del module._forward_pre_hooks[key]
            model = model.to(dev)
        clone = HFModel(model, self.tokenizer, name=self.name, role=self.role, threads=self.threads,
                        source_dir=self.source_dir, deterministic=self.deterministic, forward_plan=self.forward_plan)
        clone._replicas = self._replicas  # every replica knows all the others
        clone._lock = self._lock
        return clone

    # -- tokenizer helpers ---------------------------------------------------------------------------

    @property
    def deterministic(self) -> bool:
        """Whether each token is computed in a forward of its own (on a CPU on one intra-op thread), so
        that a row depends on the tokens alone, bitwise (:mod:`dsi.models.determinism`); off by default
        here: a verification forward over k + 1 tokens costs far less than k + 1 forwards with transformers."""
        return self._deterministic

    @deterministic.setter
    def deterministic(self, value: bool | None) -> None:
        value = check_deterministic(value, False)
        for model in {id(m): m for m in [self, *getattr(self, "_replicas", {}).values()]}.values():
            model._deterministic = value  # replicas on other devices too; sessions follow at their next forward

    @property
    def forward_plan(self) -> ForwardPlan:
        """How sessions run their forwards: the KV cache (dynamic or static) and CUDA graphs
        (:mod:`dsi.models.hf.forward_plan`). Sessions made after a change follow it; replicas change with this model."""
        return self._plan

    @forward_plan.setter
    def forward_plan(self, plan: ForwardPlan) -> None:
        if not isinstance(plan, ForwardPlan):
            raise ConfigError(f"forward_plan={plan!r} must be a dsi.models.hf.forward_plan.ForwardPlan")
        if plan.static:
            check_full_attention(self.model.config, self.name)
        for model in {id(m): m for m in [self, *getattr(self, "_replicas", {}).values()]}.values():
            model._plan = plan

    @property
    def model_context(self) -> int | None:
        """The model's own maximum number of positions, or None if unknown."""
        config = self.model.config.get_text_config()
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = getattr(config, key, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    @property
    def max_context(self) -> int | None:
        """The most positions (prompt + generated) a session holds: the model's, or its static cache's length."""
        limit = self.model_context
        return self._plan.cache_len(limit) if self._plan.static else limit

    def check_length(self, prompt_len: int, max_new_tokens: int = 0) -> None:
        """Raise :class:`ConfigError` if the prompt plus new tokens exceed the model's context."""
        prompt_len = check_int(prompt_len, "prompt_len", 0)
        max_new_tokens = check_int(max_new_tokens, "max_new_tokens", 0)
        limit = self.max_context
        if limit is not None and prompt_len + max_new_tokens > limit:
            raise ConfigError(
                f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} exceeds the context of "
                f"{self.name} (max_context={limit} tokens); shorten the prompt or lower max_new_tokens"
            )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every token that ends a generation (generation config plus tokenizer), in a stable order."""
        ids: list[int] = []
        gen = getattr(self.model, "generation_config", None)
        raw = getattr(gen, "eos_token_id", None) if gen is not None else None
        for value in [*(raw if isinstance(raw, list | tuple) else [raw]),
                      getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None,
                      self.model.config.get_text_config().eos_token_id]:
            for v in value if isinstance(value, list | tuple) else [value]:
                if isinstance(v, int) and 0 <= v < self.vocab_size and v not in ids:
                    ids.append(v)
        return tuple(ids)

    @property
    def eos_token_id(self) -> int | None:
        ids = self.eos_token_ids
        return ids[0] if ids else None

    def _need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ConfigError(f"{self.name} has no tokenizer; pass token ids instead of text")
        return self.tokenizer

    def encode(self, text: str, *, chat: bool = False, system: str | None = None) -> list[int]:
        """Token ids of ``text``; with ``chat``, of the chat template applied to one user message."""
        return encode_prompt(self._need_tokenizer(), self.name, text, chat=chat, system=system)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of token ``ids``, each checked to be an id of a logit row or of the tokenizer (ids the
        tokenizer does not know, a padded row's, decode to nothing); :class:`ConfigError` otherwise."""
        tokenizer = self._need_tokenizer()
        ids = check_token_ids(ids, max(self.vocab_size, len(tokenizer)), of=self.name)
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # -- cancellation ----------------------------------------------------------------------------------

    def _check_cancel(self, module: nn.Module, args: Any) -> None:
        flag = getattr(self._local, "cancel", None)
        if flag is not None and flag.is_set():
            raise TaskCancelled("forward cancelled between layers")

    def _forward(self, ids: torch.Tensor, cache: Any, cancel: CancelFlag | None, num_rows: int | None = None,
                 greedy: bool = False, pick: list[int] | None = None, **extra: Any) -> torch.Tensor | None:
        """One forward of ``ids`` ([1, n]) after ``cache``.

        Returns the last ``num_rows`` logit rows as float32 on the CPU ([num_rows, V]), or with
        ``greedy`` their argmax ids (int64, [num_rows]), taken on the model's device so that only
        the ids cross to the host; ``num_rows=0`` returns None (the cache is all that is wanted).
        ``pick``: the rows to return instead, by index, in that order. The output layer runs only for the rows
        asked for where the model supports it (``logits_to_keep``). This is the forward's one host-device
        synchronisation.
        """
        n = ids.shape[1]
        rows = n if num_rows is None else num_rows
        if pick is not None:
            index = torch.tensor(pick, dtype=torch.long, device=ids.device)
            if self._keep_kwarg is not None:
                extra[self._keep_kwarg] = index
            logits = self._run_model(ids, cache, cancel, **extra).logits[0]
            return self._host_rows(logits if self._keep_kwarg is not None else logits[index], greedy)
        if self._keep_kwarg is not None and rows < n:
            extra[self._keep_kwarg] = max(rows, 1)  # 0 would mean "every row"
        out = self._run_model(ids, cache, cancel, **extra)
        if rows == 0:
            return None
        return self._host_rows(out.logits[0, -rows:], greedy)  # [rows, V]

    def _run_model(self, ids: torch.Tensor, cache: Any, cancel: CancelFlag | None, **kwargs: Any) -> Any:
        """The model's forward of ``ids`` ([1, n]) after ``cache``, with the cancel hooks armed."""
        with self._intra_op_threads():
            self._local.cancel = cancel
            try:
                return self.model(input_ids=ids, use_cache=True, **{self._cache_kwarg: cache}, **kwargs)
            finally:
                self._local.cancel = None

    @property
    def decides_on_device(self) -> bool:
        """Whether rows are read on this model's device: sampled chain verifications, processed greedy rows and
        draws (the target's and a drafter's) are decided there (``forward_plan``'s
        ``device_decisions``; by default on a GPU outside the deterministic mode, whose laws are the host's so
        that every window, chain or tree, reads the same bits)."""
        chosen = self.forward_plan.device_decisions
        return self.device.type == "cuda" and not self.deterministic if chosen is None else chosen

    def _host_rows(self, logits: torch.Tensor, greedy: bool | str) -> torch.Tensor:
        """Logit rows ``[rows, V]`` on the device as the host gets them: float32 on the CPU, or with ``greedy``
        their argmax ids (int64 ``[rows]``, taken on the device so that only the ids cross); with
        ``greedy=ON_DEVICE`` the rows as they are, on the device (a reader decides there)."""
        if greedy == ON_DEVICE:
            return logits
        if greedy:  # argmax of bf16 = argmax of its float32 copy; a row with NaN (no order) is marked -1
            return self._checked_ids(greedy_ids(logits).cpu())  # [rows] int64
        return logits.float().cpu()  # [rows, V]

    def _checked_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Greedy ids on the host (:func:`~dsi.models.hf.forward_plan.greedy_ids`), refused where a row had a NaN."""
        bad = ids.numpy() < 0
        if bad.any():
            raise ModelError(f"{self.name} returned NaN logits (rows {np.flatnonzero(bad).tolist()} of the last "
                             f"{len(bad)}); its forward is numerically broken")
        return ids

    @contextlib.contextmanager
    def _intra_op_threads(self) -> Any:
        """The calling thread's torch intra-op threads for one forward.

        Outside the deterministic mode: ``threads`` (kept afterwards, None: torch's setting as it is). In the
        mode on a CPU: one thread, whatever ``threads`` says, and the thread's setting back afterwards. A CPU
        kernel's reduction order may depend on its thread count (MKL's fp32 products, ATen's attention and
        parallel reductions; by up to 1.2e-7 in a tiny fp32 Llama's rows on an AMD EPYC, 1.7e-6 in a 125M
        one's), and the methods of one comparison run with different counts (the auto-tuner gives DSI's
        workers a share of the cores, non-SI all of them): one thread is one fixed order. With torch's OpenMP
        backend the setting belongs to the calling thread, so forwards of other sessions running at the same
        time in other threads keep theirs (tests/integration/test_deterministic_mode.py checks both)."""
        if not (self.deterministic and self.device.type == "cpu"):
            if self.threads is not None and torch.get_num_threads() != self.threads:
                torch.set_num_threads(self.threads)
            yield
            return
        before = torch.get_num_threads()
        if before != 1:
            torch.set_num_threads(1)
        try:
            yield
        finally:
            if before != 1:
                torch.set_num_threads(before)

    @property
    def one_forward_trees(self) -> bool:
        """Whether a draft tree can be verified in one forward with a tree attention mask: the attention is
        eager or sdpa (they take a custom 4D mask as it is) and every layer attends to the whole context (no
        sliding window, whose mask a custom one would replace); not in deterministic mode (its canonical
        cut is one token a forward)."""
        config = self.model.config.get_text_config()
        attention = getattr(config, "_attn_implementation", None)
        return attention in ("eager", "sdpa") and not has_sliding_layers(config) and not self.deterministic

    def close(self) -> None:
        """Remove the cancellation hooks (the model itself is left to the garbage collector)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def __repr__(self) -> str:
        return (f"HFModel(name={self.name!r}, vocab_size={self.vocab_size}, dtype={self.dtype}, "
                f"device={str(self.device)!r}, layers={len(self.layers)})")


def main_first(tree: Any, main: list[int], fresh: int) -> tuple[list[int], list[int]]:
    """A tree's nodes in the order one forward computes them: its main path first (so that the main path's keys
    and values land where a chain's would, right after the prefix, and the side nodes' after them, dropped by
    moving the cache's length), then the other nodes in the tree's order (still parents before children). Also
    which of that forward's rows, after ``fresh`` new prefix tokens, are the root's and each node's in the
    tree's own order."""
    on_main = set(main)
    order = main + [i for i in range(len(tree)) if i not in on_main]
    where = np.empty(len(tree), dtype=np.int64)
    where[order] = np.arange(len(tree))
    return order, [fresh - 1] + (fresh + where).tolist()


class HFSession:
    """One token sequence and its KV cache on one :class:`HFModel`: a ``DynamicCache``, or with the model's
    :attr:`~HFModel.forward_plan` static, a preallocated :func:`~dsi.models.hf.forward_plan.new_positioned_cache` (and
    with CUDA graphs, the session's captured forwards), fixed when the session is made.

    On a GPU each session runs its forwards on a CUDA stream of its own, so that the kernels of
    several sessions (the drafter and target servers as threads of one process) can overlap on the
    device, and waiting for one session's result does not wait for another's queued kernels.
    """

    def __init__(self, owner: HFModel) -> None:
        self._owner = owner
        self._plan = owner.forward_plan
        self._tokens: list[int] = []
        self._stream = None
        if owner.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=owner.device)
            self._stream.wait_stream(torch.cuda.current_stream(owner.device))  # the weights are ready
        self._graphs: GraphSet | None = None
        self._dtype = owner.model.dtype
        context = owner.model_context  # the session's limit, read once (a config's attributes are slow to read)
        self._limit = self._plan.cache_len(context) if self._plan.static else context
        self._cache = self._new_cache()

    def _new_cache(self) -> Any:
        owner = self._owner
        if self._plan.static:  # its buffers are allocated at the first forward
            cache = new_positioned_cache(owner.model.config, self._limit, owner.device)
            self._graphs = GraphSet(owner, self._graph_body, self._stream) if self._plan.cuda_graphs else None
            return cache
        from transformers import DynamicCache

        return DynamicCache(config=owner.model.config)

    def _on_stream(self) -> Any:
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    @property
    def one_forward_trees(self) -> bool:
        """Whether :meth:`tree_rows` computes a tree in one forward (:attr:`HFModel.one_forward_trees`)."""
        return self._owner.one_forward_trees

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    @property
    def model(self) -> HFModel:
        return self._owner

    def extend(self, tokens: Sequence[int], cancel: CancelFlag | None = None) -> np.ndarray:
        tokens = check_token_ids(tokens, self._owner.vocab_size, "tokens", self._owner.name)
        return self.extend_rows(tokens, cancel, len(tokens), False)

    reads_rows = True  # a reader of a sampled chain is run where the rows are (models/hf/device_laws.py)

    def extend_rows(self, tokens: Sequence[int], cancel: CancelFlag | None, num_rows: int, greedy: bool,
                    read: Any = None) -> Any:
        """The session interface's fast path (:func:`dsi.models.base.extend_rows`); ``read`` of the rows, which a
        sampled chain's reader (:class:`~dsi.sampling.ChainRead`), a processed greedy one
        (:class:`~dsi.sampling.GreedyRead`), non-SI's draw (:class:`~dsi.sampling.BonusRead`), a drafter's
        (:class:`~dsi.sampling.DraftRead`) or any of the first three with log-probabilities
        (:class:`~dsi.logprobs.LogprobsRead`) does on the model's device where the model decides there
        (:attr:`HFModel.decides_on_device`)."""
        decide = DEVICE_READERS.get(type(read))
        if decide is not None and not greedy and read.on_device and self._owner.decides_on_device:
            rows = self._extend(tokens, cancel, num_rows, ON_DEVICE)
            with torch.inference_mode(), self._on_stream():
                return decide(rows, read)
        rows = self._extend(tokens, cancel, num_rows, greedy)
        return rows if read is None else read(rows)

    def _extend(self, tokens: Sequence[int], cancel: CancelFlag | None, num_rows: int, greedy: bool | str) -> Any:
        """The last ``num_rows`` rows of a forward of ``tokens`` as :meth:`HFModel._host_rows` gives them."""
        owner = self._owner
        vocab = owner.vocab_size
        new = check_token_ids(tokens, vocab, "tokens", owner.name)
        if not new:
            return np.empty((0,) if greedy else (0, vocab), dtype=np.int64 if greedy else np.float32)
        num_rows = check_int(num_rows, "num_rows", 1, len(new))
        limit = self._limit
        if limit is not None and len(self._tokens) + len(new) > limit:
            raise ContextLengthError(
                f"{len(self._tokens) + len(new)} tokens exceed max_context={limit} of {owner.name}")
        if cancel is not None and cancel.is_set():
            raise TaskCancelled("forward cancelled before it started")
        before = len(self._tokens)
        with torch.inference_mode(), self._on_stream():
            if self._plan.static:
                def forward(a: int, b: int, rows: int) -> torch.Tensor | None:  # new[a:b], its last ``rows`` rows
                    return self._static_forward(new[a:b], before + a, cancel, rows, greedy)
            else:
                ids = torch.tensor([new], dtype=torch.long, device=owner.device)  # [1, n]

                def forward(a: int, b: int, rows: int) -> torch.Tensor | None:
                    return owner._forward(ids[:, a:b], self._cache, cancel, rows, greedy)
            try:
                if owner.deterministic:  # the canonical cut: one token a forward, rows only where read
                    first = len(new) - num_rows
                    rows = [forward(i, i + 1, int(i >= first)) for i in range(len(new))]
                    out = torch.cat([r for r in rows if r is not None])  # [num_rows(, V)]
                else:
                    out = forward(0, len(new), num_rows)  # [num_rows(, V)]
            except BaseException:
                self._restore(before)
                raise
        self._tokens.extend(new)
        return out if greedy == ON_DEVICE else out.numpy()

    def tree_rows(self, prefix: Sequence[int], tree: Any, cancel: CancelFlag | None = None, *, greedy: bool = False,
                  top: int | None = None) -> np.ndarray:
        """A draft tree's rows (:func:`dsi.models.base.tree_rows`) in **one forward**: the prefix's new tokens
        and every node in one batch, each node at the position of its depth and attending to the prefix and
        its own ancestors (a 4D attention mask, position ids by depth); then the cache keeps the prefix and
        the main path only, as if they alone had been run. The batch holds the main path first
        (:func:`main_first`), so the cache keeps it by its length alone: no keys or values move. Falls back to
        one extension per path where the model cannot take such a mask (:attr:`HFModel.one_forward_trees`)."""
        owner = self._owner
        prefix = check_token_ids(prefix, owner.vocab_size, "prefix", owner.name)
        if not prefix:
            raise ConfigError("a tree is verified after a prefix of at least one token")
        nodes = check_token_ids(tree.tokens, owner.vocab_size, "tree.tokens", owner.name)
        if not owner.one_forward_trees or len(tree) == 0:
            return path_tree_rows(self, prefix, tree, cancel, greedy=greedy, top=top)
        keep = min(common_prefix_length(self._tokens, prefix), len(prefix) - 1)  # the root row is computed
        fresh = prefix[keep:]
        new = fresh + nodes
        depth = max(tree.depth(i) for i in range(len(tree)))
        if self._limit is not None and len(prefix) + depth > self._limit:
            raise ContextLengthError(f"{len(prefix) + depth} tokens exceed max_context={self._limit} of "
                                     f"{owner.name}")
        if cancel is not None and cancel.is_set():
            raise TaskCancelled("forward cancelled before it started")
        self.truncate(keep)  # checked: only now is the session changed
        q, n = len(new), len(tree)
        main = tree.main_path()
        order, pick = main_first(tree, main, len(fresh))
        new = fresh + [nodes[j] for j in order]  # the main path first: it lands where a chain's tokens would
        allowed = np.zeros((q, keep + q), dtype=bool)  # [q, kv]: query i may attend to key j (in ``new``'s order)
        allowed[:, :keep] = True
        allowed[: len(fresh), keep: keep + len(fresh)] = np.tril(np.ones((len(fresh), len(fresh)), dtype=bool))
        allowed[len(fresh):, keep: keep + len(fresh)] = True  # every node sees the whole prefix
        allowed[len(fresh):, keep + len(fresh):] = tree.attention_mask()[np.ix_(order, order)]  # its ancestors
        positions = list(range(keep, len(prefix))) + tree.positions(len(prefix))[order].tolist()
        kept = len(prefix) + len(main)  # the prefix and the main path: what the cache keeps, where they are
        if self._plan.static:
            with torch.inference_mode(), self._on_stream():
                try:
                    out = self._static_forward(new, keep, cancel, 1 + n, greedy, positions=positions,
                                               allowed=allowed, pick=pick)
                except BaseException:
                    self._restore(keep)
                    raise
            self._tokens = prefix + [int(tree.tokens[i]) for i in main]
            self._restore(kept)  # the side nodes come after the main path: the length moves
            return out.numpy()
        with torch.inference_mode(), self._on_stream():
            mask = additive_mask(torch.from_numpy(allowed).to(owner.device), self._dtype)  # [1, 1, q, keep + q]
            ids = torch.tensor([new], dtype=torch.long, device=owner.device)  # [1, q]
            try:
                out = owner._forward(ids, self._cache, cancel, 1 + n, greedy, pick=pick, attention_mask=mask,
                                     position_ids=torch.tensor([positions], dtype=torch.long, device=owner.device))
            except BaseException:
                self._restore(keep)
                raise
            self._tokens = prefix + [int(tree.tokens[i]) for i in main]
            self._restore(kept)  # the side nodes come after the main path: a crop
        return out.numpy()

    def truncate(self, length: int) -> None:
        length = check_int(length, "truncate length", 0, len(self._tokens))
        if length == len(self._tokens):
            return
        if self._plan.static:  # a static cache only moves its length: no torch call
            self._restore(length)
        else:
            with torch.inference_mode(), self._on_stream():
                self._restore(length)
        del self._tokens[length:]

    def _restore(self, length: int) -> None:
        """Crop every cache layer to ``length`` tokens (layers may be at different lengths); a static cache only
        moves its length."""
        if self._plan.static:
            self._cache.length = length
            return
        if length == 0:
            self._cache = self._new_cache()
            return
        try:
            for layer in self._cache.layers:
                have = layer.get_seq_length()
                if have > length:
                    layer.crop(-(have - length))
            ok = all(layer.get_seq_length() == length for layer in self._cache.layers)
        except (RuntimeError, ValueError) as exc:  # e.g. a sliding-window layer past its window
            logger.debug("cache crop failed (%s); recomputing the prefix", exc)
            ok = False
        if not ok:
            self._rebuild(length)

    def _rebuild(self, length: int) -> None:
        """Recompute the cache of the first ``length`` tokens from scratch (fallback of crop)."""
        self._cache = self._new_cache()
        with torch.inference_mode(), self._on_stream():
            ids = torch.tensor([self._tokens[:length]], dtype=torch.long, device=self._owner.device)
            step = 1 if self._owner.deterministic else max(length, 1)  # as the tokens were computed
            for i in range(0, length, step):
                self._owner._forward(ids[:, i: i + step], self._cache, None, num_rows=0)

    def close(self) -> None:
        self._tokens = []
        self._cache = self._new_cache()  # an empty cache holds no memory (nor graphs); the session stays usable

    # -- the static cache (dsi.models.hf.forward_plan) -------------------------------------------------------

    def _static_forward(self, new: list[int], start: int, cancel: CancelFlag | None, num_rows: int, greedy: bool,
                        positions: list[int] | None = None, allowed: np.ndarray | None = None,
                        pick: list[int] | None = None) -> torch.Tensor | None:
        """One forward of ``new`` written at cache positions ``start ..`` (padded to a graph's size where graphs
        are on), each query seeing ``allowed`` (a tree's ``[n, start + n]`` mask) or the causal context, at
        ``positions`` (default: its cache position); the last ``num_rows`` real rows as :meth:`HFModel._host_rows`
        gives them (None for 0), and the cache's length ``start + n`` after it. Its inputs are made on the host
        and cross in one copy (:class:`~dsi.models.hf.forward_plan.ForwardInputs`)."""
        owner, cache, graphs = self._owner, self._cache, self._graphs
        n = len(new)
        if start + n > cache.max_len:
            raise ContextLengthError(f"{start + n} tokens exceed the static cache of {cache.max_len} positions of "
                                     f"{owner.name} (kv_cache_len)")
        size = padded_size(n, graphs is not None)
        if start + size > cache.max_len:
            size = n  # no room for the padding at the end of the cache: this forward as it is
        span = attended(start + size, cache.max_len, graphs is not None)  # what attention reads
        graphed = graphs is not None and not graphs.disabled and size <= GRAPH_MAX_TOKENS
        inputs = graphs.inputs(size, span) if graphed else ForwardInputs(size, span, owner.device)
        inputs.fill(new, start, positions, allowed)
        if cancel is not None and cancel.is_set():
            raise TaskCancelled("forward cancelled before it started")
        inputs.send()
        replayed = graphs.run(inputs) if graphed else None  # None: eager (a capture failed: said once)
        picked = list(range(n - num_rows, n)) if pick is None else pick  # the real tokens' rows read, in order
        if replayed is None:
            keep = self._keep(n, size, num_rows, picked, pick is None)  # the output layer on those rows only
            logits, ids = self._run_static(inputs, cancel, **keep), None
        else:
            keep, (logits, ids) = {}, replayed
        cache.length = start + n
        if num_rows == 0:
            return None
        if replayed is not None and greedy and greedy != ON_DEVICE:  # the graph's argmax: only the ids cross
            if pick is None:  # (copies: the graph's buffers are its next replay's)
                return owner._checked_ids(ids[n - num_rows: n].to("cpu", copy=True))
            return owner._checked_ids(ids[:n].cpu()[picked])
        if keep:  # the output layer ran on the picked rows, in order (an int: the last ones, unpadded)
            rows = logits[0, -num_rows:]
        elif pick is None:
            rows = logits[0, n - num_rows: n]  # [num_rows, V]
        else:
            rows = logits[0].index_select(0, torch.tensor(picked, dtype=torch.long, device=owner.device))
        if replayed is None or greedy == ON_DEVICE:
            return owner._host_rows(rows, greedy)
        return rows.to("cpu", torch.float32, copy=True)  # a copy: the graph's buffer is its next replay's

    def _keep(self, n: int, size: int, num_rows: int, picked: list[int], tail: bool) -> dict:
        """The model's ``logits_to_keep`` argument for a forward of ``size`` tokens (``n`` real) whose rows
        ``picked`` are read (``tail``: the last ``num_rows``): none where every row is read or the model takes
        none, the count where the rows are the unpadded tail, else their indices, in order."""
        name = self._owner._keep_kwarg
        if name is None or (tail and num_rows >= size):
            return {}
        if tail and size == n:
            return {name: max(num_rows, 1)}  # 0 would mean "every row"
        return {name: torch.tensor(picked or [n - 1], dtype=torch.long, device=self._owner.device)}

    def _run_static(self, inputs: ForwardInputs, cancel: CancelFlag | None, **keep: Any) -> torch.Tensor:
        """The model's forward on the static cache of ``inputs`` (on the device), its logits ``[1, rows, V]``."""
        cache = self._cache
        cache.write_at, cache.attend = inputs.write_at, inputs.span
        mask = additive_mask(inputs.visible, self._dtype)
        return self._owner._run_model(inputs.ids, cache, cancel, attention_mask=mask, position_ids=inputs.positions,
                                      **keep).logits

    def _graph_body(self, inputs: ForwardInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """What a captured graph runs: the forward on ``inputs`` and its rows' greedy ids."""
        logits = self._run_static(inputs, None)
        return logits, greedy_ids(logits[0])
