"""Draft trees (dsi.trees): structure, shapes, and why verification stays exact.

- Exact enumeration in float64: decoding window by window with a tree (fixed widths and dynamic,
  depth <= 3, width <= 3, vocabularies of 3-4 tokens, greedy and sampling, plain and processed
  rows) gives exactly the target's law of the first tokens, and more tokens per window than a chain.
- With the real counter-based uniforms, a tree commits exactly the chain's tokens for every seed
  (the chain-coupled rule), so seed determinism holds for any shape.
"""

from __future__ import annotations

import functools
import hashlib
import itertools

import numpy as np
import pytest

from dsi.constraints import BoundConstraint, Constraint, TokenTable
from dsi.errors import ConfigError
from dsi.sampling import Prefix, SamplingParams, decide, draft_token, process_logits, residual, shape_logits
from dsi.trees import ROOT, BestFirst, DraftTree, Dynamic, Widths, check_windowed, grow, parse_shape, walk


# ---- structure ---------------------------------------------------------------------------------
def test_a_tree_knows_its_paths_depths_positions_and_mask():
    #        root
    #      0(5)   1(6)
    #    2(7) 3(8)
    #    4(9)
    tree = DraftTree((5, 6, 7, 8, 9), (ROOT, ROOT, 0, 0, 2))
    assert tree.children(ROOT) == (0, 1) and tree.children(0) == (2, 3) and tree.children(1) == ()
    assert tree.main_path() == [0, 2, 4] and tree.path_tokens(4) == [5, 7, 9]
    assert tree.paths() == [[1], [0, 3], [0, 2, 4]]
    assert tree.positions(10).tolist() == [10, 10, 11, 11, 12]
    mask = tree.attention_mask()
    assert mask[4].tolist() == [True, False, True, False, True]
    assert mask[1].tolist() == [False, True, False, False, False]
    assert not tree.is_chain() and DraftTree.chain([1, 2, 3]).is_chain()
    assert DraftTree.chain([1, 2, 3]).attention_mask().tolist() == np.tril(np.ones((3, 3), bool)).tolist()


@pytest.mark.parametrize("tokens, parents, fragment", [
    ((1, 2), (ROOT,), "needs as many parents"),
    ((1, 2), (ROOT, 1), "must be an earlier node"),
    ((1, 1), (ROOT, ROOT), "repeats token 1 among its siblings"),
    ((1, -2), (ROOT, 0), "token -2 must be a token id"),
])
def test_malformed_trees_are_refused_naming_the_node(tokens, parents, fragment):
    with pytest.raises(ConfigError, match=fragment):
        DraftTree(tokens, parents)


def test_shapes_parse_from_their_names():
    assert parse_shape("off") is None and parse_shape("chain") is None and parse_shape(None) is None
    assert parse_shape("auto") == Dynamic() and parse_shape("3,2,1") == Widths((3, 2, 1))
    assert parse_shape("best-first") == BestFirst() and parse_shape(" Best_First ") == BestFirst()
    assert parse_shape("branches") == Dynamic(branches=True) and parse_shape("branches").name == "branches"
    assert parse_shape("branches:0.05") == Dynamic(floor=0.05, branches=True)
    assert parse_shape("branches:0.05").name == "branches:0.05" and parse_shape("auto:0.05").name == "auto:0.05"
    assert Dynamic(branches=True).priced(0.27) == Dynamic(floor=0.45, price=0.27, branches=True)  # pricing keeps it
    for bad, fragment in (("3,x", "must be off, auto, branches, best-first, or widths"), ("3,0", "integers >= 1"),
                          ("branches:0", "'branches:F' takes"), ("branches:x", "such as branches:0.3")):
        with pytest.raises(ConfigError, match=fragment):
            parse_shape(bad)


def test_one_width_is_that_width_at_every_depth_and_a_proposal_of_none_ends_the_path():
    def propose(path):  # main token 10 + depth, side tokens 20.., nothing after depth 3
        return None if len(path) >= 3 else (10 + len(path), [(20 + t, 0.1) for t in range(4)])

    tree = grow(Widths((2,)), 7, propose)
    assert [tree.depth(i) for i in range(len(tree))] == [1, 1, 2, 2, 3, 3]  # 2 children per depth, depth 3 the last
    assert tree.path_tokens(tree.main_path()[-1]) == [10, 11, 12]
    assert len(grow(Widths((2,)), 3, propose)) == 3 and len(grow(Widths((3, 1)), 9, propose)) == 4
    assert len(grow(Dynamic(), 9, lambda path: None)) == 0 and len(grow(BestFirst(), 9, lambda path: None)) == 0
    with pytest.raises(ConfigError, match="top=0 must be an integer >= 1"):
        BestFirst(top=0)
    with pytest.raises(ConfigError, match="best-first.*DSI"):
        BestFirst().sides(0, ())  # DSI's per-position branching refuses a node budget


