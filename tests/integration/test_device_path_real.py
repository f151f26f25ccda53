"""The decisions made where the rows are (dsi.models.hf.device_laws: a drafter's draws, the servers' chain decisions,
non-SI's draw and the logprobs' top N), forced on for the embedded pair on the CPU: over its real 151,936-id
vocabulary every method gives the host path's tokens, and logprob entries within float32 rounding of the host's
with the same top tokens. Runs where the pair is converted for the hf backend."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import dsi  # noqa: E402
from dsi.models.hf.checkpoint import is_converted  # noqa: E402
from dsi.sampling import SamplingParams  # noqa: E402

pytestmark = [
    pytest.mark.realmodel,
    pytest.mark.slow,
    pytest.mark.hf,
    pytest.mark.skipif(not is_converted(), reason="the embedded pair is not converted for the hf backend "
                                                  "(run `dsi demo --backend hf` once)"),
]

REQUESTS = [  # (sampling, logprobs)
    (SamplingParams(), 5),
    (SamplingParams(repetition_penalty=1.1, presence_penalty=0.3), 3),
    (SamplingParams(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05, seed=3), 5),  # Qwen's own
    (SamplingParams(temperature=0.9, top_p=0.9, seed=4), None),  # the drafts' laws left on the device
]


@pytest.mark.usefixtures("no_thread_leak")
def test_every_method_deciding_on_the_device_gives_the_host_s_tokens_and_logprobs():
    from dsi.models.loading import load_pair

    target, drafter = load_pair("default-target", "default-drafter", backend="hf", dtype="fp32", progress=False)
    prompt = target.encode("def fibonacci(n):")
    plans = {model: model.forward_plan for model in (target, drafter)}
    rejections = []
    for params, logprobs in REQUESTS:
        for method in ("ar", "si", "dsi"):
            outs = []
            for on in (False, True):
                for model, plan in plans.items():
                    model.forward_plan = replace(plan, device_decisions=on)
                assert target.decides_on_device == drafter.decides_on_device == on
                outs.append(dsi.generate(target=target, drafter=None if method == "ar" else drafter, prompt=prompt,
                                         method=method, lookahead=4, num_target_servers=2, max_new_tokens=12,
                                         sampling=params, logprobs=logprobs))
            host, device = outs
            assert device.tokens == host.tokens, (method, params)
            if logprobs is not None:
                for a, b in zip(host.logprobs, device.logprobs, strict=True):
                    assert a.token == b.token and b.logprob == pytest.approx(a.logprob, abs=2e-5)
                    assert [i for i, _ in a.top] == [i for i, _ in b.top]
            if not params.greedy:
                rejections.append(device.stats.rejections)
    assert sum(rejections) > 0  # corrections drawn from residuals of drafter laws left on the device
