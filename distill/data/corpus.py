"""Local text corpora for pretraining: discovery, a deterministic held-out split, a byte-level BPE, packing.

A corpus is a list of documents, each with a stable *name* (the path relative to the corpus root, or
``file.jsonl:LINE`` / ``row N``) that decides the split: a document is held out when the SHA-1 of its name
falls in the held-out bucket (``sha1(name) % 10 == 0`` for a fraction of 0.1, as for the stdlib reference pair
of recipes/pretrain/stdlib-*.yaml). The split depends only on the names, never on the machine or the order
files are listed in.

Sources (``corpus.source``):

    python-stdlib        CPython's standard library source (``sysconfig``), on every machine: the offline default
    DIR                  every text file under DIR (hidden files and binary files skipped)
    'data/**/*.txt'      a glob (quote it in the shell); matched .jsonl files contribute one document per line
    FILE.jsonl           one document per line, the text in ``corpus.text_field``
    DATASET              a ``datasets`` dataset: a ``save_to_disk`` dir, a dir of parquet/arrow files, or a hub id
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import torch

from distill.config import CorpusConfig, RecipeError

STDLIB = "python-stdlib"
# The same exclusions as the reference pair: test suites and GUI / legacy packages.
STDLIB_EXCLUDE = frozenset({"test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "site-packages"})
EOS_TOKEN = "<|endoftext|>"
_GLOB_CHARS = ("*", "?", "[")


@dataclass(frozen=True)
class Document:
    """One unit of the split: `name` is what the held-out hash sees, `text` the content."""

    name: str
    text: str


@dataclass
class Corpus:
    """A corpus split into training and held-out documents (both in sorted-name order)."""

    source: str
    kind: str  # python-stdlib | folder | glob | jsonl | dataset
    train: list[Document] = field(default_factory=list)
    heldout: list[Document] = field(default_factory=list)

    def describe(self) -> str:
        chars = sum(len(d.text) for d in self.train)
        return (
            f"corpus {self.source} ({self.kind}): {len(self.train)} training documents ({chars / 1e6:.1f}M chars), "
            f"{len(self.heldout)} held out"
        )


# ---------------------------------------------------------------- discovery


def stdlib_root() -> Path:
    """The folder holding CPython's standard-library source on this machine."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """(relative posix path, path) of every stdlib ``*.py`` outside STDLIB_EXCLUDE, sorted by relative path."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if not set(rel.parts[:-1]) & STDLIB_EXCLUDE and path.is_file():
            out.append((rel.as_posix(), path))
    return sorted(out)


def _read_text(path: Path) -> str | None:
    """The file as text, or None when it is binary (NUL bytes). Undecodable bytes become U+FFFD."""
    data = path.read_bytes()
    if b"\x00" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("utf-8", errors="replace")


def _jsonl_documents(path: Path, name: str, text_field: str) -> list[Document]:
    docs = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise RecipeError(f"corpus.source: line {lineno} of {path} is not JSON; fix the file") from None
            if not isinstance(record, dict) or text_field not in record:
                keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                raise RecipeError(
                    f"corpus.text_field: line {lineno} of {path} has no {text_field!r} field (it has: {keys}); "
                    f"set corpus.text_field to the field holding the text"
                )
            text = record[text_field]
            if isinstance(text, str) and text.strip():
                docs.append(Document(f"{name}:{lineno}", text))
    return docs


def _file_documents(files: Iterable[tuple[str, Path]], text_field: str) -> list[Document]:
    docs = []
    for name, path in files:
        if path.suffix == ".jsonl":
            docs.extend(_jsonl_documents(path, name, text_field))
            continue
        text = _read_text(path)
        if text is not None and text.strip():
            docs.append(Document(name, text))
    return docs


