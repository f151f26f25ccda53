"""Draft trees in the engines (issue 24): tree windows in SI and DSI stay exact and deterministic.

The pair: a random target and, as drafter, the target's logits plus seeded noise, so the drafter's
second and third choices are often the target's token (side children win: the trees matter).

- Greedy SI and DSI with trees commit exactly non-SI's tokens, for fixed shapes and ``auto``, any k,
  event-driven windows and SP, with penalties too, and count every token once in the stats.
- Sampled DSI with a tree gives the same tokens for any SP, lookahead and window policy (where a
  tree branches is a function of each position's drafter row, never of the cut).
- Logprobs come from the row that decided each token: a side path's rows are processed with their
  own prefix, so they equal non-SI's numbers.
- (A drafter of another vocabulary: tests/unit/engine/test_crossvocab.py.)
"""

from __future__ import annotations

import numpy as np
import pytest

import dsi
from dsi.errors import ConfigError
from dsi.models import CallableLM
from tests.conftest import Jitter, random_lm

VOCAB = 16
PROMPT = [1, 2, 3]


def noisy_pair(seed: int = 1, noise: float = 1.5):
    target = random_lm(VOCAB, seed, sharpness=2.0)

    def drafter_logits(tokens):
        rng = np.random.default_rng([seed, len(tokens), *tokens])
        return np.asarray(target.next_logits(tuple(tokens)), dtype=np.float64) + rng.normal(0, noise, VOCAB)

    return target, CallableLM(drafter_logits, VOCAB, name="noisy target")


def reference(target, tokens, sampling=None, logprobs=None):
    return dsi.generate(target=target, prompt=PROMPT, method="ar", max_new_tokens=tokens, sampling=sampling,
                        logprobs=logprobs)


@pytest.mark.parametrize("method, tree, lookahead, servers", [
    ("si", "2,2,1", 4, 1), ("si", "3,1,1", 3, 1), ("si", "auto", 5, 1), ("si", "auto", 1, 1), ("si", "best-first", 5, 1),
    ("si", "branches", 5, 1), ("si", "branches:0.05", 3, 1),
    ("dsi", "2", 1, 1), ("dsi", "3", 3, 2), ("dsi", "auto", 2, 3), ("dsi", "auto", "auto", 2), ("dsi", "2", "auto", 4),
    ("dsi", "branches", 3, 2), ("dsi", "branches:0.05", "auto", 3),
])
def test_greedy_tree_windows_equal_non_si(method, tree, lookahead, servers, no_thread_leak):
    target, drafter = noisy_pair()
    expected = reference(target, 60).tokens
    jt, jd = Jitter(target, 0.0015, 5), Jitter(drafter, 0.0005, 6)
    # "auto" and "branches" price a tree from the forwards they measure: on a loaded machine they may find chains
    # cheaper, so they have up to three runs to pick a tree (each run's output must be exact whatever it picks)
    for _ in range(3 if tree in ("auto", "branches") else 1):
        out = dsi.generate(target=jt, drafter=jd, prompt=PROMPT, method=method, max_new_tokens=60,
                           lookahead=lookahead, num_target_servers=servers, draft_tree=tree)
        assert out.tokens == expected
        stats = out.stats
        assert stats.accepted_tokens + stats.rejections + stats.bonus_tokens == 60
        if stats.extra["draft_tree"] == tree:
            break
    assert stats.extra["draft_tree"] == tree and stats.extra["tree_windows"] > 0
    assert stats.extra.get("tree_side_accepts", 0) > 0  # the drafter's second choices won somewhere


def test_greedy_trees_with_penalties_and_stop_ids_equal_non_si(no_thread_leak):
    """Each path's rows are processed with that path's tokens (penalties count them), on the server."""
    target, drafter = noisy_pair(seed=4)
    params = dsi.SamplingParams(presence_penalty=0.8, repetition_penalty=1.3, logit_bias={3: 1.0}, min_tokens=10,
                                stop_token_ids=[7])
    expected = dsi.generate(target=target, prompt=PROMPT, method="ar", max_new_tokens=50, sampling=params).tokens
    for method, tree, k in (("si", "2,2,2", 4), ("dsi", "auto", 3), ("dsi", "3", "auto"), ("dsi", "branches", 2)):
        out = dsi.generate(target=target, drafter=drafter, prompt=PROMPT, method=method, max_new_tokens=50,
                           lookahead=k, draft_tree=tree, sampling=params)
        assert out.tokens == expected, (method, tree, k)


