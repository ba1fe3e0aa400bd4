"""Shared test setup: offline, W&B offline, one torch thread, and where the shared fixtures (reference pair, prompt
sets) live. The tiny tokenizers and models are built by tests/tiny.py."""

import os
from pathlib import Path

import pytest
import torch

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


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """Tiny models: thread hand-offs cost more than they save, and on a shared machine two threads each can be
    100x slower than one. Session-wide, so that module fixtures that build and run models are covered too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
