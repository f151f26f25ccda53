"""compare.first_divergence: where a method departs from non-SI, and the target's margin there."""

from __future__ import annotations

import numpy as np
import pytest

from dsi.cli.generate import _identical_mark
from dsi.compare import first_divergence
from dsi.models import CallableLM


def target():
    # after any context, token 3 leads token 4 by 0.01 logits and token 5 by 2.0
    return CallableLM(lambda ctx: np.array([0.0, 0.0, 0.0, 1.0, 0.99, -1.0]), 6)


def test_identical_outputs_have_no_divergence():
    assert first_divergence(target(), [1], [3, 3, 3], [3, 3, 3]) is None


@pytest.mark.parametrize("other, index, margin", [([3, 4, 3], 1, 0.01), ([5, 3], 0, 2.0)])
def test_divergence_index_and_margin(other, index, margin):
    div = first_divergence(target(), [1], [3, 3, 3], other)
    assert div["index"] == index
    assert div["margin"] == pytest.approx(margin)


def test_length_mismatch_without_token_difference():
    assert first_divergence(target(), [1], [3, 3, 3], [3, 3]) == {"index": 2, "margin": None}


def test_identical_mark_distinguishes_near_ties_from_errors():
    assert _identical_mark({"identical": True}) == "✓"
    assert _identical_mark({"identical": False, "divergence": {"index": 7, "margin": 0.06, "near_tie": True}}) == "≈ @7 margin 0.060"
    assert _identical_mark({"identical": False, "divergence": {"index": 2, "margin": 3.0, "near_tie": False}}).startswith("✗")
