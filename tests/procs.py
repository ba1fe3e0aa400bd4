"""Child-process helpers: train/distill.py in a fresh process (and a tiny recipe for it), and the /proc reads of
the tests that stop a run and check nothing it started outlives it (Linux)."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent

HAS_PROC = Path("/proc/self/task").is_dir()


def load_script(relpath: str, name: str | None = None):
    """A script of the repo (train/distill.py, bench/...) imported as a module by its path, registered in
    sys.modules under `name` (default: its file stem) because dataclasses look their module up there."""
    path = REPO / relpath
    spec = importlib.util.spec_from_file_location(name or f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def tiny_recipe(paths: dict, out: Path, distill: dict, train: dict, **sections: dict) -> dict:
    """A train/distill.py recipe for a tiny saved pair: `paths` has target, draft, train and eval (prompt files).
    FKL, lr 1e-3, one warm-up step, no evaluation but step 0's, a log line every step; `distill`, `train` and
    any other section given update those defaults."""
    recipe = {
        "target": {"model": str(paths["target"]), "dtype": "float32"},
        "draft": {"model": str(paths["draft"]), "dtype": "float32"},
        "data": {"train_prompts": str(paths["train"]), "eval_prompts": str(paths["eval"]), "max_prompt_tokens": 32},
        "distill": {"loss": "fkl", **distill},
        "train": {"lr": 1e-3, "warmup_steps": 1, **train},
        "eval": {"every": 100_000, "num_prompts": 1, "max_new_tokens": 8, "repeats": 1, "hf_assisted": False},
        "log": {"report_to": "none", "every": 1},
        "output_dir": str(out),
    }
    for name, values in sections.items():
        recipe[name].update(values)
    return recipe


def tiny_run_paths(root: Path, train_prompts: int = 8) -> dict:
    """A tiny saved pair and its prompt files under `root`: the `paths` of :func:`tiny_recipe`."""
    from tests.tiny import make_pair, make_prompts

    target, draft = make_pair(root / "pair")
    return {
        "target": target,
        "draft": draft,
        "train": make_prompts(root / "train.jsonl", train_prompts, seed=1),
        "eval": make_prompts(root / "eval.jsonl", 2, seed=2),
    }


def child_pids(pid: int) -> list[int]:
    """The direct children of process `pid` (started by any of its threads)."""
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(c) for c in children.read_text().split() if int(c) not in found]
        except OSError:
            continue  # the thread or the process exited meanwhile
    return found


def wait_for_child(pid: int, marker: str, timeout_s: float) -> int:
    """The pid of the first child of `pid` whose command line holds `marker`; fails if `pid` exits or
    `timeout_s` passes first. Matching the command line skips short-lived helpers an import may spawn."""
    deadline = time.time() + timeout_s
    while True:
        for child in child_pids(pid):
            try:
                if marker in Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace"):
                    return child
            except OSError:
                continue  # it exited between the two reads
        assert running(pid) and time.time() < deadline, f"no child running {marker} started"
        time.sleep(0.05)


def running(pid: int) -> bool:
    """Process `pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, children first. torch's elastic agent (accelerate launch, torch.distributed.run)
    starts each worker in a session of its own, so a signal to the launcher's process group misses them."""
    found, todo = [], child_pids(pid)
    while todo:
        child = todo.pop(0)
        found.append(child)
        todo += child_pids(child)
    return found


def signal_tree(pid: int, sig: int) -> None:
    """`sig` to `pid`'s process group and to every process below it (workers in sessions of their own too)."""
    for target in [pid, *descendants(pid)]:
        try:
            os.kill(target, sig)
        except ProcessLookupError:
            pass  # it exited meanwhile
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def stop_tree(pid: int, grace_s: float = 10.0) -> None:
    """SIGABRT to the tree under `pid` (each Python process with PYTHONFAULTHANDLER=1 writes its stacks), then,
    after `grace_s`, SIGKILL to whatever is left of it: nothing a hung test started outlives the test."""
    tree = [pid, *descendants(pid)]  # read before the launcher dies and its workers are re-parented
    signal_tree(pid, signal.SIGABRT)
    deadline = time.time() + grace_s
    while time.time() < deadline and any(running(p) for p in tree):
        time.sleep(0.2)
    for target in tree:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


def free_port() -> int:
    """A TCP port free now, for a launch's rendezvous: each multi-process run gets its own instead of accelerate's
    fixed 29500, which a run still closing down (or anything else on the machine) may hold."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_captured(cmd: list[str], *, env: dict, cwd: Path | str, timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)` for a run that may start processes of its own
    (accelerate launch, its workers): past `timeout` every process below it gets SIGABRT first, so that
    Python's faulthandler writes each one's stacks to the captured stderr, and the test fails with them (where a
    run hung) instead of a bare TimeoutExpired."""
    env = dict(env, PYTHONFAULTHANDLER="1")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_tree(proc.pid, grace_s=20)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a pipe still held open: fail with what is known
            proc.kill()
            stdout, stderr = "", "(its output could not be read: a process still holds the pipes)"
        import pytest

        pytest.fail(f"{' '.join(map(str, cmd[:6]))}... ran past {timeout:.0f} s; its stacks:\n{stderr[-12000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def run_distill(recipe: dict, tmp_path: Path, **env_extra: str) -> subprocess.CompletedProcess:
    """train/distill.py on `recipe` (written to tmp_path/recipe.yaml) in a fresh process, offline, output captured."""
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **env_extra)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return run_captured([sys.executable, str(REPO / "train" / "distill.py"), "--recipe", str(path)],
                        env=env, timeout=600, cwd=REPO)  # fmt: skip
