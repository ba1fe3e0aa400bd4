"""Training a standalone draft (`draft.kind: standalone`): a small causal LM with the target's tokenizer.

It is loaded from draft.model (a sibling, a pretrained small LM, or `draft.init: truncate`'s cut of the target)
before the data; each step runs it on the batch's tokens and compares its logits with the target's
(:func:`step_loss`). As a speculative draft it speeds up the target's own rollouts, HF assisted generation runs
it, and a checkpoint is an ordinary HF checkpoint (decoding side: ``decode.kinds.standalone.decoding``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from decode.kinds.standalone import TRAITS  # noqa: F401  (the kind's facts: distill.kinds.interface.Kind)
from distill import models
from distill.config import Recipe
from distill.data.prompts import draft_vocabulary, vocabulary_text
from distill.kinds.interface import StepLoss
from distill.training import losses, subset_loss, teacher_cache


def check_inputs(recipe: Recipe, target: str | None, target_config: Callable[[], Any]) -> None:
    """Nothing of its own: distill.training.preflight refuses a draft.model folder saved as another kind
    (``TRAITS.folder_kinds``) and checks its vocabulary against the target's, as for any draft LM."""


def load_draft(recipe: Recipe, device: torch.device) -> tuple[nn.Module, Any]:
    """draft.model loaded for training, and its tokenizer."""
    draft = models.load_draft(recipe.draft, device=device, gradient_checkpointing=recipe.train.gradient_checkpointing)
    return draft, models.load_tokenizer(recipe.draft.model, recipe.draft, key="draft.model")


def build_draft(
    recipe: Recipe,
    target: nn.Module,
    source: Any,
    train_prompts: Sequence,
    vocab_size: int,
    teachers: Any,
    resume_from: Path | None,
    is_main: bool,
) -> nn.Module:
    """Never called: a standalone draft is loaded (:func:`load_draft`), not built from the target."""
    raise TypeError("a standalone draft is loaded from draft.model (load_draft), not built from the target")


def cache_teacher(recipe: Recipe, target: nn.Module) -> teacher_cache.TeacherCache | None:
    """distill.cache_teacher: the target's top-k rows of sequences that come back in later epochs."""
    cfg = recipe.distill
    return teacher_cache.TeacherCache(cfg.top_k, cfg.temperature, cfg.cache_teacher_gb) if cfg.cache_teacher else None


def generation_recorder(teachers: Any, recipe: Recipe, target: nn.Module) -> None:
    """Nothing is kept while the target generates: the top-k rows are taken in the steps."""
    return None


def decoding_vocab(
    recipe: Recipe, source: Any, train_prompts: Sequence, vocab_size: int, state: Any, is_main: bool
) -> list[int] | None:
    """draft.vocab_subset: the ids draftsmith's decoder drafts from (``state.draft_vocab`` saves them with every
    checkpoint), or None for the whole vocabulary."""
    if not recipe.draft.vocab_subset:
        return None
    cached = source.cache.completions() if source.cache is not None else []  # read once for both uses
    size = recipe.draft.vocab_subset
    draft_vocab, where = draft_vocabulary(size, train_prompts, cached, vocab_size, source.eos_token_id)
    state.draft_vocab = (draft_vocab, vocab_size, where, vocabulary_text(train_prompts, cached)[0])
    if is_main:
        print(f"draft vocabulary: the {len(draft_vocab)} of {vocab_size} tokens most frequent in the {where}")
    return draft_vocab


def loss_step(
    accelerator: Any,
    draft: nn.Module,
    target: nn.Module,
    recipe: Recipe,
    vocab_size: int,
    teachers: teacher_cache.TeacherCache | None,
    draft_vocab: list[int] | None,
) -> Callable[[dict[str, torch.Tensor], list, bool], StepLoss]:
    """The step of one micro-batch: the prepared ``draft`` on its tokens, then :func:`step_loss`.

    distill.loss_vocab=subset: the draft's head and the loss cover the draft vocabulary alone."""
    trained, subset_head, subset_position = accelerator.unwrap_model(draft), None, None
    if recipe.distill.loss_vocab == "subset":
        subset_head = subset_loss.restricted(trained, draft_vocab)
        subset_position = subset_loss.index_of(draft_vocab, vocab_size, device=accelerator.device)

    def step(batch: dict[str, torch.Tensor], pairs: list, on_policy: bool) -> StepLoss:
        with training_head(trained, subset_head):
            student = draft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        loss, agreement, scored = step_loss(
            student.logits, batch, pairs, target, recipe, vocab_size, teachers, on_policy, position=subset_position
        )
        return StepLoss(loss, agreement, scored)

    return step


