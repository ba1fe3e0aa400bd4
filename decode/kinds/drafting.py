"""What every kind's drafter shares with the decoder: the verify pass it reads (:class:`Verified`) and the
validity mask of tokens that are all real (:func:`all_real`). A leaf module: the kinds' decoding modules and the
decoder's loops import it without going through a kind."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Verified:
    """One verify pass, as every kind's ``update`` sees it.

    ids [B, C]: what the target was fed (its pending tokens, then the g draft tokens); valid [B, C] or None (all
    real); draft_tokens [B, g]; accepted [B] and acc_list: accepted draft tokens per row; nxt [B]: the token the
    round ends with (correction or bonus); features [B, C, F]: the target's aux hidden states of the fed
    positions (kinds that asked for them), else None.
    """

    ids: torch.Tensor
    valid: torch.Tensor | None
    draft_tokens: torch.Tensor
    accepted: torch.Tensor
    acc_list: list[int]
    nxt: torch.Tensor
    features: torch.Tensor | None = None


def all_real(ids: torch.Tensor) -> torch.Tensor:
    """A validity mask [same shape as ``ids``] marking every token real (no padding)."""
    return torch.ones_like(ids, dtype=torch.bool)
