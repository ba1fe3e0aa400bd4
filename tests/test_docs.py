"""The README stays short and true to what it describes: the recipe it quotes, the CI test command, its links."""

import re
from pathlib import Path

import pytest

from distill.config import Recipe, load_recipe

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_WORDS = 900  # a front page: the detail lives in docs/
TEST_COMMAND = "HF_HUB_OFFLINE=1 WANDB_MODE=offline python -m pytest -q -x --durations=15"


def test_readme_is_short():
    words = len(README.read_text().split())
    assert words <= MAX_README_WORDS, f"README.md has {words} words; move detail to docs/ (at most {MAX_README_WORDS})"


def test_readme_runs_the_ci_test_command_and_states_no_test_count():
    text = README.read_text()
    assert f"    {TEST_COMMAND}\n" in text
    ci = (ROOT / ".ci" / "run").read_text()  # CI exports the README's environment, then runs its pytest line
    env, pytest_line = TEST_COMMAND.split(" python ", 1)
    assert f"\nexport {env} " in ci and f"\npython {pytest_line}\n" in ci
    assert not re.search(r"\b\d+ tests\b", text), "a test count drifts with every change: leave it out"


def test_readme_quotes_the_quickstart_limits_it_runs():
    """The quickstart stops at max_steps or max_minutes, whichever first: the README names both as the recipe sets."""
    train = load_recipe(ROOT / "recipes" / "quickstart.yaml", cls=Recipe).train
    text = " ".join(README.read_text().split())
    assert f"`train.max_steps` ({train.max_steps})" in text
    assert f"`train.max_minutes` ({train.max_minutes:g})" in text


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_resolve(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        path = target.split("#", 1)[0]
        assert (page.parent / path).exists(), f"{page.name} links to {target}, which does not exist"
