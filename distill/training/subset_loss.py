"""Training over the draft vocabulary (`distill.loss_vocab: subset` with `draft.vocab_subset: N`).

draftsmith's decoder drafts from the N tokens the target writes most often (decode.draft_vocab): the draft's
distribution there is the softmax over those N logits alone. Training can use the same restriction: the head
multiplies only those N rows of its weight (the rest of the vocabulary costs nothing in the forward, the backward
and the loss), and the loss compares that N-token distribution with the target's, the teacher's probability of
every other token going into the tail bucket of the top-k coarsening (distill.training.losses). On SmolLM2's
49152-token vocabulary a 2-layer draft's head is most of its training cost; with N = 8192 a step costs ~2.5x less.

The weight rows are the model's own (a view, not a copy), so training changes only those N rows as outputs; the
head's other rows still score the hidden states of the untrained draft. HF assisted generation, vLLM and SGLang
serve the full head, so checkpoints are saved with those rows replaced by one row fitted to score far below the
trained ones (decode.draft_vocab.with_masked_head, in distill.training.run_state), its mass outside the N tokens
measured on held-out text into draft_vocab.json. On SmolLM2 the head as trained made HF assisted generation 0.68x plain
`generate`, the masked one 1.10x (docs/smollm2.md).

    position = index_of(ids, vocab)                     # id -> column of the restricted logits
    head = restricted(model, ids)                       # once; shares the model's weight
    with swapped_head(model, head):                     # logits [batch, seq, N + 1] inside the block
        student = model(input_ids=...).logits
    top_ids, log_pt = restrict_top_k(top_ids, log_pt, position)
    loss = losses.distill_loss_top_k(student, mask, top_ids, log_pt)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

# Log-probability given to a teacher top-k id outside the subset (its mass moves to the tail): finite, so that the
# KL terms p (log p - log q) are exactly 0 instead of 0 * inf, and representable in the teacher cache's float16.
_ABSENT = -1.0e4


def index_of(ids: Sequence[int], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[vocab] int64: the column of each token id among the sorted `ids`, -1 for the ids outside them."""
    keep = torch.tensor(sorted(set(ids)), dtype=torch.long)
    if keep.numel() == 0 or int(keep.min()) < 0 or int(keep.max()) >= vocab:
        raise ValueError(f"draft vocabulary ids must lie in [0, {vocab}) and be at least one")
    position = torch.full((vocab,), -1, dtype=torch.long)
    position[keep] = torch.arange(keep.numel())
    return position.to(device)


def restrict_top_k(
    top_ids: torch.Tensor, log_pt: torch.Tensor, position: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k rows in the columns of the restricted logits.

    top_ids [tokens, k] (token ids), log_pt [tokens, k + 1] (their log-probabilities and the tail's) ->
    (columns [tokens, k], log-probabilities [tokens, k + 1]): ids outside the subset point at the absent column
    (whose student probability is 0) with log-probability _ABSENT, and their mass is added to the tail.
    """
    position = position.to(top_ids.device)
    cols = position[top_ids.long()]
    absent = cols < 0
    cols = cols.masked_fill(absent, int(position.max()) + 1)  # the absent column follows the subset's
    lp = log_pt.float()
    gone = lp[:, :-1].masked_fill(~absent, float("-inf"))
    tail = torch.logsumexp(torch.cat([lp[:, -1:], gone], -1), -1, keepdim=True)
    top = lp[:, :-1].masked_fill(absent, _ABSENT)
    return cols, torch.cat([top, tail], -1)


class RestrictedHead(nn.Module):
    """`head`'s rows `ids` (its own weight, indexed: gradients reach those rows) plus an absent column of -inf."""

    def __init__(self, head: nn.Linear, ids: Sequence[int]) -> None:
        super().__init__()
        self.head = head
        self.register_buffer(
            "ids", torch.tensor(sorted(set(ids)), dtype=torch.long, device=head.weight.device), persistent=False
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.head.weight.index_select(0, self.ids)
        bias = self.head.bias.index_select(0, self.ids) if self.head.bias is not None else None
        logits = nn.functional.linear(hidden, weight, bias)
        return torch.cat([logits, logits.new_full((*logits.shape[:-1], 1), float("-inf"))], -1)


def restricted(model: nn.Module, ids: Sequence[int]) -> RestrictedHead:
    """The restricted output layer of `model` (sharing its weight), for :func:`swapped_head`.

    Raises:
        ValueError: the model's output layer is not a plain linear layer.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"distill.loss_vocab=subset needs a draft whose output layer is a linear layer, not "
            f"{type(head).__name__}: set distill.loss_vocab=full"
        )
    return RestrictedHead(head, ids)


@contextlib.contextmanager
def swapped_head(model: nn.Module, head: RestrictedHead) -> Iterator[None]:
    """Inside the block `model`'s output layer is `head` (logits over its ids plus the absent column); the
    model's own output layer is put back after, also when the block raises."""
    model.set_output_embeddings(head)
    try:
        yield
    finally:
        model.set_output_embeddings(head.head)
