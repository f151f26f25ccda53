"""The engines recipe as a newcomer meets it (issue 66): the commands of the README and of docs/engines.md run
as written, with only the model paths, the hosts and ports, and one thread per process put in (vLLM: the
cores it binds and the tiny model's context), against real engines; and the local copies follow the
engines' dtype.

The models are tiny random Llamas with large weights (``init_std=0.5``), whose bf16 and fp32 rows differ by
nats, as a real model's do (the issue met 0.354 nats): a local copy in the other dtype fails the start check.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")

from tests.engine_servers import ROOT, EngineProcess, free_port, vllm_python  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.slow]

PROMPT = "def fibonacci(n):"
TOKENS = 12


@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    """Model directories whose bf16 rows are far from their fp32 rows: a target and a drafter."""
    from tests.tiny_hf import make_model_dir

    root = tmp_path_factory.mktemp("sharp")
    return {"target": str(make_model_dir(root / "target", seed=0, layers=2, hidden=128, init_std=0.5)),
            "drafter": str(make_model_dir(root / "drafter", seed=1, layers=1, hidden=64, init_std=0.5)),
            "other": str(make_model_dir(root / "other", seed=7, layers=2, hidden=128, init_std=0.5))}


@pytest.fixture(scope="module")
def expected(sharp):
    """The local fp32 non-SI greedy output of PROMPT: what every recipe must print."""
    out = subprocess.run([sys.executable, "-m", "dsi.cli.main", "generate", "--target", sharp["target"], "--method",
                          "ar", "--dtype", "fp32", "--threads", "1", "--prompt", PROMPT, "--max-new-tokens",
                          str(TOKENS), "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["token_ids"]


def commands(path: Path, after: str, index: int = 0) -> list[str]:
    """The commands of the ``index``-th bash block after the text ``after`` in ``path``: continuation lines
    joined, comments dropped."""
    text = path.read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text[text.index(after):], re.S)
    lines, current = [], ""
    for raw in blocks[index].splitlines():
        line = raw.split(" #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        lines.append(current + line)
        current = ""
    return lines


def fill(command: str, sharp: dict, ports: dict[str, int]) -> list[str]:
    """``command`` with the models and the hosts put in: ./my-target and ./my-drafter become the test's
    models, and each ``10.0.0.N:PORT`` (or ``--port PORT``) the port of a server on 127.0.0.1."""
    command = command.replace("./my-target", sharp["target"]).replace("./my-drafter", sharp["drafter"])
    command = re.sub(r"10\.0\.0\.(\d+):(\d+)", lambda m: f"127.0.0.1:{ports[m.group(1)]}", command)
    return shlex.split(command)


def engine(argv: list[str], port: int, env: dict | None = None) -> EngineProcess:
    argv = [*argv, "--host", "127.0.0.1"]
    argv[argv.index("--port") + 1] = str(port)
    if argv[0] == "dsi":
        argv = [sys.executable, "-m", "dsi.cli.main", *argv[1:], "--threads", "1"]
    return EngineProcess(argv, port, env, timeout=300.0)


def generate(argv: list[str]) -> subprocess.CompletedProcess:
    assert argv[:2] == ["dsi", "generate"], argv
    return subprocess.run([sys.executable, "-m", "dsi.cli.main", *argv[1:], "--threads", "1",
                           "--max-new-tokens", str(TOKENS), "--json"], capture_output=True, text=True, timeout=600)


def stop(engines) -> None:
    for e in engines:
        e.stop()


def test_the_readme_recipe_runs_as_written(sharp, expected):
    """README "Serving and engines": two target engines and a drafter engine (``dsi serve --method ar``), and
    ``dsi generate`` over them: the local fp32 non-SI output."""
    serve_targets, serve_drafter, gen = commands(ROOT / "README.md", "The paper's simplest deployment")
    ports = {"2": free_port(), "3": free_port(), "4": free_port()}
    engines = []
    try:
        for host in ("2", "3"):
            engines.append(engine(fill(serve_targets, sharp, ports), ports[host]))
        engines.append(engine(fill(serve_drafter, sharp, ports), ports["4"]))
        out = generate(fill(gen, sharp, ports))
    finally:
        stop(engines)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["token_ids"] == expected
    assert "computes other rows" not in out.stderr  # the recipe's own dtype matches: nothing to follow


def test_the_engines_md_recipe_runs_as_written_on_vllm(sharp, expected, caplog):
    """docs/engines.md "The seed's simplest configuration": two vLLM target engines started with the command
    shown, the drafter engine shown, and its ``dsi generate`` (``-v``: the drafter's rows are described right)."""
    python = vllm_python()
    if python is None:
        pytest.skip("no vLLM venv: bash packaging/vllm-venv.sh builds it (CI does)")
    doc = ROOT / "docs" / "engines.md"
    [vllm_command] = commands(doc, "## The seed's simplest configuration", 0)
    [drafter_command] = commands(doc, "## The seed's simplest configuration", 2)
    gen = commands(doc, "## The seed's simplest configuration", 3)[0]
    assert "--dtype fp32" in gen and "--dtype float32" in vllm_command and "--enforce-eager" in vllm_command
    ports = {"2": free_port(), "3": free_port(), "4": free_port()}
    engines = []
    try:
        for cpu, host in enumerate(("2", "3")):
            argv = fill(vllm_command, sharp, ports)
            env = dict(a.split("=", 1) for a in argv if re.fullmatch(r"[A-Z_]+=\S*", a))
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
            argv = [a for a in argv if not re.fullmatch(r"[A-Z_]+=\S*", a)]
            argv[0] = python  # .venv-vllm/bin/python, wherever the venv is
            argv[argv.index("--max-model-len") + 1] = "256"  # the tiny model's positions
            engines.append(engine(argv, ports[host], {**env, "VLLM_LOGGING_LEVEL": "WARNING"}))
        engines.append(engine(fill(drafter_command, sharp, ports), ports["4"]))
        argv = fill(gen, sharp, ports)
        out = subprocess.run([sys.executable, "-m", "dsi.cli.main", "-v", *argv[1:], "--threads", "1",
                              "--max-new-tokens", str(TOKENS), "--json"], capture_output=True, text=True, timeout=600)
    finally:
        stop(engines)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["token_ids"] == expected
    drafter_lines = [line for line in out.stderr.splitlines()
                     if "drafter server" in line and "whole-vocabulary" in line]
    assert drafter_lines and all("drafts are drawn from its top log-probabilities" in line for line in drafter_lines)
    assert not any("sampling then needs top_k" in line for line in drafter_lines)


@pytest.fixture(scope="module")
def fp32_engines(sharp):
    """Two target engines and a drafter engine serving the models in fp32 (``dsi serve``)."""
    from tests.engine_servers import start_dsi_serve

    servers = [start_dsi_serve(sharp["target"]), start_dsi_serve(sharp["target"]),
               start_dsi_serve(sharp["drafter"], "--max-logprobs", "20")]
    yield servers
    stop(servers)


def test_without_dtype_the_local_copies_follow_the_engines_and_say_so(sharp, expected, fp32_engines):
    targets, drafter = f"{fp32_engines[0].url},{fp32_engines[1].url}", fp32_engines[2].url
    base = ["dsi", "generate", "--target", sharp["target"], "--drafter", sharp["drafter"], "--method", "dsi",
            "-k", "2", "--prompt", PROMPT, "--target-servers", targets]
    for argv in (base, [*base, "--drafter-server", drafter]):
        out = generate(argv)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["token_ids"] == expected
        said = [line for line in out.stderr.splitlines() if "computes other rows" in line]
        assert len(said) == 1 and "than the local copy in bf16" in said[0]
        assert "in fp32 they match: the local copies run fp32 (pass --dtype fp32 to start so)" in said[0]
        assert re.search(r"\(\d+\.\d+ nats apart\)", said[0])
    # the dtype given: no retry, an error naming the local copy's dtype and the flag
    out = generate([*base, "--dtype", "bf16"])
    assert out.returncode == 2
    assert "The local target runs bf16" in out.stderr and "--dtype fp32" in out.stderr
    assert "computes other rows" not in out.stderr
    out = generate([*base, "--dtype", "fp32"])
    assert out.returncode == 0 and "computes other rows" not in out.stderr
    assert json.loads(out.stdout)["token_ids"] == expected


def test_an_engine_serving_other_weights_is_refused_in_either_dtype(sharp, fp32_engines):
    out = generate(["dsi", "generate", "--target", sharp["other"], "--drafter", sharp["drafter"], "--method", "dsi",
                    "-k", "2", "--prompt", PROMPT, "--target-servers", fp32_engines[0].url])
    assert out.returncode == 2
    assert "does not match either" in out.stderr and "other weights" in out.stderr
    assert "computes other rows" not in out.stderr
