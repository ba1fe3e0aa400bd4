"""Training an EAGLE-3 head (`draft.kind: eagle3`): what train/distill.py's step feeds the head, and its loss.

Each step the frozen target runs once on the batch's sequences with ``output_hidden_states=True``: its hidden
states at the head's three aux layers are the head's features and its logits are the teacher, so nothing is
cached on disk. The head is unrolled for ``distill.ttt_steps`` steps (the training-time test: steps after the
first read the head's own output, as in decoding); step k at position i is compared with the target's
distribution at position i + k + 1, over the head's draft vocabulary plus one tail bucket (:func:`step_log_probs`).

    model = Unrolled(head)                                    # what accelerate prepares (DDP wraps its forward)
    loss, stats = step_loss(model, target, batch, recipe.distill)
    # stats: {"train/loss_0": ..., "train/acc_0": ..., ...} per unrolled step
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from decode.kinds import eagle3
from distill import losses
from distill.config import EAGLE3_VOCAB, DistillConfig, Recipe

# Tail mass below this is treated as this (log = -69), so that a draft vocabulary covering every token gives finite
# log-probabilities whose KL terms are 0 (distill.losses uses the same floor).
_TAIL_FLOOR = 1e-30
_LOGIT_FLOOR = -1e4  # -inf logits (masked) give p = 0 and a finite log p, as in distill.losses


class Unrolled(nn.Module):
    """The head as the training loop's model: its forward is the training-time unroll.

    accelerate prepares this module, so DDP's gradient synchronisation and mixed precision's autocast wrap the
    forward that training calls (``head.unrolled`` is a plain method they would not see). ``head`` is the
    :class:`decode.kinds.eagle3.Eagle3Head` itself, which evaluation and checkpoints use.
    """

    def __init__(self, head: eagle3.Eagle3Head) -> None:
        super().__init__()
        self.head = head

    def forward(
        self,
        ids: torch.Tensor,
        features: torch.Tensor,
        position_ids: torch.Tensor,
        key_valid: torch.Tensor,
        steps: int,
    ) -> list[torch.Tensor]:
        return self.head.unrolled(ids, features, position_ids, key_valid, steps=steps)


def head_of(model: nn.Module) -> eagle3.Eagle3Head:
    """The head inside an (unwrapped) :class:`Unrolled`, or the head itself."""
    return model.head if isinstance(model, Unrolled) else model


# ---------------------------------------------------------------- the draft vocabulary and the head


def vocab_size(requested: int, target_vocab: int) -> int:
    """The head's draft vocabulary size: draft.vocab_subset, or min(EAGLE3_VOCAB, the target's) when it is 0.

    Raises:
        ValueError: a draft vocabulary larger than the target's.
    """
    if requested > target_vocab:
        raise ValueError(
            f"draft.vocab_subset={requested} is larger than the target's vocabulary ({target_vocab} tokens): "
            f"set draft.vocab_subset <= {target_vocab} (0: min({EAGLE3_VOCAB}, {target_vocab}))"
        )
    return requested or min(EAGLE3_VOCAB, target_vocab)


def check_target_config(config: Any, recipe: Recipe) -> None:
    """Refuse, from the target's config alone, a target the head cannot read or a head that cannot fit it.

    Raises:
        ValueError: one line: no per-layer hidden states, aux layer ids outside the target's layers, a draft
            vocabulary larger than the target's.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers, vocab = getattr(text, "num_hidden_layers", None), getattr(text, "vocab_size", None)
    if not isinstance(layers, int) or not isinstance(vocab, int) or not getattr(text, "hidden_size", None):
        raise ValueError(
            f"target.model {recipe.target.model!r} ({getattr(config, 'model_type', '?')}) does not say its decoder "
            "layers, hidden size and vocabulary, so its forward cannot give the per-layer hidden states an EAGLE-3 "
            "head reads: use an HF decoder-only causal LM as the target, or draft.kind=standalone"
        )
    if recipe.draft.aux_layers is not None:
        try:
            eagle3.check_aux_layers(recipe.draft.aux_layers, layers)
        except ValueError as err:
            raise ValueError(f"draft.aux_layers: {err}") from None
    vocab_size(recipe.draft.vocab_subset, vocab)


