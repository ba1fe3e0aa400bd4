"""Draft kinds: how a draft turns what the target computed into proposals.

A kind is one module: how it is built, what a training step feeds it, how it proposes in the decoder, how it is
saved for the engines that serve it. The decoder (``decode.speculative``) talks to a kind through a *drafter*,
the draft's state during one decoding call:

    drafter.aux_layers                  target layers whose hidden states the drafter needs (None: none)
    drafter.propose(controller, cap, proc, greedy, generator) -> (tokens [B, g], q [B, g, V] or None)
    drafter.update(verified)            after the target's verify pass: what was fed, accepted and its features
    drafter.select(rows)                keep only these batch rows
    drafter.forwards                    draft forwards run

The accept/reject rule, the bench and best/ selection stay the same for every kind.

    standalone   a small causal LM with the target's tokenizer (decode.kinds.standalone)
    eagle3       a one-layer head over three of the target's hidden layers (decode.kinds.eagle3)
    peagle       an EAGLE-3 head that drafts a whole block in one forward (decode.kinds.peagle)
    pard         a standalone draft LM that drafts a whole block in one forward from mask tokens (decode.kinds.pard)
"""

from __future__ import annotations

import torch
from torch import nn

from decode.compat import logits_width
from decode.kinds import eagle3, pard, peagle, standalone
from decode.kinds.standalone import Verified
from decode.kv_stream import KVStream

KINDS = (standalone.NAME, eagle3.NAME, peagle.NAME, pard.NAME)
BLOCK_KINDS = (peagle.NAME, pard.NAME)  # a whole block per draft forward

__all__ = [
    "BLOCK_KINDS",
    "KINDS",
    "Verified",
    "capped_draft_length",
    "check_draft_length",
    "cost_stream",
    "drafter_for",
    "forwards_per_round",
    "kind_of",
]


def kind_of(draft: nn.Module) -> str:
    """The kind of a loaded draft: ``eagle3`` for an EAGLE-3 head, ``peagle`` for a P-EAGLE one, ``pard`` for a
    draft LM whose config has a ``pard_token``, else ``standalone``."""
    return getattr(draft, "kind", None) or (pard.NAME if pard.is_pard(draft) else standalone.NAME)


def drafter_for(draft: nn.Module, batch: int, vocab: int, input_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """The drafter of ``draft``'s kind for one decoding call over ``input_ids`` [B, P] (``prompt_mask`` [B, P])."""
    kind = kind_of(draft)
    if kind == peagle.NAME:
        return peagle.Drafter(draft, batch, vocab)
    if kind == eagle3.NAME:
        return eagle3.Drafter(draft, batch, vocab)
    if kind == pard.NAME:
        return pard.Drafter(draft, batch, vocab, input_ids, prompt_mask)
    return standalone.Drafter(draft, batch, vocab, input_ids, prompt_mask)


def cost_stream(model: nn.Module, batch: int):
    """What ``decode.metrics.ForwardCostMeter`` times a model's KV-cached forwards through, by kind."""
    if kind_of(model) in (eagle3.NAME, peagle.NAME):
        return eagle3.CostStream(model, batch)
    return KVStream(model, batch, logits_width(model))


def forwards_per_round(draft: nn.Module, gamma: float) -> float:
    """Draft forwards a round of ``gamma`` drafted tokens costs: one for a block draft (P-EAGLE), gamma for a
    chain."""
    return 1.0 if kind_of(draft) in BLOCK_KINDS else gamma


def check_draft_length(draft: nn.Module, gamma: int) -> None:
    """ValueError when a fixed ``gamma`` is above the block a block draft was trained for (a chain: no limit)."""
    kind = kind_of(draft)
    if kind == peagle.NAME:
        peagle.check_draft_length(draft, gamma)
    elif kind == pard.NAME:
        pard.check_draft_length(draft, gamma)


def capped_draft_length(draft: nn.Module, gamma: int | str) -> int | str:
    """``gamma`` capped at a block draft's trained block (for loops whose draft length is a speed setting only,
    as the target's rollouts); ``auto`` and chains as they are."""
    kind = kind_of(draft)
    if not isinstance(gamma, int) or kind not in BLOCK_KINDS:
        return gamma
    block = draft.block_size if kind == peagle.NAME else pard.block_of(draft)
    return min(gamma, int(block))
