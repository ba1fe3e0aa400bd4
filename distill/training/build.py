"""The `build_*` helpers of train/distill.py's sections: the accelerator, the data, the rollout source and the
target's continuations generated before the first step, the resumed state.

Each is what one section of the entry script calls; none knows the draft's kind (distill.kinds does).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from distill.config import Recipe
from distill.data import prompt_gen, rollouts
from distill.data.prompts import Example, encode_examples
from distill.models import context_length, resolve_mixed_precision, slow_bf16_warning
from distill.training import distributed, schedule
from distill.training.helpers import Timer
from distill.training.run_state import RunState, trim_metrics
from distill.training.tracking import tracker_setup


def build_accelerator(
    recipe: Recipe, out: Path, is_main: bool, run_id: str | None = None
) -> tuple[Any, dict, str | None]:
    """The run's Accelerator with its trackers (log.report_to; `run_id`: the W&B run a resumed run continues), the
    trackers' init kwargs and the mixed precision it runs (train.mixed_precision=auto: bf16 only where it is
    native; a warning where bf16 is slow)."""
    from accelerate import Accelerator

    log_with, init_kwargs = tracker_setup(recipe.log, out, is_main, run_id=run_id)
    mixed_precision = resolve_mixed_precision(recipe.train.mixed_precision)
    if is_main and (warning := slow_bf16_warning(mixed_precision)):
        print(warning, file=sys.stderr)
    accelerator = Accelerator(
        log_with=log_with or None,
        project_dir=str(out),
        gradient_accumulation_steps=recipe.train.grad_accum,
        mixed_precision=mixed_precision,
        # The loop steps the scheduler once per optimizer step itself: accelerate's default would step it once
        # per process (num_processes times), ending warm-up and decay early under DDP.
        step_scheduler_with_optimizer=False,
        kwargs_handlers=distributed.process_group_kwargs(recipe.train.dist_timeout_minutes),
    )
    return accelerator, init_kwargs, mixed_precision


def rollout_cache_dir(recipe: Recipe, out: Path) -> Path:
    """Where the target's continuations (and generated prompts) are cached: distill.cache_dir, else in the run."""
    return Path(recipe.distill.cache_dir) if recipe.distill.cache_dir else out / "rollout_cache"


def build_data(
    recipe: Recipe,
    accelerator: Any,
    target: torch.nn.Module,
    tokenizer: Any,
    draft: torch.nn.Module | None,
    out: Path,
) -> tuple[list[Example], list[dict]]:
    """The encoded training prompts (cut to the models' context) and the eval rows (eval.num_prompts of them);
    prints the data line on the main process. ``draft``: None while the kind builds it later."""
    cache_dir = rollout_cache_dir(recipe, out)
    prompt_args = dict(target_name=recipe.target.model, seed=recipe.train.seed, cache_dir=cache_dir)
    if prompt_gen.is_generated(recipe.data.train_prompts):  # every process samples a share of the Magpie prompts
        train_rows, eval_rows = prompt_gen.load_train_eval(
            recipe.data, target, tokenizer, accelerator=accelerator, **prompt_args
        )
    else:
        with accelerator.main_process_first():  # a Hub data set is downloaded once
            train_rows, eval_rows = prompt_gen.load_train_eval(recipe.data, target, tokenizer, **prompt_args)
    context = context_length(*[m for m in (target, draft) if m is not None])
    train_prompts = encode_examples(
        train_rows,
        tokenizer,
        recipe.data,
        context,
        recipe.distill.max_new_tokens,
        completion_field=recipe.distill.completion_field if recipe.distill.source == "fixed" else None,
    )
    eval_rows = eval_rows[: recipe.eval.num_prompts]
    if accelerator.is_main_process:
        world = accelerator.num_processes
        print(f"data: {len(train_prompts)} training prompts, {len(eval_rows)} eval prompts, {world} process(es)")
    return train_prompts, eval_rows


def build_source(
    recipe: Recipe, target: torch.nn.Module, tokenizer: Any, out: Path, rank: int, vocab_size: int
) -> rollouts.RolloutSource:
    """The recipe's rollout source (distill.source) bound to the target and this process's cache."""
    return rollouts.RolloutSource(
        recipe.distill,
        target,
        tokenizer,
        cache_dir=rollout_cache_dir(recipe, out),
        seed=recipe.train.seed,
        process_index=rank,
        num_draft_tokens=recipe.distill.num_draft_tokens,
        vocab=vocab_size,
    )


def pregenerate(
    recipe: Recipe,
    source: rollouts.RolloutSource,
    train_prompts: list[Example],
    accelerator: Any,
    timer: Timer,
    rollout_draft: torch.nn.Module | None,
    recorder: Any = None,
    *,
    clock: Any,
) -> None:
    """The target's continuations, generated before the first step on the training clock (source target/mix
    with the cache): a run is charged for every target forward it needs, as source=schedule's on-demand target
    phase is. `rollout_draft`: the draft that speeds them up (None: the target alone); `recorder`: the kind's
    distill.cache_teacher store filled as they are generated (an EAGLE-3 head's TargetCache); `clock`: the run's
    clock split (RunState.clock), charged with the minutes generating."""
    if recipe.distill.source not in ("target", "mix") or not recipe.distill.cache_rollouts:
        return
    watch = schedule.GenerationWatch(recipe.train.max_minutes, accelerator.is_main_process)
    with timer.running(), clock.generating():
        if recipe.data.engine == "vllm":  # vLLM generates them, the target alone (distill/data/vllm_rollouts.py)
            from distill.data.vllm_rollouts import pregenerate_with_vllm

            made = pregenerate_with_vllm(
                recipe, source, train_prompts, accelerator=accelerator, recorder=recorder, on_batch=watch
            )
        else:
            made = source.pregenerate(
                train_prompts,
                rollout_draft,
                accelerator=accelerator,
                batch_size=recipe.distill.pregenerate_batch_size,
                recorder=recorder,
                on_batch=watch,
            )
    if accelerator.is_main_process and made:
        total = len(source.cache) if source.cache is not None else made  # every process's, once all are done
        print(f"data: {total} target continuations in {timer.elapsed_s:.2f} s (on the training clock)")
        if recorder is not None:
            kept = len(recorder.cache)
            note = f"({kept} of this process's {made})"
            print(f"distill.cache_teacher: the target's states kept as it generated them {note}")


def resume_state(accelerator: Any, state: RunState, resume: bool) -> int:
    """--resume: load the newest complete checkpoint's training state (models, optimizer, scheduler, RNG) and
    return its step; 0 when there is none or the run starts afresh."""
    if not resume:
        return 0
    found = state.restore()
    if found is None:
        if accelerator.is_main_process:
            print(f"--resume: no complete checkpoint in {state.ckpt_root}, starting from step 0")
            trim_metrics(state.out / "metrics.jsonl", None)  # every row: the run starts over
        return 0
    start_step, path = found
    accelerator.load_state(str(path / "state"))
    if accelerator.is_main_process:
        print(f"resumed from {path} (step {start_step}, {state.train_s / 60:.1f} training minutes)")
        trim_metrics(state.out / "metrics.jsonl", start_step)  # the rows this run writes again
    return start_step
