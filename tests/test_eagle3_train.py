"""Training an EAGLE-3 head (draft.kind: eagle3): the loss over the draft vocabulary and its tail bucket, the
unrolled step on a tiny real target, the recipe's checks, and `train/distill.py` end to end (served-format
checkpoints, best/, 2 processes, kill -9 and --resume, bad inputs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from decode.kinds import eagle3
from distill import data, eagle3_train, losses
from distill.config import DistillConfig, RecipeError, load_recipe
from tests.test_distill_e2e import (
    error_line,
    kill_at_checkpoint,
    launch,
    run_script,
    write_recipe,
)
from tests.tiny import make_pair, make_prompts, tiny_config, tiny_llama

# ---------------------------------------------------------------- the loss


@pytest.mark.parametrize("loss", losses.LOSSES)
def test_loss_is_the_conditioned_divergence_scaled_by_the_in_vocabulary_mass(loss):
    g = torch.Generator().manual_seed(0)
    teacher, student = torch.randn(5, 40, generator=g) * 3, torch.randn(5, 12, generator=g)
    ids = torch.tensor([0, 3, 4, 9, 11, 17, 20, 21, 30, 33, 38, 39])
    log_ps, log_pt = eagle3_train.step_log_probs(student, teacher, ids)
    p = teacher.softmax(-1)
    in_mass = p[:, ids].sum(-1)
    conditioned = (p[:, ids] / in_mass[:, None]).log()
    expected = in_mass * losses.divergence(student.log_softmax(-1), conditioned, loss, 0.3)
    assert torch.allclose(losses.divergence(log_ps, log_pt, loss, 0.3), expected, atol=1e-5)
    assert torch.allclose(log_pt.exp().sum(-1), torch.ones(5), atol=1e-5)  # the tail bucket holds the rest
    # its optimum is the target conditioned on the draft vocabulary: loss 0 and no gradient there
    best = conditioned.clone().requires_grad_(True)
    value = losses.divergence(*eagle3_train.step_log_probs(best, teacher, ids), loss, 0.3).mean()
    value.backward()
    assert float(value.detach()) < 1e-5
    if loss != "tvd":  # |x| has no gradient at its minimum
        assert best.grad.abs().max() < 1e-5


def test_a_draft_vocabulary_of_every_token_gives_the_plain_divergence():
    g = torch.Generator().manual_seed(1)
    teacher, student = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g, requires_grad=True)
    log_ps, log_pt = eagle3_train.step_log_probs(student, teacher, torch.arange(16))
    value = losses.divergence(log_ps, log_pt, "fkl")
    assert torch.allclose(value, losses.divergence(student.log_softmax(-1), teacher.log_softmax(-1), "fkl"))
    value.sum().backward()
    assert torch.isfinite(student.grad).all()


def test_default_unroll_and_weights_are_the_kinds():
    cfg = DistillConfig()
    assert (cfg.ttt_steps, cfg.step_weight) == (eagle3.TTT_STEPS, eagle3.STEP_WEIGHT)


# ---------------------------------------------------------------- the step on a real tiny target


def test_step_loss_decreases_and_reports_every_unrolled_step():
    target = tiny_llama(97, 0, layers=4, initializer_range=0.2).requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    pairs = [(torch.randint(1, 97, (5,), generator=g).tolist(), torch.randint(1, 97, (20,), generator=g).tolist())]
    batch = data.collate_training(pairs * 4, 0)
    torch.manual_seed(0)
    model = eagle3_train.Unrolled(eagle3.build(target, list(range(64))))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    seen = []
    for _ in range(30):
        loss, stats = eagle3_train.step_loss(model, target, batch, DistillConfig(loss="fkl"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seen.append(float(loss.detach()))
    assert set(stats) == {f"train/{name}_{k}" for name in ("loss", "acc") for k in range(3)}
    weights = [0.8**k for k in range(3)]
    weighted = sum(w * stats[f"train/loss_{k}"] for k, w in enumerate(weights)) / sum(weights)
    assert weighted == pytest.approx(seen[-1], rel=1e-4)
    assert seen[-1] < 0.5 * seen[0]
    assert target.model.embed_tokens.weight.grad is None  # the shared embedding stays frozen


# ---------------------------------------------------------------- recipe checks


@pytest.mark.parametrize(
    "override, needle",
    [
        ("draft.lora.enabled=true", "draft.lora.enabled=false"),
        ("draft.quantization.load_in_4bit=true", "draft.quantization"),
        ("draft.init=truncate", "draft.init"),
        ("distill.source=draft", "distill.source=target"),
        ("distill.source=mix", "distill.source=target"),
        ("distill.cache_teacher=true", "cache_teacher=false"),
        ("distill.top_k=64", "top_k=0"),
        ("draft.aux_layers=[1,2]", "3 target layers"),
        ("distill.ttt_steps=0", "distill.ttt_steps"),
        ("distill.step_weight=1.5", "distill.step_weight"),
    ],
)
def test_options_that_do_not_apply_to_a_head_are_refused(override, needle):
    needs = ["distill.top_k=64"] if "cache_teacher" in override else []  # cache_teacher's own precondition
    with pytest.raises(RecipeError) as err:
        load_recipe(None, ["draft.kind=eagle3", *needs, override])
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_standalone_recipes_are_unchanged():
    recipe = load_recipe(None, ["distill.source=mix", "distill.top_k=64", "distill.cache_teacher=true"])
    assert recipe.draft.kind == "standalone"


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["draft.aux_layers=[1,2,9]"], "not 3 distinct rising ids"),
        (["draft.vocab_subset=500"], "larger than the target's vocabulary (97 tokens)"),
    ],
)
def test_target_config_checks(overrides, needle):
    recipe = load_recipe(None, ["draft.kind=eagle3", *overrides])
    with pytest.raises(ValueError) as err:
        eagle3_train.check_target_config(tiny_config("llama", 97, layers=4), recipe)
    assert needle in str(err.value)


def test_a_target_without_decoder_layers_is_refused():
    from transformers import PretrainedConfig

    recipe = load_recipe(None, ["draft.kind=eagle3"])
    with pytest.raises(ValueError, match="per-layer hidden states"):
        eagle3_train.check_target_config(PretrainedConfig(vocab_size=97), recipe)


def test_default_draft_vocabulary_is_capped_at_the_targets():
    assert eagle3_train.vocab_size(0, 320) == 320
    assert eagle3_train.vocab_size(0, 49152) == 8192
    assert eagle3_train.vocab_size(100, 320) == 100


# ---------------------------------------------------------------- train/distill.py end to end


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("assets")
    target, _ = make_pair(root)
    return {
        "target": target,
        "train": make_prompts(root / "train.jsonl", 40, seed=1),
        "eval": make_prompts(root / "eval.jsonl", 6, seed=2),
    }


def head_recipe(assets: dict, out: Path, **sections) -> dict:
    recipe = {
        "target": {"model": str(assets["target"]), "dtype": "float32"},
        "draft": {"kind": "eagle3", "vocab_subset": 128},
        "data": {"train_prompts": str(assets["train"]), "eval_prompts": str(assets["eval"]), "max_prompt_tokens": 48},
        "distill": {"source": "target", "max_new_tokens": 12},
        "train": {"lr": 3e-3, "max_steps": 6, "batch_size": 4, "warmup_steps": 1, "seed": 0},
        "eval": {"every": 3, "num_prompts": 3, "max_new_tokens": 12, "num_draft_tokens": 3, "repeats": 1},
        "log": {"report_to": "wandb", "every": 1},
        "output_dir": str(out),
    }
    for section, values in sections.items():
        recipe[section].update(values)
    return recipe


@pytest.fixture(scope="module")
def head_run(assets, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("head")
    out = tmp / "run"
    proc = launch(write_recipe(tmp, head_recipe(assets, out)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval.hf_assisted=false" in proc.stdout  # HF assisted generation cannot run a head
    return out


@pytest.mark.slow
def test_checkpoints_and_best_hold_the_served_head(head_run, assets):
    from transformers import AutoModelForCausalLM

    report = json.loads((head_run / "report.json").read_text())
    assert [c["step"] for c in report["checkpoints"]] == [0, 3, 6]
    assert report["best"]["speedup"]["vs_hf_assisted"] is None
    target = AutoModelForCausalLM.from_pretrained(assets["target"])
    for folder in [head_run / "best", *sorted((head_run / "checkpoints").iterdir())]:
        config = json.loads((folder / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 128
        assert (folder / "tokenizer.json").is_file() and (folder / "eval.json").is_file()
        head = eagle3.load(folder, target)
        assert head.aux_layers == eagle3.default_aux_layers(4) and 0 in head.draft_ids.tolist()  # EOS is in
    step6 = eagle3.load(head_run / "checkpoints" / "step-6", target)
    assert step6.fc.weight.dtype == torch.float32
    rows = [json.loads(line) for line in (head_run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert {f"train/{n}_{k}" for n in ("loss", "acc") for k in range(3)} <= set(train[0])
    assert len(list((head_run / "wandb").glob("offline-run-*"))) == 1


@pytest.mark.slow
def test_two_processes_train_one_head(assets, tmp_path):
    out = tmp_path / "run"
    recipe = head_recipe(assets, out, train={"batch_size": 2}, eval={"every": 6})
    proc = launch(write_recipe(tmp_path, recipe), processes=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["world_size"] == 2
    a, b = report["param_checksums"]
    assert a == b
    assert (out / "best" / "model.safetensors").is_file()


@pytest.mark.slow
def test_kill_and_resume_matches_uninterrupted(assets, head_run, tmp_path):
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path, head_recipe(assets, out))
    kill_at_checkpoint(recipe, out, step=3)
    resumed = launch(recipe, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    mine = json.loads((out / "report.json").read_text())
    ref = json.loads((head_run / "report.json").read_text())
    assert mine["param_checksums"] == pytest.approx(ref["param_checksums"], rel=1e-9)
    assert [c["loss"] for c in mine["checkpoints"]] == pytest.approx([c["loss"] for c in ref["checkpoints"]])


@pytest.mark.slow
@pytest.mark.parametrize(
    "draft, needle",
    [
        ({"aux_layers": [1, 2, 7]}, "aux layer ids [1, 2, 7] are not 3 distinct rising ids"),
        ({"vocab_subset": 1000}, "larger than the target's vocabulary"),
        ({"model": "TARGET"}, "is not an EAGLE-3 head folder"),
    ],
)
def test_bad_input_is_one_error_line_and_nothing_written(assets, tmp_path, draft, needle):
    draft = {k: str(assets["target"]) if v == "TARGET" else v for k, v in draft.items()}
    out = tmp_path / "run"
    line = error_line(run_script("--recipe", str(write_recipe(tmp_path, head_recipe(assets, out, draft=draft)))))
    assert needle in line
    assert not out.exists()
