"""Requests sent to a decoder that stays up are checked where the decoder receives them (issue 64, item 4).

``dsi.Request`` is what every decoder's ``generate`` takes (non-SI, SI, DSI, the one ``method="auto"``
builds, and a choice rebuilt by ``build_chosen_decoder``); ``dsi.make_request`` builds one and checks it at
once. A bad hand-made request gets the ConfigError that ``dsi.generate`` raises for the same arguments, word
for word, before any forward; the decoder then serves the next request.
"""

from __future__ import annotations

import numpy as np
import pytest

import dsi
from dsi.errors import ConfigError
from dsi.evaluate.autotune import AutoChoice
from dsi.models import CallableLM, synthetic_pair
from dsi.models.emulated.synthetic import SyntheticTarget

VOCAB = 50
KINDS = ["ar", "si", "dsi", "chosen"]


class Counting:
    """A next-token function that counts its forwards."""

    def __init__(self, seed: int) -> None:
        self.inner, self.calls = SyntheticTarget(VOCAB, seed), 0

    def __call__(self, context):
        self.calls += 1
        return self.inner(context)


def build(kind: str, target, drafter):
    if kind == "chosen":  # what method="auto" returns, without measuring
        choice = AutoChoice("dsi", "auto", 2, "test", (), {}, 0.8, 16, "key", "now")
        return dsi.api.build_chosen_decoder(choice, target=target, drafter=drafter)
    return dsi.build_decoder(target=target, drafter=None if kind == "ar" else drafter, method=kind,
                             num_target_servers=2, lookahead=2)


# (the arguments as dsi.generate takes them, the same request as a hand-made dsi.Request)
BAD = [
    ({"max_new_tokens": 0}, {"max_new_tokens": 0}),
    ({"max_new_tokens": -1}, {"max_new_tokens": -1}),
    ({"max_new_tokens": 2.5}, {"max_new_tokens": 2.5}),
    ({"sampling": dsi.SamplingParams(logit_bias={53: 100})}, {"sampling": dsi.SamplingParams(logit_bias={53: 100})}),
    ({"sampling": dsi.SamplingParams(stop_token_ids=[50])}, {"sampling": dsi.SamplingParams(stop_token_ids=[50])}),
    ({"sampling": {"temperature": 1}}, {"sampling": {"temperature": 1}}),
    ({"eos_token_id": 60}, {"eos_token_ids": 60}),
    ({"eos_token_id": -1}, {"eos_token_ids": -1}),
    ({"eos_token_id": "2"}, {"eos_token_ids": "2"}),
    ({"logprobs": -1}, {"logprobs": -1}),
    ({"logprobs": VOCAB + 1}, {"logprobs": VOCAB + 1}),
    ({"logprobs": 1.0}, {"logprobs": 1.0}),
    ({"logprobs_mode": "bogus"}, {"logprobs_mode": "bogus"}),
    ({"prompt": []}, {"prompt": ()}),
    ({"prompt": "hello"}, {"prompt": "hello"}),
    ({"prompt": [1, VOCAB]}, {"prompt": (1, VOCAB)}),
    ({"prompt": [-1]}, {"prompt": (-1,)}),
    ({"prompt": [1.5]}, {"prompt": (1.5,)}),
    ({"prompt": None}, {"prompt": None}),
]


def _message(call) -> str:
    with pytest.raises(ConfigError) as info:
        call()
    return str(info.value)


@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_hand_made_request_gets_dsi_generates_error_before_any_forward(kind, no_thread_leak):
    fn, dfn = Counting(0), Counting(1)
    target, drafter = CallableLM(fn, VOCAB), CallableLM(dfn, VOCAB)
    with build(kind, target, drafter) as decoder:
        for generate_args, fields in BAD:
            args = {"prompt": [1, 2], "max_new_tokens": 4} | generate_args
            expected = _message(lambda: dsi.generate(target=target, drafter=None if kind == "ar" else drafter,
                                                     method="ar" if kind == "ar" else "si", **args))
            request = {"prompt": (1, 2), "max_new_tokens": 4} | fields
            assert _message(lambda: decoder.generate(dsi.Request(**request))) == expected, fields
            assert _message(lambda: dsi.make_request(vocab_size=VOCAB, **args)) == expected, generate_args
        assert fn.calls == 0 and dfn.calls == 0, "a bad request reached a model"
        # the decoder serves on, and sampling=None is greedy, as in dsi.generate
        reference = dsi.generate(target=target, prompt=[1, 2], max_new_tokens=6, method="ar").tokens
        assert decoder.generate(dsi.Request([1, 2], 6, sampling=None)).tokens == reference
        assert decoder.generate(dsi.make_request(np.array([1, 2]), 6)).tokens == reference


