"""distill.training.teacher_cache: the target's top-k rows kept for sequences that come back, and the loss on them."""

from __future__ import annotations

import json

import pytest
import torch

from distill.config import RecipeError, load_recipe
from distill.data.prompts import collate_training
from distill.training import losses
from distill.training.teacher_cache import TeacherCache, sequence_key, teacher_rows, top1_agreement_top_k
from tests.procs import run_distill, tiny_recipe, tiny_run_paths
from tests.tiny import tiny_llama

V = 40


def _batch():
    pairs = [([1, 2, 3, 4], [5, 6, 7]), ([8, 9], [10, 11, 12, 13, 14]), ([3, 3, 3, 3, 3, 3], [2])]
    return pairs, collate_training(pairs, pad_token_id=0, loss_positions="all")


@pytest.mark.parametrize("loss", losses.LOSSES)
def test_loss_on_kept_rows_equals_the_top_k_loss(loss):
    """The loss on teacher_top_k rows is distill_loss(top_k=k): same value, same gradient."""
    g = torch.Generator().manual_seed(0)
    student = torch.randn(3, 9, V, generator=g, requires_grad=True)
    teacher = torch.randn(3, 9, V, generator=g) * 3
    mask = (torch.rand(3, 9, generator=g) > 0.4).long()
    reference = losses.distill_loss(student, teacher, mask, loss=loss, beta=0.3, temperature=0.8, top_k=5)
    (ref_grad,) = torch.autograd.grad(reference, student)
    ids, log_pt = losses.teacher_top_k(teacher[mask.bool()], 5, temperature=0.8)
    cached = losses.distill_loss_top_k(student, mask, ids, log_pt, loss=loss, beta=0.3, temperature=0.8)
    (grad,) = torch.autograd.grad(cached, student)
    assert cached.item() == pytest.approx(reference.item(), rel=1e-6, abs=1e-7)
    torch.testing.assert_close(grad, ref_grad)


def test_loss_on_kept_rows_names_a_row_count_mismatch():
    student, mask = torch.randn(1, 4, V), torch.tensor([[1, 1, 0, 1]])
    ids, log_pt = losses.teacher_top_k(torch.randn(2, V), 4)
    with pytest.raises(ValueError, match=r"do not match the 3 masked positions"):
        losses.distill_loss_top_k(student, mask, ids, log_pt)


def test_rows_come_from_the_cache_the_second_time_and_match_the_full_batch_forward():
    target = tiny_llama(V, seed=3)
    pairs, batch = _batch()
    keys = [sequence_key(p, c) for p, c in pairs]
    cache = TeacherCache(top_k=6, temperature=0.8)
    ids, log_pt, computed = teacher_rows(cache, keys, batch, target, keep=True)
    assert computed == 3 and len(cache) == 3 and cache.nbytes > 0
    # the same rows as the top-k of the whole batch's forward (right padding: a row's logits are its own)
    with torch.no_grad():
        full = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ref_ids, ref_logp = losses.teacher_top_k(full[batch["loss_mask"].bool()], 6, 0.8)
    assert ids.shape == ref_ids.shape and log_pt.shape == ref_logp.shape
    torch.testing.assert_close(log_pt, ref_logp, atol=1e-4, rtol=1e-4)
    assert (ids[:, 0] == ref_ids[:, 0]).all()

    again_ids, again_logp, computed = teacher_rows(cache, keys, batch, target, keep=True)
    assert computed == 0 and cache.hits == 3
    assert torch.equal(again_ids, ids)
    torch.testing.assert_close(again_logp, log_pt, atol=2e-3, rtol=1e-3)  # stored in float16

    # one new sequence in the batch: only it goes through the target
    pairs2 = [pairs[0], ([7, 7], [1, 2])]
    batch2 = collate_training(pairs2, pad_token_id=0, loss_positions="all")
    _, _, computed = teacher_rows(cache, [sequence_key(p, c) for p, c in pairs2], batch2, target, keep=False)
    assert computed == 1 and len(cache) == 3  # keep=False (on-policy): not stored


def test_top1_agreement_from_kept_rows():
    pairs, batch = _batch()
    n = int(batch["loss_mask"].sum())
    student = torch.zeros(batch["input_ids"].shape + (V,))
    student[..., 7] = 1.0  # argmax 7 everywhere
    ids = torch.tensor([[7, 1]] * (n - 2) + [[3, 7]] * 2)
    assert top1_agreement_top_k(student, batch["loss_mask"], ids).item() == pytest.approx((n - 2) / n)


