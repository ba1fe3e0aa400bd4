"""Assert that a CI pass runs on the transformers release it claims to test (pyproject's range decides which).

python .ci/versions.py requirement   # print pyproject's transformers requirement, e.g. transformers>=5.19
python .ci/versions.py newest        # installed transformers is the newest release that requirement allows
python .ci/versions.py oldest        # installed transformers is the floor's release series, and vllm imports
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def requirement(name: str = "transformers") -> Requirement:
    """`name`'s requirement in pyproject's dependencies."""
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    return next(r for r in map(Requirement, deps) if r.name == name)


def installed(name: str) -> Version:
    from importlib.metadata import version

    return Version(version(name))


def newest_allowed(req: Requirement) -> Version:
    """The release pip picks for `req` on a clean install (its dependencies resolved too: a newer release whose
    dependencies the index lacks is not installable)."""
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", "-"]
    report = json.loads(subprocess.run([*cmd, str(req)], check=True, capture_output=True, text=True).stdout)
    return next(Version(i["metadata"]["version"]) for i in report["install"] if i["metadata"]["name"] == req.name)


def main(what: str) -> str:
    req = requirement()
    have = installed(req.name)
    if what == "requirement":
        return str(req)
    if what == "newest":
        want = newest_allowed(req)
        assert have == want, f"{req.name} {have} is installed, but the newest release {req} allows is {want}"
        return f"{req.name} {have}: the newest release {req} allows"
    if what == "oldest":
        floor = min(Version(s.version) for s in req.specifier if s.operator in (">=", "=="))
        assert have.release[:2] == floor.release[:2], f"{req.name} {have} is installed, not the floor's {floor}.x"
        import vllm

        return f"{req.name} {have}: pyproject's floor ({req}); vllm {vllm.__version__} imports"
    raise SystemExit(f"usage: {__doc__}")


if __name__ == "__main__":
    print(main(sys.argv[1] if len(sys.argv) > 1 else ""))
