"""Speculation chosen by load (dsi.server.load_choice): the chooser's rule on given measurements, and a server whose
slots pick per request, on synthetic models whose speculation is far slower or far faster than plain decoding."""

from __future__ import annotations

import pytest

from dsi.server.load_choice import (BURST_S, CLEAR_GAP, EXPLORE_EVERY, HANDOFF_MARGIN, HANDOFF_MIN_BURSTS,
                                    HANDOFF_MIN_REMAINING, HANDOFF_MIN_TOKENS, MIN_SAMPLES, PLAIN, SPECULATIVE,
                                    LoadChooser, SegmentClock, level_label, level_of)

IN_TURN = [SPECULATIVE, PLAIN] * MIN_SAMPLES  # how a level measures the two ways first


def test_levels_group_the_running_requests_by_powers_of_two():
    assert [level_of(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 32)] == [1, 1, 2, 4, 4, 8, 8, 16, 32]
    assert [level_label(level_of(n)) for n in (1, 2, 3, 7, 20)] == ["1", "2", "3-4", "5-8", "17-32"]


def feed(chooser: LoadChooser, running: int, rates: dict[str, float], count: int) -> list[str]:
    """``count`` requests at ``running``, each way giving its rate (tokens per second); the ways picked."""
    picked = []
    for _ in range(count):
        pick = chooser.choose(running)
        chooser.record_rate(pick.way, pick.level, 100, 100 / rates[pick.way])
        picked.append(pick.way)
    return picked


def test_each_way_is_measured_at_a_level_then_the_faster_one_runs():
    chooser = LoadChooser()
    picked = feed(chooser, 1, {SPECULATIVE: 14.0, PLAIN: 10.0}, 2 * MIN_SAMPLES + 5)
    assert picked[:2 * MIN_SAMPLES] == IN_TURN
    assert picked[2 * MIN_SAMPLES:] == [SPECULATIVE] * 5
    # another level is measured on its own (speculation led below it), and there plain decoding is faster
    picked = feed(chooser, 6, {SPECULATIVE: 8.0, PLAIN: 10.0}, 2 * MIN_SAMPLES + 5)
    assert picked[:2 * MIN_SAMPLES] == IN_TURN and picked[2 * MIN_SAMPLES:] == [PLAIN] * 5
    snapshot = chooser.snapshot()
    assert snapshot["1"][SPECULATIVE]["rate"] == pytest.approx(14.0) and snapshot["5-8"][PLAIN]["rate"] == 10.0
    assert feed(chooser, 1, {SPECULATIVE: 14.0, PLAIN: 10.0}, 1) == [SPECULATIVE]  # the first level kept its own


def test_a_way_measured_once_far_behind_is_not_measured_twice():
    chooser = LoadChooser()
    picked = feed(chooser, 1, {SPECULATIVE: 10.0, PLAIN: 10.0 * CLEAR_GAP}, 2 * MIN_SAMPLES)
    assert picked == [SPECULATIVE, PLAIN, PLAIN, PLAIN]
    close = LoadChooser()  # a closer call is measured MIN_SAMPLES times each way
    assert feed(close, 1, {SPECULATIVE: 10.0, PLAIN: 10.0 * CLEAR_GAP * 0.95}, 2 * MIN_SAMPLES) == IN_TURN


@pytest.mark.parametrize("gap", [1.5, 3.0])
def test_the_losing_way_is_tried_again_less_often_the_further_it_is_behind(gap):
    chooser = LoadChooser()
    feed(chooser, 1, {SPECULATIVE: 10.0, PLAIN: 10.0 * gap}, 2 * MIN_SAMPLES)
    every = round(EXPLORE_EVERY * gap ** 2)
    picked = feed(chooser, 1, {SPECULATIVE: 10.0, PLAIN: 10.0 * gap}, 3 * every)
    tried = [i for i, way in enumerate(picked) if way == SPECULATIVE]
    assert len(tried) == 3 and tried[0] < every and tried[1] - tried[0] == tried[2] - tried[1] == every


def test_a_way_that_gets_faster_takes_over_after_it_is_tried_again():
    chooser = LoadChooser(explore_every=2)
    feed(chooser, 1, {SPECULATIVE: 10.0, PLAIN: 20.0}, 2 * MIN_SAMPLES)
    picked = feed(chooser, 1, {SPECULATIVE: 100.0, PLAIN: 20.0}, 40)  # acceptance rose: speculation pays now
    assert picked[-5:] == [SPECULATIVE] * 5


