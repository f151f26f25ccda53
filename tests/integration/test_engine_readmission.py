"""A target engine that is lost and comes back (issue 66): a ``dsi serve`` in front of two real engines
keeps serving exact answers on the one left, says it is degraded (``/health``, ``/metrics``, the log),
probes the lost one, and re-admits it once it answers its start check again: later requests use it.

The engine is killed by process group (a vLLM API server's ``VLLM::EngineCore`` child outlives a
``kill -9`` of the server alone) and restarted on its port. Slow: an engine starts in seconds (``dsi serve``)
or about 40 s (vLLM) here.
"""

from __future__ import annotations

import logging
import signal

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")

from tests.engine_models import TOKENS, dirs, local, prompts, reference  # noqa: E402,F401
from tests.engine_servers import answered_requests, start_dsi_serve, start_vllm, vllm_python  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.slow]


def expected_text(target, tokens: list[int]) -> str:
    eos = set(target.eos_token_ids)
    cut = next((i for i, t in enumerate(tokens) if t in eos), None)  # the server stops at EOS
    return target.decode(tokens if cut is None else tokens[:cut])


@pytest.mark.parametrize("kind", ["dsi-serve", "vllm"])
def test_a_lost_engine_is_readmitted_when_it_is_back_and_later_requests_use_it(dirs, local, prompts, reference,
                                                                               kind, caplog):
    import httpx

    from dsi.server import ServeConfig, create_app
    from tests.unit.server.conftest import running_server, wait_until

    if kind == "vllm" and vllm_python() is None:
        pytest.skip("no vLLM venv: bash packaging/vllm-venv.sh builds it (CI does)")
    start = (lambda port=None: start_vllm(dirs["target"], port=port)) if kind == "vllm" else \
        (lambda port=None: start_dsi_serve(dirs["target"], port=port))
    target, drafter, _ = local
    survivor, victim = start_dsi_serve(dirs["target"]), start()
    back = None
    caplog.set_level(logging.WARNING)
    try:
        config = ServeConfig(method="dsi", lookahead=2, num_target_servers=2, model_name="front", max_concurrent=1,
                             target_servers=(survivor.url, victim.url), temperature=0.0)
        with running_server(create_app(target, drafter, config)) as front:
            def complete(i: int) -> str:
                r = httpx.post(front.url + "/v1/completions", timeout=120, json={
                    "model": "front", "prompt": prompts[i], "max_tokens": TOKENS, "temperature": 0})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            def health() -> dict:
                return httpx.get(front.url + "/health", timeout=10).json()

            assert complete(0) == expected_text(target, reference[0])
            assert health()["status"] == "ok" and answered_requests(victim) > 0
            victim.signal(signal.SIGKILL)  # the whole process group
            victim.proc.wait(30)
            # exact on the survivor; the victim is found lost at its first task
            for i in range(len(prompts)):
                assert complete(i) == expected_text(target, reference[i])
                if health()["status"] == "degraded":
                    break
            state = health()
            assert state["status"] == "degraded", state
            assert state["target_servers"] == {"configured": 2, "in_service": 1, "lost": 1, "readmissions": 0}
            metrics = httpx.get(front.url + "/metrics", timeout=10).text
            assert "dsi_target_servers_lost 1.0" in metrics and "dsi_target_servers_in_service 1.0" in metrics
            assert complete(1) == expected_text(target, reference[1])  # degraded, still exact

            back = start(victim.port)  # the same URL again
            wait_until(lambda: health()["status"] == "ok", timeout=90, what="the engine re-admitted")
            assert health()["target_servers"] == {"configured": 2, "in_service": 2, "lost": 0, "readmissions": 1}
            before = answered_requests(back)
            for i in range(len(prompts)):
                assert complete(i) == expected_text(target, reference[i])
            assert answered_requests(back) > before, "no request reached the re-admitted engine"
            metrics = httpx.get(front.url + "/metrics", timeout=10).text
            assert "dsi_target_servers_lost 0.0" in metrics and "dsi_target_server_readmissions_total 1.0" in metrics
    finally:
        for engine in (survivor, victim, back):
            if engine is not None:
                engine.stop()
    lines = [r.getMessage() for r in caplog.records]
    lost = [line for line in lines if "died" in line]
    assert lost and all("lost: probed in the background" in line and "restarting" not in line for line in lost)
    assert any(f"{victim.url} passes its start check again" in line for line in lines)