def test_more_side_children_commit_more_tokens_per_target_forward(no_thread_leak):
    """Greedy SI with the same main path (depth 2) and 0, 1, 2 side children below the root: the budget k
    grows by each side child, and so do the tokens a target forward commits."""
    target, drafter = noisy_pair(seed=2)
    per_forward = []
    for tree, k in (("1,1", 2), ("2,1", 3), ("3,1", 4)):
        out = dsi.generate(target=target, drafter=drafter, prompt=PROMPT, method="si", max_new_tokens=80, lookahead=k,
                           draft_tree=tree)
        per_forward.append(80 / out.stats.target_forwards)
    assert per_forward[0] <= per_forward[1] <= per_forward[2] and per_forward[0] < per_forward[2], per_forward


def test_sampled_dsi_with_a_tree_is_the_same_for_any_sp_lookahead_and_window_policy(no_thread_leak):
    """The token after a side child that won is the target's draw whether the row after that child came in
    the deciding window's result, in the next window's (kept as the next epoch's window 0), or from a new
    zero-draft task: all three happen here, and the tokens do not change."""
    target, drafter = noisy_pair(seed=3)
    params = dsi.SamplingParams(temperature=0.9, seed=11, frequency_penalty=0.3)
    jt, jd = Jitter(target, 0.0015, 1), Jitter(drafter, 0.0005, 2)
    for tree in ("2", "auto"):
        outputs, side_wins, adopted = set(), 0, 0
        for lookahead, servers in ((1, 1), (3, 1), (3, 3), ("auto", 1), ("auto", 3)):
            out = dsi.generate(target=jt, drafter=jd, prompt=PROMPT, method="dsi", max_new_tokens=50,
                               lookahead=lookahead, num_target_servers=servers, draft_tree=tree, sampling=params)
            outputs.add(tuple(out.tokens))
            side_wins += out.stats.extra.get("tree_side_accepts", 0)
            adopted += out.stats.extra.get("tree_adopted_windows", 0)
        assert len(outputs) == 1, tree
        assert side_wins > adopted > 0, tree


@pytest.mark.parametrize("wrap, depth", [("path by path", 1), ("one forward", 1),
                                         pytest.param("one forward", 3, marks=pytest.mark.slow)])
def test_sampled_dsi_with_branches_commits_autos_tokens_for_any_sp_lookahead_and_window_policy(wrap, depth,
                                                                                              monkeypatch,
                                                                                              no_thread_leak):
    """``"branches"`` decides as ``"auto"`` with its floor does (after a side child that won, the target's own
    draw), and only adds the drafter's draft after each side child as a guess at that draw, with the row after
    it: so its tokens are ``auto``'s, seed for seed, whether that draft and its row came with the window or
    not; on a drafter that computes a tree in one forward (the latency model) the side children's drafts come
    from the main path's forwards. Side chains deeper than one token (``depth``) seed the next epoch with the
    drafts a restarted drafter would make there, with their side children, so the tokens are still ``auto``'s."""
    import dsi.trees
    from dsi.models import WithLatency

    monkeypatch.setattr(dsi.trees, "DSI_CHAIN_DEPTH", depth)

    target, drafter = noisy_pair(seed=3)
    jt = Jitter(target, 0.0015, 1)
    jd = Jitter(drafter, 0.0005, 2) if wrap == "path by path" else WithLatency(drafter, 0.0005, 0.0005, cv=0.5)
    for seed in (11, 12):
        params = dsi.SamplingParams(temperature=0.9, seed=seed, frequency_penalty=0.3)
        auto = dsi.generate(target=jt, drafter=jd, prompt=PROMPT, method="dsi", max_new_tokens=50, lookahead=3,
                            num_target_servers=2, sampling=params, draft_tree="auto:0.05")
        side_wins = continued = 0
        for lookahead, servers in ((1, 1), (3, 1), (4, 3), ("auto", 1), ("auto", 3)):
            out = dsi.generate(target=jt, drafter=jd, prompt=PROMPT, method="dsi", max_new_tokens=50,
                               lookahead=lookahead, num_target_servers=servers, draft_tree="branches:0.05",
                               sampling=params)
            assert out.tokens == auto.tokens, (seed, lookahead, servers)
            stats = out.stats
            assert stats.accepted_tokens + stats.rejections + stats.bonus_tokens == 50
            assert (stats.rejections, stats.extra["tree_side_accepts"]) == (auto.stats.rejections,
                                                                          auto.stats.extra["tree_side_accepts"])
            side_wins += stats.extra.get("tree_side_accepts", 0)
            continued += stats.extra.get("tree_continued_sides", 0)
        assert side_wins >= continued > 0, seed


