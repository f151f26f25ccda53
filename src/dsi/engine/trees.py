"""Tree windows in the engines (issue 24): a drafter that proposes tree nodes, and the decision of a
verified tree against its task's result.

- :class:`TreeDrafter` is the oracle :func:`dsi.trees.grow` calls, on one drafter session: one
  drafter forward per node that gets children, reusing the session's cache along the path (a side
  path truncates back to where it branches). Its main token is the chain's own draft at that
  position (the argmax of the processed row, or the DRAFT-uniform sample of the processed law ``q``),
  so the main path is exactly what a chain would draft; the side tokens are the next most likely
  under the drafter's processed law (greedy: the softmax of its processed logits).
- :func:`decide_tree` walks a tree task's result (:func:`dsi.trees.walk`): each node with children
  is decided as the chain decides its main child (:func:`dsi.sampling.decide`, the uniforms of the
  absolute position), so the committed tokens never depend on the tree; a walk that ends on a leaf
  takes the target's own token there (a bonus, as after a chain whose drafts were all accepted).
- :func:`request_shape` is the shape a request drafts with: chains where the drafter cannot branch (a
  drafter of another vocabulary in string mode proposes one settled target token per position, with no
  law over alternatives).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dsi.engine.request import Request
from dsi.engine.stats import GenerationStats
from dsi.errors import ContextLengthError, DraftUnavailable
from dsi.logprobs import top_ids
from dsi.models.base import LanguageModel, ModelSession, forward_rows
from dsi.sampling import Prefix, SamplingParams, bonus, decide, draft_from_logits, shape_logits
from dsi.transport.base import TaskResult
from dsi.trees import ROOT, DraftTree, Proposal, TreeShape, TreeWalk, walk


def request_shape(shape: TreeShape, model: LanguageModel, params: SamplingParams, stats: GenerationStats) -> TreeShape:
    """The tree shape a request with ``params`` drafts with on the drafter ``model``: ``shape``, or None
    (chains) where the drafter cannot branch (a drafter of another vocabulary in string mode); said in
    ``stats.extra`` (``draft_tree``, and ``draft_tree_fallback`` with the reason)."""
    if shape is None:
        return None
    mode_for = getattr(model, "mode_for", None)
    if mode_for is not None and mode_for(params.greedy) == "string":
        stats.extra["draft_tree"] = "chain"
        stats.extra["draft_tree_fallback"] = ("a drafter of another vocabulary in string mode proposes one settled "
                                              "target token per position and no law over alternatives, so it "
                                              "cannot branch")
        return None
    stats.extra["draft_tree"] = shape.name
    return shape


def ranked(law: np.ndarray, count: int) -> list[tuple[int, float]]:
    """The ``count`` most likely ids of ``law`` ``[V]`` (probabilities) with a positive probability, most
    likely first (ties: lower id)."""
    return [(i, float(law[i])) for i in top_ids(law, count) if law[i] > 0.0]


def draft_with_alternatives(row: np.ndarray, params: SamplingParams, position: int, prefix: Prefix,
                            count: int) -> tuple[int, np.ndarray | None, list[tuple[int, float]]]:
    """The drafter's draft at ``position`` from its raw logits ``row`` ``[V]`` (exactly the chain's:
    :func:`dsi.sampling.draft_from_logits`), its processed law ``q`` (None when greedy), and its
    ``count`` likeliest tokens with their drafter probabilities (the processed law; greedy: the
    softmax of the processed logits), most likely first."""
    main, q = draft_from_logits(row, params, position, prefix)
    if q is not None:
        return main, q, ranked(q, count)
    shaped = shape_logits(row, params, prefix) if params.moves_argmax else np.asarray(row, dtype=np.float64)
    ids = top_ids(shaped, count)
    finite = shaped[np.isfinite(shaped)]
    top = float(finite.max()) if finite.size else 0.0
    with np.errstate(under="ignore"):
        probs = np.exp(shaped[ids] - top) / float(np.exp(shaped - top).sum())
    return main, None, [(i, float(p)) for i, p in zip(ids, probs, strict=True)]


class TreeDrafter:
    """The drafter oracle of one window's tree after ``base``, on ``session`` (see the module docstring).

    ``top``: side tokens considered per node. After :func:`dsi.trees.grow`, :meth:`main_law` gives the
    drafter's processed law of each node's main child (None when greedy), what its decision needs."""

    def __init__(self, session: ModelSession, request: Request, base: Sequence[int], top: int) -> None:
        self.session = session
        self.request = request
        self.base = tuple(base)
        self.top = top
        self.forwards = 0
        self.context_limited = False
        self._laws: dict[tuple[int, ...], np.ndarray | None] = {}

    def propose(self, path: list[int]) -> Proposal | None:
        if path and path[-1] in self.request.eos_token_ids:
            return None  # nothing is drafted after an EOS
        context = self.base + tuple(path)
        try:
            self.forwards += 1
            row = forward_rows(self.session, context, 1)[-1]  # [V] raw drafter logits
        except ContextLengthError:
            self.context_limited = True
            return None
        except DraftUnavailable:  # nothing to propose here (a drafter of another vocabulary)
            return None
        main, q, alternatives = draft_with_alternatives(row, self.request.sampling, len(context),
                                                        self.request.prefix(context), self.top + 1)
        self._laws[tuple(path)] = q
        return main, alternatives

    def main_law(self, tree: DraftTree, node: int) -> np.ndarray | None:
        """The drafter's processed law at the position after ``node`` (:data:`ROOT`: after ``base``)."""
        return self._laws[() if node == ROOT else tuple(tree.path_tokens(node))]


def row_of(node: int) -> int:
    """The row of a tree task's result that follows ``node`` (:data:`ROOT`: row 0, after the prefix)."""
    return 0 if node == ROOT else 1 + node


def decide_tree(tree: DraftTree, result: TaskResult, drafter: TreeDrafter, params: SamplingParams,
                base_len: int) -> TreeWalk:
    """The walk of a verified tree (its task's ``result``): every position decided as a chain decides it,
    then the target's own token after a leaf (its row is in the same forward)."""

    def decide_after(node: int) -> int:
        row = row_of(node)
        position = base_len + (0 if node == ROOT else tree.depth(node))
        if params.greedy:
            return int(result.tokens[row])
        children = tree.children(node)
        if not children:
            return bonus(result.probs[row], params, position)
        main = children[0]
        return decide(result.probs[row], tree.tokens[main], drafter.main_law(tree, node), params, position).token

    return walk(tree, decide_after, leaf_token=True)


def parent_row(walked: TreeWalk, index: int) -> int:
    """The row that decided the ``index``-th token :meth:`TreeWalk.tokens` commits (for its logprobs)."""
    return 0 if index == 0 else row_of(walked.accepted[index - 1])


def ended_on_leaf(tree: DraftTree, walked: TreeWalk) -> bool:
    """Whether the walk accepted down to a leaf (its last token is then a bonus, not a correction)."""
    return not tree.children(walked.accepted[-1] if walked.accepted else ROOT)
