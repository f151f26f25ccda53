"""``dsi serve``: the OpenAI-compatible HTTP server (:mod:`dsi.server`) under uvicorn.

Takes every model and engine option of ``dsi generate`` (same parsers) plus the server's; the
sampling options of ``generate`` become the defaults of requests that omit them. Binds to
loopback unless ``--host`` says otherwise. SIGINT / SIGTERM: stop accepting connections, answer
queued requests 503, let running ones finish for up to ``--shutdown-timeout`` seconds (a second
Ctrl-C cuts that short), abort the rest (each still ends its answer: a stream its last events and
``[DONE]``), close every decoder, exit 0 (:mod:`dsi.server.runner`). fastapi / uvicorn are imported
only when the command runs. Every option is checked (an API key included) before any model is
loaded. The API key may come from the environment instead of the command line, where ``ps`` shows it
(:func:`api_key`). The model id shown to clients (``--served-model-name``) defaults to a name, never a
local path (:func:`served_name`).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

from dsi.cli.args import COUNT, NON_NEGATIVE, SCORING_PORT, Number
from dsi.cli.generate import (
    _load,
    add_engine_args,
    add_model_args,
    add_sampling_args,
    auto_options,
    drafter_server,
    server_count,
    target_servers,
    transport_options,
)
from dsi.errors import ConfigError

log = logging.getLogger(__name__)

API_KEY_VARIABLES = ("DSI_API_KEY", "VLLM_API_KEY")  # read in this order when --api-key is not given


def register(subparsers: argparse._SubParsersAction) -> None:
    from dsi.evaluate.bench import SERVE_SCENARIOS

    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, Prometheus metrics)",
        description="Serve a target/drafter pair over HTTP with the OpenAI API (/v1/completions, "
        "/v1/chat/completions, /v1/models), vLLM's /tokenize, /detokenize and /version, plus /health and /metrics. "
                    "Needs: pip install 'dsi[server]'.",
    )
    add_model_args(p)
    add_engine_args(p)
    add_sampling_args(p)
    # the sampling options of generate are the defaults of requests that omit them
    p.set_defaults(max_new_tokens=256, temperature=1.0, seed=None)
    helps = {
        "max_new_tokens": "max_tokens of requests that omit it, clipped to the context (default 256)",
        "temperature": "temperature of requests that omit it (default 1.0, as in the OpenAI API; 0 = greedy)",
        "top_p": "top_p of requests that omit it (default 1.0: off)",
        "top_k": "top_k of requests that omit it (default 0: off)",
        "seed": "seed of requests that omit it (default: a random seed per request)",
    }
    for action in p._actions:
        if action.dest in helps:
            action.help = helps[action.dest]
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=Number(int, 0, 65535), default=8000,
                   help="TCP port (default 8000; 0 picks a free one)")
    g.add_argument("--scoring-port", type=SCORING_PORT, default=0, metavar="PORT|auto|off",
                   help="TCP port of the scoring channel, the fast path of another dsi verifying on this server "
                        "outside HTTP (advertised in the model card; default auto: a free port on --host; off: none, "
                        "such a dsi then verifies through /v1/completions)")
    g.add_argument("--max-concurrent", type=Number(int, 1, 256), default=1,  # dsi.server.config.MAX_SLOTS
                   help="engine slots: requests generated at once, each on its own decoder (1 to 256, default 1)")
    g.add_argument("--max-queue", type=Number(int, 0, 4096), default=64,  # dsi.server.config.MAX_QUEUE
                   help="requests that may wait for a slot, 0 to 4096; more get 429 (default 64)")
    g.add_argument("--speculation-by-load", choices=["auto", "on", "off"], default="auto",
                   help="on: each slot of a speculative server also holds a plain (non-SI) decoder, and each request "
                        "runs the way measured faster at the server's load when it starts, handed over to the other "
                        "mid-generation where that one measured faster (its dsi object's 'load' says which and why; "
                        "/metrics counts them); with SI over --target-servers, each window's lookahead (up to -k) is "
                        "chosen by goodput at the server's load instead, down to plain decoding. off: every request "
                        "speculates the configured way. auto (default): on for in-process backends, off over "
                        "--target-servers")
    g.add_argument("--max-body-bytes", type=COUNT, default=None,
                   help="largest request body in bytes; larger ones get 413 (default 16777216: 16 MiB)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on the /v1 endpoints, /tokenize and /detokenize "
                        "(printable ASCII, no surrounding spaces). Default: the environment variable DSI_API_KEY, "
                        "else VLLM_API_KEY (as vLLM), else none; prefer them, since ps shows the command line")
    g.add_argument("--served-model-name", default=None,
                   help="model id in the API, /health and responses (default: the --target name without its "
                        "directories, e.g. 'my-7b' for ./models/my-7b)")
    g.add_argument("--logprobs-mode", choices=("raw", "processed"), default="raw",
                   help="generated tokens' logprobs: raw (the model's logits, vLLM's default) or processed "
                        "(the law each token was drawn from)")
    g.add_argument("--max-logprobs", type=Number(int, -1), default=20,
                   help="the most logprobs / prompt_logprobs per token a request may ask (default 20, as vLLM; -1: the "
                        "whole vocabulary, which another dsi needs to sample over this server without top_k)")
    g.add_argument("--synthetic", choices=sorted(SERVE_SCENARIOS), metavar="SCENARIO", default=None,
                   help="serve a dsi bench scenario's synthetic model instead of --target (its emulated latency; "
                        "prompts as token ids separated by commas or spaces): with --method ar one model, an engine "
                        "for 'dsi bench --target-servers' or another dsi serve; with a speculative method the "
                        f"scenario's pair. One of {', '.join(SERVE_SCENARIOS)}")
    g.add_argument("--synthetic-role", choices=("target", "drafter"), default="target",
                   help="with --synthetic --method ar: serve the scenario's target (default) or its drafter")
    g.add_argument("--synthetic-steps", type=NON_NEGATIVE, default=None, metavar="TOKEN_MS",
                   help="with --synthetic: the target's forwards, every slot's, share batched steps as a batching "
                        "engine's do (an emulation): a step lasts the scenario's target time plus TOKEN_MS per token "
                        "it computes, and a forward arriving during a step waits for the next (default: none, each "
                        "forward its own time)")
    g.add_argument("--shutdown-timeout", type=NON_NEGATIVE, default=10.0,
                   help="on SIGINT/SIGTERM, seconds running requests may take before they are aborted (default 10; "
                        "a second Ctrl-C aborts them at once); "
                        "an aborted stream still ends with a chunk per choice (finish_reason 'abort'), an error "
                        "event and [DONE], a plain request with a 503")
    p.set_defaults(func=run_serve)


def served_name(target: str) -> str:
    """The default model id for ``--target``: a local path's last component (no directories, no
    ``.gguf``), or the spec itself (an embedded short name or a hub id ``org/name``)."""
    path = Path(target).expanduser()
    try:
        local = path.exists()
    except OSError:
        local = False
    if not local:
        return target
    name = path.resolve().name
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") and len(name) > 5 else name


def api_key(flag: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The API key: ``--api-key`` if given, else ``DSI_API_KEY``, else
    ``VLLM_API_KEY`` (vLLM's variable, for drop-in use), else none. Checked here
    (:func:`~dsi.server.config.check_api_key`, naming its source, never the key); a variable set but
    empty is refused rather than read as "no key", which would serve without one."""
    from dsi.server.config import check_api_key

    if flag is not None:
        key, source = flag, "--api-key"
    else:
        source = next((name for name in API_KEY_VARIABLES if name in environ), "")
        key = environ[source] if source else None
        if key == "":
            raise ConfigError(f"{source} is set but empty: set it to the key, or unset it to serve without one")
    check_api_key(key, source or "--api-key")
    return key


