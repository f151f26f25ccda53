"""HFModel sessions on tiny random Llama and GPT-2 models built from config (seeded, float32).

Tolerance: session rows are compared with one from-scratch forward of the whole sequence with
``atol=1e-5`` (float32; observed differences are below 1e-6, they come from summing attention
over a cache in a different order).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dsi.errors import ConfigError, ContextLengthError, ModelError, TaskCancelled  # noqa: E402
from dsi.models.base import LanguageModel, ModelSession, extend_rows, forward_rows  # noqa: E402
from dsi.models.hf.model import HFModel, check_device, decoder_layers, torch_dtype  # noqa: E402
from dsi.models.hf.forward_plan import ForwardPlan  # noqa: E402
from dsi.trees import DraftTree  # noqa: E402
from tests.bad_ids import bad_ids  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]
ATOL = 1e-5
VOCAB = 97


def tiny_llama(seed: int = 0, layers: int = 4, vocab: int = VOCAB, positions: int = 64):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions, eos_token_id=1,
        bos_token_id=0, pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).eval()


def tiny_gpt2(seed: int = 0, vocab: int = VOCAB):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=3, n_head=4, n_positions=64,
                                     bos_token_id=0, eos_token_id=1)
    return transformers.GPT2LMHeadModel(config).eval()


def reference(model, ids) -> np.ndarray:
    """Logits of one from-scratch forward without a cache. # [len(ids), V]"""
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].float().numpy()


IDS = [3, 17, 42, 5, 88, 23, 61, 9, 14, 70, 33, 2, 50, 76]
MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2}


PLANS = {  # every session test runs on each cache: dynamic, static, and static with graphs' padded shapes (eager
    # on a CPU: dsi.models.hf.forward_plan)
    "dynamic": ForwardPlan(),
    "static": ForwardPlan("static"),
    "padded": ForwardPlan("static", cuda_graphs=True),
}


@pytest.fixture(params=[(m, p) for m in sorted(MODELS) for p in PLANS], ids=lambda mp: f"{mp[0]}-{mp[1]}")
def pair(request):
    model, plan = request.param
    raw = MODELS[model]()
    return raw, HFModel(raw, forward_plan=PLANS[plan])


def test_protocols_and_shape(pair):
    raw, model = pair
    assert isinstance(model, LanguageModel)
    session = model.new_session()
    assert isinstance(session, ModelSession)
    rows = session.extend(IDS[:5])
    assert rows.shape == (5, VOCAB) and rows.dtype == np.float32
    assert session.tokens == tuple(IDS[:5])
    assert model.vocab_size == VOCAB
    assert session.extend([]).shape == (0, VOCAB)


def test_incremental_extends_equal_one_forward(pair):
    raw, model = pair
    ref = reference(raw, IDS)
    session = model.new_session()
    got = np.concatenate([session.extend(IDS[:4]), session.extend(IDS[4:5]), session.extend(IDS[5:11]),
                          session.extend(IDS[11:])])
    np.testing.assert_allclose(got, ref, atol=ATOL)


def test_truncate_then_extend_equals_from_scratch(pair):
    raw, model = pair
    session = model.new_session()
    session.extend(IDS)
    session.truncate(6)
    assert session.tokens == tuple(IDS[:6])
    other = [7, 8, 9, 10]
    np.testing.assert_allclose(session.extend(other), reference(raw, IDS[:6] + other)[6:], atol=ATOL)
    session.truncate(0)
    np.testing.assert_allclose(session.extend(IDS[:3]), reference(raw, IDS[:3]), atol=ATOL)


def test_forward_rows_reuses_cache(pair):
    raw, model = pair
    session = model.new_session()
    session.extend(IDS[:8])
    context = IDS[:6] + [11, 12, 13]
    rows = forward_rows(session, context, 3)
    np.testing.assert_allclose(rows, reference(raw, context)[-3:], atol=ATOL)
    assert session.tokens == tuple(context)


