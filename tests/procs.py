"""Child-process helpers for the tests that stop a run and check nothing it started outlives it (Linux /proc)."""

from __future__ import annotations

from pathlib import Path

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
