"""``dsi selftest``: passes on a correct engine, fails on deliberately broken ones (so the checks
can fail), and its statistics are right."""

from __future__ import annotations

from dataclasses import replace

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import dsi.engine.dsi as dsi_engine  # noqa: E402
import dsi.engine.si as si_engine  # noqa: E402
from dsi.cli.main import main  # noqa: E402
from dsi.sampling import Decision, Purpose, residual, sample_from, uniform  # noqa: E402
from dsi.evaluate.selftest import chi2_sf, chi_square, read_prompts  # noqa: E402
from tests.tiny_hf import make_model_dir  # noqa: E402

pytestmark = pytest.mark.hf


def perturbed_copy(source, out, noise: float, seed: int = 1):
    """A drafter that is the target with Gaussian noise on every weight (partial acceptance)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(source)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("selftest-models")
    target = make_model_dir(root / "target", seed=0, layers=2)
    drafter = perturbed_copy(target, root / "drafter", noise=0.3)  # acceptance about 0.6
    return str(target), str(drafter)


def selftest(capsys, pair, *extra):
    # random tiny models have nearly flat logits; temperature 0.05 sharpens them so that the
    # acceptance ratios p/q matter (at 1.0, top-4 laws are almost uniform and a biased ratio hides)
    code = main(["selftest", "--target", pair[0], "--drafter", pair[1], "--threads", "1", "--samples", "300",
                 "--temperature", "0.05", "--max-new-tokens", "16", "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


def test_selftest_passes_on_a_correct_engine(capsys, pair):
    code, doc = selftest(capsys, pair)
    assert code == 0 and doc["passed"] and doc["failures"] == []
    names = [c["name"] for c in doc["checks"]]
    assert names == ["greedy SI == non-SI", "greedy DSI == non-SI", "DSI sampling law at prefix 1 (chi-square)",
                     "DSI sampling law at prefix 2 (chi-square)"]
    for check in doc["checks"][2:]:
        d = check["detail"]
        assert d["p_value"] >= 1e-4 and d["impossible_draws"] == 0 and d["support"] >= 4 and d["cells"] >= 2
    assert 0.2 < doc["acceptance_rate"]["dsi sampling"] < 0.95  # drafts are both accepted and rejected
    assert 0.2 < doc["acceptance_rate"]["dsi greedy"] < 1.0
    assert set(doc["speedup_vs_nonsi"]) == {"si", "dsi"} and all(v > 0 for v in doc["speedup_vs_nonsi"].values())


def always_accept(laws, row, draft, q, params, position):
    return Decision(draft, True)


def biased_accept(laws, row, draft, q, params, position):
    """Accepts with probability min(1, 2 p/q) instead of min(1, p/q): a subtler bug. (It rejects only where the
    right test rejects too, so the target server, which decides with the right test, sent the row's law.)"""
    if uniform(params.seed, position, Purpose.ACCEPT) < 2.0 * laws.prob(row, draft) / q[draft]:
        return Decision(draft, True)
    return Decision(sample_from(residual(laws[row], q), uniform(params.seed, position, Purpose.RESIDUAL)), False)


# always_accept is the grosser bug (biased_accept fails the same checks): slow suite only
@pytest.mark.parametrize("broken", [pytest.param(always_accept, marks=pytest.mark.slow), biased_accept])
def test_selftest_fails_when_dsi_acceptance_is_biased(capsys, pair, monkeypatch, broken):
    monkeypatch.setattr(dsi_engine, "decide_row", broken)  # only DSI's sampling path calls it
    code, doc = selftest(capsys, pair)
    assert code == 1 and not doc["passed"]
    checks = {c["name"]: c for c in doc["checks"]}
    assert checks["greedy DSI == non-SI"]["passed"]  # greedy does not go through decide in DSI
    failed = [c for c in doc["checks"] if not c["passed"]]
    assert failed and all("chi-square" in c["name"] for c in failed)
    assert any(c["detail"]["p_value"] < 1e-4 or c["detail"]["impossible_draws"] for c in failed)


def test_selftest_fails_when_si_greedy_is_wrong(capsys, pair, monkeypatch):
    # SI then keeps every greedy draft, even wrong ones
    monkeypatch.setattr(si_engine, "decide_greedy", lambda target_token, draft: Decision(int(draft), True))
    code = main(["selftest", "--target", pair[0], "--drafter", pair[1], "--threads", "1", "--positions", "0",
                 "--max-new-tokens", "16"])
    out = capsys.readouterr().out
    assert code == 1
    assert "✗  greedy SI == non-SI" in out and "✓  greedy DSI == non-SI" in out
    assert "selftest: FAILED (greedy SI == non-SI)" in out and "differ, first: prompt" in out


def test_chi2_survival_function_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 5, 15, 40):
        for x in (0.01, 0.5, 3.0, 15.0, 60.0, 150.0):
            assert chi2_sf(x, df) == pytest.approx(stats.chi2.sf(x, df), rel=1e-9, abs=1e-300)


