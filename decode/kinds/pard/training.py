"""Training a PARD draft (`draft.kind: pard`): a standalone draft LM that drafts draft.block_size tokens in one
forward from mask tokens.

Everything but the step is the standalone kind's (decode.kinds.standalone.training): the draft is loaded from
draft.model (a sibling, a pretrained small LM, or a cut of the target), speeds up the target's rollouts, and is saved
as an ordinary HF checkpoint, its config marked with ``pard_token`` and ``block_size`` (decode.kinds.pard). A step runs
the draft once over every sequence and its K - 1 mask copies (decode.kinds.pard.decoding.block_inputs) and compares
block position k at anchor i with the target's distribution at i + k, the position that predicts x_{i+k+1}. With
distill.anchors N the mask copies hold only N anchors a sequence drawn at random (distill.training.anchors): one
forward of S + (K - 1) * N positions instead of K * S.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from decode import sources
from decode.kinds.pard import (
    TRAITS,  # noqa: F401  (the kind's facts: distill.kinds.interface.Kind)
    decoding,
)
from decode.kinds.standalone.training import (  # the same as a standalone draft's
    build_draft,
    generation_recorder,
    served,
)
from distill import models
from distill.config import Recipe
from distill.kinds.interface import StepLoss, check_mask_token_id, config_vocab
from distill.training import losses
from distill.training.anchors import pick_anchors, step_seed

__all__ = [
    "anchored_loss",
    "block_loss",
    "build_draft",
    "cache_teacher",
    "check_inputs",
    "decoding_vocab",
    "generation_recorder",
    "load_draft",
    "loss_step",
    "save_checkpoint",
    "served",
    "trainable_anchors",
]


def check_inputs(recipe: Recipe, target: str | None, target_config: Callable[[], Any]) -> None:
    """draft.mask_token_id, when set, is an id of the draft's vocabulary (draft.init=truncate: the target's). A
    folder saved as another kind is refused by distill.training.preflight (``TRAITS.folder_kinds``), the options a
    PARD step does not run with the recipe (distill.config).

    Raises:
        ValueError: one line naming draft.mask_token_id and the ids to choose from.
    """
    mask, draft = recipe.draft.mask_token_id, recipe.draft
    if mask is None or target is None:
        return  # nothing to check, or the quickstart pair is built later
    if draft.init == "truncate" or not draft.model:
        check_mask_token_id(mask, config_vocab(target_config()), "the target's")  # the draft is cut from it
        return
    kwargs = {"trust_remote_code": draft.trust_remote_code, **({"revision": draft.revision} if draft.revision else {})}
    config = sources.load_config(draft.model, key="draft.model", **kwargs)
    check_mask_token_id(mask, config_vocab(config), "the draft's")


def load_draft(recipe: Recipe, device: torch.device) -> tuple[nn.Module, Any]:
    """draft.model loaded for training (as a standalone draft), marked a PARD draft of draft.block_size with its
    mask token (draft.mask_token_id, else the tokenizer's mask, pad or unk token, else the vocabulary's last id;
    a draft already marked keeps its own unless the recipe names one). A PARD draft trained for another block is
    trained for draft.block_size from here on, and the run says so."""
    draft = models.load_draft(recipe.draft, device=device, gradient_checkpointing=recipe.train.gradient_checkpointing)
    tokenizer = models.load_tokenizer(recipe.draft.model, recipe.draft, key="draft.model")
    had = getattr(draft.config, "block_size", None) if decoding.is_pard(draft) else None
    if had is not None and int(had) != recipe.draft.block_size and int(os.environ.get("RANK", "0")) == 0:
        print(
            f"pard draft: {recipe.draft.model} was trained for a block of {had}; it is trained for "
            f"draft.block_size={recipe.draft.block_size} from here on"
        )
    vocab = int(draft.config.vocab_size)
    mask = recipe.draft.mask_token_id
    if mask is None:
        mask = getattr(draft.config, "pard_token", None)
    if mask is None:
        found = (tokenizer.mask_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id)
        mask = next((int(i) for i in found if i is not None and 0 <= int(i) < vocab), vocab - 1)
    decoding.mark(draft, block_size=recipe.draft.block_size, pard_token=int(mask))
    return draft, tokenizer


def cache_teacher(recipe: Recipe, target: nn.Module) -> None:
    """Nothing is kept: every step runs the target (the recipe refuses distill.cache_teacher)."""
    return None


def decoding_vocab(
    recipe: Recipe, source: Any, train_prompts: Sequence, vocab_size: int, state: Any, is_main: bool
) -> None:
    """The whole vocabulary (the recipe refuses draft.vocab_subset)."""
    return None


def block_loss(
    draft: nn.Module,
    teacher: torch.Tensor,
    ids: torch.Tensor,
    valid: torch.Tensor,
    loss_mask: torch.Tensor,
    loss: str,
    beta: float,
    temperature: float,
    step_weight: float,
    vocab_size: int | None = None,
    shift: int = 0,
    anchors: int = 0,
    seed: int = 0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """sum_k w^k loss_k / sum_k w^k over the draft's block positions, and per position its loss and top-1
    agreement with the target (``train/loss_k``, ``train/acc_k``).

    Block position k at anchor i predicts x_{i+k+1}: it is compared with the target's logits at i + k (``teacher``
    [B, S, V], one forward of the target over ``ids``), where ``loss_mask`` at i + k says whether x_{i+k+1}
    counts. The anchors are every position, or with ``anchors`` N, N per sequence drawn among its
    :func:`trainable_anchors` (``seed``: :func:`distill.training.anchors.anchor_seed`); block position 0 is
    trained at every position either way. ``shift``: for tests only, moves the teacher of the positions k >= 1 (a
    wrong step that must fail).
    """
    if anchors:
        picked, chosen = pick_anchors(trainable_anchors(valid, loss_mask), anchors, seed)
        return anchored_loss(
            draft, teacher, ids, valid, loss_mask, picked, chosen, loss, beta, temperature, step_weight, vocab_size,
            shift,
        )  # fmt: skip
    blocks = decoding.block_logits(draft, ids, valid, decoding.block_of(draft))
    width = ids.shape[1]

    def terms() -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:  # one shifted teacher at a time
        for k, student in enumerate(blocks):
            at = k + (shift if k else 0)
            if at >= width:
                return
            mask = torch.zeros_like(loss_mask)
            mask[:, : width - at] = loss_mask[:, at:]
            shifted = torch.zeros_like(teacher)
            shifted[:, : width - at] = teacher[:, at:]
            yield student, shifted, mask

    return weighted_loss(terms(), loss, beta, temperature, step_weight, vocab_size)


def trainable_anchors(valid: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: the positions i whose first block position is trained (x_{i+2}, predicted at i + 1, counts)."""
    trainable = torch.zeros_like(valid, dtype=torch.bool)
    trainable[:, :-1] = loss_mask[:, 1:].bool() & valid[:, 1:].bool()
    return trainable & valid.bool()


