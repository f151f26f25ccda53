"""One decoder configuration (:class:`dsi.DecoderConfig`): validated once, immutable, plain data; every
builder takes it, and the keyword arguments of ``dsi.build_decoder`` / ``dsi.generate`` build it."""

from __future__ import annotations

import dataclasses
import json

import pytest

import dsi
from dsi import DecoderConfig
from dsi.engine.api import build_decoder as engine_build_decoder
from dsi.engine.api import make_request
from dsi.engine.config import OPTION_NAMES
from dsi.errors import ConfigError
from dsi.models.emulated.synthetic import synthetic_pair
from dsi.sampling import SamplingParams
from dsi.trees import Dynamic, Widths

BAD = [
    ({"method": "fast"}, "method='fast' must be one of auto, dsi, si, ar"),
    ({"lookahead": 0}, "lookahead=0 must be an integer >= 1 or 'auto'"),
    ({"lookahead": "auto", "method": "si"}, "lookahead='auto' is DSI's event-driven window policy"),
    ({"max_window": 4}, "max_window=4 applies to lookahead='auto' only"),
    ({"num_target_servers": 0}, "num_target_servers=0 must be an integer >= 1"),
    ({"transport": "pigeons"}, "transport='pigeons' must be one of threads, processes, ray"),
    ({"draft_tree": 3.5}, "draft_tree=3.5 must be None, 'off', 'auto'"),
    ({"draft_tree": "auto", "method": "ar"}, "needs a drafter"),
    ({"draft_tree": "auto", "method": "auto"}, "with method='auto': the method choice weighs draft trees"),
    ({"vocab_mode": "tokens"}, "vocab_mode='tokens' must be one of"),
    ({"merges": -1}, "merges=-1 must be 'auto' or an int >= 0"),
    ({"deterministic": "yes"}, "deterministic='yes' must be None, True or False"),
    ({"deterministic": True, "target_servers": ["http://127.0.0.1:1/v1"]}, "deterministic=True cannot hold with "
                                                                           "target_servers"),
    ({"drafter_server": "http://127.0.0.1:1/v1", "method": "ar"}, "with method='ar': non-SI drafts nothing"),
    ({"transport_options": [("liveness", 1)]}, "transport_options=.* must be None or a dict"),
]


@pytest.mark.parametrize("options, message", BAD, ids=[str(o) for o, _ in BAD])
def test_a_bad_option_is_refused_naming_it_in_the_config_and_every_builder(options, message):
    with pytest.raises(ConfigError, match=message):
        DecoderConfig(**options)
    target, drafter = synthetic_pair(0.8)
    with pytest.raises(ConfigError, match=message):
        dsi.build_decoder(target=target, drafter=drafter, **options)
    with pytest.raises(ConfigError, match=message):
        dsi.generate(target=target, drafter=drafter, prompt=[1], max_new_tokens=2, **options)
    if options.get("method") != "auto":
        with pytest.raises(ConfigError, match=message):
            engine_build_decoder(target=target, drafter=drafter, **options)


def test_an_unknown_option_is_refused_naming_the_known_ones():
    target, drafter = synthetic_pair(0.8)
    with pytest.raises(ConfigError, match=r"unknown decoder option\(s\) lookahed; the options are: method, lookahead"):
        dsi.build_decoder(target=target, drafter=drafter, lookahed=3)
    with pytest.raises(ConfigError, match="config=.* must be a dsi.DecoderConfig"):
        dsi.build_decoder(target=target, drafter=drafter, config={"method": "si"})


def test_the_config_is_immutable_and_a_replace_is_validated():
    config = DecoderConfig(method="si", lookahead=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lookahead = 4  # type: ignore[misc]
    options = {"liveness": 5.0}
    placed = config.replace(transport_options=options)
    options["liveness"] = 1.0  # the caller's dict changing later changes nothing
    assert placed.transport_options == {"liveness": 5.0} and config.transport_options is None
    with pytest.raises(ConfigError, match="lookahead='auto' is DSI's"):
        config.replace(lookahead="auto")
    assert DecoderConfig(target_servers=["http://a:1/v1"]).target_servers == ("http://a:1/v1",)
    assert DecoderConfig(method="dsi", draft_tree="auto").tree_shape == Dynamic()


@pytest.mark.parametrize("config", [
    DecoderConfig(),
    DecoderConfig(method="si", lookahead=3, draft_tree="3,2,1", vocab_mode="intersection", merges=2),
    DecoderConfig(method="dsi", lookahead="auto", max_window=6, num_target_servers=3, transport="processes",
                  transport_options={"liveness": {"floor_s": 5.0}}, draft_tree=Widths((2,))),
    DecoderConfig(method="auto", num_target_servers=2, auto_options={"tokens": 16}, deterministic=True),
    DecoderConfig(method="dsi", target_servers=("http://127.0.0.1:8000/v1",), drafter_server="http://h:1/v1"),
])
def test_a_config_travels_as_json_and_comes_back_equal(config):
    data = json.loads(json.dumps(config.to_dict()))
    assert DecoderConfig.from_dict(data) == config
    assert set(data) == set(OPTION_NAMES)


@pytest.mark.parametrize("method", ["ar", "si", "dsi"])
def test_a_config_builds_the_decoder_the_keywords_build(method):
    """Behaviour does not change: the same decoder and tokens from a config as from keyword arguments."""
    target, drafter = synthetic_pair(0.8, seed=4)
    request = make_request([1, 2, 3], 16, SamplingParams(temperature=0.7, seed=3), None, target.vocab_size)
    options = {"method": method, "lookahead": 3, "num_target_servers": 2 if method == "dsi" else None}
    with dsi.build_decoder(target=target, drafter=drafter, **options) as by_keywords:
        expected = by_keywords.generate(request)
    with dsi.build_decoder(target=target, drafter=drafter, config=DecoderConfig(**options)) as by_config:
        got = by_config.generate(request)
    assert type(by_config) is type(by_keywords) and got.tokens == expected.tokens
    # a config with keywords on top: the keywords win
    with dsi.build_decoder(target=target, drafter=drafter, config=DecoderConfig(method="ar"), **options) as mixed:
        assert mixed.method == method


def test_the_server_and_the_cli_hold_their_decoder_options_as_one_config():
    from dsi.cli.generate import decoder_config
    from dsi.cli.main import build_parser
    from dsi.server import ServeConfig

    serve = ServeConfig(method="dsi", lookahead="auto", max_window=4, num_target_servers=3, draft_tree="auto")
    assert serve.decoder == DecoderConfig(method="dsi", lookahead="auto", max_window=4, num_target_servers=3,
                                          draft_tree="auto")
    with pytest.raises(ConfigError, match="max_window=4 applies to lookahead='auto' only"):
        ServeConfig(method="dsi", lookahead=3, max_window=4)
    args = build_parser().parse_args(["generate", "--prompt", "x", "--method", "si", "-k", "4", "--draft-tree", "2"])
    assert decoder_config(args, quiet=True).replace(auto_options=None) == DecoderConfig(
        method="si", lookahead=4, num_target_servers=1, transport_options={}, draft_tree="2")
