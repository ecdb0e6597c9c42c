"""The import structure the architecture promises (docs/ARCHITECTURE.md): no import cycles
among the project's modules, zero never imports megatron, the model and mpu packages import
no trainer code.

Imports are read from the source (module level and inside functions alike: a deferred import
still ties the two modules together). A package's own `__init__` importing its submodules is
an edge like any other; the implicit import of a parent package is not.
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("megatron", "zero")


def _module_files():
    files = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            files[name] = path
    return files


def _resolve(name, modules):
    """The project module `name` refers to (the longest prefix that is one), or None."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module, path, modules):
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from package import submodule` imports the submodule
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            resolved = _resolve(target, modules)
            if resolved is not None and resolved != module:
                found.add(resolved)
                break
    return found


@pytest.fixture(scope="module")
def graph():
    modules = _module_files()
    return {module: _imports(module, path, modules) for module, path in modules.items()}


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for neighbour in graph.get(node, ()):
            if neighbour not in index:
                visit(neighbour)
                low[node] = min(low[node], low[neighbour])
            elif neighbour in on_stack:
                low[node] = min(low[node], index[neighbour])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_graph_is_read(graph):
    assert "megatron.training.pretrain" in graph["megatron.training.loop"] or \
        "megatron.training.loop" in graph["megatron.training.pretrain"]
    assert "zero.activation_checkpointing" in graph["zero.checkpointing"]


def test_no_import_cycles(graph):
    assert _cycles(graph) == []


def test_cycle_detection_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_zero_never_imports_megatron(graph):
    offenders = {m: sorted(t for t in targets if t.startswith("megatron"))
                 for m, targets in graph.items() if m.startswith("zero")}
    assert {m: t for m, t in offenders.items() if t} == {}


@pytest.mark.parametrize("package, allowed", [
    ("megatron.model", ("megatron.model", "megatron.mpu", "megatron.errors", "zero")),
    # the one RNG tracker class lives in zero (mpu keeps its process-wide instance), and so
    # does the device a process group's collectives take
    ("megatron.mpu", ("megatron.mpu", "megatron.errors",
                      "zero.activation_checkpointing.rng_tracker", "zero.comm.agreement")),
])
def test_model_and_mpu_import_no_trainer_code(graph, package, allowed):
    offenders = {m: sorted(t for t in targets if not t.startswith(allowed))
                 for m, targets in graph.items() if m == package or
                 m.startswith(package + ".")}
    assert {m: t for m, t in offenders.items() if t} == {}