def _ranked(q: np.ndarray) -> list[tuple[int, float]]:
    order = sorted(range(q.size), key=lambda t: (-q[t], t))
    return [(t, float(q[t])) for t in order]


def test_fixed_widths_branch_along_the_main_path_within_the_budget():
    q = np.array([0.5, 0.3, 0.15, 0.05])
    calls = []

    def propose(path):
        calls.append(list(path))
        return 1, _ranked(q)  # the main child need not be the most likely (a sampled draft)

    tree = grow(Widths((3, 2, 1)), 6, propose)
    assert tree.children(ROOT) == (0, 1, 2) and [tree.tokens[c] for c in tree.children(ROOT)] == [1, 0, 2]
    assert tree.main_path() == [0, 3, 5] and len(tree) == 6 and calls == [[], [1], [1, 1]]
    assert len(grow(Widths((3, 2, 1)), 4, propose)) == 4  # the budget cuts the shape
    assert grow(None, 3, propose).is_chain()


def test_auto_trees_are_the_chain_with_side_leaves_where_the_drafter_is_unsure():
    """``auto`` drafts the chain's ``budget`` drafts (the main path, one proposal a level) and gives each
    position the next likeliest tokens of drafter probability >= 0.1 (at most two) as leaves."""
    laws = {0: np.array([0.97, 0.01, 0.01, 0.01]), 1: np.array([0.4, 0.35, 0.2, 0.05]),
            2: np.array([0.6, 0.3, 0.05, 0.05]), 3: np.array([0.05, 0.9, 0.03, 0.02])}
    calls = []

    def propose(path):
        calls.append(list(path))
        q = laws[len(path)]
        return int(np.argmax(q)), _ranked(q)

    tree = grow(Dynamic(), 4, propose)
    chain = grow(None, 4, propose)
    assert tuple(tree.path_tokens(tree.main_path()[-1])) == chain.tokens == (0, 0, 0, 1)
    assert calls == [[], [0], [0, 0], [0, 0, 0]] * 2  # one proposal a level, as the chain's drafts
    sides = {tree.depth(tree.main_path()[d]): [tree.tokens[c] for c in tree.children(tree.parents[tree.main_path()[d]])][1:]
             for d in range(4)}
    assert sides == {1: [], 2: [1, 2], 3: [1], 4: []}  # 0.35 and 0.2 pass the floor, 0.05 does not
    assert all(not tree.children(n) for n in range(len(tree)) if n not in tree.main_path())  # side children are leaves
    assert grow(Dynamic(), 4, lambda path: (0, _ranked(laws[0]))).is_chain()  # a confident drafter: the chain
    assert len(grow(Dynamic(floor=0.31), 4, propose)) == 5 and len(grow(Dynamic(top=2), 4, propose)) == 6


