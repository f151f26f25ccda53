"""Sampled chain decisions on the model's device (dsi.models.hf.device_laws), on the CPU: the laws torch makes are
the host's (dsi.sampling) within float32 rounding with the same support, the decisions read the same rows and
decide alike, and a tiny Hugging Face target deciding on its device keeps SI's and DSI's output law (seeded
chi-square against the target's law enumerated in float64) and one output per seed for any SP."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dsi.models.hf.device_laws import distribution, greedy_ids, read_chain  # noqa: E402
from dsi.sampling import ChainRead, LazyLaws, Prefix, SamplingParams, process_logits, read_chain_laws  # noqa: E402

PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=50),
    SamplingParams(temperature=1.3, top_p=0.9),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.8, min_p=0.02),
    SamplingParams(temperature=1e-39),  # 1 / T is no float32: divided in float64 (the limit: the argmax)
    SamplingParams(temperature=2.0, min_p=0.1),
]


def rows(seed: int, n: int = 4, vocab: int = 3000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = (rng.standard_normal((n, vocab)) * 3).astype(np.float32)
    out[0, :5] = out[0, :5].max() + 1.0  # ties at the top
    out[1, 7:20] = -np.inf
    out[2, 11] = np.inf  # +inf: all the mass on it
    return out


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", PARAMS, ids=repr)
@pytest.mark.parametrize("seed", range(3))
def test_device_laws_are_the_host_s_within_float32_rounding_with_the_same_support(params, seed, device):
    logits = rows(seed)
    device = distribution(torch.from_numpy(logits).to(device), params).cpu().numpy()
    for j, row in enumerate(logits):
        host = process_logits(row, params)
        np.testing.assert_array_equal(device[j] > 0, host > 0)
        np.testing.assert_allclose(device[j], host, rtol=0, atol=2e-7)
        assert abs(float(device[j].sum(dtype=np.float64)) - 1.0) < 1e-5


def test_a_broken_row_is_refused_on_the_device_too():
    from dsi.errors import ModelError

    from dsi.sampling import GreedyRead

    bad = rows(0)
    bad[3, 5] = np.nan
    bad[1] = -np.inf
    chain = ChainRead((1, 2, 3, 4, 5, 6), SamplingParams(temperature=1.0), 3, frozenset(), (0.5, 0.5, 0.5))
    with pytest.raises(ModelError, match=r"NaN or all -inf logits in rows \[1, 3\] of 4"):
        read_chain(torch.from_numpy(bad), chain)
    with pytest.raises(ModelError, match=r"NaN or all -inf logits in rows \[1, 3\] of 4"):
        greedy_ids(torch.from_numpy(bad), GreedyRead((1, 2, 3, 4, 5, 6), SamplingParams(logit_bias={1: 1.0}), 3))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", PARAMS[:4], ids=repr)
def test_a_chain_decided_on_the_device_reads_the_rows_the_host_reads_and_decides_alike(params, device):
    """Over many seeds (accepts and rejections at every row), the device's ReadLaws give the host's decisions:
    the same accept probabilities (within rounding), the same row read whole, its law within rounding."""
    logits = rows(7, n=5)
    n = len(logits)
    rejected_at = set()
    for seed in range(60):
        rng = np.random.default_rng(seed)
        sampled = replace(params, seed=seed)
        host_laws = [process_logits(row, sampled) for row in logits]
        drafts = tuple(int(rng.choice(len(logits[0]), p=host_laws[j] / host_laws[j].sum(dtype=np.float64)))
                       for j in range(n - 1))
        context = (1, 2, 3) + drafts
        # drafter probabilities up to 3 times the target's: each draft accepted with probability 1/3 to 1
        draft_probs = tuple(float(host_laws[j][x]) * rng.uniform(0.5, 3.0) for j, x in enumerate(drafts))
        host = read_chain_laws(LazyLaws.of_chain(logits, sampled, context, 3), context, draft_probs, sampled)
        tokens, device_read = read_chain(torch.from_numpy(logits).to(device),
                                         ChainRead(context, sampled, 3, frozenset(), draft_probs))
        assert sorted(device_read.laws) == sorted(host.laws), seed
        np.testing.assert_allclose(device_read.accept_probs, host.accept_probs, rtol=1e-5, atol=1e-9)
        [row] = host.laws
        np.testing.assert_allclose(device_read.laws[row], host.laws[row], rtol=0, atol=2e-7)
        np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))
        rejected_at.add(row)
    assert len(rejected_at) >= 3  # rejections at several rows, and chains accepted whole (row n - 1)


def tiny_pair(device_decisions: bool | None, device: str = "cpu", graphs: bool = False):
    """A tiny-vocabulary Llama target (peaked laws) and another as its drafter on ``device``, deciding there or not
    (None: the default, on where the device is a GPU), with CUDA graphs (on the static cache) or not."""
    import transformers

    from dsi.models.hf.model import HFModel
    from dsi.models.hf.forward_plan import ForwardPlan

    models = []
    for seed in (3, 4):
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(vocab_size=5, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          bos_token_id=0, eos_token_id=None, pad_token_id=0)
        model = transformers.LlamaForCausalLM(config).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)
        models.append(model)
    plan = (ForwardPlan("static", cuda_graphs=True, device_decisions=device_decisions) if graphs
            else ForwardPlan(device_decisions=device_decisions))
    return (models[0], HFModel(models[0], device=device, forward_plan=plan),
            HFModel(models[1], device=device, forward_plan=plan))


@pytest.mark.hf
@pytest.mark.usefixtures("one_torch_thread")
def test_a_target_deciding_on_its_device_keeps_the_law_and_one_output_per_seed(monkeypatch, no_thread_leak):
    """SI and DSI with a target that decides its chains on its device (forced on the CPU): the device path runs,
    a seed gives one output for SP 1-3 and both methods' windows, and 600 seeded two-token outputs follow the
    target's exact law (chi-square, alpha 1e-4; the slow suite runs 1200 in tests/integration/test_hf_lossless.py)."""
    import dsi.models.hf.device_laws as device_laws
    import dsi.models.hf.model as hf
    from dsi.sampling import ChainRead

    model, target, drafter = tiny_pair(True)
    assert target.decides_on_device and not tiny_pair(False)[1].decides_on_device
    calls = []
    real = device_laws.read_chain
    monkeypatch.setitem(hf.DEVICE_READERS, ChainRead, lambda rows, chain: calls.append(rows.shape) or real(rows, chain))
    assert_one_output_per_seed_and_the_law(model, target, drafter)
    assert calls and all(shape[1] == 5 for shape in calls)