def periodically_wrong_drafter(target, period: int):
    """A drafter whose likeliest token is the target's second (and its second the target's first) after a
    context whose length is a multiple of ``period``, and the target's own after any other."""
    def logits(tokens):
        row = np.asarray(target.next_logits(tuple(tokens)), dtype=np.float64).copy()
        if len(tokens) % period == 0:
            first, second = np.argsort(-row, kind="stable")[:2]
            row[first], row[second] = row[second], row[first]
        return row

    return CallableLM(logits, VOCAB, name=f"drafter wrong every {period}")


@pytest.mark.parametrize("lookahead, servers", [(4, 1), (4, 2), (6, 3)])
def test_a_side_child_that_wins_is_followed_by_its_drafted_continuation_from_the_same_window(lookahead, servers,
                                                                                              no_thread_leak):
    """Every other draft is wrong and its side child right, and the drafter's draft after that child right
    again: with ``"branches"`` the window that holds the child holds that draft and the row after it, so a side
    win commits the child and the target's token after it (that draft) and goes on, its next position decided
    by the row after it from the same result; greedy output stays non-SI's, no rejection, and fewer
    verifications than leaf side children (``"2"``) need."""
    target = random_lm(VOCAB, 7, sharpness=2.0)
    drafter = periodically_wrong_drafter(target, 2)
    expected = reference(target, 40).tokens
    jt, jd = Jitter(target, 0.002, 1), Jitter(drafter, 0.0002, 2)
    kwargs = dict(prompt=PROMPT, method="dsi", max_new_tokens=40, lookahead=lookahead, num_target_servers=servers)
    runs = {tree: dsi.generate(target=jt, drafter=jd, draft_tree=tree, **kwargs) for tree in ("branches:0.01", "2")}
    for out in runs.values():
        assert out.tokens == expected
    stats = runs["branches:0.01"].stats
    assert stats.rejections == 0 and stats.extra["tree_side_accepts"] > 0
    assert stats.extra["tree_continued_sides"] > 0
    assert stats.verify_tasks < runs["2"].stats.verify_tasks


@pytest.mark.parametrize("lookahead, servers", [(3, 2), ("auto", 2), ("auto", 4)])
def test_a_side_child_that_wins_goes_on_along_its_side_chain_decided_by_rows_already_computed(lookahead, servers,
                                                                                              monkeypatch,
                                                                                              no_thread_leak):
    """Every fifth draft is wrong and its side child right, and the drafter right for the next four: with
    ``"branches"`` each side child continues as a side chain, a token per drafter step, carried by the windows
    sent after each token is drafted (their trees rooted at the child's position), so a side win commits the child
    and goes on along its chain, positions after it decided by rows those windows computed: more than one such
    row per side win (one, the row after the drafter's first token after the child, with chains one token deep),
    and greedy output stays non-SI's with no rejection."""
    import dsi.trees

    target = random_lm(VOCAB, 7, sharpness=2.0)
    drafter = periodically_wrong_drafter(target, 5)
    expected = reference(target, 60).tokens
    jt, jd = Jitter(target, 0.004, 1), Jitter(drafter, 0.0002, 2)
    kwargs = dict(prompt=PROMPT, method="dsi", max_new_tokens=60, lookahead=lookahead, num_target_servers=servers,
                  draft_tree="branches:0.01")
    # whether a side chain is carried, and how far beyond one row, follows timing (event-driven windows, jitter):
    # a loaded machine may send every window before a chain grows, so each depth has up to three runs to show it
    rows_per_win: dict[int, list[float]] = {1: [], 4: []}
    shown = {1: lambda rows: rows > 0, 4: lambda rows: rows > 1.0}
    for depth in (1, 4):
        monkeypatch.setattr(dsi.trees, "DSI_CHAIN_DEPTH", depth)
        for _ in range(3):
            out = dsi.generate(target=jt, drafter=jd, **kwargs)
            assert out.tokens == expected, depth
            stats = out.stats
            assert stats.rejections == 0 and stats.extra["tree_side_accepts"] >= 8, depth
            carried = stats.extra.get("tree_continued_sides", 0)
            rows_per_win[depth].append(stats.extra["tree_side_chain_rows"] / carried if carried else 0.0)
            if shown[depth](rows_per_win[depth][-1]):
                break
    assert all(r in (0.0, 1.0) for r in rows_per_win[1]) and 1.0 in rows_per_win[1], rows_per_win
    assert max(rows_per_win[4]) > 1.0, rows_per_win


