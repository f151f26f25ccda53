"""``ReplayLM``: a model's real compute with another pair's recorded greedy decisions.

Use: measure how fast SI and DSI would decode a real pair on hardware where that pair's weights
cannot be loaded (a machine with no registry access, say), by running models of the *same
architecture* (random weights, same cost per forward) whose greedy choices are replayed from a
run of the real pair. Every ``extend`` runs the inner model's forward (so time, KV cache and
cancellation are real) and then returns logits whose argmax is the recorded token for that
context, or ``fallback`` for a context the recording does not hold.

A recording (:func:`record_decisions`) holds, for each prompt, the target's greedy output and
the drafter's greedy guess at every prefix of it. Replayed greedy SI and DSI then take exactly
the real pair's decisions: the drafts along the target's output are the real drafter's, so
acceptance and rejections are the real run's; what the drafter proposes after a rejected draft
(off the recording, so ``fallback``) is discarded by the algorithm whatever it is. Greedy only:
the replayed logits are one-hot, not the real distributions.

:func:`random_weights_model` builds the stand-ins (a transformers architecture from its
``config.json``, seeded random weights, built directly on the device); :class:`ReplayRecipe`
rebuilds a replayed model inside a target server process or Ray actor (pass it as the
transport's ``recipe`` option), so no weights ever travel.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from dsi.errors import ConfigError, ContextLengthError
from dsi.models.base import (
    CancelFlag,
    LanguageModel,
    ModelSession,
    context_limit,
    extend_rows,
    greedy_guess,
    guessable_positions,
)
from dsi.models.costs import ForwardCosts, stated_costs

RECORDING_VERSION = 1


@dataclass(frozen=True)
class RecordedPrompt:
    """One prompt of a recording: ``target[i]`` and ``drafter[i]`` are the two models' greedy
    tokens after ``prompt + target[:i]``."""

    prompt: tuple[int, ...]
    target: tuple[int, ...]
    drafter: tuple[int, ...]

    @property
    def accept_pattern(self) -> list[bool]:
        return [d == t for d, t in zip(self.drafter, self.target, strict=True)]


def _drafter_guesses(drafter: LanguageModel, prompt: list[int], output: list[int]) -> list[int]:
    """The drafter's greedy guess of ``output[i]`` after ``prompt + output[:i]``, for every i its
    declared context reaches (all of them without a limit), from one forward."""
    if not prompt or not output:
        raise ConfigError("a recording needs a non-empty prompt and a non-empty target output")
    count = guessable_positions(drafter, len(prompt), len(output))
    if count == 0:
        return []
    session = drafter.new_session()
    try:
        if getattr(drafter, "drafts_through_text", False):  # a drafter of another vocabulary guesses
            # through its own continuation of the text: one position at a time
            return [greedy_guess(session, prompt + output[:i]) for i in range(count)]
        rows = session.extend(prompt + output[: count - 1])[len(prompt) - 1:]
    finally:
        session.close()
    return [int(np.argmax(row)) for row in rows]


def record_decisions(drafter: LanguageModel, prompt: Sequence[int], target_output: Sequence[int]) -> RecordedPrompt:
    """Record ``prompt``: the target's greedy output (given) and the drafter's greedy guess at
    every prefix of it, from one drafter forward over ``prompt + target_output[:-1]``.

    A drafter whose declared context (``max_context``) is too short for that raises
    :class:`~dsi.errors.ContextLengthError`; :func:`accept_pattern` needs no full recording."""
    prompt, output = [int(t) for t in prompt], [int(t) for t in target_output]
    guesses = _drafter_guesses(drafter, prompt, output)
    if len(guesses) < len(output):
        raise ContextLengthError(
            f"the drafter's max_context={context_limit(drafter)} cannot hold the prompt of {len(prompt)} tokens and "
            f"{len(output) - 1} output tokens; record a shorter output (at most {len(guesses)} tokens)")
    return RecordedPrompt(tuple(prompt), tuple(output), tuple(guesses))


def accept_pattern(drafter: LanguageModel, prompt: Sequence[int], target_output: Sequence[int]) -> list[bool]:
    """Whether the drafter's greedy guess equals the target's token at each position of
    ``target_output`` (the target's greedy output after ``prompt``).

    Past the drafter's declared context there is no draft, so no accepted one: False (the
    engines commit the target's own token there)."""
    prompt, output = [int(t) for t in prompt], [int(t) for t in target_output]
    guesses = _drafter_guesses(drafter, prompt, output)
    return [g == t for g, t in zip(guesses, output, strict=False)] + [False] * (len(output) - len(guesses))


def save_recording(path: str | Path, prompts: Sequence[RecordedPrompt], meta: Mapping[str, Any] | None = None) -> None:
    doc = {"version": RECORDING_VERSION, "meta": dict(meta or {}),
           "prompts": [{"prompt": list(p.prompt), "target": list(p.target), "drafter": list(p.drafter)}
                       for p in prompts]}
    Path(path).write_text(json.dumps(doc), encoding="utf-8")


def load_recording(path: str | Path) -> tuple[list[RecordedPrompt], dict]:
    """The prompts and metadata of a recording written by :func:`save_recording`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recording {str(path)!r} does not exist")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("version") != RECORDING_VERSION:
            raise ConfigError(f"recording {str(path)!r} has version {doc.get('version')!r}; "
                              f"this dsi reads version {RECORDING_VERSION}")
        prompts = [RecordedPrompt(tuple(p["prompt"]), tuple(p["target"]), tuple(p["drafter"])) for p in doc["prompts"]]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"recording {str(path)!r} is not a dsi recording: {exc}") from exc
    for i, p in enumerate(prompts):
        if not p.prompt or not p.target or len(p.target) != len(p.drafter):
            raise ConfigError(f"recording {str(path)!r}: prompt {i} needs a prompt and equally long "
                              f"target and drafter token lists")
    return prompts, dict(doc.get("meta") or {})


def recorded_choices(prompts: Sequence[RecordedPrompt]) -> tuple[dict, dict]:
    """``(target_choices, drafter_choices)``: each model's recorded token for every context."""
    target_choices: dict[tuple[int, ...], int] = {}
    drafter_choices: dict[tuple[int, ...], int] = {}
    for p in prompts:
        for i, (t, d) in enumerate(zip(p.target, p.drafter, strict=True)):
            context = p.prompt + p.target[:i]
            target_choices[context] = t
            drafter_choices[context] = d
    return target_choices, drafter_choices


def replay_pair(
    target: LanguageModel, drafter: LanguageModel, prompts: Sequence[RecordedPrompt], fallback: int = 0
) -> tuple[ReplayLM, ReplayLM]:
    """``target`` and ``drafter`` wrapped to take the recorded decisions of ``prompts``.

    Where their vocabularies differ in size (padding of one tokenizer), both report the smaller.
    """
    target_choices, drafter_choices = recorded_choices(prompts)
    vocab = min(target.vocab_size, drafter.vocab_size)
    return (ReplayLM(target, target_choices, fallback, vocab_size=vocab),
            ReplayLM(drafter, drafter_choices, fallback, vocab_size=vocab))


def random_weights_model(config_dir: str | Path, dtype: str = "bf16", device: str = "cpu", *, seed: int = 0,
                         threads: int | None = None, role: str | None = None, forward_plan: Any = None) -> Any:
    """An :class:`~dsi.models.hf.model.HFModel` of the architecture in ``config_dir`` (a ``config.json``)
    with seeded random weights, built directly on ``device``: each forward costs what the real
    model's would. ``forward_plan``: its KV cache and CUDA graphs (:class:`~dsi.models.hf.forward_plan.ForwardPlan`).
    Needs torch and transformers (the ``hf`` extra)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from dsi.models.hf.model import HFModel, check_device, torch_dtype

    config_dir = Path(config_dir)
    if not (config_dir / "config.json").is_file():
        raise ConfigError(f"config_dir={str(config_dir)!r} has no config.json")
    dev = check_device(device, dtype)
    hf_logging.disable_progress_bar()
    config = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(seed)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype))
    return HFModel(model, name=f"{config_dir.name} (random weights)", threads=threads, role=role,
                   forward_plan=forward_plan)


@dataclass(frozen=True)
class ReplayRecipe:
    """Rebuilds ``ReplayLM(random_weights_model(config_dir, ...), choices)`` in the process that
    calls :meth:`build` (a recipe in the sense of :mod:`dsi.transport.recipes`)."""

    config_dir: str
    choices: Mapping[tuple[int, ...], int] = field(compare=False)
    dtype: str = "bf16"
    device: str = "cpu"
    threads: int | None = None
    vocab_size: int | None = None
    fallback: int = 0
    forward_plan: Any = None  # dsi.models.hf.forward_plan.ForwardPlan (None: the default)

    uses_device = True

    def build(self) -> ReplayLM:
        model = random_weights_model(self.config_dir, self.dtype, self.device, threads=self.threads, role="target",
                                     forward_plan=self.forward_plan)
        return ReplayLM(model, self.choices, self.fallback, vocab_size=self.vocab_size)

    def placed(self, device: str | None, threads: int | None) -> ReplayRecipe:
        return replace(self, device=self.device if device is None else str(device),
                       threads=self.threads if threads is None else threads)


class ReplayLM:
    """``model``'s forwards, with logits whose argmax is ``choices[context]`` (else ``fallback``).

    ``vocab_size`` (default: the model's) is the size of the rows it returns: give the pair one
    common size when their architectures pad the same tokenizer differently (Qwen2.5-14B has 152064
    rows, Qwen2.5-0.5B 151936); every recorded id must lie below it.
    """

    def __init__(self, model: LanguageModel, choices: Mapping[tuple[int, ...], int], fallback: int = 0,
                 vocab_size: int | None = None) -> None:
        vocab = model.vocab_size if vocab_size is None else vocab_size
        if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 2:
            raise ConfigError(f"vocab_size={vocab!r} must be an integer >= 2")
        bad = [t for t in (*choices.values(), fallback) if not 0 <= t < min(vocab, model.vocab_size)]
        if bad:
            raise ConfigError(f"recorded token ids {bad[:5]} are outside the vocabulary "
                              f"[0, {min(vocab, model.vocab_size)}) of {model!r}")
        self.model = model
        self.choices = dict(choices)
        self.fallback = int(fallback)
        self._vocab_size = vocab

    @property
    def wrapped_model(self) -> object:
        """The model whose forwards this one passes on (:func:`dsi.models.determinism.base_model`)."""
        return self.model

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_context(self) -> int | None:
        """The inner model's declared context limit (:func:`dsi.models.base.context_limit`)."""
        return context_limit(self.model)

    @property
    def threads(self) -> int | None:  # torch threads of an HF inner model (see dsi.evaluate.compare)
        return getattr(self.model, "threads", None)

    @threads.setter
    def threads(self, value: int | None) -> None:
        if hasattr(self.model, "threads"):
            self.model.threads = value

    def forward_costs(self) -> ForwardCosts | None:
        """The inner model's stated costs (:mod:`dsi.models.costs`), or None: then timed on this model."""
        return stated_costs(self.model)

    def new_session(self, device: Any = None) -> ReplaySession:
        inner = self.model.new_session() if device is None else self.model.new_session(device=device)
        return ReplaySession(self, inner)

    def __repr__(self) -> str:
        return f"ReplayLM({self.model!r}, {len(self.choices)} recorded contexts)"


class ReplaySession:
    def __init__(self, owner: ReplayLM, inner: ModelSession) -> None:
        self._owner = owner
        self._inner = inner

    @property
    def tokens(self) -> tuple[int, ...]:
        return self._inner.tokens

    def extend(self, tokens: Sequence[int], cancel: CancelFlag | None = None) -> np.ndarray:
        return self.extend_rows(tokens, cancel, len(tokens), False)

    def extend_rows(self, tokens: Sequence[int], cancel: CancelFlag | None, num_rows: int, greedy: bool) -> np.ndarray:
        before = tuple(self._inner.tokens)
        # the real forward, asked for what a real run would ask: its time, cache and cancellation
        extend_rows(self._inner, tokens, cancel, num_rows, greedy)
        owner, new = self._owner, [int(t) for t in tokens]
        choices = [owner.choices.get(before + tuple(new[: i + 1]), owner.fallback)
                   for i in range(len(new) - num_rows, len(new))]
        if greedy:
            return np.asarray(choices, dtype=np.int64)  # [num_rows]
        rows = np.zeros((num_rows, owner.vocab_size), dtype=np.float32)  # [num_rows, V], one-hot
        rows[np.arange(num_rows), choices] = 1.0
        return rows

    def truncate(self, length: int) -> None:
        self._inner.truncate(length)

    def close(self) -> None:
        self._inner.close()
