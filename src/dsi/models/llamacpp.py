"""The llama.cpp backend: a ``.gguf`` file as a :class:`~dsi.models.base.LanguageModel`, no conversion.

One :class:`LlamaCppModel` loads the GGUF's weights once (a ``llama_model``); each session is a
``llama_context`` of its own on those weights (its own KV cache and thread pool), so the drafter
and every target server of the thread transport share one copy of the weights. The binding is
``llama-cpp-python``'s low-level module (``llama_cpp.llama_cpp``, ctypes over ``llama.h``; see
docs/models.md for why), imported only here, only when a model is built.

What a session does with llama.cpp:

- ``extend_rows``: one ``llama_decode`` per batch of at most ``n_batch`` tokens, asking for
  logits only on the rows the caller reads (the per-token ``logits`` flags of the batch); with
  ``greedy``, only their argmax leaves this module;
- ``truncate``: ``llama_memory_seq_rm`` drops the KV cells past the prefix;
- cancellation: llama.cpp's abort callback reads the running task's cancel flag between graph
  nodes, so a preempted forward stops mid-forward (``llama_decode`` returns 2); the session then
  removes what the aborted batch wrote and is exactly as before the call;
- ``threads``: llama.cpp threads per session (``llama_set_n_threads``), settable at any time;
- ``deterministic`` (settable at any time): every token is fed in a ``llama_decode`` of its own, with
  flash attention off, so a row's logits and every KV cell are a function of the tokens alone,
  bitwise, whatever batches the caller asks for, whatever the session computed before and however many
  threads compute it (see :mod:`dsi.models.determinism`). Flash attention is a context setting, so a
  session whose model switched mode rebuilds its context at its next forward, recomputing the tokens it
  held.

Text: the vocabulary, special tokens and chat template come from the GGUF
(:class:`GGUFTokenizer`, with the Hugging Face tokenizer methods the rest of dsi uses). The chat
template is rendered with Jinja2 as transformers renders it, so a chat prompt has the same tokens
on both backends.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dsi.errors import ConfigError, ContextLengthError, ModelError, TaskCancelled
from dsi.models.base import (
    CancelFlag,
    check_int,
    check_text,
    check_token_ids,
    common_prefix_length,
    encode_prompt,
    path_tree_rows,
)
from dsi.models.determinism import check_deterministic

log = logging.getLogger(__name__)

DEFAULT_N_CTX = 4096  # KV cells per session when the caller does not say (the GGUF's own may be 32k+)
N_BATCH = 512  # tokens per llama_decode call
# the deterministic mode (one token per llama_decode) is off unless asked for: it costs non-SI 4-16%, but
# SI 38-99% and DSI 51-88% on the embedded pair here, whose verification forwards it cuts into single
# tokens (docs/results.md#what-the-mode-costs)
DETERMINISTIC_DEFAULT = False
_ABORTED = 2  # llama_decode's return code after the abort callback said stop
MAX_TREE_PATHS = 16  # root-to-leaf paths of a draft tree verified in one forward (more: one forward per path)

_init_lock = threading.Lock()
_initialised = False
_log_callback: Any = None  # keeps the ctypes callback alive


def binding() -> Any:
    """The low-level llama.cpp module (``llama_cpp.llama_cpp``), initialised once."""
    global _initialised, _log_callback
    try:
        from llama_cpp import llama_cpp as ll
    except ImportError as exc:
        raise ModelError(
            f"the llama.cpp backend needs llama-cpp-python: pip install 'dsi[llama]' ({exc}); "
            "or use backend='hf'"
        ) from exc
    with _init_lock:
        if not _initialised:
            ll.llama_backend_init()

            @ll.llama_log_callback
            def quiet(level: int, text: bytes, user_data: Any) -> None:
                if level >= 4 and text:  # GGML_LOG_LEVEL_ERROR only; the rest is load chatter
                    log.debug("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())

            _log_callback = quiet
            if not os.environ.get("DSI_LLAMA_VERBOSE"):
                ll.llama_log_set(_log_callback, ctypes.c_void_p())
            _initialised = True
    return ll


def extra_buffers_safe(system_info: str, environ: Any = os.environ) -> bool:
    """Whether weights may go to llama.cpp's extra buffer types (``use_extra_bufts``: the CPU repacking,
    and AMX where the build has it), from the build's ``llama_print_system_info()``.

    Not in a build with ggml's AMX kernels (``AMX_INT8 = 1``) unless ``DSI_LLAMA_AMX=1``: they repack
    Q4_K / Q6_K / Q8_0 weights into AMX buffers and then segfault in ``ggml_backend_amx_mul_mat`` on the
    first forward of the embedded Q4_K_M pair (an Intel Sapphire Rapids machine, 2026-12-02; upstream:
    ggml-org/llama.cpp issue 20824). Without extra buffers such a build computes on the plain CPU kernels
    (slower, but a crash is worse); ``packaging/llama-cpp-minimal.cmake`` compiles llama-cpp-python
    without the AMX kernels, which keeps the repacking (docs/models.md)."""
    amx = "AMX_INT8 = 1" in system_info
    return not amx or environ.get("DSI_LLAMA_AMX") == "1"


_amx_warned = False


def _model_params(ll: Any) -> Any:
    global _amx_warned
    params = ll.llama_model_default_params()
    params.n_gpu_layers = 0
    info = ll.llama_print_system_info().decode("utf-8", "replace")
    if not extra_buffers_safe(info):
        params.use_extra_bufts = False
        if not _amx_warned:
            _amx_warned = True
            log.warning("this llama-cpp-python was built with ggml's AMX kernels, which crash on the embedded "
                        "models: running without extra buffer types (no weight repacking, slower). Rebuild it "
                        "with packaging/llama-cpp-minimal.cmake (docs/models.md), or set DSI_LLAMA_AMX=1 to "
                        "use AMX anyway")
    return params


def _check_threads(threads: object) -> None:
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise ConfigError(f"threads={threads!r} must be an integer >= 1 (or None for llama.cpp's default)")


class LlamaCppModel:
    """A GGUF model run by llama.cpp on the CPU.

    ``n_ctx``: KV cells of each session, the most tokens it may hold (default: the GGUF's training
    context, at most :data:`DEFAULT_N_CTX`: a 32k-token cache costs about 1 GB per session for a
    1.5B model). ``threads``: llama.cpp threads per session (None: llama.cpp's default).
    """

    def __init__(self, gguf_path: str | os.PathLike[str], *, n_ctx: int | None = None, threads: int | None = None,
                 name: str | None = None, role: str | None = None, deterministic: bool | None = None) -> None:
        path = Path(gguf_path).expanduser()
        if not path.is_file():
            raise ConfigError(f"gguf_path={str(path)!r} is not a file; the llama.cpp backend reads a .gguf file")
        if n_ctx is not None and (not isinstance(n_ctx, int) or isinstance(n_ctx, bool) or n_ctx < 1):
            raise ConfigError(f"n_ctx={n_ctx!r} must be an integer >= 1 (or None for the model's, at most "
                              f"{DEFAULT_N_CTX})")
        _check_threads(threads)
        self.deterministic = deterministic  # checked by the setter
        ll = binding()
        self._ll = ll
        params = _model_params(ll)
        model = ll.llama_model_load_from_file(os.fsencode(path), params)
        if not model:
            raise ModelError(f"llama.cpp could not load {str(path)!r} (not a GGUF model it supports?); set "
                             "DSI_LLAMA_VERBOSE=1 to see its log")
        self._model = model
        self._vocab = ll.llama_model_get_vocab(model)
        self._n_vocab = int(ll.llama_vocab_n_tokens(self._vocab))
        self.context_trained = int(ll.llama_model_n_ctx_train(model))
        self.n_ctx = n_ctx if n_ctx is not None else min(self.context_trained or DEFAULT_N_CTX, DEFAULT_N_CTX)
        self.source_path = path
        self.name = name or path.stem
        self.role = role
        self._threads = threads
        self._lock = threading.Lock()
        self._sessions: set[LlamaCppSession] = set()
        self._closed = False
        self.tokenizer = GGUFTokenizer(self)

    @classmethod
    def load(cls, gguf_path: str | os.PathLike[str], **kwargs: Any) -> LlamaCppModel:
        return cls(gguf_path, **kwargs)

    # -- the LanguageModel interface -------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._n_vocab

    @property
    def max_context(self) -> int:
        """The most tokens a session holds (its KV cells, ``n_ctx``)."""
        return self.n_ctx

    @property
    def threads(self) -> int | None:
        return self._threads

    @threads.setter
    def threads(self, value: int | None) -> None:
        _check_threads(value)
        self._threads = value  # sessions pick it up at their next forward

    @property
    def deterministic(self) -> bool:
        """Whether each token is computed in a forward of its own (a row then depends on the tokens
        alone, bitwise); None at construction means the backend's default, :data:`DETERMINISTIC_DEFAULT`."""
        return self._deterministic

    @deterministic.setter
    def deterministic(self, value: bool | None) -> None:
        self._deterministic = check_deterministic(value, DETERMINISTIC_DEFAULT)  # picked up at the next forward

    def new_session(self) -> LlamaCppSession:
        with self._lock:
            if self._closed:
                raise ModelError(f"{self.name} was closed")
            session = LlamaCppSession(self)
            self._sessions.add(session)
            return session

    def _forget(self, session: LlamaCppSession) -> None:
        with self._lock:
            self._sessions.discard(session)

    def close(self) -> None:
        """Free the weights (and any session still open)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sessions = list(self._sessions)
        for session in sessions:
            session.close()
        self._ll.llama_model_free(self._model)

    # -- text --------------------------------------------------------------------------------------

    def check_length(self, prompt_len: int, max_new_tokens: int = 0) -> None:
        """Raise :class:`ConfigError` if the prompt plus new tokens exceed a session's context."""
        prompt_len = check_int(prompt_len, "prompt_len", 0)
        max_new_tokens = check_int(max_new_tokens, "max_new_tokens", 0)
        if prompt_len + max_new_tokens > self.n_ctx:
            raise ConfigError(
                f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} exceeds the context of "
                f"{self.name} (n_ctx={self.n_ctx} tokens); shorten the prompt, lower max_new_tokens, or "
                f"load it with a larger n_ctx (--max-model-len; trained: {self.context_trained})"
            )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every end-of-generation token of the vocabulary (EOS, EOT, ...): EOS first."""
        return self.tokenizer.eog_ids

    @property
    def eos_token_id(self) -> int | None:
        ids = self.eos_token_ids
        return ids[0] if ids else None

    def encode(self, text: str, *, chat: bool = False, system: str | None = None) -> list[int]:
        """Token ids of ``text``; with ``chat``, of the chat template applied to one user message."""
        return encode_prompt(self.tokenizer, self.name, text, chat=chat, system=system)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of token ``ids`` (each checked to be in ``[0, vocab_size)``: :class:`ConfigError` otherwise)."""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"LlamaCppModel({self.name!r}, vocab_size={self._n_vocab}, n_ctx={self.n_ctx}, threads={self._threads})"