def test_branches_continue_side_children_as_the_drafters_chains_while_their_mass_stays_at_the_floor():
    """``branches``: the main path is the chain's (and its side children ``auto``'s); each side child goes on
    with the drafter's own draft, one round a level (one ``propose_many`` call per round, ``budget`` of them),
    a node getting its draft as a child while its mass (side probability times its drafts') is >= the floor,
    and side children of its own where their mass (its mass times their probability) is >= the floor;
    nothing is deeper than the budget."""
    laws = {(): np.array([0.4, 0.35, 0.2, 0.05]), (1,): np.array([0.1, 0.5, 0.4, 0.0]),
            (2,): np.array([0.1, 0.3, 0.6, 0.0])}
    rounds = []

    def law(path):
        return laws.get(tuple(path), np.array([0.9, 0.05, 0.03, 0.02]))

    def propose(path):
        q = law(path)
        return int(np.argmax(q)), _ranked(q)

    def many(paths):
        rounds.append([list(p) for p in paths])
        return [propose(p) for p in paths]

    tree = grow(Dynamic(branches=True), 3, propose, many)
    auto = grow(Dynamic(), 3, propose)
    assert len(rounds) == 3 and rounds[0] == [[]] and rounds[1] == [[0], [1], [2]]
    assert tree.path_tokens(tree.main_path()[-1]) == auto.path_tokens(auto.main_path()[-1]) == [0, 0, 0]
    paths = {tuple(tree.path_tokens(leaf)) for leaf in tree.leaves()}
    # side 1 (0.35) -> 1 (x0.5 = 0.175) -> 0, and its own side child 2 (x0.4 = 0.14) -> 0; side 2 (0.2) -> 2
    # (x0.6 = 0.12) -> 0, its 1 (x0.3 = 0.06) below the floor; every mass kept >= 0.1
    assert paths == {(0, 0, 0), (1, 1, 0), (1, 2, 0), (2, 2, 0)}
    assert rounds[2] == [[0, 0], [1, 1], [1, 2], [2, 2]]
    assert max(tree.depth(n) for n in range(len(tree))) == 3
    below_side_one = [n for n in range(len(tree)) if tree.path_tokens(n) == [1]][0]
    assert [tree.tokens[c] for c in tree.children(below_side_one)] == [1, 2]  # its draft first, then its side
    # a higher floor: the side children (0.35, 0.2 >= 0.2) get their draft, whose mass (0.175, 0.12) gets none,
    # and no side child of their own (0.14, 0.06)
    cut = grow(Dynamic(floor=0.2, branches=True), 3, propose)
    assert {tuple(cut.path_tokens(leaf)) for leaf in cut.leaves()} == {(0, 0, 0), (1, 1), (2, 2)}
    assert grow(Dynamic(floor=0.36, branches=True), 3, propose).is_chain()
    # the probability oracle, where given, is what a draft's mass is made of (side children: their ranking)
    rare = grow(Dynamic(branches=True), 3, propose, many, lambda path, token: 0.01)
    assert {tuple(rare.path_tokens(leaf)) for leaf in rare.leaves()} == {(0, 0, 0), (1, 1), (1, 2, 0), (2, 2)}
    assert len(grow(Dynamic(branches=True), 9, lambda path: None)) == 0


def test_dsi_windows_refuse_the_shapes_they_cannot_take_naming_them():
    check_windowed(None)
    check_windowed(Dynamic())
    check_windowed(Widths((2,)))
    check_windowed(Dynamic(branches=True))  # DSI continues each side child by one draft
    check_windowed(Dynamic(floor=0.2, branches=True))
    for shape, fragment in ((BestFirst(), "'best-first' is for SI"), (Widths((2, 1)), "one width for every position")):
        with pytest.raises(ConfigError, match=fragment):
            check_windowed(shape)


def test_best_first_trees_spend_the_budget_where_the_drafter_is_unsure():
    confident = np.array([0.97, 0.01, 0.01, 0.01])
    unsure = np.array([0.4, 0.35, 0.2, 0.05])

    def propose_for(table):
        return lambda path: (int(np.argmax(table)), _ranked(table))

    sure_tree = grow(BestFirst(top=3), 4, propose_for(confident))
    assert sure_tree.is_chain()  # 0.97^4 beats every side child
    wide = grow(BestFirst(top=3), 4, propose_for(unsure))
    assert len(wide.children(ROOT)) == 3 and len(wide) == 4
    for node in range(len(wide)):  # main child first everywhere
        kids = wide.children(node)
        assert not kids or wide.tokens[kids[0]] == 0


def _best_first_one_node_at_a_time(shape, budget, propose):
    """The reference growth: pop the best candidate, expand it with one drafter call, repeat."""
    import heapq

    from dsi.trees import _canonical, _path, _sides

    tokens, parents, heap, order = [], [], [], 0

    def expand(node, mass):
        nonlocal order
        proposal = propose([tokens[i] for i in _path(parents, node)])
        if proposal is None:
            return
        main, ranked = proposal
        prob = dict(ranked)
        kids = [main] + _sides(main, ranked, shape.top - 1)
        best = max(prob.get(t, 0.0) for t in kids)
        for rank, token in enumerate(kids):
            heapq.heappush(heap, (-(mass * prob.get(token, 0.0) if rank else mass * best), order, node, token,
                                  mass * prob.get(token, 0.0)))
            order += 1

    expand(ROOT, 1.0)
    while heap and len(tokens) < budget:
        _, _, parent, token, mass = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        if len(tokens) < budget:
            expand(len(tokens) - 1, mass)
    return _canonical(tokens, parents)


