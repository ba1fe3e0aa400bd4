"""Run llama.cpp's own converter (``convert_hf_to_gguf.py``) on an HF folder: the one place that calls it.

The converter is run as a subprocess with the ``gguf-py`` beside it on ``PYTHONPATH``, so the GGUF layout is the
one the llama.cpp build that will load it expects. Its error is cut to its last line, the one that says why.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from decode.llamacpp.binaries import LlamaCpp

OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # what the converter writes itself; other quantizations: llama-quantize


class ConversionFailed(ValueError):
    """llama.cpp's converter refused the folder; the message has its reason (unknown tokenizer, architecture...)."""


def convert(
    src: str | os.PathLike, out: str | os.PathLike, outtype: str, lc: LlamaCpp,
    target_model_dir: str | os.PathLike | None = None, timeout: float = 3600.0,
) -> Path:  # fmt: skip
    """Convert HF folder ``src`` to the GGUF file ``out`` (written whole: to a temporary name, then renamed).

    ``target_model_dir``: the target's HF folder, for drafts that take their tokenizer and sizes from it (an
    EAGLE-3 head, a DFlash or DSpark draft).

    Raises:
        ValueError: ``outtype`` is not one the converter writes.
        LlamaCppMissing: no converter beside the llama.cpp found.
        ConversionFailed: the converter exited non-zero; its reason.
    """
    if outtype not in OUTTYPES:
        raise ValueError(f"GGUF type {outtype!r}: choose one of {', '.join(OUTTYPES)}")
    script = lc.convert_script()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    cmd = [sys.executable, str(script), str(src), "--outtype", outtype, "--outfile", str(partial)]
    if target_model_dir is not None:
        cmd += ["--target-model-dir", str(target_model_dir)]
    env = dict(os.environ)
    gguf_py = script.parent / "gguf-py"
    if gguf_py.is_dir():  # the converter's own gguf package, not an older one installed beside draftsmith
        env["PYTHONPATH"] = os.pathsep.join([str(gguf_py), *filter(None, [env.get("PYTHONPATH")])])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        partial.unlink(missing_ok=True)
        raise ConversionFailed(f"llama.cpp's converter did not finish {src} in {timeout:.0f} s") from None
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if "error" in ln.lower()), lines[-1] if lines else "")
        raise ConversionFailed(f"llama.cpp's converter refused {src}: {why}")
    partial.replace(out)
    return out
