"""method="auto" (dsi.evaluate.autotune): measured where the workers run, predicted, checked, cached."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import dsi
import dsi.evaluate.autotune as autotune
from dsi.evaluate.autotune import AutoChoice, choose_method
from dsi.errors import ConfigError
from dsi.models import synthetic_pair
from dsi.models.emulated.replay import accept_pattern


class OneCore:
    """Models whose forwards all need one shared "core" (a lock held for the whole forward): the
    drafter and target servers of DSI then take turns, as on a CPU whose cores they share."""

    def __init__(self, model, core: threading.Lock) -> None:
        self.model, self.core = model, core

    @property
    def vocab_size(self):
        return self.model.vocab_size

    def new_session(self):
        return _OneCoreSession(self.model.new_session(), self.core)

    def __repr__(self):
        return f"OneCore({self.model!r})"


class _OneCoreSession:
    def __init__(self, inner, core):
        self._inner, self._core = inner, core

    @property
    def tokens(self):
        return self._inner.tokens

    def extend(self, tokens, cancel=None):
        with self._core:
            return self._inner.extend(tokens, cancel)

    def truncate(self, length):
        self._inner.truncate(length)

    def close(self):
        self._inner.close()


def test_a_good_drafter_on_separate_hardware_picks_dsi(tmp_path, no_thread_leak):
    # forwards that sleep (no compute to share): DSI's ideal here is about 2x SI's, a margin no
    # scheduling noise of a loaded test machine closes
    target, drafter = synthetic_pair(0.95, target_tpot=0.030, drafter_tpot=0.001)
    choice = choose_method(target, drafter, max_servers=2, cache_dir=tmp_path)
    assert choice.method == "dsi" and not choice.cached
    labels = [c.label for c in choice.candidates]
    assert labels[0] == choice.label and "non-SI" in labels and any(label.startswith("SI") for label in labels)
    assert {"non-SI", "SI k=4", "DSI auto SP=1", "DSI auto SP=2"} <= set(choice.measured)
    assert choice.acceptance > 0.7
    # the evidence: DSI measured faster than SI's and non-SI's calibration runs
    assert choice.measured["DSI auto SP=2"]["wall_s"] < choice.measured["SI k=4"]["wall_s"]
    assert choice.measured["non-SI"]["target_forward_s"] >= 0.030 * 0.999  # a forward sleeps its latency


def test_a_drafter_that_is_never_right_picks_non_si(tmp_path, no_thread_leak):
    target, drafter = synthetic_pair(0.0, target_tpot=0.010, drafter_tpot=0.002)
    choice = choose_method(target, drafter, max_servers=2, cache_dir=tmp_path)
    assert choice.method == "ar", choice.reason
    assert choice.acceptance == 0.0
    # decided from the accept pattern, not from noisy timings: no speculative run was made
    assert set(choice.measured) == {"non-SI"} and [c.label for c in choice.candidates] == ["non-SI"]
    assert "never the target's token" in choice.reason


def test_workers_sharing_one_core_make_dsi_lose_and_the_choice_sees_it(tmp_path, no_thread_leak):
    """Alone, each forward costs the same whatever the method; run concurrently on one "core",
    DSI's drafter waits for the servers. Isolated latencies would predict a DSI win; the
    concurrent calibration shows the slowdown and SI (sequential by nature) is picked."""
    core = threading.Lock()
    target, drafter = synthetic_pair(0.9, target_tpot=0.015, drafter_tpot=0.003)
    target, drafter = OneCore(target, core), OneCore(drafter, core)
    choice = choose_method(target, drafter, max_servers=2, cache_dir=tmp_path)
    assert choice.method == "si", choice.reason
    dsi_run = choice.measured["DSI auto SP=1"]
    assert dsi_run["wall_s"] > 0.9 * choice.measured["SI k=4"]["wall_s"]
    assert "slow each other down" in choice.reason  # the evidence is named: forwards slower together


def test_the_choice_is_cached_and_refreshed_on_demand(tmp_path, monkeypatch, no_thread_leak):
    target, drafter = synthetic_pair(0.9, target_tpot=0.010, drafter_tpot=0.001)
    first = choose_method(target, drafter, cache_dir=tmp_path)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and first.cache_file == str(files[0])
    assert json.loads(files[0].read_text())["label"] == first.label

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured although a cached choice exists")

    monkeypatch.setattr(autotune, "_measure_and_choose", no_measuring)
    again = choose_method(target, drafter, cache_dir=tmp_path)
    assert again.cached and again.label == first.label and again.candidates == first.candidates
    with pytest.raises(AssertionError, match="measured although"):
        choose_method(target, drafter, cache_dir=tmp_path, refresh=True)
    other_sp = tmp_path / "other"
    with pytest.raises(AssertionError):  # another bound on SP is another key
        choose_method(target, drafter, cache_dir=other_sp, max_servers=3)


def test_a_corrupt_cache_file_is_measured_again(tmp_path, no_thread_leak):
    target, drafter = synthetic_pair(0.9, target_tpot=0.010, drafter_tpot=0.001)
    first = choose_method(target, drafter, cache_dir=tmp_path)
    (tmp_path / f"{first.key}.json").write_text("{not json")
    again = choose_method(target, drafter, cache_dir=tmp_path)
    assert not again.cached  # measured again, and the file rewritten
    assert json.loads((tmp_path / f"{first.key}.json").read_text())["key"] == first.key


def test_generate_with_method_auto_is_lossless_and_says_what_it_picked(tmp_path, no_thread_leak):
    target, drafter = synthetic_pair(0.8, target_tpot=0.010, drafter_tpot=0.001)
    reference = dsi.generate(target=target, prompt=[5, 6], method="ar", max_new_tokens=30).tokens
    out = dsi.generate(target=target, drafter=drafter, prompt=[5, 6], method="auto", max_new_tokens=30,
                       num_target_servers=2, auto_options={"cache_dir": tmp_path})
    assert out.tokens == reference
    auto = out.stats.to_dict()["auto"]
    assert auto["picked"].split()[0] in ("non-SI", "SI", "DSI") and auto["reason"].startswith(auto["picked"])
    assert out.stats.method == {"non-SI": "ar", "SI": "si", "DSI": "dsi"}[auto["picked"].split()[0]]


def test_choice_round_trips_through_its_dict():
    choice = AutoChoice("dsi", "auto", 2, "why", (autotune.Candidate("dsi", "auto", 2, 1.0, 1.1),), {"x": {}},
                        0.9, 32, "k", "now")
    assert AutoChoice.from_dict(json.loads(json.dumps(choice.to_dict()))) == choice


@pytest.mark.parametrize("kwargs, message", [
    ({"max_servers": 0}, "max_servers=0"), ({"tokens": 4}, "tokens=4 must be an integer >= 8"),
])
def test_bad_arguments_name_the_value(kwargs, message, tmp_path):
    target, drafter = synthetic_pair(0.9)
    with pytest.raises(ConfigError, match=message):
        choose_method(target, drafter, cache_dir=tmp_path, **kwargs)
    with pytest.raises(ConfigError, match="needs a drafter"):
        choose_method(target, None, cache_dir=tmp_path)


def test_dsi_workers_share_the_cores_when_the_user_left_threads_unset(monkeypatch):
    import os
    import types

    from dsi.evaluate.autotune import threads_set, worker_threads

    class Model:
        def __init__(self, threads=None, device="cpu"):
            self.threads, self.device = threads, types.SimpleNamespace(type=device)

    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert worker_threads(Model(), Model(), "dsi", 3, "threads") == 2  # drafter + 3 servers on 8 cores
    assert worker_threads(Model(), Model(), "dsi", 1, "processes") == 8  # only the drafter runs here
    assert worker_threads(Model(), Model(), "si", 3, "threads") is None  # one worker at a time: all cores
    assert worker_threads(Model(threads=4), Model(), "dsi", 3, "threads") is None  # the user's setting
    assert worker_threads(Model(device="cuda"), Model(device="cuda"), "dsi", 3, "threads") is None
    a, b = Model(), Model()
    with threads_set(2, a, b):
        assert (a.threads, b.threads) == (2, 2)
    assert (a.threads, b.threads) == (None, None)


def test_a_drafter_with_a_short_context_is_measured_not_refused(tmp_path, no_thread_leak):
    """The calibration prompt plus 32 tokens is longer than the drafter's 12 positions: every run
    still completes, and positions past the drafter's context count as no accepted draft."""
    from dsi.models import CallableLM, WithLatency

    target, drafter = synthetic_pair(1.0, vocab_size=32)  # a drafter that is always right...
    short = WithLatency(CallableLM(drafter.next_logits, 32, max_context=12), 0.0005, 0.0005)  # ...while it can see
    choice = choose_method(WithLatency(target, 0.002, 0.002), short, max_servers=1, cache_dir=tmp_path, tokens=32)
    assert {"non-SI", "SI k=4", "DSI auto SP=1"} <= set(choice.measured)
    assert choice.acceptance == pytest.approx((12 - 4 + 1) / 32)  # drafts only for positions 4..12


