"""The tiny random fp32 Llamas the engine tests serve (head size 32, which vLLM's CPU attention
supports), as module-scoped pytest fixtures: a module imports the ones it uses.

- ``dirs``: checkpoint directories: ``target`` (2 layers, hidden 128), ``drafter`` (1 layer, hidden 64)
  and ``other`` (the target's shape and vocabulary, other weights);
- ``local``: (target, drafter, same) loaded here, ``same`` being the target's weights as a drafter
  (every draft accepted);
- ``prompts``: :data:`PROMPTS` as target ids; ``reference``: the local non-SI greedy output of each,
  :data:`TOKENS` tokens;
- ``dsi_engines``: two ``dsi serve --method ar`` engines of the target; ``vllm_engines``: two vLLM engines of it
  (skipped without the vLLM venv); ``engines``: each of them in turn (vLLM in the slow run).
"""

from __future__ import annotations

import pytest

PROMPTS = ["def add(a, b):", "for i in range(10):\n", "The quick brown fox"]
TOKENS = 24


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from tests.tiny_hf import make_model_dir

    root = tmp_path_factory.mktemp("engines")
    return {
        "target": str(make_model_dir(root / "target", seed=0, layers=2, hidden=128)),
        "drafter": str(make_model_dir(root / "drafter", seed=1, layers=1, hidden=64)),
        "other": str(make_model_dir(root / "other", seed=7, layers=2, hidden=128)),  # same vocabulary, other weights
    }


@pytest.fixture(scope="module")
def local(dirs):
    from dsi.models.loading import load_model, load_pair

    target, drafter = load_pair(dirs["target"], dirs["drafter"], dtype="fp32", progress=False, threads=1)
    same = load_model(dirs["target"], role="drafter", dtype="fp32", progress=False, threads=1)  # accepts everything
    return target, drafter, same


@pytest.fixture(scope="module")
def prompts(local):
    return [local[0].encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(local, prompts):
    """The local non-SI greedy output of each prompt."""
    import dsi

    target = local[0]
    return [dsi.generate(target=target, prompt=p, method="ar", max_new_tokens=TOKENS).tokens for p in prompts]


@pytest.fixture(scope="module")
def dsi_engines(dirs):
    from tests.engine_servers import start_all, start_dsi_serve

    servers = start_all([lambda: start_dsi_serve(dirs["target"]) for _ in range(2)])
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def vllm_engines(dirs):
    from tests.engine_servers import start_all, start_vllm, vllm_python

    if vllm_python() is None:
        pytest.skip("no vLLM venv: bash packaging/vllm-venv.sh builds it (CI does)")
    servers = start_all([lambda: start_vllm(dirs["target"]) for _ in range(2)])
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module", params=["dsi-serve", pytest.param("vllm", marks=pytest.mark.slow)])
def engines(request):
    return request.getfixturevalue("dsi_engines" if request.param == "dsi-serve" else "vllm_engines")
