"""Property tests of the verification math over extreme logits and parameters (hypothesis).

Logit rows mix +-inf, +-1e308, subnormals, exact ties and ordinary values; temperatures run from
the smallest subnormal to 1e308. Whatever the combination, a processed distribution is finite,
non-negative, sums to 1 and keeps the argmax; every token the math returns is in range and has
positive probability under the law it was drawn from. NaN logits and all -inf rows are refused
with :class:`ModelError`, never turned into a token. The examples are derandomized (the same ones
on every run) and few, so the file runs in seconds.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsi.errors import ConfigError, ModelError
from dsi.sampling import (
    LAW_DTYPE,
    SamplingParams,
    bonus,
    decide,
    draft_from_logits,
    process_logits,
    residual,
    sample_from,
)

PROPERTY = settings(max_examples=150, deadline=None, derandomize=True, database=None)

EXTREMES = [np.inf, -np.inf, 1e308, -1e308, 1.7976931348623157e308, 5e-324, -5e-324, 0.0, 1.0, -1.0, 30.0]
logit_values = st.one_of(
    st.sampled_from(EXTREMES),
    st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False),
)
# rows with at least one logit above -inf (an all -inf row is refused, tested below)
rows = st.lists(logit_values, min_size=2, max_size=12).filter(lambda r: max(r) > -np.inf).map(np.array)
temperatures = st.one_of(
    st.sampled_from([0.0, 5e-324, 1e-320, 1e-300, 1e-12, 0.5, 1.0, 7.0, 1e300, 1e308]),
    st.floats(min_value=0.0, max_value=1e308, allow_nan=False, allow_infinity=False),
)
top_ps = st.one_of(st.sampled_from([1.0, 1e-12, 0.5, 0.999999]),
                   st.floats(min_value=1e-9, max_value=1.0, exclude_min=True))
uniforms = st.one_of(st.sampled_from([0.0, 0.5, 1.0 - 2**-53]),
                     st.floats(min_value=0.0, max_value=1.0, exclude_max=True))


@st.composite
def params(draw, greedy: bool | None = None):
    t = 0.0 if greedy else draw(temperatures)
    if greedy is False and t == 0.0:
        t = 1.0
    return SamplingParams(temperature=t, top_k=draw(st.integers(0, 14)), top_p=draw(top_ps),
                          seed=draw(st.integers(0, 2**63 - 1)))


def assert_distribution(probs: np.ndarray, size: int) -> None:
    assert probs.shape == (size,) and probs.dtype == LAW_DTYPE
    assert np.isfinite(probs).all() and (probs >= 0.0).all()
    assert abs(float(probs.sum(dtype=np.float64)) - 1.0) < 1e-5  # float32 laws (dsi.sampling.LAW_DTYPE)


@PROPERTY
@given(row=rows, sp=params())
def test_processed_distribution_is_finite_normalised_and_keeps_the_argmax(row, sp):
    probs = process_logits(row, sp)
    assert_distribution(probs, row.size)
    assert probs[int(np.argmax(row))] > 0.0  # the greedy token (first +inf, else first max) survives
    assert (probs[row == -np.inf] == 0.0).all()
    if sp.greedy:
        assert probs[int(np.argmax(row))] == 1.0
    if np.isposinf(row).any():  # the limit as those logits grow: nothing else keeps any mass
        assert probs[~np.isposinf(row)].sum() == 0.0


@PROPERTY
@given(row=rows, sp=params(greedy=False), u=uniforms)
def test_sampled_tokens_are_in_range_with_positive_probability(row, sp, u):
    probs = process_logits(row, sp)
    token = sample_from(probs, u)
    assert 0 <= token < row.size and probs[token] > 0.0
    token = bonus(probs, sp, position=int(u * 1000))
    assert 0 <= token < row.size and probs[token] > 0.0
    token, q = draft_from_logits(row, sp, position=3)
    assert 0 <= token < row.size and q[token] > 0.0


@PROPERTY
@given(data=st.data(), sp=params(), position=st.integers(0, 10**6))
def test_decide_commits_a_token_the_target_allows(data, sp, position):
    size = data.draw(st.integers(2, 10))
    p_row = np.array(data.draw(st.lists(logit_values, min_size=size, max_size=size).filter(lambda r: max(r) > -np.inf)))
    q_row = np.array(data.draw(st.lists(logit_values, min_size=size, max_size=size).filter(lambda r: max(r) > -np.inf)))
    p, q = process_logits(p_row, sp), process_logits(q_row, sp)
    # a drafted token, or any token at all (also one the drafter gives probability 0)
    draft = data.draw(st.one_of(st.just(draft_from_logits(q_row, sp, position)[0]), st.integers(0, size - 1)))
    decision = decide(p, draft, None if sp.greedy else q, sp, position)
    assert 0 <= decision.token < size and p[decision.token] > 0.0
    if decision.accepted:
        assert decision.token == draft


@PROPERTY
@given(data=st.data(), sp=params(greedy=False))
def test_residual_is_a_distribution_on_the_targets_support(data, sp):
    size = data.draw(st.integers(2, 10))
    p = process_logits(np.array(data.draw(st.lists(logit_values, min_size=size, max_size=size)
                                          .filter(lambda r: max(r) > -np.inf))), sp)
    q = process_logits(np.array(data.draw(st.lists(logit_values, min_size=size, max_size=size)
                                          .filter(lambda r: max(r) > -np.inf))), sp)
    r = residual(p, q)
    assert_distribution(r, size)
    assert (r[p == 0.0] == 0.0).all()  # never a token the target rules out (p == q falls back to p)


@pytest.mark.parametrize("temperature", [5e-324, 1e-320, 1e-310, 1e-300])
def test_overflowing_temperatures_give_their_limit_not_nan(temperature):
    """The issue's case: logits / 1e-320 overflows; the result is the T -> 0 limit, uniform on ties."""
    sp = SamplingParams(temperature=temperature, seed=1)
    assert not sp.greedy
    assert process_logits(np.array([1.0, 3.0, 2.0, -4.0]), sp).tolist() == [0.0, 1.0, 0.0, 0.0]
    assert process_logits(np.array([1.0, 3.0, 2.0, 3.0]), sp).tolist() == [0.0, 0.5, 0.0, 0.5]
    # huge finite gaps: exp of a gap past -1.8e308 is 0, the maximum keeps everything
    assert process_logits(np.array([-1e308, 1e308, 0.0]), sp).tolist() == [0.0, 1.0, 0.0]
    tokens = {bonus(process_logits(np.array([1.0, 3.0, 2.0, -4.0]), sp), sp, pos) for pos in range(50)}
    assert tokens == {1}  # the last vocabulary id repeated was the bug


