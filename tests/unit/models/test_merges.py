"""Merged tokens (dsi.models.vocab.merges): which target tokens are merges, which shared tokens a position looks
ahead from, and how their mass is split; the law through a whole engine is tests/stats/test_chi_square_crossvocab.py."""

from __future__ import annotations

import numpy as np
import pytest

import dsi
from dsi.errors import ConfigError
from dsi.models import CallableLM
from dsi.models.vocab.bridge import CrossVocabularyDrafter, bridge_drafter
from dsi.models.vocab.merges import MergeTable, merge_candidates, merge_logits
from dsi.models.vocab.vocabulary import Vocabulary
from dsi.sampling import SamplingParams
from tests.tiny_vocab import PiecesTokenizer

T_TEXTS = ["a", "b", "ab", "c", "abc", "bc!", "!"]  # target ids 0..6
D_TEXTS = ["c", "b", "a", "bc", "!", "<eos>"]  # drafter ids 0..5; "a", "b", "c", "!" shared


def vocabularies():
    return (Vocabulary.from_tokenizer(PiecesTokenizer(T_TEXTS)), Vocabulary.from_tokenizer(PiecesTokenizer(D_TEXTS)))


def test_a_merge_is_a_target_token_outside_the_intersection_spelled_by_a_shared_token_and_one_drafter_token():
    target, drafter = vocabularies()
    table = MergeTable.of(target, drafter, len(T_TEXTS), drafter_stop_ids=[5])
    merges = {(int(a), int(b), int(t)) for a, (bs, ts) in table.completions.items() for b, t in zip(bs, ts)}
    # "ab" = a + b and "abc" = a + bc (not ab + c: "ab" is no drafter token); "bc!" = b + "c!"? no such drafter
    # token, and "bc" + "!" starts with a drafter token the target lacks: not a merge
    assert merges == {(2, 1, 2), (2, 3, 4)}
    assert table.starters.tolist() == [2] and table.target_of == {2: 0} and table.size == 2


def test_the_drafter_s_stop_token_never_completes_a_merge():
    target = Vocabulary.from_tokenizer(PiecesTokenizer(["a", "a<eos>"]))
    drafter = Vocabulary.from_tokenizer(PiecesTokenizer(["a", "<eos>"]))
    assert MergeTable.of(target, drafter, 2).size == 1
    assert MergeTable.of(target, drafter, 2, drafter_stop_ids=[1]).size == 0


def test_candidates_are_the_likeliest_starters_within_the_floor_most_likely_first():
    starters = np.array([1, 4, 6, 7])
    table = MergeTable(starters, {int(a): (np.array([0]), np.array([0])) for a in starters},
                       {int(a): int(a) for a in starters})
    row = np.array([9.0, 1.0, 0.0, 0.0, 3.0, 0.0, 2.0, np.log(0.001)])
    assert merge_candidates(table, row, shared_max=3.0, lookahead=3) == [4, 6, 1]
    assert merge_candidates(table, row, shared_max=3.0, lookahead=2) == [4, 6]
    assert merge_candidates(table, row, shared_max=3.0, lookahead=0) == []
    assert merge_candidates(table, row, shared_max=3.0, lookahead=3, floor=0.3) == [4, 6]  # e^-1 > 0.3 > e^-2
    assert merge_candidates(table, row, shared_max=-np.inf, lookahead=3) == []


def test_the_split_keeps_every_other_token_and_the_total_mass():
    target, drafter = vocabularies()
    table = MergeTable.of(target, drafter, len(T_TEXTS))
    row = np.array([0.5, -1.0, -np.inf, 0.2, -np.inf, -np.inf, -2.0])  # intersection logits in target ids
    after_a = np.log([0.1, 0.3, 0.1, 0.2, 0.1, 0.2])  # drafter ids: b 0.3, bc 0.2
    merged = merge_logits(row.copy(), table, [2], [after_a])
    before, after = np.exp(row), np.exp(merged)
    np.testing.assert_allclose(after.sum(), before.sum(), rtol=1e-12)
    np.testing.assert_allclose(after[[0, 2, 4]], before[0] * np.array([0.5, 0.3, 0.2]), rtol=1e-12)
    np.testing.assert_array_equal(merged[[1, 3, 5, 6]], row[[1, 3, 5, 6]])
    # a drafter sure to go on with a merge leaves the shared token nothing
    sure = np.array([-np.inf, 0.0, -np.inf, -np.inf, -np.inf, -np.inf])
    assert np.isneginf(merge_logits(row.copy(), table, [2], [sure])[0])


def test_merges_is_checked_and_reported():
    target, drafter = vocabularies()
    for bad in (-1, "some", 1.5, True):
        with pytest.raises(ConfigError, match=f"merges={bad!r} must be 'auto' or an int >= 0"):
            CrossVocabularyDrafter(CallableLM(lambda ctx: np.zeros(6), 6), target, drafter, vocab_size=7, merges=bad)
    model = bridge_drafter(CallableLM(lambda ctx: np.zeros(7), 7), CallableLM(lambda ctx: np.zeros(6), 6),
                           "intersection", target_tokenizer=PiecesTokenizer(T_TEXTS),
                           drafter_tokenizer=PiecesTokenizer(D_TEXTS), merges=2)
    info = model.request_info(SamplingParams(temperature=1.0))
    assert (info["vocab_merge_lookahead"], info["vocab_merges"]) == (2, 2)