def assert_one_output_per_seed_and_the_law(model, target, drafter) -> None:
    """Sampled DSI on ``target`` with ``drafter`` gives one output per seed for SP 1-3, and 600 seeded two-token SI
    outputs follow ``model``'s exact law (:func:`assert_two_token_law`), with rejections enough to test residuals."""
    import dsi
    from dsi.engine.api import build_decoder

    params = SamplingParams(temperature=1.0, top_k=4, top_p=0.95, seed=11)
    outs = {tuple(dsi.generate(target=target, drafter=drafter, prompt=(1, 2, 3), max_new_tokens=12, lookahead=3,
                               num_target_servers=sp, sampling=params).tokens) for sp in (1, 2, 3)}
    assert len(outs) == 1
    decoder = build_decoder(target=target, drafter=drafter, method="si", lookahead=2)
    try:
        rejections = assert_two_token_law(model, params, decoder)
    finally:
        decoder.close()
    assert rejections > 600 // 10


def assert_two_token_law(model, params: SamplingParams, decoder, samples: int = 600) -> int:
    """Seeded two-token outputs of ``decoder`` after (1, 2, 3) against ``model``'s exact law under ``params``
    (chi-square, alpha 1e-4; cells expected below 5 pooled); returns the rejections counted."""
    from scipy.stats import chisquare

    from dsi.engine.api import make_request
    from dsi.sampling import Prefix

    prompt = (1, 2, 3)

    def law_of(context):
        with torch.no_grad():
            row = model(torch.tensor([list(context)])).logits[0, -1].double().numpy()
        p = process_logits(row, params, Prefix(context, 3))
        return p / p.sum(dtype=np.float64)

    law = {(a, b): pa * pb for a, pa in enumerate(law_of(prompt)) for b, pb in enumerate(law_of(prompt + (a,)))}
    counts = dict.fromkeys(law, 0)
    rejections = 0
    for seed in range(samples):
        out = decoder.generate(make_request(prompt, 2, replace(params, seed=seed), None, 5))
        counts[tuple(out.tokens)] += 1
        rejections += out.stats.rejections
    keys = [k for k in law if law[k] * samples >= 5]
    observed = np.array([counts[k] for k in keys] + [samples - sum(counts[k] for k in keys)])
    expected = np.array([law[k] for k in keys] + [1 - sum(law[k] for k in keys)]) * samples
    assert chisquare(observed, expected).pvalue > 1e-4, (observed, expected.round(1))
    return rejections


# ---- processed rows: penalties, bias, min_tokens and a constraint ------------------------------------------------

CHARS = [*"0123456789abcdefghij", *'{}":, ']
EOS = len(CHARS)


