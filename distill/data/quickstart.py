"""The offline quickstart's local assets: the cached target/draft pair and python-stdlib prompt files.

Prompts are cut from the same files the pair trained on (training prompts) and from its held-out files (eval
prompts), in the prompt-file format of docs/data.md, so the quickstart needs nothing but this machine's Python.
"""

from __future__ import annotations

import random
from pathlib import Path

from decode.prompts import write_jsonl
from distill.config import CorpusConfig
from distill.data.corpus import Document, load_corpus
from distill.training.pretraining import ensure_quickstart_pair, quickstart_cache_dir

N_TRAIN, N_EVAL = 2000, 64


def prompt_windows(docs: list[Document], n: int, seed: int, prefix: str) -> list[dict]:
    """`n` prompts of 6-14 whole lines (at most ~500 characters) from random places in random documents."""
    rng = random.Random(seed)
    docs = [d for d in docs if d.text.count("\n") > 20]
    rows: list[dict] = []
    while len(rows) < n:
        doc = rng.choice(docs)
        lines = doc.text.splitlines(keepends=True)
        start = rng.randrange(0, len(lines) - 15)
        text = "".join(lines[start : start + rng.randint(6, 14)])[-500:]
        if text.strip():
            rows.append({"id": f"{prefix}-{len(rows)}", "source": f"{doc.name}:{start + 1}", "prompt": text})
    return rows


def ensure_stdlib_prompts(cache_dir: Path, rebuild: bool = False) -> tuple[Path, Path]:
    """(train prompts, eval prompts) JSONL files under `cache_dir/prompts`, written once and reused."""
    out = cache_dir / "prompts"
    train_path, eval_path = out / "stdlib-train.jsonl", out / "stdlib-eval.jsonl"
    if rebuild or not (train_path.is_file() and eval_path.is_file()):
        out.mkdir(parents=True, exist_ok=True)
        corpus = load_corpus(CorpusConfig(source="python-stdlib", holdout_fraction=0.1))
        write_jsonl(prompt_windows(corpus.train, N_TRAIN, seed=0, prefix="train"), train_path)
        write_jsonl(prompt_windows(corpus.heldout, N_EVAL, seed=1, prefix="eval"), eval_path)
    return train_path, eval_path


def ensure_quickstart_assets(rebuild: bool = False, progress: bool = True) -> dict[str, Path]:
    """Build (first use, or `rebuild`) or reuse the quickstart pair and prompt files; return their paths."""
    cache = quickstart_cache_dir()
    target, draft = ensure_quickstart_pair(rebuild=rebuild, cache_dir=cache, progress=progress)
    train_prompts, eval_prompts = ensure_stdlib_prompts(cache, rebuild=rebuild)
    return {"target": target, "draft": draft, "train_prompts": train_prompts, "eval_prompts": eval_prompts}
