"""Training over the draft vocabulary (distill.training.subset_loss, distill.loss_vocab=subset)."""

from __future__ import annotations

import json

import pytest
import torch

from distill.config import RecipeError, load_recipe
from distill.training import losses
from distill.training.distributed import check_engine
from distill.training.subset_loss import index_of, restrict_top_k, restricted, swapped_head
from tests.tiny import tiny_llama

V, K = 40, 6


def _teacher(tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(tokens, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_index_of_maps_ids_and_sends_the_rest_to_the_absent_column():
    position = index_of([7, 2, 30, 2], V)
    assert position[2] == 0 and position[7] == 1 and position[30] == 2
    assert int((position == -1).sum()) == V - 3  # every other id
    with pytest.raises(ValueError, match=r"in \[0, 40\)"):
        index_of([3, 40], V)


def test_restrict_top_k_keeps_the_mass_and_moves_absent_ids_to_the_tail():
    top_ids, log_pt = losses.teacher_top_k(_teacher(5), K)
    ids = [int(i) for i in top_ids[:, ::2].unique()]  # about half the teacher's top ids are in the subset
    cols, lp = restrict_top_k(top_ids, log_pt, index_of(ids, V))
    p, q = log_pt.exp(), lp.exp()
    assert torch.allclose(q.sum(-1), p.sum(-1), atol=1e-6)  # nothing lost: absent mass is in the tail
    inside = torch.isin(top_ids, torch.tensor(ids))
    assert torch.equal(q[:, :-1][inside], p[:, :-1][inside])
    assert (q[:, :-1][~inside] == 0).all() and (cols[~inside] == len(ids)).all()
    assert torch.allclose(q[:, -1], p[:, -1] + (p[:, :-1] * ~inside).sum(-1), atol=1e-6)


@pytest.mark.parametrize("loss", ["fkl", "rkl", "jsd", "tvd"])
def test_subset_loss_is_the_divergence_of_the_subset_softmax(loss):
    """The value equals the divergence, computed directly in float64, between the target's distribution coarsened
    to {subset ids in its top k} + tail and the draft's softmax over the subset coarsened the same way."""
    tokens, ids = 7, [0, 3, 4, 9, 11, 17, 20, 25, 33, 39]
    teacher = _teacher(tokens, 1)
    student_full = torch.randn(tokens, V, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    student = torch.cat([student_full[:, ids], torch.full((tokens, 1), float("-inf"), dtype=torch.float64)], -1)
    top_ids, log_pt = losses.teacher_top_k(teacher, K)
    cols, lp = restrict_top_k(top_ids, log_pt, index_of(ids, V))
    mask = torch.ones(1, tokens)
    got = losses.distill_loss_top_k(student.float()[None], mask, cols, lp, loss=loss)

    p_t = torch.softmax(teacher.double(), -1)
    q = torch.zeros(tokens, V, dtype=torch.float64)
    q[:, ids] = torch.softmax(student_full[:, ids], -1)

    def coarse(probs: torch.Tensor, t: int) -> torch.Tensor:  # {subset ids in the teacher's top k} + tail, logs
        kept = [i for i in top_ids[t].tolist() if i in ids]
        part = probs[t, kept]
        return torch.cat([part, (1 - part.sum()).reshape(1)]).log()[None]

    expected = [losses.divergence(coarse(q, t), coarse(p_t, t), loss)[0] for t in range(tokens)]
    assert torch.isfinite(got)
    assert float(got) == pytest.approx(float(torch.stack(expected).mean()), rel=2e-4, abs=1e-6)


def test_with_every_id_the_subset_loss_is_the_full_top_k_loss():
    tokens = 9
    teacher = _teacher(tokens, 3)
    student = torch.randn(1, tokens, V, generator=torch.Generator().manual_seed(4), requires_grad=True)
    top_ids, log_pt = losses.teacher_top_k(teacher, K)
    mask = torch.ones(1, tokens)
    full = losses.distill_loss_top_k(student, mask, top_ids, log_pt)
    padded = torch.cat([student, torch.full((1, tokens, 1), float("-inf"))], -1)
    cols, lp = restrict_top_k(top_ids, log_pt, index_of(range(V), V))
    sub = losses.distill_loss_top_k(padded, mask, cols, lp)
    assert float(sub.detach()) == pytest.approx(float(full.detach()), rel=1e-5)
    (g_full,) = torch.autograd.grad(full, student)
    (g_sub,) = torch.autograd.grad(sub, student)
    assert torch.allclose(g_full, g_sub, atol=1e-6)


def test_restricted_head_trains_its_rows_only_and_is_put_back():
    model = tiny_llama(V, tie=False)
    head = model.get_output_embeddings()
    ids = [1, 5, 6, 30]
    x = torch.randint(0, V, (2, 5))
    full = model(input_ids=x).logits
    restricted_head = restricted(model, ids)
    with swapped_head(model, restricted_head):
        logits = model(input_ids=x).logits
    assert model.get_output_embeddings() is head
    assert logits.shape == (2, 5, len(ids) + 1) and torch.isinf(logits[..., -1]).all()
    assert torch.allclose(logits[..., :-1], full[..., ids], atol=1e-5)
    logits[..., :-1].sum().backward()
    touched = head.weight.grad.abs().sum(-1) > 0
    assert touched.nonzero().flatten().tolist() == ids
    with pytest.raises(RuntimeError, match="boom"), swapped_head(model, restricted_head):
        raise RuntimeError("boom")
    assert model.get_output_embeddings() is head


def test_recipe_and_launch_checks():
    base = ["draft.vocab_subset=64", "distill.loss_vocab=subset", "distill.top_k=8"]
    assert load_recipe(None, base).distill.loss_vocab == "subset"
    with pytest.raises(RecipeError, match="draft.vocab_subset"):
        load_recipe(None, base[1:])
    with pytest.raises(RecipeError, match="distill.top_k"):
        load_recipe(None, base[:2])
    with pytest.raises(RecipeError, match="LoRA"):
        load_recipe(None, [*base, "draft.lora.enabled=true"])
    engine = dict(source="target", quantized=False, lora=False, cuda=False, has_deepspeed=True)
    check_engine(None, subset_head=True, **engine)
    with pytest.raises(ValueError, match="loss_vocab=full"):
        check_engine("fsdp", subset_head=True, **engine)


@pytest.mark.slow
@pytest.mark.parametrize("cache_teacher", [False, True])
def test_a_run_trains_over_its_draft_vocabulary(tmp_path, cache_teacher):
    """A real run with loss_vocab=subset, the teacher's rows computed each step or kept from the first epoch: it
    trains (the loss falls) and the checkpoint is an ordinary one whose full head drafts from the subset alone."""
    from safetensors.torch import load_file

    from decode.draft_vocab import load_ids
    from tests.procs import run_distill, tiny_recipe, tiny_run_paths

    out = tmp_path / "run"
    paths = tiny_run_paths(tmp_path)
    distill = {"source": "target", "max_new_tokens": 8, "top_k": 8, "loss_vocab": "subset"}
    recipe = tiny_recipe(
        paths, out, {**distill, "cache_teacher": cache_teacher}, {"max_steps": 6, "batch_size": 4, "lr": 3e-3},
        draft={"vocab_subset": 40},
    )  # fmt: skip
    proc = run_distill(recipe, tmp_path, OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(train_losses) == 6 and train_losses[-1] < train_losses[0]
    ids = load_ids(out / "best")
    before = load_file(str(paths["draft"] / "model.safetensors"))
    after = load_file(str(out / "checkpoints" / "step-6" / "model.safetensors"))
    head = next(k for k in before if k.endswith("lm_head.weight") or k.endswith("embed_tokens.weight"))
    others = torch.ones(after["lm_head.weight"].shape[0], dtype=torch.bool)
    others[ids] = False
    assert not torch.equal(after["lm_head.weight"][ids], before[head][ids])  # the subset's rows trained
    stale = after["lm_head.weight"][others]  # masked for engines that run the full head: one fitted row
    assert torch.equal(stale, stale[:1].expand_as(stale)) and stale.any()
    saved_head = json.loads((out / "best" / "draft_vocab.json").read_text())["saved_head"]
    assert saved_head["heldout_positions"] > 0 and 0 <= saved_head["outside_mass_mean"] <= 1
    assert json.loads((out / "best" / "config.json").read_text())["tie_word_embeddings"] is False
