"""Every shipped recipe loads and validates (torchtune's test_configs.py, litgpt's test_config_hub.py)."""

from pathlib import Path

import pytest
import yaml

from distill.config import PretrainRecipe, Recipe, is_multi_kind, load_recipe, read_recipe_data
from distill.search import load_plan

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
ALL = sorted(p for p in RECIPES.rglob("*.yaml") if "accelerate" not in p.parts)
ACCELERATE = sorted((RECIPES / "accelerate").glob("*.yaml"))


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(RECIPES)))
def test_recipe_loads(path):
    cls = PretrainRecipe if "pretrain" in path.parts else Recipe
    data = read_recipe_data(path)
    if cls is Recipe and is_multi_kind(data):  # several kinds: each candidate's recipe validates, none left out
        plan = load_plan(data)
        assert len(plan.kinds) >= 2 and not plan.skipped, plan.skipped
    else:
        assert isinstance(load_recipe(path, cls=cls), cls)
    text = path.read_text()
    # Each recipe opens with a comment saying what it is for and how to launch it.
    assert text.startswith("#"), f"{path.name} must open with a comment (purpose, hardware, command)"
    assert "train/" in text.split("\n\n")[0], f"{path.name}'s header comment must give the launch command"


def test_there_are_recipes():
    assert any(p.name == "quickstart.yaml" for p in ALL)


@pytest.mark.parametrize("path", ACCELERATE, ids=lambda p: p.name)
def test_accelerate_configs_parse(path):
    config = yaml.safe_load(path.read_text())
    assert config["distributed_type"] in {"NO", "MULTI_GPU", "MULTI_CPU", "FSDP", "DEEPSPEED"}
    assert "accelerate launch" in path.read_text()
