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


def in_ci() -> bool:
    """True where the environment says this is a CI run (CI=true, as CI services set it; .ci/run sets it too)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


@pytest.hookimpl(trylast=True)  # after -k / -m deselect: what is left is what runs
def pytest_collection_modifyitems(config, items):
    """Tests marked `shared` skip cleanly where the shared fixtures (reference pair, prompt sets) are absent; in
    CI, where they must be present, selecting such a test without them stops the run instead (a skip there would
    let CI pass without running what it claims to)."""
    if (PAIR / "target").is_dir() and DEV_PROMPTS.is_file():
        return
    shared = [item for item in items if "shared" in item.keywords]
    if shared and in_ci():
        raise pytest.UsageError(
            f"CI=true but {SHARED} (reference pair and prompt sets) is missing, so {len(shared)} selected tests "
            f"marked `shared` would skip (first: {shared[0].nodeid}): put the shared fixtures at {SHARED}, "
            "or unset CI to let them skip"
        )
    skip = pytest.mark.skip(reason="../shared (reference pair and prompt sets) not present")
    for item in shared:
        item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """Tiny models: thread hand-offs cost more than they save, and on a shared machine two threads each can be
    100x slower than one. Session-wide, so that module fixtures that build and run models are covered too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