def engine_summary(method: str, lookahead: int | str, sp: int) -> str:
    """How the start-up line describes the engine: non-SI has no lookahead, and only DSI (or auto,
    which may pick it) has target servers in parallel."""
    if method == "ar":
        return "ar"
    if method == "si":
        return f"si, k={lookahead}"
    return f"{method}, k={lookahead}, SP={sp}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); port 0 picks a free port."""
    from dsi.server.runner import listen

    return listen(host, port, 2048, f"--host {host} --port {port}")


def _synthetic_pair(args: argparse.Namespace):
    """``--synthetic``'s (target, drafter), the target's forwards sharing batched steps with ``--synthetic-steps``."""
    from dsi.evaluate.bench import SERVE_SCENARIOS, scenario_pair
    from dsi.models.emulated.latency import WithLatency
    from dsi.models.emulated.steps import SharedSteps

    scenario = SERVE_SCENARIOS[args.synthetic]
    target, drafter = scenario_pair(scenario)
    if args.synthetic_steps is not None:
        steps = SharedSteps(scenario.target_ms / 1000, args.synthetic_steps / 1000)
        target = WithLatency(target.model, target.ttft, target.tpot, steps=steps)
    return target, drafter


def run_serve(args: argparse.Namespace) -> int:
    try:
        from dsi.server import ServeConfig, create_app
        from dsi.server.runner import make_server
    except ImportError as exc:
        raise ConfigError(f"dsi serve needs the server extra: pip install 'dsi[server]' ({exc})") from exc
    key = api_key(args.api_key)
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ConfigError(f"--served-model-name={args.served_model_name!r} must name the model (clients send it)")
    limits = {} if args.max_body_bytes is None else {"max_body_bytes": args.max_body_bytes}
    if args.synthetic is not None and args.method != "ar" and args.synthetic_role != "target":
        raise ConfigError(f"--synthetic-role {args.synthetic_role} serves one model: add --method ar (not --method "
                          f"{args.method}); a speculative method serves the scenario's pair")
    if args.synthetic_steps is not None and args.synthetic is None:
        raise ConfigError("--synthetic-steps batches a synthetic model's forwards: add --synthetic SCENARIO")
    synthetic = (args.synthetic, args.synthetic_role) if args.synthetic is not None else None
    default_name = (served_name(args.target) if synthetic is None
                    else f"synthetic-{args.synthetic}-{args.synthetic_role}")
    config = ServeConfig(
        method=args.method, lookahead=args.lookahead, max_window=args.max_window, num_target_servers=server_count(args),
        transport=args.transport, auto_options=auto_options(args),
        transport_options=transport_options(args), max_concurrent=args.max_concurrent, max_queue=args.max_queue,
        api_key=key, **limits,
        model_name=args.served_model_name or default_name, max_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        shutdown_grace_s=args.shutdown_timeout, vocab_mode=args.vocab_mode, merges=args.merges,
        max_logprobs=args.max_logprobs, logprobs_mode=args.logprobs_mode, draft_tree=args.draft_tree,
        target_servers=tuple(urls) if (urls := target_servers(args)) else None, drafter_server=drafter_server(args),
        synthetic=synthetic, speculation_by_load={"on": True, "off": False}.get(args.speculation_by_load),
    )
    if not _is_loopback(args.host):
        log.warning("dsi serve: listening on %s, reachable from other machines%s", args.host,
                    "" if key else "; consider --api-key or DSI_API_KEY")
    sock = _bind(args.host, args.port)
    scoring = None
    try:
        if args.scoring_port is not None:
            from dsi.server.scoring import bind

            scoring = bind(args.host, args.scoring_port)
        if synthetic is not None:
            from dsi.evaluate.bench import SYNTHETIC_VOCAB
            from dsi.server.codec import IdsCodec

            target, drafter = _synthetic_pair(args)
            if args.method == "ar" and args.synthetic_role == "drafter":
                target, drafter = drafter, None
            app = create_app(target, None if args.method == "ar" else drafter, config,
                             codec=IdsCodec(SYNTHETIC_VOCAB), scoring_socket=scoring)
        else:
            app = create_app(*_load(args, need_drafter=args.method != "ar"), config, free_unused_drafter=True,
                             scoring_socket=scoring)
    except BaseException:
        sock.close()
        if scoring is not None:
            scoring.close()
        raise
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    server = make_server(app, graceful_s=args.shutdown_timeout, log_level="info" if args.verbose else "warning",
                         access_log=bool(args.verbose))
    engine = engine_summary(config.method, config.lookahead, config.num_target_servers)
    print(f"dsi serve: {config.model_name!r} ({engine}, {config.max_concurrent} slot(s)) on http://{shown}:{port}/v1"
          + (f", scoring channel on port {scoring.getsockname()[1]}" if scoring is not None else ""),
          file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        if scoring is not None:
            scoring.close()
    if not server.started:
        print("dsi serve: the server did not start (see the log above)", file=sys.stderr)
        return 2
    print("dsi serve: shut down cleanly", file=sys.stderr, flush=True)
    return 0
