"""The two models of ``python -m decode bench --engine llamacpp`` as GGUF files: what the bench reads of a GGUF
header (the ``gguf`` package), the draft kind a GGUF holds, whether a draft fits its target as llama.cpp will check,
and a target or draft given as an HF folder converted once into draftsmith's cache (``$DRAFTSMITH_CACHE/gguf``,
else ``~/.cache/draftsmith/gguf``) by llama.cpp's converter (``decode.llamacpp.convert``) or the draft exporter
(``decode.llamacpp.export``).
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from decode.llamacpp.binaries import LlamaCpp, cache_root

VOCAB_SLACK = 128  # llama.cpp serves a draft whose token count is within this of the target's (speculative.cpp)
VOCAB_CHECK_FROM = 5  # ... and whose tokens from this id on are the target's


# ---------------------------------------------------------------------------------------------------------------
# GGUF metadata (the gguf package)
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GgufInfo:
    """What the bench reads of a GGUF file's header."""

    path: Path
    architecture: str
    file_type: str | None  # "Q4_1", "Q8_0", "F32" (general.file_type); None when the file does not say
    tokens: tuple[str, ...] = field(repr=False)  # tokenizer.ggml.tokens ([] when it carries no vocabulary)
    embedding_length: int | None
    context_length: int | None
    target_hidden_size: int | None  # a draft over the target's hidden states: the width it reads
    block_size: int | None  # a block draft: the block it was trained for, its verified first position counted
    sample_from_anchor: bool  # ... whose first position proposes a token too (then it drafts the whole block)
    has_chat_template: bool
    tensors: frozenset[str] = field(repr=False)


def _value(fields: dict, key: str) -> Any:
    f = fields.get(key)
    if f is None:
        return None
    value = f.contents()
    return value


def file_type_name(code: int | None) -> str | None:
    """general.file_type as llama.cpp names it (3 -> "Q4_1", 0 -> "F32")."""
    if code is None:
        return None
    from gguf import LlamaFileType

    try:
        name = LlamaFileType(int(code)).name
    except ValueError:
        return f"type {int(code)}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


@functools.lru_cache(maxsize=16)
def _read_gguf(path: str, mtime_ns: int, size: int) -> GgufInfo:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    fields = reader.fields
    arch = _value(fields, "general.architecture") or ""

    def arch_int(key: str) -> int | None:
        value = _value(fields, f"{arch}.{key}")
        return int(value) if isinstance(value, (int, float)) else None

    tensors = frozenset(t.name for t in reader.tensors)
    hidden = arch_int("target_hidden_size")
    layers = _value(fields, f"{arch}.target_layers")
    if hidden is None and layers and "fc.weight" in tensors:  # the width its fc layer fuses, per target layer
        fc = next(t for t in reader.tensors if t.name == "fc.weight")
        hidden = int(fc.shape[0]) // len(layers)
    return GgufInfo(
        path=Path(path),
        architecture=arch,
        file_type=file_type_name(_value(fields, "general.file_type")),
        tokens=tuple(_value(fields, "tokenizer.ggml.tokens") or ()),
        embedding_length=arch_int("embedding_length"),
        context_length=arch_int("context_length"),
        target_hidden_size=hidden,
        block_size=arch_int("block_size"),
        sample_from_anchor=_value(fields, f"{arch}.sample_from_anchor") is True,
        has_chat_template="tokenizer.chat_template" in fields,
        tensors=tensors,
    )


def max_draft(info: GgufInfo) -> int | None:
    """The most tokens llama.cpp drafts a round with this draft GGUF (it clamps --spec-draft-n-max to it): a block
    draft's block less its verified first position, unless that position samples too; None: no limit."""
    if info.block_size is None:
        return None
    return info.block_size if info.sample_from_anchor else info.block_size - 1


