"""The suite's own rule for the shared fixtures (tests/conftest.py): tests marked `shared` skip where ../shared is
absent, except in CI (CI=true), where selecting one without it fails the run. Checked on a copy of the conftest
in a folder with no ../shared, run by a real pytest."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

TESTS = """
import pytest

@pytest.mark.shared
def test_needs_the_reference_pair():
    pass

def test_plain():
    pass
"""


@pytest.fixture
def bare_checkout(tmp_path) -> Path:
    """A checkout of tests/conftest.py and two tests, one marked `shared`, with no ../shared beside it."""
    root = tmp_path / "checkout"
    (root / "tests").mkdir(parents=True)
    shutil.copy(HERE / "conftest.py", root / "tests" / "conftest.py")
    (root / "tests" / "test_two.py").write_text(TESTS)
    (root / "pytest.ini").write_text("[pytest]\nmarkers =\n    shared: needs ../shared\n")
    assert not (root.parent / "shared").exists()
    return root


def pytest_in(root: Path, ci: str | None, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=root, env=env, timeout=300)


@pytest.mark.parametrize("ci", [None, "false"])
def test_shared_tests_skip_where_the_fixtures_are_absent(bare_checkout, ci):
    proc = pytest_in(bare_checkout, ci)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed, 1 skipped" in proc.stdout and "../shared (reference pair and prompt sets)" in proc.stdout


@pytest.mark.parametrize("ci", ["true", "1"])
def test_in_ci_a_shared_test_without_the_fixtures_fails_the_run(bare_checkout, ci):
    proc = pytest_in(bare_checkout, ci)
    assert proc.returncode != 0 and "passed" not in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 1, proc.stdout + proc.stderr
    assert "CI=true" in errors[0] and "test_needs_the_reference_pair" in errors[0] and "shared" in errors[0]


def test_in_ci_a_selection_without_shared_tests_runs(bare_checkout):
    proc = pytest_in(bare_checkout, "true", "-k", "plain")
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout + proc.stderr
