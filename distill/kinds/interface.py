"""The small interface every training-side draft kind provides (``decode.kinds.<kind>.training``; see distill.kinds
for the order of the calls)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from decode.kinds.traits import KindTraits
from distill.config import Recipe


@dataclass
class StepLoss:
    """One micro-batch's training step, as the loop logs it."""

    loss: torch.Tensor  # scalar, carries the gradient
    agreement: float  # the draft's top-1 agreement with the target on the trained positions
    teacher_forwards: int  # sequences the target ran a forward for (the rest came from distill.cache_teacher)
    stats: dict[str, float] = field(default_factory=dict)  # further train/* figures, averaged over micro-batches


@runtime_checkable
class Kind(Protocol):
    """What a kind's module provides (module attributes and functions; see the module docstring for the order)."""

    TRAITS: KindTraits  # the kind's facts, declared once in its folder's __init__.py (decode.kinds.traits)

    def check_inputs(self, recipe: Recipe, target: str | None, target_config: Callable[[], Any]) -> None: ...

    def load_draft(self, recipe: Recipe, device: torch.device) -> tuple[nn.Module | None, Any]: ...

    def cache_teacher(self, recipe: Recipe, target: nn.Module) -> Any: ...

    def generation_recorder(self, teachers: Any, recipe: Recipe, target: nn.Module) -> Any: ...

    def build_draft(
        self,
        recipe: Recipe,
        target: nn.Module,
        source: Any,
        train_prompts: Sequence[Any],
        vocab_size: int,
        teachers: Any,
        resume_from: Path | None,
        is_main: bool,
    ) -> nn.Module: ...

    def decoding_vocab(
        self, recipe: Recipe, source: Any, train_prompts: Sequence[Any], vocab_size: int, state: Any, is_main: bool
    ) -> list[int] | None: ...

    def loss_step(
        self,
        accelerator: Any,
        draft: nn.Module,
        target: nn.Module,
        recipe: Recipe,
        vocab_size: int,
        teachers: Any,
        draft_vocab: list[int] | None,
    ) -> Callable[[dict[str, torch.Tensor], list, bool], StepLoss]: ...

    def served(self, model: nn.Module) -> nn.Module: ...

    def save_checkpoint(
        self, draft: nn.Module, folder: Path, tokenizer: Any, draft_vocab: tuple | None, recipe: Recipe, result: dict
    ) -> None: ...


def config_vocab(config: Any) -> int | None:
    """The output width a model config gives (its text config's ``vocab_size``), or None where it says none."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    return vocab if isinstance(vocab, int) else None


def check_mask_token_id(mask: int | None, vocab_size: int | None, whose: str) -> None:
    """draft.mask_token_id, when set, is an id of the vocabulary of ``vocab_size`` tokens (``whose``: "the target's").

    Raises:
        ValueError: one line naming draft.mask_token_id, the vocabulary and the ids to choose from.
    """
    if mask is None or vocab_size is None or 0 <= mask < vocab_size:
        return
    raise ValueError(
        f"draft.mask_token_id={mask} is outside {whose} vocabulary of {vocab_size} tokens: set an id in "
        f"0..{vocab_size - 1} (or null to pick one)"
    )
