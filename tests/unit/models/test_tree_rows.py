"""Verification rows of a draft tree on any session (dsi.models.base.tree_rows): every node's row is
the row of its own path, each node is computed once, and the session keeps the main path."""

from __future__ import annotations

import numpy as np
import pytest

from dsi.errors import ConfigError
from dsi.models.base import forward_rows, tree_rows
from dsi.models.emulated.callable import CallableLM
from dsi.trees import ROOT, DraftTree

VOCAB = 11
PREFIX = [3, 1, 4, 1, 5]
#        root
#      0(2)    1(7)   2(9)
#    3(6) 4(8)
#    5(3)
TREE = DraftTree((2, 7, 9, 6, 8, 3), (ROOT, ROOT, ROOT, 0, 0, 3))


def _next_logits(context):
    rng = np.random.default_rng(abs(hash(tuple(context))) % 2**32)
    return rng.normal(size=VOCAB)


class Counting(CallableLM):
    """A CallableLM that counts the tokens its sessions run."""

    def __init__(self):
        super().__init__(_next_logits, VOCAB)
        self.runs = 0

    def new_session(self):
        session = super().new_session()
        extend = session.extend

        def counted(tokens, cancel=None):
            self.runs += len(tokens)
            return extend(tokens, cancel)

        session.extend = counted
        return session


def test_every_row_is_its_own_paths_row_and_each_node_runs_once():
    model = Counting()
    session = model.new_session()
    rows = tree_rows(session, PREFIX, TREE)
    assert rows.shape == (1 + len(TREE), VOCAB)
    np.testing.assert_array_equal(rows[0], _next_logits(PREFIX))
    for node in range(len(TREE)):
        np.testing.assert_array_equal(rows[1 + node], _next_logits(PREFIX + TREE.path_tokens(node)))
    assert model.runs == len(PREFIX) + len(TREE)  # the prefix once, then each node once
    assert session.tokens == tuple(PREFIX + TREE.path_tokens(TREE.main_path()[-1]))  # the main path kept
    ids = tree_rows(session, PREFIX, TREE, greedy=True)
    assert ids.tolist() == np.argmax(rows, axis=-1).tolist()


def test_a_chain_tree_has_the_chain_rows_and_a_warm_session_is_reused():
    model = Counting()
    session = model.new_session()
    forward_rows(session, PREFIX + [2, 6], 1)  # a cache from an earlier window
    chain = DraftTree.chain([2, 6, 3])
    want = forward_rows(CallableLM(_next_logits, VOCAB).new_session(), PREFIX + [2, 6, 3], 4)
    before = model.runs
    rows = tree_rows(session, PREFIX, chain)
    np.testing.assert_array_equal(rows, want)
    assert model.runs - before == 4  # the prefix's last token and the three drafts, nothing twice
    with pytest.raises(ConfigError, match="after a prefix"):
        tree_rows(session, [], chain)