# ---- once auto has chosen, it costs nothing -----------------------------------------------------------
COUNTERS = ("new_tokens", "drafted_tokens", "accepted_tokens", "rejections", "bonus_tokens", "verify_tasks",
            "target_forwards", "drafter_forwards", "num_target_servers", "lookahead", "method")


def _choice(method, lookahead, servers):
    return AutoChoice(method, lookahead, servers, f"{method} by test", (), {}, 0.8, 32, "test-key", "now")


def _dsi_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("dsi-") and t.is_alive())


@pytest.mark.parametrize("method, lookahead, servers", [("ar", 1, 1), ("si", 3, 1), ("dsi", 2, 2),
                                                        ("dsi", "auto", 2)])
def test_the_decoder_auto_picked_is_the_one_built_by_hand(method, lookahead, servers, no_thread_leak):
    """Same engine, configuration, workers (threads) and work (counters) as the method built by hand."""
    from dsi.engine.api import build_decoder, make_request

    target, drafter = synthetic_pair(0.7, seed=3)  # no latency: deterministic counters for ar and si
    request = make_request([3, 1, 4], 24, dsi.SamplingParams(), None, target.vocab_size)
    hand = build_decoder(target=target, drafter=drafter, method=method, lookahead=lookahead,
                         num_target_servers=servers)
    hand_threads = _dsi_threads()
    hand_out = hand.generate(request)
    hand.close()
    auto = autotune.decoder_for_choice(_choice(method, lookahead, servers), target=target, drafter=drafter)
    assert type(auto.inner) is type(hand) and auto.method == hand.method
    def config(decoder) -> dict:  # its settings (not whether it is closed: the hand-built one is)
        return {k: v for k, v in vars(decoder).items() if isinstance(v, int | str) and k != "_closed"}

    assert config(auto.inner) == config(hand)
    auto_threads = _dsi_threads()
    auto_out = auto.generate(request)
    auto.close()
    assert auto_threads == hand_threads  # nothing else started beside it
    assert auto_out.tokens == hand_out.tokens
    got, want = auto_out.stats.to_dict(), hand_out.stats.to_dict()
    deterministic = COUNTERS if method != "dsi" else ("new_tokens", "num_target_servers", "lookahead", "method")
    assert {k: got[k] for k in deterministic} == {k: want[k] for k in deterministic}
    assert got["auto"]["picked"] == auto.choice.label


