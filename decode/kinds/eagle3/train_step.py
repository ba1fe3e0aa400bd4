"""Training an EAGLE-3 head (`draft.kind: eagle3`): what train/distill.py's step feeds the head, and its loss.

Each step the frozen target runs once on the batch's sequences, keeping its hidden states at the head's three aux
layers (the head's features) and its last one: its logits are the teacher, so nothing is cached on disk. With
distill.cache_teacher they are kept in memory instead (:class:`TargetCache`), taken while the target generates the
continuations (:class:`GenerationRecorder`), and a step runs the head alone. The head is unrolled for
``distill.ttt_steps`` steps (the training-time test: steps after the first read the head's own output, as in
decoding); step k at position i is compared with the target's distribution at position i + k + 1, over the head's
draft vocabulary plus one tail bucket (:func:`step_log_probs`). Memory grows linearly in the sequence length: the
unroll builds no [S, S] attention scores and forward KL keeps only the head's logits for its backward.

    model = Unrolled(head)                                    # what accelerate prepares (DDP wraps its forward)
    loss, stats = step_loss(model, target, batch, recipe.distill)
    # stats: {"train/loss_0": ..., "train/acc_0": ..., ...} per unrolled step
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from decode.compat import text_config
from decode.kinds.eagle3 import decoding as eagle3
from distill.config import HEAD_VOCAB, DistillConfig, Recipe
from distill.training import losses
from distill.training.teacher_cache import sequence_key

logger = logging.getLogger(__name__)

# Tail mass below this is treated as this (log = -69), so that a draft vocabulary covering every token gives finite
# log-probabilities whose KL terms are 0 (distill.training.losses uses the same floor).
_TAIL_FLOOR = 1e-30
_LOGIT_FLOOR = -1e4  # -inf logits (masked) give p = 0 and a finite log p, as in distill.training.losses


class Unrolled(nn.Module):
    """The head as the training loop's model: its forward is the training-time unroll.

    accelerate prepares this module, so DDP's gradient synchronisation and mixed precision's autocast wrap the
    forward that training calls (``head.unrolled`` is a plain method they would not see). ``head`` is the
    :class:`decode.kinds.eagle3.decoding.Eagle3Head` itself, which evaluation and checkpoints use.
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
        recompute: bool = False,
    ) -> list[torch.Tensor]:
        return self.head.unrolled(ids, features, position_ids, key_valid, steps=steps, recompute=recompute)


def head_of(model: nn.Module) -> eagle3.Eagle3Head:
    """The head inside an (unwrapped) :class:`Unrolled`, or the head itself."""
    return model.head if isinstance(model, Unrolled) else model


# ---------------------------------------------------------------- the draft vocabulary and the head


def vocab_size(requested: int, target_vocab: int) -> int:
    """The head's draft vocabulary size: draft.vocab_subset, or min(HEAD_VOCAB, the target's) when it is 0.

    Raises:
        ValueError: a draft vocabulary larger than the target's.
    """
    if requested > target_vocab:
        raise ValueError(
            f"draft.vocab_subset={requested} is larger than the target's vocabulary ({target_vocab} tokens): "
            f"set draft.vocab_subset <= {target_vocab} (0: min({HEAD_VOCAB}, {target_vocab}))"
        )
    return requested or min(HEAD_VOCAB, target_vocab)


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


def planned_aux_layers(recipe: Recipe, target: nn.Module) -> list[int]:
    """The aux layers a head built from ``target`` reads: draft.aux_layers, else the default (2, L//2, L-3). A head
    started from draft.model reads its own, which may differ."""
    return list(eagle3.head_config(target, 1, recipe.draft.aux_layers).eagle_aux_hidden_state_layer_ids)


# ---------------------------------------------------------------- the loss


