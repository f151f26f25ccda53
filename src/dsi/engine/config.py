"""One validated, immutable description of a decoder: :class:`DecoderConfig`.

Every option that shapes a decoder lives here, checked once when the object is made, with errors that
name the value and what is allowed: the method, the window policy (lookahead, max_window), where the
target servers run (SP, transport and its options, engine URLs), the draft tree, how a drafter of another
vocabulary is bridged (vocab_mode, merges), the drafter's engine, the deterministic mode, and the options
of ``method="auto"``'s choice. ``dsi.build_decoder`` and ``dsi.generate`` build one from their keyword
arguments; the engine's builder, the CLI, the server and autotune take one. Adding an option is adding a
field here (and its check), then reading it where it is used.

Models and tokenizers are objects, not options: they stay arguments of the builders. A config is plain
data: :meth:`DecoderConfig.to_dict` gives a JSON-safe dict (``from_dict`` reads it back), for caches and
for the recipes that rebuild things in other processes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from dsi.errors import ConfigError, is_int, require, shown
from dsi.models.vocab.bridge import VOCAB_MODES, check_merges
from dsi.transport import TRANSPORTS
from dsi.transport.base import check_num_servers
from dsi.trees import BestFirst, Dynamic, TreeShape, Widths, check_windowed, parse_shape

ENGINE_METHODS = ("dsi", "si", "ar")  # what the engine runs
METHODS = ("auto", *ENGINE_METHODS)  # "auto": the fastest of the engine's methods here (dsi.api)
DEFAULT_TARGET_SERVERS = 2  # SP when neither num_target_servers nor engine URLs say


def check_lookahead(method: str, lookahead: object, max_window: object = None) -> None:
    """Validate ``lookahead`` (an integer k >= 1, or "auto" for DSI's event-driven windows) and
    ``max_window`` (None or an integer >= 1, with "auto" only)."""
    require(
        (is_int(lookahead) and lookahead >= 1) or lookahead == "auto",
        f"lookahead={lookahead!r} must be an integer >= 1 or 'auto' (DSI's event-driven windows)",
    )
    if lookahead == "auto" and method == "si":
        raise ConfigError("lookahead='auto' is DSI's event-driven window policy; SI needs an integer lookahead")
    if max_window is not None:
        require(is_int(max_window) and max_window >= 1,
                f"max_window={shown(max_window)} must be None or an integer >= 1")
        require(lookahead == "auto", f"max_window={shown(max_window)} applies to lookahead='auto' only "
                                     f"(lookahead={lookahead!r} sends windows of exactly that many drafts)")


def check_placement(num_target_servers: object, transport: object) -> None:
    """Validate the number of target servers (1 to :data:`~dsi.transport.MAX_SERVERS`) and the transport that
    runs them."""
    check_num_servers(num_target_servers, "num_target_servers")
    require(transport in TRANSPORTS, f"transport={shown(transport)} must be one of {', '.join(TRANSPORTS)}")


def check_draft_tree(method: str, draft_tree: object) -> TreeShape:
    """``draft_tree`` as a shape: None / ``"off"`` (chains), ``"auto"`` (side children where the drafter is
    unsure), ``"branches"`` (SI: they continue as the drafter's chains), ``"best-first"`` (SI), widths per
    depth (``"3,2,1"``), or a :class:`~dsi.trees.Widths` /
    :class:`~dsi.trees.Dynamic` / :class:`~dsi.trees.BestFirst`."""
    if draft_tree is None or isinstance(draft_tree, Widths | Dynamic | BestFirst):
        shape = draft_tree
    elif isinstance(draft_tree, str):
        shape = parse_shape(draft_tree)
    else:
        raise ConfigError(f"draft_tree={draft_tree!r} must be None, 'off', 'auto', 'branches', 'best-first', widths "
                          "per depth such as '3,2,1', or a dsi.trees.Widths / Dynamic / BestFirst")
    if shape is not None and method == "ar":
        raise ConfigError(f"draft_tree={draft_tree!r} needs a drafter: it applies to method 'si' or 'dsi', not 'ar'")
    if method == "dsi":
        check_windowed(shape)  # refuses what DSI cannot branch by (widths per depth, branches), naming the shape
    return shape


def _mapping(value: object, name: str) -> dict | None:
    if value is None:
        return None
    require(isinstance(value, Mapping), f"{name}={shown(value)} must be None or a dict of options")
    return dict(value)


@dataclass(frozen=True)
class DecoderConfig:
    """The options of a decoder (see the module doc).

    ``deterministic``: None keeps the models' own mode (llama.cpp: on, hf: off); True or False switches
    both models (they keep the setting; :mod:`dsi.models.determinism`). In the mode every token is
    computed in a forward of its own, so greedy SI and DSI equal non-SI bit for bit and a seed gives
    the same tokens whatever ran before; a model that has no such mode is refused.

    ``method="auto"`` measures non-SI, SI and DSI on this placement (once; the choice is cached)
    and builds the fastest; ``num_target_servers`` is then the most DSI may use, and
    ``auto_options`` go to :func:`dsi.evaluate.autotune.choose_method` (``cache_dir``, ``refresh``,
    ``tokens``, ``prompt``). The decoder's ``choice`` says what was picked and why; once chosen it
    is exactly the decoder that method builds by hand.

    ``lookahead``: drafts per verification window (k), or ``"auto"`` (DSI only): event-driven
    windows, sent whenever a target server is idle, carrying every draft made since the previous
    window (at most ``max_window``).

    ``target_servers``: a list of engine URLs (``http://host:port/v1``: vLLM OpenAI servers or ``dsi
    serve`` instances serving the target) to verify on instead of servers of this process; ``target``
    is then the local copy they are checked against (vocabulary and a canary forward) and whose
    tokenizer stays local (:mod:`dsi.models.engines.target`, docs/engines.md). ``num_target_servers``
    defaults to 2, or one per URL.

    ``vocab_mode``: how a drafter's tokens relate to the target's (:mod:`dsi.models.vocab.bridge`).
    ``"auto"``: the drafter's own tokens when both share one vocabulary, else a drafter of another
    vocabulary drafts through text (string-level for greedy requests, the token intersection for
    sampling); ``"shared"``: one vocabulary required; ``"string"`` / ``"intersection"``: that
    translation. Translating needs both tokenizers: the models' ``tokenizer`` attributes, or
    ``target_tokenizer`` / ``drafter_tokenizer``. Output stays exact in every mode. ``merges`` (a drafter
    of another vocabulary, intersection mode): how many likely shared tokens per position its law extends to
    the target tokens they begin and the drafter spells in two (:mod:`dsi.models.vocab.merges`); ``"auto"``: 3
    where the drafter's rows are cheap (an accelerator, a stated low row price), 0 (plain TLI) on a CPU.

    ``draft_tree`` (SI and DSI): spend each window's drafts as a tree instead of a chain (:mod:`dsi.trees`):
    None or ``"off"`` (chains), ``"auto"`` (the chain's drafts with side children where the drafter is
    unsure), ``"branches"`` (SI: those side children go on as the drafter's own drafts, in the same k
    drafter rounds), ``"best-first"`` (SI: an EAGLE-2-style tree of k nodes) or widths per depth
    (``"3,2,1"``). The committed tokens are the chain's for the same seed (DSI), or the target's law with
    the same guarantees (SI): a tree only changes how many tokens a verification commits.

    ``drafter_server``: the URL of an engine serving the drafter (vLLM or ``dsi serve``); its tokens are
    streamed from there, and ``drafter`` is the local copy it is checked against and whose tokenizer
    stays local (:mod:`dsi.models.engines.drafter`, docs/engines.md)."""

    method: str = "dsi"  # "dsi", "si", "ar", or "auto" (the fastest of them here: dsi.api)
    lookahead: int | str = 5  # k, or "auto" (DSI's event-driven windows)
    max_window: int | None = None  # with lookahead="auto": the most drafts one window carries
    num_target_servers: int | None = None  # SP; None: 2, or one per engine URL (method "auto": the most DSI may use)
    transport: str = "threads"  # where the target servers run: "threads", "processes", "ray"
    transport_options: Mapping[str, Any] | None = None  # the transport's own (devices, liveness, recipe, ...)
    draft_tree: Any = None  # None / "off", "auto", "branches", "best-first", widths "3,2,1", or a dsi.trees shape
    vocab_mode: str = "auto"  # how a drafter's tokens reach the target (dsi.models.vocab.bridge)
    merges: int | str = "auto"  # a drafter of another vocabulary: its merged tokens' lookahead (dsi.models.vocab.merges)
    deterministic: bool | None = None  # None: the models' own mode; True / False: switch both
    target_servers: Any = None  # engine URLs that verify (a list), True (the target is an EngineTarget), or None
    drafter_server: str | None = None  # an engine URL serving the drafter
    auto_options: Mapping[str, Any] | None = None  # method="auto": options of dsi.evaluate.autotune.choose_method
    tree_shape: TreeShape = field(default=None, init=False, compare=False, repr=False)  # draft_tree parsed

    def __post_init__(self) -> None:
        method = self.method
        require(method in METHODS, f"method={shown(method)} must be one of {', '.join(METHODS)}")
        if method == "auto" and self.draft_tree not in (None, "off"):
            raise ConfigError(f"draft_tree={self.draft_tree!r} with method='auto': the method choice weighs draft "
                              "trees itself (chains and the trees '2' and 'auto', and picks one); pick method 'si' "
                              "or 'dsi' (--method) to choose the tree yourself")
        check_lookahead(method, self.lookahead, self.max_window)
        object.__setattr__(self, "tree_shape", check_draft_tree(method, self.draft_tree))
        check_placement(DEFAULT_TARGET_SERVERS if self.num_target_servers is None else self.num_target_servers,
                        self.transport)
        require(self.vocab_mode in VOCAB_MODES,
                f"vocab_mode={self.vocab_mode!r} must be one of {', '.join(VOCAB_MODES)}")
        check_merges(self.merges)
        require(self.deterministic is None or isinstance(self.deterministic, bool),
                f"deterministic={self.deterministic!r} must be None, True or False")
        if isinstance(self.target_servers, list):  # hashable, and a caller's list cannot change it later
            object.__setattr__(self, "target_servers", tuple(self.target_servers))
        if self.deterministic and self.target_servers is not None:
            raise ConfigError("deterministic=True cannot hold with target_servers: an engine's rows depend on its own "
                              "batching, which dsi does not control; drop deterministic or the target servers")
        if self.deterministic and self.drafter_server is not None:
            raise ConfigError("deterministic=True cannot hold with drafter_server: an engine's rows depend on its "
                              "own batching, which dsi does not control; drop deterministic or the drafter server")
        if self.drafter_server is not None and method == "ar":
            raise ConfigError(f"drafter_server={self.drafter_server!r} with method='ar': non-SI drafts nothing; "
                              "drop it")
        object.__setattr__(self, "transport_options", _mapping(self.transport_options, "transport_options"))
        object.__setattr__(self, "auto_options", _mapping(self.auto_options, "auto_options"))

    @classmethod
    def of(cls, config: DecoderConfig | None = None, options: Mapping[str, Any] | None = None) -> DecoderConfig:
        """``config`` (default: the defaults) with ``options`` (keyword arguments of a builder) applied; an
        unknown option is refused, naming the known ones."""
        if config is not None and not isinstance(config, DecoderConfig):
            raise ConfigError(f"config={config!r} must be a dsi.DecoderConfig or None")
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise ConfigError(f"unknown decoder option(s) {', '.join(unknown)}; the options are: "
                              f"{', '.join(OPTION_NAMES)}")
        base = config if config is not None else cls()
        return replace(base, **options) if options else base

    def replace(self, **changes: Any) -> DecoderConfig:
        """A copy with ``changes`` (validated as a new config is)."""
        return DecoderConfig.of(self, changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe plain data: the fields, a tree shape object as its fields and ``kind`` (its class name),
        engine URLs as a list (``transport_options`` and ``auto_options`` as given: JSON-safe if their values
        are)."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        if data["draft_tree"] is not None and not isinstance(data["draft_tree"], str):
            data["draft_tree"] = asdict(data["draft_tree"]) | {"kind": type(data["draft_tree"]).__name__}
        if isinstance(data["target_servers"], tuple):
            data["target_servers"] = list(data["target_servers"])
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DecoderConfig:
        """The config :meth:`to_dict` gave."""
        data = dict(data)
        tree = data.get("draft_tree")
        if isinstance(tree, Mapping):
            kinds = {c.__name__: c for c in (Widths, Dynamic, BestFirst)}
            tree = dict(tree)
            kind = kinds.get(tree.pop("kind", None))
            require(kind is not None, f"draft_tree={shown(data['draft_tree'])} names no known tree shape")
            data["draft_tree"] = kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in tree.items()})
        return cls.of(None, data)


OPTION_NAMES = tuple(f.name for f in fields(DecoderConfig) if f.init)
