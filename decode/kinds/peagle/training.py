"""Training a P-EAGLE head (`draft.kind: peagle`): an EAGLE-3 head that drafts draft.block_size tokens in one forward.

Everything but the head's block is the EAGLE-3 kind's (decode.kinds.eagle3.training): the head is built from the target
once the target's continuations are generated (or started from an EAGLE-3 or P-EAGLE head folder in draft.model,
or from the newest checkpoint on --resume), each step feeds it the target's hidden states, and it is saved in the
layout vLLM loads. Its head carries a mask token and a learned mask feature (decode.kinds.peagle), and a step
trains all draft.block_size positions of every sequence in one pass: position k of the block reads the mask
inputs, as in decoding, and is compared with the target's distribution k + 1 tokens on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from decode.kinds.eagle3 import train_step
from decode.kinds.eagle3 import training as chain
from decode.kinds.eagle3.training import (  # the same as an EAGLE-3 head's
    cache_teacher,
    decoding_vocab,
    generation_recorder,
    load_draft,
    loss_step,
    save_checkpoint,
    served,
)
from decode.kinds.peagle import (
    TRAITS,  # noqa: F401  (the kind's facts: distill.kinds.interface.Kind)
    decoding,
)
from distill import models
from distill.config import Recipe
from distill.kinds.interface import check_mask_token_id, config_vocab

__all__ = [
    "build_draft",
    "cache_teacher",
    "check_inputs",
    "decoding_vocab",
    "generation_recorder",
    "load_draft",
    "loss_step",
    "mask_token_id",
    "save_checkpoint",
    "served",
]


def check_inputs(recipe: Recipe, target: str | None, target_config: Callable[[], Any]) -> None:
    """An EAGLE-3 head's checks (decode.kinds.eagle3.training.check_inputs), and draft.mask_token_id, when set, an
    id of the target's vocabulary.

    Raises:
        ValueError: one line naming the recipe key and the fix.
    """
    chain.check_inputs(recipe, target, target_config)
    if target is not None and recipe.draft.mask_token_id is not None:
        check_mask_token_id(recipe.draft.mask_token_id, config_vocab(target_config()), "the target's")


def mask_token_id(recipe: Recipe, vocab_size: int) -> int:
    """draft.mask_token_id, or the target tokenizer's mask, pad or unk token, or the vocabulary's last id.

    The token only marks the drafted positions (its embedding is the target's, frozen); the head learns what to
    read there in its mask feature, so any id in the vocabulary works.

    Raises:
        ValueError: draft.mask_token_id outside the target's vocabulary.
    """
    chosen = recipe.draft.mask_token_id
    if chosen is None:
        tokenizer = models.load_tokenizer(recipe.target.model, recipe.target, key="target.model")
        found = (tokenizer.mask_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id)
        chosen = next((int(i) for i in found if i is not None and 0 <= int(i) < vocab_size), vocab_size - 1)
    check_mask_token_id(chosen, vocab_size, "the target's")
    return int(chosen)


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
    """The EAGLE-3 kind's head (its vocabulary, draft.model or checkpoint) made a P-EAGLE head of
    draft.block_size: an EAGLE-3 head gains a fresh mask feature, a P-EAGLE head keeps its own."""
    head = train_step.head_of(
        chain.build_draft(recipe, target, source, train_prompts, vocab_size, teachers, resume_from, is_main)
    )
    mask = head.config.mask_token_id if head.parallel and recipe.draft.mask_token_id is None else None
    mask = mask_token_id(recipe, vocab_size) if mask is None else int(mask)
    started = "its own mask feature" if head.parallel else "a fresh mask feature"
    had = getattr(head.config, "block_size", None) if head.parallel else None
    if had is not None and int(had) != recipe.draft.block_size:
        started += f", trained for a block of {had} until now"  # the recipe's block, said out loud
    head = decoding.with_mask(head, block_size=recipe.draft.block_size, mask_token_id=mask)
    if is_main:
        print(f"peagle head: block of {recipe.draft.block_size} tokens per forward, mask token {mask} ({started})")
    return train_step.Unrolled(head)
