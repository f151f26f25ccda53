"""Property tests of the public Python API (hypothesis): what a new user's arbitrary arguments get.

Issue 64's fuzzing of the Python API found entry points that crashed instead of refusing (a ``logit_bias`` key
``"²"``, a 5,000-digit key, a decoder's hand-made request) and none that broke losslessness. Kept here, bounded
and derandomized:

- any request arguments, hostile ones mixed in (unicode digits, huge integers, NaN, wrong types), either make a
  request or raise :class:`~dsi.errors.ConfigError` naming the bad value, from :func:`dsi.make_request` and from
  a built decoder alike, never another exception;
- valid requests on a small pair: greedy DSI and SI give non-SI's tokens, and a seeded sampled request gives
  the same tokens on DSI with 1 and 3 servers and when sent again to the same decoder.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dsi
from dsi.errors import ConfigError
from dsi.models import synthetic_pair

VOCAB = 24
PROPERTY = settings(max_examples=60, deadline=None, derandomize=True, database=None)

# (an integer of over 4,300 digits, which has no repr, is tested apart: hypothesis reports examples by their repr)
HOSTILE_NUMBERS = [0, -1, 1, 5, VOCAB, VOCAB - 1, 10**30, -(10**30), 10**400, 1.5, math.nan, math.inf, True, None,
                   "5", "²", "٥", "1" * 5000, [], {}]
hostile = st.sampled_from(HOSTILE_NUMBERS)
ids = st.one_of(st.integers(0, VOCAB - 1), hostile)
bias_keys = st.one_of(st.integers(0, VOCAB - 1), st.integers(0, VOCAB - 1).map(str),
                      st.sampled_from(["²", "٥", " 5", "-1", "1" * 5000, "0x1", "1_0"]), hostile)


@st.composite
def request_arguments(draw) -> dict:
    """Arguments of :func:`dsi.make_request`, valid or not."""
    sampling = draw(st.one_of(
        st.none(),
        st.builds(dict, temperature=st.one_of(st.sampled_from([0.0, 0.7, 1.0]), hostile),
                  seed=st.one_of(st.integers(0, 2**63 - 1), hostile),
                  logit_bias=st.dictionaries(bias_keys, st.one_of(st.floats(-100, 100), hostile), max_size=3)
                  .filter(lambda d: all(isinstance(k, int | str) for k in d)),
                  stop_token_ids=st.lists(ids, max_size=2)),
    ))
    return dict(prompt=draw(st.one_of(st.lists(ids, max_size=5), hostile)),
                max_new_tokens=draw(st.one_of(st.integers(1, 6), hostile)),
                sampling=sampling,
                eos_token_id=draw(st.one_of(st.none(), ids, st.lists(ids, max_size=2))),
                logprobs=draw(st.one_of(st.none(), st.integers(0, 3), hostile)),
                logprobs_mode=draw(st.sampled_from(["raw", "processed", "bogus", 3])))


def _request(arguments: dict) -> dsi.Request:
    sampling = arguments["sampling"]
    if isinstance(sampling, dict):
        sampling = dsi.SamplingParams(**sampling)
    return dsi.make_request(arguments["prompt"], arguments["max_new_tokens"], sampling,
                            arguments["eos_token_id"], VOCAB, arguments["logprobs"], arguments["logprobs_mode"])


@pytest.fixture(scope="module")
def pair():
    return synthetic_pair(0.7, vocab_size=VOCAB, seed=3)


@pytest.fixture(scope="module")
def decoders(pair):
    target, drafter = pair
    built = {"ar": dsi.build_decoder(target=target, method="ar"),
             "dsi": dsi.build_decoder(target=target, drafter=drafter, method="dsi", lookahead=2,
                                      num_target_servers=2)}
    yield built
    for decoder in built.values():
        decoder.close()


@PROPERTY
@given(arguments=request_arguments())
def test_any_request_arguments_make_a_request_or_a_config_error_naming_the_value(arguments, decoders):
    try:
        request = _request(arguments)
    except ConfigError as exc:
        assert str(exc) and len(str(exc)) < 2000  # named, and short even for a 5,000-digit value
        return
    for decoder in decoders.values():  # what make_request accepted, a decoder serves
        result = decoder.generate(request)
        assert 1 <= len(result.tokens) <= request.max_new_tokens
        assert all(0 <= t < VOCAB for t in result.tokens)


@PROPERTY
@given(arguments=request_arguments())
def test_a_decoder_refuses_a_hand_made_request_as_make_request_does(arguments, decoders):
    """The same arguments as a :class:`dsi.Request` built by hand (no check) and sent to a decoder: the same
    ConfigError as :func:`dsi.make_request`'s, or a run."""
    try:
        expected = None
        _request(arguments)
    except ConfigError as exc:
        expected = str(exc)
    sampling = arguments["sampling"]
    if isinstance(sampling, dict):
        try:
            sampling = dsi.SamplingParams(**sampling)
        except ConfigError:
            return  # refused before any request exists
    request = dsi.Request(arguments["prompt"], arguments["max_new_tokens"], sampling, arguments["eos_token_id"],
                          arguments["logprobs"], arguments["logprobs_mode"])
    for decoder in decoders.values():
        if expected is None:
            decoder.generate(request)
        else:
            with pytest.raises(ConfigError) as info:
                decoder.generate(request)
            assert str(info.value) == expected


