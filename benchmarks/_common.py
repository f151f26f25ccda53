"""What the benchmark programs share: the repository on the import path, the ``--out`` and ``--dry-run``
options, the machine a run was on, medians of timed runs, the one JSON line a run ends with, and the tiny
models a dry run uses instead of real ones.

A program imports this module before anything of dsi (``from _common import ...``: Python puts the
program's folder, benchmarks/, first on the import path), so that the test helpers it builds tiny models
with (``tests.tiny_hf``, ``tests.tiny_gguf``, ``tests.engine_servers``) import from this checkout, and dsi
too where none is installed (``PYTHONPATH=<another checkout>/src`` times that checkout's code).

A dry run (``--dry-run``) checks that a program still runs; it measures nothing. It takes the program's
own code path on tiny models built from config (two layers of width 32: tests/tiny_hf.py,
tests/tiny_gguf.py, benchmarks/tiny_configs.py; synthetic models for the engine's programs) with a few
tokens, in seconds, and downloads nothing. tests/benchmarks runs every program's dry run, so that none
rots between the rare real runs.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # this checkout's tests' helpers
    sys.path.insert(0, str(ROOT))
if importlib.util.find_spec("dsi") is None:  # not installed: this checkout's (PYTHONPATH=<a checkout>/src wins)
    sys.path.append(str(ROOT / "src"))


def add_options(parser: argparse.ArgumentParser, dry_run: str, out_default: str | None = None) -> None:
    """``--out`` (the JSON report's file) and ``--dry-run`` (``dry_run`` says what it runs)."""
    parser.add_argument("--out", type=Path, default=out_default, help="also write the JSON report here")
    parser.add_argument("--dry-run", action="store_true", help=f"check that the program runs, measure nothing: "
                        f"{dry_run}")


def add_pair_options(parser: argparse.ArgumentParser) -> None:
    """``--target``, ``--drafter`` (the embedded pair by default), ``--backend`` and ``--dtype``: the pair a
    program loads with :func:`dsi.models.loading.load_pair`."""
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--backend", default="llama.cpp", choices=["llama.cpp", "hf"])
    parser.add_argument("--dtype", default=None, help="hf only (default bf16)")


def parse(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """``parser``'s arguments, ``--out``'s folder made now (``--out results/x.json``), not found missing after a
    long run; refused at once where it cannot be made."""
    args = parser.parse_args(argv)
    out = getattr(args, "out", None)
    if out is not None:
        try:
            Path(out).resolve().parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            parser.error(f"--out={str(out)!r}: its folder cannot be made: {exc}")
    return args


def shrink(args: argparse.Namespace, **small) -> bool:
    """With ``--dry-run``, set ``args``' attributes to a dry run's ``small`` sizes. Returns ``args.dry_run``."""
    if args.dry_run:
        for name, value in small.items():
            setattr(args, name, value)
    return args.dry_run


def git_commit() -> str | None:
    """This checkout's commit (short), ``+`` when its files differ from it; None outside git."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+" if dirty else "")) or None


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def machine() -> dict:
    """The machine and software a run was on: :func:`dsi.evaluate.bench.machine_info` (Python, platform, CPUs),
    the CPU's model, torch and the GPU where the program imported torch, dsi's version and commit."""
    from importlib import metadata

    from dsi.evaluate.bench import machine_info

    info = {**machine_info(), "cpu": cpu_model()}
    torch = sys.modules.get("torch")  # a program that never imported torch (the simulators) does not pay for it
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    try:
        info["dsi"] = metadata.version("dsi")
    except metadata.PackageNotFoundError:
        info["dsi"] = None
    info["commit"] = git_commit()
    return info


def write_json(out: str | os.PathLike | None, report: dict) -> None:
    """``report`` to ``out`` (indented; nothing without ``out``): a long program calls it after every
    configuration, so that a run cut short keeps what it measured."""
    if out is not None:
        Path(out).write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")


def emit(report: dict, out: str | os.PathLike | None = None, *, stamp: bool = True) -> dict:
    """A run's last words: ``report`` written to ``out`` and printed as one JSON line. ``stamp`` adds the date
    and :func:`machine` where ``report`` has none of its own. Returns what was written."""
    if stamp:
        report = {**report, "date": report.get("date") or time.strftime("%Y-%m-%d"),
                  "machine": report.get("machine") or machine()}
    write_json(out, report)
    print(json.dumps(report, default=str), flush=True)
    return report


def _sync(device: str | None) -> None:
    if device is not None and device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def timed(run: Callable[[], object], repeats: int, device: str | None = None) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``run`` (on a CUDA ``device``: synchronised before and after)."""
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def median_seconds(run: Callable[[], object], repeats: int, device: str | None = None, warmup: int = 0) -> float:
    """The median seconds of ``repeats`` calls of ``run`` after ``warmup`` calls not counted."""
    return statistics.median(timed(run, warmup + repeats, device)[warmup:])


def scratch() -> Path:
    """A new temporary folder, removed when the program exits."""
    folder = Path(tempfile.mkdtemp(prefix="dsi-bench-"))
    atexit.register(shutil.rmtree, folder, True)
    return folder


def tiny_pair(backend: str = "hf", noise: float = 0.3, layers: int = 2, hidden: int = 32) -> tuple[str, str]:
    """A tiny random Llama target and its drafter, the target with weight noise (``noise`` x each tensor's
    std: the two agree on about half their greedy tokens), written to a :func:`scratch` folder for
    ``backend``: Hugging Face folders ("hf") or GGUF files ("llama.cpp"). Returns their paths."""
    folder = scratch()
    if backend == "llama.cpp":
        from tests.tiny_gguf import write_tiny_gguf

        return tuple(str(write_tiny_gguf(folder / f"{name}.gguf", layers=layers, hidden=hidden, noise=n)[0])
                     for name, n in (("target", 0.0), ("drafter", noise)))
    if backend != "hf":
        raise ValueError(f"backend={backend!r} must be hf or llama.cpp")
    import transformers

    from tests.tiny_hf import make_model_dir, perturb

    target = make_model_dir(folder / "target", seed=0, layers=layers, hidden=hidden)
    perturb(transformers.AutoModelForCausalLM.from_pretrained(target), noise).save_pretrained(folder / "drafter")
    transformers.AutoTokenizer.from_pretrained(target).save_pretrained(folder / "drafter")
    return str(target), str(folder / "drafter")


def tiny_configs() -> Path:
    """benchmarks/configs/' architectures at two layers of width 32 (benchmarks/tiny_configs.py), in a
    :func:`scratch` folder: random weights of them cost next to nothing, and the recorded token ids stay valid."""
    from tiny_configs import write_tiny_configs

    return write_tiny_configs(scratch())


def need_vllm() -> bool:
    """Whether the vLLM venv is there (``bash packaging/vllm-venv.sh``); says so on stderr where it is not."""
    from tests.engine_servers import vllm_python

    if vllm_python() is None:
        print("no vLLM venv: bash packaging/vllm-venv.sh", file=sys.stderr)
        return False
    return True
