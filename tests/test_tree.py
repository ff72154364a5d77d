"""The tree itself: short functions, no references outside the repository, docs that match."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "ark"
MAX_FUNCTION_LINES = 80


def test_no_function_is_longer_than_80_lines() -> None:
    long = []
    for p in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "split these: " + "; ".join(long)


def test_nothing_cites_documents_outside_the_repository() -> None:
    texts = [*SRC.rglob("*.py"), *SRC.rglob("*.c"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "docs").rglob("*.md"),
             *(p for p in (ROOT / "scripts").rglob("*") if p.is_file()), ROOT / "README.md", ROOT / "pyproject.toml", ROOT / ".ci" / "run"]
    outside = re.compile(r"ARK\.md|closing note|issue #?\d+", re.IGNORECASE)
    hits = [str(p.relative_to(ROOT)) for p in texts if p != Path(__file__).resolve() and outside.search(p.read_text())]
    assert not hits


def test_every_module_the_docs_name_exists() -> None:
    """README and the docs name modules like ``ark.core.protocol``: each imports."""
    named = set()
    for p in (ROOT / "README.md", *(ROOT / "docs").rglob("*.md")):
        named |= set(re.findall(r"`(ark(?:\.[A-Za-z_]+)+)`", p.read_text()))
    assert len(named) >= 20
    for name in sorted(named):  # a module, or a module's attribute (``ark.agent.client.ArkClient``)
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ModuleNotFoundError:
                continue
            for attr in parts[i:]:
                try:
                    obj = getattr(obj, attr)  # AttributeError: the docs name something that is not there
                except ImportError:  # built on first access from an extra not installed here (vLLM)
                    break
            break
        else:
            raise AssertionError(f"{name}: no such module")


def test_every_module_is_in_the_architecture_document() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = [
        ".".join(p.relative_to(SRC.parent).with_suffix("").parts)
        for p in SRC.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
        and ".".join(p.relative_to(SRC.parent).with_suffix("").parts) not in doc
    ]
    assert not missing, f"docs/architecture.md does not say what these hold: {missing}"


def _imports_within(wing: str) -> dict[str, set[str]]:
    """Module -> the modules of the same wing it imports (type-only imports included)."""
    graph: dict[str, set[str]] = {}
    for p in (SRC / wing).glob("*.py"):
        name = f"ark.{wing}.{p.stem}"
        deps: set[str] = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            deps |= {m for m in mods if m.startswith(f"ark.{wing}.") and (SRC / wing / f"{m.split('.')[2]}.py").is_file()}
        graph[name] = {".".join(d.split(".")[:3]) for d in deps} - {name}
    return graph


def _circle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of ``graph`` ([] if none), by depth-first search."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return [*stack[stack.index(d):], d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_no_import_circle_inside_the_simulator() -> None:
    """Modules of the simulator's wing import each other one way only (a shared type lives
    in a module of its own), type-only imports included."""
    assert _circle(_imports_within("sim")) == []
