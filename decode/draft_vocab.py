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
draft vocabulary (distill.training.subset_loss) is saved through `with_masked_head`: the same full-width head, its
untrained rows replaced by one row fitted to score far below the trained rows on the draft's own hidden states, so
those engines propose from the draft vocabulary when they sample too. A Llama head has no bias, so this is a fit, not a
-inf: the saved head's mass outside the draft vocabulary is measured on held-out text and kept in draft_vocab.json.
"""

from __future__ import annotations

import collections
import copy
import json
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

FILE = "draft_vocab.json"
MARGIN = 30.0  # nats the fitted row aims below the top trained logit: 40960 rows there hold < 1e-8 of the mass
MAX_MASS = 1e-3  # warn when the saved head puts more than this outside the draft vocabulary on held-out text
FIT_TOKENS, HELDOUT_TOKENS = 16384, 4096  # hidden states the row is fitted on / measured on


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


def save_ids(
    directory: str | Path, ids: Sequence[int], *, vocab: int, source: str, saved_head: dict | None = None
) -> Path:
    """Write `draft_vocab.json` into a checkpoint folder (atomically: a temp file renamed into place).

    `saved_head`: what `with_masked_head` measured of the head saved beside it (its mass outside `ids`).
    """
    path = Path(directory) / FILE
    tmp = path.with_name(f".{FILE}.tmp")
    content = {"size": len(ids), "vocab": vocab, "source": source, "ids": list(ids)}
    if saved_head is not None:
        content["saved_head"] = saved_head
    tmp.write_text(json.dumps(content) + "\n")
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


def load_saved_head(folder: str | Path) -> dict | None:
    """The `saved_head` measurement of a checkpoint's `draft_vocab.json` (`with_masked_head`); None without one."""
    path = Path(folder) / FILE
    try:
        return json.loads(path.read_text()).get("saved_head") if path.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None


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


def with_masked_head(model: nn.Module, ids: Sequence[int], text: Sequence[Sequence[int]]) -> tuple[nn.Module, dict]:
    """A view of `model` to save for other engines, and what its head puts outside `ids` on held-out text.

    A draft trained over its draft vocabulary (`distill.loss_vocab: subset`) has trained only those rows of its
    head; the others still score the hidden states of the untrained draft. HF assisted generation, vLLM and
    SGLang run the full head, and a Llama head has no bias to hold -inf, so every other row becomes one vector
    fitted (`outside_row`) on the draft's final hidden states over `text` (token id lists: the text the draft
    drafts) to score MARGIN below the top trained logit. One sequence in five is held out of the fit; the saved
    head's probability outside `ids` at temperature 1 on it is returned: `outside_mass_mean`/`_max` per position,
    `argmax_outside` (the share of positions whose greedy token is outside `ids`, where the saved head and the
    subset head would disagree). The output layer is untied; the input embeddings keep every row (prompts hold any
    token); `model` is unchanged.

    Raises:
        ValueError: the model's output layer is not a plain linear layer, or `text` is empty.
    """
    head = _linear_head(model)
    keep = torch.zeros(head.weight.shape[0], dtype=torch.bool, device=head.weight.device)
    keep[torch.tensor(sorted(set(ids)), dtype=torch.long, device=keep.device)] = True
    fit = final_states(model, [t for i, t in enumerate(text) if i % 5], FIT_TOKENS)
    heldout = final_states(model, text[::5], HELDOUT_TOKENS)
    masked = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None)
    masked.to(device=head.weight.device, dtype=head.weight.dtype).requires_grad_(False)
    with torch.no_grad():
        trained = head.weight[keep].float()
        masked.weight.copy_(head.weight)
        masked.weight[~keep] = outside_row(fit, (fit @ trained.T).amax(-1)).to(masked.weight.dtype)
        if head.bias is not None:  # a head with a bias holds the mask exactly
            masked.bias.copy_(head.bias.masked_fill(~keep, torch.finfo(head.bias.dtype).min))
        report = outside_mass(masked, keep, heldout)
    report.update(fit_positions=len(fit), margin=MARGIN)
    if report["outside_mass_max"] > MAX_MASS or report["argmax_outside"] > 0:
        print(
            f"warning: the saved head puts up to {report['outside_mass_max']:.2g} of its probability outside the "
            f"draft vocabulary on held-out text ({report['argmax_outside']:.2%} of positions greedy there): "
            "engines that run the full head may propose other tokens (see draft_vocab.json saved_head)",
            file=sys.stderr,
        )
    view = _view(model)
    view.config = copy.deepcopy(model.config)
    view.config.tie_word_embeddings = False  # save the masked rows, not the embeddings, as the output layer
    view.set_output_embeddings(masked)
    return view, report


@torch.no_grad()
def final_states(model: nn.Module, text: Sequence[Sequence[int]], max_tokens: int) -> torch.Tensor:
    """What `model`'s output layer reads over `text` (its decoder's last hidden states, one sequence at a time,
    float32): [<= max_tokens, hidden]. The output layer itself is not run."""
    decoder, device = model.get_decoder(), next(model.parameters()).device
    states: list[torch.Tensor] = []
    for tokens in text:
        if sum(len(s) for s in states) >= max_tokens:
            break
        if len(tokens):
            ids = torch.tensor([list(tokens)[:max_tokens]], device=device)
            states.append(decoder(input_ids=ids).last_hidden_state[0])
    if not states:
        raise ValueError("no text to fit the masked head on: pass the token lists the draft vocabulary came from")
    return torch.cat(states)[:max_tokens].float()


def outside_row(states: torch.Tensor, top: torch.Tensor, margin: float = MARGIN) -> torch.Tensor:
    """The row w whose logit w.h is `margin` below `top` (the top trained logit) on the hidden states `states`.

    A soft-margin fit, min mean(softplus(w.h - top + margin)) + 1e-7 |w|^2 with the states in units of their mean
    norm, by L-BFGS (convex: one answer, about a second for 16384 states); the small penalty keeps w the shortest
    row that holds the margin, which is what holds it on states the fit has not seen.
    states: [n, hidden]; top: [n]. Returns [hidden].
    """
    scale = states.norm(dim=-1).mean().clamp_min(1e-6)
    unit = states / scale
    w = torch.zeros(states.shape[-1], device=states.device, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=300, history_size=20, line_search_fn="strong_wolfe")

    def objective() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.softplus(unit @ w - top + margin).mean() + 1e-7 * w.square().sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(objective)
    return w.detach() / scale


@torch.no_grad()
def outside_mass(head: nn.Linear, keep: torch.Tensor, states: torch.Tensor) -> dict:
    """What `head` (full width) puts outside the rows `keep` at temperature 1 on `states` ([n, hidden])."""
    logits = head(states.to(head.weight.dtype)).float()  # [n, vocab]
    mass = logits.softmax(-1)[:, ~keep].sum(-1)
    return {
        "heldout_positions": len(states),
        "outside_mass_mean": float(mass.mean()),
        "outside_mass_max": float(mass.max()),
        "argmax_outside": float((~keep[logits.argmax(-1)]).float().mean()),
    }


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
