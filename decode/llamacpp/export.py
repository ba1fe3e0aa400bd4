"""A saved draft as the GGUF file llama.cpp serves next to its target:

    llama-server -m TARGET.gguf -md DRAFT.gguf --spec-type T --spec-draft-n-max K

where T is the draft kind's ``llamacpp_spec_type`` (``decode.kinds``). The draft folder (a run's best/, a checkpoint
or a publish folder) is first *staged* by its kind (``decode.kinds.<kind>.gguf.gguf_folder``: the config keys
llama.cpp's converter would otherwise default stated, the weights linked), then converted by llama.cpp's own
``convert_hf_to_gguf.py`` (``decode.llamacpp.convert``), reading the target's HF folder for its tokenizer and sizes.
The GGUF is written whole (a temporary name, then renamed) or not at all.

:func:`plan` makes every check before anything is written: the kind is one llama.cpp serves, the target is an HF
folder (a ``.gguf`` target cannot give the converter its tokenizer files), llama.cpp and its converter are found,
and its ``llama-server`` lists the kind's ``--spec-type``. Torch is imported only by :func:`export_draft`.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from decode import kinds
from decode.llamacpp.binaries import LlamaCpp, check_spec_type, find
from decode.llamacpp.convert import OUTTYPES, convert

DEFAULT_TYPE = "f16"  # --gguf with no type, export.gguf: true
SERVER = "llama-server"
# the target's files the converter reads (its config and tokenizer), fetched alone for a Hub id
TARGET_FILES = [
    "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
]  # fmt: skip


def gguf_name(outtype: str) -> str:
    """The file name of a draft's GGUF of type ``outtype``: ``draft-f16.gguf``."""
    return f"draft-{outtype}.gguf"


def parse_types(value: bool | str | None) -> tuple[str, ...]:
    """The GGUF types asked for: ``True`` -> (:data:`DEFAULT_TYPE`,), ``"f16,q8_0"`` -> both, falsy -> ().

    Raises:
        ValueError: a type the converter does not write, naming those it does.
    """
    if value is None or value is False or value == "":
        return ()
    if value is True:
        return (DEFAULT_TYPE,)
    types = tuple(dict.fromkeys(t.strip().lower() for t in str(value).split(",") if t.strip()))
    bad = [t for t in types if t not in OUTTYPES]
    if bad or not types:
        raise ValueError(f"GGUF type {', '.join(bad) or repr(value)}: choose among {', '.join(OUTTYPES)}")
    return types


def spec_type(kind: str) -> str:
    """llama.cpp's ``--spec-type`` for drafts of ``kind``.

    Raises:
        ValueError: one line: llama.cpp serves no draft of this kind, naming what does (``decode.kinds.gguf``).
    """
    kinds.gguf(kind)  # refuses a kind llama.cpp does not serve
    return str(kinds.traits(kind).llamacpp_spec_type)


def launch_line(spec: str, num_draft_tokens: int, target: str = "TARGET.gguf", draft: str = "DRAFT.gguf") -> str:
    """The ``llama-server`` command that serves ``draft`` next to ``target``."""
    return f"llama-server -m {target} -md {draft} --spec-type {spec} --spec-draft-n-max {int(num_draft_tokens)}"


