"""How far a distillation run is through its budget, and the lr that follows from it.

`train.schedule_by` picks the horizon: `steps` (train.max_steps) or `minutes` (train.max_minutes of training
clock, with max_steps as a cap). The same progress drives the lr decay and `distill.source: schedule`, so both
reach their end when the budget runs out rather than at a step count the run may never get to.

The training clock holds the target's continuations generated before the first step as well as the steps;
`eval.every_minutes` counts only the minutes of steps (:attr:`TrainClock.step_s`), and
:class:`GenerationWatch` warns when the generation alone is on course to take more than half of the budget.
"""

from __future__ import annotations

import math
import sys
import time
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
    loop's timer exists. The loop sets `elapsed_s` from the clock every process agrees on, so what is read off it
    (the lr, `step_s` and the minute marks of eval.every_minutes) is the same on every rank.
    """

    def __init__(self) -> None:
        self.elapsed_s = 0.0
        self.steps_from_s = 0.0  # the reading at which the run's first optimizer step began (start_steps)

    def start_steps(self, done_s: float = 0.0) -> None:
        """Call once, just before this session's first step, with `elapsed_s` set: from here `step_s` counts.
        `done_s`: the step seconds a resumed run spent before (its checkpoint's), which `step_s` continues."""
        self.steps_from_s = self.elapsed_s - done_s

    @property
    def step_s(self) -> float:
        """Training-clock seconds since the run's first optimizer step: what eval.every_minutes counts. The target's
        continuations generated before that step are on the training clock but not in this, so a long generation
        cannot bring an evaluation of a draft that has barely trained forward."""
        return self.elapsed_s - self.steps_from_s


def build_budget_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig, clock: TrainClock
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over :func:`lr_multiplier`. The lambda is a closure, not an object, so a checkpoint's
    scheduler state holds only the step count and a resumed run reads the clock it is given."""
    factor: Callable[[int], float] = lambda step: lr_multiplier(step, clock.elapsed_s, cfg)  # noqa: E731
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def generation_warning(
    spent_s: float, done: int, total: int, max_minutes: float, first_s: float = 0.0, first_done: int = 0
) -> str | None:
    """The warning line when generating the target's continuations before the first step is on course to take
    more than half of `max_minutes` (train.max_minutes; 0: no budget, no warning): `done` of `total` prompts in
    `spent_s` seconds, the rest projected at the rate since the first batch (`first_done` prompts in `first_s`
    seconds; 0, 0: from the start). None while it is not.

    The first batch carries the engine's start-up (vLLM: a minute of loading and compiling), so a projection from
    it alone would be far too high. The prompts come shortest first, so the projection tends to err low rather
    than high, and it passes half the budget at the latest when the generation itself does."""
    if max_minutes <= 0 or done <= 0 or total <= 0:
        return None
    rate_s = (spent_s - first_s) / (done - first_done) if done > first_done else 0.0
    projected_min = (spent_s + (total - done) * rate_s) / 60.0
    if projected_min <= max_minutes / 2:
        return None
    return (
        f"warning: generating the target's continuations will take about {projected_min:.1f} of the "
        f"train.max_minutes={max_minutes:g} training minutes ({done} of {total} prompts in {spent_s / 60:.1f} min), "
        "leaving under half for training steps: use fewer prompts (data.max_train_prompts), shorter continuations "
        "(distill.max_new_tokens) or a larger train.max_minutes"
    )


class GenerationWatch:
    """The per-batch callback of the generation before the first step (`RolloutSource.pregenerate(on_batch=...)`,
    called with prompts done and total): prints :func:`generation_warning`'s line once, when `enabled` (the main
    process). Its seconds count from its construction, just before the generation starts; the rate it projects
    from is the one after the first batch (start-up excluded)."""

    def __init__(self, max_minutes: float, enabled: bool = True, write: Callable[[str], None] | None = None) -> None:
        self.max_minutes = max_minutes
        self.enabled = enabled
        self.write = write or _write_above_the_bar
        self.start = time.perf_counter()
        self.first: tuple[float, int] | None = None  # seconds and prompts at the first batch's end
        self.warned = False

    def __call__(self, done: int, total: int) -> None:
        if self.warned or not self.enabled:
            return
        spent_s = time.perf_counter() - self.start
        if self.first is None:
            self.first = (spent_s, done)
        line = generation_warning(spent_s, done, total, self.max_minutes, *self.first)
        if line is not None:
            self.warned = True
            self.write(line)


def _write_above_the_bar(line: str) -> None:
    """One line on stderr that the generation's progress bar does not overwrite."""
    from tqdm.auto import tqdm

    tqdm.write(line, file=sys.stderr)
