"""The settings of ``dsi serve`` (:class:`ServeConfig`), validated when they are made.

A bad value is a :class:`dsi.errors.ConfigError` at start-up, before any model is loaded; in
particular an API key that no client could send (see :func:`check_api_key`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dsi.engine.config import DecoderConfig
from dsi.errors import ConfigError, require, shown
from dsi.models.vocab.bridge import check_mode_sampling
from dsi.sampling import SamplingParams
from dsi.server.limits import DEFAULT_MAX_BODY_BYTES
from dsi.server.protocol import MAX_SEED

MAX_SLOTS = 256  # max_concurrent: each slot is a decoder (its target servers, drafter thread, KV caches) and a thread
MAX_QUEUE = 4096  # max_queue: as many requests may also be read and tokenised at once, each up to max_body_bytes


def check_api_key(key: object, source: str = "--api-key") -> None:
    """Raise :class:`ConfigError` unless ``key`` is None or a key a client can send and match.

    The key travels in an HTTP header (``Authorization: Bearer <key>``), which carries ASCII
    reliably and nothing else, and the server strips the whitespace around the token: a key
    with a character outside printable ASCII, or with surrounding whitespace, could never match.
    The message names where the key came from (``source``: the option or environment variable)
    and the position of the first bad character, never the key.
    """
    if key is None:
        return
    if not isinstance(key, str) or key == "":
        raise ConfigError(f"api_key ({source}) must be a non-empty string or None")
    if key != key.strip():
        raise ConfigError(f"api_key ({source}) has leading or trailing whitespace, which clients cannot send "
                          "in the Authorization header; remove it")
    bad = next((i for i, c in enumerate(key) if not " " <= c <= "~"), None)
    if bad is not None:
        raise ConfigError(f"api_key ({source}) has a character at position {bad} that is not printable ASCII; "
                          "HTTP headers cannot carry it reliably, so no client could match the key. "
                          "Use ASCII letters, digits and punctuation")


@dataclass(frozen=True)
class ServeConfig:
    """Engine and server settings. Sampling fields are the defaults of requests that omit them."""

    method: str = "dsi"
    lookahead: int | str = 5  # k, or "auto" (DSI's event-driven windows)
    max_window: int | None = None  # with lookahead="auto": the most drafts per window
    num_target_servers: int = 1  # with method="auto": the most DSI may use
    auto_options: dict | None = None  # method="auto": options of dsi.evaluate.autotune.choose_method
    transport: str = "threads"
    transport_options: dict | None = None
    max_concurrent: int = 1  # engine slots, each one decoder
    max_queue: int = 64  # requests waiting for a slot; more get 429
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413
    api_key: str | None = None
    model_name: str = "dsi"  # the model id of the API (never a local path: clients see it)
    max_tokens: int = 256  # default max_tokens (clipped to the context)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None  # None: a fresh random seed for each request that gives none
    retry_after_s: int = 1
    shutdown_grace_s: float = 5.0  # at shutdown, how long running requests may take to stop
    vocab_mode: str = "auto"  # how the drafter's tokens reach the target (dsi.models.vocab.bridge)
    merges: int | str = "auto"  # a drafter of another vocabulary: its merged tokens' lookahead (dsi.models.vocab.merges)
    target_servers: tuple[str, ...] | None = None  # engines (URLs) that verify instead of local servers
    drafter_server: str | None = None  # an engine (URL) serving the drafter, whose tokens are streamed
    synthetic: tuple[str, str] | None = None  # (scenario, role) of a synthetic model served (dsi serve --synthetic)
    max_logprobs: int = 20  # the most (prompt_)logprobs per position a request may ask (-1: the whole vocabulary)
    logprobs_mode: str = "raw"  # the distribution of generated tokens' logprobs: "raw" (vLLM's default) or "processed"
    # each slot also holds a plain decoder, and each request runs the way measured faster at its load, handed over
    # mid-generation where the other way measured faster (dsi.server.load_choice); a non-SI server has nothing to
    # choose. None: on for in-process backends, off over engines (--target-servers), where it measured slower
    # (docs/results.md, "Serving under load on an emulated batching engine")
    speculation_by_load: bool | None = None
    draft_tree: str | None = None  # spend each window's drafts as a tree (dsi.trees): None / "off", "auto", "branches", "best-first", "3,2,1"

    def __post_init__(self) -> None:
        def positive_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1

        require(positive_int(self.num_target_servers),
                f"num_target_servers={shown(self.num_target_servers)} must be >= 1")
        self.decoder  # noqa: B018 - the decoder's options, checked by the one object that holds them
        require(positive_int(self.max_concurrent) and self.max_concurrent <= MAX_SLOTS,
                f"max_concurrent={self.max_concurrent!r} must be an integer in [1, {MAX_SLOTS}] (engine slots)")
        require(isinstance(self.max_queue, int) and not isinstance(self.max_queue, bool)
                and 0 <= self.max_queue <= MAX_QUEUE,
                f"max_queue={self.max_queue!r} must be an integer in [0, {MAX_QUEUE}]")
        require(positive_int(self.max_body_bytes),
                f"max_body_bytes={shown(self.max_body_bytes)} must be an integer >= 1")
        require(positive_int(self.max_tokens), f"max_tokens={shown(self.max_tokens)} must be an integer >= 1")
        check_api_key(self.api_key)
        require(isinstance(self.model_name, str) and self.model_name.strip() != "", "model_name must not be empty")
        require(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED),
                f"seed={self.seed!r} must be None or an integer in [0, 2**63 - 1]")
        defaults = SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)  # validates them
        if self.method != "ar":  # string-level drafting serves greedy requests only: the default must be one
            check_mode_sampling(self.vocab_mode, defaults)
        require(self.logprobs_mode in ("raw", "processed"),
                f"logprobs_mode={self.logprobs_mode!r} must be 'raw' or 'processed'")
        require(isinstance(self.max_logprobs, int) and not isinstance(self.max_logprobs, bool)
                and self.max_logprobs >= -1,
                f"max_logprobs={self.max_logprobs!r} must be an integer >= 0, or -1 (the whole vocabulary)")
        require(self.speculation_by_load is None or isinstance(self.speculation_by_load, bool),
                f"speculation_by_load={shown(self.speculation_by_load)} must be True, False or None (on in-process, "
                "off over engines)")
        require(positive_int(self.retry_after_s),
                f"retry_after_s={shown(self.retry_after_s)} must be an integer >= 1")

    @property
    def chooses_by_load(self) -> bool:
        """Whether speculation is chosen by load (``speculation_by_load``, None resolved): a speculative server's."""
        if self.method == "ar":
            return False
        return not self.target_servers if self.speculation_by_load is None else self.speculation_by_load

    @property
    def decoder(self) -> DecoderConfig:
        """The options of the server's decoders (each slot builds one), as :class:`dsi.DecoderConfig`."""
        return DecoderConfig(
            method=self.method, lookahead=self.lookahead, max_window=self.max_window,
            num_target_servers=self.num_target_servers, transport=self.transport,
            transport_options=self.transport_options, auto_options=self.auto_options, draft_tree=self.draft_tree,
            vocab_mode=self.vocab_mode, merges=self.merges, target_servers=self.target_servers,
            drafter_server=self.drafter_server,
        )
