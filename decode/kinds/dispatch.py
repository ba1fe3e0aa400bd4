"""What the decoder asks of a loaded draft, by its kind: its drafter, its forwards' cost, its block.

A kind's decoding module (``decode.kinds.<kind>.decoding``) gives the decoder (``decode.speculative``) a *drafter*,
the draft's state during one decoding call:

    drafter.aux_layers                  target layers whose hidden states the drafter needs (None: none)
    drafter.propose(controller, cap, proc, greedy, generator) -> (tokens [B, g], q [B, g, V] or None)
    drafter.update(verified)            after the target's verify pass: what was fed, accepted and its features
    drafter.select(rows)                keep only these batch rows
    drafter.forwards                    draft forwards run

A decoding module gives ``drafter(draft, batch, vocab, input_ids, prompt_mask)``, ``cost_stream(model, batch)``,
``block_of(draft)`` (None for a chain) and ``check_draft_length(draft, gamma)``; whether it drafts a whole block per
forward is its trait (``decode.kinds.traits``). The accept/reject rule, the bench and best/ selection stay the same
for every kind.
"""

from __future__ import annotations

import torch
from torch import nn

from decode import kinds
from decode.kinds.pard import decoding as pard
from decode.kinds.standalone import decoding as standalone
from decode.kinds.standalone.decoding import Verified

# each kind's decoding module, in the registry's order (decode.kinds: a new kind is one line there)
MODULES = {name: kinds.decoding(name) for name in kinds.names()}
BLOCK_KINDS = tuple(name for name, t in kinds.KINDS.items() if t.block)  # a whole block per draft forward

__all__ = [
    "BLOCK_KINDS",
    "MODULES",
    "Verified",
    "capped_draft_length",
    "check_draft_length",
    "cost_stream",
    "drafter_for",
    "forwards_per_round",
    "kind_of",
]


def kind_of(draft: nn.Module) -> str:
    """The kind of a loaded draft: its ``kind`` attribute (an EAGLE-3, P-EAGLE or DFlash draft has one), ``pard``
    for a draft LM whose config has a ``pard_token``, else ``standalone``."""
    return getattr(draft, "kind", None) or (pard.NAME if pard.is_pard(draft) else standalone.NAME)


def drafter_for(draft: nn.Module, batch: int, vocab: int, input_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """The drafter of ``draft``'s kind for one decoding call over ``input_ids`` [B, P] (``prompt_mask`` [B, P])."""
    return MODULES[kind_of(draft)].drafter(draft, batch, vocab, input_ids, prompt_mask)


def cost_stream(model: nn.Module, batch: int):
    """What ``decode.metrics.ForwardCostMeter`` times a model's KV-cached forwards through, by kind."""
    return MODULES[kind_of(model)].cost_stream(model, batch)


def forwards_per_round(draft: nn.Module, gamma: float) -> float:
    """Draft forwards a round of ``gamma`` drafted tokens costs: one for a block draft, gamma for a chain."""
    return 1.0 if kind_of(draft) in BLOCK_KINDS else gamma


def check_draft_length(draft: nn.Module, gamma: int) -> None:
    """ValueError when a fixed ``gamma`` is above the block a block draft was trained for (a chain: no limit)."""
    MODULES[kind_of(draft)].check_draft_length(draft, gamma)


def capped_draft_length(draft: nn.Module, gamma: int | str) -> int | str:
    """``gamma`` capped at a block draft's trained block (for loops whose draft length is a speed setting only,
    as the target's rollouts); ``auto`` and chains as they are."""
    block = MODULES[kind_of(draft)].block_of(draft)
    if not isinstance(gamma, int) or block is None:
        return gamma
    return min(gamma, int(block))
