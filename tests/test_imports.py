"""No import circles among the packages' modules, counting imports inside functions too: a module that needs
another's piece imports it, and the piece lives where both can import it without going round."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("distill", "decode")


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the shipped packages (a package is its __init__)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of the packages it imports anywhere in its file (top level or inside a function)."""
    files = module_files()
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = absolute(node, package)
                for alias in node.names:
                    sub = f"{base}.{alias.name}" if base else alias.name
                    graph[name].add(sub if sub in files else base)
            elif isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names)
        graph[name] = {m for m in graph[name] if m in files and m != name}
    return graph


def absolute(node: ast.ImportFrom, package: str) -> str:
    """The absolute module an ImportFrom names: `from .x import y` in package `p.q` is `p.q.x`."""
    if node.level == 0:
        return node.module or ""
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    graph = import_graph()
    assert "decode.speculative" in graph and "decode.kinds.eagle3.training" in graph  # the walk sees subpackages
    assert "distill.kinds" in graph["distill.training.run_state"]  # and imports inside functions
    assert cycles(graph) == []


def test_relative_imports_resolve():
    node = ast.parse("from ..kinds import eagle3").body[0]
    assert absolute(node, "distill.training") == "distill.kinds"
    assert absolute(ast.parse("from . import hub").body[0], "distill.publishing") == "distill.publishing"


# The layout packages group modules and hold nothing themselves: each thing is imported from the module it lives in.
LAYOUT_PACKAGES = ("distill", "distill.data", "distill.training", "distill.publishing")


def test_layout_packages_hold_only_a_docstring():
    files = module_files()
    for package in LAYOUT_PACKAGES:
        body = ast.parse(files[package].read_text()).body
        assert ast.get_docstring(ast.Module(body=body, type_ignores=[])), f"{package}/__init__.py has no docstring"
        assert len(body) == 1, f"{package}/__init__.py holds code: import from its modules instead"


def test_layout_subpackages_list_their_modules():
    """Each subpackage's docstring names every module in it, one line each (the line starts with its name)."""
    files = module_files()
    for package in LAYOUT_PACKAGES[1:]:
        listed = {
            line.split()[0]
            for line in ast.get_docstring(ast.parse(files[package].read_text())).splitlines()
            if line.strip()
        }
        modules = {name.rpartition(".")[2] for name in files if name.rpartition(".")[0] == package}
        assert modules <= listed, f"{package}/__init__.py does not list {sorted(modules - listed)}"


# ---------------------------------------------------------------- the command lines answer --help at once

# Each entry point as a user runs it, then what it had imported when argparse answered (and exited). torch and
# transformers take seconds to import; --help, argument errors and --print-config need neither.
ANSWERED = """
import runpy, sys
sys.argv = [sys.argv[1], *sys.argv[2:]]
try:
    if sys.argv[0].endswith(".py"):
        runpy.run_path(sys.argv[0], run_name="__main__")
    else:
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
except SystemExit as done:
    print("exit", done.code)
print("heavy", sorted(m for m in ("torch", "transformers", "accelerate") if m in sys.modules))
"""


@pytest.mark.parametrize(
    ("command", "answer"),
    [
        (["train/distill.py", "--help"], "exit 0"),
        (["train/distill.py", "--no-such-flag"], "exit 2"),
        (["train/distill.py", "--print-config", "train.lr=1e-4"], "  lr: 0.0001"),
        (["train/publish.py", "--help"], "exit 0"),
        (["train/publish.py", "runs/x"], "exit 2"),  # --repo-id missing
        (["decode", "--help"], "exit 0"),
    ],
    ids=["distill-help", "distill-bad-flag", "distill-print-config", "publish-help", "publish-missing-arg", "decode"],
)
def test_a_command_line_answers_without_importing_torch(command, answer):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    proc = subprocess.run(
        [sys.executable, "-c", ANSWERED, *command], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert answer in lines, proc.stdout[-2000:]
    assert lines[-1] == "heavy []", (command, lines[-1])
