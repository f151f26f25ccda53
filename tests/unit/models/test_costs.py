"""What a forward costs by its rows (dsi.models.costs), and how it prices the "auto" tree's side children
(dsi.trees.floor_for_price, dsi.engine.trees.priced_shape)."""

from __future__ import annotations

import time

import numpy as np
import pytest

import dsi
from dsi.engine.trees import priced_shape
from dsi.errors import ConfigError
from dsi.models import CallableLM, WithLatency
from dsi.models.costs import ForwardCosts, forward_costs, measure_forward_costs
from dsi.models.emulated.replay import ReplayLM
from dsi.trees import (CHAIN_PRICE, DEFAULT_FLOOR, DSI_FLOOR, BestFirst, Dynamic, Widths, floor_for_price,
                       grows_side_chains, parse_shape)

VOCAB = 16


def _logits(context):
    row = np.zeros(VOCAB)
    row[(sum(context) * 7 + len(context)) % VOCAB] = 3.0
    return row


DRAFTER = CallableLM(_logits, VOCAB)  # a drafter that branches (its requests draft tree windows)


class SleepyLM:
    """A model that states nothing: a forward over n tokens sleeps ``a + b * n`` seconds; counts its sessions."""

    def __init__(self, a: float, b: float) -> None:
        self.a, self.b, self.sessions = a, b, 0
        self.inner = CallableLM(_logits, VOCAB)

    @property
    def vocab_size(self) -> int:
        return VOCAB

    def new_session(self):
        self.sessions += 1
        outer, session = self, self.inner.new_session()

        class Session:
            tokens = property(lambda s: session.tokens)

            def extend(self, tokens, cancel=None):
                time.sleep(outer.a + outer.b * len(tokens))
                return session.extend(tokens, cancel)

            def truncate(self, length):
                session.truncate(length)

            def close(self):
                pass

        return Session()


def test_stated_costs_of_the_latency_model_callables_and_replays():
    gpu = WithLatency(CallableLM(_logits, VOCAB), ttft=0.02, tpot=0.02)
    cpu = WithLatency(CallableLM(_logits, VOCAB), ttft=0.008, tpot=0.008, token_s=0.003)
    assert forward_costs(gpu) == ForwardCosts(0.02, 0.0) and forward_costs(gpu).row_price == 0.0
    assert forward_costs(cpu).row_price == pytest.approx(0.003 / 0.011)
    assert forward_costs(CallableLM(_logits, VOCAB)).row_price == 0.0  # no hardware: nothing to weigh
    assert forward_costs(ReplayLM(cpu, {})) == forward_costs(cpu)  # a replay states what its inner model states
    sleepy = SleepyLM(0.0, 0.0)
    assert forward_costs(ReplayLM(sleepy, {}), measure=False) is None and sleepy.sessions == 0


def test_a_model_that_states_nothing_is_timed_once():
    sleepy = SleepyLM(0.004, 0.006)  # one token: 10 ms, each more: 6 ms, a price of 0.6
    costs = forward_costs(sleepy)
    assert costs.measured and 0.3 < costs.row_price < 0.9, costs  # sleeps only grow: generous margins
    assert forward_costs(sleepy) is costs and sleepy.sessions == 1  # remembered per model object
    flat = measure_forward_costs(SleepyLM(0.01, 0.0))
    assert flat.row_price < 0.3, flat


def test_a_model_whose_sessions_fail_has_no_measured_cost():
    class Broken(SleepyLM):
        def new_session(self):
            raise RuntimeError("no device")

    assert measure_forward_costs(Broken(0.0, 0.0)) is None
    assert priced_shape(Dynamic(), Broken(0.0, 0.0), DRAFTER, "threads", {}) == Dynamic()  # the default floor stays


