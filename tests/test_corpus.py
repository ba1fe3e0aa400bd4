"""distill/data/corpus.py: sources, the deterministic held-out split, the byte-level BPE, packing."""

import hashlib
import json
import random

import pytest
import torch

from distill.config import CorpusConfig, RecipeError
from distill.data.corpus import (
    STDLIB_EXCLUDE,
    Document,
    PackedChunks,
    eval_windows,
    is_heldout,
    list_documents,
    load_corpus,
    pack,
    split_documents,
    stdlib_files,
    train_tokenizer,
)

PY_SNIPPET = 'def f(x):\n\t"""Tabs, trailing spaces   \n unicode: café, 東京, 🐍."""\n    return {"a": [1, 2e-3]}  \n'


def write_folder(root, n=30):
    """n small python-like files in nested folders, plus a hidden file and a binary file that must be skipped."""
    for i in range(n):
        path = root / f"pkg{i % 3}" / f"mod_{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# module {i}\n" + PY_SNIPPET * (i % 4 + 1))
    (root / ".hidden.py").write_text("secret = 1\n")
    (root / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    return root


def test_stdlib_files_exclude_tests_and_gui_packages():
    files = stdlib_files()
    names = [name for name, _ in files]
    assert len(files) > 300 and names == sorted(names)
    assert all(not set(name.split("/")[:-1]) & STDLIB_EXCLUDE for name in names)
    assert "json/encoder.py" in names and not any(n.startswith("tkinter/") for n in names)


def test_split_is_the_reference_hash_split():
    """fraction 0.1 holds out exactly the files with sha1(relative path) % 10 == 0 (the reference pair)."""
    for name, _ in stdlib_files()[:200]:
        assert is_heldout(name, 0.1) == (int(hashlib.sha1(name.encode()).hexdigest(), 16) % 10 == 0)
    assert is_heldout("copy.py", 0.1) and is_heldout("base64.py", 0.1)  # files of the reference dev prompts


def test_split_deterministic_disjoint_nonempty(tmp_path):
    kind, docs = list_documents(str(write_folder(tmp_path / "c")))
    assert kind == "folder" and len(docs) == 30  # hidden and binary files skipped
    assert all(not d.name.startswith(".") and d.name.endswith(".py") for d in docs)
    train, held = split_documents(docs, 0.2)
    shuffled = list(docs)
    random.Random(1).shuffle(shuffled)
    train2, held2 = split_documents(shuffled, 0.2)
    assert {d.name for d in held} == {d.name for d in held2}  # the split depends on names, not on order
    assert held and train and not {d.name for d in train} & {d.name for d in held}
    assert len(train) + len(held) == len(docs)
    # Same corpus elsewhere on disk: same split (names are relative to the corpus root).
    _, docs_b = list_documents(str(write_folder(tmp_path / "elsewhere" / "c")))
    assert [d.name for d in split_documents(docs_b, 0.2)[1]] == [d.name for d in held]


def test_split_never_leaves_heldout_empty():
    docs = [Document(f"doc{i}", "x") for i in range(3)]
    for frac in (0.01, 0.1, 0.49):
        train, held = split_documents(docs, frac)
        assert train and held
    with pytest.raises(RecipeError, match="at least 2"):
        split_documents(docs[:1], 0.1)


def test_glob_source_names_relative_to_pattern_root(tmp_path):
    write_folder(tmp_path / "c")
    (tmp_path / "c" / "notes.txt").write_text("not python\n")
    kind, docs = list_documents(str(tmp_path / "c" / "**" / "*.py"))
    assert kind == "glob" and len(docs) == 30 and docs[0].name.startswith("pkg0/")
    with pytest.raises(RecipeError, match="matches no files"):
        list_documents(str(tmp_path / "c" / "*.nothing"))


def test_jsonl_source(tmp_path):
    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"content": f"text {i}\n" * 3, "id": i}) for i in range(12)]
    path.write_text("\n".join(lines[:6]) + "\n\n" + "\n".join(lines[6:]) + "\n")  # a blank line is skipped
    corpus = load_corpus(CorpusConfig(source=str(path), text_field="content", holdout_fraction=0.2))
    assert corpus.kind == "jsonl" and len(corpus.train) + len(corpus.heldout) == 12
    assert corpus.heldout and corpus.train[0].text.startswith("text")
    with pytest.raises(RecipeError, match=r"corpus.text_field: line 1 .* has no 'text' field \(it has: content, id\)"):
        list_documents(str(path), text_field="text")
    # A glob of JSONL files: one document per line of each.
    (tmp_path / "more.jsonl").write_text(lines[0] + "\n")
    kind, docs = list_documents(str(tmp_path / "*.jsonl"), text_field="content")
    assert kind == "glob" and len(docs) == 13 and docs[0].name == "docs.jsonl:1"