def processed_params(greedy: bool, constraint: bool = True) -> list[SamplingParams]:
    from dsi.constraints import BoundConstraint, Constraint, TokenTable

    table = TokenTable(tuple(c.encode() for c in CHARS) + (b"",), (EOS,))
    temperature = {} if greedy else dict(temperature=0.9, top_p=0.95)
    cases = [SamplingParams(presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.4, **temperature),
             SamplingParams(logit_bias={3: 2.0, 5: -1.5, 9: 0.25}, min_tokens=6, **temperature)]
    if constraint:
        cases.append(SamplingParams(constraint=BoundConstraint(Constraint.regex("[a-c]+[0-9]{2,4}"), table),
                                    repetition_penalty=1.2, **temperature))
        cases.append(SamplingParams(constraint=BoundConstraint(Constraint.regex("(ab|c)[0-9]+"), table),
                                    **temperature))  # a constraint alone: the rows keep their dtype on the host
    return cases


def processed_rows(seed: int, n: int = 4) -> np.ndarray:
    out = (np.random.default_rng(seed).standard_normal((n, EOS + 1)) * 2).astype(np.float32)
    out[:, 3] = out[:, 7]  # ties between a touched and an untouched id
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", processed_params(greedy=True), ids=repr)
def test_processed_rows_shaped_on_the_device_are_the_host_s_bit_for_bit(params, device, dtype):
    """The host gets a bf16 model's rows as float32 (HFModel._host_rows): the device's shaping of the bf16 rows
    is the host's of those copies."""
    from dsi.models.hf.device_laws import shape_rows
    from dsi.sampling import GreedyRead, greedy_tokens
    from dsi.sampling import shape_rows as host_shape_rows

    for seed in range(5):
        rows_on_device = torch.from_numpy(processed_rows(seed)).to(device, getattr(torch, dtype))
        logits = rows_on_device.float().cpu().numpy()  # what the host path reads
        context = (2, 3, 3, 10, 11, 12 + seed % 3, 3, 14)  # a prompt of 3, an output of 5 (rows: its last 4)
        stops = frozenset({EOS, 5})
        host = host_shape_rows(logits, params, context, 3, stops)
        shaped = shape_rows(rows_on_device, params, context, 3, stops).cpu().numpy()
        np.testing.assert_array_equal(shaped, host.astype(np.float64))
        ids = greedy_ids(rows_on_device, GreedyRead(context, params, 3, stops))
        np.testing.assert_array_equal(ids, greedy_tokens(logits, params, context, 3, stops))


@pytest.mark.parametrize("params", processed_params(greedy=False), ids=repr)
def test_processed_sampled_chains_decided_on_the_device_decide_as_the_host(params):
    logits = processed_rows(1, n=5)
    rows_read = set()
    for seed in range(40):
        rng = np.random.default_rng(seed)
        sampled = replace(params, seed=seed)
        context = (2, 3, 3, 10, 11) + tuple(int(t) for t in rng.integers(0, EOS, 4))
        host = read_chain_laws(LazyLaws.of_chain(logits, sampled, context, 3), context, (0.3,) * 4, sampled)
        _, device = read_chain(torch.from_numpy(logits), ChainRead(context, sampled, 3, frozenset(), (0.3,) * 4))
        assert sorted(device.laws) == sorted(host.laws), seed
        np.testing.assert_allclose(device.accept_probs, host.accept_probs, rtol=1e-5, atol=1e-9)
        [row] = host.laws
        np.testing.assert_allclose(device.laws[row], host.laws[row], rtol=0, atol=2e-7)
        rows_read.add(row)
    assert len(rows_read) >= 2


def test_a_row_with_nothing_possible_fails_on_the_device_with_the_host_s_error():
    from dsi.constraints import BoundConstraint, Constraint, TokenTable
    from dsi.models.hf.device_laws import shape_rows
    from dsi.sampling import NothingAllowed

    table = TokenTable(tuple(c.encode() for c in CHARS) + (b"",), (EOS,))
    params = SamplingParams(constraint=BoundConstraint(Constraint.regex("a[0-9]"), table))
    logits = processed_rows(0, n=1)
    logits[0, CHARS.index("a")] = -np.inf  # the one token the grammar allows first
    for rows in (torch.from_numpy(logits), torch.from_numpy(logits).bfloat16()):
        with pytest.raises(NothingAllowed, match="the regex constraint allows none of the tokens left"):
            shape_rows(rows, params, (1, 2), 2, frozenset())


