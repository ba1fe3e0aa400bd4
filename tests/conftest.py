"""Shared test setup: offline, W&B offline, and where the shared fixtures (reference pair, prompt sets) live."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
PAIR = SHARED / "fixtures" / "stdlib-pair"
DEV_PROMPTS = SHARED / "data" / "stdlib-dev-prompts.jsonl"
TRAIN_PROMPTS = SHARED / "data" / "stdlib-train-prompts.jsonl"


def pytest_collection_modifyitems(config, items):
    """Tests marked `shared` skip cleanly where the shared fixtures (reference pair, prompt sets) are absent."""
    if (PAIR / "target").is_dir() and DEV_PROMPTS.is_file():
        return
    skip = pytest.mark.skip(reason="../shared (reference pair and prompt sets) not present")
    for item in items:
        if "shared" in item.keywords:
            item.add_marker(skip)
