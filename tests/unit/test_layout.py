"""The package's shape, as docs/architecture.md draws it: layers, no circles, short functions
with few paths.

Read from the source (imports as `ast` sees them, lazy ones inside functions included), so a
reviewer can run the same check: `pytest tests/unit/test_layout.py`.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "vllm_nccl_sync"

LAYERS = {
    "outcomes": 0, "wire": 0, "moved": 0,
    "planes": 1,
    "trainer": 2, "engine": 2,
    "integrations": 3,
    "verify": 4, "tiny": 4, "bench": 4, "demo": 4, "weight_transfer": 4, "cli": 5,
}
"""Each part's floor: a module imports only parts on lower floors or its own part (`__init__`,
the package's face, re-exports anything)."""

NEVER = {
    ("trainer", "engine"), ("engine", "trainer"),  # the two sides never import each other
    ("trainer", "integrations"), ("engine", "integrations"),  # both stay framework-free
}

FRAMEWORKS = {"vllm", "sglang", "verl", "ray"}
"""What `engine/` and `trainer/` never import, lazily or not: the integrations adapt to them."""

MAX_FUNCTION_LINES = 60
"""A function is one step: longer ones are split by what they do (files are split by concept,
never by length)."""


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _part(module: str) -> str | None:
    bits = module.split(".")
    return bits[1] if len(bits) > 1 else None


def _imports(f: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{f}: relative import (the package imports absolutely)")
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


MODULES = _modules()


def _edges() -> dict[str, set[str]]:
    edges = {}
    for mod, f in MODULES.items():
        edges[mod] = {m for m in _imports(f) if m in MODULES and m != mod}
    return edges


def test_every_part_has_a_floor():
    parts = {_part(m) for m in MODULES} - {None}
    assert parts <= set(LAYERS), f"parts without a floor: {sorted(parts - set(LAYERS))}"


def test_no_arrow_runs_up_and_the_sides_stay_apart():
    wrong = []
    for mod, targets in _edges().items():
        src = _part(mod)
        if src is None:  # the package's face
            continue
        for t in targets:
            dst = _part(t)
            if dst is None or dst == src:
                continue
            if (src, dst) in NEVER or LAYERS[dst] > LAYERS[src]:
                wrong.append(f"{mod} -> {t}")
    assert not wrong, "imports against the layout:\n" + "\n".join(sorted(wrong))


def test_no_import_circle():
    edges = _edges()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state and _part(m) is not None:
            visit(m)


def test_the_two_sides_import_no_framework():
    wrong = [f"{mod} -> {name}" for mod, f in MODULES.items()
             if _part(mod) in ("engine", "trainer")
             for name in _imports(f) if name.split(".")[0] in FRAMEWORKS]
    assert not wrong, "framework imports in engine/ or trainer/:\n" + "\n".join(sorted(wrong))


def test_only_the_vllm_integration_imports_its_patches():
    home = "vllm_nccl_sync.integrations.vllm"
    wrong = [f"{mod} -> {t}" for mod, targets in _edges().items()
             if not mod.startswith(home + ".") and mod != home
             for t in targets if t.startswith(home + ".patches")]
    assert not wrong, "vLLM patches imported elsewhere:\n" + "\n".join(sorted(wrong))


def _functions() -> dict[str, int]:
    """Every function and method of the package: `path:name` -> its lines."""
    out = {}
    for f in PKG.rglob("*.py"):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                key = f"{f.relative_to(PKG)}:{n.name}"
                out[key] = max(out.get(key, 0), n.end_lineno - n.lineno + 1)
    return out


def test_functions_are_short():
    long = {k: n for k, n in _functions().items() if n > MAX_FUNCTION_LINES}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


MAX_BRANCHES = 12
"""A function takes at most this many paths: McCabe's count, 1 + each `if`/`elif`, loop,
`except` and `case` (boolean operators and comprehensions not counted)."""
_BRANCHES = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.ExceptHandler, ast.match_case)


def _branches(fn: ast.AST) -> int:
    """1 + the decision points of `fn` itself (nested functions and classes count apart)."""
    n, todo = 1, list(ast.iter_child_nodes(fn))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        n += isinstance(node, _BRANCHES)
        todo.extend(ast.iter_child_nodes(node))
    return n


def test_functions_take_few_paths():
    many = {}
    for f in PKG.rglob("*.py"):
        for n in ast.walk(ast.parse(f.read_text())):
            paths = _branches(n) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) else 0
            if paths > MAX_BRANCHES:
                many[f"{f.relative_to(PKG)}:{n.name}"] = paths
    assert not many, f"functions with over {MAX_BRANCHES} paths: {many}"


def _defs(pattern: str) -> list[str]:
    found = []
    for mod, f in MODULES.items():
        if re.search(pattern, f.read_text(), re.M):
            found.append(mod)
    return found


@pytest.mark.parametrize("what,pattern", [
    ("the frame check", r"^def open_frame\b|^def check_frame\b|hmac\.compare_digest"),
    ("the version rule", r"^def belongs\b"),
    ("the bucket lane", r"^class \w*Lane\b"),
    ("the engine session", r"^class EngineSession\b"),
])
def test_each_concern_lives_once(what, pattern):
    where = _defs(pattern)
    assert len(where) == 1, f"{what} is defined in {where or 'no module'}"