def test_extend_rows_fast_path_equals_full_rows_and_runs_the_head_only_on_them(pair):
    """The session's own extend_rows gives the tail of extend's rows (or their argmax), and the
    output layer sees only those rows (logits_to_keep): no logits for rows nobody reads."""
    raw, model = pair
    ref = reference(raw, IDS)  # [len(IDS), V]
    head_rows = []
    handle = raw.get_output_embeddings().register_forward_pre_hook(
        lambda module, args: head_rows.append(args[0].shape[1]))
    try:
        session = model.new_session()
        assert hasattr(session, "extend_rows")
        tail = extend_rows(session, IDS[:9], None, 2)
        np.testing.assert_allclose(tail, ref[7:9], atol=ATOL)
        ids = extend_rows(session, IDS[9:], None, 3, greedy=True)
        assert ids.dtype == np.int64 and ids.tolist() == np.argmax(ref[-3:], axis=-1).tolist()
        assert head_rows == [2, 3]
        greedy = forward_rows(session, IDS[:6] + [11, 12], 2, greedy=True)
        assert greedy.tolist() == np.argmax(reference(raw, IDS[:6] + [11, 12])[-2:], axis=-1).tolist()
        with pytest.raises(ConfigError, match="num_rows=4"):
            extend_rows(session, [1, 2, 3], None, 4)
    finally:
        handle.remove()


def test_truncate_rejects_bad_length(pair):
    _, model = pair
    session = model.new_session()
    session.extend(IDS[:3])
    with pytest.raises(ConfigError, match="length=4"):
        session.truncate(4)
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        session.extend([VOCAB])
    assert session.tokens == tuple(IDS[:3])


class Refuses:
    """Stands in for a tokenizer or a forward that must not be reached: the argument is refused before."""

    def __getattr__(self, name):
        raise AssertionError(f"{name} was reached with an argument Python should have refused")

    def __call__(self, *args, **kwargs):
        raise AssertionError("a forward ran with an argument Python should have refused")

    def __len__(self) -> int:
        return 320  # the test tokenizer's length (the model's rows are padded beyond it)


@pytest.fixture
def with_tokenizer():
    """A tiny Llama of 330 logit rows with the 320-token test tokenizer (rows 320..329 are padding)."""
    from tests.tiny_hf import make_tokenizer

    return HFModel(tiny_llama(layers=1, vocab=330), make_tokenizer(), name="tiny")


@pytest.mark.parametrize("ids, message", bad_ids(330))
def test_bad_ids_are_refused_before_the_tokenizer_and_torch(with_tokenizer, ids, message):
    model = with_tokenizer
    session = model.new_session()
    session.extend([5, 6])
    model.tokenizer, forward = Refuses(), model._forward
    model._forward = Refuses()
    try:
        with pytest.raises(ConfigError, match=message):
            model.decode(ids)
        with pytest.raises(ConfigError, match=message.replace("ids", "tokens", 1)):
            session.extend(ids)
        with pytest.raises(ConfigError, match=message.replace("ids", "prefix", 1)):
            session.tree_rows(ids, DraftTree.chain([7]))
    finally:
        model._forward = forward
    assert session.tokens == (5, 6)


def test_bad_text_and_lengths_are_config_errors(with_tokenizer):
    model = with_tokenizer
    for text in (123, None, b"bytes", ["a"]):
        with pytest.raises(ConfigError, match=r"text=.* must be a str"):
            model.encode(text)
    with pytest.raises(ConfigError, match=r"system=\['x'\] \(list\) must be a str"):
        model.encode("hi", chat=True, system=["x"])
    session = model.new_session()
    session.extend([5, 6, 7])
    for length in (1.5, True, None, -1, 4):
        with pytest.raises(ConfigError, match=rf"truncate length={length!r} must be an integer in \[0, 3\]"):
            session.truncate(length)
    for num_rows in (0, 3, 1.0, True):
        with pytest.raises(ConfigError, match=rf"num_rows={num_rows!r} must be an integer in \[1, 2\]"):
            session.extend_rows([8, 9], None, num_rows, True)
    with pytest.raises(ConfigError, match=r"tree.tokens\[1\]=330 is outside the vocabulary"):
        session.tree_rows([5, 6, 7], DraftTree((8, 330), (-1, 0)))
    assert session.tokens == (5, 6, 7)
    with pytest.raises(ConfigError, match=r"prompt_len=2.5 must be an integer >= 0"):
        model.check_length(2.5)


def test_numpy_ids_and_padded_rows_decode(with_tokenizer):
    model = with_tokenizer
    ids = model.encode("def add(a, b):")
    text = model.decode(ids)
    assert text == "def add(a, b):"
    assert model.decode(np.array(ids, dtype=np.int32)) == model.decode([np.int64(t) for t in ids]) == text
    assert model.decode([*ids, 325]) == text  # a padded row's id: no text, no error
    session = model.new_session()
    rows = session.extend(np.array(ids, dtype=np.int64))
    session.truncate(np.int64(2))
    np.testing.assert_allclose(session.extend(tuple(np.int32(t) for t in ids[2:])), rows[2:], atol=ATOL)


