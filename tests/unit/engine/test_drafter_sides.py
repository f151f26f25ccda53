"""The drafter thread's side children (issue 24, DSI's draft trees): each draft reports its side children
(the tree shape's choice among its row's likeliest tokens), and with ``side_depth`` (DSI's ``"branches"``) each
side child continues as a side chain, a token per drafter step, computed in the main path's next forwards: first
the drafter's likeliest token after the child (its greedy draft there, the mode of a sampled request's law), then
the drafts a chain restarted after the child would make."""

from __future__ import annotations

import queue

import numpy as np
import pytest

from dsi.engine.drafter import Draft, DraftsDone, DraftWorker
from dsi.engine.trees import draft_with_alternatives
from dsi.models import WithLatency
from dsi.sampling import Prefix, SamplingParams, draft_from_logits
from dsi.trees import parse_shape
from tests.conftest import random_lm

VOCAB = 12
CONTEXT = (1, 2, 3)


def drafts_of(model, params, shape, side_depth, limit=12):
    """Run one drafter job to its end; its Draft events in order."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    worker = DraftWorker(model, events.put)
    try:
        worker.restart(1, CONTEXT, limit, params, frozenset(), len(CONTEXT), 3, shape.least, shape.sides,
                       side_depth)
        drafts = []
        while not isinstance(event := events.get(timeout=10), DraftsDone):
            assert isinstance(event, Draft)
            drafts.append(event)
        return drafts, worker.forwards
    finally:
        worker.close()


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=4, presence_penalty=0.5)])
@pytest.mark.parametrize("one_forward", [True, False])
@pytest.mark.parametrize("depth", [1, 3])
def test_each_side_chain_is_the_likeliest_token_after_its_child_then_the_chains_own_drafts(params, one_forward,
                                                                                         depth):
    model = WithLatency(random_lm(VOCAB, 3, sharpness=0.7), 0.0, 0.0, one_forward_trees=one_forward)
    shape = parse_shape("branches:0.05")
    limit = 12
    plain, plain_forwards = drafts_of(model, params, shape, side_depth=0, limit=limit)
    drafts, forwards = drafts_of(model, params, shape, side_depth=depth, limit=limit)
    # the main path and its side children are the same: continuing costs the main path nothing
    assert [(d.token, d.sides) for d in drafts] == [(d.token, d.sides) for d in plain]
    assert forwards == plain_forwards  # one drafter step a draft either way (a tree forward where it continues)
    assert all(not d.side_steps for d in plain) and not drafts[0].side_steps
    chains: dict[tuple[int, int], list] = {}
    for draft in drafts:
        grown = [(step.root, step.side) for step in draft.side_steps]
        assert len(grown) == len(set(grown))  # a chain grows by one token a step
        for step in draft.side_steps:
            assert step.side in drafts[step.root].sides and step.root < draft.index
            chain = chains.setdefault((step.root, step.side), [])
            # a chain grows in every step after its child was drafted, up to its depth
            assert draft.index == step.root + 1 + len(chain)
            context = CONTEXT + tuple(d.token for d in drafts[: step.root]) + (step.side, *chain)
            row = np.asarray(model.new_session().extend(list(context))[-1])
            prefix = Prefix(context, len(CONTEXT), frozenset())
            want, want_q = draft_from_logits(row, params, len(context), prefix)
            if not chain:  # the guess: greedy, the chain's own draft; sampled, the mode of the law it is drawn from
                assert step.q is None
                assert step.token == (want if want_q is None else int(np.argmax(want_q)))
                _, _, ranking = draft_with_alternatives(row, params, len(context), prefix, 3)
                assert step.token == ranking[0][0]  # the drafter's likeliest token
            else:  # then what a chain restarted after the child drafts there: the same token and law
                assert step.token == want
                assert (step.q is None) == (want_q is None)
                if want_q is not None:
                    np.testing.assert_allclose(step.q, want_q, atol=1e-12)
            chain.append(step.token)
    assert len(chains) > 3  # side children were there to continue
    for (root, _), chain in chains.items():
        # each chain reached its depth, or the drafts' end
        assert len(chain) == min(depth, limit - 1 - root), (root, chain)