@PROPERTY
@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6), tokens=st.integers(1, 12),
       seed=st.integers(0, 2**63 - 1), lookahead=st.sampled_from([1, 3, "auto"]))
def test_greedy_speculation_equals_non_si_and_a_seed_gives_the_same_tokens_for_any_sp(pair, prompt, tokens, seed,
                                                                                      lookahead):
    target, drafter = pair
    reference = dsi.generate(target=target, prompt=prompt, max_new_tokens=tokens, method="ar").tokens
    for method in ("si", "dsi"):
        out = dsi.generate(target=target, drafter=drafter, prompt=prompt, max_new_tokens=tokens, method=method,
                           lookahead=3 if method == "si" and lookahead == "auto" else lookahead,
                           num_target_servers=2).tokens
        assert out == reference, method
    sampling = dsi.SamplingParams(temperature=1.0, seed=seed)
    runs = [dsi.generate(target=target, drafter=drafter, prompt=prompt, max_new_tokens=tokens, method="dsi",
                         lookahead=lookahead, num_target_servers=sp, sampling=sampling).tokens for sp in (1, 3)]
    assert runs[0] == runs[1]


HUGE = 10**5000  # no repr: Python refuses to convert an integer of over 4,300 digits to text


@pytest.mark.parametrize("field", ["prompt", "max_new_tokens", "eos_token_id", "logprobs", "bias_key", "bias_value",
                                   "stop_token_ids", "seed", "max_window"])
def test_an_integer_too_long_to_print_is_named_not_a_bare_value_error(field, decoders):
    arguments = dict(prompt=[1, 2], max_new_tokens=3, sampling=None, eos_token_id=None, logprobs=None,
                     logprobs_mode="raw")
    if field == "max_window":
        with pytest.raises(ConfigError, match="max_window=<an integer of 16610 bits>"):
            dsi.DecoderConfig(method="dsi", lookahead="auto", max_window=-HUGE)
        return
    if field in ("bias_key", "bias_value", "stop_token_ids", "seed"):
        sampling = {"bias_key": dict(logit_bias={HUGE: 1.0}), "bias_value": dict(logit_bias={1: HUGE}),
                    "stop_token_ids": dict(stop_token_ids=[HUGE]), "seed": dict(seed=HUGE)}[field]
        arguments["sampling"] = sampling
    else:
        arguments[field] = [1, HUGE] if field == "prompt" else -HUGE if field == "max_new_tokens" else HUGE
    with pytest.raises(ConfigError, match="an integer of 16610 bits"):
        _request(arguments)