def target_folder(target: str, revision: str | None = None) -> Path:
    """The target's HF folder the converter reads (config.json and tokenizer): a local folder as it is, a Hub id's
    config and tokenizer files from the Hub (or its local cache offline).

    Raises:
        ValueError: one line: a ``.gguf`` target (the converter needs the HF folder it was made from), a folder
            without config.json, a Hub id that cannot be had.
    """
    if not target:
        raise ValueError("the target is unknown: llama.cpp's converter needs the target's HF folder")
    if str(target).lower().endswith(".gguf"):
        raise ValueError(
            f"target {target!r} is a GGUF file: llama.cpp's converter needs the target's HF folder (config.json and "
            "tokenizer files) to write a draft's GGUF; give the HF folder or Hub id the GGUF was made from"
        )
    path = Path(target).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"target {target!r} has no config.json: llama.cpp's converter needs the target's HF folder"
            )
        return path
    if path.exists() or str(target).startswith((".", "/", "~")):
        raise ValueError(f"target {target!r} is not an HF folder: llama.cpp's converter needs one (with config.json)")
    from huggingface_hub import snapshot_download

    from distill.publishing.hub import hub_offline

    try:
        where = snapshot_download(
            str(target), revision=revision, allow_patterns=TARGET_FILES, local_files_only=hub_offline()
        )
    except Exception as e:  # noqa: BLE001 - offline, gated, missing: one line saying which
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"target {target!r}: its config and tokenizer could not be had for llama.cpp's converter ({first}); "
            "download it (hf download) or give its local HF folder"
        ) from None
    return Path(where)


@dataclass(frozen=True)
class Plan:
    """What an export needs, checked: the kind, its spec type, the llama.cpp, the target's HF folder, the types."""

    kind: str
    spec_type: str
    llama_cpp: LlamaCpp
    target_dir: Path | None  # None: not known yet (a target a run builds), resolved when the export runs
    types: tuple[str, ...]


def plan(
    kind: str,
    target: str | None,
    types: tuple[str, ...],
    llama_cpp: str | os.PathLike | None = None,
    revision: str | None = None,
) -> Plan:
    """Every check of an export of a ``kind`` draft for ``target``, before anything is written (module docstring);
    ``target`` None: a target not made yet, left unchecked.

    Raises:
        ValueError: one line (``decode.llamacpp.binaries.LlamaCppMissing`` among them): the kind, the target, the
            llama.cpp build.
    """
    spec = spec_type(kind)
    for t in types:
        parse_types(t)
    lc = find(llama_cpp, need=SERVER)
    lc.convert_script()
    check_spec_type(lc.tool(SERVER), spec)
    return Plan(kind, spec, lc, None if target is None else target_folder(target, revision), tuple(types))


def check_folder(folder: str | os.PathLike, target_dir: Path) -> str:
    """The kind of the draft saved in ``folder``, checked to be one llama.cpp serves, made for the target in
    ``target_dir``, and staged as its kind requires (``decode.kinds.<kind>.gguf.check``). Imports torch.

    Raises:
        ValueError: one line naming the problem and the fix.
    """
    from transformers import AutoConfig

    from decode.kinds.dispatch import MODULES, read_as

    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such draft folder (a run's best/, a checkpoint or a publish folder)")
    kind = read_as(folder)
    module = kinds.gguf(kind)
    MODULES[kind].check_folder(folder, AutoConfig.from_pretrained(target_dir), str(target_dir))
    module.check(folder, target_dir)
    return kind


def export_draft(
    folder: str | os.PathLike, target_hf_dir: str | os.PathLike, out: str | os.PathLike, outtype: str, lc: LlamaCpp
) -> Path:
    """Write the GGUF of the draft saved in ``folder`` (for the target whose HF folder is ``target_hf_dir``) to
    ``out``, of type ``outtype`` (f32, f16, bf16, q8_0), with the llama.cpp ``lc``; returns ``out``.

    Raises:
        ValueError: one line, before ``out`` is written: a kind llama.cpp does not serve, a draft made for another
            target, a layout llama.cpp would run otherwise; ``decode.llamacpp.convert.ConversionFailed`` with the
            converter's reason.
    """
    target_dir = Path(target_hf_dir)
    parse_types(outtype)
    kind = check_folder(folder, target_dir)
    lc.convert_script()
    reads_target = kinds.traits(kind).reads_hidden_states  # its tokenizer and sizes are the target's
    with tempfile.TemporaryDirectory(prefix="draftsmith-gguf-") as tmp:
        staged = kinds.gguf(kind).gguf_folder(Path(folder), Path(tmp) / "draft", target_dir)
        return convert(staged, out, outtype, lc, target_model_dir=target_dir if reads_target else None)