class LlamaCppSession:
    """One token sequence in a ``llama_context`` of its own (the ModelSession protocol)."""

    def __init__(self, owner: LlamaCppModel) -> None:
        ll = owner._ll
        self._ll = ll
        self._owner = owner
        self._n_batch = min(N_BATCH, owner.n_ctx)
        self._tokens: list[int] = []
        self._cancel: CancelFlag | None = None
        self._abort = ll.ggml_abort_callback(self._should_abort)  # kept alive with the session
        self._open_context()
        self._batch = ll.llama_batch_init(self._n_batch, 0, 1 + MAX_TREE_PATHS)  # a token may be in every sequence
        self._closed = False

    def _open_context(self) -> None:
        """A ``llama_context`` for the owner's current threads and mode (an empty cache).

        In deterministic mode flash attention is off: llama.cpp's CPU flash attention splits the KV of a
        one-token forward across the threads once the cache view reaches 512 cells (past 256 tokens) and
        merges the parts, so the row would depend on the thread count (measured:
        docs/results.md#past-256-tokens-flash-attention-and-the-thread-count). Without flash attention every
        reduction runs whole in one thread. Off it costs a prompt read
        at once 3-5% on the embedded pair here, a one-token forward nothing measurable."""
        ll, owner = self._ll, self._owner
        params = ll.llama_context_default_params()
        params.n_ctx = owner.n_ctx
        params.n_batch = params.n_ubatch = self._n_batch
        # sequence 0 is the session's text; 1.. are a draft tree's paths during one tree forward (tree_rows):
        # one unified KV cache, so a cell may belong to several sequences (a prefix shared by every path)
        params.n_seq_max = 1 + MAX_TREE_PATHS
        params.kv_unified = True
        # llama.cpp's own default is a fixed 4 threads; None here means every core, as for torch
        params.n_threads = params.n_threads_batch = owner.threads or os.cpu_count() or 1
        canonical = owner.deterministic
        if canonical:
            params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.no_perf = True
        ctx = ll.llama_init_from_model(owner._model, params)
        if not ctx:
            raise ModelError(f"llama.cpp could not make a context of {owner.n_ctx} tokens for {owner.name} "
                             "(out of memory? lower n_ctx)")
        self._ctx = ctx
        self._canonical = canonical
        self._memory = ll.llama_get_memory(ctx)
        self._threads = owner.threads
        ll.llama_set_abort_callback(ctx, self._abort, ctypes.c_void_p())

    def _follow_mode(self) -> None:
        """Before a forward: if the owner switched the deterministic mode since this session's context was
        made, make a new context for it and recompute the tokens held (in the new mode's cut)."""
        if self._canonical == self._owner.deterministic:
            return
        held, old = list(self._tokens), self._ctx
        self._open_context()  # the old context stays the session's if this fails
        self._ll.llama_free(old)
        self._tokens = []
        if held:
            self.extend_rows(held, None, 1, greedy=True)

    def _should_abort(self, _data: Any) -> bool:
        flag = self._cancel
        try:
            return bool(flag is not None and flag.is_set())
        except BaseException:  # noqa: BLE001 - never let an exception cross into C: stop the forward
            return True

    @property
    def one_forward_trees(self) -> bool:
        """Whether :meth:`tree_rows` computes a tree in one ``llama_decode`` (not in deterministic mode)."""
        return not self._owner.deterministic

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    @property
    def model(self) -> LlamaCppModel:
        return self._owner

    def extend(self, tokens: Sequence[int], cancel: CancelFlag | None = None) -> np.ndarray:
        tokens = check_token_ids(tokens, self._owner.vocab_size, "tokens", self._owner.name)
        return self.extend_rows(tokens, cancel, len(tokens), greedy=False)

    def extend_rows(self, tokens: Sequence[int], cancel: CancelFlag | None, num_rows: int, greedy: bool) -> np.ndarray:
        """Process ``tokens``; the last ``num_rows`` logit rows ``[num_rows, V]`` (float32), or with
        ``greedy`` their argmax ids ``[num_rows]`` (int64). Only those rows are computed."""
        vocab = self._owner.vocab_size
        new = check_token_ids(tokens, vocab, "tokens", self._owner.name)  # llama.cpp aborts on a bad id
        if not new:
            raise ConfigError(f"tokens=[] of {self._owner.name}: a forward needs at least one token")
        num_rows = check_int(num_rows, "num_rows", 1, len(new))
        if len(self._tokens) + len(new) > self._owner.n_ctx:
            raise ContextLengthError(f"{len(self._tokens) + len(new)} tokens exceed n_ctx={self._owner.n_ctx} "
                                     f"of {self._owner.name}")
        self._follow_mode()
        if self._owner.threads != self._threads:
            self._threads = self._owner.threads
            n = self._threads or os.cpu_count() or 1
            self._ll.llama_set_n_threads(self._ctx, n, n)
        start = len(self._tokens)
        first_row = len(new) - num_rows
        out = np.empty(num_rows, np.int64) if greedy else np.empty((num_rows, vocab), np.float32)
        self._cancel = cancel
        step = 1 if self._canonical else self._n_batch  # one token a forward: the canonical cut
        try:
            for offset in range(0, len(new), step):
                if cancel is not None and cancel.is_set():
                    raise TaskCancelled("forward cancelled")
                chunk = new[offset: offset + step]
                self._decode(chunk, start + offset, first_row - offset)
                for i in range(max(0, first_row - offset), len(chunk)):
                    self._read_row(i, out, offset + i - first_row, greedy)
                self._tokens.extend(chunk)
        except BaseException:
            self._remove_from(start)  # exactly as before the call
            raise
        finally:
            self._cancel = None
        return out

    def _read_row(self, i: int, out: np.ndarray, r: int, greedy: bool) -> None:
        """Row ``i`` of the last decode into ``out[r]``: the logits, or with ``greedy`` their argmax."""
        row = np.ctypeslib.as_array(self._ll.llama_get_logits_ith(self._ctx, i), shape=(self._owner.vocab_size,))
        if not greedy:
            out[r] = row
        elif np.isnan(row).any():
            raise ModelError(f"{self._owner.name} returned NaN logits")
        else:
            out[r] = int(np.argmax(row))

    def _decode(self, chunk: list[int], position: int, first_row: int) -> None:
        batch = self._batch
        batch.n_tokens = len(chunk)
        for i, token in enumerate(chunk):
            batch.token[i] = token
            batch.pos[i] = position + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i >= first_row
        code = self._ll.llama_decode(self._ctx, batch)
        if code == _ABORTED:
            raise TaskCancelled("forward cancelled")
        if code != 0:
            raise ModelError(f"llama_decode failed with code {code} on {self._owner.name} "
                             f"({len(chunk)} tokens at position {position})")

    def tree_rows(self, prefix: Sequence[int], tree: Any, cancel: CancelFlag | None = None, *, greedy: bool = False,
                  top: int | None = None) -> np.ndarray:
        """A draft tree's rows (:func:`dsi.models.base.tree_rows`) in **one** ``llama_decode``: sequence 0 is
        the session's text (the prefix, then the main path), and each root-to-leaf path is a sequence of its
        own (1..P) that shares the prefix's cells (``llama_memory_seq_cp``) and holds its own nodes, each
        node in every path through it, at the position of its depth; llama.cpp's mask lets a token see
        only cells of its own sequences at earlier positions, so a node attends to the prefix and its
        ancestors. Afterwards sequences 1..P are removed: the cache keeps the prefix and the main path.
        Falls back to one extension per path in deterministic mode (one token a forward), for a tree of
        more than :data:`MAX_TREE_PATHS` paths, or one larger than a batch."""
        vocab = self._owner.vocab_size
        prefix = check_token_ids(prefix, vocab, "prefix", self._owner.name)  # llama.cpp aborts on a bad id
        if not prefix:
            raise ConfigError("a tree is verified after a prefix of at least one token")
        check_token_ids(tree.tokens, vocab, "tree.tokens", self._owner.name)
        paths = tree.paths()
        self._follow_mode()
        keep = min(common_prefix_length(self._tokens, prefix), len(prefix) - 1)
        fresh = prefix[keep:]
        if (self._canonical or not paths or len(paths) > MAX_TREE_PATHS
                or len(fresh) + len(tree) > self._n_batch):
            return path_tree_rows(self, prefix, tree, cancel, greedy=greedy, top=top)
        depth = max(len(path) for path in paths)
        if len(prefix) + depth > self._owner.n_ctx or keep + len(fresh) + len(tree) > self._owner.n_ctx:
            raise ContextLengthError(f"a tree of {len(tree)} nodes after {len(prefix)} tokens exceeds "
                                     f"n_ctx={self._owner.n_ctx} of {self._owner.name}")
        self.truncate(keep)
        main = set(tree.main_path())
        seqs: list[list[int]] = [[] for _ in range(len(tree))]  # the sequences each node belongs to
        for p, path in enumerate(paths, 1):
            for node in path:
                seqs[node].append(p)
        ll, batch = self._ll, self._batch
        for p in range(1, len(paths) + 1):  # every path sees the kept prefix
            ll.llama_memory_seq_cp(self._memory, 0, p, -1, -1)
        every = list(range(len(paths) + 1))
        entries = [(t, keep + i, every) for i, t in enumerate(fresh)]  # the prefix's rest is in every sequence
        entries += [(int(tree.tokens[i]), len(prefix) - 1 + tree.depth(i), ([0] if i in main else []) + seqs[i])
                    for i in range(len(tree))]
        batch.n_tokens = len(entries)
        for i, (token, position, ids) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = len(ids)
            for j, seq in enumerate(ids):
                batch.seq_id[i][j] = seq
            batch.logits[i] = i >= len(fresh) - 1  # the root row (after the prefix) and every node
        self._cancel = cancel
        try:
            if cancel is not None and cancel.is_set():
                raise TaskCancelled("forward cancelled")
            code = ll.llama_decode(self._ctx, batch)
            if code == _ABORTED:
                raise TaskCancelled("forward cancelled")
            if code != 0:
                raise ModelError(f"llama_decode failed with code {code} on {self._owner.name} (a tree of "
                                 f"{len(tree)} nodes after {len(prefix)} tokens)")
            out = np.empty(1 + len(tree), np.int64) if greedy else np.empty((1 + len(tree), vocab), np.float32)
            for r in range(1 + len(tree)):
                self._read_row(len(fresh) - 1 + r, out, r, greedy)
        except BaseException:
            for p in range(1, len(paths) + 1):
                ll.llama_memory_seq_rm(self._memory, p, -1, -1)
            self._tokens[keep:] = fresh  # what sequence 0 may hold now; then drop it back to the kept prefix
            self._remove_from(keep)
            raise
        finally:
            self._cancel = None
        for p in range(1, len(paths) + 1):
            ll.llama_memory_seq_rm(self._memory, p, -1, -1)
        self._tokens = prefix + [int(tree.tokens[i]) for i in tree.main_path()]
        return out

    def _remove_from(self, length: int) -> None:
        if not self._ll.llama_memory_seq_rm(self._memory, 0, length, -1):
            raise ModelError(f"llama.cpp could not drop the cache of {self._owner.name} past {length} tokens")
        del self._tokens[length:]

    def truncate(self, length: int) -> None:
        length = check_int(length, "truncate length", 0, len(self._tokens))
        if length < len(self._tokens):
            self._remove_from(length)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._ll.llama_batch_free(self._batch)
        self._ll.llama_free(self._ctx)
        self._owner._forget(self)