def log_sum_exp(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[tokens, V] logits -> [tokens] float32 log-sum-exp of logits / temperature, in float32 chunks of rows (no
    full-width float32 copy of a batch's logits)."""
    return torch.cat([_scaled(c, temperature).logsumexp(-1) for c in logits.detach().split(_ROWS)])


def teacher_log_probs(
    teacher: torch.Tensor, draft_ids: torch.Tensor, temperature: float = 1.0, lse: torch.Tensor | None = None
) -> torch.Tensor:
    """The target's log-probabilities of the draft vocabulary's tokens and of the tail bucket (every other token).

    teacher [tokens, V] logits, draft_ids [Vd] target ids -> [tokens, Vd + 1] float32 (log p_tail floored at
    log 1e-30, so a draft vocabulary covering every token still gives finite terms). ``lse``: the rows'
    :func:`log_sum_exp`, when the caller has it.
    """
    t = teacher.detach()
    lse = log_sum_exp(t, temperature) if lse is None else lse
    return _with_tail(_scaled(t.index_select(-1, draft_ids.to(t.device)), temperature) - lse[:, None])


def _with_tail(inside: torch.Tensor) -> torch.Tensor:
    """[tokens, Vd] log p of the draft vocabulary -> [tokens, Vd + 1] with the tail bucket appended: what the draft
    vocabulary leaves, log(1 - sum p_inside), floored (exact to float32 rounding)."""
    return torch.cat([inside, _log1m_exp(inside.logsumexp(-1, keepdim=True).clamp(max=0.0))], -1)


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


@functools.cache
def keeps_selected_hidden_states() -> bool:
    """Whether the installed transformers reads a list given as ``output_hidden_states`` as the indices, among the
    L + 1 hidden states, to keep (5.25 does). Releases that read it otherwise (5.19 gives L entries, shifted by
    one) get ``True`` instead: all of them, the same numbers with more memory. Probed once on a 2-layer model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                         num_attention_heads=1, num_key_value_heads=1)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    ids = torch.zeros(1, 2, dtype=torch.long)
    with torch.no_grad():
        every = model(input_ids=ids, output_hidden_states=True).hidden_states
        some = model(input_ids=ids, output_hidden_states=[1, -1]).hidden_states
    return (
        isinstance(some, tuple | list)
        and len(some) == len(every)
        and some[1] is not None
        and some[-1] is not None
        and torch.equal(some[1], every[1])
        and torch.equal(some[-1], every[-1])
    )


def target_forward(
    target: nn.Module, batch: dict[str, torch.Tensor], aux_layers: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The frozen target on the batch, one forward: (features [B, S, 3 * H_target], logits [B, S, V], last hidden
    state [B, S, H_target], the input of its output layer).

    The forward keeps only those four of its L + 1 hidden states where transformers' ``output_hidden_states``
    takes the indices to keep (the others come back None and are freed as the forward goes on); elsewhere it keeps
    them all (:func:`keeps_selected_hidden_states`)."""
    wanted: bool | list[int] = [*aux_layers, -1] if keeps_selected_hidden_states() else True
    with torch.no_grad():
        out = target(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            output_hidden_states=wanted,
        )
    if out.hidden_states is None:
        raise ValueError(
            "the target's forward returned no hidden states (output_hidden_states): use draft.kind=standalone"
        )
    return torch.cat([out.hidden_states[i] for i in aux_layers], -1), out.logits, out.hidden_states[-1]


@dataclass
class TargetSide:
    """What the frozen target gives one batch: the head's input and its teacher, per position [B, S, ...]."""

    features: torch.Tensor  # [B, S, 3 * H_target] the aux hidden states
    log_p: torch.Tensor  # [B, S, Vd + 1] float32: log p over the draft vocabulary, then the tail bucket
    top: torch.Tensor  # [B, S] the target's most likely token (for train/acc_k)
    computed: int  # rows the target ran a forward for (the rest came from a TargetCache)


def target_side(
    target: nn.Module,
    batch: dict[str, torch.Tensor],
    head: eagle3.Eagle3Head,
    temperature: float = 1.0,
    cache: TargetCache | None = None,
    keys: Sequence[bytes] | None = None,
) -> TargetSide:
    """The target's side of a batch: from ``cache`` when it holds every row (``keys``: one
    :func:`distill.training.teacher_cache.sequence_key` per row), else from one forward of the target, kept in
    ``cache``."""
    valid = batch["attention_mask"].bool()
    if cache is not None and keys is not None:
        found = cache.batch(keys, valid, head.draft_ids)
        if found is not None:
            return found
    features, logits, last = target_forward(target, batch, head.aux_layers)
    flat = logits.flatten(0, 1)
    lse = log_sum_exp(flat, temperature)
    log_p = teacher_log_probs(flat, head.draft_ids, temperature, lse).view(*valid.shape, -1)
    top = logits.argmax(-1)
    if cache is not None and keys is not None:
        cache.put_batch(keys, valid, features, last, flat, lse, top, head.draft_ids)
    return TargetSide(features, log_p, top, computed=valid.shape[0])


def step_loss(
    model: nn.Module,
    target: nn.Module,
    batch: dict[str, torch.Tensor],
    cfg: DistillConfig,
    cache: TargetCache | None = None,
    keys: Sequence[bytes] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted loss of one micro-batch, sum_k w^k loss_k / sum_k w^k, and per step k its loss and the head's
    top-1 agreement with the target (``train/loss_k``, ``train/acc_k``); ``train/teacher_forwards``: rows the
    target ran a forward for.

    Args:
        model: the prepared :class:`Unrolled` (DDP-wrapped or not).
        batch: :func:`distill.data.prompts.collate_training`'s right-padded batch; its loss_mask
            (distill.loss_positions) selects which predicted tokens count, as for a standalone draft.
        cache, keys: distill.cache_teacher's :class:`TargetCache` and the batch's sequence keys.
    """
    head = head_of(getattr(model, "module", model))
    side = target_side(target, batch, head, cfg.temperature, cache, keys)
    return head_loss(model, side, batch, cfg)


def head_loss(
    model: nn.Module, side: TargetSide, batch: dict[str, torch.Tensor], cfg: DistillConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """:func:`step_loss` given the target's side of the batch: the head's unroll over ``side.features`` and its
    loss against ``side.log_p`` (what a step computes once the target's part is done)."""
    head = head_of(getattr(model, "module", model))
    valid = batch["attention_mask"].bool()
    positions = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
    steps = head.block_size or cfg.ttt_steps  # a P-EAGLE head trains every position of its block
    outputs = model(batch["input_ids"], side.features, positions, valid, steps, recompute=cfg.recompute)
    draft_ids = head.draft_ids
    log_p = side.log_p.flatten(0, 1)  # [B * S, Vd + 1]: each unrolled step reads the same rows, shifted
    # forward KL's terms that depend on the target alone, once per position (see _FklTeacher)
    fkl = _FklTeacher.of(log_p) if cfg.loss == "fkl" else None
    width = valid.shape[1]
    total, weights, stats = None, 0.0, {"train/teacher_forwards": float(side.computed)}
    for k, student in enumerate(outputs):
        # step k at i predicts token i + k + 2, which the target's logits at i + k + 1 predict
        mask = eagle3.step_mask(valid, k) & eagle3.shift_left(batch["loss_mask"], k + 1).bool()
        if not bool(mask.any()):
            continue  # sequences too short for this step
        rows_b, rows_i = mask.nonzero(as_tuple=True)
        student_rows = rows_b * width + rows_i
        teacher_rows = student_rows + k + 1
        if fkl is not None:
            loss_k = fkl.rows(student.flatten(0, 1), teacher_rows, cfg.temperature, student_rows).mean()
        else:
            log_pt = log_p[teacher_rows]
            log_ps = student_log_probs(student[rows_b, rows_i], log_pt[:, -1:], cfg.temperature)
            loss_k = losses.divergence(log_ps, log_pt, cfg.loss, cfg.beta).mean()
        weight = cfg.step_weight**k
        total = weight * loss_k if total is None else total + weight * loss_k
        weights += weight
        with torch.no_grad():
            same = draft_ids[student.argmax(-1)[rows_b, rows_i]] == side.top.flatten()[teacher_rows]
        stats[f"train/loss_{k}"] = float(loss_k.detach())
        stats[f"train/acc_{k}"] = float(same.float().mean())
    if total is None:
        raise ValueError(
            "mask selects no completion tokens for any unrolled step: every sequence is shorter than 3 tokens "
            "past its prompt; raise distill.max_new_tokens"
        )
    return total / weights, stats


@dataclass
class _FklTeacher:
    """Forward KL against the pinned-tail teacher, with the target's terms computed once per batch.

    With the student's tail pinned to the target's (:func:`student_log_probs`), KL(p || p_S) over the Vd + 1
    outcomes is sum_v p_v log p_v - (1 - p_tail) log(1 - p_tail) - sum_v p_v log q_v (v over the draft
    vocabulary): a per-position constant minus a soft-label cross-entropy. It equals losses.divergence(..., "fkl")
    (tested) without building [tokens, Vd + 1] student log-probabilities for every unrolled step.
    """

    p_inside: torch.Tensor  # [rows, Vd] the target's probabilities of the draft vocabulary
    constant: torch.Tensor  # [rows] the terms without the student

    @staticmethod
    def of(log_p: torch.Tensor) -> _FklTeacher:
        inside, log_tail = log_p[:, :-1], log_p[:, -1]
        p = inside.exp()
        # 0 * log 0 is 0: masked tokens (log p = -1e4) give p = 0 exactly
        constant = (p * inside).sum(-1) - p.sum(-1) * _log1m_exp(log_tail)
        return _FklTeacher(p, constant)

    def rows(
        self, student: torch.Tensor, rows: torch.Tensor, temperature: float, student_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[tokens] KL of the head's logits against the teacher's rows ``rows`` [tokens]: ``student`` [tokens, Vd],
        or with ``student_rows`` [tokens] the rows of ``student`` [N, Vd] to read (no copy of them is made)."""
        if student_rows is None:
            student_rows = torch.arange(student.shape[0], device=student.device)
        expected = _ExpectedLogQ.apply(student, student_rows, self.p_inside, rows, temperature)
        return self.constant[rows] - expected


class _ExpectedLogQ(torch.autograd.Function):
    """sum_v p_v log q_v for rows of the head's logits, q = softmax(clamp(logits / T)): forward KL's term with the
    student, computed in chunks of rows and differentiated by hand (d/dz = p - q sum_v p_v).

    Autograd would keep, for every unrolled step, three [rows, Vd] float32 tensors (the scaled logits, log q and
    the gathered p); this keeps the logits alone, which the head computed anyway.

    forward(logits [N, Vd], rows [n], p [M, Vd], p_rows [n], temperature) -> [n] float32, row j from logits[rows[j]]
    and p[p_rows[j]].
    """

    @staticmethod
    def forward(ctx, logits, rows, p, p_rows, temperature):
        ctx.save_for_backward(logits, rows, p, p_rows)
        ctx.temperature = temperature
        return torch.cat(
            [
                (p[pr] * torch.log_softmax(_scaled(logits[r], temperature), -1)).sum(-1)
                for r, pr in zip(rows.split(_ROWS), p_rows.split(_ROWS))
            ]
        )

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        logits, rows, p, p_rows = ctx.saved_tensors
        temperature = ctx.temperature
        out = torch.zeros_like(logits)
        for r, pr, g in zip(rows.split(_ROWS), p_rows.split(_ROWS), grad.split(_ROWS)):
            scaled = logits[r].float() / temperature
            q = scaled.clamp(min=_LOGIT_FLOOR).softmax(-1)
            pc = p[pr]
            kept = scaled >= _LOGIT_FLOOR  # clamp's gradient: none where it clamped
            out[r] = ((pc - q * pc.sum(-1, keepdim=True)) * kept * (g[:, None] / temperature)).to(out.dtype)
        return out, None, None, None, None


# ---------------------------------------------------------------- the target's side, kept for the steps


class TargetCache:
    """distill.cache_teacher for a head: the target's side of each training sequence, kept in memory (while the
    target generates it, :class:`GenerationRecorder`, or on the first step that runs the target on it), so that
    a step over kept sequences runs the head alone.

    Per real token it keeps the three aux hidden states and the last hidden state (the output layer's input) in
    the target's dtype, the log-sum-exp of its logits and its top token: the teacher's log-probabilities over the
    draft vocabulary are rebuilt from the last hidden state and the output layer's draft rows (Vd of its V rows).
    SmolLM2-135M: 4.6 kB a token, 0.92 GB per process for the recipe's 3299 sequences on 2 processes. A target
    whose logits are not its output layer over that state (a scale, a soft cap beyond Gemma 2's) is found on the
    first batch: the cache then keeps nothing and every step runs the target. Rows past ``max_gb`` are not kept.
    """

    def __init__(self, target: nn.Module, temperature: float, max_gb: float) -> None:
        self.temperature = temperature
        self.max_bytes = int(max_gb * 1e9)
        out = target.get_output_embeddings()
        self._weight = out.weight if out is not None else None
        self._bias = getattr(out, "bias", None)
        self._softcap = getattr(text_config(target), "final_logit_softcapping", None)
        self._entries: dict[bytes, tuple[torch.Tensor, ...]] = {}
        self.nbytes = 0
        self.usable: bool | None = None if self._weight is not None else False  # None: not checked yet

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def _inside_logits(self, last: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
        """The target's logits of the draft vocabulary from its last hidden state, [n, H] -> [n, Vd] float32."""
        ids = draft_ids.to(self._weight.device)
        logits = last.to(self._weight.dtype) @ self._weight[ids].T
        if self._bias is not None:
            logits = logits + self._bias[ids]
        logits = logits.float()
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def _log_p(self, last: torch.Tensor, lse: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
        return _with_tail(_scaled(self._inside_logits(last, draft_ids), self.temperature) - lse[:, None])

    def put_batch(
        self,
        keys: Sequence[bytes],
        valid: torch.Tensor,
        features: torch.Tensor,
        last: torch.Tensor,
        logits: torch.Tensor,
        lse: torch.Tensor,
        top: torch.Tensor,
        draft_ids: torch.Tensor,
    ) -> None:
        """Keep each row's real tokens (``logits`` [B * S, V] and their ``lse`` [B * S] as the step computed)."""
        rows = valid.flatten()
        if not self.check(last.flatten(0, 1)[rows], logits[rows], draft_ids):
            return
        lse = lse[rows]
        lengths = valid.sum(-1).tolist()
        starts = [0, *itertools.accumulate(lengths)]
        for b, key in enumerate(keys):
            n = lengths[b]
            self.put(key, features[b, :n], last[b, :n], lse[starts[b] : starts[b] + n], top[b, :n])

    def check(self, last: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor) -> bool:
        """Whether rows can be kept: on the first call, are the target's ``logits`` [n, V] its output layer over
        its ``last`` hidden states [n, H] (compared on the columns ``ids``)? Later calls return that answer."""
        if self.usable is None:
            rebuilt = self._inside_logits(last, ids)
            given = logits.index_select(-1, ids.to(logits.device)).float()
            # a scale or a cap differs by far more than the rounding of the target's dtype (2 bf16 steps)
            self.usable = bool(torch.allclose(rebuilt, given, rtol=2**-6, atol=1e-3))
            if not self.usable:
                gap = float((rebuilt - given).abs().max())
                logger.warning(
                    "distill.cache_teacher: the target's logits are not its output layer over its last hidden "
                    "state (largest gap %.3g), so nothing is kept and every step runs the target",
                    gap,
                )
        return bool(self.usable)

    def put(
        self, key: bytes, features: torch.Tensor, last: torch.Tensor, lse: torch.Tensor, top: torch.Tensor
    ) -> None:
        """Keep one sequence's target side, [n, ...] per real token, unless it is kept already or past max_gb."""
        entry = (_owned(features), _owned(last), _owned(lse), top.to("cpu", torch.int32))
        size = sum(t.numel() * t.element_size() for t in entry)
        if key in self._entries or self.nbytes + size > self.max_bytes:
            return
        self._entries[key] = entry
        self.nbytes += size

    def batch(self, keys: Sequence[bytes], valid: torch.Tensor, draft_ids: torch.Tensor) -> TargetSide | None:
        """The batch's :class:`TargetSide` rebuilt from kept rows, or None unless every row is kept."""
        found = [self._entries.get(k) for k in keys]
        if not self.usable or any(entry is None for entry in found):
            return None
        if [e[0].shape[0] for e in found] != valid.sum(-1).tolist():
            return None  # kept for other token positions than this batch has (cannot happen with sequence keys)
        device, (b, s) = valid.device, valid.shape
        feats, last, lse, top = (torch.cat([e[j] for e in found]).to(device) for j in range(4))
        rows = valid.flatten()
        log_p_rows = self._log_p(last, lse, draft_ids)
        # padding positions (never trained): probability 0 inside, everything in the tail
        log_p = log_p_rows.new_full((b * s, log_p_rows.shape[1]), _LOGIT_FLOOR)
        log_p[:, -1] = 0.0
        log_p[rows] = log_p_rows
        features = feats.new_zeros(b * s, feats.shape[-1])
        features[rows] = feats
        top_all = torch.zeros(b * s, dtype=torch.long, device=device)
        top_all[rows] = top.long()
        return TargetSide(features.view(b, s, -1), log_p.view(b, s, -1), top_all.view(b, s), computed=0)


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU in storage of its own: a row view of a batch tensor would keep the whole batch (its
    padding too) alive for as long as the entry."""
    t = t.detach().cpu()
    whole = t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole else t.clone()


class GenerationRecorder:
    """Fills a :class:`TargetCache` while the target generates the training continuations, so that no training
    step runs the target for them: the target's forwards in generation already computed every position's hidden
    states and logits (the ``observer`` of :func:`decode.speculative.target_generate`).

        recorder = GenerationRecorder(cache, head_aux_layers)
        completions = <target_generate(..., observer=recorder) over a batch of prompts>
        recorder.finish(prompts, completions)   # keeps each sequence under its sequence_key, then forgets the batch
    """

    def __init__(self, cache: TargetCache, aux_layers: Sequence[int]) -> None:
        self.cache = cache
        self.layers = [*aux_layers, -1]  # the features, then the last hidden state (the output layer's input)
        self._parts: dict[int, list[tuple[torch.Tensor, ...]]] = {}

    def seen(self, rows: list[int], logits: torch.Tensor, states: torch.Tensor, valid: torch.Tensor | None) -> None:
        """One forward's inputs: ``rows`` the batch rows they belong to, ``valid`` [B, q] False on padding."""
        if self.cache.usable is False:
            return
        hidden = states.shape[-1] // len(self.layers)
        flat = logits.flatten(0, 1)
        lse = log_sum_exp(flat, self.cache.temperature).view(logits.shape[:2])
        top = logits.argmax(-1)
        real = torch.ones(logits.shape[:2], dtype=torch.bool, device=logits.device) if valid is None else valid
        if self.cache.usable is None:
            last = states[..., -hidden:].flatten(0, 1)[real.flatten()]
            if not self.cache.check(last, flat[real.flatten()], top[real].unique()):
                self._parts.clear()
                return
        for b, row in enumerate(rows):
            m = real[b].to(states.device)
            self._parts.setdefault(row, []).append((states[b, m].cpu(), lse[b, m].cpu(), top[b, m].cpu()))

    def finish(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]) -> None:
        """Keep row i's states under ``sequence_key(prompts[i], completions[i])``, then forget the batch."""
        for row, (prompt, completion) in enumerate(zip(prompts, completions)):
            parts = self._parts.get(row)
            if not parts:
                continue
            states, lse, top = (torch.cat([p[j] for p in parts]) for j in range(3))
            if states.shape[0] != len(prompt) + len(completion):
                continue  # not every position was seen (cannot happen with target_generate's observer)
            hidden = states.shape[-1] // len(self.layers)
            self.cache.put(sequence_key(prompt, completion), states[:, :-hidden], states[:, -hidden:], lse, top)
        self._parts.clear()