def test_a_non_si_pick_holds_no_drafter_and_needs_none():
    import gc
    import weakref

    target, drafter = synthetic_pair(0.7, seed=1)
    gone = weakref.ref(drafter)
    auto = autotune.decoder_for_choice(_choice("ar", 1, 1), target=target, drafter=drafter)
    del drafter
    gc.collect()
    assert gone() is None  # the auto decoder keeps nothing of the drafter alive
    built = autotune.decoder_for_choice(_choice("ar", 1, 1), target=target, drafter=None)
    assert auto.generate(dsi.engine.make_request([1, 2], 8, dsi.SamplingParams(), None, target.vocab_size)).tokens \
        == built.generate(dsi.engine.make_request([1, 2], 8, dsi.SamplingParams(), None, target.vocab_size)).tokens
    with pytest.raises(ConfigError, match="needs a drafter"):
        autotune.decoder_for_choice(_choice("si", 3, 1), target=target, drafter=None)


def test_a_cached_choice_builds_the_same_workers_as_the_method_by_hand(tmp_path, no_thread_leak):
    """Through the public entry: after the first (measuring) build, a build reads the cache and starts
    exactly the threads the picked method starts when built by hand."""
    target, drafter = synthetic_pair(0.95, target_tpot=0.020, drafter_tpot=0.001)
    first = dsi.build_decoder(target=target, drafter=drafter, method="auto", num_target_servers=2,
                              auto_options={"cache_dir": tmp_path, "tokens": 16})
    first.close()
    choice = first.choice
    assert _dsi_threads() == []
    again = dsi.build_decoder(target=target, drafter=drafter, method="auto", num_target_servers=2,
                              auto_options={"cache_dir": tmp_path, "tokens": 16})
    assert again.choice.cached and again.choice.label == choice.label
    auto_threads = _dsi_threads()
    again.close()
    hand = dsi.build_decoder(target=target, drafter=drafter, method=choice.method, lookahead=choice.lookahead,
                             num_target_servers=choice.num_target_servers)
    assert _dsi_threads() == auto_threads
    hand.close()