@pytest.mark.parametrize("token_s, looks_ahead", [(0.0, 3), (0.0005, 3), (0.002, 0)])
def test_auto_looks_ahead_where_a_drafter_row_is_cheap(token_s, looks_ahead):
    """``merges="auto"``: the drafter's stated row price (here a latency model: 10 ms a forward and ``token_s``
    a token more) decides, at most 0.1 of a one-token forward (a GPU) or nothing (a CPU)."""
    from dsi.models import WithLatency

    target, drafter = vocabularies()
    slow = WithLatency(CallableLM(lambda ctx: np.zeros(6), 6), 0.01, 0.01, token_s=token_s)
    model = CrossVocabularyDrafter(slow, target, drafter, vocab_size=7, mode="intersection")
    assert model.merges == looks_ahead
    assert model.request_info(SamplingParams(temperature=1.0))["vocab_merge_lookahead"] == looks_ahead
    assert "merges='auto'" in repr(model)


def test_auto_without_a_stated_price_looks_ahead_on_an_accelerator_only():
    """No stated costs: a drafter (or the model it wraps) on a GPU looks ahead, one on the CPU or that says
    nothing (llama.cpp here) does not; never timed, so the law cannot follow a measurement."""
    from types import SimpleNamespace

    from dsi.models.vocab.merges import merges_for

    assert merges_for(SimpleNamespace(device="cuda:0")) == 3
    assert merges_for(SimpleNamespace(device="cpu")) == 0
    assert merges_for(SimpleNamespace()) == 0
    assert merges_for(SimpleNamespace(wrapped_model=SimpleNamespace(device="cuda"))) == 3
    assert merges_for(SimpleNamespace(wrapped_model=CallableLM(lambda ctx: np.zeros(2), 2))) == 3  # states 0


@pytest.mark.parametrize("via", ["bridge_drafter", "dsi.generate"])
@pytest.mark.parametrize("merges", [0, 3])
@pytest.mark.parametrize("method", ["si", "dsi"])
def test_greedy_output_is_the_target_s_own_with_merged_drafts(method, merges, via, no_thread_leak):
    """A target that writes "ab" and "abc", a drafter that writes "a" and then "b" (or "bc", less often): merges
    draft "ab", which the target often writes; plain TLI drafts "a", which it never does. Greedy output is
    non-SI's either way; ``merges`` is the same through ``bridge_drafter`` and ``dsi.generate``."""
    text = [2, 2, 4, 2, 4, 4, 2, 2, 2, 4, 2, 2]

    def target_row(ctx):  # the target writes ``text`` after the one-token prompt, then "c"
        logits = np.zeros(len(T_TEXTS))
        logits[text[len(ctx) - 1] if len(ctx) - 1 < len(text) else 3] = 5.0
        return logits

    def drafter_row(ctx):  # after "a": "b" (and "bc" a little less); else "a"
        logits = np.zeros(len(D_TEXTS))
        if ctx and ctx[-1] == 2:
            logits[[1, 3]] = [3.0, 2.5]
        else:
            logits[2] = 3.0
        return logits

    target, drafter = CallableLM(target_row, len(T_TEXTS)), CallableLM(drafter_row, len(D_TEXTS))
    tokenizers = dict(target_tokenizer=PiecesTokenizer(T_TEXTS), drafter_tokenizer=PiecesTokenizer(D_TEXTS))
    plain = dsi.generate(target=target, prompt=[3], max_new_tokens=12, method="ar").tokens
    if via == "bridge_drafter":
        bridged = bridge_drafter(target, drafter, "intersection", merges=merges, **tokenizers)
        out = dsi.generate(target=target, drafter=bridged, prompt=[3], max_new_tokens=12, method=method, lookahead=3)
    else:
        out = dsi.generate(target=target, drafter=drafter, prompt=[3], max_new_tokens=12, method=method, lookahead=3,
                           vocab_mode="intersection", merges=merges, **tokenizers)
    assert out.tokens == plain == text
    assert out.stats.extra["vocab_merge_lookahead"] == merges
    if merges:
        assert out.stats.accepted_tokens >= 4 and out.stats.extra["drafter_merge_forwards"] > 0
    else:
        assert out.stats.accepted_tokens == 0 and out.stats.extra.get("drafter_merge_forwards", 0) == 0


def test_merges_are_refused_where_they_cannot_apply():
    """A number for a drafter of the target's own vocabulary (nothing to merge), and one that contradicts a
    drafter bridged already, are refused naming the value; ``"auto"`` is always accepted."""
    same = CallableLM(lambda ctx: np.zeros(7), 7)
    with pytest.raises(ConfigError, match="merges=3 applies to a drafter of another vocabulary"):
        dsi.build_decoder(target=same, drafter=CallableLM(lambda ctx: np.ones(7), 7), method="si", merges=3)
    dsi.build_decoder(target=same, drafter=CallableLM(lambda ctx: np.ones(7), 7), method="si", merges="auto").close()
    bridged = bridge_drafter(same, CallableLM(lambda ctx: np.zeros(6), 6), "intersection",
                             target_tokenizer=PiecesTokenizer(T_TEXTS), drafter_tokenizer=PiecesTokenizer(D_TEXTS),
                             merges=2)
    assert bridge_drafter(same, bridged, merges=2) is bridged and bridge_drafter(same, bridged) is bridged
    with pytest.raises(ConfigError, match="merges=0 for a drafter bridged already with merges=2"):
        bridge_drafter(same, bridged, merges=0)
    with pytest.raises(ConfigError, match="merges='3' must be 'auto' or an int >= 0"):
        dsi.generate(target=same, drafter=bridged, prompt=[1], max_new_tokens=2, method="si", merges="3")
