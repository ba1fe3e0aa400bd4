"""Training a DFlash draft (`draft.kind: dflash`): a few layers that fill draft.block_size tokens in one forward.

The draft is built from the target (draft.num_layers layers reading the outputs of target layers draft.aux_layers,
DFlash's ``target_layer_ids``), or continued from a DFlash folder in draft.model, or from the newest checkpoint on
--resume. Each step reads the target's hidden states and logits of the batch (one target forward, or
distill.cache_teacher's kept rows, as for an EAGLE-3 head: ``decode.kinds.eagle3.train_step.target_side``) and trains
every block position of every anchor in one pass (``decode.kinds.dflash.decoding.DFlashDraft.block_logits``): the block
at anchor i holds x_{i+1} and draft.block_size mask tokens and sees the target's features at positions <= i; its
position k is compared with the target's distribution at i + k, the one over token i + k + 1, weighted
distill.step_weight^k. It is saved in the layout vLLM's ``method: dflash`` loads (decoding side:
``decode.kinds.dflash.decoding``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from decode.compat import text_config
from decode.kinds.dflash import (
    TRAITS,  # noqa: F401  (the kind's facts: distill.kinds.interface.Kind)
    decoding,
)
from decode.kinds.eagle3 import decoding as eagle3
from decode.kinds.eagle3 import train_step
from decode.kinds.eagle3.training import cache_teacher, decoding_vocab, load_draft  # the same as an EAGLE-3 head's
from decode.kinds.peagle.training import mask_token_id
from distill import models
from distill.config import DistillConfig, Recipe
from distill.kinds.interface import StepLoss, check_mask_token_id, config_vocab
from distill.training import losses
from distill.training.anchors import pick_anchors, step_seed
from distill.training.teacher_cache import sequence_key

__all__ = [
    "Blocks",
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
]


class Blocks(nn.Module):
    """The draft as the training loop's model: its forward is the training pass over every anchor's block.

    accelerate prepares this module, so DDP and autocast wrap the forward training calls; ``draft`` is the
    :class:`decode.kinds.dflash.decoding.DFlashDraft` itself, which evaluation and checkpoints use.
    """

    def __init__(self, draft: decoding.DFlashDraft) -> None:
        super().__init__()
        self.draft = draft

    def forward(
        self, ids: torch.Tensor, features: torch.Tensor, valid: torch.Tensor, anchors: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.draft.block_logits(ids, features, valid, anchors)


def served(model: nn.Module) -> decoding.DFlashDraft:
    """The draft itself, not its training wrapper."""
    model = getattr(model, "module", model)
    return model.draft if isinstance(model, Blocks) else model


def planned_layer_ids(recipe: Recipe, num_layers: int) -> list[int]:
    """draft.aux_layers (DFlash's target_layer_ids: j = the output of layer j), else the default, checked against
    a target of ``num_layers`` layers.

    Raises:
        ValueError: one line naming draft.aux_layers and the ids the target has.
    """
    wanted = recipe.draft.aux_layers
    try:
        return decoding.check_layer_ids(
            decoding.default_layer_ids(num_layers) if wanted is None else wanted, num_layers
        )
    except ValueError as err:
        raise ValueError(f"draft.aux_layers: {err}") from None


def check_inputs(recipe: Recipe, target: str | None, target_config: Callable[[], Any]) -> None:
    """draft.model, when given, must be a DFlash folder (to continue) made for this target, of draft.block_size
    and draft.mask_token_id (:func:`check_folder_keeps`); the target must give per-layer hidden states and have the
    layers draft.aux_layers names; draft.mask_token_id, when set, must be an id of its vocabulary.

    Raises:
        ValueError: one line naming the recipe key and the fix.
    """
    folder = recipe.draft.model
    if folder and not decoding.is_dflash_folder(folder):
        raise ValueError(
            f"draft.model {folder!r} is not a DFlash draft folder (config.json with architectures "
            f"[{decoding.ARCHITECTURE}] and dflash_config): leave draft.model empty to build the draft from the target"
        )
    if folder:
        check_folder_keeps(folder, recipe.draft.block_size, recipe.draft.mask_token_id)
    check_target(recipe, target, target_config)
    if target is not None:
        if folder:
            check_folder_fits(folder, target_config(), recipe.target.model)
        check_mask_token_id(recipe.draft.mask_token_id, config_vocab(target_config()), "the target's")


def check_folder_keeps(path: str, block_size: int, mask_token_id: int | None) -> None:
    """A DFlash draft keeps the block and the mask token it was trained with (its served config), so
    draft.block_size must be its block, and draft.mask_token_id, when set, its mask token."""
    block = decoding.folder_block(path)
    if block is not None and block != block_size:
        raise ValueError(
            f"draft.block_size={block_size}, and draft.model {path!r} is a DFlash draft of block {block}, which it "
            f"keeps: set draft.block_size={block} to continue it, or leave draft.model empty to build a draft of "
            f"{block_size}"
        )
    own = (decoding.folder_config_dict(path) or {}).get("dflash_config", {}).get("mask_token_id")
    if mask_token_id is not None and own is not None and int(own) != mask_token_id:
        raise ValueError(
            f"draft.mask_token_id={mask_token_id}, and draft.model {path!r} is a DFlash draft with mask token {own}, "
            f"which it keeps: set draft.mask_token_id={own} (or null) to continue it, or leave draft.model empty to "
            f"build a draft with mask token {mask_token_id}"
        )


def check_folder_fits(path: str, target_config: Any, target_name: str) -> None:
    """draft.model, a DFlash folder, was made for this target: its config.json against the target's (vocabulary,
    hidden size, target_layer_ids; :func:`decode.kinds.dflash.decoding.fitted_config`)."""
    try:
        decoding.fitted_config(decoding.folder_config_dict(path), path, target_config, target_name)
    except ValueError as err:
        raise ValueError(f"draft.model and target.model: {err}") from None


def check_target(recipe: Recipe, target: str | None, target_config: Callable[[], Any]) -> None:
    """The target gives per-layer hidden states and has the layers draft.aux_layers names (any block draft over
    the target's states: the message names recipe.draft.kind).

    Raises:
        ValueError: one line naming the recipe key and the fix.
    """
    if target is not None:
        config = target_config()
        models.check_hidden_states(config, recipe.target, f"draft.kind={recipe.draft.kind}")
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        layers = getattr(text, "num_hidden_layers", None)
        if isinstance(layers, int):
            planned_layer_ids(recipe, layers)


def generation_recorder(
    teachers: train_step.TargetCache | None, recipe: Recipe, target: nn.Module
) -> train_step.GenerationRecorder | None:
    """What fills ``teachers`` while the target generates the continuations (the layers the draft reads)."""
    if teachers is None:
        return None
    return train_step.GenerationRecorder(teachers, recorded_layers(recipe, target))


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
    """The draft to train, in float32: the newest checkpoint's (--resume), draft.model's (a DFlash folder), or a
    fresh one of draft.num_layers layers, draft.block_size and the mask token (:func:`mask_token_id`)."""
    start = resume_from if resume_from is not None and decoding.is_dflash_folder(resume_from) else None
    if start is None and recipe.draft.model:
        start = Path(recipe.draft.model)
    if start is not None:
        draft = decoding.load(start, target).float()
        started = f"continued from {start}"
    else:
        layers = int(text_config(target).num_hidden_layers)
        draft = decoding.build(
            target, planned_layer_ids(recipe, layers), num_layers=recipe.draft.num_layers,
            block_size=recipe.draft.block_size, mask_token_id=mask_token_id(recipe, vocab_size),
        )  # fmt: skip
        started = "fresh"
    if is_main:
        print(
            f"dflash draft: {draft.config.num_hidden_layers} layer(s) over target layers {draft.layer_ids}, block of "
            f"{draft.block_size} tokens per forward, mask token {draft.mask_token_id} ({started})"
        )
    if teachers is not None and draft.aux_layers != recorded_layers(recipe, target):
        teachers.clear()  # draft.model's draft reads other layers than those kept while generating
    return Blocks(draft)


def recorded_layers(recipe: Recipe, target: nn.Module) -> list[int]:
    """The hidden_states indices kept while the target generates (:func:`generation_recorder`)."""
    layers = int(text_config(target).num_hidden_layers)
    return [j + 1 for j in planned_layer_ids(recipe, layers)]


def block_loss(
    model: nn.Module,
    side: train_step.TargetSide,
    batch: dict[str, torch.Tensor],
    cfg: DistillConfig,
    seed: int = 0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted loss of one micro-batch given the target's side (features, log p over the whole vocabulary
    and the empty tail bucket): sum_k w^k loss_k / sum_k w^k over block positions k = 1..K, and per position
    ``train/loss_k`` and ``train/acc_k`` (k counted from 0 for the first drafted token, as the other kinds log).

    Block position k at anchor i is compared with the target's row i + k (the distribution over token i + k + 1)
    where both are real positions and the batch's loss_mask keeps row i + k. The anchors are every position, or
    with ``cfg.anchors`` N, N drawn per sequence among those whose first block position is trained.
    """
    anchors, chosen = block_anchors(batch, cfg, seed)
    logits = model(batch["input_ids"], side.features, batch["attention_mask"].bool(), anchors)  # [B, N, K + 1, V]
    return logits_loss(logits, anchors, chosen, side, batch, cfg)


def block_anchors(batch: dict[str, torch.Tensor], cfg: DistillConfig, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_loss`'s anchors [B, N] and which of them are chosen [B, N] bool (``seed``:
    :func:`distill.training.anchors.anchor_seed`)."""
    valid = batch["attention_mask"].bool()
    width = valid.shape[1]
    if cfg.anchors:
        trainable = decoding.block_mask(valid, 1) & eagle3.shift_left(batch["loss_mask"], 1).bool()
        return pick_anchors(trainable, cfg.anchors, seed)
    anchors = torch.arange(width, device=valid.device).expand(valid.shape[0], width)
    return anchors, torch.ones_like(anchors, dtype=torch.bool)


def trained_positions(batch: dict[str, torch.Tensor], anchors: torch.Tensor, k: int) -> torch.Tensor:
    """[B, N] bool: the anchors whose block position k is trained (both positions real, loss_mask keeps i + k)."""
    valid = batch["attention_mask"].bool()
    trained = decoding.block_mask(valid, k) & eagle3.shift_left(batch["loss_mask"].long(), k).bool()
    return trained.gather(1, anchors)


def logits_loss(
    logits: torch.Tensor,
    anchors: torch.Tensor,
    chosen: torch.Tensor,
    side: train_step.TargetSide,
    batch: dict[str, torch.Tensor],
    cfg: DistillConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """:func:`block_loss` of the blocks' logits [B, N, K + 1, V] at ``anchors`` (``chosen`` of them)."""
    width = batch["attention_mask"].shape[1]
    log_p = side.log_p.flatten(0, 1)  # [B * S, V + 1]
    total, weights, stats = None, 0.0, {}
    for k in range(1, logits.shape[2]):
        mask = chosen & trained_positions(batch, anchors, k)
        if not bool(mask.any()):
            continue  # sequences too short for this position
        rows_b, rows_n = mask.nonzero(as_tuple=True)
        teacher_rows = rows_b * width + anchors[rows_b, rows_n] + k
        student = logits[rows_b, rows_n, k]
        log_pt = log_p[teacher_rows]
        log_ps = train_step.student_log_probs(student, log_pt[:, -1:], cfg.temperature)
        loss_k = losses.divergence(log_ps, log_pt, cfg.loss, cfg.beta).mean()
        weight = cfg.step_weight ** (k - 1)
        total = weight * loss_k if total is None else total + weight * loss_k
        weights += weight
        with torch.no_grad():
            same = student.argmax(-1) == side.top.flatten()[teacher_rows]
        stats[f"train/loss_{k - 1}"] = float(loss_k.detach())
        stats[f"train/acc_{k - 1}"] = float(same.float().mean())
    if total is None:
        raise ValueError(
            "mask selects no completion tokens for any block position: every sequence is shorter than 2 tokens past "
            "its prompt; raise distill.max_new_tokens"
        )
    return total / weights, stats


def loss_step(
    accelerator: Any,
    draft: nn.Module,
    target: nn.Module,
    recipe: Recipe,
    vocab_size: int,
    teachers: train_step.TargetCache | None,
    draft_vocab: list[int] | None,
) -> Callable[[dict[str, torch.Tensor], list, bool], StepLoss]:
    """The step of one micro-batch: the target's side (its hidden states at the draft's layers and its
    distribution, from one forward or distill.cache_teacher), then every block of the batch in one pass."""
    return block_step(accelerator, draft, target, recipe, teachers, block_loss)


def block_step(
    accelerator: Any,
    draft: nn.Module,
    target: nn.Module,
    recipe: Recipe,
    teachers: train_step.TargetCache | None,
    block_loss_of: Callable[..., tuple[torch.Tensor, dict[str, float]]],
) -> Callable[[dict[str, torch.Tensor], list, bool], StepLoss]:
    """:func:`loss_step` with the loss ``block_loss_of(model, side, batch, cfg, seed)`` (a block draft with heads
    of its own; ``seed``: :func:`distill.training.anchors.anchor_seed`)."""

    def step(batch: dict[str, torch.Tensor], pairs: list, on_policy: bool) -> StepLoss:
        inner = served(draft)
        keys = None if teachers is None else [sequence_key(*p) for p in pairs]
        side = train_step.target_side(target, batch, inner, recipe.distill.temperature, teachers, keys)
        value, stats = block_loss_of(draft, side, batch, recipe.distill, step_seed(accelerator, recipe.train.seed))
        return StepLoss(value, stats.get("train/acc_0", 0.0), side.computed, stats)

    return step


def save_checkpoint(
    draft: nn.Module, folder: Path, tokenizer: Any, draft_vocab: tuple | None, recipe: Recipe, result: dict
) -> None:
    """The served format (config.json + model.safetensors, vLLM's DFlash layout) and the target's tokenizer; the
    README's launch line drafts the gamma ``result`` (the checkpoint's evaluation) measured, capped at the block."""
    from decode.metrics import best_gamma

    decoding.save(served(draft), folder, target_name=recipe.target.model, gamma=best_gamma(result))
    tokenizer.save_pretrained(folder)
