"""The layering rules: the core never loads torch, Ray or the web stack."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "transformers", "ray", "fastapi", "uvicorn", "llama_cpp")


@pytest.mark.parametrize(
    "module",
    ["dsi", "dsi.api", "dsi.engine", "dsi.sampling", "dsi.logprobs", "dsi.transport.threads", "dsi.models", "dsi.sim",
     "dsi.evaluate.bench", "dsi.evaluate.autotune", "dsi.evaluate.compare", "dsi.cli.main"],
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
        for name in ("import torch", "import ray", "dsi.models.hf.model", "dsi.models.llamacpp", "fastapi"):
            assert name not in text, f"{path.name} mentions {name}"


# The layers, lowest first: a module may import its own unit and the units of lower layers only.
# ("__init__" is the package root, ``import dsi``; "api" is the public entry that knows method="auto".)
LAYERS = (
    {"errors", "allocator"},
    {"constraints", "coupling", "sampling", "windows", "text", "trees"},
    {"logprobs"},
    {"models"},
    {"transport"},
    {"engine", "sim"},
    {"evaluate"},
    {"api", "__init__"},
    {"server"},
    {"cli"},
)


def _package_imports() -> dict[str, set[str]]:
    """For each module of the dsi package, the dsi modules it imports anywhere (lazily too).

    ``from dsi.x import y`` names the module ``dsi.x.y`` when that is a module, else ``dsi.x``;
    relative imports are resolved. (The implicit import of a parent package that Python makes
    when it loads a submodule is not an edge: it never runs the submodule's importer again.)"""
    import ast
    from pathlib import Path

    import dsi

    root = Path(dsi.__file__).parent
    paths = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                if base == "dsi" or base.startswith("dsi."):
                    found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name == "dsi" or a.name.startswith("dsi.")}
        graph[name] = {m for m in found if m in paths} - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a depth-first search's first back edge), or None."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:  # on the stack: a back edge
                stack = [*path, node]
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt, [*path, node])):
                return found
        state[node] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module, [])):
            return found
    return None


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_the_package_has_no_import_cycle():
    """Any circle of imports anywhere in dsi (lazy imports inside functions count) fails here."""
    cycle = _cycle(_package_imports())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    assert _cycle({"x": {"y"}, "y": {"z"}, "z": {"y"}}) == ["y", "z", "y"]


def test_every_import_goes_down_the_layers():
    layer_of = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    graph = _package_imports()
    units = {_unit(m) for m in graph}
    assert units <= set(layer_of), f"units without a layer: {sorted(units - set(layer_of))}"
    wrong = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                   if layer_of[_unit(t)] > layer_of[_unit(m)])
    assert not wrong, "imports that go up the layers:\n" + "\n".join(wrong)
    beside = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                    if {_unit(m), _unit(t)} == {"engine", "sim"})
    assert not beside, f"the engine and the simulator stand beside each other: {beside}"


def test_method_auto_is_known_only_above_the_engine():
    """The engine builds concrete methods; the public entry (dsi.api) alone reaches the autotuner."""
    graph = _package_imports()
    importers = sorted(m for m, targets in graph.items() if "dsi.evaluate.autotune" in targets)
    assert all(_unit(m) in {"api", "evaluate", "cli"} for m in importers), importers
    assert "dsi.evaluate.autotune" in graph["dsi.api"]
    for module, targets in graph.items():
        if _unit(module) == "engine":
            assert not {t for t in targets if _unit(t) in {"evaluate", "api", "__init__"}}, module


def _model_imports() -> dict[str, set[str]]:
    """For each module of dsi.models, the dsi.models modules it imports anywhere (lazily too), named by
    their path under dsi.models ("hf.model", "loading"; a subpackage's own ``__init__`` is "hf")."""
    graph = _package_imports()
    inside = "dsi.models."
    return {m[len(inside):]: {t[len(inside):] for t in targets if t.startswith(inside)}
            for m, targets in graph.items() if m.startswith(inside)}


# dsi.models by concern: the room of a module is its subpackage, or its own name at the top.
BACKENDS = {"hf", "llamacpp"}
INTERFACE = {"base", "costs", "determinism"}
AROUND_THE_BACKENDS = {"engines", "vocab", "emulated"}


def _room(module: str) -> str:
    return module.split(".")[0]