class GGUFTokenizer:
    """The GGUF's vocabulary through the Hugging Face tokenizer methods dsi uses."""

    def __init__(self, model: LlamaCppModel) -> None:
        ll, vocab = model._ll, model._vocab
        self._ll = ll
        self._vocab = vocab
        self._size = model.vocab_size
        self._model_name = model.name  # for errors
        self._text_vocab: dict[str, int] | None = None
        self._pieces: list[bytes] | None = None
        self.eos_token_id = _token_or_none(ll.llama_vocab_eos(vocab))
        self.bos_token_id = _token_or_none(ll.llama_vocab_bos(vocab))
        eog = [t for t in range(self._size) if ll.llama_vocab_is_eog(vocab, t)]
        ordered = [t for t in (self.eos_token_id, _token_or_none(ll.llama_vocab_eot(vocab))) if t in eog]
        self.eog_ids: tuple[int, ...] = tuple(dict.fromkeys(ordered + eog))
        template = ll.llama_model_chat_template(model._model, None)
        self.chat_template: str | None = template.decode("utf-8") if template else None
        self.bos_token = self._piece(self.bos_token_id)
        self.eos_token = self._piece(self.eos_token_id)

    def __len__(self) -> int:
        return self._size

    def _piece(self, token: int | None) -> str | None:
        if token is None:
            return None
        return self.decode([token], skip_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (special tokens written in the text are recognised, as in HF)."""
        data = check_text(text).encode("utf-8")
        add_special_tokens = bool(add_special_tokens)
        room = len(data) + 8
        buf = (self._ll.llama_token * room)()
        n = self._ll.llama_tokenize(self._vocab, data, len(data), buf, room, add_special_tokens, True)
        if n < 0:
            room = -n
            buf = (self._ll.llama_token * room)()
            n = self._ll.llama_tokenize(self._vocab, data, len(data), buf, room, add_special_tokens, True)
        if n < 0:
            raise ModelError(f"llama.cpp could not tokenise a text of {len(data)} bytes")
        return list(buf[:n])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of token ``ids``, each checked here first: llama.cpp reads an id outside ``[0, len(self))``
        with ``std::vector::at``, whose exception aborts the process (:class:`ConfigError` instead)."""
        ids = check_token_ids(ids, self._size, of=self._model_name)
        if not ids:
            return ""
        tokens = (self._ll.llama_token * len(ids))(*ids)
        room = 16 * len(ids) + 16
        for _ in range(2):
            buf = ctypes.create_string_buffer(room)
            n = self._ll.llama_detokenize(self._vocab, tokens, len(ids), buf, room, False, not skip_special_tokens)
            if n >= 0:
                return buf.raw[:n].decode("utf-8", errors="replace")
            room = -n
        raise ModelError(f"llama.cpp could not detokenise {len(ids)} tokens")

    def token_bytes(self) -> list[bytes]:
        """The bytes each token spells (special tokens: their text), by id; built once."""
        if self._pieces is None:
            buf = ctypes.create_string_buffer(256)
            pieces = []
            for token in range(self._size):
                n = self._ll.llama_token_to_piece(self._vocab, token, buf, 256, 0, True)
                if n < 0:  # longer than the buffer: ask again with room for it
                    big = ctypes.create_string_buffer(-n)
                    n = self._ll.llama_token_to_piece(self._vocab, token, big, -n, 0, True)
                    pieces.append(big.raw[:n])
                else:
                    pieces.append(buf.raw[:n])
            self._pieces = pieces
        return self._pieces

    def get_vocab(self) -> dict[str, int]:
        """Token text -> id (the GGUF's token strings), built once."""
        if self._text_vocab is None:
            vocab: dict[str, int] = {}
            for token in range(self._size):
                vocab.setdefault(self._ll.llama_vocab_get_text(self._vocab, token).decode("utf-8", "replace"), token)
            self._text_vocab = vocab
        return self._text_vocab

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs: Any) -> str | list[int]:
        """The GGUF's chat template rendered with Jinja2 the way transformers renders it."""
        if not self.chat_template:
            raise ConfigError("this GGUF has no chat template")
        text = render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _token_or_none(token: int) -> int | None:
    return int(token) if token is not None and token >= 0 else None


def render_chat_template(template: str, messages: list[dict[str, str]], **variables: Any) -> str:
    """Render a Hugging Face chat template (sandboxed Jinja2, trim_blocks and lstrip_blocks, with
    ``raise_exception`` and ``tojson`` as transformers defines them)."""
    import json

    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        raise ModelError(f"chat templates need jinja2: pip install jinja2 ({exc})") from exc

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                  ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=messages, **variables)
    except TemplateError as exc:
        raise ConfigError(f"the chat template refused these messages: {exc}") from exc
