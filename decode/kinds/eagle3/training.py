"""Training an EAGLE-3 head (`draft.kind: eagle3`): a one-layer head over three of the target's hidden layers.

There is no draft LM to load: the head is built from the target once the target's continuations are generated,
because its draft vocabulary is counted on them (or started from an EAGLE-3 head folder in draft.model, or from
the newest checkpoint on --resume). Each step feeds it the target's hidden states and logits of the batch
(``decode.kinds.eagle3.train_step.step_loss``, which holds the numerics); it trains as an :class:`Unrolled` module
and is evaluated and saved as the head itself, in the layout vLLM and SGLang load (decoding side:
``decode.kinds.eagle3``). It needs the target's states to draft, so it neither speeds up the target's rollouts
nor runs in HF assisted generation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from decode.kinds.eagle3 import (
    TRAITS,  # noqa: F401  (the kind's facts: distill.kinds.interface.Kind)
    decoding,
    train_step,
)
from decode.kinds.eagle3 import formats as eagle3_formats
from distill import models
from distill.config import Recipe
from distill.data.prompts import draft_vocabulary
from distill.kinds.interface import StepLoss
from distill.training.teacher_cache import sequence_key


def check_inputs(recipe: Recipe, target: str | None, target_config: Callable[[], Any]) -> None:
    """draft.model, when given, must be an EAGLE-3 head folder; the target (``target_config()``, read once
    ``target`` is known) must give per-layer hidden states the head can read.

    Raises:
        ValueError: one line naming the recipe key and the fix.
    """
    if recipe.draft.model:
        check_folder(recipe.draft.model)
    if target is not None:
        config = target_config()
        train_step.check_target_config(config, recipe)
        models.check_hidden_states(config, recipe.target, "draft.kind=eagle3")
        if recipe.draft.model:
            check_head_fits(recipe.draft.model, config, recipe.target.model)


def check_folder(path: str) -> None:
    """draft.kind=eagle3 with a draft.model: it must be an EAGLE-3 head folder (the head to start from)."""
    if not decoding.is_eagle3(path):
        raise ValueError(
            f"draft.model {path!r} is not an EAGLE-3 head folder (config.json with architectures "
            f"[{decoding.ARCHITECTURE}]): leave draft.model empty to build the head from the target, or set "
            "draft.kind=standalone"
        )
    eagle3_formats.check(path)  # its layout and variants, before the run writes anything


def check_head_fits(path: str, target_config: Any, target_name: str) -> None:
    """draft.model, an EAGLE-3 head folder, was made for this target: its config.json against the target's
    (vocabulary, hidden size, aux layer ids; :func:`decode.kinds.eagle3.decoding.folder_config`)."""
    from decode.kinds.eagle3 import decoding as eagle3

    try:
        eagle3.folder_config(path, target_config, target_name)
    except ValueError as err:
        raise ValueError(f"draft.model and target.model: {err}") from None


def load_draft(recipe: Recipe, device: torch.device) -> tuple[None, None]:
    """Nothing to load before the data: :func:`build_draft` builds the head once its draft vocabulary is known."""
    return None, None


def cache_teacher(recipe: Recipe, target: nn.Module) -> train_step.TargetCache | None:
    """distill.cache_teacher: the target's hidden states and logits of each sequence, kept as it generates them."""
    cfg = recipe.distill
    return train_step.TargetCache(target, cfg.temperature, cfg.cache_teacher_gb) if cfg.cache_teacher else None


def generation_recorder(
    teachers: train_step.TargetCache | None, recipe: Recipe, target: nn.Module
) -> train_step.GenerationRecorder | None:
    """What fills ``teachers`` while the target generates the continuations (the aux layers a head built from the
    target reads)."""
    if teachers is None:
        return None
    return train_step.GenerationRecorder(teachers, train_step.planned_aux_layers(recipe, target))


def build_draft(
    recipe: Recipe,
    target: nn.Module,
    source: Any,
    train_prompts: Sequence,
    vocab_size: int,
    teachers: train_step.TargetCache | None,
    resume_from: Path | None,
    is_main: bool,
) -> train_step.Unrolled:
    """The head to train, over the draft.vocab_subset tokens most frequent in the continuations ``source`` holds.

    ``resume_from`` (--resume): the newest checkpoint, whose head (with its own vocabulary) is taken; a resume-only
    checkpoint holds no head, and the vocabulary counted here, on the same cached continuations, is the one the
    run started with.
    """
    size = train_step.vocab_size(recipe.draft.vocab_subset, vocab_size)
    cached = source.cache.completions() if source.cache is not None else []
    ids, where = draft_vocabulary(size, train_prompts, cached, vocab_size, source.eos_token_id)
    head = train_step.initial_head(recipe, target, ids, resume_from)
    if is_main:
        size, layers = len(head.draft_ids), head.aux_layers
        if head.draft_ids.tolist() != list(ids):
            where = "the loaded head's own"  # draft.model's or a checkpoint's head keeps the vocabulary it has
        print(f"eagle3 head: draft vocabulary of {size} of {vocab_size} tokens ({where}), aux layers {layers}")
    if teachers is not None and head.aux_layers != train_step.planned_aux_layers(recipe, target):
        teachers.clear()  # draft.model's head reads other layers than those kept while generating
    return train_step.Unrolled(head)


def decoding_vocab(
    recipe: Recipe, source: Any, train_prompts: Sequence, vocab_size: int, state: Any, is_main: bool
) -> None:
    """None: the head carries its own draft vocabulary (``head.draft_ids``)."""
    return None


def loss_step(
    accelerator: Any,
    draft: nn.Module,
    target: nn.Module,
    recipe: Recipe,
    vocab_size: int,
    teachers: train_step.TargetCache | None,
    draft_vocab: list[int] | None,
) -> Callable[[dict[str, torch.Tensor], list, bool], StepLoss]:
    """The step of one micro-batch: the target's hidden states and logits, the head unrolled over them
    (``train_step.step_loss``); its stats are train/loss_k and train/acc_k per unrolled step k."""

    def step(batch: dict[str, torch.Tensor], pairs: list, on_policy: bool) -> StepLoss:
        keys = None if teachers is None else [sequence_key(*p) for p in pairs]
        loss, unrolled = train_step.step_loss(draft, target, batch, recipe.distill, cache=teachers, keys=keys)
        agreement = unrolled.get("train/acc_0", 0.0)
        scored = int(unrolled.pop("train/teacher_forwards"))
        return StepLoss(loss, agreement, scored, unrolled)

    return step


def served(model: nn.Module) -> decoding.Eagle3Head:
    """The head itself, not its training unroll."""
    return train_step.head_of(model)


def save_checkpoint(
    draft: nn.Module, folder: Path, tokenizer: Any, draft_vocab: tuple | None, recipe: Recipe, result: dict
) -> None:
    """The served format (config.json + model.safetensors) and the target's tokenizer, which engines and the
    model card read; the speculators keys name the recipe's target and the gamma `result` (the checkpoint's
    evaluation) measured, so that `vllm serve best/` runs them with no flags."""
    from decode.kinds.eagle3.formats import verifier_name
    from decode.metrics import best_gamma

    verifier = verifier_name(recipe.target.model)
    decoding.save(
        draft, folder, target_name=recipe.target.model, verifier=verifier, speculative_tokens=best_gamma(result)
    )
    tokenizer.save_pretrained(folder)
