"""How far a distillation run is through its budget, and the lr that follows from it.

`train.schedule_by` picks the horizon: `steps` (train.max_steps) or `minutes` (train.max_minutes of training
clock, with max_steps as a cap). The same progress drives the lr decay and `distill.source: schedule`, so both
reach their end when the budget runs out rather than at a step count the run may never get to.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from distill.config import TrainConfig


def budget_progress(step: int, elapsed_s: float, cfg: TrainConfig) -> float:
    """The fraction of the training budget spent, in [0, 1].

    schedule_by=steps: step / max_steps. schedule_by=minutes: the larger of elapsed / max_minutes and
    step / max_steps, so whichever limit ends the run also ends the schedule.
    """
    by_steps = step / cfg.max_steps
    if cfg.schedule_by == "steps":
        return min(1.0, by_steps)
    by_time = elapsed_s / (cfg.max_minutes * 60.0)
    return min(1.0, max(by_steps, by_time))


def lr_multiplier(step: int, elapsed_s: float, cfg: TrainConfig) -> float:
    """Multiplier of the peak lr: linear warm-up over `warmup_steps`, then cosine / linear decay to 10% (or
    constant) over the budget's progress (:func:`budget_progress`)."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.lr_scheduler == "constant":
        return 1.0
    if cfg.schedule_by == "steps":
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    else:
        # warm-up is a handful of steps against a budget of minutes: decay over the whole budget's progress
        progress = budget_progress(step, elapsed_s, cfg)
    if cfg.lr_scheduler == "linear":
        return 1.0 - 0.9 * progress
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


class TrainClock:
    """The training seconds the lr schedule reads; the loop sets `elapsed_s` before each `scheduler.step()`.

    A plain holder rather than the timer itself: the scheduler is built (and restored by --resume) before the
    loop's timer exists.
    """

    def __init__(self) -> None:
        self.elapsed_s = 0.0


def build_budget_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig, clock: TrainClock
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over :func:`lr_multiplier`. The lambda is a closure, not an object, so a checkpoint's
    scheduler state holds only the step count and a resumed run reads the clock it is given."""
    factor: Callable[[int], float] = lambda step: lr_multiplier(step, clock.elapsed_s, cfg)  # noqa: E731
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