def initial_head(
    recipe: Recipe, target: nn.Module, draft_ids: Sequence[int], checkpoint: Path | None = None
) -> eagle3.Eagle3Head:
    """The head training starts from, in float32: a checkpoint's (resume), draft.model's (an EAGLE-3 head folder),
    or a fresh one built from the target over `draft_ids`.

    Raises:
        ValueError: draft.model is not an EAGLE-3 head, or its aux layers differ from draft.aux_layers.
    """
    start = checkpoint if checkpoint is not None and eagle3.is_eagle3(checkpoint) else None
    if start is None and recipe.draft.model:
        start = Path(recipe.draft.model)
        if not eagle3.is_eagle3(start):
            raise ValueError(
                f"draft.model {recipe.draft.model!r} is not an EAGLE-3 head folder (config.json with "
                f"architectures [{eagle3.ARCHITECTURE}]): leave draft.model empty to build the head from the target"
            )
    if start is None:
        return eagle3.build(target, draft_ids, recipe.draft.aux_layers)
    head = eagle3.load(start, target).float()
    wanted = recipe.draft.aux_layers
    if wanted is not None and list(wanted) != head.aux_layers:
        raise ValueError(
            f"draft.aux_layers {list(wanted)} differ from the head in {str(start)!r} ({head.aux_layers}): set "
            "draft.aux_layers=null to keep the head's"
        )
    return head


# ---------------------------------------------------------------- the loss


