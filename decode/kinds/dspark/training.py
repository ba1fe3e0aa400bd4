"""Training a DSpark draft (`draft.kind: dspark`): a DFlash draft (:mod:`decode.kinds.dflash.training`) with a low-rank
Markov bias of the previous token and, when draft.confidence_min is set, a confidence head (decode.kinds.dspark).

Built, fed and anchored as a DFlash draft: draft.num_layers layers over target layers draft.aux_layers, a block of
draft.block_size mask tokens, the target's side from one forward or distill.cache_teacher, distill.anchors blocks
per sequence. Its Markov head has rank draft.markov_rank. The loss is DFlash's block loss over the Markov-biased
logits (the true previous tokens feed the bias: what drafting sees while every earlier token was right), plus,
with a confidence head, :data:`CONFIDENCE_WEIGHT` times the binary cross-entropy of its logit at block position k
against whether the draft's argmax there is the target's token, over the positions where every earlier block
position matched (the only ones whose confidence decides anything while drafting). Saved in speculators'
``dspark`` layout, which vLLM's ``method: dspark`` reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from decode.compat import text_config
from decode.kinds.dflash import training as dflash
from decode.kinds.dflash.training import (  # the same as a DFlash draft's
    block_anchors,
    cache_teacher,
    decoding_vocab,
    generation_recorder,
    load_draft,
    logits_loss,
    served,
    trained_positions,
)
from decode.kinds.dspark import (
    TRAITS,  # noqa: F401  (the kind's facts: distill.kinds.interface.Kind)
    decoding,
)
from decode.kinds.eagle3 import train_step
from decode.kinds.peagle.training import mask_token_id
from distill.config import DistillConfig, Recipe
from distill.kinds.interface import StepLoss, check_mask_token_id, config_vocab

CONFIDENCE_WEIGHT = 1.0  # the confidence head's BCE next to the block loss (speculators' confidence_head_alpha)

__all__ = [
    "Blocks",
    "block_loss",
    "build_draft",
    "cache_teacher",
    "check_inputs",
    "confidence_loss",
    "decoding_vocab",
    "generation_recorder",
    "load_draft",
    "loss_step",
    "save_checkpoint",
    "served",
]


class Blocks(dflash.Blocks):
    """The training loop's model: its forward gives every anchor's block logits and confidence logits."""

    def forward(
        self, ids: torch.Tensor, features: torch.Tensor, valid: torch.Tensor, anchors: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.draft.block_outputs(ids, features, valid, anchors)


def check_inputs(recipe: Recipe, target: str | None, target_config: Callable[[], Any]) -> None:
    """draft.model, when given, must be a DSpark folder (to continue); the target as a DFlash draft's;
    draft.mask_token_id, when set, an id of the target's vocabulary.

    Raises:
        ValueError: one line naming the recipe key and the fix.
    """
    if recipe.draft.model and not decoding.is_dspark_folder(recipe.draft.model):
        raise ValueError(
            f"draft.model {recipe.draft.model!r} is not a DSpark draft folder (config.json with "
            "speculators_model_type dspark): leave draft.model empty to build the draft from the target"
        )
    dflash.check_target(recipe, target, target_config)
    if target is not None:
        check_mask_token_id(recipe.draft.mask_token_id, config_vocab(target_config()), "the target's")


def build_draft(
    recipe: Recipe,
    target: nn.Module,
    source: Any,
    train_prompts: Sequence,
    vocab_size: int,
    teachers: train_step.TargetCache | None,
    resume_from: Path | None,
    is_main: bool,
) -> Blocks:
    """The draft to train, in float32: the newest checkpoint's (--resume), draft.model's (a DSpark folder, its
    heads as saved), or a fresh one (:func:`decode.kinds.dspark.decoding.build` with the recipe's draft keys)."""
    start = resume_from if resume_from is not None and decoding.is_dspark_folder(resume_from) else None
    if start is None and recipe.draft.model:
        start = Path(recipe.draft.model)
    if start is not None:
        draft = decoding.load(start, target, confidence_min=recipe.draft.confidence_min).float()
        started = f"continued from {start}"
    else:
        layers = int(text_config(target).num_hidden_layers)
        draft = decoding.build(
            target, dflash.planned_layer_ids(recipe, layers), num_layers=recipe.draft.num_layers,
            block_size=recipe.draft.block_size, mask_token_id=mask_token_id(recipe, vocab_size),
            markov_rank=recipe.draft.markov_rank or decoding.DEFAULT_RANK, confidence_min=recipe.draft.confidence_min,
        )  # fmt: skip
        started = "fresh"
    if is_main:
        cut = f"confidence cut {draft.confidence_min:g}" if draft.confidence_head is not None else "no confidence head"
        print(
            f"dspark draft: {draft.config.num_hidden_layers} layer(s) over target layers {draft.layer_ids}, block of "
            f"{draft.block_size} tokens per forward, Markov rank {draft.markov_rank}, {cut} ({started})"
        )
    if teachers is not None and draft.aux_layers != dflash.recorded_layers(recipe, target):
        teachers.clear()  # draft.model's draft reads other layers than those kept while generating
    return Blocks(draft)


def confidence_loss(
    logits: torch.Tensor,
    confidence: torch.Tensor,
    anchors: torch.Tensor,
    chosen: torch.Tensor,
    side: train_step.TargetSide,
    batch: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, dict[str, float]]:
    """The confidence head's binary cross-entropy: its logit at block position k (``confidence`` [B, N, K + 1])
    against whether the argmax of ``logits`` [B, N, K + 1, V] there is the target's token, over the trained
    positions of ``chosen`` anchors whose earlier block positions all matched; ``train/conf_loss`` and
    ``train/conf_gap`` (mean predicted minus mean actual acceptance)."""
    width = side.top.shape[1]
    matched = torch.ones_like(chosen)
    picked, wanted = [], []
    for k in range(1, logits.shape[2]):
        with torch.no_grad():
            same = logits[:, :, k].argmax(-1) == side.top.gather(1, (anchors + k).clamp(max=width - 1))
        use = chosen & trained_positions(batch, anchors, k) & matched
        picked.append(confidence[:, :, k][use])
        wanted.append(same[use].float())
        matched = matched & same
    scores, truth = torch.cat(picked), torch.cat(wanted)
    if scores.numel() == 0:
        return confidence.sum() * 0.0, {}
    loss = F.binary_cross_entropy_with_logits(scores, truth)
    gap = float(scores.detach().sigmoid().mean() - truth.mean())
    return loss, {"train/conf_loss": float(loss.detach()), "train/conf_gap": gap}


def block_loss(
    model: nn.Module,
    side: train_step.TargetSide,
    batch: dict[str, torch.Tensor],
    cfg: DistillConfig,
    seed: int = 0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DFlash's block loss (:func:`decode.kinds.dflash.training.logits_loss`) of the Markov-biased logits, plus
    :data:`CONFIDENCE_WEIGHT` x :func:`confidence_loss` when the draft has a confidence head."""
    anchors, chosen = block_anchors(batch, cfg, seed)
    logits, confidence = model(batch["input_ids"], side.features, batch["attention_mask"].bool(), anchors)
    loss, stats = logits_loss(logits, anchors, chosen, side, batch, cfg)
    if confidence is None:
        return loss, stats
    bce, more = confidence_loss(logits, confidence, anchors, chosen, side, batch)
    return loss + CONFIDENCE_WEIGHT * bce, {**stats, **more}


def loss_step(
    accelerator: Any,
    draft: nn.Module,
    target: nn.Module,
    recipe: Recipe,
    vocab_size: int,
    teachers: train_step.TargetCache | None,
    draft_vocab: list[int] | None,
) -> Callable[[dict[str, torch.Tensor], list, bool], StepLoss]:
    """DFlash's step (:func:`decode.kinds.dflash.training.loss_step`) with :func:`block_loss`."""
    return dflash.block_step(accelerator, draft, target, recipe, teachers, block_loss)


def save_checkpoint(
    draft: nn.Module, folder: Path, tokenizer: Any, draft_vocab: tuple | None, recipe: Recipe, result: dict
) -> None:
    """The served format (config.json + model.safetensors, speculators' dspark layout) and the target's
    tokenizer."""
    decoding.save(served(draft), folder, target_name=recipe.target.model)
    tokenizer.save_pretrained(folder)