def test_model_modules_import_each_other_one_way():
    """No circle (embedded -> loading -> hf -> loading was one)."""
    cycle = _cycle(_model_imports())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_models_show_their_parts():
    """models/ is grouped by concern: the rooms are these, and each subpackage says what it owns."""
    import dsi.models

    root = Path(dsi.models.__file__).parent
    rooms = {p.stem for p in root.glob("*.py") if p.stem != "__init__"} | {p.name for p in root.iterdir()
                                                                            if (p / "__init__.py").exists()}
    assert rooms == {"base", "costs", "determinism", "sources", "embedded", "cache", "loading", "llamacpp",
                     "hf", "engines", "vocab", "emulated"}
    for path in root.rglob("*.py"):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and len(doc) > 80, f"{path.relative_to(root)} has no docstring saying what it owns"


def _room_violations(graph: dict[str, set[str]]) -> list[str]:
    """The imports between models' rooms that go the wrong way: a backend importing the engines, the bridge
    or emulation; the interface importing anything but itself; the engines or the bridge importing a backend
    or each other; anything but emulation importing emulation (the package root only re-exports it)."""
    wrong = []
    for module, targets in graph.items():
        room = _room(module)
        for target in sorted(targets):
            to = _room(target)
            if ((room in BACKENDS and to in AROUND_THE_BACKENDS)
                    or (room in INTERFACE and to not in INTERFACE)
                    or (room in {"engines", "vocab"} and to in BACKENDS | AROUND_THE_BACKENDS - {room})
                    or (to == "emulated" and room != "emulated")):
                wrong.append(f"{module} -> {target}")
    return wrong


def test_a_backend_never_imports_the_engines_the_bridge_or_emulation():
    wrong = _room_violations(_model_imports())
    assert not wrong, "imports across models' rooms that go the wrong way:\n" + "\n".join(wrong)


def test_the_room_rules_see_a_wrong_import():
    assert _room_violations({"hf.model": {"emulated.replay", "base"}}) == ["hf.model -> emulated.replay"]
    assert _room_violations({"llamacpp": {"vocab.bridge"}}) == ["llamacpp -> vocab.bridge"]
    assert _room_violations({"determinism": {"emulated.callable"}}) == ["determinism -> emulated.callable"]
    assert _room_violations({"engines.target": {"hf.model"}}) == ["engines.target -> hf.model"]
    assert _room_violations({"vocab.bridge": {"engines.target"}}) == ["vocab.bridge -> engines.target"]
    assert _room_violations({"loading": {"emulated.synthetic"}}) == ["loading -> emulated.synthetic"]
    # the allowed directions
    assert _room_violations({"emulated.replay": {"hf.model", "base"}, "loading": {"hf.model", "vocab.bridge"},
                             "vocab.bridge": {"vocab.merges", "base"}, "hf.model": {"determinism"}}) == []


def test_where_a_model_comes_from_does_not_depend_on_the_engine_that_runs_it():
    graph = _model_imports()
    engines = {"hf", "hf.model", "hf.forward_plan", "hf.device_laws", "hf.checkpoint", "llamacpp", "loading"}
    for module in ("cache", "embedded", "sources"):
        assert not graph[module] & engines, f"{module} imports {graph[module] & engines}"
    assert "loading" not in graph["hf.model"] and "loading" not in graph["hf.checkpoint"]
    assert {"hf.model", "hf.forward_plan", "llamacpp", "loading"}.isdisjoint(graph["hf.checkpoint"])
    # only the dispatcher knows both backends
    assert [m for m, deps in graph.items() if "hf.model" in deps and "llamacpp" in deps] == ["loading"]


def test_resolving_and_choosing_a_backend_loads_no_engine():
    code = (
        "import sys\n"
        "from dsi.models.loading import choose_backend\n"
        "from dsi.models.sources import resolve_source\n"
        "import dsi.models.hf, dsi.models.hf.checkpoint, dsi.models.engines, dsi.models.vocab, dsi.cli.backend\n"
        "choose_backend([resolve_source('default-target')], 'auto', devices=['cpu'])\n"
        "loaded = [m for m in ('torch', 'transformers', 'llama_cpp') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_engine_builder_refuses_auto_and_names_the_public_entry():
    from dsi.engine.api import build_decoder
    from dsi.errors import ConfigError
    from dsi.models import synthetic_pair

    target, drafter = synthetic_pair(0.9)
    with pytest.raises(ConfigError, match=r"method='auto'.*dsi\.build_decoder"):
        build_decoder(target=target, drafter=drafter, method="auto")
