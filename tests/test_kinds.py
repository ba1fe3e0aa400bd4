"""The draft-kind seam: every kind is one folder in decode/kinds/ whose torch-free traits the registry lists, every
`draft.kind` the recipe accepts is a registered kind whose training module has the whole interface, train/distill.py
names no kind, and a run goes through the registry's module (a kind swapped in the registry is the one that builds,
trains, evaluates and saves the draft)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

from decode import kinds as registry
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
        assert isinstance(module, types.ModuleType) and module.TRAITS.name == name
        assert isinstance(module, Kind)
        missing = [m for m in MEMBERS if not hasattr(module, m)]
        assert not missing, f"decode.kinds.{name}.training lacks {missing}"
        for member in MEMBERS:
            want = getattr(Kind, member, None)
            if callable(want):  # the same parameters as the interface (self aside)
                have = list(inspect.signature(getattr(module, member)).parameters)
                assert have == list(inspect.signature(want).parameters)[1:], f"{name}.{member}{have}"
    with pytest.raises(ValueError, match=r"draft.kind='medusa' is not a draft kind: use one of standalone, eagle3"):
        kinds.get("medusa")


# What importing the registry and reading every kind's traits loads: the recipe does both, and --print-config and
# every one-line refusal of a recipe come before torch is imported.
READ_TRAITS = """
import sys
import decode.kinds as registry
print("traits", ",".join(f"{n}:{registry.traits(n).title}" for n in registry.names()))
print("heavy", sorted(m for m in ("torch", "transformers", "accelerate") if m in sys.modules))
"""


def test_the_registry_and_every_kinds_traits_import_without_torch():
    proc = subprocess.run([sys.executable, "-c", READ_TRAITS], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "traits " + ",".join(f"{n}:{t.title}" for n, t in registry.KINDS.items())
    assert lines[-1] == "heavy []", lines[-1]


def test_each_kind_is_one_folder_that_declares_its_traits_once():
    """A kind's folder holds its traits, decoding and training modules; KindTraits is built nowhere else."""
    assert registry.names() == tuple(registry.KINDS) == recipe_kinds()
    for name, traits in registry.KINDS.items():
        folder = REPO / "decode" / "kinds" / name
        assert {"__init__.py", "decoding.py", "training.py"} <= {p.name for p in folder.iterdir()}, name
        assert traits.name == name and traits is importlib.import_module(f"decode.kinds.{name}").TRAITS
        assert registry.decoding(name).__name__ == f"decode.kinds.{name}.decoding"
        assert registry.training(name) is kinds.get(name) and kinds.get(name).TRAITS is traits
    built = sorted(
        str(path.relative_to(REPO))
        for package in ("decode", "distill", "train")
        for path in (REPO / package).rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and "KindTraits" in (getattr(node.func, "id", None), getattr(node.func, "attr", None))
    )
    assert built == sorted(f"decode/kinds/{name}/__init__.py" for name in registry.KINDS)
    with pytest.raises(ValueError, match=r"draft.kind='medusa' is not a draft kind: use one of standalone, eagle3"):
        registry.traits("medusa")


def test_the_recipe_reads_the_kinds_traits():
    """draft.kind's choices, the block kinds, DFlash's backbone kinds, the keys of one kind only and the heads over
    the target's states are what the registry's traits say."""
    from distill import config

    kinds_by = {
        field: {n for n, t in registry.KINDS.items() if getattr(t, field)}
        for field in ("block", "dflash_backbone", "reads_hidden_states")
    }
    assert set(config.BLOCK_KINDS) == kinds_by["block"]
    assert set(config.DFLASH_KINDS) == kinds_by["dflash_backbone"]
    assert {n for n in registry.KINDS if config.is_head(n)} == kinds_by["reads_hidden_states"]
    assert config.KIND_KEYS == {"markov_rank": "dspark", "confidence_min": "dspark"}


def test_the_entry_script_names_no_kind():
    source = (REPO / "train" / "distill.py").read_text()
    names = [*recipe_kinds(), "head_kind", "eagle", "is_eagle3", "eagle3_train"]
    found = [n for n in names if re.search(re.escape(n), source, re.IGNORECASE)]
    assert not found, f"train/distill.py names {found}: put it in the kind's folder (decode/kinds/<kind>/)"
    # nor does it branch on the recipe's kind: it asks the registry
    tree = ast.parse(source)
    reads = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "kind"]
    assert reads == ["recipe.draft.kind", "recipe.draft.kind"], reads  # kinds.get(...) in run() and for the pair


def recording(kind: types.ModuleType, calls: list[str]) -> types.ModuleType:
    """A kind module that is `kind`, noting the name of each interface function train/distill.py calls."""
    module = types.ModuleType(f"recording_{kind.TRAITS.name}")
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
