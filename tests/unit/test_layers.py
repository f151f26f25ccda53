"""The layering rules: the core never loads torch, Ray or the web stack."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "ray", "fastapi", "uvicorn", "llama_cpp")


@pytest.mark.parametrize(
    "module",
    ["dsi", "dsi.engine", "dsi.sampling", "dsi.transport.threads", "dsi.models", "dsi.bench", "dsi.cli.main"],
)
def test_core_modules_do_not_import_heavy_dependencies(module):
    code = (
        f"import sys, {module}\n"
        f"import dsi.cli.main; dsi.cli.main.build_parser()\n"
        f"loaded = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_engine_sources_name_no_concrete_backend():
    from pathlib import Path

    import dsi.engine

    root = Path(dsi.engine.__file__).parent
    for path in root.glob("*.py"):
        text = path.read_text()
        for name in ("import torch", "import ray", "dsi.models.hf", "dsi.models.llamacpp", "fastapi"):
            assert name not in text, f"{path.name} mentions {name}"


def _model_imports() -> dict[str, set[str]]:
    """For each module of dsi.models, the dsi.models modules it imports anywhere (lazily too)."""
    import ast
    from pathlib import Path

    import dsi.models

    root = Path(dsi.models.__file__).parent
    modules = {p.stem for p in root.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in modules:
        found: set[str] = set()
        for node in ast.walk(ast.parse((root / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dsi.models"):
                sub = node.module.split(".")[2:3]
                # `from dsi.models import embedded` names a module; `from dsi.models.x import y` the module x
                found |= set(sub) if sub else {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("dsi.models.")}
        graph[name] = found - {name}
    return graph


def test_model_modules_import_each_other_one_way():
    """No circle (embedded -> loading -> hf -> loading was one): a depth-first search finds no back edge."""
    graph = _model_imports()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join([*path, node, nxt])}"
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_where_a_model_comes_from_does_not_depend_on_the_engine_that_runs_it():
    graph = _model_imports()
    engines = {"hf", "llamacpp", "hf_checkpoint", "loading"}
    for module in ("cache", "embedded", "sources"):
        assert not graph[module] & engines, f"{module} imports {graph[module] & engines}"
    assert "loading" not in graph["hf"] and "loading" not in graph["hf_checkpoint"]
    assert {"hf", "llamacpp", "loading"}.isdisjoint(graph["hf_checkpoint"])
    # only the dispatcher knows both backends
    assert [m for m, deps in graph.items() if {"hf", "llamacpp"} <= deps] == ["loading"]


def test_resolving_and_choosing_a_backend_loads_no_engine():
    code = (
        "import sys\n"
        "from dsi.models.loading import choose_backend\n"
        "from dsi.models.sources import resolve_source\n"
        "import dsi.models.hf_checkpoint, dsi.cli.backend\n"
        "choose_backend([resolve_source('default-target')], 'auto', devices=['cpu'])\n"
        "loaded = [m for m in ('torch', 'transformers', 'llama_cpp') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
