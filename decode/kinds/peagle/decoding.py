"""The P-EAGLE draft kind: an EAGLE-3 head that drafts a whole block of K tokens in one forward.

The head is an EAGLE-3 head (``decode.kinds.eagle3``: ``fc`` over three target layers, one Llama layer, a draft
vocabulary) plus a learned *mask feature* ``mask_hidden`` [1, 3 * H_target] and a *mask token* id. One draft forward
reads the (feature, next token) pairs the target owes it, as EAGLE-3 does, followed by K - 1 mask positions (the
mask token's embedding and ``mask_hidden``, fused by ``fc`` as a target feature is): the last real position
proposes d_1, the j-th mask position d_{j+1}. No drafted token is read back, so the block costs one forward
whatever K is; the mask positions' cache entries are dropped after the round. It is trained on all K positions of
every sequence in one pass (``Eagle3Head.unrolled``, whose steps after the first read the mask inputs).

The layout is vLLM's (``speculative_config: {"method": "eagle3", "parallel_drafting": true}``; config
``mask_token_id``, tensor ``mask_hidden``; the speculators type ``peagle``): config.json adds ``mask_token_id`` and
``block_size`` (the K it was trained for) to an EAGLE-3 head's.

    head = build(target, draft_ids, block_size=6, mask_token_id=0)   # a fresh head
    head = with_mask(eagle3_head, block_size=6, mask_token_id=0)      # warm-started from an EAGLE-3 head
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from decode.kinds.eagle3 import decoding as eagle3

# the head's forwards (timed as an EAGLE-3 head's), its folder, load, save and vLLM support (vLLM serves both as
# eagle3)
from decode.kinds.eagle3.decoding import check_folder, cost_stream, folder_block, load, save, vllm_problem  # noqa: F401
from decode.kinds.peagle import TRAITS
from decode.kinds.standalone.decoding import draft_tokens, stack

NAME = TRAITS.name
MAX_BLOCK = 16  # the largest block a head is built for (the bench's verify-cost curve covers K = 1..16)


def check_block_size(block_size: int) -> int:
    """``block_size`` as an int in 2..MAX_BLOCK, else ValueError naming the range."""
    if not 2 <= int(block_size) <= MAX_BLOCK:
        raise ValueError(f"block size {block_size} is not in 2..{MAX_BLOCK}: a P-EAGLE head drafts 2..16 tokens")
    return int(block_size)


def _parallel_config(config, block_size: int, mask_token_id: int):
    if not 0 <= int(mask_token_id) < int(config.vocab_size):
        raise ValueError(
            f"mask token id {mask_token_id} is outside the target's vocabulary of {config.vocab_size} tokens: set "
            "draft.mask_token_id to an id in it"
        )
    config.block_size = check_block_size(block_size)
    config.mask_token_id = int(mask_token_id)
    config.parallel_drafting = True
    return config


def build(
    target: nn.Module,
    draft_ids: Sequence[int],
    aux_layers: Sequence[int] | None = None,
    *,
    block_size: int,
    mask_token_id: int,
) -> eagle3.Eagle3Head:
    """A fresh P-EAGLE head for ``target`` (as ``eagle3.build``), with ``mask_hidden`` at the layers'
    initialisation."""
    head = eagle3.build(target, draft_ids, aux_layers)
    return with_mask(head, block_size=block_size, mask_token_id=mask_token_id)


def with_mask(head: eagle3.Eagle3Head, *, block_size: int, mask_token_id: int) -> eagle3.Eagle3Head:
    """A P-EAGLE head with ``head``'s weights (an EAGLE-3 head warm-starts one) and a fresh ``mask_hidden``; a
    P-EAGLE head keeps its own ``mask_hidden`` and takes the new block size and mask token."""
    config = _parallel_config(head.config.__class__.from_dict(head.config.to_dict()), block_size, mask_token_id)
    ref = head.fc.weight
    out = eagle3.Eagle3Head(config, head.embed_tokens, head.draft_ids.tolist())
    out.to(device=ref.device, dtype=ref.dtype)
    with torch.no_grad():
        nn.init.normal_(out.mask_hidden, std=0.02)
    missing, _ = out.load_state_dict(head.state_dict(), strict=False)
    if set(missing) - {"mask_hidden"}:
        raise ValueError(f"with_mask: the head lacks {sorted(set(missing) - {'mask_hidden'})}")
    if hasattr(head, "name_or_path"):
        out.name_or_path = head.name_or_path
    return out


def block_of(head: nn.Module) -> int | None:
    """The block the head was trained for (None: a chain head)."""
    return getattr(head, "block_size", None)


def check_draft_length(head: nn.Module, gamma: int) -> None:
    """ValueError when a fixed ``gamma`` is above the block ``head`` was trained for (a chain head: no limit)."""
    block = getattr(head, "block_size", None)
    if block is not None and gamma > block:
        raise ValueError(
            f"num_draft_tokens={gamma} is above the block of {block} tokens this P-EAGLE head was trained for: use "
            f"num_draft_tokens <= {block} or 'auto', or train a head with a larger draft.block_size"
        )


class Drafter(eagle3.Drafter):
    """A P-EAGLE head's state in one decoding call: the EAGLE-3 drafter's cache and pending pairs, and one forward
    per round that proposes the whole block."""

    def propose(self, controller, gamma_cap: int, proc, greedy: bool, generator):
        batch = self.cache.length.shape[0]
        block = min(gamma_cap, self.head.block_size)
        controller.start_round(batch, block)
        tokens, qs = [], []
        if block > 0 and self.pending is not None:
            ids, features, valid = self.pending
            self.pending = None
            mask_ids, mask_features = self.head.mask_inputs(batch, block - 1)
            ids = torch.cat([ids, mask_ids], 1)
            features = torch.cat([features.to(mask_features.dtype), mask_features], 1)
            valid = torch.cat([valid, torch.ones(batch, block - 1, dtype=torch.bool, device=self.device)], 1)
            logits, _ = self._feed(ids, features, valid, fused=True)
            block_logits = logits[:, -block:]
            later = iter(range(1, block))

            def step(token: torch.Tensor) -> torch.Tensor:  # already computed: no forward
                return self._logits(block_logits[:, next(later)])

            first = self._logits(block_logits[:, 0])
            tokens, qs = draft_tokens(first, step, controller, block, proc, greedy, generator)
            self.cache.crop(block - 1)  # the mask positions; the next round feeds the target's features there
        return stack(tokens, qs, batch, self.vocab, self.device, greedy)


def drafter(head: eagle3.Eagle3Head, batch: int, vocab: int, input_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """The kind's drafter for one decoding call (``decode.kinds.drafter_for``)."""
    return Drafter(head, batch, vocab)


def is_folder(path) -> bool:
    """A folder holding a head that drafts a block (``mask_token_id`` and ``block_size`` on an EAGLE-3 head's
    config)."""
    return eagle3.folder_block(path) is not None


def is_model(draft: nn.Module) -> bool:
    """A loaded draft of this kind (it names its kind)."""
    return getattr(draft, "kind", None) == NAME
