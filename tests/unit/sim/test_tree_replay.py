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
