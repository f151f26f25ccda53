"""Which constrained-decoding library dsi should build structured output on (issue 52, part 3), by measurement:
xgrammar, llguidance and outlines-core on Qwen2.5's tokenizer (151,936 ids, read from the embedded pair's GGUF).

For each library: the tokenizer's setup; the compile time of a typical JSON schema (an object of six fields: a
string, an integer with a minimum, an enum, an array of strings, a nested object with a pattern, a boolean) and
of a regex; the time of one next-token mask over the whole vocabulary, median over the tokens of a valid
instance walked token by token (each mask, then the token consumed); whether the matcher rolls back (checked:
after k tokens and a rollback of k, the mask is the one before), and what ``pip`` would install with it. Then
dsi's own compile of a ``tool_choice: "required"`` schema over ``--tools`` N functions, and its first mask.

    python benchmarks/structured_libs.py --out docs/data/structured_libs-DATE.json

Each library is optional: one that does not import is reported as missing. Needs transformers (the tokenizer)
and the embedded pair's GGUF in the cache (``dsi demo`` fetches it). ``--dry-run``: the tiny byte-level BPE
tokenizer of tests/tiny_hf.py instead of Qwen's, no pip footprint.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from _common import add_options, emit, parse, shrink

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address", "active"],
    "additionalProperties": False,
}
INSTANCE = ('{"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "engines", "notes"], '
            '"address": {"city": "London", "zip": "12345"}, "active": true}')
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4}"
ROLLBACK = 4


def tokenizer():
    import transformers

    from dsi.models.cache import cache_dir

    folder = cache_dir() / "gguf"
    name = "qwen2.5-coder-0.5b-instruct.gguf"
    if not (folder / name).is_file():
        raise SystemExit(f"{folder / name} is missing: run `dsi demo` once to fetch the embedded pair")
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def xgrammar_case(tok, vocab: int, ids: list[int]) -> dict:
    import numpy as np
    import torch
    import xgrammar as xgr

    info, setup = _timed(lambda: xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiled, schema_s = _timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    _, regex_s = _timed(lambda: compiler.compile_regex(REGEX))
    matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=ROLLBACK)
    mask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for token in ids:
        _, s = _timed(lambda: matcher.fill_next_token_bitmask(mask))
        times.append(s)
        assert matcher.accept_token(token), f"xgrammar refused token {token}"
    completed = matcher.is_completed() or matcher.accept_token(tok.eos_token_id)
    matcher.reset()
    for token in ids[:5]:
        matcher.accept_token(token)
    matcher.fill_next_token_bitmask(mask)
    before = mask.clone()
    for token in ids[5:5 + ROLLBACK]:
        matcher.accept_token(token)
    matcher.rollback(ROLLBACK)
    matcher.fill_next_token_bitmask(mask)
    return {"tokenizer_setup_s": setup, "schema_compile_s": schema_s, "regex_compile_s": regex_s,
            "mask_ms": 1e3 * statistics.median(times), "mask_ms_max": 1e3 * max(times), "completed": bool(completed),
            "rollback": bool(torch.equal(before, mask)), "allowed_first": int(np.unpackbits(
                before.numpy().view(np.uint8)).sum())}


def llguidance_case(tok, vocab: int, ids: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import numpy as np

    info, setup = _timed(lambda: llguidance.hf.from_tokenizer(tok, n_vocab=vocab))
    grammar, schema_s = _timed(lambda: llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    matcher, first_s = _timed(lambda: llguidance.LLMatcher(info, grammar))
    _, regex_s = _timed(lambda: llguidance.LLMatcher(info, llguidance.LLMatcher.grammar_from_regex(REGEX)))
    assert not matcher.is_error(), matcher.get_error()
    times = []
    for token in ids:
        bits, s = _timed(lambda: matcher.compute_bitmask())
        times.append(s)
        assert matcher.consume_token(token), f"llguidance refused token {token}: {matcher.get_error()}"
    completed = matcher.is_accepting()
    matcher.reset()
    for token in ids[:5]:
        matcher.consume_token(token)
    before = bytes(matcher.compute_bitmask())
    for token in ids[5:5 + ROLLBACK]:
        matcher.consume_token(token)
    matcher.rollback(ROLLBACK)
    after = bytes(matcher.compute_bitmask())
    return {"tokenizer_setup_s": setup, "schema_compile_s": schema_s + first_s, "regex_compile_s": regex_s,
            "mask_ms": 1e3 * statistics.median(times), "mask_ms_max": 1e3 * max(times), "completed": bool(completed),
            "rollback": before == after,
            "allowed_first": int(np.unpackbits(np.frombuffer(before, dtype=np.uint8)).sum())}


def outlines_case(tok, vocab: int, ids: list[int]) -> dict:
    import numpy as np
    import outlines_core
    import torch

    def build():  # the tokens' text (byte-level BPE symbols decoded), as outlines' own adapter gives it
        tokens: dict[str, list[int]] = {}
        eos = tok.eos_token_id
        for token, i in tok.get_vocab().items():
            if i != eos and i < vocab:
                tokens.setdefault(tok.convert_tokens_to_string([token]), []).append(i)
        return outlines_core.Vocabulary(eos, tokens)

    vocabulary, setup = _timed(build)
    regex, _ = _timed(lambda: outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA)))
    index, schema_s = _timed(lambda: outlines_core.Index(regex, vocabulary))
    _, regex_s = _timed(lambda: outlines_core.Index(REGEX, vocabulary))
    guide = outlines_core.Guide(index, max_rollback=ROLLBACK)
    mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    times = []
    for token in ids:
        _, s = _timed(lambda: guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size()))
        times.append(s)
        guide.advance(token)
    completed = guide.is_finished()
    guide.reset()
    for token in ids[:5]:
        guide.advance(token)
    guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
    before = mask.clone()
    for token in ids[5:5 + ROLLBACK]:
        guide.advance(token)
    guide.rollback_state(ROLLBACK)
    guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
    return {"tokenizer_setup_s": setup, "schema_compile_s": schema_s, "regex_compile_s": regex_s,
            "mask_ms": 1e3 * statistics.median(times), "mask_ms_max": 1e3 * max(times), "completed": bool(completed),
            "rollback": bool(torch.equal(before, mask)),
            "allowed_first": int(np.unpackbits(before.numpy().view(np.uint8)).sum())}


CASES = {"xgrammar": xgrammar_case, "llguidance": llguidance_case, "outlines-core": outlines_case}


def tool(i: int) -> dict:
    """A function of eight parameters of mixed types (strings, numbers, enums, arrays, objects), as agents send."""
    kinds = [{"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
             {"type": "string", "enum": [f"opt{k}" for k in range(20)]},
             {"type": "array", "items": {"type": "string"}, "maxItems": 5},
             {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}]
    props = {f"p{j}": kinds[(i * 3 + j) % len(kinds)] for j in range(8)}
    return {"type": "function", "function": {"name": f"tool_{i}", "description": f"tool number {i}", "parameters": {
        "type": "object", "properties": props, "required": list(props)[:4]}}}


def tool_costs(tok, vocab: int, counts: list[int]) -> list[dict]:
    """What dsi's own compile of ``tool_choice: "required"`` over N tools costs (dsi.server.tools builds the schema,
    dsi.constraints compiles it within its LIMITS), and its first mask; the vocabulary's own setup (once per
    vocabulary, about 0.3 s at 152k ids) is done before."""
    from dsi.constraints import BoundConstraint, Constraint, TokenTable
    from dsi.server.protocol import ChatCompletionRequest, validate_request
    from dsi.server.tools import tool_calling

    table = TokenTable.of_tokenizer(tok, vocab, [tok.eos_token_id])
    BoundConstraint(Constraint.json_object(), table)  # the vocabulary's matcher tokenizer, once per vocabulary
    rows = []
    for n in counts:
        request = validate_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                                           "tools": [tool(i) for i in range(n)],
                                                           "tool_choice": "required"})
        schema = tool_calling(request).schema
        bound, compile_s = _timed(lambda: BoundConstraint(Constraint.json_schema(schema), table))
        _, mask_s = _timed(lambda: bound.allowed([]))
        rows.append({"tools": n, "schema_chars": len(json.dumps(schema)), "compile_ms": 1e3 * compile_s,
                     "first_mask_ms": 1e3 * mask_s})
    return rows


def install_footprint(name: str) -> dict:
    """What ``pip install NAME`` would add to an empty environment (pip's dry-run report)."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as report:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                               "--report", report.name, name], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            return {"error": done.stderr.strip().splitlines()[-1:] or ["pip failed"]}
        packages = sorted(i["metadata"]["name"] for i in json.load(open(report.name))["install"])
    heavy = [p for p in packages if p.lower() in ("torch", "triton") or p.lower().startswith(("nvidia-", "cuda-"))]
    return {"packages": len(packages), "names": packages, "pulls_torch_or_cuda": heavy}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--library", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--no-footprint", action="store_true", help="skip pip's dry runs (they need the index)")
    parser.add_argument("--tools", type=int, nargs="*", default=[8, 32, 128],
                        help="also time dsi's compile of tool_choice 'required' over this many tools (none: skip)")
    add_options(parser, "the tiny tokenizer of tests/tiny_hf.py (320 ids), no pip footprint")
    args = parse(parser)
    if shrink(args, no_footprint=True):
        from tests.tiny_hf import make_tokenizer

        tok = make_tokenizer()
    else:
        tok = tokenizer()
    vocab = len(tok) if args.dry_run else 151936
    ids = tok.encode(INSTANCE)
    rows = {}
    for name in args.library:
        try:
            rows[name] = CASES[name](tok, vocab, ids)
        except ImportError as exc:
            rows[name] = {"error": f"not installed: {exc}"}
        except Exception as exc:  # noqa: BLE001 - one library's failure is a result, the others still run
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"}
        if not args.no_footprint:
            rows[name]["install"] = install_footprint(name)
    print(f"{'a tiny' if args.dry_run else 'Qwen2.5'} tokenizer, V = {vocab}; a {len(ids)}-token instance of a "
          "six-field schema")
    print("| library | tokenizer setup s | schema compile ms | regex compile ms | mask ms (median, max) | rollback | "
          "pip installs |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        install = r.get("install", {})
        pulls = f"{install.get('packages', '?')} packages" + (
            f", incl. {', '.join(install['pulls_torch_or_cuda'][:3])}..." if install.get("pulls_torch_or_cuda") else "")
        if "error" in r:
            print(f"| {name} | {r['error'][:80]} ||||| {pulls} |")
            continue
        print(f"| {name} | {r['tokenizer_setup_s']:.2f} | {1e3 * r['schema_compile_s']:.1f} | "
              f"{1e3 * r['regex_compile_s']:.1f} | {r['mask_ms']:.3f}, {r['mask_ms_max']:.3f} | "
              f"{'yes' if r['rollback'] else 'NO'} | {pulls} |")
    tools = tool_costs(tok, vocab, args.tools) if args.tools else []
    if tools:
        print("\ndsi's compile of tool_choice 'required' (dsi.server.tools, dsi.constraints), 8 parameters a tool")
        print("| tools | schema characters | compile ms | first mask ms |")
        print("|---|---|---|---|")
        for r in tools:
            print(f"| {r['tools']} | {r['schema_chars']:,} | {r['compile_ms']:.1f} | {r['first_mask_ms']:.2f} |")
    emit({"benchmark": "structured_libs", "vocab": vocab, "instance_tokens": len(ids), "schema": SCHEMA,
          "rows": rows, "tool_schemas": tools}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
