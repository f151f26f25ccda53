"""Model recipes: which models travel whole, which are re-loaded, and clear errors otherwise."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from dsi.errors import ConfigError
from dsi.models import CallableLM, WithLatency, synthetic_pair
from dsi.transport.recipes import HFRecipe, LatencyRecipe, LlamaCppRecipe, PickledModel, RecipeModel, model_recipe


def test_synthetic_and_latency_models_travel_whole():
    target, _ = synthetic_pair(0.5, vocab_size=8, target_tpot=0.01)
    recipe = model_recipe(target)
    assert isinstance(recipe, PickledModel)
    built = pickle.loads(pickle.dumps(recipe)).build()
    assert isinstance(built, WithLatency) and built.tpot == 0.01
    ctx = (1, 2, 3)
    np.testing.assert_array_equal(built.model.next_logits(ctx), target.model.next_logits(ctx))


def test_a_recipe_is_its_own_recipe_and_closures_are_refused():
    recipe = HFRecipe("/nowhere", "bf16", "cpu", 2)
    assert model_recipe(recipe) is recipe
    with pytest.raises(ConfigError, match="lambdas or closures"):
        model_recipe(CallableLM(lambda ctx: np.zeros(3), 3))


def test_a_recipe_model_is_built_only_when_a_session_is_asked_for():
    class Counting:
        builds = 0

        def build(self):
            Counting.builds += 1
            return synthetic_pair(0.5, vocab_size=8)[0]

        def placed(self, device, threads):
            return self

    recipe = Counting()
    lazy = RecipeModel(recipe, 8)
    assert model_recipe(lazy) is recipe and lazy.vocab_size == 8 and Counting.builds == 0
    lazy.new_session()
    lazy.new_session()
    assert Counting.builds == 1
    with pytest.raises(ConfigError, match="vocab_size"):
        RecipeModel(recipe, 1)


def test_placed_overrides_device_and_threads_only_where_they_mean_something():
    recipe = HFRecipe("/m", "bf16", "cpu", None)
    assert recipe.placed("cuda:1", 4) == HFRecipe("/m", "bf16", "cuda:1", 4)
    assert recipe.placed(None, None) == recipe
    wrapped = LatencyRecipe(recipe, 0.1, 0.02).placed("cuda:0", None)
    assert wrapped.inner.device == "cuda:0" and wrapped.uses_device
    target, _ = synthetic_pair(0.5, vocab_size=8)
    assert model_recipe(target).placed("cpu", 2).build() is target
    with pytest.raises(ConfigError, match="no device setting"):
        model_recipe(target).placed("cuda:0", None)


@pytest.mark.hf
def test_hf_models_are_reloaded_from_their_directory(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from dsi.models.hf.model import HFModel
    from tests.transport_support import save_tiny_llama_pair

    from dsi.models.hf.forward_plan import ForwardPlan

    target_dir, _ = save_tiny_llama_pair(tmp_path)
    model = HFModel.load(target_dir, dtype="fp32", device="cpu", threads=1, progress=False)
    recipe = model_recipe(WithLatency(model, 0.05, 0.01))
    assert isinstance(recipe, LatencyRecipe)
    assert recipe.inner == HFRecipe(str(model.source_dir), "fp32", "cpu", 1, False, ForwardPlan())
    model.forward_plan = ForwardPlan("static", kv_cache_len=32)  # the cache and graphs travel with the recipe
    assert pickle.loads(pickle.dumps(model_recipe(model))).build().forward_plan == model.forward_plan
    model.forward_plan = ForwardPlan()
    rebuilt = pickle.loads(pickle.dumps(recipe)).build()
    ids = [3, 5, 7, 11]
    np.testing.assert_array_equal(rebuilt.new_session().extend(ids), model.new_session().extend(ids))
    in_memory = HFModel(model.model)  # built from a module, not loaded from a directory
    try:
        with pytest.raises(ConfigError, match="no source_dir"):
            model_recipe(in_memory)
    finally:
        in_memory.close()


class StubLlama:
    """Stands for dsi.models.llamacpp.LlamaCppModel (what a recipe reads, and load())."""

    loads: list = []

    def __init__(self, gguf_path, n_ctx=64, threads=None, name=None, role=None, deterministic=None):
        self.source_path, self.n_ctx, self.threads, self.name, self.role = gguf_path, n_ctx, threads, name, role
        self.deterministic = False if deterministic is None else deterministic
        self.vocab_size = 8

    @classmethod
    def load(cls, gguf_path, **kwargs):
        cls.loads.append((gguf_path, kwargs))
        return cls(gguf_path, **kwargs)

    def new_session(self):
        raise AssertionError("not used here")

    def __reduce__(self):
        raise TypeError("cannot pickle a llama_model pointer")


@pytest.fixture
def stub_llamacpp(monkeypatch):
    import sys
    import types

    StubLlama.loads = []
    monkeypatch.setitem(sys.modules, "dsi.models.llamacpp", types.SimpleNamespace(LlamaCppModel=StubLlama))
    return StubLlama


def test_llamacpp_models_are_reloaded_from_their_gguf(stub_llamacpp):
    model = StubLlama("/models/t.gguf", n_ctx=128, threads=2, name="default-target", deterministic=False)
    recipe = model_recipe(model)
    assert recipe == LlamaCppRecipe("/models/t.gguf", 128, 2, "default-target", False) and not recipe.uses_device
    wrapped = model_recipe(WithLatency(model, 0.05, 0.01))
    assert isinstance(wrapped, LatencyRecipe) and wrapped.inner == recipe and not wrapped.uses_device
    rebuilt = pickle.loads(pickle.dumps(wrapped)).build()
    assert isinstance(rebuilt, WithLatency) and rebuilt.tpot == 0.01
    assert StubLlama.loads == [("/models/t.gguf", {"n_ctx": 128, "threads": 2, "name": "default-target",
                                                   "role": "target", "deterministic": False})]


def test_a_llamacpp_server_runs_on_the_cpu_with_its_own_threads():
    recipe = LlamaCppRecipe("/m.gguf", 256, None, "m")
    assert recipe.placed(None, None) == recipe
    assert recipe.placed("cpu", 3) == LlamaCppRecipe("/m.gguf", 256, 3, "m")
    assert recipe.placed("CPU", None) == recipe
    for device in ("cuda:0", "cuda", "mps"):
        with pytest.raises(ConfigError, match=rf"device='{device}' given for the llama.cpp model 'm', which runs on "
                                              r"the CPU only; use device 'cpu' \(or none\)"):
            recipe.placed(device, None)
    with pytest.raises(ConfigError, match="runs on the CPU only"):
        LatencyRecipe(recipe, 0.1, 0.02).placed("cuda:1", 1)


@pytest.mark.hf
def test_a_real_llamacpp_model_is_rebuilt_from_its_recipe(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    llamacpp = pytest.importorskip("dsi.models.llamacpp")
    from dsi.errors import ModelError
    from tests.tiny_gguf import write_tiny_gguf

    path, _, _ = write_tiny_gguf(tmp_path / "tiny.gguf", seed=0)
    try:
        model = llamacpp.LlamaCppModel(path, n_ctx=64, threads=1, name="tiny", deterministic=True)
    except ModelError as exc:
        if "pip install" in str(exc):
            pytest.skip(f"the llama.cpp binding is not installed: {exc}")
        raise
    try:
        recipe = model_recipe(model)
        assert recipe == LlamaCppRecipe(str(path), 64, 1, "tiny", True)  # the deterministic mode travels
        rebuilt = pickle.loads(pickle.dumps(recipe.placed("cpu", 2))).build()
        try:
            assert (rebuilt.n_ctx, rebuilt.threads, rebuilt.source_path, rebuilt.deterministic) == (64, 2, path, True)
            ids = [3, 5, 7, 11]
            np.testing.assert_array_equal(rebuilt.new_session().extend(ids), model.new_session().extend(ids))
        finally:
            rebuilt.close()
    finally:
        model.close()


def test_transport_modules_load_neither_torch_nor_ray():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import dsi.transport.processes, dsi.transport.ray, dsi.transport.recipes, dsi.transport.remote\n"
        "loaded = [m for m in ('torch', 'transformers', 'ray', 'llama_cpp') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