def test_above_a_level_where_plain_decoding_led_speculation_is_not_measured_first():
    """Speculation's gain only shrinks as load grows: a level above one where plain decoding measured faster starts
    plainly, and tries speculation at the exploration rate of the lower level's gap; below, nothing is presumed."""
    chooser = LoadChooser()
    feed(chooser, 2, {SPECULATIVE: 5.0, PLAIN: 10.0}, 2 * MIN_SAMPLES)  # level 2: plain decoding 2x faster
    every = round(EXPLORE_EVERY * 2.0 ** 2)
    first = chooser.choose(5)
    assert first.way == PLAIN and "lower level measured plain decoding 2.00x faster" in first.reason
    chooser.record_rate(first.way, first.level, 100, 10.0)
    picked = [first.way] + feed(chooser, 5, {SPECULATIVE: 2.0, PLAIN: 10.0}, every + 2)
    # plain decoding measured first (MIN_SAMPLES requests), then speculation tried at the every-th request after
    assert picked[:MIN_SAMPLES] == [PLAIN] * MIN_SAMPLES and picked.index(SPECULATIVE) == MIN_SAMPLES + every - 1
    assert feed(chooser, 1, {SPECULATIVE: 14.0, PLAIN: 10.0}, 2 * MIN_SAMPLES) == IN_TURN  # below: measured
    # where speculation led below, a higher level measures both first
    other = LoadChooser()
    feed(other, 1, {SPECULATIVE: 14.0, PLAIN: 10.0}, 2 * MIN_SAMPLES)
    assert feed(other, 2, {SPECULATIVE: 14.0, PLAIN: 10.0}, 2 * MIN_SAMPLES) == IN_TURN


def test_a_segment_slower_than_the_other_way_is_handed_over():
    chooser = LoadChooser()
    feed(chooser, 1, {SPECULATIVE: 30.0, PLAIN: 10.0}, 2 * MIN_SAMPLES)
    enough, left = HANDOFF_MIN_TOKENS, HANDOFF_MIN_REMAINING
    slow = 10.0 / (1 + HANDOFF_MARGIN) * 0.9  # plain decoding's average beats it by more than the margin
    reason = chooser.handoff(SPECULATIVE, 1, enough, slow, left)
    assert reason is not None and "plain measured 10.00 tok/s at level 1" in reason
    assert chooser.handoff(SPECULATIVE, 1, enough, 10.0, left) is None  # within the margin
    assert chooser.handoff(SPECULATIVE, 1, enough - 1, slow, left) is None  # too few tokens to tell
    assert chooser.handoff(SPECULATIVE, 1, enough, slow, left - 1) is None  # too little left to pay a prefill
    assert chooser.handoff(SPECULATIVE, 1, enough, None, left) is None
    assert chooser.handoff(SPECULATIVE, 1, 4 * enough, slow, left, bursts=HANDOFF_MIN_BURSTS - 1) is None  # windows
    assert chooser.handoff(SPECULATIVE, 3, enough, slow, left) is None  # nothing measured at level 3-4
    # plain decoding at a level where speculation measured faster (the load fell) goes on speculating
    assert "speculative measured 30.00 tok/s" in chooser.handoff(PLAIN, 1, enough, 10.0, left)


def test_a_segment_clock_leaves_out_its_first_burst():
    clock = SegmentClock()
    clock.tick(1, now=10.0)  # the prefill's token, or a first window decided at once
    clock.tick(3, now=10.0 + BURST_S / 2)
    assert clock.rate is None and clock.decoded == 0
    clock.tick(2, now=11.0)
    clock.tick(1, now=12.0)
    clock.tick(1, now=12.0 + BURST_S / 2)  # the same window's commit
    assert clock.decoded == 4 and clock.count == 8 and clock.bursts == 2
    assert clock.rate == pytest.approx(4 / 2.0)


def test_by_default_speculation_is_chosen_by_load_in_process_and_not_over_engines():
    from dsi.server import ServeConfig

    assert ServeConfig(method="si").chooses_by_load and ServeConfig(method="auto").chooses_by_load
    assert not ServeConfig(method="dsi", target_servers=("http://127.0.0.1:1/v1",)).chooses_by_load
    assert ServeConfig(method="dsi", target_servers=("http://127.0.0.1:1/v1",), speculation_by_load=True).chooses_by_load
    assert not ServeConfig(method="si", speculation_by_load=False).chooses_by_load
    assert not ServeConfig(method="ar", speculation_by_load=True).chooses_by_load  # nothing to choose
    with pytest.raises(Exception, match="speculation_by_load='yes' must be True, False or None"):
        ServeConfig(method="si", speculation_by_load="yes")


