"""A disk that fills at any write of a run: one `error:` line naming the path and the space left, exit status 2,
nothing half-written, the previous checkpoint and best/ intact, and `--resume` goes on once space is freed.

train/distill.py runs in a fresh process (DISK_FULL) that fills the disk the moment the run opens a chosen file
for writing, through every writer a run uses: Python's open (JSON, metrics.jsonl, the copies into best/), torch's
zip writer (optimizer, scheduler, RNG state) and safetensors' (weights). On a small tmpfs (root) the filesystem is
really filled; elsewhere the file is made a link to /dev/full, whose writes fail with ENOSPC as a full disk's do.
Each run is the `--resume` of the one before: the run that fails at one write proves the previous one resumable.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.procs import tiny_recipe, tiny_run_paths

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

DISK_FULL = """
import fnmatch, os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
out, pattern, how = Path(sys.argv[2]).resolve(), sys.argv[3], sys.argv[4]
fired, busy = [], []


def fill():
    # every byte the filesystem has left goes to a ballast file beside output_dir
    fd = os.open(out.parent / "ballast", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        st = os.statvfs(out.parent)
        try:
            os.posix_fallocate(fd, os.fstat(fd).st_size, st.f_bavail * st.f_frsize)
        except OSError:
            pass
        for size in (1 << 16, 1):
            try:
                while True:
                    os.write(fd, b"\\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)


def hit(path):
    if fired or busy or pattern == "-":
        return
    try:
        rel = Path(os.path.abspath(os.fsdecode(path))).relative_to(out)
    except (TypeError, ValueError):
        return
    if not fnmatch.fnmatch(str(rel), pattern):
        return
    fired.append(rel)
    busy.append(1)
    if how == "fill":
        fill()
    else:
        os.symlink("/dev/full", out / rel)  # the file to be created: every write to it fails with ENOSPC
    sys.stderr.write(f"disk full at {rel}\\n")


def audit(event, args):
    if event == "open" and not isinstance(args[0], int):
        path, mode, flags = args
        if (mode and any(c in mode for c in "wax+")) or (flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            hit(path)


sys.addaudithook(audit)  # Python's open and os.open
import torch
import safetensors.torch

zip_writer = torch._C.PyTorchFileWriter  # torch.save opens the file in C++


def writer(name, *args, **kwargs):
    if isinstance(name, str | os.PathLike):
        hit(name)
    return zip_writer(name, *args, **kwargs)


torch._C.PyTorchFileWriter = writer
serialize = safetensors.torch.serialize_file  # safetensors opens the file in Rust


def serialize_file(tensors, filename, *args, **kwargs):
    hit(filename)
    return serialize(tensors, filename, *args, **kwargs)


safetensors.torch.serialize_file = serialize_file
from tests.procs import load_script

load_script("train/distill.py").main(sys.argv[5:])
"""

STATE = ("model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl")
# (file opened for writing when the disk fills, relative to output_dir), in the order a run writes them: each run
# resumes the one before, which failed at an earlier one. The first checkpoint is step-0's, the next step-1's.
STEP1 = "checkpoints/.tmp-step-1"
EVERY_WRITE = (
    ".tmp-resolved_recipe.yaml-*",  # the run's resolved recipe, at its start
    "metrics.jsonl",  # its first row (the start record): a new file
    ".tmp-base_eval.json-*",  # step-0's checkpoint: the base draft's evaluation, beside the checkpoints
    ".tmp-best-*/model.safetensors",  # best/ exported from step-0
    f"{STEP1}/*samples.jsonl*",  # step 1's evaluation: its samples
    *(f"{STEP1}/state/{name}" for name in STATE),  # the training state: weights, optimizer, scheduler, RNG
    f"{STEP1}/model.safetensors",  # the draft as engines load it
    f"{STEP1}/.tmp-eval.json-*",
    f"{STEP1}/.tmp-trainer_state.json-*",
    ".tmp-report.json-*",  # the run's end
)
# without root: a file created by each kind of writer (a new file only: /dev/full replaces it; a writer that clears its
# folder or writes through a file of its own first, as transformers and safetensors do for weights, removes the link)
SOME_WRITES = (
    "metrics.jsonl",
    ".tmp-best-*/model.safetensors",
    f"{STEP1}/state/optimizer.bin",
    f"{STEP1}/.tmp-eval.json-*",
    ".tmp-report.json-*",
)


def run_full_at(tmp_path: Path, recipe: Path, out: Path, pattern: str, how: str, *args: str) -> tuple[int, str]:
    """train/distill.py on `recipe` (DISK_FULL), the disk filling at the first write-open of a file matching
    `pattern` under `out` ("-": never); its exit status and output."""
    script = tmp_path / "disk_full.py"
    script.write_text(DISK_FULL)
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, str(script), str(REPO), str(out), pattern, how, "--recipe", str(recipe), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def snapshot(directory: Path) -> dict[str, str]:
    """Every file under `directory` by its relative path -> its content's hash."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def complete_dirs(out: Path) -> dict[str, dict[str, str]]:
    """best/ and every checkpoints/step-N, each checked complete, by name -> snapshot."""
    found = {"best": snapshot(out / "best")} if (out / "best").is_dir() else {}
    for step in sorted((out / "checkpoints").glob("step-*")):
        files = snapshot(step)
        assert "trainer_state.json" in files and all(f"state/{name}" in files for name in STATE), step
        if "eval.json" in files:
            assert {"model.safetensors", "config.json", "resolved_recipe.yaml"} <= set(files), step
        found[f"checkpoints/{step.name}"] = files
    if "best" in found:
        assert {"model.safetensors", "config.json", "eval.json"} <= set(found["best"])
    return found


def one_row_each(out: Path) -> list[tuple[int, str]]:
    """metrics.jsonl's (step, kind of row) pairs, checked to be unique."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kinds = [(r["step"], "start" if "distributed" in r else "eval" if "eval/speedup" in r else "train") for r in rows]
    assert len(kinds) == len(set(kinds)), kinds
    return kinds


def fill_each_write_in_turn(tmp_path: Path, out: Path, points: tuple[str, ...], how: str, free_space) -> None:
    paths = tiny_run_paths(tmp_path / "assets")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(tiny_recipe(paths, out, {"max_new_tokens": 8}, {"max_steps": 1, "batch_size": 2}))
    )
    for i, pattern in enumerate(points):
        before = complete_dirs(out) if out.is_dir() else {}
        rc, output = run_full_at(tmp_path, recipe, out, pattern, how, *(["--resume"] if i else []))
        fired = re.findall(r"disk full at (\S+)", output)
        assert fired, f"{pattern}: the run never wrote it\n{output[-3000:]}"
        errors = [line for line in output.splitlines() if line.startswith("error:")]
        assert rc == 2 and len(errors) == 1, f"{fired[0]}: rc {rc}\n{output[-3000:]}"
        assert "Traceback" not in output, f"{fired[0]}\n{output[-3000:]}"
        line = errors[0]
        assert re.search(rf"{re.escape(str(out))}\S*", line), line  # names the path
        assert re.search(r"\d+(\.\d)? (B|KiB|MiB|GiB|TiB) free on its filesystem", line), line  # and the space left
        if how == "fill":
            assert "no space left on device" in line, line
        assert not [p for p in out.rglob(".tmp-*")], f"{fired[0]}: {list(out.rglob('.tmp-*'))}"
        after = complete_dirs(out)
        changed = [name for name, files in before.items() if after.get(name) != files]
        if any(name not in before for name in after):  # a checkpoint completed first: best/ may follow it
            changed = [name for name in changed if name != "best"]
        assert not changed, f"{fired[0]}: {changed} changed"
        assert not (out / "report.json").exists()
        free_space()
    rc, output = run_full_at(tmp_path, recipe, out, "-", how, "--resume")
    assert rc == 0, output[-3000:]
    assert json.loads((out / "report.json").read_text())["best_step"] in (0, 1)
    assert {"best", "checkpoints/step-1"} <= set(complete_dirs(out))
    # the last run resumed from step-1 (its report failed): its start record is step 1's
    assert sorted(one_row_each(out)) == [(0, "eval"), (0, "start"), (1, "eval"), (1, "start"), (1, "train")]


def test_a_disk_full_at_each_write_is_one_line_and_resume_goes_on(tmp_path):
    """A real full filesystem (a small tmpfs, which needs root to mount)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mnt)], capture_output=True)
    if mount.returncode:
        pytest.skip("cannot mount a tmpfs here (needs root); test_a_write_to_a_full_device_... runs without")
    try:
        fill_each_write_in_turn(
            tmp_path, mnt / "run", EVERY_WRITE, "fill", lambda: (mnt / "ballast").unlink(missing_ok=True)
        )
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_write_to_a_full_device_at_each_writer_is_one_line_and_resume_goes_on(tmp_path):
    """Without root: the file a writer creates is a link to /dev/full (ENOSPC on every write); the run's own clean-up
    removes it with the rest of the partial write."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    fill_each_write_in_turn(tmp_path, tmp_path / "run", SOME_WRITES, "devfull", lambda: None)