def _random_oracle(seed, vocab, sampled, stop_after=None):
    def propose(path):
        if stop_after is not None and len(path) >= stop_after:
            return None  # the end of the drafter's context
        rng = np.random.default_rng([seed, len(path), *path])
        law = rng.dirichlet(np.full(vocab, 0.3))
        main = int(rng.choice(vocab, p=law)) if sampled else int(np.argmax(law))
        return main, _ranked(law)

    return propose


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_best_first_trees_grown_in_rounds_are_the_one_at_a_time_trees_with_fewer_drafter_calls(sampled):
    """The rounds (every expansion a round needs in one drafter call) give the tree that growing one node
    at a time gives, on random drafters (greedy: the main child is the argmax; sampled: any token), for
    every budget and width; and they ask the drafter in fewer calls where it is unsure."""
    fewer = 0
    for seed in range(40):
        for budget in (1, 2, 4, 7, 12):
            for top in (2, 3, 4):
                shape = BestFirst(top=top)
                oracle = _random_oracle(seed, 6, sampled, stop_after=None if seed % 5 else 3)
                calls = []

                def many(paths, oracle=oracle, calls=calls):
                    calls.append(len(paths))
                    return [oracle(p) for p in paths]

                single = []
                want = _best_first_one_node_at_a_time(shape, budget, lambda p, o=oracle: single.append(1) or o(p))
                got = grow(shape, budget, oracle, propose_many=many)
                assert got == want, (seed, budget, top)
                assert len(calls) <= len(single)
                fewer += len(calls) < len(single)
    assert fewer > 100  # most unsure trees take fewer rounds than nodes


# ---- exact enumeration -------------------------------------------------------------------------
VOCAB = 3
PROMPT = (0, 1)


def _logits(prefix: tuple[int, ...], salt: bytes, vocab: int) -> np.ndarray:
    digest = hashlib.blake2b(bytes(prefix) + salt, digest_size=16).digest()
    return (np.frombuffer(digest, dtype=np.uint8)[:vocab].astype(np.float64) - 128.0) / 40.0


def _law(prefix, salt, vocab, params):
    return _cached_law(tuple(prefix), salt, vocab, params)


@functools.lru_cache(maxsize=None)
def _cached_law(prefix: tuple[int, ...], salt: bytes, vocab: int, params: SamplingParams) -> np.ndarray:
    """A law is a function of its arguments, and the enumerations below ask for the same ones millions of
    times: each computed once, read-only (a caller that wrote into one would fail). Widened to float64 and
    normalised there: the enumerations check that the decisions compose laws exactly, to float64 rounding (the
    engine's float32 laws sum to 1 within their own rounding: dsi.sampling.LAW_DTYPE)."""
    law = process_logits(_logits(prefix, salt, vocab), params, Prefix(list(prefix), len(PROMPT)))
    law = law / law.sum(dtype=np.float64)
    law.flags.writeable = False
    return law


def _explore(run):
    """Every outcome of ``run(choose)`` with its exact probability (``choose`` branches on each option)."""
    outcomes: dict = {}
    pending = [[]]
    while pending:
        script = pending.pop()
        steps, mass = [], 1.0

        def choose(options, script=script, steps=steps):
            nonlocal mass
            options = [(value, p) for value, p in options if p > 0.0]
            index = script[len(steps)] if len(steps) < len(script) else 0
            steps.append(len(options))
            mass *= options[index][1]
            return options[index][0]

        result = run(choose)
        outcomes[result] = outcomes.get(result, 0.0) + mass
        for step in range(len(script), len(steps)):
            taken = script + [0] * (step - len(script))
            pending += [taken + [j] for j in range(1, steps[step])]
    return outcomes


def _window(choose, tokens, shape, budget, target, drafter, greedy, vocab, ranks=None):
    """One window after ``tokens``: grow the tree (main child drawn from the drafter), verify it
    chain-coupled. Returns the committed tokens and how many drafts were accepted. ``ranks``: the
    drafter law whose order names the side children when greedy (its one-hot law has no order)."""
    def propose(path):
        q = drafter(tokens + path)
        main = int(np.argmax(q)) if greedy else choose([(t, q[t]) for t in range(vocab)])
        return main, _ranked(ranks(tokens + path) if greedy else q)

    tree = grow(shape, budget, propose)

    def decided(node):
        path = [] if node == ROOT else tree.path_tokens(node)
        p = target(tokens + path)
        if greedy:
            return int(np.argmax(p))
        return _coupled(choose, p, tree.tokens[tree.children(node)[0]], drafter(tokens + path), vocab)

    outcome = walk(tree, decided)
    return outcome.tokens(tree), len(outcome.accepted)


def _coupled(choose, p, x, q, vocab):
    """The chain-coupled decision below a node (what :func:`dsi.sampling.decide` draws) as a ``choose``: the main
    child ``x`` kept with ``min(1, p(x) / q(x))``, else the residual's token."""
    keep = min(1.0, p[x] / q[x])
    r = residual(p, q) if keep < 1.0 else np.zeros_like(p)
    return choose([(t, keep * (t == x) + (1.0 - keep) * r[t]) for t in range(vocab)])


