"""Verification rows of a draft tree on any session (dsi.models.base.tree_rows): every node's row is
the row of its own path, each node is computed once, and the session keeps the main path."""

from __future__ import annotations

import numpy as np
import pytest

from dsi.errors import ConfigError
from dsi.models.base import forward_rows, tree_rows
from dsi.models.callable import CallableLM
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
    from dsi.models.hf import HFModel
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