def test_dsis_auto_tree_grows_side_chains_only_where_a_verified_row_is_nearly_free(no_thread_leak):
    """DSI's ``"auto"`` continues its side children as side chains (as ``"branches"`` does) where its floor was
    priced from a row costing at most ``CHAIN_PRICE`` of a forward (a latency model whose forward costs the same
    for any number of tokens), not where a row costs more (a twentieth of the forward: floor 0.1, leaf side
    children), nor at a fixed floor; the tokens are non-SI's in all three."""
    from dsi.models import WithLatency
    from dsi.trees import CHAIN_PRICE

    target = random_lm(VOCAB, 7, sharpness=2.0)
    drafter = periodically_wrong_drafter(target, 5)
    expected = reference(target, 50).tokens
    runs = {}
    for label, token_s, tree in (("free", 0.0, "auto"), ("priced", 0.0002, "auto"), ("fixed", 0.0, "auto:0.02")):
        out = dsi.generate(target=WithLatency(target, ttft=0.004, tpot=0.004, token_s=token_s),
                           drafter=Jitter(drafter, 0.0002, 2), prompt=PROMPT, method="dsi", max_new_tokens=50,
                           lookahead="auto", num_target_servers=2, draft_tree=tree)
        assert out.tokens == expected, label
        runs[label] = out.stats.extra
    assert runs["free"]["tree_row_price"] == 0.0 and runs["free"]["tree_floor"] == 0.02
    assert runs["free"]["tree_side_chain_depth"] == 1 and runs["free"]["tree_continued_sides"] > 0
    assert runs["priced"]["tree_row_price"] > CHAIN_PRICE and runs["priced"]["tree_floor"] == 0.1
    for label in ("priced", "fixed"):
        assert runs[label]["tree_side_accepts"] > 0, label  # still a tree: its side children win
        assert "tree_side_chain_depth" not in runs[label] and "tree_continued_sides" not in runs[label], label


def test_a_decoder_refuses_a_side_chain_depth_below_one():
    from dsi.engine.dsi import DSIDecoder

    for bad in (0, -1, 2.0, True):
        with pytest.raises(ConfigError, match=f"side_depth={bad!r} must be an int >= 1"):
            DSIDecoder(None, "auto", None, side_depth=bad)


def second_choice_drafter(target):
    """A drafter whose likeliest token is always the target's second and whose second is the target's first."""
    def logits(tokens):
        row = np.asarray(target.next_logits(tuple(tokens)), dtype=np.float64).copy()
        first, second = np.argsort(-row, kind="stable")[:2]
        row[first], row[second] = row[second], row[first]
        return row

    return CallableLM(logits, VOCAB, name="second-choice drafter")


