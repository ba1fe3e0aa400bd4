"""Block anchors (``distill.anchors``): the positions of each sequence whose blocks a step trains, drawn at random
among its trainable positions, afresh for every micro-batch of a run and the same again on ``--resume``.

Kind-agnostic: a block kind decides which positions are trainable and what a block at an anchor is; the draw and
its seed are shared (every kind whose ``trains_anchors`` trait is set draws here).
"""

from __future__ import annotations

import torch


def pick_anchors(trainable: torch.Tensor, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """N anchors per row drawn at random without replacement among the ``trainable`` [B, S] positions:
    (anchors [B, N] long, chosen [B, N] bool; a row with fewer than N trainable positions fills the rest with
    unchosen ones). ``seed`` (:func:`anchor_seed`) makes a fresh draw for every micro-batch of a run."""
    score = torch.rand(trainable.shape, generator=torch.Generator().manual_seed(seed)).to(trainable.device)
    top = score.masked_fill(~trainable, -1.0).topk(min(n, trainable.shape[1]), dim=1)
    return top.indices, top.values >= 0


def anchor_seed(seed: int, micro_batch: int, rank: int) -> int:
    """The anchor draw's seed for one micro-batch: a function of train.seed, the micro-batch's place in the run
    (accelerate's step counter, which its saved state carries, so a resumed run draws what the uninterrupted one
    would) and the process. A seed taken from the batch's tokens would repeat the same draw every epoch."""
    return (seed * 1_000_003 + micro_batch) * 1_009 + rank


def step_seed(accelerator, seed: int) -> int:
    """:func:`anchor_seed` of the micro-batch ``accelerator`` is at (called inside ``accelerator.accumulate``,
    which has counted this micro-batch in ``accelerator.step``) on this process."""
    return anchor_seed(seed, accelerator.step, accelerator.process_index)