def _first_tokens(choose, shape, budget, length, target, drafter, greedy, vocab):
    """One tree window, then the target's own law up to ``length`` tokens: if this is the target's
    law, so is decoding window after window (each window starts from a committed prefix)."""
    ranks = None if not greedy else (lambda prefix: _law(prefix, b"d", vocab, SamplingParams(temperature=1.0)))
    tokens = list(PROMPT) + _window(choose, list(PROMPT), shape, budget, target, drafter, greedy, vocab, ranks)[0]
    while len(tokens) - len(PROMPT) < length:
        p = target(tokens)
        tokens.append(int(np.argmax(p)) if greedy else choose([(t, p[t]) for t in range(vocab)]))
    return tuple(tokens[len(PROMPT):][:length])


TREES = [(None, 3), (Widths((3,)), 3), (Widths((2, 2)), 4), (Widths((3, 2, 1)), 5), (Dynamic(top=3), 3),
         (BestFirst(top=3), 4), (Dynamic(top=3, floor=0.05, branches=True), 3)]
# structured output: ids 0 and 1 spell "a" and "b", 2 is EOS; the output is one or two letters, then EOS
GRAMMAR = BoundConstraint(Constraint.regex("[ab]{1,2}"), TokenTable((b"a", b"b", b""), (2,)))
PARAMS = {
    "greedy": SamplingParams(),
    "T=1": SamplingParams(temperature=1.0),
    "processed": SamplingParams(temperature=0.8, presence_penalty=0.7, logit_bias={2: 0.6}, top_k=3),
    # the target's law masked to the grammar; the drafter's is not (its drafts the grammar refuses are rejected)
    "constrained": SamplingParams(temperature=0.9, constraint=GRAMMAR),
    "constrained-greedy": SamplingParams(constraint=GRAMMAR),
}


def _law_cases() -> list:
    """Every tree with every sampling. The branching tree's sampled laws take 80-95 s each to enumerate here (a
    side child below a side child multiplies the walks): they run in the slow suite, its greedy ones by default."""
    cases = []
    for shape, budget in TREES:
        for name in PARAMS:
            slow = isinstance(shape, Dynamic) and shape.branches and not PARAMS[name].greedy
            cases.append(pytest.param(name, shape, budget, id=f"{getattr(shape, 'name', shape)}-{budget}-{name}",
                                      marks=[pytest.mark.slow] if slow else []))
    return cases


@pytest.mark.parametrize("name, shape, budget", _law_cases())
def test_tree_decoding_has_exactly_the_target_law(name, shape, budget):
    params, length = PARAMS[name], 3
    drafter_params = SamplingParams(temperature=1.3) if not params.greedy else (
        params if name == "greedy" else SamplingParams())  # processed differently

    def target(prefix):
        return _law(prefix, b"t", VOCAB, params)

    def drafter(prefix):
        return _law(prefix, b"d", VOCAB, drafter_params)

    law = _explore(lambda choose: _first_tokens(choose, shape, budget, length, target, drafter, params.greedy, VOCAB))
    for seq in itertools.product(range(VOCAB), repeat=length):
        want = np.prod([target(list(PROMPT) + list(seq[:i]))[seq[i]] for i in range(length)])
        assert law.get(seq, 0.0) == pytest.approx(want, abs=1e-12), (seq, law.get(seq), want)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)


def test_the_exact_law_covers_side_children_below_side_children():
    """The ``branches`` row of :data:`TREES` does grow a side child below a side child from the sampled cases'
    drafter (T = 1.3), so their enumeration covers such nodes."""
    shape, budget = TREES[-1]
    assert isinstance(shape, Dynamic) and shape.branches

    def propose(path):
        q = _law(list(PROMPT) + path, b"d", VOCAB, SamplingParams(temperature=1.3))
        return int(np.argmax(q)), _ranked(q)

    tree = grow(shape, budget, propose)
    main = set(tree.main_path())
    assert any(len(tree.children(n)) >= 2 for n in range(len(tree)) if n not in main), tree


