"""Helpers for the process and Ray transport tests: one loopback Ray cluster per test process,
a tiny HF Llama pair saved to disk, and checks that server processes are really gone."""

from __future__ import annotations

import os
import time

import pytest

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
