"""Recipe system: YAML in, dotted overrides, type coercion, unknown keys rejected with a suggestion."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from distill.config import PretrainRecipe, Recipe, RecipeError, dump_recipe, load_recipe, save_recipe

REPO = Path(__file__).resolve().parent.parent


def write(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


def test_defaults_load():
    recipe = load_recipe(None)
    assert isinstance(recipe, Recipe)
    assert recipe.distill.loss == "fkl"
    assert recipe.eval.num_draft_tokens == 4


def test_yaml_and_overrides_coerce_types(tmp_path):
    path = write(tmp_path, "train:\n  lr: 2.0e-4\n  max_steps: 10\ndistill:\n  loss: jsd\n")
    recipe = load_recipe(
        path,
        [
            "train.lr=1e-3",
            "train.max_steps=20",
            "eval.num_draft_tokens=auto",
            "eval.temperature=0.8",
            "target.quantization.load_in_4bit=true",
            "draft.lora.target_modules=[q_proj,v_proj]",
            "log.run_name=null",
        ],
    )
    assert recipe.train.lr == 1e-3 and isinstance(recipe.train.lr, float)
    assert recipe.train.max_steps == 20 and isinstance(recipe.train.max_steps, int)
    assert recipe.distill.loss == "jsd"
    assert recipe.eval.num_draft_tokens == "auto"
    assert recipe.eval.temperature == 0.8
    assert recipe.target.quantization.load_in_4bit is True
    assert recipe.draft.lora.target_modules == ["q_proj", "v_proj"]
    assert recipe.log.run_name is None


def test_an_empty_value_is_the_empty_string(tmp_path):
    """docs/data.md: with data.eval_prompts empty, eval_split of the training rows is held out. `key=` on the
    command line and `key:` in YAML are both that empty value."""
    from distill.data.prompts import load_train_eval

    base = load_recipe(write(tmp_path, "data:\n  eval_prompts: held.jsonl\n"))
    assert base.data.eval_prompts == "held.jsonl"
    assert (
        load_recipe(write(tmp_path, "data:\n  eval_prompts: held.jsonl\n"), ["data.eval_prompts="]).data.eval_prompts
        == ""
    )
    assert load_recipe(write(tmp_path, "data:\n  eval_prompts:\n")).data.eval_prompts == ""
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(f'{{"prompt": "row {i}"}}\n' for i in range(40)))
    cfg = load_recipe(None, [f"data.train_prompts={rows}", "data.eval_prompts=", "data.eval_split=0.1"]).data
    train, held = load_train_eval(cfg)
    assert (len(train), len(held)) == (36, 4)


def test_int_field_accepts_whole_float_and_rejects_fraction():
    assert load_recipe(None, ["train.max_steps=5.0"]).train.max_steps == 5
    with pytest.raises(RecipeError, match="train.max_steps: expected an integer"):
        load_recipe(None, ["train.max_steps=5.5"])


def test_unknown_key_names_valid_keys_and_closest_match(tmp_path):
    with pytest.raises(RecipeError) as err:
        load_recipe(write(tmp_path, "train:\n  lrr: 1.0e-4\n"))
    message = str(err.value)
    assert "unknown key 'train.lrr'" in message
    assert "Did you mean 'lr'?" in message
    assert "max_steps" in message  # the valid names are listed
    assert "\n" not in message


def test_unknown_section(tmp_path):
    with pytest.raises(RecipeError, match="unknown key 'evaluation'.*Did you mean 'eval'"):
        load_recipe(write(tmp_path, "evaluation:\n  every: 3\n"))


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("train.lr=fast", "train.lr: expected a number"),
        ("distill.loss=jds", "did you mean 'jsd'"),
        ("distill.beta=1.5", r"distill.beta: must be in \[0, 1\]"),
        ("eval.num_draft_tokens=0", r"positive int, 'auto' or tree:TOPK,DEPTH,NODES"),
        ("eval.num_draft_tokens=tree:4,5", "e.g. tree:4,5,16"),
        ("eval.num_draft_tokens=tree:4,5,16", "an EAGLE-3 head's draft tree; a standalone draft drafts a chain"),
        ("distill.num_draft_tokens=-1", r"int >= 0 \(0: the target alone\) or 'auto'"),
        ("train.batch_size=0", "train.batch_size: must be > 0"),
        ("distill.pregenerate_batch_size=0", "distill.pregenerate_batch_size: must be > 0"),
        ("target.quantization.load_in_4bit=maybe", "expected true or false"),
        ("train.lr", "not key=value"),
    ],
)
def test_bad_values_give_one_line_errors(override, pattern):
    with pytest.raises(RecipeError, match=pattern) as err:
        load_recipe(None, [override])
    assert "\n" not in str(err.value)


def test_an_eagle3_recipe_may_evaluate_with_a_draft_tree():
    recipe = load_recipe(None, ["draft.kind=eagle3", "eval.num_draft_tokens=tree:3, 4, 8", "eval.hf_assisted=false"])
    assert recipe.eval.num_draft_tokens == "tree:3,4,8"
    for extra, message in [
        ("eval.temperature=0.8", "decodes greedily, one prompt at a time"),
        ("eval.batch_size=4", "decodes greedily, one prompt at a time"),
        ("eval.extra_engines=[vllm]", "vLLM and llama.cpp measure chains"),
    ]:
        with pytest.raises(RecipeError, match=message):
            load_recipe(None, ["draft.kind=eagle3", "eval.num_draft_tokens=tree:3,4,8", extra])


def test_both_quantizations_rejected():
    with pytest.raises(RecipeError, match="load_in_4bit or load_in_8bit"):
        load_recipe(None, ["target.quantization.load_in_4bit=true", "target.quantization.load_in_8bit=true"])


def test_missing_and_invalid_yaml(tmp_path):
    with pytest.raises(RecipeError, match="not found"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(RecipeError, match="not valid YAML at line"):
        load_recipe(write(tmp_path, "train:\n  lr: [1, 2\n"))
    with pytest.raises(RecipeError, match="expected a mapping"):
        load_recipe(write(tmp_path, "train: 3\n"))


def test_resolved_recipe_round_trips(tmp_path):
    recipe = load_recipe(None, ["train.lr=3e-4", "eval.num_draft_tokens=auto", "distill.source=mix"])
    out = save_recipe(recipe, tmp_path / "run")
    assert out.name == "resolved_recipe.yaml"
    assert load_recipe(out) == recipe
    assert yaml.safe_load(dump_recipe(recipe))["train"]["lr"] == 3e-4


def test_print_config_shows_each_keys_help_and_reads_back_as_the_same_recipe(tmp_path):
    """train/distill.py --print-config (a real run of the script): the resolved recipe with each key's help as a
    comment on the line above it, YAML that load_recipe reads back to the same recipe."""
    from distill.config import DistillConfig, TrainConfig

    overrides = ["train.lr=3e-4", "eval.num_draft_tokens=auto", "target.lora.target_modules=[q_proj, 'v: proj']"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "train" / "distill.py"), "--print-config", *overrides],
        cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    printed = tmp_path / "printed.yaml"
    printed.write_text(proc.stdout)
    assert load_recipe(printed) == load_recipe(REPO / "recipes" / "quickstart.yaml", overrides)  # the default recipe
    lines = proc.stdout.splitlines()
    for cls, key in ((TrainConfig, "lr"), (DistillConfig, "anchors")):
        text = " ".join(cls.__dataclass_fields__[key].metadata["help"].split())
        at = next(i for i, line in enumerate(lines) if line.startswith(f"  {key}:"))
        assert lines[at - 1] == f"  # {text}", lines[at - 1]
    assert lines[lines.index("train:") - 1].startswith("# Optimisation")  # a section's own docstring
    keys = [i for i, line in enumerate(lines) if line.lstrip()[:1].isalpha()]  # "name: value" and "section:"
    assert [lines[i] for i in keys if not lines[i - 1].lstrip().startswith("# ")] == []  # each with its help


def test_pretrain_schema_is_separate():
    recipe = load_recipe(None, ["model.hidden_size=128", "corpus.source=python-stdlib"], cls=PretrainRecipe)
    assert recipe.model.hidden_size == 128
    with pytest.raises(RecipeError, match="unknown key 'distill'"):
        load_recipe(None, ["distill.loss=fkl"], cls=PretrainRecipe)


def test_bare_no_is_the_string_no_where_a_choice_expects_it(tmp_path):
    # YAML 1.1 reads `no` as false; train.mixed_precision's choices include the string "no".
    assert load_recipe(write(tmp_path, "train:\n  mixed_precision: no\n")).train.mixed_precision == "no"
    assert load_recipe(None, ["train.mixed_precision=no"]).train.mixed_precision == "no"
    with pytest.raises(RecipeError, match="distill.loss"):
        load_recipe(None, ["distill.loss=false"])  # a bool is still no valid choice elsewhere


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["eval.every_minutes=-1"], r"^eval.every_minutes: must be >= 0 \(0: off\), got -1"),
        (["eval.every_minutes=10", "train.max_minutes=5"], r"^eval.every_minutes: 10 is more than train.max_minutes="),
    ],
)
def test_evaluation_minutes_must_fit_the_budget(overrides, pattern):
    with pytest.raises(RecipeError, match=pattern) as err:
        load_recipe(None, overrides)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["eval.every_minutes=5", "train.max_minutes=5"],  # the budget itself
        ["eval.every_minutes=30", "train.max_minutes=0"],  # no time budget: any interval
        ["eval.every_minutes=0", "train.max_minutes=5"],  # off
    ],
)
def test_evaluation_minutes_within_the_budget_or_off_load(overrides):
    load_recipe(None, overrides)


def test_evaluation_minutes_beyond_the_budget_are_one_error_line_and_nothing_written(tmp_path):
    out = tmp_path / "run"
    # models that do not exist: were the recipe accepted, the run would stop at them with another error line
    models = [f"target.model={tmp_path / 'no-target'}", f"draft.model={tmp_path / 'no-draft'}", "build_pair=null"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "train" / "distill.py"), f"output_dir={out}", *models, "eval.every_minutes=10",
         "train.max_minutes=5"],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "error: eval.every_minutes: 10 is more than train.max_minutes=5, so no evaluation by minutes would run: set "
        "eval.every_minutes to at most train.max_minutes (0: off), or raise train.max_minutes"
    ]
    assert not out.exists()


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["draft.num_layers=0"], r"draft.num_layers: must be in 1..8"),
        (["draft.kind=dflash", "draft.aux_layers=[2, 1]"], "a DFlash draft reads 1 or more target layer outputs"),
        (["draft.kind=dflash", "draft.block_size=3", "eval.num_draft_tokens=4"], "the DFlash draft is trained for"),
    ],
)
def test_bad_dflash_values_give_one_line_errors(overrides, pattern):
    with pytest.raises(RecipeError, match=pattern) as err:
        load_recipe(None, overrides)
    assert "\n" not in str(err.value)


def test_a_dflash_recipe_takes_any_rising_layer_outputs():
    recipe = load_recipe(None, ["draft.kind=dflash", "draft.aux_layers=[0, 3, 5, 6]", "draft.num_layers=2"])
    assert recipe.draft.aux_layers == [0, 3, 5, 6] and recipe.draft.num_layers == 2
