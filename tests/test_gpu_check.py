"""bench/gpu_check.sh: valid bash, and a clear stop (exit 2, one line) on a machine without a CUDA GPU."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.sh"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: the script would run the check")
def test_gpu_check_stops_without_cuda(tmp_path):
    run = subprocess.run(
        ["bash", str(SCRIPT)], env={**os.environ, "OUT": str(tmp_path / "out")},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0], run.stderr
    assert not (tmp_path / "out").exists(), "nothing is written before the CUDA check"