@pytest.mark.parametrize("lookahead, servers", [(1, 1), (3, 1), (3, 2), ("auto", 1), ("auto", 3), (2, 4)])
def test_every_correction_that_is_a_side_child_is_rescued_even_at_an_epochs_first_position(lookahead, servers,
                                                                                          no_thread_leak):
    """Every draft is wrong and its side child right: a chain commits one token an epoch, a tree two (the side
    child and the target's token after it) and never rejects, also at each epoch's first position, decided by
    the zero-draft task, whose side children travel with the next window (kept as the next epoch's window 0
    when it has not answered yet); the event simulator takes the same decisions."""
    from dsi.sim.events import simulate

    target = random_lm(VOCAB, 7, sharpness=2.0)
    drafter = second_choice_drafter(target)
    expected = reference(target, 40).tokens
    jt, jd = Jitter(target, 0.001, 1), Jitter(drafter, 0.0003, 2)
    kwargs = dict(prompt=PROMPT, method="dsi", max_new_tokens=40, lookahead=lookahead, num_target_servers=servers)
    chain = dsi.generate(target=jt, drafter=jd, **kwargs).stats
    out = dsi.generate(target=jt, drafter=jd, draft_tree="2", **kwargs)
    assert out.tokens == expected
    assert (chain.rejections, chain.accepted_tokens) == (40, 0)
    stats = out.stats
    assert (stats.rejections, stats.extra["tree_side_accepts"], stats.bonus_tokens) == (0, 20, 20)
    if lookahead in (1, 2):  # window 1 goes out after one or two drafts, long before the zero-draft task
        # answers: the rows after position 0's side children come with it, kept, not computed again
        assert stats.extra["tree_adopted_windows"] > 0
    sim = simulate("dsi", target_tpot=1.0, drafter_tpot=0.1, lookahead=lookahead, num_servers=servers,
                   matches=[False] * 40, rescues=[True] * 40).runs[0]
    assert (sim.rejections, sim.side_wins) == (0, 20)


@pytest.mark.parametrize("method, tree", [("si", "2,2"), ("dsi", "auto")])
def test_logprobs_with_trees_equal_non_si(method, tree, no_thread_leak):
    target, drafter = noisy_pair(seed=5)
    params = dsi.SamplingParams(presence_penalty=0.6, repetition_penalty=1.2)
    expected = reference(target, 40, params, logprobs=3)
    for mode in ("raw", "processed"):
        ar = dsi.generate(target=target, prompt=PROMPT, method="ar", max_new_tokens=40, sampling=params, logprobs=3,
                          logprobs_mode=mode)
        out = dsi.generate(target=target, drafter=drafter, prompt=PROMPT, method=method, max_new_tokens=40,
                           lookahead=3, draft_tree=tree, sampling=params, logprobs=3, logprobs_mode=mode)
        assert out.tokens == expected.tokens
        assert out.stats.extra.get("tree_side_accepts", 0) > 0
        for got, want in zip(out.logprobs, ar.logprobs, strict=True):
            assert got.token == want.token and [t for t, _ in got.top] == [t for t, _ in want.top]
            assert got.logprob == pytest.approx(want.logprob, abs=1e-9)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(method="dsi", draft_tree="3,2"), "DSI branches position by position"),
    (dict(method="ar", draft_tree="2"), "applies to method 'si' or 'dsi'"),
    (dict(method="auto", draft_tree="auto"), "weighs draft trees itself"),
    (dict(method="si", draft_tree=3), "must be None, 'off', 'auto', 'branches', 'best-first', widths"),
    (dict(method="si", draft_tree="wide"), "must be off, auto, branches, best-first, or widths"),
    (dict(method="dsi", draft_tree="best-first"), "'best-first' is for SI"),
    (dict(method="si", draft_tree="branches:1.5"), "'branches:F' takes the least drafter probability"),
])
def test_bad_draft_trees_are_refused_naming_the_value(kwargs, fragment):
    target, drafter = noisy_pair()
    with pytest.raises(ConfigError, match=fragment):
        dsi.build_decoder(target=target, drafter=drafter, **kwargs).close()


@pytest.mark.parametrize("method, tree, lookahead", [("dsi", "2", 3), ("dsi", "3", "auto"), ("dsi", "auto", 1),
                                                    ("dsi", "branches:0.05", 3), ("dsi", "branches:0.05", "auto"),
                                                    ("si", "2", 5), ("si", "2", 4), ("si", "auto", 4),
                                                    ("si", "auto", 1)])
