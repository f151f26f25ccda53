"""Model recipes: which models travel whole, which are re-loaded, and clear errors otherwise."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from dsi.errors import ConfigError
from dsi.models import CallableLM, WithLatency, synthetic_pair
from dsi.transport.recipes import HFRecipe, LatencyRecipe, PickledModel, RecipeModel, model_recipe


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
    from dsi.models.hf import HFModel
    from tests.transport_support import save_tiny_llama_pair

    target_dir, _ = save_tiny_llama_pair(tmp_path)
    model = HFModel.load(target_dir, dtype="fp32", device="cpu", threads=1, progress=False)
    recipe = model_recipe(WithLatency(model, 0.05, 0.01))
    assert isinstance(recipe, LatencyRecipe)
    assert recipe.inner == HFRecipe(str(model.source_dir), "fp32", "cpu", 1)
    rebuilt = pickle.loads(pickle.dumps(recipe)).build()
    ids = [3, 5, 7, 11]
    np.testing.assert_array_equal(rebuilt.new_session().extend(ids), model.new_session().extend(ids))
    in_memory = HFModel(model.model)  # built from a module, not loaded from a directory
    try:
        with pytest.raises(ConfigError, match="no source_dir"):
            model_recipe(in_memory)
    finally:
        in_memory.close()


def test_transport_modules_load_neither_torch_nor_ray():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import dsi.transport.processes, dsi.transport.ray, dsi.transport.recipes, dsi.transport.remote\n"
        "loaded = [m for m in ('torch', 'transformers', 'ray') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
