"""Tree windows in the engines (issue 24): a drafter that proposes tree nodes, and the decision of a
verified tree against its task's result.

- :class:`TreeDrafter` is the oracle :func:`dsi.trees.grow` calls, on one drafter session. Its main
  token is the chain's own draft at that position (the argmax of the processed row, or the
  DRAFT-uniform sample of the processed law ``q``), so the main path is what a chain would draft; the
  side tokens are the next most likely under the drafter's processed law (greedy: the softmax of its
  processed logits). A fixed shape expands only its main path: one drafter forward a level, reusing
  the session's cache. A dynamic tree expands several nodes a round (:func:`dsi.trees.grow`), and a
  drafter session that computes a draft tree in one forward (``tree_rows``: hf, llama.cpp, the latency
  model) computes a round's paths in one: every path below their common ancestor, as one tree.
- :func:`decide_tree` walks a tree task's result (:func:`dsi.trees.walk`): each node with children
  is decided as the chain decides its main child (:func:`dsi.sampling.decide`, the uniforms of the
  absolute position), so the committed tokens never depend on the tree; a walk that ends on a leaf
  takes the target's own token there (a bonus, as after a chain whose drafts were all accepted).
  :func:`expected_tree_tokens` is how many tokens that walk commits in expectation, exactly, given the rows.
- :func:`request_shape` is the shape a request drafts with: chains where the drafter cannot branch (a
  drafter of another vocabulary in string mode proposes one settled target token per position, with no
  law over alternatives), and for greedy requests where the hardware's row price leaves no greedy side
  child worth ranking for (:data:`dsi.trees.CHAIN_FLOOR`).
- :func:`tree_patterns` reads, from one drafter forward along a greedy output, what the event simulator
  needs to time tree windows of each shape (:func:`dsi.sim.events.simulate`'s ``rescues``): where the main draft is
  the target's token, where a side child would rescue a rejection, and how many side children each
  position gets (``method="auto"`` weighs trees with it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dsi.engine.request import Request
from dsi.engine.stats import GenerationStats
from dsi.errors import ConfigError, ContextLengthError, DraftUnavailable
from dsi.logprobs import likeliest, top_ids
from dsi.models.base import LanguageModel, ModelSession, forward_rows, guessable_positions, tree_rows
from dsi.models.costs import forward_costs
from dsi.sampling import (
    Prefix,
    SamplingParams,
    bonus,
    decide,
    draft_from_logits,
    drafting,
    residual,
    shape_logits,
)
from dsi.transport.base import TaskResult
from dsi.trees import (CHAIN_FLOOR, DEFAULT_FLOOR, ROOT, BestFirst, DraftTree, Dynamic, Proposal, TreeShape,
                       TreeWalk, Widths, walk)


def can_branch(model: LanguageModel, greedy: bool) -> bool:
    """Whether the drafter ``model`` can draft trees for a request (greedy or not): not a drafter of another
    vocabulary in string mode."""
    mode_for = getattr(model, "mode_for", None)
    return mode_for is None or mode_for(greedy) != "string"


def request_shape(shape: TreeShape, model: LanguageModel, params: SamplingParams, stats: GenerationStats) -> TreeShape:
    """The tree shape a request with ``params`` drafts with on the drafter ``model``: ``shape``, or None
    (chains) where the drafter cannot branch (a drafter of another vocabulary in string mode), and where
    ``shape`` is an ``"auto"`` or ``"branches"`` tree priced at a floor of at least :data:`~dsi.trees.CHAIN_FLOOR`
    (a greedy side child has drafter probability at most 1/2, so at such a floor it would pay for its row only
    where the drafter's top two nearly tie, and ranking every row for it costs more than it saves; a sampled one
    wins far less often than its drafter probability; a fixed ``"auto:F"`` stays a tree); said in
    ``stats.extra`` (``draft_tree``, and ``draft_tree_fallback`` with the reason)."""
    if shape is None:
        return None
    if not can_branch(model, params.greedy):
        stats.extra["draft_tree"] = "chain"
        stats.extra["draft_tree_fallback"] = ("a drafter of another vocabulary in string mode proposes one settled "
                                              "target token per position and no law over alternatives, so it "
                                              "cannot branch")
        return None
    # priced: a floor fixed by name ("auto:F") has no price, and stays a tree
    if isinstance(shape, Dynamic) and shape.price is not None and shape.least >= CHAIN_FLOOR:
        stats.extra["draft_tree"] = "chain"
        stats.extra["tree_floor"] = shape.least
        stats.extra["tree_row_price"] = shape.price
        why = ("a greedy side child has at most 1/2, so it would pay only where the drafter's top two nearly tie, "
               "and ranking every row for it costs more" if params.greedy else
               "a sampled side child wins only where the draft is rejected and the residual's draw lands on it, "
               "far less often than that")
        stats.extra["draft_tree_fallback"] = (f"a verified row costs {shape.price:g} of a forward here, so a side "
                                              f"child must have drafter probability >= {shape.least:g}; {why}: "
                                              "the request drafts the chain")
        return None
    stats.extra["draft_tree"] = shape.name
    if isinstance(shape, Dynamic):
        stats.extra["tree_floor"] = shape.least
        if shape.price is not None:
            stats.extra["tree_row_price"] = shape.price
    return shape


def priced_shape(shape: TreeShape, target: LanguageModel, drafter: LanguageModel, transport: str,
                 options: dict | None, least: float = DEFAULT_FLOOR) -> TreeShape:
    """``shape`` with an ``"auto"`` tree's floor set from what one more verified row costs the target servers
    (:func:`dsi.trees.floor_for_price`, at least ``least``: :data:`~dsi.trees.DSI_FLOOR` for DSI's decoders): a
    cost the target states (latency models, callables) wherever its servers run, or one timed here on a scratch
    session where they run this very model on this host (threads, or processes on no other devices); elsewhere
    (Ray, other devices) it is not known and the default floor stays. Other shapes, an ``"auto:F"`` floor, and a
    ``drafter`` that branches for no request (string mode for greedy and sampled ones: :func:`request_shape`
    drafts chains) are returned as they are."""
    if not isinstance(shape, Dynamic) or shape.fixed or not (can_branch(drafter, True) or can_branch(drafter, False)):
        return shape
    here = transport == "threads" or (transport == "processes" and not (options or {}).get("devices"))
    costs = forward_costs(target, measure=here)
    return shape.priced(None if costs is None else costs.row_price, least)


def ranked(law: np.ndarray, count: int) -> list[tuple[int, float]]:
    """The ``count`` most likely ids of ``law`` ``[V]`` (probabilities) with a positive probability, most
    likely first (ties: lower id)."""
    return [(i, float(law[i])) for i in top_ids(law, count) if law[i] > 0.0]


def draft_with_alternatives(row: np.ndarray, params: SamplingParams, position: int, prefix: Prefix,
                            count: int, floor: float = 0.0) -> tuple[int, np.ndarray | None, list[tuple[int, float]]]:
    """The drafter's draft at ``position`` from its raw logits ``row`` ``[V]`` (exactly the chain's:
    :func:`dsi.sampling.draft_from_logits`), its processed law ``q`` (None when greedy), and its
    ``count`` likeliest tokens with their drafter probabilities (the processed law; greedy: the
    softmax of the processed logits), most likely first.

    ``floor`` > 0 (what :meth:`dsi.trees.Dynamic.sides` reads): only those of them other than the draft
    whose probability is at least ``floor``. Only a logit within ``log(floor)`` of the top can reach it (the
    normaliser is at least the top's term), so a greedy row ranks just those, and one where no other logit
    comes that close (most rows of a confident drafter) is neither ranked nor normalised."""
    main, q = draft_from_logits(row, params, position, prefix)
    if q is not None:
        if floor <= 0.0:
            return main, q, ranked(q, count)
        # only ids at or above the floor can be reported: at most 1 / floor of them, ranked as ``ranked`` ranks
        # (the likeliest first, ties by id) without a partition of the whole law
        ids = likeliest(q, np.flatnonzero(q >= floor), count)
        return main, q, _unsure([(i, float(q[i])) for i in ids], main, floor)
    # the row in its own dtype (a float32 row is not copied to float64: this runs for every node of a tree,
    # over the whole vocabulary); the normaliser is summed in float64
    shaped = _greedy_logits(row, params, prefix)
    ids: list[int] | None = None
    if floor > 0.0:
        top = float(shaped.max())
        if math.isfinite(top):
            # every token that can reach ``floor`` (and, ties included, the first of the likeliest order)
            reach = shaped.dtype.type(top + math.log(floor) - 1e-3)  # a margin for the dtype's rounding
            near = np.flatnonzero(shaped >= reach)
            if near.size <= 1 and (near.size == 0 or int(near[0]) == main):
                return main, None, []
            # the near tokens' own normaliser is at most the row's, so a token below the floor against it is
            # below it against the row's: where that holds for every one but the draft, nothing is normalised
            # (a high floor, as on a CPU, leaves most rows here); a margin covers the dtype's rounding
            weights = np.exp(shaped[near].astype(np.float64) - top)
            might = near[weights >= floor * (1.0 - 1e-4) * weights.sum()]
            if might.size == 0 or (might.size == 1 and int(might[0]) == main):
                return main, None, []
            ids = likeliest(shaped, near, count)
    if ids is None:
        ids = top_ids(shaped, count)
        top = float(shaped[ids[0]]) if ids else 0.0
    probs = _softmax_at(shaped, ids, top)
    alternatives = [(i, float(p)) for i, p in zip(ids, probs, strict=True)]
    return main, None, alternatives if floor <= 0.0 else _unsure(alternatives, main, floor)


def likeliest_draft(row: np.ndarray, params: SamplingParams, prefix: Prefix) -> int:
    """The drafter's likeliest token from its raw logits ``row`` after ``prefix``: the argmax of the logits as
    ``params`` process them (its greedy draft; the mode of a sampled request's law)."""
    return int(np.argmax(_greedy_logits(row, params, prefix)))


def _greedy_logits(row: np.ndarray, params: SamplingParams, prefix: Prefix) -> np.ndarray:
    """The logits a greedy draft is the argmax of and side children are ranked by: the raw ``row`` in its own
    dtype, or shaped by the processors where they can move the argmax (a row with no token a constraint allows:
    nothing to draft)."""
    if not params.moves_argmax:
        return np.asarray(row)
    with drafting():
        return shape_logits(row, params, prefix)


def _softmax_at(shaped: np.ndarray, ids: Sequence[int], top: float) -> np.ndarray:
    """The softmax probabilities (float64) of ``ids`` under the logits ``shaped`` ``[V]``, whose largest logit is
    ``top``: the exponentials in the row's own dtype (a float32 row is not copied to float64: this runs for
    every node of a tree, over the whole vocabulary), the normaliser summed in float64. A ``top`` that is not
    finite (a row the processors emptied, a +inf logit) is replaced by the largest finite logit."""
    if not math.isfinite(top):
        finite = shaped[np.isfinite(shaped)]
        top = float(finite.max()) if finite.size else 0.0
    with np.errstate(under="ignore", invalid="ignore"):
        total = float(np.exp(shaped - shaped.dtype.type(top)).sum(dtype=np.float64))
        return np.exp(shaped[list(ids)].astype(np.float64) - top) / total


def _unsure(alternatives: list[tuple[int, float]], main: int, floor: float) -> list[tuple[int, float]]:
    """The alternatives other than ``main`` with probability >= ``floor``."""
    return [(t, p) for t, p in alternatives if t != main and p >= floor]


def ranking_floor(shape: TreeShape) -> float:
    """The least drafter probability a side child of ``shape`` may have (:class:`~dsi.trees.Dynamic`'s
    ``floor``; 0 for the others): what :func:`draft_with_alternatives` may skip below."""
    return shape.least if isinstance(shape, Dynamic) else 0.0


class TreeDrafter:
    """The drafter oracle of one window's tree after ``base``, on ``session`` (see the module docstring).

    ``top``: side tokens considered per node. After :func:`dsi.trees.grow`, :meth:`main_law` gives the
    drafter's processed law of each node's main child (None when greedy), what its decision needs."""

    def __init__(self, session: ModelSession, request: Request, base: Sequence[int], top: int,
                 floor: float = 0.0) -> None:
        self.session = session
        self.request = request
        self.base = tuple(base)
        self.top = top
        self.floor = floor  # side tokens below this drafter probability are not reported (ranking_floor)
        self.forwards = 0
        self.context_limited = False
        self._laws: dict[tuple[int, ...], np.ndarray | None] = {}
        self._rows: dict[tuple[int, ...], np.ndarray] = {}  # each proposed path's raw row (for probability)

    @classmethod
    def for_shape(cls, session: ModelSession, request: Request, base: Sequence[int],
                  shape: Widths | Dynamic | BestFirst) -> TreeDrafter:
        """The oracle SI grows ``shape`` with: its ``top`` for dynamic and best-first trees, its widest level's
        side children for fixed widths, and its ranking floor (:func:`ranking_floor`)."""
        top = shape.top if isinstance(shape, Dynamic | BestFirst) else max(shape.widths) - 1
        return cls(session, request, base, top, ranking_floor(shape))

    def propose(self, path: list[int]) -> Proposal | None:
        if path and path[-1] in self.request.eos_token_ids:
            return None  # nothing is drafted after an EOS
        context = self.base + tuple(path)
        try:
            self.forwards += 1
            row = forward_rows(self.session, context, 1)[-1]  # [V] raw drafter logits
            main, q, alternatives = draft_with_alternatives(row, self.request.sampling, len(context),
                                                            self.request.prefix(context), self.top + 1, self.floor)
        except ContextLengthError:
            self.context_limited = True
            return None
        except DraftUnavailable:  # nothing to propose here (a drafter of another vocabulary)
            return None
        self._laws[tuple(path)] = q
        self._rows[tuple(path)] = row
        return main, alternatives

    def propose_many(self, paths: list[list[int]]) -> list[Proposal | None]:
        """:meth:`propose` for several paths (one round of a dynamic tree), in one drafter forward where the
        session computes a draft tree in one (``tree_rows``, unless its ``one_forward_trees`` is False): the
        paths below their longest common prefix
        form a tree after ``base`` + that prefix (held in the cache: the session keeps a tree's main path).
        Its rows are the batch's, which on llama.cpp or bf16 may differ in the last bits from one-token
        rows (docs/results.md#where-the-logits-depend-on-the-cut): a near-tie may then draft another main token
        than a chain's, which changes what is drafted, never the output's law (the verified law is the row's own)."""
        one_forward = hasattr(self.session, "tree_rows") and getattr(self.session, "one_forward_trees", True)
        live = [p for p in paths if not (p and p[-1] in self.request.eos_token_ids)]
        if not one_forward or len(live) < 2:
            return [self.propose(p) for p in paths]
        common = _common_prefix(live)
        tree, ends = _suffix_tree([p[len(common):] for p in live])
        context = self.base + tuple(common)
        try:
            rows = np.asarray(tree_rows(self.session, context, tree))  # [1 + n, V]
        except ContextLengthError:  # a path past the drafter's context: path by path, each as it can
            return [self.propose(p) for p in paths]
        self.forwards += 1
        out: list[Proposal | None] = []
        for path in paths:
            if path not in live:
                out.append(None)  # nothing is drafted after an EOS
                continue
            position = len(self.base) + len(path)
            row = rows[1 + ends[tuple(path[len(common):])]]
            try:
                main, q, alternatives = draft_with_alternatives(row, self.request.sampling, position,
                                                                self.request.prefix(self.base + tuple(path)),
                                                                self.top + 1, self.floor)
            except DraftUnavailable:  # no token the request allows in the drafter's row
                out.append(None)
                continue
            self._laws[tuple(path)] = q
            self._rows[tuple(path)] = row
            out.append((main, alternatives))
        return out

    def probability(self, path: list[int], token: int) -> float:
        """The drafter's probability of ``token`` after ``path`` (proposed before): its processed law's, or
        greedy, the softmax of its processed logits (the probabilities side children are ranked by)."""
        key = tuple(path)
        q = self._laws[key]
        if q is not None:
            return float(q[token])
        params = self.request.sampling
        row = self._rows[key]
        shaped = _greedy_logits(row, params, self.request.prefix(self.base + key))
        if not math.isfinite(float(shaped[token])):
            return 0.0
        p = float(_softmax_at(shaped, [token], float(shaped.max()))[0])  # as draft_with_alternatives ranks
        return p if math.isfinite(p) else 0.0  # a NaN logit elsewhere

    def main_law(self, tree: DraftTree, node: int) -> np.ndarray | None:
        """The drafter's processed law at the position after ``node`` (:data:`ROOT`: after ``base``)."""
        return self._laws[() if node == ROOT else tuple(tree.path_tokens(node))]


def _common_prefix(paths: list[list[int]]) -> list[int]:
    """The longest list every path starts with, short of each whole path (every path keeps a token below)."""
    common: list[int] = []
    for column in zip(*paths, strict=False):
        if len(set(column)) != 1 or any(len(p) <= len(common) + 1 for p in paths):
            break
        common.append(column[0])
    return common


def _suffix_tree(suffixes: list[list[int]]) -> tuple[DraftTree, dict[tuple[int, ...], int]]:
    """The draft tree holding every suffix as a root-to-node path (shared heads once, in the order they
    come), and the node each suffix ends on."""
    tokens: list[int] = []
    parents: list[int] = []
    node_of: dict[tuple[int, ...], int] = {}
    for suffix in suffixes:
        parent = ROOT
        for depth in range(1, len(suffix) + 1):
            key = tuple(suffix[:depth])
            if key not in node_of:
                node_of[key] = len(tokens)
                tokens.append(int(suffix[depth - 1]))
                parents.append(parent)
            parent = node_of[key]
    return DraftTree(tuple(tokens), tuple(parents)), {tuple(s): node_of[tuple(s)] for s in suffixes}


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


def expected_tree_tokens(tree: DraftTree, laws: Sequence[np.ndarray], main_laws: dict[int, np.ndarray | None]) -> float:
    """The expected number of tokens :func:`decide_tree` commits for ``tree``, given the target's processed law
    at every row (``laws[0]`` after the prefix, ``laws[1 + i]`` after node i) and the drafter's law each node's
    main child was drawn from (``main_laws[node]`` for every node with children, :data:`ROOT` included; None
    when greedy). Exact, not sampled: one token always (the correction, or the target's own after a leaf), plus
    each node's probability of being reached, every edge's being what :func:`dsi.sampling.decide` gives it: the
    main child ``x`` ``min(1, p(x) / q(x))``, a side child ``s`` the rejection's probability times the
    residual's ``r(s)``; greedy, the child equal to the target's argmax (benchmarks/tree_sampled_acceptance.py
    compares shapes with it, on the same drafts)."""
    reach = {ROOT: 1.0}
    total = 1.0
    for node in (ROOT, *range(len(tree))):
        children = tree.children(node)
        if not children:
            continue
        p = laws[row_of(node)]
        q = main_laws[node]
        if q is None:
            best = int(np.argmax(p))
            edges = [1.0 if tree.tokens[c] == best else 0.0 for c in children]
        else:
            x = tree.tokens[children[0]]
            accept = min(1.0, float(p[x] / q[x])) if q[x] > 0.0 else float(p[x] > 0.0)
            edges = [accept]
            if len(children) > 1:  # the residual [V] only where side children read it
                r = residual(p, q)
                edges += [(1.0 - accept) * float(r[tree.tokens[c]]) for c in children[1:]]
        for child, edge in zip(children, edges, strict=True):
            reach[child] = reach[node] * edge
            total += reach[child]
    return total


def parent_row(walked: TreeWalk, index: int) -> int:
    """The row that decided the ``index``-th token :meth:`TreeWalk.tokens` commits (for its logprobs)."""
    return 0 if index == 0 else row_of(walked.accepted[index - 1])


def ended_on_leaf(tree: DraftTree, walked: TreeWalk) -> bool:
    """Whether the walk accepted down to a leaf (its last token is then a bonus, not a correction)."""
    return not tree.children(walked.accepted[-1] if walked.accepted else ROOT)


def side_count(shape: TreeShape) -> int:
    """The most side children a position gets in ``shape`` (DSI's per-position branching; SI's fixed widths
    take their widest level): the number of alternatives a :class:`TreeDrafter` ranks beyond the main draft."""
    if shape is None:
        return 0
    if isinstance(shape, Dynamic | BestFirst):
        return shape.top - 1
    return max(shape.widths) - 1


@dataclass(frozen=True)
class TreePattern:
    """Greedy drafting along a target's output, position by position: ``matches[p]``, the drafter's main
    draft is the target's token; ``rescues[p]``, the target's token is one of the side children ``shape``
    gives position p (what decides a rejection there in a tree window); ``sides[p]``, how many it gives."""

    matches: tuple[bool, ...]
    rescues: tuple[bool, ...]
    sides: tuple[int, ...]

    @property
    def mean_sides(self) -> float:
        return sum(self.sides) / len(self.sides) if self.sides else 0.0


def tree_patterns(drafter: LanguageModel, prompt: Sequence[int], output: Sequence[int],
                  shapes: Sequence[TreeShape]) -> list[TreePattern]:
    """The :class:`TreePattern` of each shape (widths of one level, or :class:`~dsi.trees.Dynamic`, branched
    position by position as DSI branches) for the greedy ``output`` after ``prompt``, all from one drafter
    forward over ``prompt + output[:-1]``. Each position's ranking is the one a greedy DSI drafter makes
    (:func:`draft_with_alternatives`); the patterns' ``matches`` are the accept pattern
    (:func:`dsi.models.emulated.replay.accept_pattern`). Past the drafter's declared context there is no draft: no
    match, no side child (the engines commit the target's own token there)."""
    prompt, output = [int(t) for t in prompt], [int(t) for t in output]
    if not prompt or not output:
        raise ConfigError("a tree pattern needs a non-empty prompt and a non-empty output")
    if not can_branch(drafter, True):
        raise ConfigError(f"{getattr(drafter, 'name', drafter)!r} drafts greedy requests through text (a drafter "
                          "of another vocabulary in string mode), so it cannot branch: no tree pattern")
    count = guessable_positions(drafter, len(prompt), len(output))
    rows = np.zeros((0, 0))
    if count:
        session = drafter.new_session()
        try:
            rows = np.asarray(forward_rows(session, prompt + output[: count - 1], count))
        finally:
            session.close()
    greedy = SamplingParams()
    most = max((side_count(shape) for shape in shapes), default=0) + 1
    ranked = [draft_with_alternatives(rows[p], greedy, len(prompt) + p, None, most) for p in range(count)]
    patterns = []
    for shape in shapes:
        matches, rescues, sides = [], [], []
        for p, token in enumerate(output):
            if p >= count:
                matches.append(False)
                rescues.append(False)
                sides.append(0)
                continue
            main, _, alternatives = ranked[p]
            children = shape.sides(main, alternatives) if shape is not None else []
            matches.append(main == token)
            rescues.append(main != token and token in children)
            sides.append(len(children))
        patterns.append(TreePattern(tuple(matches), tuple(rescues), tuple(sides)))
    return patterns
