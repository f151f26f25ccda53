"""The prepared GPU run's report: benchmarks/gpu_check.sh's files as docs/results.md's tables and issue 51's goals.

    python benchmarks/gpu_report.py results/            # a gpu_check.sh output folder; prints Markdown

gpu_check.sh runs it last (``report.md`` in its folder); run it again on the files a run brought back. It reads
``machine.txt``, ``forwards.json`` (benchmarks/gpu_forwards.py) and the three engine parts of real_pair.py
(``pair_graphs.json``, ``target14b_graphs.json``, ``target14b.json``); a file that is missing (a part cut off
before it wrote) is said, and the goals that need it read "not measured". It prints:

- the machine: the card, its memory and driver, the software;
- each forward (1 token and a verification) per architecture and plan against its weights' read time at the
  bandwidth measured in the same run, and the capture time (a size's first forward with graphs, less a replay);
- a verification and a drafter's draw decided on the host and on the device;
- each engine part's rows: time, tokens per second, ratios to non-SI and the best SI, engine / ideal, the
  forwards as they ran, the GPU's utilisation, and whether the output was non-SI's;
- tokens per second of non-SI, the best SI and the best DSI next to the bandwidth limit (one read of the
  target's weights a token: what a plain decoder at batch 1 cannot beat);
- issue 51's goals, each with its number and whether it is met: a goal measured "with graphs" where the graphs
  fell back to eager forwards (a forward that captured none; a part whose ``run.log`` section says a capture
  failed or graphs could not run) is not met or missed, but "eager, not graphs".

``--json FILE`` also writes the goals and the tokens-per-second lines. Reads only; measures nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

PARTS = {  # file stem -> what it holds
    "pair_graphs": "the embedded pair (1.5B target, 0.5B drafter), with CUDA graphs",
    "target14b_graphs": "the 14B target with the 0.5B drafter, with CUDA graphs",
    "target14b": "the 14B target with the 0.5B drafter, eager (the baseline)",
}
DRAFTER, TARGET, TARGET_14B = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "qwen2.5-14b-instruct"
FELL_BACK = ("could not be captured", "runs its forwards eagerly")  # dsi.models.hf.forward_plan's warnings


@dataclass
class Goal:
    goal: str
    measured: str  # the number and what it came from, or "not measured"
    met: bool | None  # None: not measured


def load(folder: Path) -> dict:
    """The run's files that exist: ``{"machine": text, "forwards": dict, PART: dict}``, and ``"missing"``."""
    found: dict = {"missing": []}
    machine = folder / "machine.txt"
    found["machine"] = machine.read_text() if machine.exists() else ""
    for stem in ("forwards", *PARTS):
        path = folder / f"{stem}.json"
        try:
            found[stem] = json.loads(path.read_text())
        except (OSError, ValueError):
            found["missing"].append(path.name)
    log = folder / "run.log"
    found["fallbacks"] = fallbacks(log.read_text(errors="replace") if log.exists() else "")
    return found


def fallbacks(log: str) -> dict[str, list[str]]:
    """Per part of a ``run.log`` (its ``== part NAME`` sections), the distinct lines that say CUDA graphs fell
    back to eager forwards."""
    out: dict[str, list[str]] = {}
    part = None
    for line in log.splitlines():
        if line.startswith("== part "):
            part = line[len("== part "):].split(":")[0].strip()
        elif part is not None and any(words in line for words in FELL_BACK):
            said = out.setdefault(part, [])
            if line.strip() not in said:
                said.append(line.strip())
    return out


def tokens_per_s(report: dict, row: dict) -> float:
    """A row's new tokens a second: the tokens per prompt times the prompts it ran, over its total time."""
    return report["config"]["tokens"] * len(row["per_prompt_s"]) / row["total_s"]


def best(rows: dict, method: str) -> tuple[str, dict] | None:
    """The fastest row of ``method`` whose output was non-SI's (a wrong output wins nothing)."""
    fits = [(label, r) for label, r in rows.items() if r["method"] == method and r["identical"]]
    return min(fits, key=lambda lr: lr[1]["total_s"]) if fits else None


def _measured(found: dict, config: str, plan: str) -> dict | None:
    """The forwards' row of ``config`` where it measured ``plan``."""
    for row in found.get("forwards", {}).get("rows", []):
        if row["config"] == config and plan in row.get("plans", {}):
            return row
    return None


def forward_ms(found: dict, config: str, plan: str = "graphs", n: str = "1") -> tuple[float, float] | None:
    """``(forward ms, read ms)`` of ``config``'s forward of ``n`` tokens on ``plan``, where it was measured (with
    graphs: only where they were captured; else the forward was eager)."""
    row = _measured(found, config, plan)
    if row is None or (plan == "graphs" and _eager(found, config)):
        return None
    return row["plans"][plan][f"{n}_ms"], row["read_ms"]


def _eager(found: dict, config: str) -> bool:
    """Whether ``config``'s forwards in the graphs plan were measured but captured no graph."""
    row = _measured(found, config, "graphs")
    return row is not None and not row["plans"]["graphs"].get("captured")


