"""Speculation chosen by load (dsi.server.load_choice): the chooser's rule on given measurements, and a server whose
slots pick per request, on synthetic models whose speculation is far slower or far faster than plain decoding."""

from __future__ import annotations

import pytest

from dsi.server.load_choice import EXPLORE_EVERY, MIN_SAMPLES, PLAIN, SPECULATIVE, LoadChooser, level_label, level_of


def test_levels_group_the_running_requests_by_powers_of_two():
    assert [level_of(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 32)] == [1, 1, 2, 4, 4, 8, 8, 16, 32]
    assert [level_label(level_of(n)) for n in (1, 2, 3, 7, 20)] == ["1", "2", "3-4", "5-8", "17-32"]


def feed(chooser: LoadChooser, running: int, rates: dict[str, float], count: int) -> list[str]:
    """``count`` requests at ``running``, each way giving its rate (tokens per second); the ways picked."""
    picked = []
    for _ in range(count):
        pick = chooser.choose(running)
        chooser.record(pick, 100, 100 / rates[pick.way])
        picked.append(pick.way)
    return picked


def test_each_way_is_measured_at_a_level_then_the_faster_one_runs():
    chooser = LoadChooser()
    picked = feed(chooser, 1, {SPECULATIVE: 30.0, PLAIN: 10.0}, 2 * MIN_SAMPLES + 5)
    assert picked[:2 * MIN_SAMPLES] == [SPECULATIVE] * MIN_SAMPLES + [PLAIN] * MIN_SAMPLES
    assert picked[2 * MIN_SAMPLES:] == [SPECULATIVE] * 5
    # another level is measured on its own, and there plain decoding is faster
    picked = feed(chooser, 6, {SPECULATIVE: 4.0, PLAIN: 10.0}, 2 * MIN_SAMPLES + 5)
    assert picked[2 * MIN_SAMPLES:] == [PLAIN] * 5
    snapshot = chooser.snapshot()
    assert snapshot["1"][SPECULATIVE]["rate"] == pytest.approx(30.0) and snapshot["5-8"][PLAIN]["rate"] == 10.0
    assert feed(chooser, 1, {SPECULATIVE: 30.0, PLAIN: 10.0}, 1) == [SPECULATIVE]  # the first level kept its own


@pytest.mark.parametrize("gap", [1.5, 3.0])
def test_the_losing_way_is_tried_again_less_often_the_further_it_is_behind(gap):
    chooser = LoadChooser()
    feed(chooser, 1, {SPECULATIVE: 10.0, PLAIN: 10.0 * gap}, 2 * MIN_SAMPLES)
    every = round(EXPLORE_EVERY * gap ** 2)
    picked = feed(chooser, 1, {SPECULATIVE: 10.0, PLAIN: 10.0 * gap}, 2 * every)
    assert picked.count(SPECULATIVE) == 2 and picked[every - 1] == SPECULATIVE and picked[2 * every - 1] == SPECULATIVE


def test_a_way_that_gets_faster_takes_over_after_it_is_tried_again():
    chooser = LoadChooser(explore_every=2)
    feed(chooser, 1, {SPECULATIVE: 10.0, PLAIN: 20.0}, 2 * MIN_SAMPLES)
    picked = feed(chooser, 1, {SPECULATIVE: 100.0, PLAIN: 20.0}, 40)  # acceptance rose: speculation pays now
    assert picked[-5:] == [SPECULATIVE] * 5


def test_requests_too_short_to_show_a_rate_are_not_counted():
    chooser = LoadChooser()
    pick = chooser.choose(1)
    chooser.record(pick, 1, 0.5)  # one token
    chooser.record(pick, 10, 0.0)
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
from tests.unit.server.conftest import TokenizerCodec, running_server, scripted_lm  # noqa: E402

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


def ask(url: str, n: int, tokens: int = 12) -> list[dict]:
    answers = []
    for _ in range(n):
        r = httpx.post(url + "/v1/completions", json={"model": "scripted", "prompt": "x", "max_tokens": tokens},
                       timeout=60)
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
    assert ways[:2 * MIN_SAMPLES] == [SPECULATIVE] * MIN_SAMPLES + [PLAIN] * MIN_SAMPLES
    assert ways[2 * MIN_SAMPLES:] == [expected] * 2, (case, loads)
    methods = [a["dsi"]["method"] for a in answers]
    assert all(m == ("ar" if w == PLAIN else "si") for m, w in zip(methods, ways, strict=True))
    assert all(load["level"] == "1" and load["running"] == 1 for load in loads)
    assert f'dsi_load_choices_total{{level="1",way="{expected}"}} {2 + MIN_SAMPLES}.0' in metrics


@pytest.mark.hf
def test_without_the_option_every_request_speculates(tiny_tokenizer):
    with running_server(serve(tiny_tokenizer, typo_every=1, target_s=0.0, drafter_s=0.0, by_load=False)) as s:
        answers = ask(s.url, 2 * MIN_SAMPLES + 1, tokens=4)
    assert all(a["dsi"]["method"] == "si" and a["dsi"]["load"] is None for a in answers)


@pytest.mark.hf
def test_seeded_sampling_gives_what_the_way_it_ran_gives_for_that_seed(tiny_tokenizer):
    """Through the switches, a seeded sampled request gives the tokens of a server fixed to the way it ran."""

    def sampled(url: str, seeds: list[int]) -> list[dict]:
        return [httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "scripted", "prompt": "x", "max_tokens": 10, "temperature": 2.0, "seed": seed}).json()
            for seed in seeds]

    seeds = list(range(2 * MIN_SAMPLES + 2))
    timing = dict(typo_every=3, target_s=0.01, drafter_s=0.0005)
    with running_server(serve(tiny_tokenizer, **timing)) as s:
        chosen = sampled(s.url, seeds)
    with running_server(serve(tiny_tokenizer, **timing, by_load=False)) as s:
        speculative = sampled(s.url, seeds)
    from dsi.server import ServeConfig, create_app

    script = tiny_tokenizer.encode(TEXT)
    target = scripted_lm(script, len(tiny_tokenizer), tiny_tokenizer.eos_token_id, cycle=True)
    plain_app = create_app(target, None, ServeConfig(method="ar", model_name="scripted"),
                           codec=TokenizerCodec(tiny_tokenizer))
    with running_server(plain_app) as s:
        plain = sampled(s.url, seeds)
    ways = [a["dsi"]["load"]["way"] for a in chosen]
    assert PLAIN in ways and SPECULATIVE in ways
    texts = {way: [a["choices"][0]["text"] for a in answers]
             for way, answers in ((SPECULATIVE, speculative), (PLAIN, plain))}
    assert texts[SPECULATIVE] != texts[PLAIN]  # the two ways draw differently: the check below can tell them apart
    for i, answer in enumerate(chosen):
        assert answer["choices"][0]["text"] == texts[ways[i]][i], (i, ways[i])


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
    with running_server(serve(tiny_tokenizer, typo_every=0, target_s=0.0, drafter_s=0.0)) as s:
        ask(s.url, 3, tokens=6)
        card = httpx.get(s.url + "/v1/models", timeout=10).json()["data"][0]["dsi"]
    measured = card["speculation_by_load"]["1"]
    assert measured[SPECULATIVE]["samples"] == 2 and measured[PLAIN]["samples"] == 1
    assert measured[SPECULATIVE]["rate"] > 0 and measured[PLAIN]["rate"] > 0
