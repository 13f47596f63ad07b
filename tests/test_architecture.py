"""The layout of the code, read from the source: no import cycle between modules, no function over 80 lines.

Imports are read with the ast module from every file of the project's packages, including the ones
made inside functions (a cycle hidden in a function is still a cycle of concepts).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("minigpt", "job", "parallel", "precision", "simulator", "cli")
MAX_FUNCTION_LINES = 80


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> nx.DiGraph:
    found = modules()
    graph = nx.DiGraph()
    for name, path in found.items():
        graph.add_node(name)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            graph.add_edges_from((name, target) for target in targets if target in found and target != name)
    return graph


def test_the_graph_sees_imports():
    graph = import_graph()
    assert graph.has_edge("cli.main", "cli.train") or any(graph.successors("cli.main"))
    assert graph.has_edge("simulator.compute", "simulator.efficiency")  # a real edge, so a cycle would show


def test_no_import_cycle_between_modules():
    cycles = sorted(nx.simple_cycles(import_graph()), key=len)
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_no_function_over_80_lines_in_parallel_or_simulator():
    long = []
    for package in ("parallel", "simulator"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def folder_graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    for a, b in import_graph().edges():
        if a.split(".")[0] != b.split(".")[0]:
            graph.add_edge(a.split(".")[0], b.split(".")[0])
    return graph


def test_imports_point_down_only_between_folders():
    folders = folder_graph()
    assert not list(nx.simple_cycles(folders)), list(nx.simple_cycles(folders))
    # the two interpreters never import each other; they share the job description below them
    assert not folders.has_edge("parallel", "simulator") and not folders.has_edge("simulator", "parallel")
    assert folders.has_edge("parallel", "job") and folders.has_edge("simulator", "job")
    for low in ("minigpt", "precision", "job"):  # nothing below imports an interpreter or the commands
        assert not set(folders.successors(low)) & {"parallel", "simulator", "cli"} if low in folders else True