@pytest.mark.hf
@pytest.mark.usefixtures("one_torch_thread")
def test_processed_greedy_decided_on_the_device_equals_non_si_on_the_host(monkeypatch, no_thread_leak):
    """Greedy SI and DSI with penalties and bias, and with a constraint, on a target that takes its processed
    argmax on its device: token for token non-SI's on the host (the shaped rows are the host's bit for bit)."""
    import dsi
    import dsi.models.hf.device_laws as device_laws
    import dsi.models.hf.model as hf
    from dsi.sampling import GreedyRead
    from dsi.constraints import BoundConstraint, Constraint, TokenTable

    _, target, drafter = tiny_pair(True)
    _, host_target, _ = tiny_pair(False)
    calls = []
    real = device_laws.greedy_ids
    monkeypatch.setitem(hf.DEVICE_READERS, GreedyRead, lambda rows, read: calls.append(1) or real(rows, read))
    table = TokenTable((b"a", b"b", b"c", b"d", b""), (4,))
    for params in (SamplingParams(presence_penalty=0.8, repetition_penalty=1.5, logit_bias={2: 1.0}),
                   SamplingParams(constraint=BoundConstraint(Constraint.regex("[ab]{2,5}c[cd]{1,6}"), table))):
        want = dsi.generate(target=host_target, prompt=(1, 2, 3), method="ar", max_new_tokens=14, sampling=params,
                            eos_token_id=4).tokens
        for method, lookahead, servers in (("si", 3, 1), ("dsi", 3, 2), ("dsi", "auto", 3)):
            out = dsi.generate(target=target, drafter=drafter, prompt=(1, 2, 3), method=method, lookahead=lookahead,
                               num_target_servers=servers, max_new_tokens=14, sampling=params, eos_token_id=4)
            assert out.tokens == want, (params, method, lookahead, servers)
    assert calls


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", PARAMS[:4] + processed_params(greedy=False, constraint=False), ids=repr)
def test_non_si_draws_on_the_device_the_host_s_token(params, device):
    """Non-SI's draw (BonusRead) on the device: the inverse CDF of the device's law at the BONUS uniform, the
    host's token for every seed here (they could part only where a uniform falls within float32 rounding of a
    boundary between two tokens' cumulative mass)."""
    from dsi.models.hf.device_laws import bonus_token
    from dsi.sampling import BonusRead

    logits = processed_rows(2, n=1)
    context = (2, 3, 3, 10, 11, 12)
    for seed in range(200):
        read = BonusRead(context, replace(params, seed=seed), 3, frozenset({EOS}))
        assert bonus_token(torch.from_numpy(logits).to(device), read) == read(logits), seed


@pytest.mark.hf
@pytest.mark.usefixtures("one_torch_thread")
def test_non_si_deciding_on_the_device_keeps_the_law_and_greedy_is_the_host_s(monkeypatch):
    """Non-SI on a target that decides on its device: greedy with penalties token for token the host's; sampled,
    600 seeded two-token outputs follow the exact law (chi-square, alpha 1e-4)."""
    import dsi
    import dsi.models.hf.device_laws as device_laws
    import dsi.models.hf.model as hf
    from dsi.sampling import BonusRead

    model, target, _ = tiny_pair(True)
    _, host_target, _ = tiny_pair(False)
    calls = []
    real = device_laws.bonus_token
    monkeypatch.setitem(hf.DEVICE_READERS, BonusRead, lambda rows, read: calls.append(1) or real(rows, read))
    penalised = SamplingParams(presence_penalty=0.8, repetition_penalty=1.5, logit_bias={2: 1.0})
    assert (dsi.generate(target=target, prompt=(1, 2, 3), method="ar", max_new_tokens=14, sampling=penalised).tokens
            == dsi.generate(target=host_target, prompt=(1, 2, 3), method="ar", max_new_tokens=14,
                            sampling=penalised).tokens)
    params = SamplingParams(temperature=1.0, top_k=4, top_p=0.95, presence_penalty=0.5)
    decoder = dsi.build_decoder(target=target, method="ar")
    try:
        assert_two_token_law(model, params, decoder)
    finally:
        decoder.close()
    assert len(calls) >= 2 * 600


# ---- a drafter's draws on its device ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", PARAMS[:4] + processed_params(greedy=False, constraint=False)
                         + processed_params(greedy=True, constraint=False), ids=repr)
def test_a_drafter_draws_on_its_device_the_host_s_draft(params, device):
    """A drafter's row read on its device (DraftRead): greedy, the host's processed argmax and no law; sampled,
    the host's token at the DRAFT uniform for every seed here, its probability as the law left on the device
    gives it, and that law within float32 rounding of the host's with the same support."""
    from dsi.models.hf.device_laws import DeviceLaw, draft
    from dsi.sampling import DraftRead

    logits = processed_rows(4, n=2)
    context = (2, 3, 3, 10, 11, 12)
    rows = torch.from_numpy(logits).to(device)
    drafted = set()
    for seed in range(200 if not params.greedy else 1):
        read = DraftRead(context, replace(params, seed=seed), 3, frozenset({EOS}))
        token, q = draft(rows, read)
        want, want_q = read(logits)
        assert token == want, seed
        drafted.add(token)
        if params.greedy:
            assert q is None and want_q is None
            continue
        assert isinstance(q, DeviceLaw) and q.shape == want_q.shape
        law = np.asarray(q)
        assert q[token] == law[token] > 0 and law.dtype == np.float32
        assert np.array_equal(law > 0, want_q > 0)
        np.testing.assert_allclose(law, want_q, rtol=0, atol=2e-7)
    assert params.greedy or len(drafted) >= 2  # the uniforms reach several tokens


