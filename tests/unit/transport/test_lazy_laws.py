"""Sampled tree tasks hand their laws out as they are read (:class:`dsi.sampling.LazyLaws`): each law is
bitwise what processing every row at once gives, rows off the walked path are never processed, and the rows
travel (pickle, the processes and Ray transports) as the raw logits."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from dsi.errors import ConfigError, ModelError
from dsi.models import CallableLM
from dsi.sampling import LazyLaws, SamplingParams, process_rows
from dsi.transport.base import VerifyTask
from dsi.transport.server import read_rows, run_verify_task
from dsi.trees import DraftTree

VOCAB = 23
PARAMS = [
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=1.3, top_k=5, top_p=0.8, seed=2),
    SamplingParams(temperature=0.9, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.4,
                   presence_penalty=0.2, logit_bias={3: 2.5, 7: -1.0}, min_tokens=6, seed=3),
]


def _model() -> CallableLM:
    def logits(context) -> np.ndarray:
        rng = np.random.default_rng(abs(hash(tuple(context))) % 2**32)
        return (rng.normal(size=VOCAB) * 2.0).astype(np.float32)

    return CallableLM(logits, VOCAB, name="hashed rows")


TREE = DraftTree(tokens=(4, 9, 2, 5, 7, 1, 8), parents=(-1, -1, 0, 0, 1, 2, 2))


@pytest.mark.parametrize("params", PARAMS)
def test_a_tree_tasks_lazy_laws_are_bitwise_the_eager_ones_and_only_read_rows_are_processed(params):
    context = (1, 2, 3, 4, 5, 6)
    task = VerifyTask(0, context, 1 + len(TREE), params, prompt_len=3, stop_ids=frozenset({0}), tree=TREE)
    result = run_verify_task(_model().new_session(), task, 0, None)
    assert isinstance(result.probs, LazyLaws)
    assert result.probs.computed() == 0
    eager = VerifyTask(0, context, 1 + len(TREE), params, prompt_len=3, stop_ids=frozenset({0}), tree=TREE,
                       logprobs_mode="processed")  # logprobs keep the rows processed on the server
    reference = run_verify_task(_model().new_session(), eager, 0, None)
    assert isinstance(reference.probs, np.ndarray)
    np.testing.assert_array_equal(result.tokens, reference.tokens)
    for row in (0, 3, 6):  # the root, a depth-2 node, a depth-3 node
        assert np.array_equal(result.probs[row], reference.probs[row])
    assert result.probs.computed() == 3
    # every row against the processing of its own path, computed by hand
    for node in range(len(TREE)):
        path = context + tuple(TREE.path_tokens(node))
        want = process_rows(_model().new_session().extend(path)[-1:], params, path, 3, frozenset({0}))[0]
        assert np.array_equal(result.probs[1 + node], want)
    assert np.array_equal(np.asarray(result.probs), reference.probs)


@pytest.mark.parametrize("params", PARAMS)
def test_lazy_laws_of_a_chain_are_process_rows_and_pickle_as_the_raw_rows(params):
    rows = np.random.default_rng(0).normal(size=(5, VOCAB)).astype(np.float32)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    lazy = LazyLaws.of_chain(rows, params, tokens, 2, frozenset({0}))
    eager = process_rows(rows, params, tokens, 2, frozenset({0}))
    assert np.array_equal(lazy[-1], eager[-1]) and np.array_equal(lazy[1], eager[1])
    copy = pickle.loads(pickle.dumps(lazy))
    assert copy.computed() == 0 and lazy.computed() == 2  # the processed rows stay behind
    assert np.array_equal(np.asarray(copy), eager)
    wide = np.random.default_rng(1).normal(size=(5, 4000)).astype(np.float32)
    wide_laws = process_rows(wide, params, tokens, 2, frozenset({0}))
    # the raw float32 rows travel, no processed law (the same bytes as the float32 laws, plus the small fields)
    lazy_wide = LazyLaws.of_chain(wide, params, tokens, 2)
    lazy_wide[0]
    assert len(pickle.dumps(lazy_wide)) < len(pickle.dumps(wide_laws)) + 1000
    assert pickle.loads(pickle.dumps(lazy_wide)).computed() == 0


def test_lazy_laws_refuse_what_they_cannot_hold():
    rows = np.zeros((2, VOCAB), dtype=np.float32)
    with pytest.raises(ConfigError, match="greedy"):
        LazyLaws.of_chain(rows, SamplingParams(temperature=0.0), [1, 2], 0)
    with pytest.raises(ConfigError, match="2 rows need as many"):
        LazyLaws(rows, PARAMS[0], [[1, 2]], [0], [1, 2], 0)
    lazy = LazyLaws.of_chain(rows, PARAMS[0], [1, 2], 0)
    with pytest.raises(IndexError, match="row 2 of 2"):
        lazy[2]
    with pytest.raises(TypeError, match="integer index"):
        lazy[0:1]


def test_a_broken_row_in_a_sampled_tree_fails_on_the_server_even_off_the_walked_path():
    def logits(context) -> np.ndarray:
        row = np.zeros(VOCAB, dtype=np.float32)
        if context[-1] == 8:  # node 6, a leaf off the main path
            row[2] = np.nan
        return row

    task = VerifyTask(0, (1, 2), 1 + len(TREE), PARAMS[0], tree=TREE)
    with pytest.raises(ModelError, match="NaN"):
        run_verify_task(CallableLM(logits, VOCAB).new_session(), task, 0, None)


@pytest.mark.parametrize("params", PARAMS)
def test_a_sampled_chain_task_hands_out_lazy_laws_and_logprobs_keep_them_processed(params):
    context = (1, 2, 3, 4, 5)
    lazy = run_verify_task(_model().new_session(), VerifyTask(0, context, 3, params, prompt_len=2), 0, None)
    eager = run_verify_task(_model().new_session(), VerifyTask(0, context, 3, params, prompt_len=2,
                                                                logprobs_mode="processed"), 0, None)
    assert isinstance(lazy.probs, LazyLaws) and isinstance(eager.probs, np.ndarray)
    assert np.array_equal(lazy.probs[0], eager.probs[0]) and lazy.probs.computed() == 1
    assert np.array_equal(np.asarray(lazy.probs), eager.probs)
    np.testing.assert_array_equal(lazy.tokens, eager.tokens)
    tokens, probs, _ = read_rows(_model().new_session().extend(context)[-3:], VerifyTask(0, context, 3, params,
                                                                                          prompt_len=2))
    assert np.array_equal(np.asarray(lazy.probs), probs)