def test_sequence_key_separates_prompt_and_completion():
    assert sequence_key([1, 2], [3]) != sequence_key([1], [2, 3])
    assert sequence_key([1, 2], [3]) == sequence_key((1, 2), (3,))


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["distill.cache_teacher=true"], r"distill.cache_teacher: .*set distill.top_k"),
        (["distill.cache_teacher=true", "distill.top_k=8", "distill.source=draft"], r"never come back"),
        *(
            (
                [
                    "distill.cache_teacher=true",
                    "distill.top_k=8",
                    f"distill.source={source}",
                    "distill.cache_rollouts=false",
                ],
                r"distill.cache_teacher: .*grows without bound: set cache_rollouts=true",
            )
            for source in ("target", "mix", "schedule")
        ),
    ],
)
def test_cache_teacher_config_errors(overrides, match):
    with pytest.raises(RecipeError, match=match):
        load_recipe(None, overrides)


def test_cache_teacher_without_the_rollout_cache_is_bounded_by_a_dataset():
    """source=fixed trains on the dataset's own completions: they come back every epoch, cache or not."""
    recipe = load_recipe(
        None, ["distill.cache_teacher=true", "distill.top_k=8", "distill.source=fixed", "distill.cache_rollouts=false"]
    )
    assert recipe.distill.cache_teacher and not recipe.distill.cache_rollouts


@pytest.mark.slow
def test_a_run_scores_each_sequence_once_then_trains_from_the_cache(tmp_path):
    """source=target over several epochs: the target scores every training sequence in the first epoch only."""
    out = tmp_path / "run"
    paths = tiny_run_paths(tmp_path)
    recipe = tiny_recipe(
        paths,
        out,
        {"source": "target", "max_new_tokens": 8, "top_k": 8, "cache_teacher": True},
        {"max_steps": 12, "batch_size": 4},
    )
    proc = run_distill(recipe, tmp_path, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    forwards = [r["train/teacher_forwards"] for r in rows if "train/teacher_forwards" in r]
    assert len(forwards) == 12
    assert sum(forwards) == 8  # 8 sequences, each scored once (epoch 1: steps 1-2), reused for 5 more epochs
    assert forwards[2:] == [0] * 10
    assert [r for r in rows if "train/teacher_cache_gb" in r][-1]["train/teacher_cache_gb"] > 0
    assert all(r["train/loss"] == r["train/loss"] for r in rows if "train/loss" in r)  # finite


@pytest.mark.parametrize("chunk,dtype", [(1, torch.float32), (7 * V, torch.float32), (1 << 20, torch.bfloat16)])
def test_fused_top_k_forward_kl_matches_the_unfused_form(monkeypatch, chunk, dtype):
    """The chunked forward KL on kept rows (rows one by one, ragged chunks, one chunk; a bf16 student) equals the
    log-probability form of the other losses: value and gradient."""
    monkeypatch.setitem(losses._CHUNK_ELEMENTS, "cpu", chunk)
    g = torch.Generator().manual_seed(1)
    student = (torch.randn(2, 11, V, generator=g) * 2).to(dtype).requires_grad_()
    mask = (torch.rand(2, 11, generator=g) > 0.3).long()
    ids, log_pt = losses.teacher_top_k(torch.randn(int(mask.sum()), V, generator=g) * 3, 6, temperature=0.7)
    fused = losses.distill_loss_top_k(student, mask, ids, log_pt, temperature=0.7)
    (grad,) = torch.autograd.grad(fused, student)
    log_ps = losses.student_log_probs_at(student[mask.bool()], ids, 0.7)
    plain = losses.forward_kl_per_token(log_ps, log_pt).mean()
    (ref_grad,) = torch.autograd.grad(plain, student)
    assert fused.item() == pytest.approx(plain.item(), rel=1e-5, abs=1e-6)
    tol = {"atol": 1e-6, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-4, "rtol": 2e-2}
    torch.testing.assert_close(grad.float(), ref_grad.float(), **tol)


def test_each_process_keeps_its_share_of_the_prompts_across_epochs():
    from distill.config import TrainConfig
    from distill.training.helpers import batch_indices

    cfg = TrainConfig(batch_size=3, grad_accum=2, seed=5)
    n, world = 23, 2
    seen = {r: [i for step in range(8) for m in range(2) for i in batch_indices(step, m, cfg, n, r, world)]
            for r in range(world)}  # fmt: skip
    for r in range(world):
        share = set(range(r, n, world))
        assert set(seen[r]) == share  # only its own prompts: what it cached comes back
        size = len(share)
        assert sorted(seen[r][:size]) == sorted(share)  # an epoch covers the share once
        assert seen[r][:size] != seen[r][size : 2 * size]  # and the next one is another order
    for step in range(8):  # the processes never share a prompt in a step
        assert not set(batch_indices(step, 0, cfg, n, 0, world)) & set(batch_indices(step, 0, cfg, n, 1, world))
    # one process: a seeded permutation of all prompts, epoch after epoch
    one = [i for step in range(8) for i in batch_indices(step, 0, TrainConfig(batch_size=3, seed=5), 23, 0, 1)]
    assert sorted(one[:23]) == list(range(23))
    assert batch_indices(0, 0, cfg, 1, 1, 2) == [0, 0, 0]  # fewer prompts than processes