def test_plus_inf_logits_share_the_mass_and_greedy_agrees():
    row = np.array([0.0, np.inf, 5.0, np.inf])
    assert process_logits(row, SamplingParams(temperature=2.0)).tolist() == [0.0, 0.5, 0.0, 0.5]
    assert process_logits(row, SamplingParams()).tolist() == [0.0, 1.0, 0.0, 0.0]
    assert draft_from_logits(row, SamplingParams(), 0) == (1, None)


@pytest.mark.parametrize("sp", [SamplingParams(), SamplingParams(temperature=1.0, top_k=2, top_p=0.5)])
@pytest.mark.parametrize("row, fragment", [
    ([0.0, np.nan, 1.0], r"NaN logits at 1 token ids \(first \[1\]\)"),
    ([np.nan, np.nan], r"NaN logits at 2 token ids"),
    ([-np.inf, -np.inf, -np.inf], "-inf for all 3 logits"),
])
def test_nan_and_all_minus_inf_logits_are_a_model_error(sp, row, fragment):
    with pytest.raises(ModelError, match=fragment):
        process_logits(np.array(row), sp)
    with pytest.raises(ModelError, match=fragment):
        draft_from_logits(np.array(row), sp, 0)


@pytest.mark.parametrize("probs", [np.zeros(3), np.array([0.5, np.nan, 0.5]), np.array([1.0, -0.5, 0.5])])
def test_sample_from_refuses_a_row_without_positive_finite_mass(probs):
    with pytest.raises(ModelError, match="cannot sample"):
        sample_from(probs, 0.5)


@pytest.mark.parametrize("draft", [-1, 3, 2.0])
def test_decide_refuses_an_out_of_range_draft(draft):
    p = np.array([0.2, 0.3, 0.5])
    with pytest.raises(ConfigError, match=f"draft={draft!r} must be a token id in \\[0, 3\\)"):
        decide(p, draft, p, SamplingParams(temperature=1.0), 0)


def test_a_draft_the_drafter_could_not_draw_is_accepted_only_if_the_target_allows_it():
    sp = SamplingParams(temperature=1.0)
    p, q = np.array([0.0, 0.5, 0.5]), np.array([0.0, 1.0, 0.0])
    for position in range(30):
        assert decide(p, 0, q, sp, position).token != 0  # p = q = 0: always rejected
        assert decide(p, 2, q, sp, position) == decide(p, 2, q, sp, position)
        assert decide(p, 2, q, sp, position).accepted  # q = 0 < p: always accepted
