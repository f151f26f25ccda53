"""A frozen drafter does not hold a DSI request: past its liveness deadline the request ends with a
clear error, and the decoder's next request runs on a new drafter, with the right tokens."""

from __future__ import annotations

import threading
import time

import pytest

import dsi
from dsi.engine.api import make_request
from dsi.errors import WorkerError
from dsi.models import CallableLM
from dsi.sampling import SamplingParams
from tests.conftest import random_lm

VOCAB = 24


class FreezingDrafter:
    """A drafter whose forwards block (until released) while ``frozen`` is set."""

    def __init__(self, inner: CallableLM) -> None:
        self.inner = inner
        self.frozen = threading.Event()
        self.release = threading.Event()
        self.vocab_size = inner.vocab_size

    def new_session(self):
        outer = self
        session = self.inner.new_session()

        class Session:
            @property
            def tokens(self):
                return session.tokens

            def extend(self, tokens, cancel=None):
                if outer.frozen.is_set():
                    outer.release.wait(60)  # a wedged call: no cancel flag is looked at
                return session.extend(tokens, cancel)

            def truncate(self, length):
                session.truncate(length)

            def close(self):
                session.close()

        return Session()


def test_a_frozen_drafter_ends_the_request_within_its_deadline_and_the_decoder_recovers():
    target = random_lm(VOCAB, 0)
    drafter = FreezingDrafter(random_lm(VOCAB, 1))
    prompt = [1, 2, 3]
    expected = dsi.generate(target=target, prompt=prompt, method="ar", max_new_tokens=12).tokens
    decoder = dsi.build_decoder(target=target, drafter=drafter, method="dsi", lookahead=3, num_target_servers=2,
                                transport_options={"liveness": {"floor_s": 0.3, "factor": 2.0, "unmeasured_s": 0.5}})
    try:
        assert decoder.generate(make_request(prompt, 12, SamplingParams(), None, VOCAB)).tokens == expected
        drafter.frozen.set()
        began = time.monotonic()
        with pytest.raises(WorkerError, match=r"the drafter is frozen: its forward has run .* past its liveness "
                                              r"deadline of 0\.\d s"):
            decoder.generate(make_request(prompt, 12, SamplingParams(), None, VOCAB))
        assert time.monotonic() - began < 5.0
        assert decoder.healthy()  # a server keeps this decoder: the next request replaces the drafter
        drafter.frozen.clear()
        result = decoder.generate(make_request(prompt, 12, SamplingParams(), None, VOCAB))
        assert result.tokens == expected
        assert result.stats.drafted_tokens > 0  # drafted by the new drafter
    finally:
        drafter.release.set()  # the abandoned thread returns, finds itself abandoned and stops
        decoder.close()


def test_slow_drafter_forwards_that_keep_finishing_are_not_frozen():
    """The deadline follows what the drafter has shown it takes: slow but steady is never frozen."""
    from dsi.models.emulated.synthetic import SyntheticTarget

    target = random_lm(VOCAB, 0)
    fn = SyntheticTarget(VOCAB, 1)
    slow = CallableLM(lambda ctx: (time.sleep(0.3), fn(ctx))[1], VOCAB)  # each forward past the 0.2 s floor
    prompt = [1, 2]
    result = dsi.generate(target=target, drafter=slow, prompt=prompt, method="dsi", lookahead=2, max_new_tokens=6,
                          transport_options={"liveness": {"floor_s": 0.2, "factor": 3.0, "unmeasured_s": 1.0}})
    assert result.tokens == dsi.generate(target=target, prompt=prompt, method="ar", max_new_tokens=6).tokens