def test_requests_too_short_to_show_a_rate_are_not_counted():
    chooser = LoadChooser()
    pick = chooser.choose(1)
    chooser.record_rate(pick.way, pick.level, 1, 0.5)  # one token
    chooser.record_rate(pick.way, pick.level, 10, 0.0)
    assert chooser.snapshot()["1"][SPECULATIVE]["samples"] == 0
    assert chooser.choose(1).way == SPECULATIVE  # still measuring it


def test_picks_say_why():
    chooser = LoadChooser()
    first = chooser.choose(3)
    assert first.as_dict()["level"] == "3-4" and first.as_dict()["running"] == 3 and "measuring" in first.reason
    feed(chooser, 3, {SPECULATIVE: 5.0, PLAIN: 10.0}, 2 * MIN_SAMPLES)
    later = chooser.choose(3)
    assert later.way == PLAIN and "2.00x" in later.reason and later.as_dict()["rates"][PLAIN] == 10.0


# ---- a server whose slots choose by load ----------------------------------------------------------------------

pytest.importorskip("torch")
pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")

from dsi.models import WithLatency  # noqa: E402
from tests.tiny_hf import CORPUS  # noqa: E402
from tests.unit.server.conftest import SENTINEL, TokenizerCodec, running_server, scripted_lm  # noqa: E402

TEXT = CORPUS[0]


def serve(tok, *, typo_every: int, target_s: float, drafter_s: float, by_load: bool = True):
    from dsi.server import ServeConfig, create_app

    script = tok.encode(TEXT)
    vocab, eos = len(tok), tok.eos_token_id
    target = WithLatency(scripted_lm(script, vocab, eos, cycle=True), target_s, target_s)  # ttft, tpot
    drafter = WithLatency(scripted_lm(script, vocab, eos, cycle=True, typo_every=typo_every), drafter_s, drafter_s)
    config = ServeConfig(method="si", lookahead=3, max_concurrent=1, model_name="scripted", temperature=0.0,
                         speculation_by_load=by_load)
    return create_app(target, drafter, config, codec=TokenizerCodec(tok))


def ask(url: str, n: int, tokens: int = 12, **fields) -> list[dict]:
    answers = []
    for _ in range(n):
        r = httpx.post(url + "/v1/completions", json={"model": "scripted", "prompt": "x", "max_tokens": tokens,
                                                      **fields}, timeout=60)
        assert r.status_code == 200, r.text
        answers.append(r.json())
    return answers


@pytest.mark.hf
@pytest.mark.parametrize("case, typo_every, target_s, drafter_s, expected", [
    ("every draft wrong, a slow drafter", 1, 0.002, 0.02, PLAIN),  # SI: 3 slow drafts for each token
    ("every draft right, a slow target", 0, 0.03, 0.0005, SPECULATIVE),  # SI: 4 tokens a target forward
])
def test_a_server_runs_each_request_the_way_measured_faster_with_the_same_output(tiny_tokenizer, case, typo_every,
                                                                                  target_s, drafter_s, expected):
    with running_server(serve(tiny_tokenizer, typo_every=typo_every, target_s=target_s, drafter_s=drafter_s)) as s:
        answers = ask(s.url, 2 * MIN_SAMPLES + 2)
        metrics = httpx.get(s.url + "/metrics", timeout=10).text
    texts = {a["choices"][0]["text"] for a in answers}
    assert len(texts) == 1  # greedy: every way gives the same text
    loads = [a["dsi"]["load"] for a in answers]
    ways = [load["way"] for load in loads]
    # measured in turn; the slower way, clearly behind after one request, is not measured twice
    assert ways[:2] == [SPECULATIVE, PLAIN] and ways[2:] == [expected] * (len(ways) - 2), (case, loads)
    assert not any(load["handoffs"] for load in loads)  # 12 tokens: too short to hand over
    methods = [a["dsi"]["method"] for a in answers]
    assert all(m == ("ar" if w == PLAIN else "si") for m, w in zip(methods, ways, strict=True))
    assert all(load["level"] == "1" and load["running"] == 1 for load in loads)
    assert f'dsi_load_choices_total{{level="1",way="{expected}"}} {len(ways) - 1}.0' in metrics


