"""A kind lives in one place: outside its folder (decode/kinds/<kind>/) and the registry (decode/kinds/__init__.py),
no code of the shipped packages or entry scripts names a kind. Prose may (docstrings, comments, help and messages:
a string with a space in it); code may not: an import of a kind's folder, an identifier with a kind's name in it
(`is_eagle3`, `dflash`), or a string that is a kind's name (`kind == "pard"`, `("eagle3", "peagle")`). Such code
asks the registry for a trait, or calls a function every kind's folder provides."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from decode import kinds as registry

REPO = Path(__file__).resolve().parent.parent
SCANNED = ("distill", "decode", "train")
KIND_FOLDERS = REPO / "decode" / "kinds"


def scanned_files() -> list[Path]:
    """Every .py file of the packages and entry scripts, less the kinds' folders and the registry."""
    own = {KIND_FOLDERS / name for name in registry.names()}
    files = []
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            if path == KIND_FOLDERS / "__init__.py" or any(folder in path.parents for folder in own):
                continue
            files.append(path)
    return files


def docstrings(tree: ast.AST) -> set[int]:
    """ids of the string nodes that are docstrings (prose)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def kind_in_identifier(identifier: str, names: tuple[str, ...]) -> str | None:
    """The kind an identifier names as one of its `_`-separated words (`is_eagle3`, `_dflash_support`)."""
    words = set(identifier.lower().split("_"))
    return next((n for n in names if n in words), None)


def namings(path: Path, names: tuple[str, ...]) -> list[str]:
    """Where the file's code names a kind: `file:line: what`."""
    tree = ast.parse(path.read_text())
    prose = docstrings(tree)
    where = path.relative_to(REPO)
    found = []

    def note(node: ast.AST, what: str) -> None:
        found.append(f"{where}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[:2] == ["decode", "kinds"] and len(parts) > 2 and parts[2] in names:
                note(node, f"imports from {node.module}")
            elif node.module == "decode.kinds":
                for alias in node.names:
                    if alias.name in names:
                        note(node, f"imports decode.kinds.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[:2] == ["decode", "kinds"] and len(parts) > 2 and parts[2] in names:
                    note(node, f"imports {alias.name}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            if node.value in names:
                note(node, f"the string {node.value!r}")
        elif isinstance(node, ast.Name) and (kind := kind_in_identifier(node.id, names)):
            note(node, f"the name {node.id} ({kind})")
        elif isinstance(node, ast.Attribute) and (kind := kind_in_identifier(node.attr, names)):
            note(node, f"the attribute .{node.attr} ({kind})")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if kind := kind_in_identifier(node.name, names):
                note(node, f"defines {node.name} ({kind})")
    return found


def test_no_code_outside_a_kinds_folder_names_a_kind():
    names = registry.names()
    found = [line for path in scanned_files() for line in namings(path, names)]
    assert not found, "kind named outside its folder (ask the registry's traits instead):\n" + "\n".join(found)


def test_the_scan_sees_what_it_must_refuse(tmp_path):
    """The scan itself: each way code can name a kind is found, prose is not."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""A module about eagle3 heads (prose)."""\n'
        "from decode.kinds.dflash import decoding\n"
        "from decode.kinds import pard, traits\n"
        "import decode.kinds.peagle.training\n"
        "def is_eagle3(x):\n"
        '    """True for eagle3 folders."""\n'
        '    return x == "standalone" or dflash.ok or decoding.is_dspark_folder(x)\n'
        'HELP = "kind=dflash: the layers"\n'
    )
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        found = namings(sample, registry.names())
    finally:
        REPO = saved
    whats = [line.split(": ", 1)[1] for line in found]
    assert sorted(whats) == sorted(
        [
            "imports from decode.kinds.dflash",
            "imports decode.kinds.pard",
            "imports decode.kinds.peagle.training",
            "defines is_eagle3 (eagle3)",
            "the string 'standalone'",
            "the name dflash (dflash)",
            "the attribute .is_dspark_folder (dspark)",
        ]
    ), whats
    assert not re.search(r"HELP|prose", " ".join(found))