def test_sampled_draws_and_chains_on_the_device_read_their_numbers_in_the_fewest_transfers(monkeypatch):
    """On a GPU, each read of device numbers on the host waits for every kernel queued before it, and one number
    read at a time (``bool(t)``, ``int(t)``, ``law[token]``) is a wait of its own. A sampled draft and non-SI's draw
    read one transfer (the row's check with the token, and the draft's probability), after which the host
    has queued every kernel of the draw behind the forward; a sampled chain two (the rows' checks, argmax ids and
    drafts' probabilities, then the one law the host's decisions chose); none reads a scalar on the way (on the CPU
    a transfer is no call at all, so ``Tensor.cpu`` is counted)."""
    from dsi.models.hf.device_laws import bonus_token, draft
    from dsi.sampling import BonusRead, DraftRead
    from tests.torch_calls import TorchCalls

    transfers = []
    to_host = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: transfers.append(t.shape) or to_host(t, *a, **k))
    context = tuple(range(20, 30))
    for logits in (rows(0)[[0, 1, 3]], rows(0)[[0, 2]]):  # ties at the top and -inf logits; a last row with +inf
        finite = torch.from_numpy(logits)
        for params in (PARAMS[0], PARAMS[3]):  # temperature alone; with top-k, top-p and min-p
            reads = {"draft": (1, lambda: draft(finite, DraftRead(context, params, 5))),
                     "non-SI": (1, lambda: bonus_token(finite, BonusRead(context, params, 5))),
                     "chain": (2, lambda: read_chain(finite, ChainRead(context, params, 5, frozenset(),
                                                                      (0.5,) * (len(finite) - 1))))}
            for name, (want, run) in reads.items():
                transfers.clear()
                with TorchCalls() as calls:
                    run()
                assert not calls.host_reads() and len(transfers) == want, (name, params, transfers, calls.work())


def test_a_broken_last_row_is_refused_by_a_draw_read_in_one_transfer():
    """A draft or non-SI's draw checks its row with the numbers it reads: a NaN or all -inf row still raises the
    host's error (and the draw made of it in the meantime picked an id of the vocabulary: one out of range would
    fault a GPU)."""
    from dsi.errors import ModelError
    from dsi.models.hf.device_laws import bonus_token, draft, inverse_cdf
    from dsi.sampling import BonusRead, DraftRead

    for broken in (np.nan, -np.inf):
        bad = rows(1)[[0, 3]]
        if np.isnan(broken):
            bad[1, 17] = broken
        else:
            bad[1] = broken
        for params in (PARAMS[0], PARAMS[3], SamplingParams(temperature=0.0)):
            readers = [lambda: draft(torch.from_numpy(bad), DraftRead((1, 2, 3), params, 2))]
            if not params.greedy:  # non-SI draws only sampled tokens on the device
                readers.append(lambda: bonus_token(torch.from_numpy(bad), BonusRead((1, 2, 3), params, 2)))
            for reader in readers:
                with pytest.raises(ModelError, match=r"NaN or all -inf logits in rows \[0\] of 1"):
                    reader()
    for u in (0.0, 0.5, 0.999):
        assert 0 <= int(inverse_cdf(torch.full((7,), float("nan")), u)) < 7
        assert 0 <= int(inverse_cdf(torch.zeros(7), u)) < 7


def test_a_law_left_on_the_device_reads_as_the_host_array_it_copies_once():
    import pickle

    from dsi.models.hf.device_laws import draft
    from dsi.sampling import DraftRead, residual

    logits = processed_rows(5, n=1)
    token, q = draft(torch.from_numpy(logits), DraftRead((1, 2), SamplingParams(temperature=0.9, seed=3), 2))
    p = process_logits(processed_rows(6, n=1)[0], SamplingParams(temperature=0.9))
    host = q.host()
    other = (token + 1) % len(q)
    assert q[other] == host[other] and q.host() is host  # copied once
    assert np.array_equal(residual(p, q), residual(p, host))
    assert np.array_equal(pickle.loads(pickle.dumps(q)), host)


