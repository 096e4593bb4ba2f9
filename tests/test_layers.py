"""The package's layers: imports only go down, and no module imports itself back (not even
through an import inside a function). Read from the source with `ast`, so it is exact and fast."""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "async_flowgrpo")

# Lowest first. A module may import modules of its own layer or of lower ones.
LAYERS = [
    ("foundation", ("config", "algo", "algorithms", "types", "sampling", "stop", "prompts", "conditioning", "checkpoint", "metrics", "gpu_monitor",
                    "fsdp", "seqpar", "models", "rewards", "shapes", "sync", "queue", "ema", "config_doc")),
    ("components", ("policy", "rollout", "builders", "evaluation")),
    ("actors", ("actors",)),
    ("driver", ("driver",)),
    ("modes", ("modes",)),
    ("entry", ("cli",)),
]


def modules() -> dict[str, str]:
    found = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[rel.removesuffix(".__init__").removesuffix("__init__")] = path
    return found


def imports(name: str, path: str, known: dict[str, str]) -> set[str]:
    """Modules of the package that `name` imports anywhere in its source (relative names)."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("async_flowgrpo"):
                target = node.module.removeprefix("async_flowgrpo").lstrip(".")
            else:
                continue
            for candidate in [target] + [f"{target}.{a.name}".lstrip(".") for a in node.names]:
                if candidate and candidate in known and candidate != name:
                    out.add(candidate)
        elif isinstance(node, ast.Import):
            for a in node.names:
                target = a.name.removeprefix("async_flowgrpo").lstrip(".")
                if a.name.startswith("async_flowgrpo") and target in known and target != name:
                    out.add(target)
    return out


def layer_of(name: str) -> int:
    top = name.split(".")[0]
    for level, (_, tops) in enumerate(LAYERS):
        if top in tops:
            return level
    raise AssertionError(f"async_flowgrpo.{name} is in no layer of tests/test_layers.py: place it")


@pytest.fixture(scope="module")
def graph():
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items() if name}


def test_imports_only_go_down(graph):
    upward = [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
              for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a)]
    assert not upward, "\n".join(upward)


def test_no_import_cycles(graph):
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(cycles)


def test_the_check_sees_imports_inside_functions(graph):
    # evaluation's CLI imports builders inside main(); a checker blind to it would pass vacuously
    assert "builders" in graph["evaluation"]
    assert "driver.run" in graph["modes.sync"]
