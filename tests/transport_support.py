"""Helpers for the process and Ray transport tests: one loopback Ray cluster per test process,
a tiny HF Llama pair saved to disk, and checks that server processes are really gone."""

from __future__ import annotations

import os
import time

import pytest

from dsi.sampling import SamplingParams

RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # bind 127.0.0.1 only
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",  # the same in every process of the cluster
}

# Ray reads these when it is imported: every test module that may use Ray imports this one first.
os.environ.update(RAY_ENV)

_cluster = None


def ray_cluster():
    """A two-node Ray cluster on loopback, started once per test process, connected.

    Each node has 1 CPU and a custom resource naming it (``head_slot``, ``worker_slot``).
    """
    global _cluster
    ray = pytest.importorskip("ray")
    if _cluster is None:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "include_dashboard": False, "resources": {"head_slot": 8}})
        cluster.add_node(num_cpus=1, resources={"worker_slot": 8})
        ray.init(address=cluster.address)
        _cluster = cluster  # shut down at exit by Cluster(shutdown_at_exit=True)
    return _cluster


def node_ids() -> list[str]:
    import ray

    return [n["NodeID"] for n in ray.nodes() if n["Alive"]]


def pid_gone(pid: int) -> bool:
    psutil = pytest.importorskip("psutil")
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids, timeout: float = 10.0) -> list[int]:
    """Wait until no process in ``pids`` runs; return those still running after ``timeout``."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if p is not None]
    while left and time.monotonic() < deadline:
        left = [p for p in left if not pid_gone(p)]
        if left:
            time.sleep(0.05)
    return left


def dsi_children() -> list[int]:
    """Live spawned (multiprocessing) children of this process: target servers of the process transport."""
    psutil = pytest.importorskip("psutil")
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(child.cmdline()):
                found.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def save_tiny_llama_pair(root) -> tuple[str, str]:
    """A random tiny Llama target and a drafter that agrees with it often (float32), saved to disk.

    The drafter is the target with noise on its LM head, so some drafts are accepted and some
    rejected; ``initializer_range=0.3`` keeps the top two logits apart (no near-ties).
    """
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, eos_token_id=1, bos_token_id=0, pad_token_id=0,
        initializer_range=0.3,
    )
    target = transformers.LlamaForCausalLM(config).eval()
    target_dir, drafter_dir = os.path.join(root, "target"), os.path.join(root, "drafter")
    target.save_pretrained(target_dir)
    with torch.no_grad():
        target.lm_head.weight.add_(0.3 * torch.randn_like(target.lm_head.weight))
    target.save_pretrained(drafter_dir)
    return target_dir, drafter_dir


LAW_VOCAB = 300  # a sampled answer's law: 1,200 bytes (through a shared ring of 1,024-byte buffers and up)
LAW_SAMPLING = SamplingParams(temperature=0.8, seed=3)


def law_model():
    """A target whose sampled answers carry a law of :data:`LAW_VOCAB` float32 entries."""
    from dsi.models import CallableLM
    from dsi.models.emulated.synthetic import SyntheticTarget

    return CallableLM(SyntheticTarget(LAW_VOCAB, seed=5), LAW_VOCAB, name="synthetic")


def law_tasks(start):
    """Sampled chain tasks from id ``start``: four decided on the server (one law back), one with every row's law."""
    from dsi.transport.base import VerifyTask

    return [VerifyTask(start + i, (1, 2, 3 + i, 4), 3, LAW_SAMPLING, draft_probs=(0.5, 0.25)) for i in range(4)] + [
        VerifyTask(start + 4, (4, 3, 2, 1), 3, LAW_SAMPLING)]  # every row's law


def run_tasks(pool, events, tasks):
    """Submit ``tasks``; their results in the same order."""
    from dsi.transport.base import TaskResult

    for task in tasks:
        pool.submit(task)
    got = {}
    while len(got) < len(tasks):
        event = events.get(timeout=30)
        if isinstance(event, TaskResult):
            got[event.task_id] = event
    return [got[t.task_id] for t in tasks]


def assert_same_result(a, b) -> None:
    """Two TaskResults of one task: the same tokens and the same laws, bit for bit."""
    import numpy as np

    np.testing.assert_array_equal(a.tokens, b.tokens)
    if hasattr(b.probs, "laws"):  # decided on the server: the read probabilities and one law
        np.testing.assert_array_equal(a.probs.accept_probs, b.probs.accept_probs)
        assert a.probs.laws.keys() == b.probs.laws.keys()
        for row, law in b.probs.laws.items():
            np.testing.assert_array_equal(a.probs.laws[row], law)
    else:
        np.testing.assert_array_equal(np.asarray([a.probs[i] for i in range(len(a.probs))]),
                                      np.asarray([b.probs[i] for i in range(len(b.probs))]))
