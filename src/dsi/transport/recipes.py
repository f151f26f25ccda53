"""Model recipes: how a target model is rebuilt inside another process (a spawned child, a Ray actor).

A recipe is a small picklable object whose ``build()`` returns the language model in the process
that calls it. :func:`model_recipe` picks one for a model:

- a model that pickles as it is (``synthetic_pair`` models, ``CallableLM`` over a picklable
  function, ``WithLatency`` around those) travels whole: :class:`PickledModel`;
- an :class:`~dsi.models.hf.model.HFModel` is *re-loaded* from its ``source_dir`` with its dtype, its
  device (or the server's) and its threads: :class:`HFRecipe`. Weights never travel through a pipe;
- a :class:`~dsi.models.llamacpp.LlamaCppModel` is re-loaded from its ``.gguf`` file with its context
  size and threads: :class:`LlamaCppRecipe` (CPU only: a server asked to run it on a device other
  than ``cpu`` is a :class:`~dsi.errors.ConfigError`);
- ``WithLatency`` around a re-loaded model becomes :class:`LatencyRecipe` over its inner recipe;
- anything with a ``build()`` method is taken as a recipe already (pass your own through
  ``transport_options={"recipe": ...}`` for a model none of the above covers);
- a :class:`RecipeModel` (a recipe plus a vocabulary size, loaded locally only if used locally)
  gives its recipe, so a driver can run remote servers of a model it never loads.

``placed(device, threads)`` returns the recipe for one server: a device and a thread count (torch's or
llama.cpp's) given per server override the model's own. This module imports neither torch, Ray nor
the llama.cpp binding.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from dsi.errors import ConfigError
from dsi.models.base import LanguageModel
from dsi.models.emulated.latency import WithLatency


@runtime_checkable
class ModelRecipe(Protocol):
    """Picklable instructions that rebuild a language model in the process calling ``build``."""

    def build(self) -> LanguageModel: ...

    def placed(self, device: str | None, threads: int | None) -> ModelRecipe: ...


@dataclass(frozen=True)
class PickledModel:
    """A model that pickles as it is (its weights, if any, travel with it)."""

    model: Any

    uses_device = False

    def build(self) -> LanguageModel:
        return self.model

    def placed(self, device: str | None, threads: int | None) -> PickledModel:
        if device not in (None, "cpu"):
            raise ConfigError(f"device={device!r} given for {self.model!r}, which has no device setting; "
                              "devices apply to Hugging Face models (HFModel)")
        return self


@dataclass(frozen=True)
class HFRecipe:
    """Load a transformers checkpoint directory with ``HFModel.load`` (no tokenizer use, no progress bar)."""

    source_dir: str
    dtype: str = "fp32"
    device: str = "cpu"
    threads: int | None = None
    deterministic: bool = False
    forward_plan: Any = None  # the model's dsi.models.hf.forward_plan.ForwardPlan (None: the default)

    uses_device = True

    def build(self) -> LanguageModel:
        from transformers.utils import logging as hf_logging

        from dsi.models.hf.model import HFModel

        hf_logging.disable_progress_bar()  # a server loads unattended; no bars in its log
        model = HFModel.load(self.source_dir, dtype=self.dtype, device=self.device, threads=self.threads,
                             role="target", progress=False, forward_plan=self.forward_plan)
        model.deterministic = self.deterministic
        return model

    def placed(self, device: str | None, threads: int | None) -> HFRecipe:
        return replace(self, device=self.device if device is None else str(device),
                       threads=self.threads if threads is None else threads)


@dataclass(frozen=True)
class LlamaCppRecipe:
    """Load a GGUF file with ``LlamaCppModel.load`` in the server's process (CPU only)."""

    gguf_path: str
    n_ctx: int | None = None
    threads: int | None = None
    name: str | None = None
    deterministic: bool | None = None  # None: the backend's default

    uses_device = False  # the llama.cpp wheels run on the CPU: Ray gives its servers no GPU

    def build(self) -> LanguageModel:
        from dsi.models.llamacpp import LlamaCppModel

        return LlamaCppModel.load(self.gguf_path, n_ctx=self.n_ctx, threads=self.threads, name=self.name,
                                  role="target", deterministic=self.deterministic)

    def placed(self, device: str | None, threads: int | None) -> LlamaCppRecipe:
        if device is not None and str(device).strip().lower() != "cpu":
            raise ConfigError(f"device={device!r} given for the llama.cpp model {self.name or self.gguf_path!r}, which "
                              "runs on the CPU only; use device 'cpu' (or none) for its servers, or load the "
                              "model with backend='hf' to run it on a GPU")
        return replace(self, threads=self.threads if threads is None else threads)


