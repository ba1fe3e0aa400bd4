"""Training an EAGLE-3 head (draft.kind: eagle3): the loss over the draft vocabulary and its tail bucket, the
unrolled step on a tiny real target, the recipe's checks, and `train/distill.py` end to end (served-format
checkpoints, best/, 2 processes, kill -9 and --resume, bad inputs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from decode.kinds.eagle3 import decoding as eagle3
from decode.kinds.eagle3 import train_step
from distill.config import DistillConfig, RecipeError, load_recipe
from distill.data.prompts import collate_training
from distill.training import losses
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
    log_ps, log_pt = train_step.step_log_probs(student, teacher, ids)
    p = teacher.softmax(-1)
    in_mass = p[:, ids].sum(-1)
    conditioned = (p[:, ids] / in_mass[:, None]).log()
    expected = in_mass * losses.divergence(student.log_softmax(-1), conditioned, loss, 0.3)
    assert torch.allclose(losses.divergence(log_ps, log_pt, loss, 0.3), expected, atol=1e-5)
    assert torch.allclose(log_pt.exp().sum(-1), torch.ones(5), atol=1e-5)  # the tail bucket holds the rest
    # its optimum is the target conditioned on the draft vocabulary: loss 0 and no gradient there
    best = conditioned.clone().requires_grad_(True)
    value = losses.divergence(*train_step.step_log_probs(best, teacher, ids), loss, 0.3).mean()
    value.backward()
    assert float(value.detach()) < 1e-5
    if loss != "tvd":  # |x| has no gradient at its minimum
        assert best.grad.abs().max() < 1e-5


def test_a_draft_vocabulary_of_every_token_gives_the_plain_divergence():
    g = torch.Generator().manual_seed(1)
    teacher, student = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g, requires_grad=True)
    log_ps, log_pt = train_step.step_log_probs(student, teacher, torch.arange(16))
    value = losses.divergence(log_ps, log_pt, "fkl")
    assert torch.allclose(value, losses.divergence(student.log_softmax(-1), teacher.log_softmax(-1), "fkl"))
    value.sum().backward()
    assert torch.isfinite(student.grad).all()


def test_default_unroll_and_weights_are_the_kinds():
    cfg = DistillConfig()
    assert (cfg.ttt_steps, cfg.step_weight) == (eagle3.TTT_STEPS, eagle3.STEP_WEIGHT)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_forward_kl_shortcut_equals_the_divergence_it_replaces(temperature):
    g = torch.Generator().manual_seed(2)
    teacher = torch.randn(6, 40, generator=g) * 4
    teacher[0, 5] = float("-inf")  # a masked token: p = 0 exactly
    student = torch.randn(6, 12, generator=g, requires_grad=True)
    ids = torch.tensor([0, 3, 4, 5, 9, 11, 17, 20, 21, 30, 33, 38])
    log_pt = train_step.teacher_log_probs(teacher, ids, temperature)
    log_ps = train_step.student_log_probs(student, log_pt[:, -1:], temperature)
    generic = losses.divergence(log_ps, log_pt, "fkl")
    (g_generic,) = torch.autograd.grad(generic.sum(), student)
    shortcut = train_step._FklTeacher.of(log_pt).rows(student, torch.arange(6), temperature)
    (g_shortcut,) = torch.autograd.grad(shortcut.sum(), student)
    assert torch.allclose(shortcut, generic, atol=1e-5) and torch.allclose(g_shortcut, g_generic, atol=1e-6)
    # the same rows read out of a larger logits tensor, in another order, as a step reads a batch's rows
    wide = torch.randn(10, 12, generator=g).index_copy(0, torch.tensor([7, 1, 4, 9, 0, 2]), student.detach())
    wide.requires_grad_(True)
    picked = torch.tensor([7, 1, 4, 9, 0, 2])
    read = train_step._FklTeacher.of(log_pt).rows(wide, torch.arange(6), temperature, picked)
    (g_read,) = torch.autograd.grad(read.sum(), wide)
    assert torch.allclose(read, generic, atol=1e-5) and torch.allclose(g_read[picked], g_generic, atol=1e-6)
    assert not g_read[[3, 5, 6, 8]].any()


def test_the_forward_kl_shortcut_keeps_no_copies_of_the_logits_for_its_backward():
    """Forward and backward over n rows of Vd logits peak below 3 [n, Vd] float32 tensors (the gradient and the
    chunks): autograd through log_softmax keeps 3 copies for the backward and peaks at 4."""
    from tests.memory import TensorPeak

    g = torch.Generator().manual_seed(4)
    n, vd = 2048, 1024
    fkl = train_step._FklTeacher.of(torch.randn(n + 5, vd + 1, generator=g).log_softmax(-1))
    student = torch.randn(n, vd, generator=g, requires_grad=True)
    with TensorPeak() as peak:
        fkl.rows(student, torch.arange(n) + 3, 0.8).mean().backward()
    assert peak.bytes < 3 * n * vd * 4, peak.bytes / (n * vd * 4)


# ---------------------------------------------------------------- the step on a real tiny target


def test_step_loss_decreases_and_reports_every_unrolled_step():
    target = tiny_llama(97, 0, layers=4, initializer_range=0.2).requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    pairs = [(torch.randint(1, 97, (5,), generator=g).tolist(), torch.randint(1, 97, (20,), generator=g).tolist())]
    batch = collate_training(pairs * 4, 0)
    torch.manual_seed(0)
    model = train_step.Unrolled(eagle3.build(target, list(range(64))))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    seen = []
    for _ in range(30):
        loss, stats = train_step.step_loss(model, target, batch, DistillConfig(loss="fkl"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seen.append(float(loss.detach()))
    assert set(stats) == {f"train/{name}_{k}" for name in ("loss", "acc") for k in range(3)} | {
        "train/teacher_forwards"
    }
    weights = [0.8**k for k in range(3)]
    weighted = sum(w * stats[f"train/loss_{k}"] for k, w in enumerate(weights)) / sum(weights)
    assert weighted == pytest.approx(seen[-1], rel=1e-4)
    assert seen[-1] < 0.5 * seen[0]
    assert target.model.embed_tokens.weight.grad is None  # the shared embedding stays frozen


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("loss, recompute", [("fkl", False), ("jsd", False), ("fkl", True)])
def test_a_step_has_the_loss_and_gradients_of_the_dense_attention(arch, loss, recompute):
    """The whole training step (unroll, loss, backward) on a right-padded batch of several lengths: the same loss,
    statistics and gradients as with dense [S, S] attention scores."""
    from transformers import AutoModelForCausalLM

    from tests.test_eagle3_memory import DenseUnrolled

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(tiny_config(arch, 97, layers=4, initializer_range=0.2)).eval()
    target.requires_grad_(False)
    g = torch.Generator().manual_seed(7)
    pairs = [
        (
            torch.randint(1, 97, (3 + 4 * b,), generator=g).tolist(),
            torch.randint(1, 97, (9 + 7 * b,), generator=g).tolist(),
        )
        for b in range(3)
    ]
    batch = collate_training(pairs, 0)
    head = eagle3.build(target, list(range(0, 97, 2)))
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.mul_(2.0)  # more peaked attention and distributions, where differences would show
    cfg = DistillConfig(loss=loss, temperature=0.8, recompute=recompute)
    params = [p for p in head.parameters() if p.requires_grad]
    results = []
    for model in (train_step.Unrolled(head), DenseUnrolled(head)):
        value, stats = train_step.step_loss(model, target, batch, cfg)
        results.append((value.detach(), torch.autograd.grad(value, params), stats))
    (new, new_grads, new_stats), (old, old_grads, old_stats) = results
    torch.testing.assert_close(new, old, atol=1e-6, rtol=1e-5)
    assert new_stats.keys() == old_stats.keys()
    assert all(new_stats[k] == pytest.approx(old_stats[k], rel=1e-5, abs=1e-6) for k in new_stats)
    for a, b in zip(new_grads, old_grads):  # float32 sums in another order: 1e-5 of the largest entry apart
        torch.testing.assert_close(a, b, atol=5e-5 * float(b.abs().max()), rtol=1e-4)


# ---------------------------------------------------------------- recipe checks


@pytest.mark.parametrize(
    "override, needle",
    [
        ("draft.lora.enabled=true", "draft.lora.enabled=false"),
        ("draft.quantization.load_in_4bit=true", "draft.quantization"),
        ("draft.init=truncate", "draft.init"),
        ("distill.source=draft", "distill.source=target"),
        ("distill.source=mix", "distill.source=target"),
        ("distill.top_k=64", "top_k=0"),
        ("draft.aux_layers=[1,2]", "3 target layers"),
        ("distill.ttt_steps=0", "distill.ttt_steps"),
        ("distill.step_weight=1.5", "distill.step_weight"),
    ],
)
def test_options_that_do_not_apply_to_a_head_are_refused(override, needle):
    with pytest.raises(RecipeError) as err:
        load_recipe(None, ["draft.kind=eagle3", override])
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
        train_step.check_target_config(tiny_config("llama", 97, layers=4), recipe)
    assert needle in str(err.value)


def test_a_target_without_decoder_layers_is_refused():
    from transformers import PretrainedConfig

    recipe = load_recipe(None, ["draft.kind=eagle3"])
    with pytest.raises(ValueError, match="per-layer hidden states"):
        train_step.check_target_config(PretrainedConfig(vocab_size=97), recipe)


def test_default_draft_vocabulary_is_capped_at_the_targets():
    assert train_step.vocab_size(0, 320) == 320
    assert train_step.vocab_size(0, 49152) == 8192
    assert train_step.vocab_size(100, 320) == 100


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
def test_two_processes_train_one_head_from_hidden_states_kept_while_generating(assets, tmp_path):
    out = tmp_path / "run"
    recipe = head_recipe(
        assets,
        out,
        distill={"cache_teacher": True},
        train={"batch_size": 2, "max_steps": 14},  # 40 prompts, 2 per process a step: epoch 2 from step 11
        eval={"every": 14, "at_start": False, "num_draft_tokens": "tree:2,3,4"},
    )
    proc = launch(write_recipe(tmp_path, recipe), processes=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["world_size"] == 2 and report["base"] is None  # eval.at_start=false: no step-0 evaluation
    # the evaluation drafted a tree, losslessly (a float32 target)
    best = report["best"]
    assert best["num_draft_tokens"] == "tree:2,3,4" and best["outputs_match_target"] is True
    assert [c["step"] for c in report["checkpoints"]] == [14]
    a, b = report["param_checksums"]
    assert a == b
    assert (out / "best" / "model.safetensors").is_file()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    forwards = {r["step"]: r["train/teacher_forwards"] for r in rows if "train/teacher_forwards" in r}
    # each process generated the continuations of its own share of the prompts and kept the target's states as
    # it did: no step runs the target, in either epoch
    assert [forwards[s] for s in range(1, 15)] == [0] * 14
    assert "the target's states kept as it generated them (20 of this process's 20)" in proc.stdout
    assert max(r["train/teacher_cache_gb"] for r in rows if "train/teacher_cache_gb" in r) > 0


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


# ---------------------------------------------------------------- distill.cache_teacher for a head


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen2"])
@pytest.mark.parametrize("loss", ["fkl", "jsd"])
def test_a_kept_batch_gives_the_loss_and_gradient_of_the_target_forward(arch, loss):
    from transformers import AutoModelForCausalLM

    from distill.training.teacher_cache import sequence_key

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(tiny_config(arch, 97, layers=4, initializer_range=0.2)).eval()
    target.requires_grad_(False)
    g = torch.Generator().manual_seed(3)
    pairs = [
        (torch.randint(1, 97, (4 + b,), generator=g).tolist(), torch.randint(1, 97, (12,), generator=g).tolist())
        for b in range(3)
    ]
    batch = collate_training(pairs, 0, loss_positions="all")
    keys = [sequence_key(*p) for p in pairs]
    model = train_step.Unrolled(eagle3.build(target, list(range(0, 97, 2))))
    cfg = DistillConfig(loss=loss, temperature=0.8)
    cache = train_step.TargetCache(target, cfg.temperature, max_gb=1.0)
    results = []
    for _ in range(2):  # the first step runs the target and keeps the batch, the second reads it back
        loss_value, stats = train_step.step_loss(model, target, batch, cfg, cache=cache, keys=keys)
        (grad,) = torch.autograd.grad(loss_value, model.head.fc.weight)
        results.append((loss_value.detach(), grad, stats))
    (first, g1, s1), (second, g2, s2) = results
    assert cache.usable and len(cache) == 3 and cache.nbytes > 0
    assert (s1["train/teacher_forwards"], s2["train/teacher_forwards"]) == (3.0, 0.0)
    assert torch.allclose(first, second, atol=1e-5) and torch.allclose(g1, g2, atol=1e-6)
    assert all(s1[f"train/acc_{k}"] == s2[f"train/acc_{k}"] for k in range(3))


def test_a_target_whose_logits_are_not_its_output_layer_is_never_read_from_the_cache():
    from distill.training.teacher_cache import sequence_key

    target = tiny_llama(97, 0, layers=4).requires_grad_(False)
    target.lm_head.forward = lambda h: torch.nn.functional.linear(h, target.lm_head.weight) * 0.5  # a logit scale
    pairs = [([5, 6, 7], list(range(10, 30)))]
    batch = collate_training(pairs, 0)
    model = train_step.Unrolled(eagle3.build(target, list(range(64))))
    cache = train_step.TargetCache(target, 1.0, max_gb=1.0)
    keys = [sequence_key(*pairs[0])]
    for _ in range(2):
        _, stats = train_step.step_loss(model, target, batch, DistillConfig(), cache=cache, keys=keys)
        assert stats["train/teacher_forwards"] == 1.0
    assert cache.usable is False and len(cache) == 0


def test_rows_past_the_memory_bound_are_not_kept():
    from distill.training.teacher_cache import sequence_key

    target = tiny_llama(97, 0, layers=4).requires_grad_(False)
    pairs = [([5, 6, 7], list(range(10, 30))), ([8, 9], list(range(40, 60)))]
    batch = collate_training(pairs, 0)
    model = train_step.Unrolled(eagle3.build(target, list(range(64))))
    one_row = 23 * (3 * 64 * 4 + 64 * 4 + 4 + 4)  # the first sequence's 23 tokens, float32 states
    cache = train_step.TargetCache(target, 1.0, max_gb=one_row / 1e9)
    keys = [sequence_key(*p) for p in pairs]
    train_step.step_loss(model, target, batch, DistillConfig(), cache=cache, keys=keys)
    assert len(cache) == 1 and cache.nbytes == one_row
    # What is counted is what is held: the kept rows own their storage, not views of the batch (its padding).
    held = sum(t.untyped_storage().nbytes() for entry in cache._entries.values() for t in entry)
    assert held == one_row
    _, stats = train_step.step_loss(model, target, batch, DistillConfig(), cache=cache, keys=keys)
    assert stats["train/teacher_forwards"] == 2.0  # a batch is read back only when every row is kept


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen2"])
def test_states_kept_while_generating_equal_the_training_forward_and_change_no_token(arch):
    from transformers import AutoModelForCausalLM

    from distill.data.prompts import Example
    from distill.data.rollouts import generate_target_rollouts
    from distill.training.teacher_cache import sequence_key

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(tiny_config(arch, 97, layers=4, initializer_range=0.2)).eval()
    target.requires_grad_(False)
    g = torch.Generator().manual_seed(5)
    examples = [Example(i, torch.randint(1, 97, (3 + 2 * i,), generator=g).tolist()) for i in range(4)]
    plain = generate_target_rollouts(
        examples, target, None, max_new_tokens=12, temperature=0.0, eos_token_id=[], pad_token_id=0
    )
    eos = plain[1][4]  # a token row 1 writes early: rows end at different rounds
    gen = dict(max_new_tokens=12, temperature=0.0, eos_token_id=eos, pad_token_id=0)
    plain = generate_target_rollouts(examples, target, None, **gen)
    head = eagle3.build(target, list(range(0, 97, 2)))
    cache = train_step.TargetCache(target, 0.8, max_gb=1.0)
    recorder = train_step.GenerationRecorder(cache, head.aux_layers)
    kept = generate_target_rollouts(examples, target, None, recorder=recorder, **gen)
    assert kept == plain  # observing the states changes no token
    assert len({len(c) for c in kept}) > 1 and any(c[-1] == eos for c in kept)
    assert cache.usable and len(cache) == 4 and not recorder._parts
    for example, completion in zip(examples, kept):
        pair = (example.prompt_ids, completion)
        batch = collate_training([pair], 0, loss_positions="all")
        fresh = train_step.target_side(target, batch, head, 0.8)
        found = train_step.target_side(target, batch, head, 0.8, cache, [sequence_key(*pair)])
        assert (fresh.computed, found.computed) == (1, 0)
        assert torch.allclose(found.features, fresh.features, atol=1e-4)
        assert torch.allclose(found.log_p, fresh.log_p, atol=1e-4)
        assert torch.equal(found.top, fresh.top)


def test_a_target_whose_logits_are_not_its_output_layer_keeps_nothing_while_generating():
    from distill.data.prompts import Example
    from distill.data.rollouts import generate_target_rollouts

    target = tiny_llama(97, 0, layers=4).requires_grad_(False)
    forward = target.forward

    def scaled(*args, **kwargs):  # a logit scale in the model's forward, as Cohere's and Granite's have
        out = forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out

    target.forward = scaled
    cache = train_step.TargetCache(target, 1.0, max_gb=1.0)
    recorder = train_step.GenerationRecorder(cache, [1, 2, 3])
    examples = [Example(0, [5, 6, 7]), Example(1, [8, 9])]
    generate_target_rollouts(
        examples, target, None, max_new_tokens=6, temperature=0.0, eos_token_id=[], pad_token_id=0, recorder=recorder
    )
    assert cache.usable is False and len(cache) == 0