def test_a_drafter_row_its_constraint_empties_drafts_nothing_on_the_device_too():
    from dsi.constraints import BoundConstraint, Constraint, TokenTable
    from dsi.errors import DraftUnavailable
    from dsi.models.hf.device_laws import draft
    from dsi.sampling import DraftRead

    table = TokenTable(tuple(c.encode() for c in CHARS) + (b"",), (EOS,))
    logits = processed_rows(0, n=1)
    logits[0, CHARS.index("a")] = -np.inf  # the one token the grammar allows first
    for temperature in (0.0, 0.8):
        params = SamplingParams(temperature=temperature, constraint=BoundConstraint(Constraint.regex("a[0-9]"), table))
        read = DraftRead((1, 2), params, 2)
        for reader in (read, lambda rows: draft(torch.from_numpy(rows), read)):
            with pytest.raises(DraftUnavailable, match="no token the request allows"):
                reader(logits)


@pytest.mark.hf
@pytest.mark.usefixtures("one_torch_thread")
def test_a_drafter_drawing_on_its_device_keeps_the_law_and_greedy_output(monkeypatch, no_thread_leak):
    """SI and DSI whose drafter draws on its device and whose target reads rows on the host: greedy with
    penalties token for token non-SI's; sampled, one output per seed for SP 1-3 and 600 seeded two-token SI
    outputs following the target's exact law (chi-square, alpha 1e-4)."""
    import dsi
    import dsi.models.hf.device_laws as device_laws
    import dsi.models.hf.model as hf
    from dsi.sampling import DraftRead

    model, host_target, _ = tiny_pair(False)
    _, _, drafter = tiny_pair(True)
    calls = []
    real = device_laws.draft
    monkeypatch.setitem(hf.DEVICE_READERS, DraftRead, lambda rows, read: calls.append(read.params.greedy)
                        or real(rows, read))
    penalised = SamplingParams(presence_penalty=0.8, repetition_penalty=1.5, logit_bias={2: 1.0})
    want = dsi.generate(target=host_target, prompt=(1, 2, 3), method="ar", max_new_tokens=14, sampling=penalised)
    for method, servers in (("si", 1), ("dsi", 2)):
        out = dsi.generate(target=host_target, drafter=drafter, prompt=(1, 2, 3), method=method, lookahead=3,
                           num_target_servers=servers, max_new_tokens=14, sampling=penalised)
        assert out.tokens == want.tokens, method
    assert True in calls
    calls.clear()
    assert_one_output_per_seed_and_the_law(model, host_target, drafter)
    assert False in calls


# ---- log-probabilities read on the device -------------------------------------------------------------------------


def assert_same_entry(got, want, atol: float = 2e-6) -> None:
    assert got.token == want.token and got.logprob == pytest.approx(want.logprob, abs=atol)
    assert [i for i, _ in got.top] == [i for i, _ in want.top]  # ties in id order, as on the host
    np.testing.assert_allclose([v for _, v in got.top], [v for _, v in want.top], atol=atol)