@pytest.mark.parametrize("kind", KINDS)
def test_a_hand_made_request_ends_where_dsi_generate_ends(kind, no_thread_leak):
    """eos_token_ids (one id or several) and the sampling's stop_token_ids end it; ignore_eos makes EOS ordinary."""
    target, drafter = synthetic_pair(0.8, vocab_size=VOCAB, seed=1)
    free = dsi.generate(target=target, prompt=[1, 2], max_new_tokens=12, method="ar").tokens
    stop = free[4]
    cut = free[: free.index(stop) + 1]
    with build(kind, target, drafter) as decoder:
        for request in (dsi.Request([1, 2], 12, eos_token_ids=stop), dsi.Request([1, 2], 12, eos_token_ids=[stop]),
                        dsi.Request([1, 2], 12, dsi.SamplingParams(stop_token_ids=[stop]))):
            result = decoder.generate(request)
            assert result.tokens == cut and result.stats.finish_reason == "stop", request
        ignored = dsi.Request([1, 2], 12, dsi.SamplingParams(ignore_eos=True), eos_token_ids=stop)
        assert decoder.generate(ignored).tokens == free


def test_make_request_checks_now_and_the_decoder_checks_the_vocabulary_it_did_not_know(no_thread_leak):
    request = dsi.make_request([1, 2], 4, eos_token_id=[7, 3])
    assert request.prompt == (1, 2) and request.eos_token_ids == frozenset({3, 7})
    assert dsi.make_request(request.prompt, 4, vocab_size=VOCAB) == dsi.Request((1, 2), 4)
    far = dsi.make_request([1, 2], 4, eos_token_id=VOCAB + 10)  # no vocabulary given: unknown yet
    target, drafter = synthetic_pair(0.8, vocab_size=VOCAB, seed=1)
    with dsi.build_decoder(target=target, drafter=drafter, num_target_servers=1) as decoder:
        with pytest.raises(ConfigError, match=rf"eos_token_id={VOCAB + 10} must be None, a token id or a list of "
                                              rf"token ids in \[0, {VOCAB}\)"):
            decoder.generate(far)
        with pytest.raises(ConfigError, match="must be a dsi.Request"):
            decoder.generate({"prompt": [1, 2], "max_new_tokens": 4})


@pytest.mark.parametrize("kind", ["ar", "si", "dsi"])
def test_score_checks_its_tokens_and_first_before_any_forward(kind, no_thread_leak):
    fn = Counting(0)
    target, drafter = CallableLM(fn, VOCAB), CallableLM(Counting(1), VOCAB)
    with build(kind, target, drafter) as decoder:
        for tokens, first, message in [([1, VOCAB], 1, rf"tokens\[1\]={VOCAB} is outside the vocabulary"),
                                       ([1, -2], 1, r"tokens\[1\]=-2 is outside"),
                                       ("ab", 1, "must be a sequence of token ids"),
                                       ([1, 2], 0, r"first=0 must be an integer in \[1, len\(tokens\)=2\]"),
                                       ([1, 2], 3, r"first=3 must be"), ([], 1, r"first=1 must be")]:
            with pytest.raises(ConfigError, match=message):
                decoder.score(tokens, first)
        assert fn.calls == 0
        assert decoder.score([1, 2, 3], 2).shape == (2, VOCAB)


def test_the_readmes_decoder_that_stays_up_runs(capsys, no_thread_leak):
    """The README's example of requests sent to a decoder that stays up runs as shown."""
    import re
    import textwrap
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text(encoding="utf-8")
    blocks = [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", readme, re.S)
              if "decoder.generate(" in b]
    assert len(blocks) == 1, "the README shows one decoder that stays up"
    target, drafter = synthetic_pair(0.8, vocab_size=VOCAB, seed=1)
    exec(blocks[0], {"dsi": dsi, "target": target, "drafter": drafter})  # noqa: S102 - the README's own code
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 2 and all(len(eval(line)) == 32 for line in printed)  # noqa: S307 - lists of ids