def _folder_files(root: Path) -> list[tuple[str, Path]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # .git, .cache, ...
        for fn in filenames:
            if not fn.startswith("."):
                path = Path(dirpath) / fn
                out.append((path.relative_to(root).as_posix(), path))
    return sorted(out)


def _glob_files(pattern: str) -> list[tuple[str, Path]]:
    # Names are relative to the pattern's fixed prefix, so the split does not depend on where the corpus lives.
    parts = Path(pattern).parts
    fixed = next((i for i, p in enumerate(parts) if any(c in p for c in _GLOB_CHARS)), len(parts))
    base = Path(*parts[:fixed]) if fixed else Path(".")
    matches = (Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True))
    base = Path(os.path.expanduser(str(base)))
    return sorted((p.relative_to(base).as_posix(), p) for p in matches if p.is_file())


def _is_dataset_dir(path: Path) -> bool:
    if any((path / n).is_file() for n in ("dataset_dict.json", "state.json", "dataset_info.json")):
        return True
    return any(path.glob("*.parquet")) or any(path.glob("*.arrow")) or any(path.glob("data/*.parquet"))


def _dataset_documents(source: str, text_field: str, local: bool) -> list[Document]:
    import datasets

    try:
        if local and any((Path(source) / n).is_file() for n in ("dataset_dict.json", "state.json")):
            ds = datasets.load_from_disk(source)
        else:
            ds = datasets.load_dataset(source)
    except Exception as e:  # datasets raises many types; the user needs one line
        where = "local dataset" if local else "dataset from the Hub"
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RecipeError(f"corpus.source: could not load {where} {source!r} ({msg}); check the path or id") from None
    if isinstance(ds, datasets.DatasetDict):
        split = "train" if "train" in ds else sorted(ds)[0]
        ds = ds[split]
    if text_field not in ds.column_names:
        raise RecipeError(
            f"corpus.text_field: dataset {source!r} has no {text_field!r} column (it has: "
            f"{', '.join(ds.column_names)}); set corpus.text_field"
        )
    return [Document(f"row {i}", t) for i, t in enumerate(ds[text_field]) if isinstance(t, str) and t.strip()]


def list_documents(source: str, text_field: str = "text", max_files: int = 0) -> tuple[str, list[Document]]:
    """(kind, documents sorted by name) for a corpus source; raises RecipeError when there is nothing to read."""
    hint = "point corpus.source at python-stdlib, a folder of text files, a glob, a JSONL file or a dataset"
    expanded = os.path.expanduser(source)
    path = Path(expanded)
    if source == STDLIB:
        kind, docs = STDLIB, _file_documents(stdlib_files(), text_field)
    elif any(c in source for c in _GLOB_CHARS) and not path.exists():
        kind, files = "glob", _glob_files(source)
        if not files:
            raise RecipeError(f"corpus.source: the glob {source!r} matches no files; {hint}")
        docs = _file_documents(files, text_field)
    elif path.is_dir():
        if _is_dataset_dir(path):
            kind, docs = "dataset", _dataset_documents(expanded, text_field, local=True)
        else:
            kind, docs = "folder", _file_documents(_folder_files(path), text_field)
    elif path.is_file():
        if path.suffix != ".jsonl":
            raise RecipeError(
                f"corpus.source: {source!r} is a single file and the held-out split is by file; "
                "give a folder or glob of several files, or a JSONL file (one document per line)"
            )
        kind, docs = "jsonl", _jsonl_documents(path, path.name, text_field)
    elif "/" in source.strip("/") and not source.startswith((".", "/", "~")) and source.count("/") == 1:
        if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
            raise RecipeError(
                f"corpus.source: {source!r} is not a local path and the Hub is offline (HF_HUB_OFFLINE); "
                f"give a local path or python-stdlib"
            )
        kind, docs = "dataset", _dataset_documents(source, text_field, local=False)
    else:
        raise RecipeError(f"corpus.source: {source!r} does not exist; {hint}")
    if not docs:
        raise RecipeError(f"corpus.source: {source!r} has no non-empty text documents; {hint}")
    docs.sort(key=lambda d: d.name)
    if max_files:
        docs = docs[:max_files]
    return kind, docs


# ---------------------------------------------------------------- split


