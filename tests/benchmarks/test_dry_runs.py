"""Each program of benchmarks/ as its ``--dry-run``: it must run to its end on tiny models and write a report whose
numbers make sense, and where it compares lossless methods, the same tokens for each. In the order of
benchmarks/README.md's table. All of them are in the slow suite (``-m slow``, which CI runs at every stop):
together they took 3.5 of the default run's 17 minutes, whose budget is 15; they check the measuring
programs, while the default run checks the product."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks import positive

pytestmark = pytest.mark.slow


def needs(*modules: str) -> None:
    for module in modules:
        pytest.importorskip(module)


def needs_vllm() -> None:
    needs(*HF, *SERVER)
    from tests.engine_servers import vllm_python

    if vllm_python() is None:
        pytest.skip("no vLLM venv: bash packaging/vllm-venv.sh")


HF = ("torch", "transformers")
LLAMA = ("llama_cpp", "gguf", "torch", "transformers")  # the tiny GGUF is written from a transformers model
SERVER = ("fastapi", "uvicorn", "httpx")


# Engine on emulated latencies, transports, engines over HTTP


def test_transports(dry_run):
    report = dry_run("transports.py")
    assert set(report["transports"]) == {"threads", "processes"} and report["identical_outputs"]
    for row in report["transports"].values():
        for law in row["round_trip"]["64"].values():
            assert positive(law["rtt_ms"]) and law["overhead_ms"] <= law["rtt_ms"]
        assert positive(row["dsi"]["wall_over_ideal"]) and positive(row["dsi"]["speedup_vs_non_si"])
        assert row["dsi"]["verify_tasks"] > 0


def test_engines_http(dry_run):
    needs(*SERVER)
    report = dry_run("engines_http.py")
    assert positive(report["round_trip_ms"]["http"]) and positive(report["round_trip_ms"]["channel"])
    (row,) = report["rows"]
    assert row["identical_outputs"], row  # threads, HTTP, the scoring channel: one greedy output
    assert all(positive(row[f"dsi_over_ideal_{p}"]) for p in ("threads", "http", "channel", "channel_drafter"))
    assert row["verify_tasks"]["dsi channel"] > 0


def test_engine_verify_cost_on_vllm(dry_run):
    needs_vllm()
    report = dry_run("engine_verify_cost.py", timeout=600)
    assert set(report["seconds_per_verification"]) == {"vllm", "vllm prefix cache", "dsi serve"}
    assert all(positive(s) for costs in report["seconds_per_verification"].values() for s in costs.values())
    assert all(n == 0 for n in report["windows_as_prefixes"]["vllm"].values())  # prefix_cache=False: never


def test_engine_long_context_on_vllm(dry_run):
    needs_vllm()
    report = dry_run("engine_long_context.py", timeout=900)
    assert set(report["decode_seconds_per_token"]) == {"before", "after"}
    for way in report["decode_seconds_per_token"].values():
        assert all(positive(s) for row in way.values() for s in row.values())
    assert report["exact"] and all(report["exact"].values())  # every method, both ways: the local non-SI tokens


def test_engine_sampled_draws_on_vllm(dry_run):
    needs_vllm()
    report = dry_run("engine_sampled_draws.py", timeout=900)
    assert set(report["tokens_per_second"]) == {"greedy", "sampled, whole rows", "sampled, engine draws"}
    assert all(report["exact"].values())
    rows, draws = report["bytes_back_per_draft"]["sampled, whole rows"], report["bytes_back_per_draft"][
        "sampled, engine draws"]
    assert draws["si"] < rows["si"]  # a token a row, not a row of the vocabulary


def test_engine_cancel_and_batching_on_vllm(dry_run):
    needs_vllm()
    report = dry_run("engine_cancel_and_batching.py", timeout=600)
    assert set(report["results"]) == {"vllm", "dsi serve", "dsi serve, 2 slots"}
    for result in report["results"].values():
        assert [b["clients"] for b in result["batching"]] == [1, 2]
        assert all(positive(b["verifications_per_s"]) for b in result["batching"])


def test_embedded_pair_vllm(dry_run):
    needs_vllm()
    report = dry_run("embedded_pair_vllm.py", timeout=600)
    (reference,) = report["reference"]
    for name in ("SI over vLLM", "DSI over vLLM, drafter on vLLM"):
        run = report["runs"][name]
        assert len(run["tokens"][0]) == len(reference) and 0 <= run["acceptance"] <= 1, name
    assert all(positive(s) for costs in report["seconds_per_verification"].values() for s in costs.values())


# Engine at GPU-class forwards and GPU


def test_gpu_forwards(dry_run):
    needs(*HF)
    report = dry_run("gpu_forwards.py")
    (row,) = report["rows"]
    assert row["config"] == "qwen2.5-coder-0.5b-instruct" and positive(row["read_ms"])
    assert set(row["plans"]) == {"dynamic", "static", "graphs"}
    assert all(positive(p["1_ms"]) and positive(p["5_ms"]) for p in row["plans"].values())
    graphs = row["plans"]["graphs"]
    assert all(positive(graphs[f"{kind}_{where}_ms"]) for kind in ("sampled", "penalised", "draft", "logprobs")
               for where in ("host", "device"))
    assert positive(report["bandwidth_gb_s"]) and report["machine"]["torch"]


def test_forward_host_cost(dry_run):
    """A replayed forward's host part (graph replays stood in for): its torch calls are views and the copies in and
    out; no mask, argmax or NaN check is made outside the graph."""
    needs(*HF)
    report = dry_run("forward_host_cost.py")
    assert set(report["rows"]) == {"1", "5"}
    for row in report["rows"].values():
        assert positive(row["host_us"]) and row["torch_calls"] == len(row["calls"])
        assert not set(row["calls"]) & {"arange", "le", "zeros", "masked_fill_", "argmax", "isnan", "where", "any"}
    trees = report["tree_calls"]
    assert set(trees) == {"dynamic", "static"} and all(positive(c["2"]) and c["2"] == c["6"] for c in trees.values())


def test_law_cost(dry_run):
    report = dry_run("law_cost.py")
    rows = report["rows"]
    assert [(r["request"], r["prompt"]) for r in rows] == [(q, p) for p in (10, 100)
                                                            for q in ("sampled", "nucleus", "top-p")]
    assert all(positive(r[key]) for r in rows for key in ("draft_ms", "verification_laws_ms", "device_host_part_ms"))
    assert report["vocab"] == 4096 and report["allocator_tuned"] in (True, False)


def test_tree_forward_cost(dry_run):
    needs(*HF)
    report = dry_run("tree_forward_cost.py")
    assert [r["nodes"] for r in report["rows"]] == [4, 8]
    assert [r["paths"] for r in report["rows"]] == [3, 5]  # the "2" shape: n / 2 + 1 root-to-leaf paths
    assert all(positive(r[key]) for r in report["rows"] for key in ("chain_ms", "tree_ms", "paths_ms"))


# Real models on a CPU, event-driven windows and method auto, drafters of another vocabulary


def lossless(row: dict) -> bool:
    return row["identical"] is True or row.get("near_tie") is True


def test_real_pair(dry_run):
    needs(*HF)
    report = dry_run("real_pair.py")
    rows = report["rows"]
    assert set(rows) == {"non-SI", "SI k=2", "DSI k=2 SP=1", "DSI k=auto SP=1", "HF assisted"}
    assert all(lossless(row) for row in rows.values()), rows  # every method writes non-SI's greedy tokens
    for label, row in rows.items():
        if row["method"] in ("si", "dsi"):
            assert positive(row["engine_over_ideal"]) and 0 <= row["acceptance_rate"] <= 1, label
    assert positive(report["dsi_vs_si"]) and report["skipped"] == []


def test_real_pair_replay(dry_run):
    needs(*HF)
    recording = Path(__file__).resolve().parents[2] / "benchmarks" / "recordings" / "qwen2.5-coder-code-64.json"
    report = dry_run("real_pair.py", "--replay", str(recording), "--cuda-graphs")
    assert report["config"]["pair"][0] == "qwen2.5-coder-1.5b-instruct"
    assert all(row["identical"] for row in report["rows"].values())  # the recorded decisions, replayed


def test_backends(dry_run):
    needs(*LLAMA)
    report = dry_run("backends.py")
    assert {r["backend"] for r in report["rows"]} == {"llama.cpp", "hf"}
    assert all(r["identical"] != "NO" for r in report["rows"])
    assert positive(report["llama_cpp_fastest_over_hf_fastest"])


def test_shared_cpu(dry_run):
    needs(*HF)
    report = dry_run("shared_cpu.py")
    assert set(report["rows"]) == {"SI k=2", "DSI k=2 (idle server)"}
    assert all(positive(r["total_s"]) and not r["identical"].startswith("NO") for r in report["rows"].values())


def test_auto_overhead(dry_run):
    needs(*LLAMA)
    report = dry_run("auto_overhead.py")
    assert set(report["rows"]) == {"in one process", "dsi generate"}
    for row in report["rows"].values():
        assert row["identical"] and positive(row["auto_over_hand"])  # auto's pick, by hand: the same tokens


def test_cross_vocab(dry_run):
    needs(*HF)
    report = dry_run("cross_vocab.py")
    pair = report["pair"]
    assert 0 < pair["vocab_intersection"] < min(pair["target_vocab"], pair["drafter_vocab"])
    greedy = [r for r in report["rows"] if r["temperature"] == 0]
    assert {r["method"] for r in greedy} == {"ar", "si", "uag", "dsi"}
    assert all(r["output"] in ("reference", "identical", "near-tie") for r in greedy), greedy
    assert all(positive(r["engine_over_ideal"]) for r in greedy if r["method"] in ("si", "dsi"))
    sampled = [r for r in report["rows"] if r["temperature"] > 0]
    assert all(r["new_tokens"] == 2 * 6 for r in sampled) and report["skipped"] == []


# Deterministic mode


def test_deterministic_cost(dry_run):
    needs(*LLAMA)
    report = dry_run("deterministic_cost.py")
    assert [r["method"] for r in report["rows"]] == ["non-SI", "SI k=5", "DSI k=auto SP=1"]
    assert all(r["equals_non_si_on"] for r in report["rows"])  # what the mode is for
    assert all(positive(r["cost"]) for r in report["rows"])


def test_row_cuts_llama_cpp(dry_run):
    needs(*LLAMA)
    report = dry_run("row_cuts.py", "llama.cpp")
    assert len(report["rows"]) == 2 * 3 * 2 + 1  # repacking x flash attention x threads, and micro-batches of 1
    for setting, cuts in report["rows"].items():
        assert cuts["token by token: after history vs fresh"] == 0, setting  # the deterministic mode's cut
    assert report["long"]["rows"]["flash_attn=0 threads=1 tokens a forward=1"]["max"] == 0
    assert all(positive(ms) for times in report["forward_ms_by_tokens"].values() for ms in times.values())


def test_row_cuts_hf(dry_run):
    needs(*HF)
    report = dry_run("row_cuts.py", "hf")
    assert set(report["rows"]) == {"bf16", "fp32"}
    assert report["rows"]["fp32"]["token by token: after history vs fresh"] == 0


# Draft trees


def test_tree_acceptance(dry_run):
    needs(*LLAMA)
    report = dry_run("tree_acceptance.py")
    assert [(r["prompts"], r["budget"]) for r in report["results"]] == [(s, b) for s in ("code", "prose")
                                                                         for b in (4, 8, 16)]
    for r in report["results"]:
        assert 1 <= r["chain"] <= r["budget"] + 1 and positive(r["ratio"])
        assert r["model_chain"] <= r["model_best_tree"] + 1e-9  # the chain is one of the trees the bound weighs


def test_tree_walltime(dry_run):
    needs(*LLAMA)
    report = dry_run("tree_walltime.py")  # every output is checked against the recording inside
    assert [(r["cost_model"], r["prompts"]) for r in report["results"]] == [("gpu-like", "code"), ("cpu-like", "code")]
    for r in report["results"]:
        assert all(positive(s) for s in r["median_s"].values()) and r["auto"]["picked"]


def test_tree_walltime_budgets(dry_run):
    needs(*LLAMA)
    report = dry_run("tree_walltime.py", "--budgets", "4")
    (row,) = report["results"]
    assert row["budget"] == 4
    assert all(1 <= row[name] <= 5 for name in ("chain", "best-first", "auto", "branches"))


def test_tree_walltime_exact_si(dry_run):
    needs(*LLAMA)
    report = dry_run("tree_walltime.py", "--exact-si")
    assert [r["cost_model"] for r in report["results"]] == ["gpu-like", "cpu-like"]
    assert all(positive(s) for r in report["results"] for s in r["tree_speedup"].values())


def test_tree_sampled_walltime(dry_run):
    needs(*LLAMA)
    report = dry_run("tree_sampled_walltime.py")  # every timed text is checked against its fill's inside
    (row,) = report["results"]
    assert len(row["configs"]) == 10
    for label, entry in row["configs"].items():
        assert positive(entry["tokens_per_s"]) and entry["tokens"] == 6, label
        if "speedup_over_chain" in entry:
            low, high = entry["interval_90"]
            assert positive(entry["speedup_over_chain"]) and low <= high, label


def test_tree_sampled_acceptance_expected(dry_run):
    needs(*LLAMA)
    report = dry_run("tree_sampled_acceptance.py")
    (row,) = report["results"]
    assert row["budget"] == 4 and row["chain"]["iterations"] > 0
    for tree in ("chain", "auto:0.1", "branches:0.1", "branches:0.05"):
        assert 1 <= row[tree]["tokens_per_verification"] <= 4 + 1, tree  # one token, plus at most B drafts


def test_tree_sampled_acceptance_engine(dry_run):
    needs(*LLAMA)
    report = dry_run("tree_sampled_acceptance.py", "--engine")
    (row,) = report["results"]
    assert all(1 <= row[shape]["tokens_per_verification"] <= 5 for shape in ("off", "auto:0.1", "branches:0.05"))


# Request surface and serving, structured output


def test_request_surface_cost(dry_run):
    needs(*LLAMA, *SERVER)
    report = dry_run("request_surface_cost.py")
    assert len(report["rows"]) == 2 * 5
    for r in report["rows"]:
        if r["kind"] in ("plain", "logprobs", "tiny processing + logprobs"):
            assert r["same_output_as_plain"], r  # logprobs never change what is generated
        assert positive(r["seconds"]) and positive(r["ratio_to_plain"])
    assert all(positive(ms) for ms in report["per_position_ms"].values())


def test_serve_load(dry_run):
    needs(*HF, *SERVER)
    report = dry_run("serve_load.py")
    assert report["identical_across_methods"]
    for run in report["runs"]:
        assert run["completed"] == run["requests"] == 2 and run["lost"] == run["corrupted"] == 0, run
        assert run["server_exit_code"] == 0 and positive(run["throughput_tok_s"])


def test_serve_bench_under_vllms_load_generator(dry_run):
    needs_vllm()
    report = dry_run("serve_bench.py", timeout=600)
    assert set(report["results"]) == {"ar", "default"}
    for name, levels in report["results"].items():
        serving = levels.pop("serving")
        assert serving["method"] in ("ar", "si", "dsi")  # what the server runs, auto's pick included
        (row,) = levels.values()
        assert row["completed"] == 2 and row["failed"] == 0, row
        assert positive(row["output_throughput"]) and positive(row["p50_ttft_ms"]) and positive(row["p50_tpot_ms"])
        assert positive(row["server_cpu_s_per_token"])
        if name == "ar" or serving["method"] == "ar":  # nothing to choose
            assert row["load_picks"] is None
        else:  # the default chooses by load in process: the ways its requests ran, from /metrics
            assert sum(v for k, v in row["load_picks"].items() if not k.startswith("handoffs")) >= 2, row


def test_serve_determinism(dry_run):
    needs(*LLAMA, *SERVER)
    report = dry_run("serve_determinism.py")
    assert set(report["workloads"]) == {"scoring", "short", "chat"} and report["server_exit_codes"] == [0, 0]
    for name, row in report["workloads"].items():
        assert positive(row["default_tok_s"]) and positive(row["deterministic_tok_s"]), name
        assert not row["moved_on_repeat"]["deterministic"], name  # the mode's promise
    assert not report["workloads"]["scoring"]["moved_on_repeat"]["default"]  # one forward: no timing in it


def test_serve_big_prompt(dry_run):
    needs(*HF, *SERVER)
    report = dry_run("serve_big_prompt.py")
    assert len(report["rows"]) == 2 * 3
    for row in report["rows"]:  # 0.2 MB is under either limit, and far over the tiny model's context
        assert (row["status"], row["code"]) == (400, "context_length_exceeded") and row["health_checks"] > 0, row


def test_structured_libs(dry_run):
    needs("transformers", "llguidance")
    report = dry_run("structured_libs.py")
    row = report["rows"]["llguidance"]
    assert row["completed"] and row["rollback"] and positive(row["mask_ms"])
    assert 0 < row["allowed_first"] <= report["vocab"]
    tools = report["tool_schemas"]
    assert [t["tools"] for t in tools] == [8, 32, 128]
    assert all(positive(t["compile_ms"]) for t in tools)
    assert tools[0]["schema_chars"] < tools[1]["schema_chars"] < tools[2]["schema_chars"]


def test_structured_acceptance(dry_run):
    needs(*LLAMA, "llguidance", "jsonschema")
    report = dry_run("structured_acceptance.py")  # every constrained output is validated inside
    assert set(report["rows"]) == {f"{m}{s}" for m in ("ar", "si", "dsi") for s in ("", "-schema")}
    assert all(positive(r["tokens_per_s"]) for r in report["rows"].values())
    assert report["rows"]["si-schema"]["acceptance"] is not None


# Simulators, fresh install


def test_heatmap_speed(dry_run):
    report = dry_run("heatmap_speed.py")
    (result,) = report["results"]
    assert result["configs"] == 3 * 3 * 2 and 0 < result["best_s"] <= result["median_s"]


def test_fresh_install(dry_run):
    report = dry_run("fresh_install.py", timeout=300)
    (run,) = report["runs"]
    assert run["fastest"] == "non-SI" and run["download_s"] == 0.2  # read from the stand-in demo's lines
    assert positive(run["install_s"]) and run["demo_s"] >= 0 and len(report["commit"]) == 40