def test_the_floor_follows_the_price():
    assert floor_for_price(0.0) == DEFAULT_FLOOR and floor_for_price(0.05) == DEFAULT_FLOOR
    assert floor_for_price(0.273) == 0.5 and floor_for_price(0.3) == 0.5 and floor_for_price(0.31) == 0.55
    assert floor_for_price(0.64) == 1.0 and floor_for_price(1.0) == 1.0
    # DSI's least floor where rows are free; a priced floor above it is the same
    assert floor_for_price(0.0, DSI_FLOOR) == DSI_FLOOR == 0.02 and floor_for_price(0.273, DSI_FLOOR) == 0.5
    for least in (0, -0.1, 1.5, True, "0.1"):
        with pytest.raises(ConfigError, match=f"least={least!r} must be a probability in \\(0, 1\\]"):
            floor_for_price(0.0, least)
    for bad in (-0.1, 1.5, "0.3", True):
        with pytest.raises(ConfigError, match="row_price=.* must be a number in \\[0, 1\\]"):
            floor_for_price(bad)


def test_dsi_grows_side_chains_for_branches_and_for_auto_only_where_rows_are_nearly_free():
    # "auto" where the price is known to be at most CHAIN_PRICE; never where it is not known or the floor is fixed
    assert CHAIN_PRICE == pytest.approx(DSI_FLOOR * 0.6 / 2)
    assert grows_side_chains(Dynamic(floor=DSI_FLOOR, price=0.0))
    assert grows_side_chains(Dynamic(floor=0.02, price=0.006))
    assert not grows_side_chains(Dynamic(floor=0.02, price=0.0061))
    assert not grows_side_chains(Dynamic(floor=0.5, price=0.27))
    assert not grows_side_chains(Dynamic()) and not grows_side_chains(Dynamic(floor=0.02))  # not priced, "auto:0.02"
    assert grows_side_chains(Dynamic(branches=True))
    assert grows_side_chains(Dynamic(floor=0.5, price=0.27, branches=True))
    assert not any(grows_side_chains(shape) for shape in (None, Widths((2,)), BestFirst()))
    # a GPU-like latency model (a forward costs the same for any number of tokens) prices DSI's "auto" into chains
    gpu = WithLatency(CallableLM(_logits, VOCAB), ttft=0.02, tpot=0.02)
    assert grows_side_chains(priced_shape(Dynamic(), gpu, DRAFTER, "threads", {}, DSI_FLOOR))


def test_priced_shape_prices_auto_only_and_only_where_it_can_know():
    cpu = WithLatency(CallableLM(_logits, VOCAB), ttft=0.008, tpot=0.008, token_s=0.003)
    priced = priced_shape(Dynamic(), cpu, DRAFTER, "threads", {})
    assert priced == Dynamic(floor=0.5, price=pytest.approx(0.003 / 0.011)) and priced.name == "auto"
    assert priced_shape(priced, cpu, DRAFTER, "threads", {}) == priced  # pricing twice changes nothing
    assert priced_shape(Dynamic(floor=0.5), cpu, DRAFTER, "threads", {}) == Dynamic(floor=0.5)  # auto:0.5 is fixed
    assert Dynamic(floor=0.5).name == "auto:0.5" and parse_shape("auto:0.5") == Dynamic(floor=0.5)
    assert priced_shape(Widths((2,)), cpu, DRAFTER, "threads", {}) == Widths((2,))
    assert priced_shape(None, cpu, DRAFTER, "threads", {}) is None
    assert priced_shape(Dynamic(), cpu, DRAFTER, "ray", {}) == priced  # a stated cost holds wherever the servers run
    for transport, options in (("ray", {}), ("processes", {"devices": ["cuda:0"]})):
        sleepy = SleepyLM(0.0, 0.0)
        assert priced_shape(Dynamic(), sleepy, DRAFTER, transport, options) == Dynamic() and sleepy.sessions == 0
    class ThroughText(CallableLM):  # a drafter of another vocabulary drafting every request through text
        def mode_for(self, greedy):
            return "string"

    sleepy = SleepyLM(0.0, 0.0)  # no tree is ever drafted with it: no probe
    assert priced_shape(Dynamic(), sleepy, ThroughText(_logits, VOCAB), "threads", {}) == Dynamic()
    assert sleepy.sessions == 0
    with pytest.raises(ConfigError, match="floor=2 must be None .* or a probability in \\(0, 1\\]"):
        Dynamic(floor=2)