@pytest.mark.hf
def test_speculation_slower_than_plain_decoding_hands_the_request_over_with_the_same_text(tiny_tokenizer):
    """Speculation measured faster (on other prompts), then every draft wrong and a slow drafter: the requests
    start speculating and go on plainly after a few tokens; the text is the same as plain decoding's."""
    app = serve(tiny_tokenizer, typo_every=1, target_s=0.002, drafter_s=0.02)
    chooser = app.state.dsi.chooser
    feed(chooser, 1, {SPECULATIVE: 1000.0, PLAIN: 300.0}, 2 * MIN_SAMPLES)  # what earlier requests measured
    with running_server(app) as s:
        answers = ask(s.url, 2, tokens=40, logprobs=1)
        metrics = httpx.get(s.url + "/metrics", timeout=10).text
    from dsi.server import ServeConfig, create_app

    script = tiny_tokenizer.encode(TEXT)
    target = scripted_lm(script, len(tiny_tokenizer), tiny_tokenizer.eos_token_id, cycle=True)
    with running_server(create_app(target, None, ServeConfig(method="ar", model_name="scripted", temperature=0.0),
                                   codec=TokenizerCodec(tiny_tokenizer))) as s:
        answers += ask(s.url, 1, tokens=40, logprobs=1)
    assert len({a["choices"][0]["text"] for a in answers}) == 1
    assert all(a["usage"]["completion_tokens"] == 40 for a in answers)
    # logprobs of both segments, the same as plain decoding's
    assert len({tuple(a["choices"][0]["logprobs"]["tokens"]) for a in answers}) == 1
    assert all(len(a["choices"][0]["logprobs"]["token_logprobs"]) == 40 for a in answers)
    for answer in answers[:2]:
        assert answer["dsi"]["load"]["way"] == SPECULATIVE
        [handoff] = answer["dsi"]["load"]["handoffs"]
        assert handoff["to"] == PLAIN and HANDOFF_MIN_TOKENS < handoff["at"] <= 40 - HANDOFF_MIN_REMAINING
        assert "this request's speculative decoding" in handoff["reason"]
        assert answer["dsi"]["method"] == "si" and answer["dsi"]["drafted_tokens"] > 0
    assert 'dsi_load_handoffs_total{to="plain"} 2.0' in metrics


@pytest.mark.hf
def test_plain_decoding_goes_on_speculating_when_the_load_falls(tiny_tokenizer):
    """A request started plainly at a level where plain decoding measured faster goes on speculating once the
    running requests fall to a level where speculation measured faster: the same greedy tokens, the drafts counted."""
    from dsi.engine.api import build_decoder, make_request
    from dsi.server.load_choice import LoadChosenDecoder

    script = tiny_tokenizer.encode(TEXT)
    vocab, eos = len(tiny_tokenizer), tiny_tokenizer.eos_token_id
    target = WithLatency(scripted_lm(script, vocab, eos, cycle=True), 0.02, 0.02)
    drafter = WithLatency(scripted_lm(script, vocab, eos, cycle=True), 0.0005, 0.0005)
    chooser = LoadChooser()
    feed(chooser, 1, {SPECULATIVE: 200.0, PLAIN: 50.0}, 2 * MIN_SAMPLES)
    feed(chooser, 2, {SPECULATIVE: 10.0, PLAIN: 50.0}, 2 * MIN_SAMPLES)
    measured = chooser.snapshot()["1"][SPECULATIVE]["samples"]
    running = iter([2])  # two requests when it starts, one (this) from then on
    plain = build_decoder(target=target, method="ar")
    decoder = LoadChosenDecoder(build_decoder(target=target, drafter=drafter, method="si", lookahead=3), plain,
                                chooser, lambda: next(running, 1))
    request = make_request([SENTINEL], 30, None, None, vocab)
    try:
        chosen = decoder.generate(request)
        reference = plain.generate(request)
    finally:
        decoder.close()
    assert chosen.tokens == reference.tokens and len(chosen.tokens) == 30
    load = chosen.stats.extra["load"]
    assert load["way"] == PLAIN and load["level"] == "2"
    [handoff] = load["handoffs"]
    assert handoff["to"] == SPECULATIVE and "speculative measured" in handoff["reason"]
    assert chosen.stats.method == "ar" and chosen.stats.accepted_tokens > 0  # the counters of both segments
    assert chosen.stats.new_tokens == 30 and chosen.stats.finish_reason == "length"
    assert chooser.snapshot()["1"][SPECULATIVE]["samples"] == measured + 1  # its speculative part measured