def logprob_reads(seed: int):
    """Each kind of decisions with log-probabilities (greedy raw and processed, non-SI's draw, a sampled chain with
    its drafts' probabilities), with the rows they read and the tokens an engine can commit at each row."""
    from dsi.sampling import BonusRead, GreedyRead

    logits = processed_rows(seed, n=4)
    logits[1, :6] = logits[1].max()  # ties at the top of a row
    context = (2, 3, 3, 10, 11, 12, 4, 5)
    stops = frozenset({EOS})
    greedy, sampled = processed_params(greedy=True, constraint=False), processed_params(greedy=False,
                                                                                       constraint=False)
    for params in (SamplingParams(), *greedy):
        yield GreedyRead(context, params, 3, stops), logits
    for params in (*PARAMS[:4], *sampled):
        params = replace(params, seed=seed)
        yield BonusRead(context, params, 3, stops), logits[-1:]
        host_laws = [process_logits(row, params, Prefix(context[: len(context) - 3 + j], 3, stops))
                     for j, row in enumerate(logits)]
        draft_probs = tuple(float(host_laws[j][x]) * 1.5 for j, x in enumerate(context[-3:]))
        yield ChainRead(context, params, 3, stops, draft_probs), logits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_logprobs_read_on_the_device_are_the_host_s_entries_and_only_the_committed_tokens_cross(mode, device):
    """Every row's entry for the tokens a decision can commit there, and its top 5 (ties in id order), equal the
    host's (within float32 rounding); a row crosses whole only where the engine draws the token (a sampled chain's
    read row), and asking another token of a row that crossed as its top raises rather than reporting a wrong one."""
    from dsi.errors import ModelError
    from dsi.logprobs import LogprobsRead, TopLogprobs, entry
    from dsi.models.hf.device_laws import with_logprobs
    from dsi.sampling import BonusRead

    kinds = set()
    for seed in range(3):
        for decisions, logits in logprob_reads(seed):
            read = LogprobsRead(decisions, mode, 5)
            (got, device_rows), (want, host_rows) = with_logprobs(torch.from_numpy(logits).to(device), read), read(logits)
            if isinstance(decisions, ChainRead):
                assert sorted(got[1].laws) == sorted(want[1].laws)
                np.testing.assert_array_equal(got[0], want[0])
                read_row = next(iter(want[1].laws))
                first = len(decisions.tokens) - len(logits) + 1
                committed = {j: [decisions.tokens[first + j]] for j in range(read_row)}
                committed[read_row] = list(range(0, logits.shape[1], 3))  # the engine's draw: any token
            elif isinstance(decisions, BonusRead):
                assert got == want
                committed = {0: [got]}
            else:
                np.testing.assert_array_equal(got, want)
                committed = {j: [int(t)] for j, t in enumerate(got)}
            kinds.add(type(decisions).__name__)
            assert len(device_rows) == len(host_rows)
            for j, tokens in committed.items():
                whole = not isinstance(device_rows[j], TopLogprobs)
                assert whole == (isinstance(decisions, ChainRead) and j == read_row)
                for token in tokens:
                    assert_same_entry(entry(device_rows[j], token, 5), entry(host_rows[j], token, 5))
                if not whole:
                    other = next(t for t in range(logits.shape[1]) if t not in tokens)
                    with pytest.raises(ModelError, match=f"not of the token {other} committed there"):
                        entry(device_rows[j], other, 5)
    assert kinds == {"GreedyRead", "BonusRead", "ChainRead"}


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_logprobs_of_a_row_with_infinite_logits_are_the_host_s_limit_on_the_device(mode):
    """A row whose maximum is +inf: its +inf logits share the mass (log 1/2 each here), the rest have none, on the
    device as on the host (the device finds such rows without reading a flag on the way)."""
    from dsi.logprobs import LogprobsRead, entry
    from dsi.models.hf.device_laws import with_logprobs
    from dsi.sampling import BonusRead, GreedyRead

    logits = processed_rows(1, n=3)
    logits[1, [4, 9]] = np.inf
    logits[2, 2] = -np.inf
    context = (2, 3, 3, 10, 11)
    reads = [(GreedyRead(context, SamplingParams(), 2), logits),
             (GreedyRead(context, SamplingParams(logit_bias={5: 1.0}), 2), logits),
             (BonusRead(context, SamplingParams(temperature=0.8, seed=2), 2), logits[1:2])]
    for decisions, rows in reads:
        read = LogprobsRead(decisions, mode, 4)
        (got, device_rows), (want, host_rows) = with_logprobs(torch.from_numpy(rows), read), read(rows)
        assert np.array_equal(got, want)
        committed = [int(t) for t in np.atleast_1d(got)]  # each row's argmax, or non-SI's draw
        for j, token in enumerate(committed):
            assert_same_entry(entry(device_rows[j], token, 4), entry(host_rows[j], token, 4))
        limit = entry(device_rows[1 if len(rows) > 1 else 0], committed[-1 if len(rows) == 1 else 1], 4)
        assert limit.token in (4, 9) and limit.logprob == pytest.approx(np.log(0.5))
        assert [i for i, _ in limit.top[:2]] == [4, 9] and limit.top[2][1] == -np.inf


def test_whole_row_logprobs_keep_each_rows_own_limit():
    """A block of raw rows where one row has +inf logits: that row's +inf share the mass, the others keep theirs
    (the host once made every row of such a block -inf but its +inf)."""
    from dsi.logprobs import raw_rows

    block = rows(0, n=3)  # row 2 has a +inf logit
    out = raw_rows(block).dense()
    assert out[2, 11] == 0.0 and np.isneginf(np.delete(out[2], 11)).all()
    for j in (0, 1):
        np.testing.assert_allclose(np.exp(out[j]).sum(), 1.0, rtol=1e-6)
        np.testing.assert_allclose(out[j], raw_rows(block[j:j + 1]).dense()[0], rtol=0, atol=0)