def hedging_pair(right: float, *, target_s: float, token_s: float = 0.0, drafter_s: float = 0.001, seed: int = 4,
                 second: float = 2.5):
    """A random target and a drafter whose first choice is the target's token at a fraction ``right`` of
    contexts (seeded per context) and whose second choice is it everywhere else: the pair draft trees are
    made for (every rejection has its correction among the side children). ``second``: the second choice's
    logit (the first's is 3, the others' about 0: 2.5 gives it a drafter probability of about 0.26)."""
    from dsi.models import CallableLM, WithLatency
    from tests.conftest import random_lm

    vocab = 16
    target = random_lm(vocab, seed, sharpness=2.0)

    def drafter_logits(tokens):
        best = int(np.argmax(target.next_logits(tuple(tokens))))
        rng = np.random.default_rng([seed, len(tokens), *tokens])
        logits = rng.normal(0.0, 0.1, vocab)
        other = (best + 1 + int(rng.integers(vocab - 1))) % vocab
        first, runner_up = (best, other) if rng.random() < right else (other, best)
        logits[first], logits[runner_up] = 3.0, second
        return logits

    drafter = CallableLM(drafter_logits, vocab, name=f"hedging(right={right})")
    return (WithLatency(target, target_s, target_s, token_s=token_s),
            WithLatency(drafter, drafter_s, drafter_s))


def test_trees_are_picked_where_the_drafters_second_choice_rescues_its_rejections(tmp_path, no_thread_leak):
    """A drafter right half the time, with the target's token second otherwise, and target forwards that
    cost the same whatever their tokens (a GPU-like server): a tree commits a side child and the token
    after it where a chain stops, so a tree wins, as measured (not only predicted) and without changing
    a token."""
    target, drafter = hedging_pair(0.5, target_s=0.020)
    choice = choose_method(target, drafter, max_servers=1, cache_dir=tmp_path)
    assert choice.draft_tree in ("2", "auto"), choice.reason
    assert f"tree={choice.draft_tree}" in choice.label and choice.label in choice.measured  # run, not predicted
    best_chain = min(c.seconds for c in choice.candidates if c.draft_tree is None and c.method != "ar")
    assert choice.measured[choice.label]["wall_s"] < best_chain
    assert "side children rescue" in choice.reason and "the best chain" in choice.reason
    reference = dsi.generate(target=target, prompt=[5, 6], method="ar", max_new_tokens=30).tokens
    out = dsi.generate(target=target, drafter=drafter, prompt=[5, 6], method="auto", max_new_tokens=30,
                       auto_options={"cache_dir": tmp_path})  # the cached choice
    assert out.tokens == reference
    assert out.stats.extra["draft_tree"] == choice.draft_tree and out.stats.extra["tree_side_accepts"] > 0
    assert out.stats.to_dict()["auto"]["draft_tree"] == choice.draft_tree


def test_a_chain_is_picked_where_trees_lose_and_trees_can_be_left_out(tmp_path, no_thread_leak):
    """A drafter right 95% of the time (its second choice right otherwise) and target forwards whose time
    grows with their tokens (a CPU-like server): a tree's side children are rows the target pays for and
    depth the chain keeps, so a chain is picked, and the trees it weighed are in the evidence."""
    target, drafter = hedging_pair(0.95, target_s=0.010, token_s=0.002)
    choice = choose_method(target, drafter, max_servers=1, cache_dir=tmp_path)
    assert choice.draft_tree is None and choice.method in ("si", "dsi"), choice.reason
    assert choice.candidates[0].label == choice.label
    trees = [c for c in choice.candidates if c.draft_tree is not None]
    # the "auto" tree is priced at this target's rows (2 ms on 12 ms: a floor of 0.3), above the drafter's
    # second choice (0.26): it would draft the chain, so only the width 2 is weighed as a tree
    assert {c.draft_tree for c in trees} == {"2"} and all(c.seconds > choice.candidates[0].seconds
                                                         for c in trees), choice.candidates
    assert "but the best tree" in choice.reason and "tree=auto" not in choice.reason
    chains_only = choose_method(target, drafter, max_servers=1, cache_dir=tmp_path, trees=False)
    assert not chains_only.cached and chains_only.key != choice.key  # another key: measured again
    assert all(c.draft_tree is None for c in chains_only.candidates) and "tree" not in chains_only.reason
    with pytest.raises(ConfigError, match="trees="):
        choose_method(target, drafter, cache_dir=tmp_path, trees="yes")


