"""What pyproject promises: a torch floor that covers the APIs the code calls, and a wheel whose missing checkout
files (recipes/, train/) end in one error naming the fix."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parent.parent

# The newest torch APIs the code calls, where it calls them, and the torch release that made each public.
TORCH_APIS = [
    ("distill/training/distributed.py", "from torch.distributed.tensor import DTensor", "2.5"),
    ("decode/kernels.py", "torch.is_autocast_enabled(x.device.type)", "2.4"),  # the device argument
]


def dependency(name: str) -> Requirement:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(r for r in map(Requirement, deps) if r.name == name)


def test_torch_floor_covers_the_apis_the_code_uses():
    floor = min(Version(s.version) for s in dependency("torch").specifier if s.operator == ">=")
    for path, call, since in TORCH_APIS:
        assert call in (REPO / path).read_text(), f"{path} no longer calls {call}: update TORCH_APIS"
        assert floor >= Version(since), f"pyproject's torch>={floor}, but {path} calls {call} (torch {since})"


@pytest.mark.slow
def test_wheel_lacks_the_checkout_files_and_the_quickstart_says_so(tmp_path):
    """`pip install .` ships distill/ and decode/ alone; building the quickstart pair from such an install stops
    with one line naming `pip install -e .`, before it writes anything."""
    src = tmp_path / "src"  # a copy: setuptools writes build/ and *.egg-info into the tree it builds
    for name in ("distill", "decode", "recipes", "train"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", str(src)]
        + ["-w", str(tmp_path / "dist"), "-q"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("draftsmith-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "distill/training/pretraining.py" in names and "decode/__main__.py" in names
    # every subpackage too (a kind's folder among them)
    packages = {
        p.parent.relative_to(REPO).as_posix()
        for top in ("distill", "decode")
        for p in (REPO / top).rglob("__init__.py")
    }
    shipped = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    assert packages <= shipped, f"packages the wheel lacks: {sorted(packages - shipped)}"
    assert not [n for n in names if n.startswith(("recipes/", "train/"))]

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    cache = tmp_path / "cache"
    code = (
        "import sys; from distill.training.pretraining import ensure_quickstart_pair as build; "
        "build(cache_dir=sys.argv[1])"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(cache)], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("FileNotFoundError: ") and str(site) in last, proc.stderr
    assert "recipes/ and train/" in last and last.endswith("pip install -e .")
    assert not cache.exists()
