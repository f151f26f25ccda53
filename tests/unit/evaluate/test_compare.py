"""dsi.evaluate.compare: running several methods on the same prompts, and where a method departs from non-SI."""

from __future__ import annotations

import numpy as np
import pytest

from dsi.cli.generate import _identical_mark
import dsi.evaluate.compare as compare_module
from dsi.evaluate.compare import MethodConfig, compare, first_divergence
from dsi.models import CallableLM, synthetic_pair


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


def test_compare_shares_a_decoder_between_lookaheads_and_records_each_run(monkeypatch, no_thread_leak):
    """Adjacent configs differing only in k reuse one decoder (its servers start once); each config
    still runs with its own k, and every run's time span and stats are kept."""
    built = []
    real_build = compare_module.build_decoder

    def counting_build(**kwargs):
        built.append((kwargs["method"], kwargs["num_target_servers"]))
        return real_build(**kwargs)

    monkeypatch.setattr(compare_module, "build_decoder", counting_build)
    target, drafter = synthetic_pair(0.8)
    configs = [MethodConfig("ar"), MethodConfig("si", 2), MethodConfig("si", 4),
               MethodConfig("dsi", 2, 2), MethodConfig("dsi", 3, 2), MethodConfig("dsi", 3, 1)]
    results = compare(target, drafter, [[1, 2], [3]], configs, max_new_tokens=12, repeats=2)
    assert built == [("ar", 1), ("si", 1), ("dsi", 2), ("dsi", 1)]
    for runs in results:
        assert list(runs) == ["non-SI", "SI k=2", "SI k=4", "DSI k=2 SP=2", "DSI k=3 SP=2", "DSI k=3 SP=1"]
        for label, run in runs.items():
            assert run.tokens == runs["non-SI"].tokens
            assert len(run.spans) == len(run.all_stats) == 2
            assert all(end > start for start, end in run.spans)
            assert run.all_stats[-1] is run.stats
            if label != "non-SI":
                assert run.stats["lookahead"] == run.config.lookahead


def test_a_decoder_built_for_a_config_warms_up_at_the_timed_length(monkeypatch, no_thread_leak):
    """The first config on new workers must not pay their first long request inside its timed runs
    while a config that inherits the warm workers does not (the H200 run of 2026-12-04: the first
    prompt of every such config ran 1.5-2.5x slower than the others). A decoder built for a config
    generates ``fresh_warmup_tokens`` (the GPU benchmark: the timed length) once before timing; one reused for
    the next config, a short warm-up."""
    untimed = []
    real_build = compare_module.build_decoder

    def recording_build(**kwargs):
        decoder = real_build(**kwargs)
        real_generate = decoder.generate

        def generate(request):
            untimed.append((kwargs["method"], request.max_new_tokens))
            return real_generate(request)

        decoder.generate = generate
        return decoder

    monkeypatch.setattr(compare_module, "build_decoder", recording_build)
    target, drafter = synthetic_pair(0.8)
    configs = [MethodConfig("ar"), MethodConfig("si", 2), MethodConfig("si", 4), MethodConfig("dsi", 3, 2)]
    compare(target, drafter, [[1, 2]], configs, max_new_tokens=12, repeats=1, warmup_tokens=3,
            fresh_warmup_tokens=12)
    # each config: one warm-up, then one timed run of 12
    assert untimed == [("ar", 12), ("ar", 12), ("si", 12), ("si", 12), ("si", 3), ("si", 12),
                       ("dsi", 12), ("dsi", 12)]
    untimed.clear()  # by default (dsi demo, on a CPU) every warm-up is the short one
    compare(target, drafter, [[1, 2]], configs[:2], max_new_tokens=12, repeats=1, warmup_tokens=3)
    assert untimed == [("ar", 3), ("ar", 12), ("si", 3), ("si", 12)]


def test_labels_name_the_transport_when_it_is_not_threads():
    assert MethodConfig("dsi", 3, 2).label == "DSI k=3 SP=2"
    assert MethodConfig("dsi", 3, 2, transport="processes").label == "DSI k=3 SP=2 processes"
    split = MethodConfig("dsi", 3, 2, threads=4, transport="processes", transport_options=(("threads_per_server", 6),))
    assert split.label == "DSI k=3 SP=2 processes t=6 d=4"


class _ThreadsSeen:
    """A model with a ``threads`` setting that records the setting each forward runs with."""

    def __init__(self, model) -> None:
        self.model, self.threads, self.seen = model, None, []

    @property
    def vocab_size(self):
        return self.model.vocab_size

    def new_session(self):
        owner, inner = self, self.model.new_session()

        class Session:
            tokens = property(lambda s: inner.tokens)

            def extend(s, tokens, cancel=None):
                owner.seen.append(owner.threads)
                return inner.extend(tokens, cancel)

            def truncate(s, n):
                inner.truncate(n)

            def close(s):
                inner.close()

        return Session()


def test_a_configs_threads_do_not_leak_into_the_next_one(no_thread_leak):
    """DSI with one thread per worker, then SI with the model's own setting: SI must not inherit
    DSI's single thread (that would slow it down and bias the comparison)."""
    target, drafter = synthetic_pair(0.8)
    target, drafter = _ThreadsSeen(target), _ThreadsSeen(drafter)
    compare(target, drafter, [[1, 2]], [MethodConfig("dsi", 3, 1, threads=1), MethodConfig("si", 3)],
            max_new_tokens=8, warmup_tokens=0)
    assert 1 in target.seen and target.seen[-1] is None  # SI ran last, with the model's own setting
    assert target.threads is None and drafter.threads is None  # restored after the comparison
