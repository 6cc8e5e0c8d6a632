"""The house style, checked by the one test command: ruff (lint and format), strict mypy, and the layers
of service/ (import-linter's contracts in pyproject.toml)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check", "."],
        ["ruff", "format", "--check", "."],
        ["mypy", "service", "export"],  # strict, from pyproject.toml
        ["lint-imports", "--no-cache"],  # a wrong import fails naming the contract and the import
    ],
    ids=["ruff-check", "ruff-format", "mypy", "layers"],
)
def test_the_code_passes(command: list[str]) -> None:
    done = subprocess.run([str(BIN / command[0]), *command[1:]], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout}{done.stderr}"


def _modules(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py"))


def test_the_server_package_has_at_most_ten_top_level_modules() -> None:
    top = sorted(p.name for p in (ROOT / "service").glob("*.py"))
    assert len(top) <= 10, top


def test_a_module_over_500_lines_says_why_at_its_top() -> None:
    """Its first line is `# Over 500 lines: REASON.`: a long module is a choice, not an accident."""
    long = {p: n for p in _modules("service", "export") if (n := len(p.read_text().splitlines())) > 500}
    unexplained = [
        f"{p.relative_to(ROOT)} ({n} lines)"
        for p, n in long.items()
        if not p.read_text().startswith("# Over 500 lines: ")
    ]
    assert not unexplained, unexplained


def test_service_and_export_import_no_module_that_imports_them_back() -> None:
    """No import cycle among the modules of service/ and export/ (strongly connected groups of grimp's graph)."""
    import grimp

    graph = grimp.build_graph("service", "export", cache_dir=None)
    modules = sorted(graph.modules)
    imports = {m: graph.find_modules_directly_imported_by(m) & set(modules) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in imports[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = [stack.pop()]
            while group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in modules:
        if module not in index:
            visit(module)
    assert not cycles, cycles


def test_only_the_command_line_exits() -> None:
    """A setting the server cannot use is a ConfigError (service/errors.py) wherever it is found; only
    service/cli.py turns errors into an exit status."""
    exits = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in _modules("service")
        if p != ROOT / "service" / "cli.py"
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if "SystemExit" in line
    ]
    assert not exits, exits


# A kind's name or a built-in kind's tensor named outside the kinds' packages (service/models/): what the
# server looks up instead is a capability (service/models/catalog.py). The files that still do, and why.
KIND_NAMES = {"tensor", "g2p", "ensemble", "text", "generation"}
KIND_TENSORS = {"TEXT", "PHONEMES", "WORDS", "REASONS", "SOURCES", "VARIANTS", "ATTENTION", "EMBEDDING", "SCORES",
                "QUERY", "INPUT_IDS"}  # fmt: skip
KIND_FREE = ("frontends", "serving", "scheduling", "repository", "observability", "server.py")
NAMING_KINDS: dict[str, str] = {}


def _is_kind(node: ast.AST) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        name = str(node.slice.value)
    return "kind" in name.lower()


def _kind_constants(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in KIND_NAMES}


def names_of_kinds(source: str) -> set[str]:
    """The kinds' names a module compares a kind with, gives one, or returns from a function of kinds, and
    the built-in kinds' tensor names it holds (docstrings and comments aside)."""
    tree = ast.parse(source)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in KIND_TENSORS:
            found.add(node.value)
        elif isinstance(node, ast.Compare) and any(_is_kind(n) for n in (node.left, *node.comparators)):
            found |= _kind_constants(node)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if node.value is not None and any(_is_kind(t) for t in targets):
                found |= _kind_constants(node.value)
        elif isinstance(node, ast.keyword) and node.arg == "kind":
            found |= _kind_constants(node.value)
    return found


def test_no_layer_above_or_below_the_kinds_names_one_but_those_that_say_why() -> None:
    """Front ends, data plane, schedulers, repository and observability name no kind and no kind's tensor
    (g2p, PHONEMES, WORDS...) outside NAMING_KINDS (target: none)."""
    naming = {}
    for area in KIND_FREE:
        for path in [ROOT / "service" / area] if area.endswith(".py") else _modules(f"service/{area}"):
            if found := names_of_kinds(path.read_text()):
                naming[str(path.relative_to(ROOT))] = sorted(found)
    assert set(naming) == set(NAMING_KINDS), naming
