"""Child-process helpers: train/distill.py in a fresh process, and the /proc reads of the tests that stop a run
and check nothing it started outlives it (Linux)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent

HAS_PROC = Path("/proc/self/task").is_dir()


def child_pids(pid: int) -> list[int]:
    """The direct children of process `pid`."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.is_file() else []


def running(pid: int) -> bool:
    """Process `pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def run_distill(recipe: dict, tmp_path: Path, **env_extra: str) -> subprocess.CompletedProcess:
    """train/distill.py on `recipe` (written to tmp_path/recipe.yaml) in a fresh process, offline, output captured."""
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **env_extra)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, str(REPO / "train" / "distill.py"), "--recipe", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=REPO,
    )
