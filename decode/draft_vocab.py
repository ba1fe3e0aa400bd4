"""A draft that proposes from part of the vocabulary: the tokens the target writes most often.

With a large vocabulary the draft's output layer is a large share of its cost: SmolLM2's 49152 x 576 head is
about half of a 2-layer draft's time per token on a CPU. Drafting from the N most frequent tokens only (the idea
of FR-Spec and of EAGLE-3's reduced draft vocabulary) multiplies just N rows of that matrix. Decoding stays
lossless: the draft's logits outside the subset are -inf, so it never proposes those tokens (its q is 0 there),
and the target still verifies over its whole vocabulary; a token the draft cannot propose is simply produced by
the target at a rejection.

    ids = frequent_ids(token_lists, 8192, always=[tokenizer.eos_token_id])
    save_ids(run_dir / "best", ids, source="target continuations")
    fast = with_subset_head(draft, load_ids(run_dir / "best"))   # the draft for speculative_generate

The checkpoint itself keeps its full head: HF assisted generation, vLLM and SGLang load and run it unchanged
(with their full-vocabulary cost); the ids file is read by draftsmith's decoder only. A draft trained over its
draft vocabulary (distill.subset_loss) is saved through `with_masked_head`: the same full-width head with its
untrained rows zeroed, so those engines propose from the same tokens.
"""

from __future__ import annotations

import collections
import copy
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

FILE = "draft_vocab.json"


def frequent_ids(token_lists: Iterable[Sequence[int]], n: int, *, always: Iterable[int] = (), vocab: int) -> list[int]:
    """The `n` most frequent ids in `token_lists` (ties by smaller id), plus `always` (EOS, chat markers), sorted.

    Ids that never occur fill the remaining places in id order, so the result has exactly min(n, vocab) ids.
    """
    if n < 1:
        raise ValueError(f"a draft vocabulary needs at least one token, got {n}")
    counts = collections.Counter(t for tokens in token_lists for t in tokens if 0 <= t < vocab)
    keep = {int(t) for t in always if 0 <= int(t) < vocab}
    for token, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(keep) >= n:
            break
        keep.add(token)
    filler = (t for t in range(vocab) if t not in keep)
    while len(keep) < min(n, vocab):
        keep.add(next(filler))
    return sorted(keep)


def save_ids(directory: str | Path, ids: Sequence[int], *, vocab: int, source: str) -> Path:
    """Write `draft_vocab.json` into a checkpoint folder (atomically: a temp file renamed into place)."""
    path = Path(directory) / FILE
    tmp = path.with_name(f".{FILE}.tmp")
    tmp.write_text(json.dumps({"size": len(ids), "vocab": vocab, "source": source, "ids": list(ids)}) + "\n")
    os.replace(tmp, path)
    return path


def load_ids(path: str | Path) -> list[int] | None:
    """The ids of a `draft_vocab.json` (a folder holding one, or the file); None when the folder has none.

    Raises:
        ValueError: the file is not a draft vocabulary.
    """
    path = Path(path)
    if path.is_dir():
        path = path / FILE
        if not path.is_file():
            return None
    try:
        ids = json.loads(path.read_text())["ids"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a draft vocabulary file ({e}): write it with draft_vocab.save_ids") from e
    if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
        raise ValueError(f"{path}: 'ids' must be a non-empty list of token ids")
    return ids


class SubsetHead(nn.Module):
    """`head` restricted to rows `ids`; returns full-width logits, -inf outside the subset."""

    def __init__(self, head: nn.Linear, ids: Sequence[int]):
        super().__init__()
        width = head.weight.shape[0]
        if max(ids) >= width:
            raise ValueError(f"draft vocabulary id {max(ids)} is outside the draft's {width}-token head")
        index = torch.tensor(sorted(set(ids)), dtype=torch.long, device=head.weight.device)
        self.width = width
        self.register_buffer("ids", index, persistent=False)
        # A plain nn.Linear of its own, so draftsmith's CPU kernels prepack it like any other layer.
        self.rows = nn.Linear(head.in_features, len(index), bias=head.bias is not None)
        self.rows.to(device=head.weight.device, dtype=head.weight.dtype)
        with torch.no_grad():
            self.rows.weight.copy_(head.weight[index])
            if head.bias is not None:
                self.rows.bias.copy_(head.bias[index])
        self.rows.requires_grad_(False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        part = self.rows(hidden)
        out = part.new_full((*part.shape[:-1], self.width), float("-inf"))
        return out.index_copy_(-1, self.ids, part)


def with_subset_head(model: nn.Module, ids: Sequence[int] | None) -> nn.Module:
    """A view of `model` (same weights, same config) whose output layer scores only `ids`; `model` when None.

    Raises:
        ValueError: the model's output layer is not a plain linear layer (nothing to restrict).
    """
    if ids is None:
        return model
    view = _view(model)
    view.set_output_embeddings(SubsetHead(_linear_head(model), ids))
    return view


def with_masked_head(model: nn.Module, ids: Sequence[int]) -> nn.Module:
    """A view of `model` to save for other engines: its own (untied) output layer, rows outside `ids` zero.

    A draft trained over its draft vocabulary (`distill.loss_vocab: subset`) has trained only those rows of its
    head; the others still score the hidden states of the untrained draft. HF assisted generation, vLLM and
    SGLang run the full head, so the saved draft keeps the trained rows and gives every other token a logit of 0,
    below the positive top logit of a trained draft, so it drafts from `ids` there too, at the full head's cost
    (SmolLM2's masked head drafted exactly the tokens of its 8192-row head on held-out prompts). The input
    embeddings keep every row (prompts hold any token); `model` is unchanged.

    Raises:
        ValueError: the model's output layer is not a plain linear layer.
    """
    head = _linear_head(model)
    keep = torch.zeros(head.weight.shape[0], dtype=torch.bool, device=head.weight.device)
    keep[torch.tensor(sorted(set(ids)), dtype=torch.long, device=keep.device)] = True
    masked = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None)
    masked.to(device=head.weight.device, dtype=head.weight.dtype).requires_grad_(False)
    with torch.no_grad():
        masked.weight.copy_(head.weight * keep[:, None])
        if head.bias is not None:
            masked.bias.copy_(head.bias * keep)
    view = _view(model)
    view.config = copy.deepcopy(model.config)
    view.config.tie_word_embeddings = False  # save the masked rows, not the embeddings, as the output layer
    view.set_output_embeddings(masked)
    return view


def _view(model: nn.Module) -> nn.Module:
    """A shallow copy of `model` sharing every submodule, parameter and the config; its modules can be swapped."""
    view = copy.copy(model)
    view._modules = dict(model._modules)
    return view


def _linear_head(model: nn.Module) -> nn.Linear:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"a draft vocabulary needs a draft whose output layer is a linear layer, not {type(head).__name__}: "
            "drop the draft vocabulary (--draft-vocab full)"
        )
    return head