@pytest.mark.parametrize("method,lookahead", [("si", 5), ("dsi", "auto")])
def test_auto_trees_branch_less_where_rows_cost(method, lookahead):
    """The same drafter rows (0.5 / 0.3 / 0.15): where a row is free "auto" keeps both side children (a floor of
    0.1), where it costs 0.11 of a forward (1 ms on 9 ms) only the one >= 0.2; where a row costs a whole forward,
    none. The output is the target's either way."""
    def drafter_logits(context):
        row = np.full(VOCAB, -9.0)
        top = (sum(context) * 7 + len(context)) % VOCAB
        row[top], row[(top + 1) % VOCAB], row[(top + 2) % VOCAB] = np.log(0.5), np.log(0.3), np.log(0.15)
        return row  # the target's token 0.5, two others 0.3 and 0.15

    prompt, runs = [1, 2, 3], {}
    # "whole": no fixed cost, so a row costs a whole forward (its price is the ratio, 1, at any scale: 10 ms)
    for name, token_s in (("gpu", 0.0), ("cpu", 0.001), ("whole", 0.01)):
        target = WithLatency(CallableLM(_logits, VOCAB), ttft=0.0 if name == "whole" else 0.008,
                             tpot=0.0 if name == "whole" else 0.008, token_s=token_s)
        out = dsi.generate(target=target, drafter=CallableLM(drafter_logits, VOCAB), prompt=prompt, method=method,
                           lookahead=lookahead, num_target_servers=2, draft_tree="auto", max_new_tokens=12)
        reference = dsi.generate(target=CallableLM(_logits, VOCAB), prompt=prompt, method="ar", max_new_tokens=12)
        assert out.tokens == reference.tokens
        runs[name] = out.stats.extra
    assert runs["gpu"]["tree_floor"] == (DSI_FLOOR if method == "dsi" else DEFAULT_FLOOR)
    assert runs["cpu"]["tree_floor"] == 0.2
    assert runs["whole"]["tree_floor"] == 1.0 and runs["whole"]["tree_row_price"] == 1.0
    assert runs["gpu"]["tree_side_nodes"] > runs["cpu"]["tree_side_nodes"] > 0 == runs["whole"].get("tree_side_nodes", 0)
    assert runs["gpu"]["draft_tree"] == runs["cpu"]["draft_tree"] == "auto"
    assert runs["whole"]["draft_tree"] == "chain" and ">= 1" in runs["whole"]["draft_tree_fallback"]


def test_dsi_branches_at_a_lower_floor_than_si_where_rows_are_free():
    """DSI's windows carry a few drafts, so where a verified row is free its floor is DSI_FLOOR: a side child of
    drafter probability 0.05 goes out with DSI's windows and not with SI's k-draft ones (floor 0.1); where a row
    costs 0.11 of a forward both price the same floor (0.2). The output is the target's either way."""
    def drafter_logits(context):
        row = np.full(VOCAB, -20.0)
        top = (sum(context) * 7 + len(context)) % VOCAB
        row[top], row[(top + 1) % VOCAB] = np.log(0.9), np.log(0.05)
        return row

    prompt = [1, 2, 3]
    reference = dsi.generate(target=CallableLM(_logits, VOCAB), prompt=prompt, method="ar", max_new_tokens=12).tokens
    runs = {}
    for method, lookahead in (("si", 4), ("dsi", "auto")):
        for name, token_s in (("gpu", 0.0), ("cpu", 0.001)):
            target = WithLatency(CallableLM(_logits, VOCAB), ttft=0.008, tpot=0.008, token_s=token_s)
            out = dsi.generate(target=target, drafter=CallableLM(drafter_logits, VOCAB), prompt=prompt,
                               method=method, lookahead=lookahead, num_target_servers=2, draft_tree="auto",
                               max_new_tokens=12)
            assert out.tokens == reference
            runs[method, name] = out.stats.extra
    assert (runs["si", "gpu"]["tree_floor"], runs["dsi", "gpu"]["tree_floor"]) == (DEFAULT_FLOOR, DSI_FLOOR)
    assert runs["si", "gpu"].get("tree_side_nodes", 0) == 0 < runs["dsi", "gpu"]["tree_side_nodes"]
    assert runs["si", "cpu"]["tree_floor"] == runs["dsi", "cpu"]["tree_floor"] == 0.2
    assert runs["dsi", "cpu"].get("tree_side_nodes", 0) == 0