def test_the_event_simulator_takes_the_engines_tree_decisions(method, tree, lookahead, no_thread_leak):
    """The event simulator with rescues (a rejection whose correction is one of its position's side
    children, read off the models) makes the engine's decisions: the same accepted drafts, rejections and
    side wins, which depend on the tokens only (SI: the trees "2" and "auto", and the same number of
    verifications)."""
    from dsi.engine.trees import draft_with_alternatives, priced_shape, tree_patterns
    from dsi.sim.events import simulate
    from dsi.trees import DEFAULT_FLOOR, DSI_FLOOR, parse_shape

    target, drafter = noisy_pair(seed=6)
    out = reference(target, 60).tokens
    # the floor the engine's decoder prices (a CallableLM target's rows are free: DSI's least floor is lower)
    shape = priced_shape(parse_shape(tree), target, drafter, "threads", {},
                         DSI_FLOOR if method == "dsi" else DEFAULT_FLOOR)
    greedy = dsi.SamplingParams()
    matches, rescues, sides = [], [], []
    for p, token in enumerate(out):
        context = PROMPT + out[:p]
        main, _, ranked = draft_with_alternatives(np.asarray(drafter.next_logits(tuple(context))), greedy,
                                                  len(context), None, 3)
        matches.append(main == token)
        rescues.append(main != token and token in shape.sides(main, ranked))
        sides.append(len(shape.sides(main, ranked)))
    pattern = tree_patterns(drafter, PROMPT, out, [shape])[0]  # what method="auto" reads, from one forward
    assert (list(pattern.matches), list(pattern.rescues), list(pattern.sides)) == (matches, rescues, sides)
    engine = dsi.generate(target=target, drafter=drafter, prompt=PROMPT, method=method, max_new_tokens=60,
                          lookahead=lookahead, num_target_servers=2 if method == "dsi" else None,
                          draft_tree=tree).stats
    sim = simulate(method, target_tpot=1.0, drafter_tpot=0.1, lookahead=lookahead, num_servers=2,
                   matches=matches, rescues=rescues, si_tree=tree if method == "si" else "2",
                   dsi_branches=tree.startswith("branches")).runs[0]
    assert sim.side_wins == engine.extra.get("tree_side_accepts", 0) > 0
    assert (sim.accepted, sim.rejections) == (engine.accepted_tokens, engine.rejections)
    if method == "si":
        assert sim.tasks == engine.verify_tasks
    chain = simulate(method, target_tpot=1.0, drafter_tpot=0.1, lookahead=lookahead, num_servers=2,
                     matches=matches).runs[0]
    assert chain.rejections > sim.rejections and chain.side_wins == 0


def test_a_tree_pattern_has_no_draft_past_the_drafters_context_and_none_through_text():
    from dsi.engine.trees import tree_patterns
    from dsi.models import CallableLM
    from dsi.trees import parse_shape

    target, drafter = noisy_pair(seed=6)
    out = reference(target, 12).tokens
    full, chain = tree_patterns(drafter, PROMPT, out, [parse_shape("2"), None])
    short_drafter = CallableLM(drafter.next_logits, VOCAB, max_context=len(PROMPT) + 5)
    (short,) = tree_patterns(short_drafter, PROMPT, out, [parse_shape("2")])
    assert short.matches[:6] == full.matches[:6] and short.rescues[:6] == full.rescues[:6]
    assert not any(short.matches[6:]) and not any(short.rescues[6:]) and short.sides[6:] == (0,) * 6
    assert full.sides == (1,) * 12  # the tree "2": one side child at every position
    assert chain.matches == full.matches and chain.sides == (0,) * 12 and not any(chain.rescues)

    class ThroughText(CallableLM):
        def mode_for(self, greedy):
            return "string"

    with pytest.raises(ConfigError, match="cannot branch"):
        tree_patterns(ThroughText(drafter.next_logits, VOCAB), PROMPT, out, [parse_shape("2")])


class _NoTreeForward:
    """The drafter ``model`` without its sessions' one-forward trees (``tree_rows``): drafted path by path."""

    def __init__(self, model):
        self.model = model

    @property
    def vocab_size(self):
        return self.model.vocab_size

    def new_session(self):
        inner = self.model.new_session()

        class Session:
            tokens = property(lambda self: inner.tokens)
            extend = staticmethod(inner.extend)
            truncate = staticmethod(inner.truncate)
            close = staticmethod(inner.close)

        return Session()


