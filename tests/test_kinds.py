"""The draft-kind seam on the training side (distill.kinds): every `draft.kind` the recipe accepts is a registered
module with the whole interface, train/distill.py names no kind, and a run goes through the registry's module
(a kind swapped in the registry is the one that builds, trains, evaluates and saves the draft)."""

from __future__ import annotations

import ast
import inspect
import re
import types
import typing
from pathlib import Path

import pytest

from distill import kinds
from distill.config import DraftConfig
from distill.kinds.interface import Kind
from tests.procs import load_script, tiny_recipe, tiny_run_paths

REPO = Path(__file__).resolve().parent.parent
# what the interface asks of a kind: its module attributes and functions (the Protocol's members)
MEMBERS = sorted(
    {n for n in vars(Kind) if not n.startswith("_")} | set(typing.get_type_hints(Kind)),
)


def recipe_kinds() -> tuple[str, ...]:
    """The choices of draft.kind in distill/config.py (its Literal)."""
    return typing.get_args(typing.get_type_hints(DraftConfig)["kind"])


def test_every_recipe_kind_is_a_registered_module_with_the_whole_interface():
    assert set(recipe_kinds()) == set(kinds.KINDS)
    for name in recipe_kinds():
        module = kinds.get(name)
        assert isinstance(module, types.ModuleType) and module.NAME == name
        assert isinstance(module, Kind)
        missing = [m for m in MEMBERS if not hasattr(module, m)]
        assert not missing, f"distill.kinds.{name} lacks {missing}"
        for member in MEMBERS:
            want = getattr(Kind, member, None)
            if callable(want):  # the same parameters as the interface (self aside)
                have = list(inspect.signature(getattr(module, member)).parameters)
                assert have == list(inspect.signature(want).parameters)[1:], f"{name}.{member}{have}"
    with pytest.raises(ValueError, match=r"draft.kind='medusa' is not a draft kind: use one of standalone, eagle3"):
        kinds.get("medusa")


def test_the_entry_script_names_no_kind():
    source = (REPO / "train" / "distill.py").read_text()
    names = [*recipe_kinds(), "head_kind", "eagle", "is_eagle3", "eagle3_train"]
    found = [n for n in names if re.search(re.escape(n), source, re.IGNORECASE)]
    assert not found, f"train/distill.py names {found}: put it in the kind's module (distill/kinds/)"
    # nor does it branch on the recipe's kind: it asks the registry
    tree = ast.parse(source)
    reads = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "kind"]
    assert reads == ["recipe.draft.kind", "recipe.draft.kind"], reads  # kinds.get(...) in run() and for the pair


def recording(kind: types.ModuleType, calls: list[str]) -> types.ModuleType:
    """A kind module that is `kind`, noting the name of each interface function train/distill.py calls."""
    module = types.ModuleType(f"recording_{kind.NAME}")
    for member in MEMBERS:
        value = getattr(kind, member)
        if callable(value):

            def noted(*args, _name=member, _fn=value, **kwargs):
                calls.append(_name)
                return _fn(*args, **kwargs)

            value = noted
        setattr(module, member, value)
    return module


@pytest.mark.slow
def test_a_run_goes_through_the_registered_module(tmp_path, monkeypatch, capsys):
    """train/distill.py's main() on a tiny pair, with the registry's standalone entry swapped for a recording copy
    of it: every step of the run is the registered module's."""
    calls: list[str] = []
    monkeypatch.setitem(kinds.KINDS, "standalone", recording(kinds.KINDS["standalone"], calls))
    paths = tiny_run_paths(tmp_path)
    recipe = tiny_recipe(paths, tmp_path / "run", {"source": "target"}, {"max_steps": 2, "batch_size": 2})
    import yaml

    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    load_script("train/distill.py", "distill_script_for_kinds").main(["--recipe", str(tmp_path / "recipe.yaml")])
    assert (tmp_path / "run" / "best" / "config.json").is_file()
    # preflight, models, data, the loop's one step function, two checkpoints (step 0 and step 2) evaluated and saved
    assert calls[:5] == ["check_inputs", "load_draft", "cache_teacher", "decoding_vocab", "loss_step"]
    assert calls.count("served") == 2 and calls.count("save_checkpoint") == 2
    assert "build_draft" not in calls  # a loaded draft is not built from the target
