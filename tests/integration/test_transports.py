"""Process and Ray transports: the same tokens as threads for any SP, and worker failures.

For a fixed seed, greedy and sampled outputs must be identical across threads, processes and Ray
(synthetic models with emulated latency, and a tiny random HF Llama pair loaded from disk in
each server). A target server killed mid-generation (``os.kill`` of the child, ``ray.kill`` of
the actor) must leave the output unchanged and show in the stats; killing every server must
fail fast with a WorkerError and leave no server process behind.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

import dsi
from dsi.engine.api import make_request
from dsi.models import synthetic_pair
from tests.transport_support import dsi_children, ray_cluster, save_tiny_llama_pair, wait_gone

PARAMS = {
    "greedy": dsi.SamplingParams(),
    "sampling": dsi.SamplingParams(temperature=1.0, seed=7),
    # rows processed with the tokens before them, on the server (verification) and the drafter
    "greedy, processed": dsi.SamplingParams(presence_penalty=0.7, repetition_penalty=1.3, logit_bias={5: 2.0}),
    "sampling, processed": dsi.SamplingParams(temperature=0.9, seed=7, frequency_penalty=0.5, logit_bias={2: 1.0},
                                              min_p=0.05, min_tokens=8, stop_token_ids=[0]),
}
PROMPT = [3, 1, 4, 1, 5]
TRANSPORTS = ["processes", pytest.param("ray", marks=pytest.mark.ray)]


@pytest.mark.ray
def test_ray_call_channel_gives_the_same_tokens(synthetic_reference):
    pytest.importorskip("ray")
    use("ray")
    target, drafter = synthetic()
    decoder = dsi.build_decoder(target=target, drafter=drafter, lookahead=3, num_target_servers=2,
                                transport="ray", transport_options={"channel": "ray"})
    try:
        assert [h.channel for h in decoder.pool.handles] == ["ray", "ray"]
        for name, params in PARAMS.items():
            assert run(decoder, params, 40, target.vocab_size).tokens == synthetic_reference[name]
    finally:
        decoder.close()


def use(transport: str) -> None:
    if transport == "ray":
        ray_cluster()


def run(decoder, params, tokens: int, vocab: int, on_tokens=None):
    request = make_request(PROMPT, tokens, params, None, vocab)
    return decoder.generate(request, on_tokens)


def synthetic(target_ms: float = 4.0, drafter_ms: float = 0.5):
    return synthetic_pair(0.7, vocab_size=32, seed=3, target_tpot=target_ms / 1000, drafter_tpot=drafter_ms / 1000)


def outputs(target, drafter, transport: str, servers: int, tokens: int, lookahead: int | str = 3) -> dict:
    decoder = dsi.build_decoder(target=target, drafter=drafter, lookahead=lookahead,
                                num_target_servers=servers, transport=transport)
    try:
        return {name: run(decoder, params, tokens, target.vocab_size) for name, params in PARAMS.items()}
    finally:
        decoder.close()


@pytest.fixture(scope="module")
def synthetic_reference():
    target, drafter = synthetic()
    return {name: out.tokens for name, out in outputs(target, drafter, "threads", 2, 40).items()}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("servers, lookahead", [(1, 3), (2, 3), (3, 3), (1, "auto"), (3, "auto")])
def test_synthetic_same_tokens_as_threads(transport, servers, lookahead, synthetic_reference):
    """The reference is threads with k = 3; event-driven windows must give the same tokens too."""
    use(transport)
    target, drafter = synthetic()
    got = outputs(target, drafter, transport, servers, 40, lookahead)
    for name in PARAMS:
        assert got[name].tokens == synthetic_reference[name], name
        assert got[name].stats.rejections > 0 and got[name].stats.accepted_tokens > 0
    assert not dsi_children()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_logprobs_from_remote_servers_equal_those_of_threads(transport, no_thread_leak):
    """The log-probability rows travel with the verification results: the same numbers as threads."""
    use(transport)
    target, drafter = synthetic()
    runs = {}
    for name in ("threads", transport):
        decoder = dsi.build_decoder(target=target, drafter=drafter, lookahead=3, num_target_servers=2, transport=name)
        try:
            request = make_request(PROMPT, 24, PARAMS["sampling, processed"], None, target.vocab_size, logprobs=3,
                                   logprobs_mode="processed")
            runs[name] = decoder.generate(request)
        finally:
            decoder.close()
    assert runs[transport].tokens == runs["threads"].tokens
    assert runs[transport].logprobs == runs["threads"].logprobs and len(runs["threads"].logprobs) == 24


@pytest.mark.parametrize("transport, tree", [
    ("processes", "2"), ("processes", "branches:0.05"),
    pytest.param("ray", "2", marks=[pytest.mark.ray, pytest.mark.slow]),
])
def test_tree_windows_travel_to_remote_servers(transport, tree, no_thread_leak):
    """Tree tasks (issue 24) are pickled with their tree and each path's rows are processed on the server:
    the same tokens and logprobs as threads, greedy and sampled (``branches``: side children with the
    drafter's draft after each, two levels below the main path)."""
    use(transport)
    target, drafter = synthetic()
    runs = {}
    for name in ("threads", transport):
        decoder = dsi.build_decoder(target=target, drafter=drafter, lookahead=3, num_target_servers=2, transport=name,
                                    draft_tree=tree)
        try:
            runs[name] = [decoder.generate(make_request(PROMPT, 24, PARAMS[p], None, target.vocab_size, logprobs=2))
                          for p in ("greedy, processed", "sampling, processed")]
        finally:
            decoder.close()
    for got, want in zip(runs[transport], runs["threads"], strict=True):
        assert got.tokens == want.tokens and got.logprobs == want.logprobs
        assert got.stats.extra["tree_windows"] > 0


# ---- a tiny random Llama pair, re-loaded from disk by every process / actor --------------------------------
@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from dsi.models.hf.model import HFModel

    target_dir, drafter_dir = save_tiny_llama_pair(tmp_path_factory.mktemp("llama"))
    target = HFModel.load(target_dir, dtype="fp32", device="cpu", threads=1, progress=False)
    drafter = HFModel.load(drafter_dir, dtype="fp32", device="cpu", threads=1, progress=False)
    reference = {name: out.tokens for name, out in outputs(target, drafter, "threads", 2, 24).items()}
    greedy_ar = dsi.generate(target=target, prompt=PROMPT, method="ar", max_new_tokens=24).tokens
    assert reference["greedy"] == greedy_ar
    return target, drafter, reference


@pytest.mark.hf
@pytest.mark.slow  # every server process / actor imports torch and loads the model: ~5 s each here
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("servers, lookahead", [(1, 3), (2, 3), (3, 3), (2, "auto")])
def test_hf_llama_same_tokens_as_threads(transport, servers, lookahead, llama_pair):
    use(transport)
    target, drafter, reference = llama_pair
    got = outputs(target, drafter, transport, servers, 24, lookahead)
    for name in PARAMS:
        assert got[name].tokens == reference[name], name
    assert got["sampling"].stats.rejections > 0 and got["greedy"].stats.accepted_tokens > 0


@pytest.mark.hf
@pytest.mark.slow  # every server process / actor imports torch and loads the model
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_in_the_deterministic_mode_bf16_dsi_on_other_processes_equals_non_si(transport, tmp_path):
    """The mode travels with the recipe: bf16 servers in processes / Ray actors compute every token alone,
    so greedy DSI equals in-process non-SI bit for bit and seeded sampling equals the thread transport's."""
    use(transport)
    from dsi.models.hf.model import HFModel

    target_dir, drafter_dir = save_tiny_llama_pair(tmp_path)
    target = HFModel.load(target_dir, dtype="bf16", device="cpu", threads=1, progress=False)
    drafter = HFModel.load(drafter_dir, dtype="bf16", device="cpu", threads=1, progress=False)
    target.deterministic = drafter.deterministic = True
    greedy_ar = dsi.generate(target=target, prompt=PROMPT, method="ar", max_new_tokens=24).tokens
    threads = outputs(target, drafter, "threads", 2, 24, "auto")
    got = outputs(target, drafter, transport, 2, 24, "auto")
    assert got["greedy"].tokens == threads["greedy"].tokens == greedy_ar
    assert got["sampling"].tokens == threads["sampling"].tokens


# ---- worker failures ---------------------------------------------------------------------------------------
def kill_server(pool, server: int) -> None:
    if hasattr(pool, "server_pids"):
        os.kill(pool.server_pids()[server], signal.SIGKILL)
    else:
        import ray

        ray.kill(pool.actors()[server])


def server_pids(pool) -> list[int]:
    if hasattr(pool, "server_pids"):
        return list(pool.server_pids())
    return [h.pid for h in pool.handles]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_killing_a_busy_server_mid_generation_keeps_the_output(transport, no_thread_leak):
    use(transport)
    target, drafter = synthetic(target_ms=20.0, drafter_ms=2.0)
    params = PARAMS["sampling"]
    reference = dsi.generate(target=target, drafter=drafter, prompt=PROMPT, max_new_tokens=40, lookahead=2,
                             num_target_servers=3, sampling=params).tokens
    decoder = dsi.build_decoder(target=target, drafter=drafter, lookahead=2, num_target_servers=3,
                                transport=transport)
    pool = decoder.pool
    pids = server_pids(pool)
    victims = []

    def hook(tokens):
        if not victims and len(hook.seen) >= 10:
            busy = pool.busy_servers()
            victims.append(busy[0] if busy else None)
            if busy:
                kill_server(pool, busy[0])
        hook.seen.extend(tokens)

    hook.seen = []
    try:
        out = run(decoder, params, 40, target.vocab_size, hook)
        assert victims and victims[0] is not None  # a server was running a task when it was killed
        assert out.tokens == reference
        assert out.stats.extra["dead_servers"] == 1
        assert pool.alive_servers() == 3  # the replacement counts while it starts (restart_dead is the default)
        again = run(decoder, params, 40, target.vocab_size)  # the pool keeps serving
        assert again.tokens == reference
        pids += server_pids(pool)
    finally:
        decoder.close()
    assert wait_gone(pids) == []


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_killing_every_server_fails_fast_and_leaves_no_process(transport, no_thread_leak):
    use(transport)
    target, drafter = synthetic(target_ms=20.0, drafter_ms=2.0)
    decoder = dsi.build_decoder(target=target, drafter=drafter, lookahead=2, num_target_servers=2,
                                transport=transport, transport_options={"restart_dead": False})
    pool = decoder.pool
    pids = server_pids(pool)
    killed_at = []

    def hook(tokens):
        if not killed_at:
            killed_at.append(time.monotonic())
            for server in range(pool.num_servers):
                kill_server(pool, server)

    try:
        with pytest.raises(dsi.WorkerError, match="no target server is alive"):
            run(decoder, PARAMS["greedy"], 200, target.vocab_size, hook)
        assert time.monotonic() - killed_at[0] < 10.0
    finally:
        decoder.close()
    assert wait_gone(pids) == []
    assert not dsi_children()