def test_dataset_source(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": [f"row {i}\n" for i in range(20)]}).save_to_disk(str(tmp_path / "ds"))
    corpus = load_corpus(CorpusConfig(source=str(tmp_path / "ds"), holdout_fraction=0.1))
    assert corpus.kind == "dataset" and len(corpus.train) + len(corpus.heldout) == 20 and corpus.heldout
    with pytest.raises(RecipeError, match="no 'body' column"):
        list_documents(str(tmp_path / "ds"), text_field="body")


def test_bad_sources(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecipeError, match="no non-empty text documents"):
        list_documents(str(tmp_path / "empty"))
    with pytest.raises(RecipeError, match="does not exist"):
        list_documents(str(tmp_path / "missing"))
    (tmp_path / "one.txt").write_text("hello")
    with pytest.raises(RecipeError, match="single file"):
        list_documents(str(tmp_path / "one.txt"))


@pytest.fixture(scope="module")
def tokenizer():
    texts = [p.read_text(encoding="utf-8") for _, p in stdlib_files()[:40]]
    return train_tokenizer(texts, vocab_size=600)


def test_tokenizer_round_trip_and_specials(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    source = stdlib_files()[5][1].read_text(encoding="utf-8")
    tokenizer.save_pretrained(tmp_path / "tok")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    for tok in (tokenizer, reloaded):
        assert len(tok) == 600
        assert tok.eos_token == tok.bos_token == tok.pad_token == "<|endoftext|>"
        assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == 0
        for text in (source, PY_SNIPPET, " leading space\n\n\n  ", ""):
            ids = tok(text)["input_ids"]
            assert 0 not in ids  # nothing added on encode
            assert tok.decode(ids) == text
    assert reloaded(source)["input_ids"] == tokenizer(source)["input_ids"]


def test_tokenizer_training_is_deterministic(tokenizer):
    """Every process of a multi-process run trains its own copy; they must agree."""
    texts = [p.read_text(encoding="utf-8") for _, p in stdlib_files()[:40]]
    assert train_tokenizer(texts, vocab_size=600).get_vocab() == tokenizer.get_vocab()


def test_pack_and_windows(tokenizer):
    docs = [Document("a", "x = 1\n"), Document("b", "y = 2\n")]
    stream = pack(tokenizer, docs)
    ids_a = tokenizer("x = 1\n")["input_ids"]
    assert stream.dtype == torch.int32 and stream[0] == 0 and stream[1 : 1 + len(ids_a)].tolist() == ids_a
    assert (stream == 0).sum() == 2  # one EOS before each document
    long = torch.arange(1000, dtype=torch.int32)
    chunks = PackedChunks(long, 64)
    assert len(chunks) == 15 and chunks[1].tolist() == list(range(64, 128)) and chunks[0].dtype == torch.long
    w = eval_windows(long, 64, 5)
    assert w.shape == (5, 64) and w[0, 0] == 0 and w[-1, 0] == 14 * 64  # spread over the whole stream
    assert eval_windows(long, 64, 100).shape == (15, 64)
    assert eval_windows(long[:10], 64, 4).shape == (1, 10)