def test_chi_square_pools_small_cells_and_flags_impossible_draws():
    from collections import Counter

    law = {(0,): 0.5, (1,): 0.45, (2,): 0.05}
    result = chi_square(Counter({(0,): 50, (1,): 45, (2,): 5}), law, 100)
    assert result["statistic"] == pytest.approx(0.0) and result["p_value"] == pytest.approx(1.0)
    assert result["cells"] == 3  # (2,) expects exactly 5: kept
    result = chi_square(Counter({(0,): 50, (1,): 40, (3,): 10}), law, 100)
    assert result["impossible_draws"] == 10


def test_read_prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text('def f():\n\n"def g():\\n    return"\nplain "quoted" words\n', encoding="utf-8")
    assert read_prompts(str(path)) == ["def f():", "def g():\n    return", 'plain "quoted" words']


PROCESSING = ["--presence-penalty", "1.5", "--repetition-penalty", "1.3", "--logit-bias", "5=0.05,9=-0.05"]


@pytest.mark.slow  # 13 s each: CI's slow run (selftest's own law check runs by default)
def test_selftest_checks_the_processed_law_with_penalties_and_bias(capsys, pair):
    code, doc = selftest(capsys, pair, *PROCESSING)
    assert code == 0 and doc["passed"], doc["failures"]
    assert doc["config"]["presence_penalty"] == 1.5 and doc["config"]["logit_bias"] == [[5, 0.05], [9, -0.05]]


@pytest.mark.slow  # 13 s each: CI's slow run (selftest's own law check runs by default)
def test_selftest_fails_when_verification_rows_ignore_the_penalties(capsys, pair, monkeypatch):
    import dsi.transport.server as server

    real = server.process_rows

    def without_the_output(logits, params, tokens, prompt_len, stop_ids=frozenset()):
        return real(logits, params, tokens, len(tokens), stop_ids)  # as if nothing had been generated

    class LawsWithoutTheOutput(server.LazyLaws):  # sampled verifications' laws, processed as they are read
        def __getitem__(self, index):
            self.prompt_len = self.lengths[int(index) % len(self)]  # as if nothing had been generated
            return super().__getitem__(index)

    def reader_without_the_output(reader):  # a chain's reader (sampled, or greedy and processed) that loses it
        class WithoutTheOutput(reader):
            def __call__(self, logits):
                return reader.__call__(replace(self, prompt_len=len(self.tokens)), logits)

        return WithoutTheOutput

    monkeypatch.setattr(server, "process_rows", without_the_output)
    monkeypatch.setattr(server, "LazyLaws", LawsWithoutTheOutput)
    monkeypatch.setattr(server, "ChainRead", reader_without_the_output(server.ChainRead))
    monkeypatch.setattr(server, "GreedyRead", reader_without_the_output(server.GreedyRead))
    code, doc = selftest(capsys, pair, "--presence-penalty", "1.5")  # the rows lose it (repetition would not)
    assert code == 1
    failed = [c["name"] for c in doc["checks"] if not c["passed"]]
    assert any("chi-square" in name for name in failed) or "greedy DSI == non-SI" in failed