def anchored_loss(
    draft: nn.Module,
    teacher: torch.Tensor,
    ids: torch.Tensor,
    valid: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    chosen: torch.Tensor,
    loss: str,
    beta: float,
    temperature: float,
    step_weight: float,
    vocab_size: int | None = None,
    shift: int = 0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """:func:`block_loss` with the mask segments at ``anchors`` [B, N] only (``chosen`` [B, N] of them count):
    block position 0 at every position, block position k >= 1 at anchor j against the target's row anchors[j] + k
    where ``loss_mask`` keeps it (:func:`decode.kinds.pard.decoding.anchor_logits`)."""
    blocks = decoding.anchor_logits(draft, ids, valid, decoding.block_of(draft), anchors)
    width = ids.shape[1]

    def terms() -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        yield blocks[0], teacher, loss_mask
        for k, student in enumerate(blocks[1:], start=1):
            rows = anchors + k + shift
            inside = (rows >= 0) & (rows < width)
            rows = rows.clamp(0, width - 1)
            rows_teacher = teacher.gather(1, rows[..., None].expand(-1, -1, teacher.shape[-1]))  # [B, N, V]
            yield student, rows_teacher, (chosen & inside & loss_mask.gather(1, rows).bool()).to(loss_mask.dtype)

    return weighted_loss(terms(), loss, beta, temperature, step_weight, vocab_size)


def weighted_loss(
    terms: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    loss: str,
    beta: float,
    temperature: float,
    step_weight: float,
    vocab_size: int | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """sum_k w^k loss_k / sum_k w^k over block positions k given as (student logits, teacher logits, mask)."""
    total, weights, stats = None, 0.0, {}
    for k, (student, teacher, mask) in enumerate(terms):
        if not bool(mask.any()):
            continue  # sequences too short for this position
        loss_k = losses.distill_loss(
            student, teacher, mask, loss=loss, beta=beta, temperature=temperature, vocab_size=vocab_size
        )
        weight = step_weight**k
        total = weight * loss_k if total is None else total + weight * loss_k
        weights += weight
        stats[f"train/loss_{k}"] = float(loss_k.detach())
        agreement = losses.top1_agreement(student.detach(), teacher, mask, vocab_size=vocab_size)
        stats[f"train/acc_{k}"] = float(agreement)
    if total is None:
        raise ValueError("the loss mask selects no completion token: raise distill.max_new_tokens")
    return total / weights, stats


def loss_step(
    accelerator: Any,
    draft: nn.Module,
    target: nn.Module,
    recipe: Recipe,
    vocab_size: int,
    teachers: Any,
    draft_vocab: list[int] | None,
) -> Callable[[dict[str, torch.Tensor], list, bool], StepLoss]:
    """The step of one micro-batch: the target's logits over the batch, then :func:`block_loss` of the prepared
    ``draft`` (its forward through accelerate's wrapper, so DDP syncs its gradients)."""
    cfg = recipe.distill
    unwrapped = accelerator.unwrap_model(draft)

    def step(batch: dict[str, torch.Tensor], pairs: list, on_policy: bool) -> StepLoss:
        with torch.no_grad():
            teacher = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss, stats = block_loss(
            _Forward(draft, unwrapped), teacher, batch["input_ids"], batch["attention_mask"].bool(),
            batch["loss_mask"], cfg.loss, cfg.beta, cfg.temperature, cfg.step_weight, vocab_size,
            anchors=cfg.anchors, seed=step_seed(accelerator, recipe.train.seed) if cfg.anchors else 0,
        )  # fmt: skip
        return StepLoss(loss, stats.get("train/acc_0", 0.0), len(pairs), stats)

    return step


class _Forward(nn.Module):
    """The prepared (wrapped) draft's forward with the unwrapped draft's config and parameters, for
    decoding.block_logits."""

    def __init__(self, prepared: nn.Module, unwrapped: nn.Module):
        super().__init__()
        self.prepared, self.config = prepared, unwrapped.config
        self._params = unwrapped.parameters

    def parameters(self, recurse: bool = True):
        return self._params(recurse)

    def forward(self, **kwargs):
        return self.prepared(**kwargs)


def save_checkpoint(
    draft: nn.Module, folder: Path, tokenizer: Any, draft_vocab: tuple | None, recipe: Recipe, result: dict
) -> None:
    """An HF checkpoint whose config carries ``pard_token`` and ``block_size`` (vLLM's draft_model proposer with
    parallel_drafting reads the first)."""
    models.save_draft(draft, folder, tokenizer)
