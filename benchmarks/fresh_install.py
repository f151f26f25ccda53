"""Time the README's first command on a fresh machine: install, download and demo, from nothing.

Each run clones this repository's HEAD into a new folder, makes a new virtual environment, and runs
the README's first quick-start command exactly as written, with an empty pip cache
(``PIP_CACHE_DIR`` in the run's folder, ``PIP_NO_CACHE_DIR`` too) and an empty model cache
(``DSI_CACHE_DIR``, which holds the autotune cache as well). The command's two halves are timed
apart (``A && B``: A is the install, B the demo); the demo's own line ``loaded in X s`` gives the
download and assembly of the model pair, so the demo proper is B minus that.

    python benchmarks/fresh_install.py --runs 3 --out docs/data/fresh_install-2026-12-01.json

Prints a table, then one JSON line. Runs take minutes each and use every core: run it on a quiet
machine, and nothing else beside it. ``--dry-run``: one run, the clone and the virtual environment as in a real
run, but a stand-in command of the same form (``pip --version`` for the install, a demo that prints the two
lines the run reads) instead of the README's, which installs and downloads.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, add_options, emit, parse, shrink

DRY_RUN_COMMAND = ("python -m pip --version && python -c \"import time; time.sleep(0.3); print('loaded in 0.2 s'); "
                   "print('fastest here: non-SI (a stand-in)')\"")


def readme_first_command(readme: Path = ROOT / "README.md") -> str:
    """The first command of the README's quick start (the line before its ``#`` comment)."""
    text = readme.read_text(encoding="utf-8")
    block = re.search(r"## Quick start.*?```bash\n(.*?)```", text, re.S)
    if not block:
        raise SystemExit("README.md has no ```bash block under '## Quick start'")
    first = block.group(1).strip().splitlines()[0]
    return first.split("  #")[0].strip()


def one_run(command: str, index: int, keep: bool) -> dict:
    install, _, demo = command.partition(" && ")
    if not demo:
        raise SystemExit(f"the first command {command!r} is not 'INSTALL && DEMO'")
    work = Path(tempfile.mkdtemp(prefix=f"dsi-fresh-{index}-"))
    subprocess.run(["git", "clone", "-q", str(ROOT), str(work / "dsi")], check=True)
    subprocess.run([sys.executable, "-m", "venv", str(work / "venv")], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "DSI_", "VIRTUAL_ENV"))}
    env.update(PIP_CACHE_DIR=str(work / "pip-cache"), PIP_NO_CACHE_DIR="1", DSI_CACHE_DIR=str(work / "dsi-cache"),
               VIRTUAL_ENV=str(work / "venv"), PATH=f"{work / 'venv' / 'bin'}:{env.get('PATH', '')}",
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    times, outputs = {}, {}
    for part, cmd in (("install", install), ("demo", demo)):
        began = time.perf_counter()
        proc = subprocess.run(["bash", "-c", cmd], cwd=work / "dsi", env=env, capture_output=True, text=True)
        times[part] = time.perf_counter() - began
        outputs[part] = proc.stdout + proc.stderr
        if proc.returncode not in (0, 1):  # the demo exits 1 when outputs depart beyond near-ties
            sys.stderr.write(outputs[part][-4000:])
            raise SystemExit(f"run {index}: {cmd!r} exited {proc.returncode}")
    loaded = re.search(r"loaded in ([0-9.]+) s", outputs["demo"])
    download = float(loaded.group(1)) if loaded else None
    fastest = re.search(r"fastest here: ([^(]+)\(", outputs["demo"])
    if not keep:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    return {"run": index, "total_s": times["install"] + times["demo"], "install_s": times["install"],
            "download_s": download, "demo_s": times["demo"] - (download or 0.0), "demo_command_s": times["demo"],
            "fastest": fastest.group(1).strip() if fastest else None, "work": str(work) if keep else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep each run's folder")
    add_options(parser, "one run of a stand-in command (pip --version && a demo's two lines) in the clone's venv")
    args = parse(parser)
    if args.runs < 1:
        parser.error(f"--runs={args.runs} must be >= 1")
    command = readme_first_command()
    if shrink(args, runs=1):
        command = DRY_RUN_COMMAND
    print(f"command: {command}", flush=True)
    runs = []
    for i in range(1, args.runs + 1):
        runs.append(one_run(command, i, args.keep))
        r = runs[-1]
        print(f"run {i}: total {r['total_s']:.0f} s = install {r['install_s']:.0f} + download "
              f"{r['download_s'] or 0:.0f} + demo {r['demo_s']:.0f}", flush=True)
    keys = ("total_s", "install_s", "download_s", "demo_s")
    median = {k: statistics.median(r[k] or 0.0 for r in runs) for k in keys}
    print("\n| run | total | install (compile included) | download + assembly | demo |")
    print("|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['run']} | {r['total_s']:.0f} s | {r['install_s']:.0f} s | {r['download_s'] or 0:.0f} s | "
              f"{r['demo_s']:.0f} s |")
    print(f"| median | {median['total_s']:.0f} s | {median['install_s']:.0f} s | {median['download_s']:.0f} s | "
          f"{median['demo_s']:.0f} s |")
    emit({"command": command, "runs": runs, "median": median,
          "commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                                   text=True).stdout.strip()}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
