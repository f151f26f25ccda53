"""Greedy tree windows replayed on a recording (dsi.sim.trees), against hand-counted outcomes."""

from __future__ import annotations

import pytest

from dsi.errors import ConfigError
from dsi.sim.trees import replay_greedy
from dsi.trees import Dynamic, Widths

# the target says 1 2 3 4 5 6; the drafter's first choice is right at positions 0, 2, 3, 5 and its
# second choice at positions 1 and 4
TARGET = [1, 2, 3, 4, 5, 6]
RANKED = [[1, 9], [8, 2], [3, 9], [4, 9], [7, 5], [6, 9]]


def test_a_chain_stops_at_each_wrong_first_choice():
    # window 1: accept 1, correction 2 | window 2: accept 3 4, correction 5 | window 3: accept 6 (the end)
    replay = replay_greedy(TARGET, RANKED, None, 4)
    assert (replay.windows, replay.tokens, replay.accepted) == (3, 6, 4)


def test_side_children_catch_the_second_choices():
    # widths 2,2,2: window 1 accepts 1 (main), then 2 (a side child, a leaf) and takes the target's
    # token after it, 3 | window 2 at position 3: 4 on the main path, 5 as a side child, then 6
    replay = replay_greedy(TARGET, RANKED, Widths((2, 2, 2)), 6)
    assert (replay.windows, replay.tokens, replay.accepted) == (2, 6, 4)
    assert replay.tokens_per_window == 3.0
    # widths 1,2 (a side child at depth 2 only): the same windows within a budget of 3
    second = replay_greedy(TARGET, RANKED, Widths((1, 2)), 3)
    assert (second.windows, second.tokens, second.accepted) == (2, 6, 4)


def test_a_replay_refuses_what_a_recording_cannot_decide():
    with pytest.raises(ConfigError, match="only fixed widths"):
        replay_greedy(TARGET, RANKED, Dynamic(), 4)
    with pytest.raises(ConfigError, match="6 target tokens but 5"):
        replay_greedy(TARGET, RANKED[:5], None, 4)


def _all_trees(ranks: int, budget: int):
    """Every tree of at most ``budget`` nodes over ``ranks`` choices per node, as sets of rank sequences."""
    seen, stack = set(), [frozenset()]
    while stack:
        tree = stack.pop()
        if tree in seen:
            continue
        seen.add(tree)
        if len(tree) < budget:
            for node in [()] + sorted(tree):
                for j in range(ranks):
                    child = node + (j,)
                    if child not in tree:
                        stack.append(tree | {child})
    return seen


@pytest.mark.parametrize("rates", [[0.6, 0.25, 0.1], [0.5, 0.5], [0.9, 0.05], [0.3, 0.3, 0.3], [1.0]])
@pytest.mark.parametrize("budget", [1, 2, 3, 4])
def test_the_best_tree_is_the_best_of_every_tree_under_position_independent_acceptance(rates, budget):
    """Against exhaustive enumeration: every prefix-closed set of rank sequences of at most ``budget`` nodes,
    each committing 1 + the sum over its nodes of the product of their ranks' rates."""
    import math

    from dsi.sim.trees import best_tree_tokens

    def tokens(tree) -> float:
        return 1.0 + sum(math.prod(rates[j] for j in node) for node in tree)

    best = max(tokens(t) for t in _all_trees(len(rates), budget))
    assert best_tree_tokens(rates, budget) == pytest.approx(best, abs=1e-12)
    chain = 1.0 + sum(rates[0] ** d for d in range(1, budget + 1))
    assert best_tree_tokens(rates[:1], budget) == pytest.approx(chain, abs=1e-12)


def test_rank_rates_count_where_the_targets_token_sits_in_the_drafters_ranking():
    from dsi.sim.trees import best_tree_tokens, rank_rates

    rates = rank_rates(TARGET, RANKED, 3)  # first choice right at 4 of 6 positions, second at 2
    assert rates == pytest.approx([4 / 6, 2 / 6, 0.0])
    assert rank_rates(TARGET, RANKED, 1) == pytest.approx([4 / 6])
    # at p1 = 0.65 the best tree of 4 nodes is the chain (0.65^4 = 0.18 > 0.16, the second choice's rate)
    assert best_tree_tokens([0.65, 0.16], 4) == best_tree_tokens([0.65], 4)
    assert best_tree_tokens([0.65, 0.16], 8) > best_tree_tokens([0.65], 8)


@pytest.mark.parametrize("rates, budget, fragment", [
    ([0.7, 0.5], 4, "disjoint events"), ([-0.1], 4, "disjoint events"), ([0.5], -1, "budget=-1"),
    ([0.5], 2.5, "budget=2.5"),
])
def test_bad_bound_inputs_are_refused_naming_the_value(rates, budget, fragment):
    from dsi.sim.trees import best_tree_tokens

    with pytest.raises(ConfigError, match=fragment):
        best_tree_tokens(rates, budget)