def test_context_limit_is_checked(pair):
    _, model = pair
    assert model.max_context == 64
    session = model.new_session()
    with pytest.raises(ContextLengthError, match="max_context=64"):  # a ConfigError: the drafter's "no more room"
        session.extend([5] * 65)
    session.extend([5] * 60)
    with pytest.raises(ContextLengthError, match="65 tokens exceed max_context=64"):
        extend_rows(session, [5] * 5, None, 1, greedy=True)
    assert session.tokens == (5,) * 60  # refused before the forward: the session is unchanged
    with pytest.raises(ConfigError, match="max_context=64"):
        model.check_length(60, 10)
    model.check_length(60, 4)


@pytest.mark.parametrize("greedy", [True, False])
def test_nan_logits_are_a_model_error_not_a_token(pair, greedy):
    """A forward that produces NaN (here: a poisoned output layer) raises ModelError on the greedy
    path too, where only the argmax would leave the device; the session is left as it was."""
    from dsi.sampling import SamplingParams, process_logits

    raw, model = pair
    session = model.new_session()
    extend_rows(session, IDS[:4], None, 1, greedy=greedy)
    with torch.no_grad():
        raw.get_output_embeddings().weight[7, 3] = float("nan")  # token 7's logit becomes NaN
    if greedy:
        with pytest.raises(ModelError, match="NaN logits"):
            extend_rows(session, IDS[4:7], None, 2, greedy=True)
        assert session.tokens == tuple(IDS[:4])
    else:
        rows = extend_rows(session, IDS[4:7], None, 2, greedy=False)  # [2, V]: raw rows pass through
        with pytest.raises(ModelError, match=r"NaN logits at 1 token ids \(first \[7\]\)"):
            process_logits(rows[-1], SamplingParams(temperature=1.0))


def _cancel_after_layer(model: HFModel, index: int, flag: threading.Event):
    """Set ``flag`` when layer ``index`` finishes (the next layer's pre-hook then aborts)."""

    def hook(module, args, output):
        flag.set()

    return model.layers[index].register_forward_hook(hook)


@pytest.mark.parametrize("start", [0, 5])
def test_cancel_mid_forward_restores_session(pair, start):
    raw, model = pair
    session = model.new_session()
    if start:
        session.extend(IDS[:start])
    flag = threading.Event()
    lengths = []
    handle = _cancel_after_layer(model, 1, flag)
    # observe the uneven cache the abort leaves behind, before the session restores it
    original_restore = session._restore

    def spy(length):
        lengths.append([layer.get_seq_length() for layer in session._cache.layers])
        original_restore(length)

    session._restore = spy
    try:
        with pytest.raises(TaskCancelled):
            session.extend(IDS[start:start + 4], cancel=flag)
    finally:
        handle.remove()
    n = len(model.layers)
    assert session.tokens == tuple(IDS[:start])
    if model.forward_plan.static:  # layers 0 and 1 wrote past the length, which is all a static cache keeps
        assert session._cache.length == start
    else:
        assert lengths == [[start + 4] * 2 + [start] * (n - 2)]  # layers 0 and 1 ran, the rest did not
        assert all(layer.get_seq_length() == start for layer in session._cache.layers)
    np.testing.assert_allclose(session.extend(IDS[start:]), reference(raw, IDS)[start:], atol=ATOL)


def test_cancel_flag_already_set_runs_nothing(pair):
    _, model = pair
    session = model.new_session()
    session.extend(IDS[:3])
    flag = threading.Event()
    flag.set()
    with pytest.raises(TaskCancelled):
        session.extend(IDS[3:6], cancel=flag)
    assert session.tokens == tuple(IDS[:3])


def test_cancel_before_lm_head(pair):
    """A flag set after the last layer is still honoured (the LM head is hooked too)."""
    raw, model = pair
    session = model.new_session()
    session.extend(IDS[:4])
    flag = threading.Event()
    handle = _cancel_after_layer(model, len(model.layers) - 1, flag)
    try:
        with pytest.raises(TaskCancelled):
            session.extend(IDS[4:8], cancel=flag)
    finally:
        handle.remove()
    np.testing.assert_allclose(session.extend(IDS[4:]), reference(raw, IDS)[4:], atol=ATOL)