def test_a_drafter_that_cannot_branch_is_weighed_with_chains_only(tmp_path, no_thread_leak):
    target, drafter = hedging_pair(0.5, target_s=0.010)

    class ThroughText:  # a drafter of another vocabulary whose greedy requests draft through text
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def mode_for(self, greedy):
            return "string"

    out = dsi.generate(target=target, prompt=[5, 6], method="ar", max_new_tokens=16).tokens
    matches, trees = autotune._patterns(drafter, [5, 6], out, True)
    assert {method: set(names) for method, names in trees.items()} == {"si": {"2", "auto"}, "dsi": {"2", "auto"}}
    assert matches == accept_pattern(drafter, [5, 6], out)  # the same forward gives the accept pattern
    assert autotune._patterns(ThroughText(drafter), [5, 6], out, True) == (matches, {})
    assert autotune._patterns(drafter, [5, 6], out, False) == (matches, {})


def test_dsis_auto_tree_is_weighed_at_dsis_floor_where_a_verified_row_is_free(no_thread_leak):
    """Where a verified row costs the target nothing, SI's ``auto`` tree branches at a drafter probability of 0.1
    and DSI's at :data:`dsi.trees.DSI_FLOOR` (0.02), as their decoders do: a drafter whose second choice (about
    0.05 likely) is the target's token wherever its first is not is weighed with DSI's ``auto`` tree only."""
    target, drafter = hedging_pair(0.5, target_s=0.010, second=0.6)
    out = dsi.generate(target=target, prompt=[5, 6], method="ar", max_new_tokens=16).tokens
    _, trees = autotune._patterns(drafter, [5, 6], out, True, target)
    assert set(trees["dsi"]) == {"2", "auto"} and set(trees["si"]) == {"2"}, trees
    assert trees["dsi"]["auto"].rescues == trees["dsi"]["2"].rescues  # the second choice, where it reaches 0.02


def test_of_the_runs_within_the_margin_the_simplest_is_picked_and_never_a_prediction():
    C = autotune.Candidate
    runs = [C("dsi", "auto", 4, 1.00, 1.00), C("dsi", "auto", 2, 1.02, 1.02), C("dsi", 3, 1, 0.50),  # predicted
            C("si", 4, 1, 1.10, 1.10), C("si", 4, 1, 1.01, 1.025, draft_tree="2")]
    pick = autotune.pick_run(runs, 0.03)
    assert (pick.method, pick.servers, pick.draft_tree) == ("si", 1, "2")  # SI before DSI, within 3%
    pick = autotune.pick_run(runs[:3], 0.03)
    assert pick.servers == 4  # equally simple: the faster run; the faster prediction was never run
    assert autotune.pick_run(runs[1:3], 0.03).servers == 2  # the only run
    chain_and_tree = [C("si", 4, 1, 1.0, 1.03), C("si", 4, 1, 1.0, 1.0, draft_tree="2")]
    assert autotune.pick_run(chain_and_tree, 0.03).draft_tree is None  # a chain before a tree
    assert autotune.pick_run([C("ar", None, 1, 1.05, 1.05), *chain_and_tree], 0.03).method == "si"  # 5% > 3%


def test_long_windows_are_not_mistaken_for_workers_slowing_each_other_down():
    """A DSI forward over a window of 8 drafts is longer than a one-token forward because of its rows (a slope
    of 2 ms a row here), not because of contention; the same forward with no rows to explain it is."""
    measured = {"DSI auto SP=1": {"target_forward_s": 0.027, "drafter_step_s": 0.001, "mean_window": 8.0},
                f"SI k={autotune.SI_CALIBRATION_K}": {"drafter_step_s": 0.001}}
    assert "slow each other down" not in autotune._why_dsi_loses(measured, 1, 0.4, 0.010, slope=0.002)
    assert "right only 40%" in autotune._why_dsi_loses(measured, 1, 0.4, 0.010, slope=0.002)
    assert "slow each other down" in autotune._why_dsi_loses(measured, 1, 0.4, 0.010, slope=0.0)
