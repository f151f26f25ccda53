"""Draft trees: a window's draft budget spent as a tree instead of a chain, and how a verified
tree is decided (issue 24). Pure: no model, engine or thread here.

**The verification rule (chain-coupled).** Every node's children are ordered: the *main child*
first (the drafter's own draft at that position, exactly the token a chain would draft there:
its argmax when greedy, its sample with the DRAFT uniform when sampling), then *side children*
(the drafter's next most likely tokens). The token at each position is decided exactly as a chain
decides it (:func:`dsi.sampling.decide` on the main child: accepted with the ACCEPT uniform, else
the residual drawn with the RESIDUAL uniform; greedy: the target's argmax). If the decided token is
one of the node's children, the walk goes on below that child; otherwise the token ends the window
(:func:`walk`). A position below a leaf has no draft yet: greedy decoding takes the target's token
there (its row is in the same forward), sampling leaves it to the next window, as DSI does after a
chain's last draft. So:

- a tree commits exactly the tokens a chain commits with the same seed, whatever the shape, the
  budget, the window policy or the timing: losslessness and seed determinism are the chain's;
- a side child is followed exactly when the chain's correction token is that child: for a side
  child ``s`` with probability ``P(reject main) * r(s)``, ``r`` the residual. That is the acceptance
  of multi-draft speculative sampling with deterministic side drafts (SpecInfer's or RSD's
  recursive rejection with point-mass drafts: accepting ``s`` w.p. ``r(s)``, then the next side
  child against the residual without ``s``, sums to the same ``r(s1) + r(s2) + ...``);
- greedy: the walk follows the child equal to the target's argmax, as every tree verifier does.

**Shapes.** ``"chain"`` (no tree), fixed :class:`Widths` (children per main-path node, depth by
depth: ``"3,2,1"``), :class:`Dynamic` (``"auto"``: the chain's drafts, each position with the
drafter's next likeliest tokens as side children where the drafter is unsure; ``"branches"``: the side
children continue as the drafter's own chains, in DSI by one draft), or :class:`BestFirst` (``"best-first"``:
EAGLE-2-style growth by cumulative drafter probability within a node budget).
:func:`grow` builds a tree from a drafter oracle, ``propose(path tokens) -> (main token, [(token,
drafter probability), ...] most likely first)``.

**Verification in one forward.** Node ``i`` sits at position ``len(prefix) + depth(i) - 1`` and
attends to the prefix and its own ancestors (:meth:`DraftTree.attention_mask`,
:meth:`DraftTree.positions`); a backend with sequence ids gives each root-to-leaf path its own
(:meth:`DraftTree.paths`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from dsi.errors import ConfigError

ROOT = -1  # the committed prefix: the parent of the first level

Proposal = tuple[int, Sequence[tuple[int, float]]]  # (main token, ranked (token, drafter probability))
# what a drafter oracle gives ``grow``: a proposal, or None where nothing follows the path (EOS, no room)


@dataclass(frozen=True)
class DraftTree:
    """Nodes ``0..n-1``: ``tokens[i]`` with parent ``parents[i]`` (:data:`ROOT` for the first
    level), parents before children, and among siblings the main child first."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    _children: dict[int, tuple[int, ...]] = field(init=False, repr=False, compare=False)
    _depths: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tokens, parents = tuple(int(t) for t in self.tokens), tuple(int(p) for p in self.parents)
        if len(tokens) != len(parents):
            raise ConfigError(f"a tree of {len(tokens)} tokens needs as many parents, got {len(parents)}")
        children: dict[int, list[int]] = {ROOT: []}
        depths: list[int] = []
        for i, (token, parent) in enumerate(zip(tokens, parents, strict=True)):
            if not ROOT <= parent < i:
                raise ConfigError(f"node {i}'s parent {parent} must be an earlier node or {ROOT} (the prefix)")
            if token < 0:
                raise ConfigError(f"node {i}'s token {token} must be a token id >= 0")
            siblings = children.setdefault(parent, [])
            if any(tokens[s] == token for s in siblings):
                raise ConfigError(f"node {i} repeats token {token} among its siblings")
            siblings.append(i)
            children[i] = []
            depths.append(1 if parent == ROOT else depths[parent] + 1)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "_children", {k: tuple(v) for k, v in children.items()})
        object.__setattr__(self, "_depths", tuple(depths))

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> tuple[int, ...]:
        """The children of ``node`` (:data:`ROOT`: the first level), the main child first."""
        return self._children[node]

    def depth(self, node: int) -> int:
        return self._depths[node]

    def path(self, node: int) -> list[int]:
        """The nodes from the first level down to ``node``."""
        return _path(self.parents, node)

    def path_tokens(self, node: int) -> list[int]:
        return [self.tokens[i] for i in self.path(node)]

    def main_path(self) -> list[int]:
        """The chain of main children from the root: what a chain would have drafted."""
        nodes, node = [], ROOT
        while self._children[node]:
            node = self._children[node][0]
            nodes.append(node)
        return nodes

    def is_chain(self) -> bool:
        return all(len(c) <= 1 for c in self._children.values())

    def leaves(self) -> list[int]:
        return [i for i in range(len(self)) if not self._children[i]]

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path (one sequence id each on a backend with sequence ids)."""
        return [self.path(leaf) for leaf in self.leaves()]

    def positions(self, prefix_len: int) -> np.ndarray:
        """The absolute position of each node, ``[n]`` int64: its depth after the prefix."""
        return prefix_len - 1 + np.asarray(self._depths, dtype=np.int64)

    def attention_mask(self) -> np.ndarray:
        """``[n, n]`` bool: node i attends to node j iff j is i or an ancestor of i (every node also
        attends to the whole prefix)."""
        n = len(self)
        mask = np.zeros((n, n), dtype=bool)
        for i in range(n):
            mask[i, self.path(i)] = True
        return mask


@dataclass(frozen=True)
class TreeWalk:
    """The outcome of verifying a tree: the accepted nodes (a root-to-node path), then the token
    decided where the walk left the tree (a correction: it matched no child), or None when the walk
    ended on a leaf (the position after it has no draft yet: the next window decides it, as after a
    chain's last draft)."""

    accepted: tuple[int, ...]
    token: int | None

    def tokens(self, tree: DraftTree) -> list[int]:
        """Every token the window commits: the accepted nodes' tokens, then the decided one."""
        return [tree.tokens[i] for i in self.accepted] + ([] if self.token is None else [self.token])


def walk(tree: DraftTree, decide: Callable[[int], int], *, leaf_token: bool = False) -> TreeWalk:
    """Verify ``tree``: ``decide(node)`` is the token decided at the position after ``node``
    (:data:`ROOT`: after the prefix), decided as a chain decides it against the node's main child.
    Follows the child whose token was decided.

    ``leaf_token``: where the walk ends on a leaf, also ask ``decide`` for the leaf's row and commit
    that token (the target's own token after the leaf, computed in the same forward). Greedy decoding
    takes it: every greedy token is the target's argmax, so it changes nothing but the count; a
    sampled one would be drawn where the chain has a draft, so sampling leaves that position to the
    next window and keeps the chain's tokens (the default)."""
    accepted, node = [], ROOT
    while tree.children(node):
        token = int(decide(node))
        follow = next((c for c in tree.children(node) if tree.tokens[c] == token), None)
        if follow is None:
            return TreeWalk(tuple(accepted), token)
        accepted.append(follow)
        node = follow
    return TreeWalk(tuple(accepted), int(decide(node)) if leaf_token else None)


# ---- shapes ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Widths:
    """A fixed shape: ``widths[d]`` children below the depth-d main-path node (its main child and
    ``widths[d] - 1`` side children, which are leaves); ``(1, 1, ...)`` is a chain. One width (``"2"``)
    is that width at every depth, as deep as the budget goes (DSI takes only this form)."""

    widths: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.widths or any(not isinstance(w, int) or w < 1 for w in self.widths):
            raise ConfigError(f"tree widths {self.widths!r} must be integers >= 1, one per depth")

    @property
    def name(self) -> str:
        return ",".join(map(str, self.widths))

    def sides(self, main: int, ranked: Sequence[tuple[int, float]]) -> list[int]:
        """A position's side children in DSI (one width for every position): the ``width - 1`` likeliest
        tokens other than ``main``."""
        if len(self.widths) != 1:
            raise ConfigError(f"draft tree {self.name!r}: DSI branches position by position, so it takes one width "
                              "for every position (such as '2') or 'auto'; widths per depth are for SI")
        return _sides(main, ranked, self.widths[0] - 1)


DEFAULT_FLOOR = 0.1  # the least drafter probability of an "auto" side child where rows cost nothing
# ... in DSI, priced: its windows carry a few drafts (1.3-3.8 on average on the H200), so its trees stay within
# the 16 nodes an H200 verifies at one token's cost even at this floor, where SI's k-draft trees would not
# (docs/results.md#gpu; docs/results-log.md#2026-12-04: on SmolLM2's sampled code DSI's trees at 0.02 were 4%
# faster than at 0.1, no faster at 0.01)
DSI_FLOOR = 0.02


def least_floor(method: str) -> float:
    """The least floor an ``"auto"`` tree of ``method``'s decoders is priced at: :data:`DSI_FLOOR` for DSI,
    :data:`DEFAULT_FLOOR` for SI."""
    return DSI_FLOOR if method == "dsi" else DEFAULT_FLOOR


# DSI's "branches": each side child continues as a side chain of up to this many tokens, one per drafter step, each
# carried by the windows sent after it is drafted (a window whose chains grew is rooted at their position), so a
# side child that wins goes on along its chain with the rows after it computed. One: the drafter's likeliest token
# after the child, a guess at the target's draw there. Deeper chains were slower on SmolLM2 -> Qwen's code on the
# GPU-like model (sampled 0.995 of the chain at 4 tokens against 1.097 at one: docs/results-log.md#2026-12-04;
# greedy 1.028 / 1.101 / 1.143 at 4 / 2 / 1: docs/results.md#dsi-trees-wall-time-on-the-gpu-like-model): the
# guess is the target's token after only half of the side children that win, so a chain goes on past it for few
# of them, while every chain node costs the host a 152k-id row, and the drafter's sampled nodes a processed law
# each
DSI_CHAIN_DEPTH = 1
# DSI's "auto" grows those side chains too where a verified row costs at most this much of a one-token forward: a
# chain's node pays where its side child wins and the guess is the target's draw, about half the side wins
# (docs/results-log.md#2026-12-04: 18 of 36, 56 of 98), so it needs half the price a side child at DSI's least
# floor pays (REACH is defined below: 0.02 * 0.6 / 2 = 0.006). A GPU's memory-bound forward is there (the H200
# verifies 16 nodes at one token's cost); a CPU's forward, linear in tokens, is far above it
CHAIN_PRICE = 0.006
REACH = 0.6  # about how often a side child's window reaches its position where side children matter
# A greedy side child is never the draft, so its drafter probability is at most 1/2, and it saves at most
# (1/2 - floor) * REACH of a forward where it is found: from this priced floor up (rows at least 0.24 of a
# forward, as on a CPU) at most 0.03 of a forward, and only where the drafter's top two are within 0.1 of each
# other, while ranking every drafted row to look for it cost SI 3% of its wall time at the CPU-like floor 0.5,
# where no greedy side child can be found at all (docs/results-log.md#2026-12-03): greedy requests draft the
# chain there (:func:`dsi.engine.trees.request_shape`). A sampled side child (the drafter's likeliest token where
# the sampled draft was another) wins only where the draft is rejected and the residual's draw lands on it, far
# less often than its drafter probability: from this floor up it won 6 times in 288 sampled tokens, and SI's
# ``auto`` lost 6% to the chain on CPU-like emulated costs (docs/results-log.md#2026-12-03): sampled requests
# draft the chain there too
CHAIN_FLOOR = 0.45


def floor_for_price(row_price: float, least: float = DEFAULT_FLOOR) -> float:
    """The least drafter probability an ``"auto"`` side child must have where one more verified row costs
    ``row_price`` of a one-token forward (:attr:`dsi.models.costs.ForwardCosts.row_price`).

    A side child with drafter probability ``p`` rescues a rejection about ``p`` of the times its position is
    reached (the drafts before it in its window accepted: about :data:`REACH` where the drafter is unsure
    enough for side children), and a rescue saves about a one-token forward (DSI's restarted epoch, SI's
    extra token); it costs ``row_price`` of one whenever its window is verified. So it pays where ``p *
    REACH`` exceeds the price: the floor is ``row_price / REACH`` rounded up to a step of 0.05 (so a measured
    price rarely moves it), at least ``least`` (:data:`DEFAULT_FLOOR`; DSI's decoders :data:`DSI_FLOOR`) and at
    most 1 (where no side child is added). On emulated CPU-like costs (a row 0.27 of a forward) that is 0.5, the
    floor at which "auto" came within 2% of the chain on four recorded sets
    (docs/results.md#dsi-trees-wall-time-on-the-gpu-like-model); on a GPU (rows nearly free), ``least``."""
    if not isinstance(row_price, int | float) or isinstance(row_price, bool) or not 0.0 <= row_price <= 1.0:
        raise ConfigError(f"row_price={row_price!r} must be a number in [0, 1] (a row's cost in one-token forwards)")
    if not isinstance(least, int | float) or isinstance(least, bool) or not 0.0 < least <= 1.0:
        raise ConfigError(f"least={least!r} must be a probability in (0, 1] (the floor where rows cost nothing)")
    stepped = math.ceil(round(row_price / REACH * 20, 6)) / 20
    return min(1.0, max(float(least), stepped))


@dataclass(frozen=True)
class Dynamic:
    """``"auto"``: branch where the drafter is unsure, within the chain's drafting budget. The main path is
    the chain's own drafts (k of them in SI; DSI's window policy cuts it), and each position gets as side
    children (leaves) its drafter's next most likely tokens, at most ``top - 1``, whose drafter
    probability is at least the floor (:meth:`sides`): a confident drafter gets none, and a tree costs
    no drafter forward a chain does not make (the side children come from the rows the chain's drafts
    are drawn from). Where it branches is a function of each position's drafter row alone, never of how
    windows are cut, so SI and DSI branch alike.

    ``floor`` None (``"auto"``): the decoder sets it from what a verified row costs on the target's
    hardware (``price``, :func:`floor_for_price`; :data:`DEFAULT_FLOOR` where that is not known); a number
    (``"auto:0.3"``) fixes it.

    ``branches`` (``"branches"``, ``"branches:F"``): in SI each side child continues as the drafter's own
    drafts, drafted in the same rounds as the main path (one batched drafter forward a round where the session
    computes a tree in one, :func:`grow`), a node kept while its branch's drafter probability since it left
    the main path (the side child's times the drafts' and side children's below it) stays at least the floor,
    so a branch node takes side children of its own where they keep that mass: the rule a side child meets,
    for the same reason (a node is reached about that often and costs a verified row). A rescue then goes on
    past the side child instead of ending the window there. DSI's drafter drafts the main path without
    waiting, so there each side child continues as a side chain of up to :data:`DSI_CHAIN_DEPTH` tokens, one
    per drafter step, drafted in the forwards that draft the main path (one tree forward each): first the
    drafter's likeliest token after the child (a guess at the target's token after a side child that wins),
    then its own drafts; the windows sent after each token carry it, so a side child that wins goes on along
    its chain with the rows after it already computed (:mod:`dsi.engine.dsi`). DSI's ``"auto"`` grows those side
    chains too where its floor was priced from a nearly free row (:func:`grows_side_chains`), so its default tree
    on a GPU is ``"branches"``'s."""

    top: int = 3
    floor: float | None = None
    price: float | None = None  # the row price the floor was set from (None: fixed, or not priced yet)
    branches: bool = False  # ``"branches"``: side children continue as the drafter's own chains

    def __post_init__(self) -> None:
        _check_top(self.top)
        if self.floor is not None and not (isinstance(self.floor, int | float) and not isinstance(self.floor, bool)
                                           and 0.0 < self.floor <= 1.0):
            raise ConfigError(f"floor={self.floor!r} must be None (set from the hardware's cost per verified row) "
                              "or a probability in (0, 1] (the least drafter probability of a side child)")
        if not isinstance(self.branches, bool):
            raise ConfigError(f"branches={self.branches!r} must be a bool")

    @property
    def fixed(self) -> bool:
        """Whether the floor was given (``"auto:F"``) rather than left to the decoder's pricing."""
        return self.floor is not None and self.price is None

    @property
    def name(self) -> str:
        kind = "branches" if self.branches else "auto"
        return f"{kind}:{self.floor:g}" if self.fixed else kind

    @property
    def least(self) -> float:
        """The floor in force: ``floor``, or :data:`DEFAULT_FLOOR` before the decoder prices it."""
        return DEFAULT_FLOOR if self.floor is None else float(self.floor)

    def priced(self, row_price: float | None, least: float = DEFAULT_FLOOR) -> Dynamic:
        """This shape with its floor set from ``row_price`` and ``least`` (:func:`floor_for_price`; None: not
        known, the default floor stays); a fixed floor stays as it is."""
        if self.fixed:
            return self
        if row_price is None:
            return Dynamic(self.top, branches=self.branches)
        return Dynamic(self.top, floor_for_price(row_price, least), float(row_price), self.branches)

    def sides(self, main: int, ranked: Sequence[tuple[int, float]]) -> list[int]:
        """A position's side children: the likeliest tokens other than ``main`` with drafter probability
        >= the floor, at most ``top - 1``."""
        least = self.least
        return _sides(main, [(t, p) for t, p in ranked if p >= least], self.top - 1)


@dataclass(frozen=True)
class BestFirst:
    """``"best-first"`` (SI only): EAGLE-2-style growth within a budget of k nodes, best-first by
    cumulative drafter probability (the product of the drafter's probabilities along the path),
    considering each expanded node's ``top`` most likely tokens. It may spend the budget below a side
    child, so its main path can be shorter than the chain's: it pays at budgets of 8-16, where a chain's
    last drafts are rarely reached (docs/results.md#tokens-per-verification). DSI's windows are cut by
    timing, so it cannot take a per-window node budget (:meth:`sides` refuses)."""

    top: int = 3

    def __post_init__(self) -> None:
        _check_top(self.top)

    name = "best-first"

    def sides(self, main: int, ranked: Sequence[tuple[int, float]]) -> list[int]:
        raise ConfigError("draft tree 'best-first' grows within a node budget per window, which DSI (whose windows "
                          "timing cuts) does not have: DSI branches position by position ('auto' or a width such as "
                          "'2'); 'best-first' is for SI")


def _check_top(top: object) -> None:
    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        raise ConfigError(f"top={top!r} must be an integer >= 1 (tokens considered per node)")


TreeShape = Widths | Dynamic | BestFirst | None  # None: a chain


def grows_side_chains(shape: TreeShape) -> bool:
    """Whether DSI's windows continue ``shape``'s side children as side chains (:data:`DSI_CHAIN_DEPTH`):
    ``"branches"`` always, ``"auto"`` where its floor was priced from a verified row costing at most
    :data:`CHAIN_PRICE` of a one-token forward (``"auto:F"`` and a price not known: no chains). The tokens are
    the same either way (a side chain only moves time, docs/architecture.md)."""
    return isinstance(shape, Dynamic) and (shape.branches or (shape.price is not None and shape.price <= CHAIN_PRICE))


def parse_shape(text: str | None) -> TreeShape:
    """``--draft-tree``: ``off`` / ``chain`` (None), ``auto`` (:class:`Dynamic`, its floor set from the
    hardware; ``auto:0.3`` fixes it), ``branches`` (``branches:0.3``; :class:`Dynamic` with ``branches``),
    ``best-first`` (:class:`BestFirst`), or widths ``3,2,1``."""
    if text is None:
        return None
    value = text.strip().lower()
    if value in ("off", "chain", "none", ""):
        return None
    for kind in ("auto", "branches"):
        if value == kind:
            return Dynamic(branches=kind == "branches")
        if value.startswith(kind + ":"):
            try:
                floor = float(value[len(kind) + 1:])
            except ValueError:
                floor = -1.0
            if not 0.0 < floor <= 1.0:
                raise ConfigError(f"draft tree {text!r}: '{kind}:F' takes the least drafter probability of a side "
                                  f"child, a number in (0, 1] such as {kind}:0.3")
            return Dynamic(floor=floor, branches=kind == "branches")
    if value in ("best-first", "best_first", "bestfirst"):
        return BestFirst()
    try:
        if not value.isascii():  # int() also reads other scripts' digits ("٣")
            raise ValueError(value)
        widths = tuple(int(w) for w in value.split(","))
    except ValueError:
        raise ConfigError(f"draft tree {text!r} must be off, auto, branches, best-first, or widths per depth such "
                          "as 3,2,1 (auto:F and branches:F fix the floor, F in (0, 1])"
                          ) from None
    return Widths(widths)


def check_windowed(shape: TreeShape) -> None:
    """Refuse, naming it, a shape DSI's windows cannot take: widths per depth and ``"best-first"`` (a node
    budget per window, which timing cuts). ``"branches"`` continues each side child in DSI as a side chain of up to
    :data:`DSI_CHAIN_DEPTH` tokens, drafted in the main path's forwards (:mod:`dsi.engine.dsi`)."""
    if shape is None:
        return
    shape.sides(0, ())


def grow(shape: TreeShape, budget: int, propose: Callable[[list[int]], Proposal | None],
         propose_many: Callable[[list[list[int]]], list[Proposal | None]] | None = None,
         probability: Callable[[list[int], int], float] | None = None) -> DraftTree:
    """A tree in ``shape`` (None: a chain of ``budget``) from the drafter oracle ``propose(path tokens) ->
    (main token, [(token, probability), ...] most likely first)``, called once per node that gets
    children (the root's path is ``[]``). ``propose`` returns None where the drafter has nothing after
    that path (an EOS, the end of its context): that node stays a leaf.

    ``budget`` counts the tree's nodes for :class:`Widths` and :class:`BestFirst`, and its main path for
    :class:`Dynamic` (the chain's ``budget`` drafts, its side children on top: a drafting budget, as DSI
    spends it). A :class:`BestFirst` tree is grown in rounds, each asking for every node it expands at
    once through ``propose_many(paths) -> proposals`` (default: ``propose`` path by path): a drafter that
    can compute several paths' rows in one forward then drafts a round in one (:func:`_grow_best_first`).
    A :class:`Dynamic` tree with ``branches`` is grown in rounds the same way (:func:`_grow_branches`), and
    ``probability(path tokens, token)`` gives the drafter's probability of a branch's next draft (default:
    its entry in the proposal's ranking, 0 where absent)."""
    if not isinstance(budget, int) or budget < 1:
        raise ConfigError(f"budget={budget!r} must be an integer >= 1 (draft tokens per window)")
    many = propose_many or (lambda paths: [propose(p) for p in paths])
    if isinstance(shape, BestFirst):
        return _grow_best_first(shape, budget, many)
    if isinstance(shape, Dynamic) and shape.branches:
        return _grow_branches(shape, budget, many, probability)
    dynamic = isinstance(shape, Dynamic)
    widths = (1,) * budget if shape is None or dynamic else shape.widths * (budget if len(shape.widths) == 1 else 1)
    tokens: list[int] = []
    parents: list[int] = []
    node = ROOT
    for width in widths:
        if not dynamic and len(tokens) >= budget:
            break
        proposal = propose([tokens[i] for i in _path(parents, node)])
        if proposal is None:
            break
        main, ranked = proposal
        kids = [int(main)] + (shape.sides(main, ranked) if dynamic else  # type: ignore[union-attr]
                              _sides(main, ranked, min(width, budget - len(tokens)) - 1))
        first = len(tokens)
        tokens += kids
        parents += [node] * len(kids)
        node = first  # the main child: the next level grows below it
    return DraftTree(tuple(tokens), tuple(parents))


def _grow_best_first(shape: BestFirst, budget: int,
                  propose_many: Callable[[list[list[int]]], list[Proposal | None]]) -> DraftTree:
    """EAGLE-2-style best-first growth, in rounds: the tree is the ``budget`` candidates of highest
    priority (a candidate's cumulative drafter probability; a main child takes its best sibling's, so
    it comes first), and a round expands, in one ``propose_many`` call, every candidate of the current
    best ``budget`` not expanded yet whose children could still enter them (their priorities are at most
    its cumulative probability, so one at or below the budget-th priority cannot gain a child there).
    Priorities never grow along a path, so the best ``budget`` always form a tree, and the rounds end
    with the tree a one-node-at-a-time best-first growth gives (ties aside: earlier candidates first):
    one drafter forward per round instead of one per node."""
    # candidate i: parents[i] (a candidate index or ROOT), tokens[i], cumulative[i], priority[i]
    tokens: list[int] = []
    parents: list[int] = []
    cumulative: list[float] = []
    priority: list[float] = []
    expanded: set[int] = set()

    def path_of(node: int) -> list[int]:
        return [tokens[i] for i in _path(parents, node)]

    def add_children(node: int, proposal: Proposal | None) -> None:
        if proposal is None:
            return
        mass = 1.0 if node == ROOT else cumulative[node]
        main, ranked = proposal
        prob = dict((int(t), float(p)) for t, p in ranked)
        kids = [int(main)] + _sides(main, ranked, shape.top - 1)
        best = max(prob.get(t, 0.0) for t in kids)
        for rank, token in enumerate(kids):
            tokens.append(token)
            parents.append(node)
            cumulative.append(mass * prob.get(token, 0.0))
            priority.append(cumulative[-1] if rank else mass * best)

    def best() -> list[int]:
        return heapq.nsmallest(budget, range(len(tokens)), key=lambda i: (-priority[i], i))

    add_children(ROOT, propose_many([[]])[0])
    while True:
        chosen = best()
        floor = priority[chosen[-1]] if len(chosen) == budget else -1.0
        todo = [i for i in chosen if i not in expanded and cumulative[i] > floor and len(_path(parents, i)) < budget]
        if not todo:
            break
        expanded.update(todo)
        for node, proposal in zip(todo, propose_many([path_of(i) for i in todo]), strict=True):
            add_children(node, proposal)
    keep = sorted(chosen)  # creation order: parents before children, siblings in the order they came
    index = {old: new for new, old in enumerate(keep)}
    return _canonical([tokens[i] for i in keep], [ROOT if parents[i] == ROOT else index[parents[i]] for i in keep])


def _grow_branches(shape: Dynamic, budget: int, propose_many: Callable[[list[list[int]]], list[Proposal | None]],
                   probability: Callable[[list[int], int], float] | None) -> DraftTree:
    """``"branches"``: ``budget`` rounds, each one ``propose_many`` call over the main path's last node and
    the branch nodes added by the round before. A node's mass is its drafter probability since its branch left
    the main path (the main path's nodes: 1): the product of its path's drafter probabilities from the first
    side child down. Every proposed node grows by its own draft (the main path always; a branch node only
    while its mass is at least the floor, which is why it was proposed) and by its side children, the drafter's
    next likeliest tokens (at most ``top - 1``) whose mass, the node's times theirs, is at least the floor: on
    the main path :meth:`Dynamic.sides`, below a side child the same rule with the branch's mass. Whether a
    node gets a draft is decided before that draft is drafted, never by the draft's own probability: a
    sampled draft kept only where it is likely would no longer be drawn from the drafter's law, and the
    walk's decision below its parent would lose the target's law (side children are the node's ranked
    tokens, a function of its row, as on the main path). Every path is at most ``budget`` deep, so the
    drafter makes the chain's ``budget`` forwards where a round is one."""
    least = shape.least
    tokens: list[int] = []
    parents: list[int] = []
    mass: list[float] = []  # a node's drafter probability since its branch left the main path (main path: 1)

    def path_of(node: int) -> list[int]:
        return [tokens[i] for i in _path(parents, node)]

    def add(token: int, parent: int, weight: float) -> int:
        tokens.append(int(token))
        parents.append(parent)
        mass.append(weight)
        return len(tokens) - 1

    def add_sides(parent: int, weight: float, draft: int, ranking: Sequence[tuple[int, float]]) -> list[int]:
        """``parent``'s side children: its likeliest tokens but ``draft`` whose mass, ``weight`` (the parent's;
        1 on the main path, where this is :meth:`Dynamic.sides`) times theirs, is at least the floor."""
        kept = [(int(t), weight * float(q)) for t, q in ranking if weight * q >= least]
        chance = dict(kept)
        return [add(side, parent, chance[side]) for side in _sides(draft, kept, shape.top - 1)]

    main_node, branches = ROOT, []
    for level in range(budget):
        paths = [path_of(main_node)] + [path_of(node) for node in branches]
        proposals = propose_many(paths)
        grown = []
        for node, path, proposal in zip(branches, paths[1:], proposals[1:], strict=True):
            if proposal is None:
                continue
            token, ranking = int(proposal[0]), proposal[1]
            if level == budget - 1:  # the last round: nothing is grown below it, so its mass is not needed
                p = 0.0
            elif probability is not None:
                p = probability(path, token)
            else:
                p = dict((int(t), float(q)) for t, q in ranking).get(token, 0.0)
            grown.append(add(token, node, mass[node] * p))
            grown += add_sides(node, mass[node], token, ranking)
        if proposals[0] is None:
            break
        main, ranking = proposals[0]
        first = add(main, main_node, 1.0)
        grown += add_sides(main_node, 1.0, main, ranking)
        main_node, branches = first, [node for node in grown if mass[node] >= least]
    return _canonical(tokens, parents)


def _canonical(tokens: list[int], parents: list[int]) -> DraftTree:
    """Renumber nodes breadth-first, keeping each node's children in the order they were added (the
    main child first), so parents come before children."""
    children: dict[int, list[int]] = {ROOT: []}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i)
    new_index, order, queue = {ROOT: ROOT}, [], [ROOT]
    while queue:
        node = queue.pop(0)
        for child in children.get(node, []):
            new_index[child] = len(order)
            order.append(child)
            queue.append(child)
    return DraftTree(tuple(tokens[i] for i in order), tuple(new_index[parents[i]] for i in order))


def _path(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the first level down to ``node``, following ``parents``."""
    nodes = []
    while node != ROOT:
        nodes.append(node)
        node = parents[node]
    return nodes[::-1]


def _sides(main: int, ranked: Sequence[tuple[int, float]], count: int) -> list[int]:
    """The ``count`` most likely tokens other than ``main`` (side children)."""
    out: list[int] = []
    for token, _ in ranked:
        if len(out) >= count:
            break
        if int(token) != int(main) and int(token) not in out:
            out.append(int(token))
    return out