@pytest.mark.parametrize("name", list(PARAMS))
def test_the_expected_tokens_of_a_tree_are_the_exact_mean_of_its_walk(name):
    """:func:`dsi.engine.trees.expected_tree_tokens` (what benchmarks/tree_sampled_acceptance.py compares
    shapes with) against the exact enumeration of the walk SI takes (a token after a leaf included), on a tree
    with a side child on the main path, a side child below a side child's draft and a branch."""
    from dsi.engine.trees import expected_tree_tokens, row_of

    params = PARAMS[name]
    tree = DraftTree((0, 1, 2, 1, 0, 2, 0), (ROOT, ROOT, 0, 0, 2, 1, 1))

    def target(path):
        return _law(list(PROMPT) + path, b"t", VOCAB, params)

    def drafter(path):
        return _law(list(PROMPT) + path, b"d", VOCAB, SamplingParams(temperature=1.3))

    def path_of(node):
        return [] if node == ROOT else tree.path_tokens(node)

    def run(choose):
        def decided(node):
            p = target(path_of(node))
            children = tree.children(node)
            if params.greedy:
                return int(np.argmax(p))
            if not children:
                return choose([(t, p[t]) for t in range(VOCAB)])
            return _coupled(choose, p, tree.tokens[children[0]], drafter(path_of(node)), VOCAB)

        return len(walk(tree, decided, leaf_token=True).tokens(tree))

    exact = sum(count * mass for count, mass in _explore(run).items())
    laws = [None] * (1 + len(tree))
    for node in (ROOT, *range(len(tree))):
        laws[row_of(node)] = target(path_of(node))
    main_laws = {node: None if params.greedy else drafter(path_of(node))
                 for node in (ROOT, *range(len(tree))) if tree.children(node)}
    assert expected_tree_tokens(tree, laws, main_laws) == pytest.approx(exact, abs=1e-12)
    assert 1.0 < exact < 1 + 4  # at least the correction, at most the deepest path and a token after it


def _accepted_per_window(shape, budget, params, vocab=3):
    """The exact expected number of drafts one window accepts, averaged over a few prompts, with a
    drafter that is often wrong."""
    drafter_params = SamplingParams(temperature=params.temperature * 1.5 if not params.greedy else 0.0)

    def target(prefix):
        return _law(prefix, b"T", vocab, params)

    def drafter(prefix):
        return _law(prefix, b"D", vocab, drafter_params)

    def ranks(prefix):
        return _law(prefix, b"D", vocab, SamplingParams(temperature=1.0))

    total = 0.0
    prompts = [(0, 1), (1, 0), (2, 2), (1, 2), (0, 0), (2, 1)]
    for prompt in prompts:
        outcomes = _explore(lambda choose, prompt=prompt: _window(choose, list(prompt), shape, budget, target, drafter,
                                                                  params.greedy, vocab, ranks)[1])
        total += sum(accepted * mass for accepted, mass in outcomes.items())
    return total / len(prompts)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0)], ids=["greedy", "T=1"])
def test_a_tree_accepts_more_per_window_than_the_chain_of_its_budget(params):
    chain = _accepted_per_window(None, 4, params)
    tree = _accepted_per_window(Widths((2, 2)), 4, params)  # 2 of the 3 tokens at each branching
    best_first = _accepted_per_window(BestFirst(top=3), 4, params)
    auto = _accepted_per_window(Dynamic(top=3), 4, params)  # the chain's 4 drafts and side leaves: never fewer
    assert tree > chain * 1.05 and best_first > chain * 1.05 and auto > chain * 1.05, (chain, tree, best_first, auto)


def test_branches_accept_past_a_rescue_where_the_drafter_goes_on_right():
    """A drafter whose first choice is wrong at the first position, whose second is the target's token there,
    and which drafts the target's tokens after it: ``auto`` rescues the first position and stops at its
    leaf; ``branches`` goes on down the branch to the budget's depth (greedy, exact counts)."""
    target = [7, 3, 4, 5, 6]  # the target's greedy tokens, position by position

    def propose(path):
        depth = len(path)
        if depth == 0:
            return 1, [(1, 0.5), (7, 0.4), (2, 0.1)]
        on_target = list(path) == target[:depth]
        main = target[depth] if on_target else 0
        return main, [(main, 0.9), (9, 0.1)]

    def walked(shape):
        tree = grow(shape, 4, propose)
        outcome = walk(tree, lambda node: target[0 if node == ROOT else tree.depth(node)], leaf_token=True)
        return outcome.tokens(tree)

    assert walked(None) == [7]
    assert walked(Dynamic()) == [7, 3]  # the side child, then the target's own token after the leaf
    assert walked(Dynamic(branches=True)) == target  # 4 drafts down the branch, then the target's token