def test_hf_and_llamacpp_sessions_give_each_node_its_paths_row(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from dsi.models.hf.model import HFModel
    from tests.unit.models.test_hf import reference, tiny_llama

    raw = tiny_llama()
    model = HFModel(raw)
    rows = tree_rows(model.new_session(), PREFIX, TREE)
    for node in [ROOT, *range(len(TREE))]:
        path = [] if node == ROOT else TREE.path_tokens(node)
        np.testing.assert_allclose(rows[0 if node == ROOT else 1 + node], reference(raw, PREFIX + path)[-1],
                                   atol=1e-5)
    pytest.importorskip("llama_cpp")
    from dsi.models.llamacpp import LlamaCppModel
    from tests.tiny_gguf import write_tiny_gguf

    path, _, _ = write_tiny_gguf(tmp_path / "m.gguf", seed=3, layers=1)
    gguf = LlamaCppModel(path, threads=1)
    try:
        rows = tree_rows(gguf.new_session(), PREFIX, TREE)
        for node in range(len(TREE)):
            alone = forward_rows(gguf.new_session(), PREFIX + TREE.path_tokens(node), 1)[0]
            np.testing.assert_allclose(rows[1 + node], alone, atol=1e-3)
    finally:
        gguf.close()


def test_a_latency_model_charges_a_tree_as_one_forward_and_a_cpu_like_one_per_token():
    """WithLatency (GPU-like): a tree of 4 paths takes one forward's time, not one per path, with the same
    rows; with ``token_s`` (CPU-like) the time grows with the tokens computed. Lower bounds are sleeps, so
    exact; the upper bound has a margin of most of a forward."""
    import time

    from dsi.models.emulated.latency import WithLatency

    gpu = WithLatency(CallableLM(_next_logits, VOCAB), ttft=0.0, tpot=0.2)
    session = gpu.new_session()
    forward_rows(session, PREFIX, 1)  # prefilled: later forwards cost tpot
    start = time.perf_counter()
    rows = tree_rows(session, PREFIX, TREE)
    elapsed = time.perf_counter() - start
    assert len(TREE.paths()) == 4 and 0.2 <= elapsed < 0.35  # one forward per path would take 0.8 s
    np.testing.assert_array_equal(rows, tree_rows(CallableLM(_next_logits, VOCAB).new_session(), PREFIX, TREE))
    assert session.tokens == tuple(PREFIX + TREE.path_tokens(TREE.main_path()[-1]))

    cpu = WithLatency(CallableLM(_next_logits, VOCAB), ttft=0.0, tpot=0.0, token_s=0.05)
    session = cpu.new_session()
    forward_rows(session, PREFIX, 1)
    start = time.perf_counter()
    tree_rows(session, PREFIX, TREE)  # the prefix's last token again (the root row) and 6 nodes
    assert time.perf_counter() - start >= 7 * 0.05
    start = time.perf_counter()
    forward_rows(session, PREFIX + [2, 6, 3, 1, 1], 1)  # 2 new tokens after the main path the tree left
    assert 2 * 0.05 <= time.perf_counter() - start < 5 * 0.05

    paths = WithLatency(CallableLM(_next_logits, VOCAB), ttft=0.0, tpot=0.1, one_forward_trees=False)
    session = paths.new_session()
    assert not session.one_forward_trees and "one_forward_trees=False" in repr(paths)
    forward_rows(session, PREFIX, 1)
    start = time.perf_counter()
    np.testing.assert_array_equal(tree_rows(session, PREFIX, TREE), rows)
    assert time.perf_counter() - start >= 4 * 0.1  # a backend without the kernel: one forward per path
    with pytest.raises(ConfigError, match="one_forward_trees="):
        WithLatency(CallableLM(_next_logits, VOCAB), ttft=0.0, tpot=0.1, one_forward_trees="no")


def test_a_latency_model_verifies_a_tree_with_its_inner_sessions_own_tree_kernel():
    """WithLatency times a tree as one forward and takes its rows from the wrapped session's own ``tree_rows``
    where it has one (a real backend's kernel), with the session left holding the main path; without one, path
    by path (the same rows here)."""
    from dsi.models.base import path_tree_rows
    from dsi.models.emulated.latency import WithLatency

    class Kernel(CallableLM):
        def __init__(self):
            super().__init__(_next_logits, VOCAB)
            self.trees = 0

        def new_session(self):
            session = super().new_session()
            model = self

            def own(prefix, tree, cancel=None, *, greedy=False, top=None):
                model.trees += 1
                return path_tree_rows(session, prefix, tree, cancel, greedy=greedy, top=top) + 1.0  # marked

            session.tree_rows = own
            return session

    kernel = Kernel()
    session = WithLatency(kernel, ttft=0.0, tpot=0.001).new_session()
    rows = tree_rows(session, PREFIX, TREE)
    plain = tree_rows(CallableLM(_next_logits, VOCAB).new_session(), PREFIX, TREE)
    assert kernel.trees == 1
    np.testing.assert_array_equal(rows, plain + 1.0)  # the kernel's rows, not rows computed path by path
    assert session.tokens == tuple(PREFIX + TREE.path_tokens(TREE.main_path()[-1]))


@pytest.mark.parametrize("plan", ["dynamic", "static", "padded"])
@pytest.mark.parametrize("family, attention", [("llama", "sdpa"), ("llama", "eager"), ("gpt2", "sdpa")])
def test_hf_verifies_a_tree_in_one_forward_and_keeps_exactly_the_main_path(family, attention, plan):
    """A 4D tree mask with position ids by depth: one model forward for the whole tree (from a warm session
    that holds part of the prefix), every row its path's row, and afterwards the cache of the prefix and
    the main path only: the same keys and values as a fresh session that ran just those, and the same next
    rows. A cancelled tree forward leaves the session as it was up to the prefix it kept."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch

    from dsi.errors import TaskCancelled
    from dsi.models.hf.model import HFModel
    from tests.unit.models.test_hf import MODELS, PLANS, reference

    raw = MODELS[family]()
    raw.config._attn_implementation = attention
    model = HFModel(raw, forward_plan=PLANS[plan])
    assert model.one_forward_trees
    assert not HFModel(raw, deterministic=True).one_forward_trees  # the canonical cut: one token a forward
    assert model.new_session().one_forward_trees
    assert not HFModel(raw, deterministic=True).new_session().one_forward_trees
    calls = []
    hook = raw.register_forward_pre_hook(lambda module, args: calls.append(1))
    session = model.new_session()
    forward_rows(session, PREFIX[:3] + [9, 9], 1)  # a cache that shares 3 prefix tokens
    calls.clear()
    rows = tree_rows(session, PREFIX, TREE)
    assert len(calls) == 1  # one forward for the prefix's rest and all 6 nodes
    for node in [ROOT, *range(len(TREE))]:
        path = [] if node == ROOT else TREE.path_tokens(node)
        np.testing.assert_allclose(rows[0 if node == ROOT else 1 + node], reference(raw, PREFIX + path)[-1],
                                   atol=1e-5)
    kept = PREFIX + TREE.path_tokens(TREE.main_path()[-1])
    assert session.tokens == tuple(kept)
    fresh = model.new_session()
    forward_rows(fresh, kept, 1)
    for mine, theirs in zip(session._cache.layers, fresh._cache.layers, strict=True):  # (a static cache: its kept part)
        torch.testing.assert_close(mine.keys[:, :, :len(kept)], theirs.keys[:, :, :len(kept)], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values[:, :, :len(kept)], theirs.values[:, :, :len(kept)], atol=1e-5,
                                   rtol=1e-5)
        assert mine.keys.shape == theirs.keys.shape
    np.testing.assert_allclose(forward_rows(session, kept + [4, 2], 2), forward_rows(fresh, kept + [4, 2], 2),
                               atol=1e-5)
    greedy = tree_rows(model.new_session(), PREFIX, TREE, greedy=True)
    assert greedy.tolist() == np.argmax(rows, axis=-1).tolist()
    hook.remove()

    class CancelAfterFirstLayer:
        def __init__(self):
            self.checks = 0

        def is_set(self):
            self.checks += 1
            return self.checks > 2

    session = model.new_session()
    forward_rows(session, PREFIX, 1)
    with pytest.raises(TaskCancelled):
        tree_rows(session, PREFIX, TREE, CancelAfterFirstLayer())
    assert session.tokens == tuple(PREFIX[:-1])  # the kept prefix (its last token is run again for the root row)
    np.testing.assert_allclose(forward_rows(session, PREFIX, 1)[0], reference(raw, PREFIX)[-1], atol=1e-5)


def test_llamacpp_verifies_a_tree_in_one_decode_with_a_sequence_per_path(tmp_path):
    """One ``llama_decode`` for the prefix's rest and every node (each path a sequence of its own sharing the
    prefix's cells); afterwards only sequence 0 is left, holding the prefix and the main path: the next rows
    are a fresh session's. A cancel restores the kept prefix. Deterministic mode goes path by path."""
    pytest.importorskip("llama_cpp")
    from dsi.errors import TaskCancelled
    from dsi.models.llamacpp import LlamaCppModel
    from tests.tiny_gguf import write_tiny_gguf

    path, _, _ = write_tiny_gguf(tmp_path / "m.gguf", seed=4, layers=2)
    gguf = LlamaCppModel(path, threads=1)
    try:
        session = gguf.new_session()
        forward_rows(session, PREFIX[:2] + [9], 1)  # a warm cache sharing 2 prefix tokens
        decodes = []
        real = session._ll.llama_decode

        class Counting:  # the session's binding with llama_decode counted
            def __getattr__(self, name):
                return getattr(session._ll_real, name)

            def llama_decode(self, ctx, batch):
                decodes.append(batch.n_tokens)
                return real(ctx, batch)

        session._ll_real, session._ll = session._ll, Counting()
        rows = tree_rows(session, PREFIX, TREE)
        assert decodes == [len(PREFIX) - 2 + len(TREE)]  # one decode: 3 prefix tokens and 6 nodes
        session._ll = session._ll_real
        for node in [ROOT, *range(len(TREE))]:
            tokens = PREFIX + ([] if node == ROOT else TREE.path_tokens(node))
            np.testing.assert_allclose(rows[0 if node == ROOT else 1 + node],
                                       forward_rows(gguf.new_session(), tokens, 1)[0], atol=1e-3)
        kept = PREFIX + TREE.path_tokens(TREE.main_path()[-1])
        assert session.tokens == tuple(kept)
        np.testing.assert_allclose(forward_rows(session, kept + [4, 2], 2),
                                   forward_rows(gguf.new_session(), kept + [4, 2], 2), atol=1e-3)
        assert tree_rows(gguf.new_session(), PREFIX, TREE, greedy=True).tolist() == np.argmax(rows, -1).tolist()

        class Cancelled:
            def is_set(self):
                return True

        session = gguf.new_session()
        forward_rows(session, PREFIX, 1)
        with pytest.raises(TaskCancelled):
            tree_rows(session, PREFIX, TREE, Cancelled())
        assert session.tokens == tuple(PREFIX[:-1])
        np.testing.assert_allclose(forward_rows(session, PREFIX, 1)[0], forward_rows(gguf.new_session(), PREFIX, 1)[0],
                                   atol=1e-3)
        assert gguf.new_session().one_forward_trees
        gguf.deterministic = True  # the canonical cut (path by path, one token a forward): bitwise a fresh run's rows
        assert not gguf.new_session().one_forward_trees
        rows = tree_rows(gguf.new_session(), PREFIX, TREE)
        for node in range(len(TREE)):
            np.testing.assert_array_equal(rows[1 + node],
                                          forward_rows(gguf.new_session(), PREFIX + TREE.path_tokens(node), 1)[0])
    finally:
        gguf.close()


@pytest.mark.parametrize("plan", ["dynamic", "static", "padded"])
def test_hf_keeps_a_tree_s_main_path_without_moving_keys_and_values(plan):
    """The main path is computed first in a tree's forward, so it lands where a chain's tokens would and the cache
    keeps it by its length alone: the torch calls a tree verification makes outside the model's forward are the
    same for a model of 2 layers and of 6, views aside (a dynamic cache is cropped to a view in each layer; moving
    the main path's keys and values took copies in every layer: on a GPU, about 200 launches for a 48-layer 14B)."""
    from dsi.models.hf.model import HFModel
    from tests.torch_calls import TorchCalls
    from tests.unit.models.test_hf import PLANS, tiny_llama

    def calls_outside_the_model(layers: int) -> list[str]:
        raw = tiny_llama(layers=layers)
        session = HFModel(raw, forward_plan=PLANS[plan]).new_session()
        forward_rows(session, PREFIX[:3], 1)
        with TorchCalls(outside=raw) as calls:
            tree_rows(session, PREFIX, TREE)
        assert session.tokens == tuple(PREFIX + TREE.path_tokens(TREE.main_path()[-1]))
        return calls.work()

    assert calls_outside_the_model(2) == calls_outside_the_model(6)