def goals(found: dict) -> list[Goal]:
    """Issue 51's goals on the GPU, each from the numbers of this run."""
    out = []
    no_graph = "eager, not graphs: no graph was captured"
    for config, name, most in ((TARGET_14B, "the 14B target's", 1.5), (TARGET, "the 1.5B target's", 3.0)):
        got = forward_ms(found, config)
        out.append(Goal(f"{name} one-token forward with graphs at most {most}x its weights' read time",
                        f"{got[0] / got[1]:.2f}x ({got[0]:.2f} ms against {got[1]:.2f} ms)" if got else
                        no_graph if _eager(found, config) else "not measured",
                        got[0] / got[1] <= most if got else None))
    got = forward_ms(found, DRAFTER)
    out.append(Goal("the drafter's step with graphs at most 3 ms", f"{got[0]:.2f} ms" if got else
                    no_graph if _eager(found, DRAFTER) else "not measured", got[0] <= 3.0 if got else None))
    engine = len(out)
    graphs, eager = found.get("target14b_graphs"), found.get("target14b")
    plain = [r["rows"].get("non-SI") if r else None for r in (graphs, eager)]
    if all(p is not None and p["identical"] for p in plain):
        ratio = tokens_per_s(graphs, plain[0]) / tokens_per_s(eager, plain[1])
        out.append(Goal("non-SI with graphs at least 3x the tokens per second of eager non-SI (14B)",
                        f"{ratio:.2f}x ({tokens_per_s(graphs, plain[0]):.1f} against "
                        f"{tokens_per_s(eager, plain[1]):.1f} tokens/s)", ratio >= 3.0))
    else:
        out.append(Goal("non-SI with graphs at least 3x the tokens per second of eager non-SI (14B)",
                        "not measured", None))
    rows = graphs["rows"] if graphs else {}
    dsi, si, ar = best(rows, "dsi"), best(rows, "si"), best(rows, "ar")
    for other, name, least in ((si, "SI", 1.3), (ar, "non-SI", 1.8)):
        text = f"DSI (its best SP and transport) at least {least}x faster than {name} with graphs (14B)"
        if dsi and other:
            ratio = other[1]["total_s"] / dsi[1]["total_s"]
            out.append(Goal(text, f"{ratio:.2f}x ({dsi[0]} against {other[0]})", ratio >= least))
        else:
            out.append(Goal(text, "not measured", None))
    ideal = dsi[1].get("engine_over_ideal") if dsi else None
    out.append(Goal("that DSI row's engine / ideal at most 1.15", f"{ideal:.2f}" if ideal else "not measured",
                    ideal <= 1.15 if ideal else None))
    if "target14b_graphs" in found.get("fallbacks", {}):  # its "graphs" rows ran (some) forwards eagerly
        out[engine:] = [Goal(g.goal, g.measured if g.met is None else
                             f"{g.measured}; eager, not graphs: the part's log says graphs fell back", None)
                        for g in out[engine:]]
    return out


