"""The drafter thread's side children (issue 24, DSI's draft trees): each draft reports its side children
(the tree shape's choice among its row's likeliest tokens), and with ``continue_sides`` (DSI's
``"branches"``) the next draft reports the drafter's likeliest token after each side child (its greedy draft
there, the mode of a sampled request's law), computed in the main path's next forward."""

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


def drafts_of(model, params, shape, continue_sides, limit=12):
    """Run one drafter job to its end; its Draft events in order."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    worker = DraftWorker(model, events.put)
    try:
        worker.restart(1, CONTEXT, limit, params, frozenset(), len(CONTEXT), 3, shape.least, shape.sides,
                       continue_sides)
        drafts = []
        while not isinstance(event := events.get(timeout=10), DraftsDone):
            assert isinstance(event, Draft)
            drafts.append(event)
        return drafts, worker.forwards
    finally:
        worker.close()


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=4, presence_penalty=0.5)])
@pytest.mark.parametrize("one_forward", [True, False])
def test_each_side_childs_continuation_is_the_drafters_likeliest_token_there(params, one_forward):
    model = WithLatency(random_lm(VOCAB, 3, sharpness=0.7), 0.0, 0.0, one_forward_trees=one_forward)
    shape = parse_shape("branches:0.05")
    plain, plain_forwards = drafts_of(model, params, shape, continue_sides=False)
    drafts, forwards = drafts_of(model, params, shape, continue_sides=True)
    # the main path and its side children are the same: continuing costs the main path nothing
    assert [(d.token, d.sides) for d in drafts] == [(d.token, d.sides) for d in plain]
    assert forwards == plain_forwards  # one drafter step a draft either way (a tree forward where it continues)
    assert all(not d.after_sides for d in plain) and not drafts[0].after_sides
    continued = 0
    for previous, draft in zip(drafts, drafts[1:]):
        assert [side for side, _ in draft.after_sides] == list(previous.sides)
        before = CONTEXT + tuple(d.token for d in drafts[: previous.index])
        for side, token in draft.after_sides:
            context = (*before, side)
            row = np.asarray(model.new_session().extend(list(context))[-1])
            want, want_q = draft_from_logits(row, params, len(context), Prefix(context, len(CONTEXT), frozenset()))
            # greedy: the chain's own draft there; sampled: the mode of the law the chain draws it from
            assert token == (want if want_q is None else int(np.argmax(want_q)))
            _, _, ranking = draft_with_alternatives(row, params, len(context), Prefix(context, len(CONTEXT),
                                                                                      frozenset()), 3)
            assert token == ranking[0][0]  # the drafter's likeliest token
            continued += 1
    assert continued > 3  # side children were there to continue
