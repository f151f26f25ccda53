"""Draft trees replayed on a recording of a real pair: tokens per verification, tree against chain.

A greedy recording holds the target's output and, at each output position, the drafter's most
likely tokens on the same context (its main draft first). Greedy tree verification only ever
walks along the target's output (a child is followed iff it is the target's token), so for fixed
shapes (:class:`dsi.trees.Widths`) the recording decides every window exactly: the main path is
the drafter's chain, a side child is the drafter's next choice at that position. Dynamic shapes
also look at the drafter off the target's path, which a recording does not hold, so they are not
replayed here.

Windows follow greedy verification (:func:`dsi.trees.walk` with ``leaf_token``): a window commits
its accepted drafts, then the correction where the walk left the tree, or the target's token after
the leaf where it ended on one (its row is in the same forward).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from dsi.errors import ConfigError
from dsi.trees import ROOT, TreeShape, grow, walk

_OFF_RECORD = 2**62  # a token no vocabulary has: the drafter's draft below a node off the target's path


@dataclass(frozen=True)
class TreeReplay:
    """Windows of one recording: how many, the tokens they committed, and the drafts accepted."""

    windows: int
    tokens: int
    accepted: int

    @property
    def tokens_per_window(self) -> float:
        """Tokens committed per target verification (what a forward buys)."""
        return self.tokens / self.windows if self.windows else 0.0


def replay_greedy(target_tokens: Sequence[int], drafter_ranked: Sequence[Sequence[int]], shape: TreeShape,
                  budget: int) -> TreeReplay:
    """Replay greedy windows of ``budget`` drafts in ``shape`` (None: a chain) over a recording:
    ``target_tokens[i]`` the target's token at output position i, ``drafter_ranked[i]`` the drafter's
    tokens at that position, most likely first (a level wider than the ranking gets fewer children)."""
    n = len(target_tokens)
    if len(drafter_ranked) != n:
        raise ConfigError(f"the recording has {n} target tokens but {len(drafter_ranked)} drafter rankings")
    if shape is not None and not hasattr(shape, "widths"):
        raise ConfigError(f"shape {shape!r} cannot be replayed from a recording: only fixed widths (or a chain)")
    if any(len(r) < 1 for r in drafter_ranked):
        raise ConfigError("every position needs at least the drafter's main draft")
    windows = tokens = accepted = 0
    start = 0
    while start < n:
        def propose(path: list[int], start: int = start):
            at = start + len(path)
            on_record = at < n and list(path) == [int(t) for t in target_tokens[start:at]]
            if not on_record:
                return _OFF_RECORD, []
            ranked = [int(t) for t in drafter_ranked[at]]
            return ranked[0], [(t, 1.0) for t in ranked]

        tree = grow(shape, budget, propose)

        def decided(node: int, start: int = start, tree=tree) -> int:
            at = start + (0 if node == ROOT else tree.depth(node))
            return int(target_tokens[at]) if at < n else -1  # past the recording: no child matches

        outcome = walk(tree, decided, leaf_token=True)  # greedy: the leaf's row gives a token too
        committed = len(outcome.tokens(tree))
        windows += 1
        tokens += committed
        accepted += len(outcome.accepted)
        start += committed
    return TreeReplay(windows, min(tokens, n), accepted)


def rank_rates(target_tokens: Sequence[int], drafter_ranked: Sequence[Sequence[int]], ranks: int) -> list[float]:
    """How often the target's token is the drafter's ``j``-th likeliest token, ``j = 0 .. ranks - 1``, over the
    positions of a recording (the rest of the mass: a token past the ranking)."""
    if len(drafter_ranked) != len(target_tokens):
        raise ConfigError(f"the recording has {len(target_tokens)} target tokens but {len(drafter_ranked)} drafter "
                          "rankings")
    if not target_tokens:
        raise ConfigError("the recording has no position")
    counts = [0] * ranks
    for token, ranked in zip(target_tokens, drafter_ranked, strict=True):
        ranked = [int(t) for t in ranked[:ranks]]
        if int(token) in ranked:
            counts[ranked.index(int(token))] += 1
    return [c / len(target_tokens) for c in counts]


def best_tree_tokens(rates: Sequence[float], budget: int) -> float:
    """Tokens a greedy verification commits in expectation with the best tree of ``budget`` drafts, under
    Sequoia's position-independent acceptance model (Chen et al., arXiv 2402.12374): the target's token is
    the drafter's ``j``-th choice with probability ``rates[j]`` at every position, independently. A node
    reached by the ranks ``(j1, ..., jd)`` is on the target's path with probability ``rates[j1] ... rates[jd]``,
    so a tree commits 1 + the sum of its nodes' products, and the best tree holds the ``budget`` largest
    products (a prefix's product is at least its extensions', so they form a tree). With ``rates[:1]`` it is
    the chain of ``budget`` drafts. A bound for every fixed shape on the drafter whose ``rates`` they are, not
    for dynamic trees, which read each position's own confidence."""
    if not isinstance(budget, int) or budget < 0:
        raise ConfigError(f"budget={budget!r} must be an integer >= 0")
    rates = [float(r) for r in rates]
    if any(not 0.0 <= r <= 1.0 for r in rates) or sum(rates) > 1.0 + 1e-9:
        raise ConfigError(f"rates={rates!r} must be probabilities of disjoint events (each in [0, 1], sum <= 1)")
    rates = [r for r in rates if r > 0]
    frontier = [-r for r in rates]  # minus the products not taken yet, best first
    heapq.heapify(frontier)
    total = 0.0
    for _ in range(budget):
        if not frontier:
            break
        negative = heapq.heappop(frontier)
        total -= negative
        for r in rates:
            heapq.heappush(frontier, negative * r)
    return 1.0 + total