def test_two_threads_share_weights_with_separate_caches(pair):
    """Two sessions run their forwards at the same time (a barrier inside layer 0 forces the
    overlap) and get exactly what sequential runs get."""
    raw, model = pair
    prompts = [IDS[:7], IDS[3:12]]
    sequential = []
    for prompt in prompts:
        s = model.new_session()
        sequential.append([s.extend(prompt[:4]), s.extend(prompt[4:])])

    barrier = threading.Barrier(2, timeout=10)

    def meet(module, args):
        if threading.current_thread().name.startswith("worker"):
            barrier.wait()

    handle = model.layers[0].register_forward_pre_hook(meet)
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            s = model.new_session()
            results[i] = [s.extend(prompts[i][:4]), s.extend(prompts[i][4:])]
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,), name=f"worker{i}") for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    finally:
        handle.remove()
    assert not errors, errors
    for i in range(2):
        for got, want in zip(results[i], sequential[i], strict=True):
            np.testing.assert_array_equal(got, want)


def test_cancel_flag_is_per_thread(pair):
    """While two forwards overlap, only the thread whose own flag is set is cancelled."""
    raw, model = pair
    barrier = threading.Barrier(2, timeout=10)
    flags = {"worker-cancel": threading.Event(), "worker-keep": threading.Event()}

    def meet(module, args):
        name = threading.current_thread().name
        if name in flags:
            barrier.wait()  # both forwards have started (and installed their flags)
            if name == "worker-cancel":
                flags[name].set()

    handle = model.layers[0].register_forward_hook(lambda m, a, o: meet(m, a))
    outcome: dict[str, object] = {}

    def work(name: str) -> None:
        s = model.new_session()
        try:
            outcome[name] = s.extend(IDS[:6], cancel=flags[name])
        except TaskCancelled as exc:
            outcome[name] = exc

    threads = [threading.Thread(target=work, args=(n,), name=n) for n in flags]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    finally:
        handle.remove()
    assert isinstance(outcome["worker-cancel"], TaskCancelled)
    np.testing.assert_allclose(outcome["worker-keep"], reference(raw, IDS[:6]), atol=ATOL)


def test_threads_setting_applies_in_worker_thread():
    model = HFModel(tiny_llama(), threads=1)
    seen = []

    def work():
        torch.set_num_threads(2)
        model.new_session().extend(IDS[:3])
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=work)
    t.start()
    t.join(timeout=30)
    assert seen == [1]
    with pytest.raises(ConfigError, match="threads=0"):
        HFModel(tiny_llama(), threads=0)


def test_bf16_rows_are_float32_and_close():
    raw = tiny_llama()
    ref = reference(raw, IDS)
    model = HFModel(tiny_llama().to(torch.bfloat16))
    assert model.dtype == "bf16"
    rows = model.new_session().extend(IDS)
    assert rows.dtype == np.float32
    np.testing.assert_allclose(rows, ref, atol=0.1)  # bf16 weights: about 3 significant digits


def test_dtype_and_device_errors():
    assert torch_dtype("bf16") is torch.bfloat16 and torch_dtype("FP32") is torch.float32
    with pytest.raises(ConfigError, match="dtype='int8'"):
        torch_dtype("int8")
    with pytest.raises(ConfigError, match="fp16 is not supported on device='cpu'"):
        check_device("cpu", "fp16")
    with pytest.raises(ConfigError, match="device='tpu'"):
        check_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            check_device("cuda:1")
    else:
        with pytest.raises(ConfigError, match="does not exist"):
            check_device(f"cuda:{torch.cuda.device_count()}")


def test_not_a_causal_lm():
    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                                          num_attention_heads=2, intermediate_size=32))
    with pytest.raises(ModelError, match="not a causal language model"):
        HFModel(bert)
    with pytest.raises(ConfigError, match="PreTrainedModel"):
        HFModel(torch.nn.Linear(2, 2))


def test_decoder_layers_found():
    assert len(decoder_layers(tiny_llama(layers=3))) == 3
    assert len(decoder_layers(tiny_gpt2())) == 3