def test_a_best_first_tree_drafts_each_round_in_one_drafter_forward_and_the_same_tree():
    """SI with ``best-first`` trees on a drafter whose sessions compute a tree in one forward (the latency model):
    a round of the tree's growth is one drafter forward, so fewer forwards than on one without the kernel
    (path by path), for the same trees (the same verifications, side wins and tokens: non-SI's)."""
    from dsi.models import WithLatency

    target, drafter = noisy_pair(seed=3, noise=2.5)
    expected = reference(target, 60).tokens
    runs = {}
    for name, model in (("batched", WithLatency(drafter, 0.0, 0.0)),
                        ("path by path", WithLatency(drafter, 0.0, 0.0, one_forward_trees=False))):
        out = dsi.generate(target=target, drafter=model, prompt=PROMPT, method="si", max_new_tokens=60, lookahead=8,
                           draft_tree="best-first")
        assert out.tokens == expected, name
        s = out.stats
        runs[name] = (s.drafter_forwards, (s.verify_tasks, s.accepted_tokens, s.rejections, s.drafted_tokens,
                                           s.extra["tree_side_accepts"]))
    assert runs["batched"][1] == runs["path by path"][1]
    assert runs["batched"][0] < 0.8 * runs["path by path"][0], runs


def test_a_branches_tree_drafts_with_the_chains_drafter_forwards_and_commits_more_per_verification():
    """SI with ``branches`` on a drafter whose sessions compute a tree in one forward: every round (the main
    path's next draft and every branch's) is one drafter forward, so it drafts with exactly the chain's
    forwards per verification (k), verifies more nodes than ``auto``, commits at least as much per
    verification, and stays non-SI's tokens."""
    from dsi.models import WithLatency

    target, drafter = noisy_pair(seed=3, noise=2.5)
    expected = reference(target, 60).tokens
    model = WithLatency(drafter, 0.0, 0.0)
    runs = {}
    for tree in ("auto", "branches"):
        out = dsi.generate(target=target, drafter=model, prompt=PROMPT, method="si", max_new_tokens=60, lookahead=4,
                           draft_tree=tree)
        assert out.tokens == expected, tree
        runs[tree] = out.stats
    auto, branches = runs["auto"], runs["branches"]
    assert branches.drafter_forwards <= 4 * branches.verify_tasks  # at most k rounds, one forward each
    assert branches.drafted_tokens > auto.drafted_tokens  # the side children went on
    assert branches.verify_tasks <= auto.verify_tasks and branches.extra["tree_side_accepts"] > 0


def test_hf_drafts_a_best_first_tree_round_in_one_model_forward(no_thread_leak):
    """The hf backend: a round of several paths is one model forward of the drafter (a 4D tree mask), greedy
    SI with ``best-first`` trees stays non-SI's tokens, and drafts the same trees as path by path (fp32)."""
    pytest.importorskip("transformers")
    from dsi.models.hf.model import HFModel
    from tests.unit.models.test_hf import tiny_llama

    target = HFModel(tiny_llama(seed=0))
    raw = tiny_llama(seed=1)
    drafter = HFModel(raw)
    prompt = [3, 17, 42, 5]
    expected = dsi.generate(target=target, prompt=prompt, method="ar", max_new_tokens=24).tokens
    calls = []
    hook = raw.register_forward_pre_hook(lambda module, args: calls.append(1))
    runs = {}
    try:
        for name, model in (("batched", drafter), ("path by path", _NoTreeForward(drafter))):
            calls.clear()
            out = dsi.generate(target=target, drafter=model, prompt=prompt, method="si", max_new_tokens=24,
                               lookahead=6, draft_tree="best-first")
            assert out.tokens == expected, name
            s = out.stats
            runs[name] = (len(calls), (s.verify_tasks, s.accepted_tokens, s.rejections, s.drafted_tokens))
    finally:
        hook.remove()
    assert runs["batched"][1] == runs["path by path"][1]
    assert runs["batched"][0] < runs["path by path"][0], runs