def teacher_log_probs(teacher: torch.Tensor, draft_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The target's log-probabilities of the draft vocabulary's tokens and of the tail bucket (every other token).

    teacher [tokens, V] logits, draft_ids [Vd] target ids -> [tokens, Vd + 1] float32 (log p_tail floored at
    log 1e-30, so a draft vocabulary covering every token still gives finite terms).
    """
    t = teacher.detach()
    # log-sum-exp over the whole vocabulary in float32 chunks of rows: no full-width float32 copy of a batch's logits
    lse = torch.cat([_scaled(c, temperature).logsumexp(-1, keepdim=True) for c in t.split(_ROWS)])
    inside = _scaled(t.index_select(-1, draft_ids.to(t.device)), temperature) - lse
    # the tail is what the draft vocabulary leaves: log(1 - sum p_inside), floored (exact to float32 rounding)
    tail = _log1m_exp(inside.logsumexp(-1, keepdim=True).clamp(max=0.0))
    return torch.cat([inside, tail], -1)


_ROWS = 512  # rows per float32 chunk of the teacher's logits


def _log1m_exp(log_p: torch.Tensor) -> torch.Tensor:
    """log(1 - p) from log p <= 0, floored at log _TAIL_FLOOR."""
    return torch.log((-torch.expm1(log_p)).clamp(min=_TAIL_FLOOR))


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return (logits.float() / temperature).clamp_(min=_LOGIT_FLOOR)


def student_log_probs(student: torch.Tensor, log_tail: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The head's distribution over the same Vd + 1 outcomes: q over the draft vocabulary scaled by the target's
    in-vocabulary mass 1 - p_tail, and the target's own tail mass p_tail in the bucket.

    The head has no tail output: it can only ever propose draft-vocabulary tokens, so the distribution it should
    learn is the target's conditioned on the draft vocabulary, q = p / (1 - p_tail). Pinning the student's tail
    to the teacher's (a constant) makes every divergence here exactly (1 - p_tail) x the divergence of those two
    conditioned distributions: finite, minimised at q = p conditioned on the draft vocabulary, and positions where
    the target writes mostly outside the draft vocabulary (where no draft token could be accepted) weigh less.
    (A tail of 0 would make forward KL infinite; renormalising the teacher alone would weigh all positions alike.)

    student [tokens, Vd] logits (carries the gradient), log_tail [tokens, 1] -> [tokens, Vd + 1] float32.
    """
    log_q = torch.log_softmax((student.float() / temperature).clamp(min=_LOGIT_FLOOR), -1)
    log_inside = _log1m_exp(log_tail)  # log(1 - p_tail)
    return torch.cat([log_q + log_inside, log_tail.expand(-1, 1)], -1)


def step_log_probs(
    student: torch.Tensor, teacher: torch.Tensor, draft_ids: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p_S, log p_T) over the draft vocabulary plus the tail bucket, for rows of one unrolled step.

    student [tokens, Vd] head logits, teacher [tokens, V] target logits of the same rows -> two [tokens, Vd + 1].
    """
    log_pt = teacher_log_probs(teacher, draft_ids, temperature)
    return student_log_probs(student, log_pt[:, -1:], temperature), log_pt


def target_forward(
    target: nn.Module, batch: dict[str, torch.Tensor], aux_layers: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen target on the batch: (features [B, S, 3 * H_target], logits [B, S, V]), one forward."""
    with torch.no_grad():
        out = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    if out.hidden_states is None:
        raise ValueError(
            "the target's forward returned no hidden states (output_hidden_states): use draft.kind=standalone"
        )
    return torch.cat([out.hidden_states[i] for i in aux_layers], -1), out.logits


def step_loss(
    model: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor], cfg: DistillConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted loss of one micro-batch, sum_k w^k loss_k / sum_k w^k, and per step k its loss and the head's
    top-1 agreement with the target (``train/loss_k``, ``train/acc_k``).

    Args:
        model: the prepared :class:`Unrolled` (DDP-wrapped or not).
        batch: :func:`distill.data.collate_training`'s right-padded batch; its loss_mask (distill.loss_positions)
            selects which predicted tokens count, as for a standalone draft.
    """
    head = head_of(getattr(model, "module", model))
    features, teacher = target_forward(target, batch, head.aux_layers)
    valid = batch["attention_mask"].bool()
    positions = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
    outputs = model(batch["input_ids"], features, positions, valid, cfg.ttt_steps)
    draft_ids = head.draft_ids
    # The teacher of every position once (each unrolled step reads the same rows, shifted): [B, S, Vd + 1]
    teacher_lp = teacher_log_probs(teacher.flatten(0, 1), draft_ids, cfg.temperature).view(*valid.shape, -1)
    teacher_top = teacher.argmax(-1)  # [B, S]
    total, weights, stats = None, 0.0, {}
    for k, student in enumerate(outputs):
        # step k at i predicts token i + k + 2, which the target's logits at i + k + 1 predict
        mask = eagle3.step_mask(valid, k) & eagle3.shift_left(batch["loss_mask"], k + 1).bool()
        if not bool(mask.any()):
            continue  # sequences too short for this step
        rows_b, rows_i = mask.nonzero(as_tuple=True)
        s_rows, log_pt = student[rows_b, rows_i], teacher_lp[rows_b, rows_i + k + 1]
        log_ps = student_log_probs(s_rows, log_pt[:, -1:], cfg.temperature)
        loss_k = losses.divergence(log_ps, log_pt, cfg.loss, cfg.beta).mean()
        weight = cfg.step_weight**k
        total = weight * loss_k if total is None else total + weight * loss_k
        weights += weight
        with torch.no_grad():
            same = draft_ids[s_rows.argmax(-1)] == teacher_top[rows_b, rows_i + k + 1]
        stats[f"train/loss_{k}"] = float(loss_k.detach())
        stats[f"train/acc_{k}"] = float(same.float().mean())
    if total is None:
        raise ValueError(
            "mask selects no completion tokens for any unrolled step: every sequence is shorter than 3 tokens "
            "past its prompt; raise distill.max_new_tokens"
        )
    return total / weights, stats
