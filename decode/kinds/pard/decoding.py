"""The PARD draft kind: a standalone draft LM that drafts a whole block of K tokens in one forward.

A PARD draft (Parallel Draft, An et al. 2025) is an ordinary causal LM with the target's tokenizer, trained so that
K - 1 *mask tokens* appended after the text make it predict the tokens after the next one: one forward reads the
tokens it has not seen yet followed by K - 1 copies of the mask token; the last real position proposes d_1, the
j-th mask position d_{j+1}. No drafted token is read back, so the block costs one forward whatever K is; the mask
positions' cache entries are dropped after the round and the next round feeds the accepted tokens.

The draft knows nothing of the target's hidden states: one PARD draft serves every target that shares its
tokenizer. Its config.json carries ``pard_token`` (the mask token id, what vLLM's ``draft_model`` proposer with
``parallel_drafting: true`` reads) and ``block_size`` (the K it was trained for).

Training reads all K positions of every sequence in one forward (:func:`block_inputs`): the sequence, then K - 1
copies of it made of mask tokens, with an attention mask under which block position k of anchor i sees the real
tokens <= i and its own block's mask positions before it: what the k-th drafted token sees in decoding. With
``distill.anchors`` N (:func:`anchor_inputs`) the mask segments hold only N drawn anchors: S + (K - 1) * N positions.
"""

from __future__ import annotations

import torch
from torch import nn

from decode.kinds.pard import TRAITS
from decode.kinds.standalone import decoding as standalone

# cost, folder check and vLLM support: as any draft LM's
from decode.kinds.standalone.decoding import (  # noqa: F401
    Verified,
    check_folder,
    cost_stream,
    draft_tokens,
    stack,
    vllm_problem,
)

NAME = TRAITS.name
MAX_BLOCK = 16


def is_pard(draft: nn.Module) -> bool:
    """A loaded draft LM whose config marks it a PARD draft (``pard_token``)."""
    return getattr(getattr(draft, "config", None), "pard_token", None) is not None