def _near_tie_drafter(context):
    """A drafter whose top two tie at 0.45 / 0.45 (the target's token first) every fourth position, and
    that is sure (0.9) elsewhere."""
    row = np.full(VOCAB, -20.0)
    top = (sum(context) * 7 + len(context)) % VOCAB
    if len(context) % 4 == 0:
        row[top], row[(top + 3) % VOCAB] = np.log(0.45), np.log(0.45)
    else:
        row[top], row[(top + 3) % VOCAB] = np.log(0.9), np.log(0.05)
    return row


@pytest.mark.parametrize("method,lookahead", [("si", 4), ("dsi", 3)])
def test_greedy_requests_draft_the_chain_where_rows_price_the_floor_past_greedy_side_children(method, lookahead):
    """At a priced floor >= CHAIN_FLOOR (rows 0.25 of a forward: 0.45) a greedy side child could only
    be a near tie of the drafter's top two, and ranking every row for it costs more than it saves
    (docs/results-log.md#2026-12-03): greedy requests draft the chain, said in the stats; sampled requests too (a
    sampled side child, the drafter's top token where the draft was another, wins far less often than its drafter
    probability: docs/results.md#why-a-sampled-side-child-rescues-less-than-a-greedy-one); a fixed "auto:0.45"
    still drafts trees, and every greedy output is the target's."""
    from dsi.trees import CHAIN_FLOOR
    cpu = dict(ttft=0.009, tpot=0.009, token_s=0.003)  # a row 0.25 of a one-token forward
    assert floor_for_price(0.25) == CHAIN_FLOOR == 0.45 and floor_for_price(0.003 / 0.011) == 0.5
    assert floor_for_price(0.2) < CHAIN_FLOOR  # cheaper rows: greedy trees stay
    prompt = [1, 2, 3]
    reference = dsi.generate(target=CallableLM(_logits, VOCAB), prompt=prompt, method="ar", max_new_tokens=16)

    def run(tree, **sampling):
        return dsi.generate(target=WithLatency(CallableLM(_logits, VOCAB), **cpu),
                            drafter=CallableLM(_near_tie_drafter, VOCAB), prompt=prompt, method=method,
                            lookahead=lookahead, num_target_servers=2, draft_tree=tree, max_new_tokens=16, **sampling)

    priced = run("auto")
    assert priced.tokens == reference.tokens
    assert priced.stats.extra["draft_tree"] == "chain" and priced.stats.extra["tree_floor"] == 0.45
    assert "0.45" in priced.stats.extra["draft_tree_fallback"] and "tree_windows" not in priced.stats.extra
    assert "tree_side_nodes" not in priced.stats.extra
    fixed = run("auto:0.45")  # asked for by name: the near ties get their side child
    assert fixed.tokens == reference.tokens and fixed.stats.extra["draft_tree"] == "auto:0.45"
    assert fixed.stats.extra["tree_side_nodes"] > 0 and "draft_tree_fallback" not in fixed.stats.extra
    sampled = run("auto", sampling=dsi.SamplingParams(temperature=1.0, seed=3))  # sampled: the chain too
    assert sampled.stats.extra["draft_tree"] == "chain" and "residual" in sampled.stats.extra["draft_tree_fallback"]
    assert "tree_side_nodes" not in sampled.stats.extra
    chain = run(None, sampling=dsi.SamplingParams(temperature=1.0, seed=3))
    assert sampled.tokens == chain.tokens  # the same seed, the same tokens as the chain's
    sampled_fixed = run("auto:0.45", sampling=dsi.SamplingParams(temperature=1.0, seed=3))
    assert sampled_fixed.stats.extra["draft_tree"] == "auto:0.45"
    assert "draft_tree_fallback" not in sampled_fixed.stats.extra
    if method == "si":  # SI's branches tree follows the same rule
        branches = run("branches")
        assert branches.tokens == reference.tokens and branches.stats.extra["draft_tree"] == "chain"