def speed_lines(found: dict) -> list[dict]:
    """Per engine part: tokens per second of non-SI, the best SI and the best DSI, and the bandwidth limit (one
    read of the target's weights a token)."""
    out = []
    for stem in PARTS:
        report = found.get(stem)
        if not report:
            continue
        rows, target = report["rows"], report["config"]["pair"][0]
        read = forward_ms(found, target, "dynamic")
        line = {"part": stem, "target": target, "bandwidth_limit_tok_s": 1e3 / read[1] if read else None}
        for key, pick in (("non_si", ("non-SI", rows["non-SI"]) if "non-SI" in rows else None),
                          ("si", best(rows, "si")), ("dsi", best(rows, "dsi"))):
            line[f"{key}_tok_s"] = tokens_per_s(report, pick[1]) if pick else None
            line[f"{key}_row"] = pick[0] if pick else None
        out.append(line)
    return out


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def markdown(found: dict) -> str:
    lines = []
    machine = [ln for ln in found["machine"].splitlines() if ln.strip()]
    forwards = found.get("forwards", {})
    lines += [f"Date: {forwards.get('date', '-')}. Machine: " + ("; ".join(machine) if machine else "no machine.txt")]
    if found["missing"]:
        lines.append(f"Missing (a part cut off before it wrote, or failed): {', '.join(found['missing'])}.")
    for part, said in found.get("fallbacks", {}).items():
        lines.append(f"**Graphs fell back to eager forwards** in part {part}: " + " / ".join(said[:3]))
    if forwards:
        lines += ["", f"Forwards ({forwards['dtype']}, random weights, after {forwards['prefix']} cached tokens, "
                  f"median of {forwards['repeats']}; copy bandwidth {forwards['bandwidth_gb_s']:.0f} GB/s, read and "
                  "write; capture: a size's first forward with graphs less a replay; graph alone: its replay "
                  "without the host's part of a forward), ms:", "",
                  f"| architecture | weights GB | read ms | plan | 1 token | x read | {forwards['tokens']} tokens | "
                  "capture (1, n) | graph alone (1, n) | graphs |", "|---|---|---|---|---|---|---|---|---|---|"]
        n = str(forwards["tokens"])
        for row in forwards["rows"]:
            if "error" in row:
                lines.append(f"| {row['config']} | {row['error'][:80]} |||||||||")
                continue
            for plan, r in row["plans"].items():
                capture = (f"{r['first_1_ms'] - r['1_ms']:.0f}, {r[f'first_{n}_ms'] - r[f'{n}_ms']:.0f}"
                           if r["captured"] else "-")  # none captured: eager forwards, no capture to time
                alone = (f"{r['replay_1_ms']:.2f}, {r[f'replay_{n}_ms']:.2f}"
                         if f"replay_{n}_ms" in r and "replay_1_ms" in r else "-")
                lines.append(f"| {row['config']} | {row['weights_gb']:.2f} | {row['read_ms']:.2f} | {plan} | "
                             f"{r['1_ms']:.2f} | {r['1_ms'] / row['read_ms']:.1f} | {r[f'{n}_ms']:.2f} | {capture} | "
                             f"{alone} | {r['captured']} |")
        lines += ["", "Decided on the host | on the device (graphs plan; forward and decision, ms): a sampled "
                  f"{n}-token verification (T 0.7, top_k 20, top_p 0.8), a penalised greedy one, a drafter's step "
                  "with its draw, the sampled one with logprobs=5:", "",
                  "| architecture | sampled | penalised | draft | logprobs |", "|---|---|---|---|---|"]
        for row in forwards["rows"]:
            g = row.get("plans", {}).get("graphs", {})
            if "sampled_host_ms" in g:
                cells = [f"{g[f'{k}_host_ms']:.2f} / {g[f'{k}_device_ms']:.2f}"
                         for k in ("sampled", "penalised", "draft", "logprobs")]
                lines.append(f"| {row['config']} | " + " | ".join(cells) + " |")
    for stem, what in PARTS.items():
        report = found.get(stem)
        if not report:
            continue
        rows = report["rows"]
        base = rows["non-SI"]["total_s"] if "non-SI" in rows else None
        si = best(rows, "si")
        config = report["config"]
        lines += ["", f"{what} ({stem}.json: {len(rows['non-SI']['per_prompt_s']) if base else '?'} prompts x "
                  f"{config['tokens']} tokens, median of {config['repeats']}; "
                  + (f"skipped at the deadline: {', '.join(report['skipped'])}" if report.get("skipped") else
                     "every configuration ran") + "):", "",
                  "| row | total s | tokens/s | vs non-SI | vs best SI | accept | engine/ideal | target ms | "
                  "drafter ms | GPU % | identical |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for label, r in rows.items():
            ms = lambda key, r=r: _num(r.get(key) * 1e3 if r.get(key) else None, 1)  # noqa: E731
            lines.append(f"| {label} | {r['total_s']:.2f} | {tokens_per_s(report, r):.1f} | "
                         f"{_num(base / r['total_s'] if base else None)} | "
                         f"{_num(si[1]['total_s'] / r['total_s'] if si else None)} | "
                         f"{_num(r.get('acceptance_rate'))} | {_num(r.get('engine_over_ideal'))} | "
                         f"{ms('target_forward_in_run_s')} | {ms('drafter_forward_in_run_s')} | "
                         f"{_num(r.get('gpu_utilisation_pct'), 0)} | {'yes' if r['identical'] else 'NO'} |")
    speeds = speed_lines(found)
    if speeds:
        lines += ["", "Tokens per second (best rows whose output was non-SI's) against the bandwidth limit (one read "
                  "of the target's weights a token):", "",
                  "| part | non-SI | best SI | best DSI | bandwidth limit |", "|---|---|---|---|---|"]
        for s in speeds:
            lines.append(f"| {s['part']} | {_num(s['non_si_tok_s'], 1)} | {_num(s['si_tok_s'], 1)} ({s['si_row']}) | "
                         f"{_num(s['dsi_tok_s'], 1)} ({s['dsi_row']}) | {_num(s['bandwidth_limit_tok_s'], 1)} |")
    lines += ["", "Issue 51's goals:", "", "| goal | measured | met |", "|---|---|---|"]
    for g in goals(found):
        lines.append(f"| {g.goal} | {g.measured} | {'-' if g.met is None else ('yes' if g.met else 'no')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a gpu_check.sh output folder ($OUT, or results/)")
    parser.add_argument("--json", metavar="FILE", help="also write the goals and tokens-per-second lines as JSON")
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    if not folder.is_dir():
        print(f"{folder}: no such folder (pass gpu_check.sh's output folder)", file=sys.stderr)
        return 2
    found = load(folder)
    sys.stdout.write(markdown(found))
    if args.json:
        Path(args.json).write_text(json.dumps({"goals": [asdict(g) for g in goals(found)],
                                               "speeds": speed_lines(found), "missing": found["missing"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