# ---- the real uniforms: the same tokens as the chain -------------------------------------------
@pytest.mark.parametrize("shape", [Widths((3, 2, 1)), Dynamic(top=3), BestFirst(top=3), Dynamic(top=3, branches=True)],
                         ids=["3,2,1", "auto", "best-first", "branches"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_with_counter_based_uniforms_a_tree_commits_the_chains_tokens(shape, temperature):
    vocab, budget, length = 5, 5, 12
    followed_side = 0
    for seed in range(60):
        params = SamplingParams(temperature=temperature, seed=seed)
        runs = []
        for tree_shape in (None, shape):
            tokens = list(PROMPT)
            while len(tokens) - len(PROMPT) < length:
                def propose(path, tokens=tokens):
                    q = _law(tokens + path, b"d", vocab, params)
                    ranks = _law(tokens + path, b"d", vocab, SamplingParams(temperature=1.0))  # greedy ranks too
                    return draft_token(q, params, len(tokens) + len(path)), _ranked(ranks)

                tree = grow(tree_shape, budget, propose)

                def decided(node, tokens=tokens, tree=tree):
                    path = [] if node == ROOT else tree.path_tokens(node)
                    position = len(tokens) + len(path)
                    p = _law(tokens + path, b"t", vocab, params)
                    return decide(p, tree.tokens[tree.children(node)[0]], _law(tokens + path, b"d", vocab, params),
                                  params, position).token

                outcome = walk(tree, decided)
                followed_side += any(tree.children(tree.parents[n])[0] != n for n in outcome.accepted)
                tokens += outcome.tokens(tree)
            runs.append(tokens[len(PROMPT):][:length])
        assert runs[0] == runs[1], (seed, runs)
    assert followed_side > 0  # side children were taken, and changed nothing in the output


@pytest.mark.parametrize("shape", [Widths((2, 2, 1)), Dynamic(top=3), BestFirst(top=3), Dynamic(top=3, branches=True)],
                         ids=["2,2,1", "auto", "best-first", "branches"])
def test_greedy_windows_that_take_the_leaf_token_still_give_the_targets_greedy_output(shape):
    vocab, greedy, ranks = 5, SamplingParams(), SamplingParams(temperature=1.0)
    want = list(PROMPT)
    for _ in range(10):
        want.append(int(np.argmax(_law(want, b"t", vocab, greedy))))
    tokens, windows = list(PROMPT), 0
    while len(tokens) < len(want):
        tree = grow(shape, 4, lambda path: (int(np.argmax(_law(tokens + path, b"d", vocab, greedy))),
                                            _ranked(_law(tokens + path, b"d", vocab, ranks))))
        outcome = walk(tree, lambda node: int(np.argmax(_law(tokens + ([] if node == ROOT else tree.path_tokens(node)),
                                                             b"t", vocab, greedy))), leaf_token=True)
        assert outcome.token is not None  # a correction, or the leaf's own token
        tokens += outcome.tokens(tree)
        windows += 1
    assert tokens[:len(want)] == want and windows < 10


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_greedy_draft_s_alternatives_are_the_softmax_of_its_row_in_its_own_dtype(dtype):
    """The likeliest tokens a greedy draft reports (what a tree's growth ranks) and their probabilities:
    the float64 softmax of the row, whether it comes as float32 (as sessions give it, not copied) or
    float64, with masked (-inf) logits, ties in id order, and a processed row (a penalty moves the argmax)."""
    from dsi.engine.trees import draft_with_alternatives

    rng = np.random.default_rng(7)
    row = (rng.standard_normal(5000) * 3).astype(dtype)
    row[rng.choice(5000, 300, replace=False)] = -np.inf
    row[[10, 20]] = row[np.isfinite(row)].max() + 1.0  # a tie on top: the lower id first
    exact = np.exp(row.astype(np.float64) - row.max())
    exact /= exact.sum()
    main, q, ranked = draft_with_alternatives(row, SamplingParams(), 0, Prefix([], 0), 4)
    assert q is None and main == 10
    assert [t for t, _ in ranked] == [int(i) for i in np.lexsort((np.arange(5000), -exact))[:4]]
    assert ranked[0][0] == 10 and ranked[1][0] == 20
    np.testing.assert_allclose([p for _, p in ranked], exact[[t for t, _ in ranked]], rtol=1e-6)
    penalised = SamplingParams(presence_penalty=2.0)  # token 10 already generated: it drops below 20
    main, _, ranked = draft_with_alternatives(row, penalised, 1, Prefix([10], 0), 2)
    assert main == 20 and ranked[0][0] == 20
    shaped = row.astype(np.float64)
    shaped[10] -= 2.0
    expected = np.exp(shaped - shaped.max()) / np.exp(shaped - shaped.max()).sum()
    np.testing.assert_allclose(ranked[0][1], expected[20], rtol=1e-6)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(presence_penalty=1.5),
                                    SamplingParams(temperature=0.7, top_k=5, seed=1)], ids=["greedy", "penalised", "T=0.7"])