def test_replica_on_same_device_is_self_and_new_session_on_device(pair):
    raw, model = pair
    assert model.on("cpu") is model
    assert model.replicas(["cpu", "cpu"]) == [model, model]
    session = model.new_session(device="cpu")
    np.testing.assert_allclose(session.extend(IDS[:5]), reference(raw, IDS[:5]), atol=ATOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_replicas_match_cpu():
    raw = tiny_llama()
    model = HFModel(raw)
    replicas = model.replicas([f"cuda:{i}" for i in range(torch.cuda.device_count())])
    for rep in replicas:
        assert rep.device.type == "cuda"
        rows = rep.new_session().extend(IDS)
        np.testing.assert_allclose(rows, reference(raw, IDS), atol=1e-3)


def test_eos_ids_and_close(pair):
    _, model = pair
    assert model.eos_token_ids == (1,)
    assert model.eos_token_id == 1
    session = model.new_session()
    session.extend(IDS[:3])
    session.close()
    assert session.tokens == ()
    model.close()
    assert model._hooks == []


def test_tokenizer_helpers_need_a_tokenizer(pair):
    _, model = pair
    with pytest.raises(ConfigError, match="no tokenizer"):
        model.encode("hello")


def test_replica_by_copy_is_independent_and_cancellable(pair):
    """The replica path used when no checkpoint directory is known (deep copy), tried on the CPU."""
    raw, model = pair
    clone = model._replicate(torch.device("cpu"))
    assert clone.model is not model.model
    assert all(len(layer._forward_pre_hooks) == 1 for layer in clone.layers)  # its own hook only
    np.testing.assert_allclose(clone.new_session().extend(IDS), reference(raw, IDS), atol=ATOL)
    flag = threading.Event()
    handle = _cancel_after_layer(clone, 0, flag)
    try:
        with pytest.raises(TaskCancelled):
            clone.new_session().extend(IDS[:4], cancel=flag)
    finally:
        handle.remove()
    assert model.new_session().extend(IDS[:4], cancel=threading.Event()).shape == (4, VOCAB)


def test_a_replica_on_another_device_follows_the_models_deterministic_mode(pair):
    """A replica (e.g. on ``cuda:1``) is in the mode when its model is, and follows a later switch (either way)."""
    _, model = pair
    model.deterministic = True
    try:
        clone = model._replicate(torch.device("cpu"))
        assert clone.deterministic
        model._replicas[torch.device("cpu", 1)] = clone  # as replicas() registers one on another device
        model.deterministic = False
        assert not clone.deterministic
        clone.deterministic = True
        assert model.deterministic
    finally:
        model._replicas.pop(torch.device("cpu", 1), None)
        model.deterministic = False


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_cuda_sessions_on_their_own_streams_overlap_correctly_and_cancel_between_layers():
    """Sessions in several threads of one process, each on its own CUDA stream, give the CPU
    reference's rows; a cancel between layers on CUDA leaves the session as it was."""
    raw = tiny_llama(layers=6)
    cpu_ref = reference(raw, IDS)
    model = HFModel(copy_of(raw), device="cuda:0")
    results: dict[int, np.ndarray] = {}

    def work(i):
        session = model.new_session()
        assert session._stream is not None
        rows = [session.extend(IDS[:5])]
        for t in IDS[5:]:
            rows.append(session.extend([t]))
        results[i] = np.concatenate(rows)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i in range(4):
        np.testing.assert_allclose(results[i], cpu_ref, atol=1e-4)
    session = model.new_session()
    session.extend(IDS[:5])
    flag = threading.Event()
    handle = _cancel_after_layer(model, 2, flag)
    try:
        with pytest.raises(TaskCancelled):
            session.extend(IDS[5:9], cancel=flag)
    finally:
        handle.remove()
    assert session.tokens == tuple(IDS[:5])
    np.testing.assert_allclose(session.extend(IDS[5:]), cpu_ref[5:], atol=1e-4)


@needs_cuda
def test_cuda_forward_synchronises_a_fixed_number_of_times_whatever_the_depth():
    """The cancellation check between layers reads a Python flag: no host-device synchronisation
    per layer. Counted with torch's sync debug mode, a greedy forward of an 8-layer model
    synchronises exactly as often as one of a 2-layer model."""
    import warnings

    counts = []
    for layers in (2, 8):
        model = HFModel(tiny_llama(layers=layers), device="cuda:0")
        session = model.new_session()
        extend_rows(session, IDS[:5], None, 1, greedy=True)  # warm-up (allocations, kernels)
        flag = threading.Event()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                extend_rows(session, IDS[5:9], flag, 2, greedy=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        counts.append(len(caught))
    assert counts[0] == counts[1] and counts[0] <= 3, counts


def copy_of(raw):
    import copy

    return copy.deepcopy(raw)