def is_pard_folder(path) -> bool:
    """A local draft folder whose config.json marks a PARD draft (``pard_token``)."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("pard_token") is not None


def is_folder(path) -> bool:
    """A folder holding a PARD draft (:func:`is_pard_folder`)."""
    return is_pard_folder(path)


def folder_block(path) -> int | None:
    """The block a PARD folder drafts in one forward: its ``block_size`` (vLLM reads ``pard_token``;
    ``block_size`` is draftsmith's: a draft trained elsewhere has none, and the user's K decides up to
    :data:`MAX_BLOCK`); None for another folder."""
    import json
    from pathlib import Path

    if not is_pard_folder(path):
        return None
    config = json.loads((Path(path) / "config.json").read_text())
    return int(config.get("block_size") or MAX_BLOCK)


def check_block_size(block_size: int) -> int:
    """``block_size`` as an int in 2..MAX_BLOCK, else ValueError naming the range."""
    if not 2 <= int(block_size) <= MAX_BLOCK:
        raise ValueError(f"block size {block_size} is not in 2..{MAX_BLOCK}: a PARD draft drafts 2..16 tokens")
    return int(block_size)


def mark(draft: nn.Module, *, block_size: int, pard_token: int) -> nn.Module:
    """Make ``draft`` a PARD draft of ``block_size`` with mask token ``pard_token`` (its config says so; it is saved
    and served that way). Returns ``draft``.

    Raises:
        ValueError: the mask token outside the draft's vocabulary, or the block outside 2..16.
    """
    config = draft.config
    if not 0 <= int(pard_token) < int(config.vocab_size):
        raise ValueError(
            f"mask token id {pard_token} is outside the draft's vocabulary of {config.vocab_size} tokens: set "
            "draft.mask_token_id to an id in it"
        )
    config.block_size = check_block_size(block_size)
    config.pard_token = int(pard_token)
    return draft


def block_of(draft: nn.Module) -> int:
    """The block the draft was trained for; a PARD draft trained elsewhere (``pard_token`` but no ``block_size``
    in its config, as the PARD paper's published drafts): up to MAX_BLOCK, the user's K decides."""
    return int(getattr(draft.config, "block_size", None) or MAX_BLOCK)


def block_inputs(
    ids: torch.Tensor, valid: torch.Tensor, block: int, pard_token: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training forward's inputs for all ``block`` positions of every anchor in one pass.

    Args:
        ids, valid: [B, S] right-padded sequences and their real positions.

    Returns:
        (input ids [B, K * S]: the sequence, then K - 1 segments of mask tokens; position ids [B, K * S]: segment k
        at anchor i sits at i + k; an additive attention mask [B, 1, K * S, K * S] in ``dtype``: segment 0 is
        causal over the real tokens; segment k >= 1 at anchor i sees the real tokens <= i and segments 1..k at
        anchor i, exactly what the k-th drafted token after x_i sees in decoding).
    """
    batch, width = ids.shape
    n = block * width
    seg = torch.arange(n, device=ids.device) // width
    pos = torch.arange(n, device=ids.device) % width
    real_key = (seg[None, :] == 0) & (pos[None, :] <= pos[:, None])  # [n, n]: causal over segment 0
    own_block = (seg[None, :] >= 1) & (seg[None, :] <= seg[:, None]) & (pos[None, :] == pos[:, None])
    key_valid = torch.cat([valid.bool(), torch.ones(batch, n - width, dtype=torch.bool, device=ids.device)], 1)
    allowed = (real_key[None] & key_valid[:, None, :]) | own_block[None]  # [B, n, n]
    mask = torch.zeros(batch, 1, n, n, dtype=dtype, device=ids.device)
    mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    block_ids = torch.cat([ids, torch.full((batch, n - width), pard_token, dtype=ids.dtype, device=ids.device)], 1)
    positions = (pos + seg).expand(batch, n)
    return block_ids, positions, mask


def block_logits(draft: nn.Module, ids: torch.Tensor, valid: torch.Tensor, block: int) -> list[torch.Tensor]:
    """``block`` tensors [B, S, V]: block position k's logits at every anchor i (k = 0: the plain next-token
    logits; k >= 1: the k-th mask position after x_i, which predicts x_{i+k+1})."""
    dtype = next(draft.parameters()).dtype
    x, positions, mask = block_inputs(ids, valid, block, int(draft.config.pard_token), dtype)
    logits = draft(input_ids=x, attention_mask=mask, position_ids=positions, use_cache=False).logits
    return list(logits.split(ids.shape[1], dim=1))


def anchor_inputs(
    ids: torch.Tensor,
    valid: torch.Tensor,
    block: int,
    pard_token: int,
    anchors: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`block_inputs` with the mask segments at ``anchors`` [B, N] only (``distill.anchors``): the forward's
    length is S + (K - 1) * N instead of K * S.

    Returns:
        (input ids [B, S + (K - 1) * N]: the sequence, then K - 1 segments of N mask tokens; position ids: mask
        segment k at anchor j sits at anchors[j] + k; an additive attention mask [B, 1, L, L] in ``dtype``: segment 0
        is causal over the real tokens; segment k >= 1 at anchor j sees the real tokens <= anchors[j] and segments
        1..k at anchor j, exactly what the k-th drafted token after x_{anchors[j]} sees in decoding).
    """
    batch, width = ids.shape
    n, device = anchors.shape[1], ids.device
    tail = (block - 1) * n
    seg = torch.arange(1, block, device=device).repeat_interleave(n)  # [tail]: each mask position's segment
    slot = torch.arange(n, device=device).repeat(block - 1)  # [tail]: its anchor's index
    at = anchors.to(device).long()[:, slot]  # [B, tail]: its anchor
    # the last real position each query sees: its own for segment 0, its anchor for a mask position
    sees = torch.cat([torch.arange(width, device=device).expand(batch, width), at], 1)  # [B, L]
    real = (torch.arange(width, device=device)[None, None, :] <= sees[:, :, None]) & valid.bool()[:, None, :]
    own_block = (slot[None, :] == slot[:, None]) & (seg[None, :] <= seg[:, None])  # [tail, tail]
    masks = torch.cat([torch.zeros(width, tail, dtype=torch.bool, device=device), own_block])  # [L, tail]
    allowed = torch.cat([real, masks.expand(batch, -1, -1)], 2)  # [B, L, L]
    mask = torch.zeros(batch, 1, width + tail, width + tail, dtype=dtype, device=device)
    mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    block_ids = torch.cat([ids, torch.full((batch, tail), pard_token, dtype=ids.dtype, device=device)], 1)
    positions = torch.cat([torch.arange(width, device=device).expand(batch, width), at + seg], 1)
    return block_ids, positions, mask


def anchor_logits(
    draft: nn.Module, ids: torch.Tensor, valid: torch.Tensor, block: int, anchors: torch.Tensor
) -> list[torch.Tensor]:
    """:func:`block_logits` at ``anchors`` [B, N]: ``block`` tensors, [B, S, V] for k = 0 (the plain next-token
    logits at every position), then [B, N, V] for k >= 1 (the k-th mask position after x_{anchors[j]})."""
    dtype = next(draft.parameters()).dtype
    x, positions, mask = anchor_inputs(ids, valid, block, int(draft.config.pard_token), anchors, dtype)
    logits = draft(input_ids=x, attention_mask=mask, position_ids=positions, use_cache=False).logits
    return list(logits.split([ids.shape[1]] + [anchors.shape[1]] * (block - 1), dim=1))


def check_draft_length(draft: nn.Module, gamma: int) -> None:
    """ValueError when a fixed ``gamma`` is above the block the PARD draft was trained for."""
    block = block_of(draft)
    if gamma > block:
        raise ValueError(
            f"num_draft_tokens={gamma} is above the block of {block} tokens this PARD draft was trained for: use "
            f"num_draft_tokens <= {block} or 'auto', or train a draft with a larger draft.block_size"
        )


class Drafter(standalone.Drafter):
    """A PARD draft's state in one decoding call: the standalone drafter's cache, and one forward per round that
    reads its pending tokens and K - 1 mask tokens and proposes the whole block.

    Invariant between rounds: the draft has cached every real token but its pending ones (the accepted draft
    tokens and the round's last token); no drafted token is ever cached.
    """

    def __init__(self, draft: nn.Module, batch: int, vocab: int, input_ids: torch.Tensor, prompt_mask: torch.Tensor):
        super().__init__(draft, batch, vocab, input_ids, prompt_mask)
        self.block, self.pard_token = block_of(draft), int(draft.config.pard_token)

    def propose(self, controller, gamma_cap: int, proc, greedy: bool, generator):
        drf = self.stream
        batch = self.ids.shape[0]
        block = min(gamma_cap, self.block)
        controller.start_round(batch, block)
        tokens, qs = [], []
        if block > 0:
            masks = torch.full((batch, block - 1), self.pard_token, dtype=self.ids.dtype, device=drf.device)
            ids = torch.cat([self.ids.to(drf.device), masks], 1)
            valid = None
            if self.valid is not None:
                valid = torch.cat([self.valid.to(drf.device), torch.ones_like(masks, dtype=torch.bool)], 1)
            block_logits = drf.feed(ids, valid, keep=block)  # [B, block, V]
            later = iter(range(1, block))

            def step(token: torch.Tensor) -> torch.Tensor:  # already computed: no forward
                return block_logits[:, next(later)]

            tokens, qs = draft_tokens(block_logits[:, 0], step, controller, block, proc, greedy, generator)
            if block > 1:  # drop the mask positions: the next round feeds the accepted tokens there
                drf.rollback(block - 1, torch.zeros(batch, dtype=torch.long), [0] * batch)
            self.ids, self.valid = self.ids[:, :0], None  # every pending token is cached now
        return stack(tokens, qs, batch, drf.vocab, drf.device, greedy)

    def update(self, v: Verified) -> None:
        """The pending tokens of the next round: row b's accepted draft tokens, then the round's last token (rows
        that accepted fewer than the most get holes)."""
        device = self.stream.device
        nxt = v.nxt.to(device)[:, None]
        if v.draft_tokens.shape[1] == 0:  # the draft read nothing this round: its pending tokens grow
            self.valid = None if self.valid is None else torch.cat([self.valid, standalone.all_real(nxt)], 1)
            self.ids = torch.cat([self.ids.to(device), nxt], 1)
            return
        most = max(v.acc_list)
        accepted = v.draft_tokens[:, :most].to(device)
        kept = torch.arange(most, device=device)[None, :] < v.accepted.to(device)[:, None]
        self.ids = torch.cat([accepted, nxt], 1)
        self.valid = None if bool(kept.all()) else torch.cat([kept, standalone.all_real(nxt)], 1)


def drafter(draft: nn.Module, batch: int, vocab: int, input_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Drafter:
    """The kind's drafter for one decoding call (``decode.kinds.drafter_for``)."""
    return Drafter(draft, batch, vocab, input_ids, prompt_mask)


def is_model(draft: nn.Module) -> bool:
    """A loaded draft LM marked a PARD draft (:func:`is_pard`)."""
    return is_pard(draft)
