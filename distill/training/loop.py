"""The pieces of train/distill.py's loop: evaluating and saving a checkpoint, the shared training clock, and the
checks that stop a run (NaN/inf loss or weights, train.max_minutes).

    checkpoint = CheckpointContext(accelerator, draft, kind.served, target, tokenizer, eval_rows, recipe, state,
                                   metrics, draft_vocab)
    evaluate_and_save(checkpoint, step, loss, train_s)      # collective: every process calls it
"""

from __future__ import annotations

import errno
import math
import os
import shutil
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from distill.config import Recipe
from distill.kinds import StepLoss
from distill.publishing.hub import first_line
from distill.training import distributed, interrupt
from distill.training.checkpoints import (
    DiskFullError,
    as_disk_error,
    low_on_space,
    newest_checkpoint,
    tied_weights_quiet,
    write_json_atomic,
)
from distill.training.helpers import (
    MetricsLog,
    Timer,
    eval_metrics,
    evaluate,
    plot_base_vs_best,
    plot_eval,
    read_samples,
    summary_table,
)
from distill.training.run_state import RunState

EVAL_ERROR = "eval_error.txt"  # in the run directory: the traceback of an evaluation that failed


class EvaluationFailed(RuntimeError):
    """An evaluation raised; the checkpoint was saved with its training state (resume-only)."""


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or inf; the message names the step and the last good checkpoint."""


@dataclass
class CheckpointContext:
    """What evaluating and saving a checkpoint needs from the run."""

    accelerator: Any
    draft: torch.nn.Module  # as prepared (wrapped)
    served: Callable[[torch.nn.Module], torch.nn.Module]  # the draft kind's: the model as evaluated and saved
    target: torch.nn.Module
    tokenizer: Any
    eval_rows: list
    recipe: Recipe
    state: RunState
    metrics: MetricsLog
    draft_vocab: list[int] | None


def evaluate_and_save(ctx: CheckpointContext, step: int, loss: float | None, train_s: float) -> None:
    """The checkpoint of `step` (`train_s` training seconds in): evaluated on the main process, then saved by every
    process."""
    acc = ctx.accelerator
    result, failed = None, None
    # all ranks join the gather of a sharded draft; the others then wait (train.dist_timeout_minutes)
    full = distributed.full_draft(ctx.draft, acc.unwrap_model(ctx.draft), acc.is_main_process, acc.device)
    if full is not None:
        full = ctx.served(full)  # an EAGLE-3 head: the head, not its training unroll
    if acc.is_main_process:
        tmp = ctx.state.tmp_dir(step)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with ctx.state.clock.evaluating():
            try:
                result = interrupt.evaluation(ctx.state, loss, lambda: evaluate_checkpoint(
                    full, ctx.target, ctx.tokenizer, ctx.eval_rows, ctx.recipe, tmp / "samples.jsonl",
                    draft_vocab=ctx.draft_vocab,
                ))  # fmt: skip
            except Exception as err:  # noqa: BLE001 - whatever broke the evaluation, the training is kept
                if out_of_space(err):  # its samples could not be written: no evaluation failed
                    raise checkpoint_write_error(err, ctx.state, step) from None
                failed = err
                ctx.state.pending_eval = {"loss": loss}  # saved as resume-only; --resume evaluates it first
                try:
                    (ctx.state.out / EVAL_ERROR).write_text(traceback.format_exc())
                except OSError as write_err:
                    raise checkpoint_write_error(write_err, ctx.state, step) from None
        if result is not None:  # None: an interrupt cut it short, and the checkpoint keeps the training state alone
            result.update(train_loss=loss, step=step, train_minutes=train_s / 60.0)
            try:
                log_evaluation(ctx.metrics, result, ctx.eval_rows, step, tmp)
            except Exception as err:
                raise checkpoint_write_error(err, ctx.state, step) from None
    save_checkpoint(acc, ctx.state, full, ctx.tokenizer, step, result)
    if acc.is_main_process and failed is not None:
        raise EvaluationFailed(
            f"the evaluation of step {step} failed ({type(failed).__name__}: {first_line(failed)}; traceback in "
            f"{ctx.state.out / EVAL_ERROR}); the training state of step {step} is saved: fix the cause and rerun "
            "with --resume, which evaluates it first"
        ) from failed


def evaluate_checkpoint(
    draft: torch.nn.Module,
    target: torch.nn.Module,
    tokenizer,
    eval_rows: list[dict],
    recipe: Recipe,
    samples_out: Path,
    draft_vocab: list[int] | None = None,
) -> dict:
    """The bench JSON of the draft as it is now (main process), timed `eval.repeats` times. It carries the
    95% interval on the speedup (`speedup.vs_target_ci95`, null where the bench cannot give one), which best
    selection uses to tell progress from timing noise."""
    result = evaluate(target, draft, tokenizer, eval_rows, recipe, samples_out=samples_out, draft_vocab=draft_vocab)
    result["speedup"].setdefault("vs_target_ci95", None)
    return result


def log_evaluation(metrics: MetricsLog, result: dict, eval_rows: list[dict], step: int, directory: Path) -> None:
    """Log one evaluation (metrics.jsonl, W&B scalars, plot and samples) and print its line."""
    metrics.log(eval_metrics(result), step=step)
    plot = plot_eval(result, directory / "per_position_acceptance.png", step)
    metrics.log_rich(result, read_samples(directory / "samples.jsonl", eval_rows), step, plot)
    ci = result["speedup"].get("vs_target_ci95")
    noise = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""
    tqdm.write(
        f"eval step {step}: acceptance {result['acceptance_rate']:.3f}  tau {result['mean_accepted_length']:.2f}"
        f"  speedup {result['speedup']['vs_target']:.2f}x{noise}"
    )


def save_checkpoint(
    accelerator, state: RunState, full: torch.nn.Module | None, tokenizer, step: int, result: dict | None
) -> None:
    """checkpoints/step-N atomically: every process writes its training state into the temporary directory,
    the main process adds the draft (`full`: a plain, unsharded copy, see distributed.full_draft) and `result`
    (its eval.json), renames it into place, updates best/ and keeps the top-k. Collective: every process calls
    it."""
    accelerator.wait_for_everyone()
    try:
        with tied_weights_quiet():
            accelerator.save_state(str(state.tmp_dir(step) / "state"))
        if accelerator.is_main_process:
            state.finish_checkpoint(full, tokenizer, step, result, state.tmp_dir(step))
    except Exception as err:
        raise checkpoint_write_error(err, state, step) from None
    accelerator.wait_for_everyone()


def save_state_only(accelerator, state: RunState, step: int) -> None:
    """A resume-only checkpoint (no eval) between evaluations: train.save_every. Collective."""
    tmp = state.tmp_dir(step)
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        with tied_weights_quiet():
            accelerator.save_state(str(tmp / "state"))
        if accelerator.is_main_process:
            state.finish_state_only(step, tmp)
    except Exception as err:
        raise checkpoint_write_error(err, state, step) from None
    accelerator.wait_for_everyone()


def out_of_space(err: BaseException) -> bool:
    """Whether `err` is a write that failed for lack of space (the disk or the user's quota)."""
    disk = as_disk_error(err, Path("."), full=False)
    return disk is not None and disk.errno in (errno.ENOSPC, errno.EDQUOT)


def checkpoint_write_error(err: Exception, state: RunState, step: int) -> Exception:
    """What a failed write of checkpoint `step` raises, after removing its temporary directory (the previous
    checkpoints and best/ are untouched): a one-line DiskFullError naming checkpoints/step-N, or the file
    outside it that failed (best/, base_eval.json, metrics.jsonl), and the space free there; `err` itself when
    it is no write failure."""
    tmp, final = state.tmp_dir(step), state.ckpt_root / f"step-{step}"
    full = low_on_space(tmp)  # before the partial files go, which free the space again
    shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(err, DiskFullError) and err.path is not None and not err.path.is_relative_to(tmp):
        return err
    if isinstance(err, DiskFullError):  # a file inside the temporary directory: the checkpoint is named
        err = OSError(err.errno, os.strerror(err.errno))
    return as_disk_error(err, final, full) or err


def write_report(state: RunState, checksums: list[float], world: int) -> None:
    """report.json, the base-vs-best table and the per-position acceptance plot."""
    report = state.report(checksums, world)
    write_json_atomic(state.out / "report.json", report)
    state.write_marker(report["clock"])
    png = state.out / "acceptance_base_vs_best.png"
    try:
        plot = plot_base_vs_best(report["base"], report["best"], png)
    except OSError as err:
        png.unlink(missing_ok=True)  # half a picture
        raise as_disk_error(err, png) from None
    table = summary_table(report["base"], report["best"], report["best_step"], report["clock"], report["selection"])
    print("\n" + table)
    print(f"\nbest draft: {state.out / 'best'}\nreport: {state.out / 'report.json'}\nplot: {plot}")


def check_weights_finite(model: torch.nn.Module, step: int, ckpt_root: Path) -> None:
    """Name divergence as such when the draft's weights hold NaN or inf."""
    if not all(torch.isfinite(p).all() for p in model.parameters() if p.requires_grad):
        raise NonFiniteLoss(
            f"the draft's weights became NaN or inf before step {step + 1}; last good checkpoint: "
            f"{last_good(ckpt_root)}. Lower train.lr or enable train.max_grad_norm, then rerun with --resume"
        )


def last_good(ckpt_root: Path) -> str:
    found = newest_checkpoint(ckpt_root)
    return str(found[1]) if found else "none"


def check_finite(accelerator, loss: torch.Tensor, step: int, ckpt_root: Path) -> None:
    """Stop on NaN/inf loss on any rank, naming the step and the last good checkpoint."""
    bad = accelerator.gather(torch.tensor([0.0 if torch.isfinite(loss) else 1.0], device=loss.device)).sum()
    if bad > 0:
        value = float(loss)
        what = "NaN" if math.isnan(value) else ("inf" if math.isinf(value) else "NaN or inf on another rank")
        raise NonFiniteLoss(
            f"loss is {what} at step {step + 1}; last good checkpoint: {last_good(ckpt_root)}. "
            "Lower train.lr or check the data, then rerun with --resume"
        )


def shared_elapsed_s(accelerator, timer: Timer) -> float:
    """The training clock all ranks agree on (their mean), so a time-based lr and data schedule stay identical
    across processes."""
    if accelerator.num_processes == 1:
        return timer.elapsed_s
    return float(accelerator.reduce(torch.tensor([timer.elapsed_s], device=accelerator.device), reduction="mean"))


def crossed_minute_mark(before_s: float, after_s: float, every_minutes: float) -> bool:
    """True when the clock passed a multiple of `every_minutes` (eval.every_minutes; 0: never) during the step that
    moved it from `before_s` to `after_s` seconds (eval.every_minutes' clock: the minutes of steps)."""
    if every_minutes <= 0:
        return False
    period_s = every_minutes * 60.0
    return math.floor(after_s / period_s) > math.floor(before_s / period_s)


def time_is_up(accelerator, timer: Timer) -> bool:
    """All ranks stop together when the main process's clock runs out."""
    flag = torch.tensor([1.0 if timer.expired() else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum") > 0) if accelerator.num_processes > 1 else bool(flag)


# ---------------------------------------------------------------- one optimizer step's figures


@dataclass
class StepTally:
    """One optimizer step's sums over its `grad_accum` micro-batches, for its train/* line."""

    grad_accum: int
    rollout_s: float = 0.0  # seconds spent sampling the step's rollouts
    loss_tokens: int = 0  # completion tokens in the loss
    batch_tokens: int = 0  # non-padding prompt + completion tokens
    loss_sum: float = 0.0
    agree_sum: float = 0.0
    teacher_forwards: int = 0  # sequences the target had to score (the rest came from distill.cache_teacher)
    stats: dict[str, float] = field(default_factory=dict)  # the kind's further figures, mean over micro-batches

    def add(self, step: StepLoss, batch: dict[str, torch.Tensor]) -> None:
        """Count one micro-batch's step."""
        self.teacher_forwards += step.teacher_forwards
        for key, value in step.stats.items():
            self.stats[key] = self.stats.get(key, 0.0) + value / self.grad_accum
        self.loss_tokens += int(batch["loss_mask"].sum())
        self.batch_tokens += int(batch["attention_mask"].sum())
        self.loss_sum += float(step.loss.detach())
        self.agree_sum += step.agreement

    @property
    def loss(self) -> float:
        """This process's mean micro-batch loss."""
        return self.loss_sum / self.grad_accum


def step_metrics(
    accelerator: Any,
    tally: StepTally,
    lr: float,
    tokens: int,
    elapsed_s: float,
    on_policy: bool,
    train_s: float,
    step_s: float,
    teachers: Any,
) -> dict[str, float]:
    """The train/* figures of one optimizer step (`tokens`: every process's, in `elapsed_s`; `train_s`: the
    training clock, `step_s`: its seconds since the first step). Collective: the loss is every process's mean."""
    loss = accelerator.gather(torch.tensor([tally.loss], device=accelerator.device)).mean().item()
    return {
        "train/loss": loss,
        "train/lr": lr,
        "train/tokens_per_s": tokens / elapsed_s,
        "train/top1_agreement": tally.agree_sum / tally.grad_accum,
        "train/rollout_s": tally.rollout_s,
        "train/on_policy": float(on_policy),
        "train/minutes": train_s / 60.0,
        "train/step_minutes": step_s / 60.0,
        **tally.stats,
        **(
            {
                # sequences of this step the target had to score (the rest came from the cache)
                "train/teacher_forwards": tally.teacher_forwards,
                "train/teacher_cache_gb": teachers.nbytes / 1e9,
            }
            if teachers is not None
            else {}
        ),
    }
