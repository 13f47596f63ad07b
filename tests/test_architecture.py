"""The layout of the code, read from the source: no import cycle between modules or between a package's rooms,
imports that point down, small folders and modules, no function over 80 lines, and docs/architecture.md naming
every subpackage.

Imports are read with the ast module from every file of the project's packages, including the ones
made inside functions (a cycle hidden in a function is still a cycle of concepts). A package's rooms are its
subpackages (parallel/data/, simulator/engine/, ...) and the modules at its top (parallel/comm.py, ...).
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("minigpt", "job", "parallel", "precision", "simulator", "cli")
MAX_FUNCTION_LINES = 80
MAX_MODULES_PER_FOLDER = 12  # .py files at a folder's top, __init__.py included
MAX_MODULE_LINES = 500
ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@lru_cache(maxsize=1)
def import_graph() -> nx.DiGraph:
    """Module to module imports (read once a session: callers copy before changing it)."""
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
    assert graph.has_edge("cli.main", "cli.commands.train") or any(graph.successors("cli.main"))
    assert graph.has_edge("simulator.costs.compute", "simulator.costs.rates.efficiency")  # a real edge, so a cycle would show


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


# ---------------------------------------------------------------- rooms: subpackages and top-level modules


def subpackages() -> list[str]:
    """Every package below a top-level one, dotted (parallel.data, cli.commands, ...)."""
    return sorted(name for name, path in modules().items() if path.name == "__init__.py" and "." in name)


def room(module: str, packages: set[str]) -> str:
    """The room a module lives in: its subpackage right below the top-level package, or itself at that top."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 and ".".join(parts[:2]) in packages else module


def room_graph(graph: nx.DiGraph) -> nx.DiGraph:
    """Room to room imports inside each top-level package (parallel.run -> parallel.data, ...)."""
    packages = set(subpackages())
    rooms = nx.DiGraph()
    for a, b in graph.edges():
        ra, rb = room(a, packages), room(b, packages)
        if ra != rb and ra.split(".")[0] == rb.split(".")[0]:
            rooms.add_edge(ra, rb)
    return rooms


def room_cycles(graph: nx.DiGraph) -> list[list[str]]:
    return sorted(nx.simple_cycles(room_graph(graph)), key=len)


def test_no_import_cycle_between_rooms():
    graph = import_graph()
    assert not room_cycles(graph), room_cycles(graph)[:5]
    rooms = room_graph(graph)
    assert rooms.has_edge("parallel.run", "parallel.data") and rooms.has_edge("simulator.engine", "simulator.costs")


def test_a_planted_cycle_between_rooms_is_found():
    """The check can fail: an import from a shared piece (the clock) up to run/sample.py closes a loop of rooms
    (run/step.py imports the clock) that no cycle of modules shows (sample.py reaches only checkpoint/)."""
    planted = import_graph().copy()
    planted.add_edge("parallel.clock", "parallel.run.sample")
    assert not list(nx.simple_cycles(planted))
    assert any({"parallel.clock", "parallel.run"} <= set(cycle) for cycle in room_cycles(planted))


@lru_cache(maxsize=None)
def imported_rooms(source: str) -> frozenset[str]:
    rooms = room_graph(import_graph())
    return frozenset(rooms.successors(source)) if source in rooms else frozenset()


def test_the_parallelisms_never_import_the_run_machinery():
    machinery = {"parallel.run", "parallel.launch", "parallel.calibrate"}
    for parallelism in ("parallel.data", "parallel.tensor", "parallel.pipeline", "parallel.context",
                        "parallel.checkpoint"):
        assert not imported_rooms(parallelism) & machinery, (parallelism, imported_rooms(parallelism))
    assert not imported_rooms("parallel.launch") & {"parallel.run", "parallel.calibrate"}  # it starts ranks only
    packages = set(subpackages())  # the shared pieces at parallel's top import no subpackage
    for module in modules():
        if module.startswith("parallel.") and room(module, packages) == module and module not in packages:
            assert not imported_rooms(module) & packages, (module, imported_rooms(module))


def test_the_cost_model_never_imports_the_engine():
    assert not imported_rooms("simulator.costs") & {"simulator.engine", "simulator.network", "simulator.search"}
    assert not imported_rooms("simulator.network") & {"simulator.engine", "simulator.search"}
    assert "simulator.search" not in imported_rooms("simulator.engine")


def test_the_commands_sit_on_top_of_the_command_line():
    for below in ("cli.options", "cli.tools", "cli.claims", "cli.output", "cli.output_file"):
        assert "cli.commands" not in imported_rooms(below), below
    assert not imported_rooms("cli.options") - {"cli.options"}  # flags import nothing else of cli/


# ---------------------------------------------------------------- sizes


def test_small_folders_and_modules():
    crowded, long = [], []
    for package in PACKAGES:
        for folder in [ROOT / package, *(p for p in (ROOT / package).rglob("*") if p.is_dir())]:
            count = len(list(folder.glob("*.py")))
            if count > MAX_MODULES_PER_FOLDER:
                crowded.append(f"{folder.relative_to(ROOT)}: {count} modules")
        for path in (ROOT / package).rglob("*.py"):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > MAX_MODULE_LINES:
                long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not crowded and not long, (crowded, long)


# ---------------------------------------------------------------- the map


def test_the_architecture_doc_names_every_subpackage_and_only_real_ones():
    text = ARCHITECTURE_DOC.read_text(encoding="utf-8")
    named = set(re.findall(rf"\b((?:{'|'.join(PACKAGES)})(?:/\w+)+)/(?![\w.])", text))
    real = {name.replace(".", "/") for name in subpackages()}
    assert real - named == set(), f"subpackages docs/architecture.md does not name: {sorted(real - named)}"
    assert named - real == set(), f"docs/architecture.md names folders that are not subpackages: {sorted(named - real)}"