def test_a_tree_drafters_probability_is_the_law_its_side_children_are_ranked_by(params):
    """``TreeDrafter.probability`` (what a ``branches`` tree's mass is made of): the drafter's processed law at
    a proposed path, the softmax of its processed row when greedy, with or without the ranking floor, on rows
    computed path by path and in one tree forward."""
    from dsi.engine.request import Request
    from dsi.engine.trees import TreeDrafter
    from dsi.models import CallableLM, WithLatency

    vocab = 16

    def logits(context):
        return _logits(tuple(int(t) % 250 for t in context), b"p", vocab) * 2.0

    base = (3, 1, 4)
    request = Request(base, 8, params)
    for model in (CallableLM(logits, vocab), WithLatency(CallableLM(logits, vocab), 0.0, 0.0)):
        session = model.new_session()
        try:
            drafter = TreeDrafter(session, request, base, top=3, floor=0.1)
            paths = [[5], [6, 7], [6, 8]]
            proposals = drafter.propose_many(paths) + [drafter.propose([])]
            for path, (main, _) in zip(paths + [[]], proposals, strict=True):
                row, prefix = logits(base + tuple(path)), Prefix(list(base + tuple(path)), len(base))
                if params.greedy:  # the softmax of the processed row (its law is one-hot)
                    shaped = shape_logits(row, params, prefix)
                    law = np.exp(shaped - shaped.max()) / np.exp(shaped - shaped.max()).sum()
                else:
                    law = process_logits(row, params, prefix)
                for token in (main, 0, 11):
                    assert drafter.probability(path, token) == pytest.approx(float(law[token]), rel=1e-6, abs=1e-12)
        finally:
            session.close()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_floor_reports_exactly_the_unsure_alternatives_and_skips_confident_rows(dtype, monkeypatch):
    """With a floor (``auto`` trees), a draft reports exactly the alternatives of the full ranking other
    than itself with probability >= floor, on confident rows, rows near the floor's edge, ties, masked
    logits, processed rows and sampled drafts; and a confident greedy row is neither ranked nor normalised."""
    import dsi.engine.trees as engine_trees
    from dsi.engine.trees import draft_with_alternatives

    rng = np.random.default_rng(11)
    params_list = [(SamplingParams(), Prefix([], 0)), (SamplingParams(presence_penalty=1.5), Prefix([3, 4], 0)),
                   (SamplingParams(temperature=0.8, seed=2), Prefix([], 0))]
    for trial in range(300):
        row = (rng.standard_normal(2000) * rng.choice([0.5, 3.0, 8.0])).astype(dtype)
        if trial % 3 == 0:
            row[rng.integers(2000)] += rng.choice([2.0, 5.0, 20.0])  # a confident drafter
        if trial % 7 == 0:
            top = int(np.argmax(row))
            row[(top + 1) % 2000] = row[top] + np.log(0.1) + rng.choice([-1e-4, 0.0, 1e-4])  # at the floor's edge
        if trial % 11 == 0:
            row[rng.choice(2000, 50, replace=False)] = -np.inf
        if trial % 5 == 1:  # a second choice about the 0.45 floor's edge against the top two alone
            top = int(np.argmax(row))
            row[(top + 3) % 2000] = row[top] + np.log(0.45 / 0.55) + rng.choice([-1e-3, 0.0, 1e-3, 0.2])
        params, prefix = params_list[trial % len(params_list)]
        for floor in (0.1, 0.3, 0.45):  # 0.45: near tokens below the floor against their own normaliser
            main, q, full = draft_with_alternatives(row, params, 5, prefix, 4)
            main2, q2, unsure = draft_with_alternatives(row, params, 5, prefix, 4, floor)
            assert main2 == main and (q is None) == (q2 is None)
            assert unsure == [(t, p) for t, p in full if t != main and p >= floor], (trial, floor)
            assert Dynamic(floor=floor).sides(main, unsure) == Dynamic(floor=floor).sides(main, full)
    calls = []
    monkeypatch.setattr(engine_trees, "top_ids", lambda *a: calls.append(1) or [])
    confident = np.zeros(2000, dtype=dtype)
    confident[7] = 10.0
    assert draft_with_alternatives(confident, SamplingParams(), 0, Prefix([], 0), 4, 0.1) == (7, None, [])
    assert calls == []  # the confident row was never ranked