def _bucket(name: str) -> int:
    return int(hashlib.sha1(name.encode("utf-8")).hexdigest(), 16)


def is_heldout(name: str, fraction: float) -> bool:
    """True when document `name` is held out. For fraction p/q (q a power of ten): sha1(name) % q < p,
    so 0.1 gives exactly ``sha1(name) % 10 == 0`` (the reference pair's split)."""
    frac = Fraction(str(fraction)).limit_denominator(10**6)
    denom = 10
    while (frac * denom).denominator != 1 and denom < 10**6:
        denom *= 10
    return _bucket(name) % denom < round(float(frac * denom))


def split_documents(docs: Sequence[Document], fraction: float) -> tuple[list[Document], list[Document]]:
    """(train, held-out), disjoint, each in input order. Held-out is never empty when there are >= 2 documents:
    if the hash holds out nothing, the document with the smallest hash is held out."""
    if len(docs) < 2:
        raise RecipeError(
            f"corpus.source: {len(docs)} document(s); the held-out split is by document, so it needs at least 2"
        )
    held = [is_heldout(d.name, fraction) for d in docs]
    if not any(held):
        held[min(range(len(docs)), key=lambda i: _bucket(docs[i].name))] = True
    if all(held):
        held[max(range(len(docs)), key=lambda i: _bucket(docs[i].name))] = False
    train = [d for d, h in zip(docs, held) if not h]
    heldout = [d for d, h in zip(docs, held) if h]
    return train, heldout


def load_corpus(cfg: CorpusConfig) -> Corpus:
    """Discover, read and split the corpus a recipe names."""
    kind, docs = list_documents(cfg.source, cfg.text_field, cfg.max_files)
    train, heldout = split_documents(docs, cfg.holdout_fraction)
    return Corpus(cfg.source, kind, train, heldout)


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE trained on `texts`, as a transformers fast tokenizer.

    One special token, ``<|endoftext|>`` = id 0, serves as BOS, EOS and PAD; nothing is added on encode, so
    ``decode(encode(text)) == text`` for any text. Deterministic for the same texts and vocab_size.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
    )


def load_tokenizer(path: str):
    """An existing tokenizer (dir or hub id) with an EOS token; PAD defaults to EOS."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(os.path.expanduser(path))
    except (OSError, ValueError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RecipeError(f"tokenizer.path: cannot load a tokenizer from {path!r} ({msg})") from None
    if tok.eos_token_id is None:
        raise RecipeError(f"tokenizer.path: {path!r} has no eos_token, needed between packed documents")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


# ---------------------------------------------------------------- packing


def pack(tokenizer, docs: Sequence[Document]) -> torch.Tensor:
    """All documents as one token stream, EOS before each: ``[EOS] doc0 [EOS] doc1 ...``  # [n_tokens] int32"""
    eos = tokenizer.eos_token_id
    ids = tokenizer([d.text for d in docs], add_special_tokens=False, verbose=False)["input_ids"]
    stream: list[int] = []
    for seq in ids:
        stream.append(eos)
        stream.extend(seq)
    return torch.tensor(stream, dtype=torch.int32)


class PackedChunks(torch.utils.data.Dataset):
    """Non-overlapping windows of `seq_len` tokens cut from a packed stream (the tail is dropped)."""

    def __init__(self, stream: torch.Tensor, seq_len: int):
        self.stream, self.seq_len = stream, seq_len
        self.n = len(stream) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.stream[i * self.seq_len : (i + 1) * self.seq_len].long()  # [seq_len]


def eval_windows(stream: torch.Tensor, seq_len: int, n: int) -> torch.Tensor:
    """`n` windows of `seq_len` tokens spread evenly over a held-out stream (fewer if it is short).  # [n, seq_len]

    A stream shorter than one window gives a single shorter window."""
    total = len(stream) // seq_len
    if total == 0:
        return stream[None, :].long()
    n = min(n, total)
    starts = torch.linspace(0, total - 1, n).round().long().unique() * seq_len
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()]).long()