def served(model: nn.Module) -> nn.Module:
    """The draft is served as it trains."""
    return model


def save_checkpoint(
    draft: nn.Module, folder: Path, tokenizer: Any, draft_vocab: tuple | None, recipe: Recipe, result: dict
) -> None:
    """An HF checkpoint (a LoRA draft: its adapter); with draft.vocab_subset, its draft_vocab.json.

    ``draft_vocab``: ``RunState.draft_vocab``, (ids, vocabulary size, where they came from, the text counted)."""
    from decode.draft_vocab import save_ids, with_masked_head

    if draft_vocab is None:
        models.save_draft(draft, folder, tokenizer)
        return
    ids, vocab, source, text = draft_vocab
    # Trained over its draft vocabulary: the head's other rows are stale, so engines that run the full head get
    # them masked (decode.draft_vocab.with_masked_head); the training draft keeps its tied head.
    saved, head = draft, None
    if recipe.distill.loss_vocab == "subset":
        saved, head = with_masked_head(draft, ids, text)
    models.save_draft(saved, folder, tokenizer)
    save_ids(folder, ids, vocab=vocab, source=source, saved_head=head)


# ---------------------------------------------------------------- the loss


def step_loss(
    student: torch.Tensor,
    batch: dict[str, torch.Tensor],
    pairs: list,
    target: torch.nn.Module,
    recipe: Recipe,
    vocab_size: int | None,
    teachers,
    on_policy: bool,
    position: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float, int]:
    """The recipe's divergence on one micro-batch, the draft's top-1 agreement with the target there, and how many
    of its sequences the target scored: all of them, unless `teachers` (distill.cache_teacher) kept their top-k
    rows from an earlier epoch; on-policy sequences are scored but not kept (they never come back).

    `position` (distill.loss_vocab=subset): the student's logits are over the draft vocabulary (plus its absent
    column) and the teacher's top-k rows are mapped there (distill.training.subset_loss.restrict_top_k)."""
    cfg, mask = recipe.distill, batch["loss_mask"]
    keep = not on_policy
    if position is not None and teachers is None:  # the top-k rows are computed for this step only
        teachers, keep = teacher_cache.TeacherCache(cfg.top_k, cfg.temperature), False
    if teachers is None:
        with torch.no_grad():
            teacher = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = losses.distill_loss(
            student, teacher, mask, loss=cfg.loss, beta=cfg.beta, temperature=cfg.temperature, top_k=cfg.top_k,
            vocab_size=vocab_size,
        )  # fmt: skip
        agreement = losses.top1_agreement(student.detach(), teacher, mask, vocab_size=vocab_size)
        return loss, float(agreement), len(pairs)
    keys = [teacher_cache.sequence_key(p, c) for p, c in pairs]
    top_ids, log_pt, scored = teacher_cache.teacher_rows(
        teachers, keys, batch, target, keep=keep, vocab_size=vocab_size
    )
    width = vocab_size
    if position is not None:
        top_ids, log_pt = subset_loss.restrict_top_k(top_ids, log_pt, position)
        width = None  # the restricted logits are all compared
    loss = losses.distill_loss_top_k(
        student, mask, top_ids, log_pt, loss=cfg.loss, beta=cfg.beta, temperature=cfg.temperature,
        vocab_size=width,
    )  # fmt: skip
    agreement = teacher_cache.top1_agreement_top_k(student.detach(), mask, top_ids, width)
    return loss, float(agreement), scored


def training_head(model: torch.nn.Module, head: torch.nn.Module | None) -> contextlib.AbstractContextManager:
    """distill.loss_vocab=subset: the draft's restricted `head` for the training forward; else nothing."""
    return subset_loss.swapped_head(model, head) if head is not None else contextlib.nullcontext()