@pytest.mark.hf
def test_without_the_option_every_request_speculates(tiny_tokenizer):
    with running_server(serve(tiny_tokenizer, typo_every=1, target_s=0.0, drafter_s=0.0, by_load=False)) as s:
        answers = ask(s.url, 2 * MIN_SAMPLES + 1, tokens=4)
    assert all(a["dsi"]["method"] == "si" and a["dsi"]["load"] is None for a in answers)


@pytest.mark.hf
def test_a_seeded_request_runs_the_configured_way_whatever_the_load(tiny_tokenizer):
    """A seed gives the tokens a server without the option gives, however many requests ran before (lm-eval's
    scores must not depend on request order); unseeded sampled requests are chosen by load."""

    def sampled(url: str, seeds: list[int | None]) -> list[dict]:
        return [httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "scripted", "prompt": "x", "max_tokens": 10, "temperature": 2.0,
            **({} if seed is None else {"seed": seed})}).json() for seed in seeds]

    seeds = list(range(2 * MIN_SAMPLES + 2))
    timing = dict(typo_every=3, target_s=0.002, drafter_s=0.005)  # plain decoding measures faster
    with running_server(serve(tiny_tokenizer, **timing)) as s:
        unseeded = sampled(s.url, [None] * (2 * MIN_SAMPLES + 2))
        chosen = sampled(s.url, seeds)
        metrics = httpx.get(s.url + "/metrics", timeout=10).text
    with running_server(serve(tiny_tokenizer, **timing, by_load=False)) as s:
        speculative = sampled(s.url, seeds)
    from dsi.server import ServeConfig, create_app

    script = tiny_tokenizer.encode(TEXT)
    target = scripted_lm(script, len(tiny_tokenizer), tiny_tokenizer.eos_token_id, cycle=True)
    plain_app = create_app(target, None, ServeConfig(method="ar", model_name="scripted"),
                           codec=TokenizerCodec(tiny_tokenizer))
    with running_server(plain_app) as s:
        plain = sampled(s.url, seeds)
    assert PLAIN in [a["dsi"]["load"]["way"] for a in unseeded]  # without a seed, the load chooses
    texts = {way: [a["choices"][0]["text"] for a in answers]
             for way, answers in ((SPECULATIVE, speculative), (PLAIN, plain))}
    assert texts[SPECULATIVE] != texts[PLAIN]  # the two ways draw differently: the check below can tell them apart
    assert [a["choices"][0]["text"] for a in chosen] == texts[SPECULATIVE]
    assert all(a["dsi"]["load"]["way"] == SPECULATIVE and a["dsi"]["load"]["level"] == "seeded" for a in chosen)
    assert f'dsi_load_choices_total{{level="seeded",way="speculative"}} {len(seeds)}.0' in metrics


@pytest.mark.hf
def test_dsi_serve_takes_the_option_and_a_non_si_server_has_nothing_to_choose(tiny_pair, monkeypatch):
    from starlette.testclient import TestClient

    from dsi.server.load_choice import LoadChosenDecoder
    from tests.unit.server.test_cli_serve import captured_serve

    app = captured_serve(monkeypatch, tiny_pair, "--method", "si", "-k", "2", "--speculation-by-load", "on")
    assert app.state.dsi.config.speculation_by_load and app.state.dsi.chooser is not None
    with TestClient(app) as client:
        answer = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0}).json()
        assert isinstance(app.state.dsi.scheduler.slots[0].decoder, LoadChosenDecoder)
    assert answer["dsi"]["load"]["way"] == SPECULATIVE  # the first requests measure speculation
    plain = captured_serve(monkeypatch, tiny_pair, "--method", "ar", "--speculation-by-load", "on")
    assert plain.state.dsi.chooser is None
    with TestClient(plain) as client:
        answer = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0}).json()
    assert answer["dsi"]["method"] == "ar" and answer["dsi"]["load"] is None


@pytest.mark.hf
def test_the_model_card_shows_what_each_way_measured_at_each_level(tiny_tokenizer):
    # forwards of 10 ms: a segment's commits after its first burst come later (what its rate is measured on)
    with running_server(serve(tiny_tokenizer, typo_every=0, target_s=0.01, drafter_s=0.0)) as s:
        ask(s.url, 3, tokens=12)
        card = httpx.get(s.url + "/v1/models", timeout=10).json()["data"][0]["dsi"]
    measured = card["speculation_by_load"]["1"]
    assert measured[SPECULATIVE]["samples"] == 2 and measured[PLAIN]["samples"] == 1
    assert measured[SPECULATIVE]["rate"] > 0 and measured[PLAIN]["rate"] > 0
