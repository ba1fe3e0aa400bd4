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
        for field in ("block", "layer_output_context", "reads_hidden_states", "trains_anchors")
    }
    assert set(config.BLOCK_KINDS) == kinds_by["block"]
    assert set(config.LAYER_OUTPUT_KINDS) == kinds_by["layer_output_context"]
    assert set(config.ANCHOR_KINDS) == kinds_by["trains_anchors"] == {"pard", "dflash", "dspark"}
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


PUBLISHING = ("SERVED_FILES", "facts", "made", "assistant_line", "vocab_line", "usage")


def test_every_kind_publishes_and_checks_its_recipe_through_the_same_names():
    """Each kind's publishing module (its published folder's facts, its card's words and launch lines) and recipe
    module (what it refuses of a recipe) give the same names with the same parameters as the plain kind's."""
    plain_pub, plain_recipe = registry.publishing(registry.PLAIN_LM), registry.recipe(registry.PLAIN_LM)
    for name in registry.names():
        pub, rec = registry.publishing(name), registry.recipe(name)
        assert pub.__name__ == f"decode.kinds.{name}.publishing" and rec.__name__ == f"decode.kinds.{name}.recipe"
        missing = [m for m in PUBLISHING if not hasattr(pub, m)]
        assert not missing, f"decode.kinds.{name}.publishing lacks {missing}"
        for member in PUBLISHING[1:]:
            have, want = inspect.signature(getattr(pub, member)), inspect.signature(getattr(plain_pub, member))
            assert list(have.parameters) == list(want.parameters), f"{name}.{member}"
        assert list(inspect.signature(rec.problems).parameters) == list(
            inspect.signature(plain_recipe.problems).parameters
        )
        # a draft built from the target is published as saved, a draft LM through transformers
        assert bool(pub.SERVED_FILES) == (not registry.traits(name).loads_draft_model), name


# What the decoder, the bench and the vLLM engine ask of every kind's decoding module (decode.kinds.dispatch).
DECODER_MEMBERS = ("drafter", "cost_stream", "block_of", "check_draft_length", "is_model", "is_folder",
                   "folder_block", "check_folder", "vllm_problem")  # fmt: skip


def test_every_kinds_decoding_module_has_what_the_decoder_asks():
    from decode.kinds.dispatch import MODULES

    assert list(MODULES) == list(registry.names())
    for name, module in MODULES.items():
        t = registry.traits(name)
        want = (*DECODER_MEMBERS, *(() if t.loads_draft_model else ("load",)), *(("tree_drafter",) * t.draft_tree))
        missing = [m for m in want if not callable(getattr(module, m, None))]
        assert not missing, f"decode.kinds.{name}.decoding lacks {missing}"


def saved_folders(root: Path) -> dict[str | None, tuple[Path, int | None]]:
    """One folder of each kind as draftsmith saves it, without its recorded draftsmith.draft_kind (the layout alone
    must tell the kind), by the kind folder_kind must give (None: a plain causal LM), with its block."""
    import json

    from decode.kinds.dflash import decoding as dflash
    from decode.kinds.dspark import decoding as dspark
    from decode.kinds.eagle3 import decoding as eagle3
    from decode.kinds.pard import decoding as pard
    from decode.kinds.peagle import decoding as peagle
    from tests.test_eagle3 import tiny_target

    target = tiny_target("llama")
    head = eagle3.build(target, range(target.config.vocab_size))
    eagle3.save(head, root / "eagle3")
    eagle3.save(peagle.with_mask(head, block_size=3, mask_token_id=1), root / "peagle")
    dflash.save(dflash.build(target, None, num_layers=1, block_size=4, mask_token_id=1), root / "dflash")
    dspark.save(
        dspark.build(target, None, num_layers=1, block_size=5, mask_token_id=1, markov_rank=4), root / "dspark"
    )
    tiny_target("llama", layers=1).save_pretrained(root / "standalone")
    pard.mark(tiny_target("llama", layers=1), block_size=6, pard_token=1).save_pretrained(root / "pard")
    for name in ("eagle3", "peagle", "dflash", "dspark", "standalone", "pard"):
        config = json.loads((root / name / "config.json").read_text())
        config.pop("draftsmith", None)
        (root / name / "config.json").write_text(json.dumps(config))
    blocks = {"eagle3": None, "peagle": 3, "dflash": 4, "dspark": 5, "standalone": None, "pard": 6}
    return {(None if n == registry.PLAIN_LM else n): (root / n, b) for n, b in blocks.items()}


def test_a_saved_folder_is_claimed_by_its_own_kind_alone(tmp_path):
    """``decode.kinds.dispatch.folder_kind``, distill's (the same function) and the bench read a folder's kind from
    its layout: each kind's ``is_folder`` claims its own layout and no other kind's; a plain causal LM is no kind's."""
    from decode.kinds.dispatch import MODULES, folder_block, folder_kind, read_as

    assert kinds.folder_kind is folder_kind
    folders = saved_folders(tmp_path)
    assert set(folders) == {None, *(n for n in registry.names() if n != registry.PLAIN_LM)}
    for kind, (folder, block) in folders.items():
        assert [n for n, m in MODULES.items() if m.is_folder(folder)] == ([kind] if kind else []), folder
        assert folder_kind(folder) == kind and folder_block(folder) == block, folder
        assert read_as(folder) == (kind or registry.PLAIN_LM)
    assert folder_kind(tmp_path / "missing") is None and folder_kind("some/hub-id") is None