def read_gguf(path: str | os.PathLike, key: str = "GGUF") -> GgufInfo:
    """The header of GGUF file ``path``; ValueError naming ``key`` when it is missing or not a GGUF file."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"{key} {str(path)!r}: no such GGUF file; fix the path")
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ValueError(
            f"{key} {str(path)!r} is a GGUF file, which needs the gguf package: pip install gguf"
        ) from None
    st = p.stat()
    try:
        return _read_gguf(str(p.resolve()), st.st_mtime_ns, st.st_size)
    except (ValueError, OSError, IndexError, KeyError) as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(
            f"{key} {str(path)!r} is not a readable GGUF file ({why}); re-download or convert it"
        ) from None


def gguf_kind(info: GgufInfo) -> str:
    """The draft kind a GGUF holds, by the kinds' ``gguf_architecture`` / ``gguf_tensors`` traits: the kind whose
    architecture it has and the most of whose telling tensors it holds; else a plain LM
    (:data:`decode.kinds.PLAIN_LM`)."""
    from decode import kinds

    matches = [
        t for t in kinds.KINDS.values()
        if t.gguf_architecture == info.architecture and set(t.gguf_tensors) <= info.tensors
    ]  # fmt: skip
    return max(matches, key=lambda t: len(t.gguf_tensors)).name if matches else kinds.PLAIN_LM


def check_vocab_count(both: str, target_tokens: int, draft_tokens: int) -> None:
    """ValueError (one line) when two vocabularies are further apart than llama.cpp serves (:data:`VOCAB_SLACK`)."""
    if abs(target_tokens - draft_tokens) > VOCAB_SLACK:
        raise ValueError(
            f"{both} do not fit: vocabularies of {target_tokens} and {draft_tokens} tokens (llama.cpp allows "
            f"{VOCAB_SLACK} apart); use a draft with the target's tokenizer"
        )


def check_fit(target: GgufInfo, draft: GgufInfo, reads_hidden_states: bool) -> None:
    """The draft GGUF fits the target GGUF as llama.cpp will check once loaded: its vocabulary (token count within
    llama.cpp's slack, the same tokens), and for a draft over the target's hidden states, the width it reads.

    Raises:
        ValueError: one line naming both files, the two figures and the fix.
    """
    both = f"--target {target.path.name} and --draft {draft.path.name}"
    if reads_hidden_states and draft.target_hidden_size and target.embedding_length:
        if draft.target_hidden_size != target.embedding_length:
            raise ValueError(
                f"{both} do not fit: the draft reads hidden states {draft.target_hidden_size} wide, the target's "
                f"embedding_length is {target.embedding_length}; use the draft made for this target"
            )
    if not draft.tokens or not target.tokens:  # a head that shares the target's vocabulary carries none
        return
    nt, nd = len(target.tokens), len(draft.tokens)
    check_vocab_count(both, nt, nd)
    for i in range(VOCAB_CHECK_FROM, min(nt, nd)):
        if target.tokens[i] != draft.tokens[i]:
            raise ValueError(
                f"{both} do not fit: their vocabularies differ first at token {i}: {target.tokens[i]!r} vs "
                f"{draft.tokens[i]!r}; use a draft with the target's tokenizer"
            )


# ---------------------------------------------------------------------------------------------------------------
# Models as GGUF files (converted once, cached)
# ---------------------------------------------------------------------------------------------------------------
def gguf_cache() -> Path:
    """Where converted GGUF files are kept: ``gguf/`` in draftsmith's cache (``binaries.cache_root``)."""
    return cache_root() / "gguf"


def folder_signature(folder: Path) -> str:
    """A digest of a model folder's files (names, sizes, modification times): a changed checkpoint is converted
    again."""
    h = hashlib.sha256(str(folder.resolve()).encode())
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(folder)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


def cached_gguf(folder: Path, outtype: str, lc: LlamaCpp, extra: str = "") -> Path:
    """The cache path of ``folder`` converted to ``outtype`` by ``lc``'s converter (it may not exist yet)."""
    key = hashlib.sha256(f"{folder_signature(folder)}|{outtype}|{lc.converter}|{extra}".encode()).hexdigest()[:16]
    return gguf_cache() / f"{folder.resolve().name}-{outtype}-{key}.gguf"


def target_gguf(target: str, outtype: str, lc: LlamaCpp) -> Path:
    """``--target`` as a GGUF file: the file itself, or an HF folder converted once into the cache.

    Raises:
        ValueError: neither a GGUF file nor a model folder; ConversionFailed (a ValueError) with the converter's
            reason.
    """
    from decode.llamacpp.convert import convert

    path = Path(target).expanduser()
    if path.suffix.lower() == ".gguf":
        read_gguf(path, "--target")
        return path
    if not (path / "config.json").is_file():
        raise ValueError(
            f"--target {target!r}: --engine llamacpp takes a .gguf file or a local Hugging Face model folder "
            "(with config.json)"
        )
    out = cached_gguf(path, outtype, lc)
    return out if out.is_file() else convert(path, out, outtype, lc)


def draft_gguf(draft: str, kind: str, target_hf: Path | None, outtype: str, lc: LlamaCpp,
               target: GgufInfo | None = None) -> Path:  # fmt: skip
    """``--draft`` as a GGUF file: the file itself, or a draft folder exported once into the cache by
    ``decode.llamacpp.export.export_draft`` (which reads the target's HF folder ``target_hf``). A plain LM folder
    next to a GGUF target (``target_hf`` None) is converted alone, once its vocabulary size is checked against the
    target GGUF's header ``target``.

    Raises:
        ValueError: a folder of a kind built over the target, next to a GGUF target (the converter needs the
            target's HF folder); a plain LM whose vocabulary cannot fit; the exporter's and converter's refusals.
    """
    import json

    from decode import kinds

    path = Path(draft).expanduser()
    if path.suffix.lower() == ".gguf":
        return path
    if not (path / "config.json").is_file():
        raise ValueError(f"--draft {draft!r}: --engine llamacpp takes a .gguf file or a saved draft folder")
    if target_hf is None and kind != kinds.PLAIN_LM:
        raise ValueError(
            f"--draft {draft!r} holds {kinds.traits(kind).description}, whose GGUF llama.cpp's converter writes from "
            "the target's HF folder: give --target as that folder, or --draft as a .gguf file"
        )
    out = cached_gguf(path, outtype, lc, f"{kind}|{folder_signature(target_hf) if target_hf else ''}")
    if out.is_file():
        return out
    if target_hf is not None:
        from decode.llamacpp.export import export_draft

        return Path(export_draft(path, target_hf, out, outtype, lc))
    vocab = json.loads((path / "config.json").read_text()).get("vocab_size")
    if target is not None and target.tokens and isinstance(vocab, int):
        check_vocab_count(f"--target {target.path.name} and --draft {path.name}", len(target.tokens), vocab)
    from decode.llamacpp.convert import convert

    return convert(path, out, outtype, lc)


def resolve_kind(draft: str) -> tuple[str, GgufInfo | None]:
    """The draft's kind and, for a GGUF draft, its header: a GGUF by its metadata (:func:`gguf_kind`), a folder
    by the registry (``decode.kinds.dispatch.read_as``)."""
    if Path(draft).suffix.lower() == ".gguf":
        info = read_gguf(draft, "--draft")
        return gguf_kind(info), info
    if not Path(draft).expanduser().is_dir():
        raise ValueError(f"--draft {draft!r}: no such file or folder; give a .gguf file or a saved draft folder")
    from decode.kinds.dispatch import read_as

    return read_as(draft), None