@dataclass(frozen=True)
class LatencyRecipe:
    """``WithLatency(inner.build(), ttft, tpot)``."""

    inner: ModelRecipe
    ttft: float
    tpot: float
    cv: float = 0.0
    seed: int = 0

    @property
    def uses_device(self) -> bool:
        return bool(getattr(self.inner, "uses_device", False))

    def build(self) -> LanguageModel:
        return WithLatency(self.inner.build(), self.ttft, self.tpot, self.cv, self.seed)

    def placed(self, device: str | None, threads: int | None) -> LatencyRecipe:
        return replace(self, inner=self.inner.placed(device, threads))


class RecipeModel:
    """A language model known by its recipe and vocabulary size; built here only if used here.

    Lets a driver hand a big target to remote servers without loading it itself (``vocab_size`` is
    all the engine needs locally): ``dsi.generate(target=RecipeModel(HFRecipe(dir, "bf16",
    "cuda"), vocab_size), transport="ray", ...)``. A session asked for in this process (threads
    transport, SI, non-SI) builds the model once, on first use.
    """

    def __init__(self, recipe: ModelRecipe, vocab_size: int) -> None:
        if not callable(getattr(recipe, "build", None)):
            raise ConfigError(f"recipe={recipe!r} has no build() method")
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 2:
            raise ConfigError(f"vocab_size={vocab_size!r} must be an integer >= 2")
        self.recipe = recipe
        self._vocab_size = vocab_size
        self._model: LanguageModel | None = None
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def new_session(self) -> Any:
        with self._lock:
            if self._model is None:
                self._model = self.recipe.build()
        return self._model.new_session()

    def __repr__(self) -> str:
        return f"RecipeModel({self.recipe!r}, vocab_size={self._vocab_size})"


def _is_hf_model(model: object) -> bool:
    hf = sys.modules.get("dsi.models.hf.model")  # an HFModel exists only if its module was imported
    return hf is not None and isinstance(model, hf.HFModel)


def _is_llamacpp_model(model: object) -> bool:
    module = sys.modules.get("dsi.models.llamacpp")  # a LlamaCppModel exists only if its module was imported
    return module is not None and isinstance(model, getattr(module, "LlamaCppModel", ()))


def model_recipe(model: object) -> ModelRecipe:
    """A picklable recipe that rebuilds ``model`` in another process (see the module docstring)."""
    if isinstance(model, RecipeModel):
        return model.recipe
    if not hasattr(model, "new_session") and callable(getattr(model, "build", None)):
        return model  # type: ignore[return-value]  # already a recipe
    if _is_hf_model(model):
        if model.source_dir is None:
            raise ConfigError(
                f"{model!r} has no source_dir, so another process cannot load it; save it with "
                "model.model.save_pretrained(DIR) and load it with HFModel.load(DIR), or pass "
                "transport_options={'recipe': ...}"
            )
        return HFRecipe(str(model.source_dir), model.dtype, str(model.device), model.threads, model.deterministic,
                        model.forward_plan)
    if _is_llamacpp_model(model):
        return LlamaCppRecipe(str(model.source_path), model.n_ctx, model.threads, model.name, model.deterministic)
    if isinstance(model, WithLatency):
        inner = model_recipe(model.model)
        if not isinstance(inner, PickledModel):
            return LatencyRecipe(inner, model.ttft, model.tpot, model.cv, model.seed)
    try:
        pickle.dumps(model, protocol=5)
    except Exception as exc:
        raise ConfigError(
            f"{model!r} cannot be sent to another process ({type(exc).__name__}: {exc}); use picklable "
            "callables (module-level functions or classes, not lambdas or closures), or pass "
            "transport_options={'recipe': ...} with a build() that makes the model there"
        ) from exc
    return PickledModel(model)


def build_with_threads(recipe: ModelRecipe, threads: int | None) -> LanguageModel:
    """``recipe.build()`` in a server process whose compute libraries use ``threads`` threads.

    OpenMP / MKL read their variables when first loaded (by the build, for torch); torch's
    intra-op pool is also set explicitly if the build loaded torch. Models without torch never
    import it.
    """
    if threads is not None:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ[var] = str(threads)
    model = recipe.build()
    if threads is not None and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    return model