@pytest.mark.hf
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_logprobs_read_on_the_device_through_every_method_are_non_si_s_on_the_host(mode, monkeypatch,
                                                                                 no_thread_leak):
    """Non-SI, SI and DSI (SP 1 and 2) on a tiny pair deciding on its device, asking logprobs: greedy (plain and
    penalised) gives non-SI's tokens on the host and its entries; sampled, every method's entries are the
    entries of the rows that decided its tokens (non-SI's on the host for that output), and DSI one output per
    seed whatever its SP."""
    import dsi
    import dsi.models.hf.device_laws as device_laws
    import dsi.models.hf.model as hf
    from dsi.logprobs import LogprobsRead, entry, logprob_row

    model, target, drafter = tiny_pair(True)
    _, host_target, _ = tiny_pair(False)
    calls = []
    real = device_laws.with_logprobs
    monkeypatch.setitem(hf.DEVICE_READERS, LogprobsRead, lambda rows, read: calls.append(1) or real(rows, read))
    prompt = (1, 2, 3)

    def host_entries(tokens, params):
        with torch.no_grad():
            logits = model(torch.tensor([[*prompt, *tokens]])).logits[0].float().numpy()
        return [entry(logprob_row(logits[len(prompt) - 1 + i], params, Prefix((*prompt, *tokens[:i]), 3), mode), t, 3)
                for i, t in enumerate(tokens)]

    for params in (SamplingParams(), SamplingParams(presence_penalty=0.8, repetition_penalty=1.5),
                   SamplingParams(temperature=1.0, top_k=4, seed=5), SamplingParams(temperature=0.9, seed=6,
                                                                                  frequency_penalty=0.4)):
        outs = set()
        for method, servers in (("ar", 1), ("si", 1), ("dsi", 1), ("dsi", 2)):
            out = dsi.generate(target=target, drafter=drafter, prompt=prompt, method=method, lookahead=3,
                               num_target_servers=servers, max_new_tokens=10, sampling=params, logprobs=3,
                               logprobs_mode=mode)
            for got, want in zip(out.logprobs, host_entries(out.tokens, params), strict=True):
                assert_same_entry(got, want)
            if method == "dsi":
                outs.add(tuple(out.tokens))
            if params.greedy:
                assert out.tokens == dsi.generate(target=host_target, prompt=prompt, method="ar", max_new_tokens=10,
                                                  sampling=params).tokens
        assert len(outs) == 1
    assert calls


@pytest.mark.hf
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("device, graphs", [
    ("cpu", False), ("cpu", True),  # on the CPU, graphs' padded shapes on the static cache, run eagerly
    pytest.param("cuda", False, marks=DEVICES[1].marks), pytest.param("cuda", True, marks=DEVICES[1].marks),
], ids=["cpu", "cpu-padded", "cuda", "cuda-graphs"])
def test_every_method_decides_on_the_device_as_the_host_does(device, graphs, monkeypatch, no_thread_leak):
    """The tiny pair on ``device`` deciding there (a GPU: its plan's default, eager or with CUDA graphs, whose
    sessions in DSI's server threads capture at once; the CPU: forced on): every kind of read goes through the
    device (counted), greedy with penalties gives non-SI's tokens on the host (the same weights, decided on the
    CPU's host path), logprob entries match the host's within float32 rounding (a GPU's forward: 1e-4) with the
    same top tokens, and a sampled seed gives DSI one output for SP 1 and 2 (the CUDA variants run in gpu_check.sh
    part 0; the laws' chi-squares run on the CPU)."""
    import dsi
    import dsi.models.hf.model as hf

    _, target, drafter = tiny_pair(True if device == "cpu" else None, device, graphs)
    _, host_target, host_drafter = tiny_pair(False)
    assert target.decides_on_device and drafter.decides_on_device
    kinds = []
    for kind, real in list(hf.DEVICE_READERS.items()):
        monkeypatch.setitem(hf.DEVICE_READERS, kind, lambda rows, read, real=real: kinds.append(type(read).__name__)
                            or real(rows, read))
    prompt = (1, 2, 3)
    for params in (SamplingParams(presence_penalty=0.8, repetition_penalty=1.5, logit_bias={2: 1.0}),
                   SamplingParams(temperature=0.9, top_k=4, top_p=0.95, seed=7)):
        for method, servers in (("ar", 1), ("si", 1), ("dsi", 1), ("dsi", 2)):
            got = [dsi.generate(target=t, drafter=None if method == "ar" else d, prompt=prompt, method=method,
                                lookahead=3, num_target_servers=servers, max_new_tokens=10, sampling=params,
                                logprobs=3)
                   for t, d in ((target, drafter), (host_target, host_drafter))]
            if params.greedy:
                assert got[0].tokens == got[1].tokens, method
            if got[0].tokens == got[1].tokens:  # sampled: equal but where a uniform falls within rounding
                for a, b in zip(got[0].logprobs, got[1].logprobs, strict=True):
                    assert_same_entry(a, b, 2e-6 if device == "cpu" else 1e-4)  # a GPU's forward rounds otherwise
        outs = {tuple(dsi.generate(target=target, drafter=drafter, prompt=prompt, lookahead=3, num_target_servers=sp,
                                   max_new_tokens=10, sampling=params).tokens) for sp in (1, 2)}
        assert len(outs) == 1
        plain = [dsi.generate(target=t, prompt=prompt, method="ar", max_new_tokens=10, sampling=params).tokens
                 for t in (target, host_target)]  # non-SI without logprobs: its draw alone
        assert not params.greedy or plain[0] == plain[1]
    assert {"LogprobsRead", "DraftRead", "ChainRead", "GreedyRead", "BonusRead"} <= set(kinds)
