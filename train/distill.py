"""Distil a draft model toward its target; pick the checkpoint by measured speculative-decoding speedup.

    # offline quickstart (builds a small local target/draft pair on first use): about 6 min on 2 CPU cores with
    # native bf16 (AVX512-BF16/AMX), about 24 min with AVX2 only
    python train/distill.py
    # a recipe, with overrides
    accelerate launch train/distill.py --recipe recipes/quickstart.yaml train.max_steps=100 eval.every=25
    # 2 CPU processes (DDP over gloo); GPUs: --config_file recipes/accelerate/multi_gpu.yaml
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 train/distill.py --recipe R.yaml
    # continue after a crash or kill, from the newest complete checkpoint
    accelerate launch train/distill.py --recipe R.yaml --resume
    # show the resolved recipe and exit
    python train/distill.py --recipe R.yaml --print-config

Writes under output_dir (docs/run-directory.md): resolved_recipe.yaml, metrics.jsonl, checkpoints/step-N/
(draft + eval.json + training state), best/ (merged, loadable), report.json. best/ is the checkpoint with the
highest measured speedup beyond the timing noise: a later checkpoint replaces it only when the lower end of its
95% speedup interval is above best's speedup (within the noise, the more tokens per target pass win: tau, then the
later step). train.max_minutes counts the training clock: training steps and the generation of their data, not
evaluation, checkpoints or loading; it continues across --resume. Ctrl-C or SIGTERM stops a run after its
current step and saves that step's resume state (distill/training/interrupt.py); an evaluation is cut short at once.

From Python: `main(argv, on_step=callback)` calls `callback(StepReport)` after every optimizer step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a source checkout without installing

from distill.config import (  # noqa: E402
    Recipe,
    RecipeError,
    build_recipe,
    dump_commented,
    is_multi_kind,
    read_recipe_data,
    to_dict,
)
from distill.training import interrupt  # noqa: E402

QUICKSTART = REPO / "recipes" / "quickstart.yaml"


@dataclass(frozen=True)
class StepReport:
    """What `run(on_step=...)` is told after every optimizer step (on every process, about its own batches)."""

    step: int
    loss: float  # this process's mean micro-batch loss
    tokens: int  # non-padding prompt + completion tokens this process trained on in this step
    micro_batches: int
    train_s: float  # training wall-clock seconds so far (the train.max_minutes clock)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", help=f"YAML recipe (default: {QUICKSTART.relative_to(REPO)})")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    parser.add_argument("--overwrite", action="store_true", help="delete a run already in output_dir first")
    parser.add_argument(
        "--allow-recipe-change",
        action="store_true",
        help="with --resume: continue although the recipe changes keys that alter training or evaluation "
        "(they are printed; without this flag --resume refuses them)",
    )
    parser.add_argument("--rebuild", action="store_true", help="rebuild the cached quickstart pair")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved recipe, each key's help as a comment, and exit"
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-4 eval.every=50")
    return parser.parse_intermixed_args(argv)


# ---------------------------------------------------------------- setup helpers


def resolve_local_artifacts(recipe: Recipe, rebuild: bool, is_main: bool) -> None:
    """Fill in what the recipe leaves empty with the quickstart assets (build_pair: quickstart), building only
    what is missing: the pair (minutes) when target.model or draft.model is empty, the prompt files (seconds)
    when a prompt file is."""
    if recipe.build_pair != "quickstart":
        return
    from distill import kinds
    from distill.data.quickstart import ensure_stdlib_prompts
    from distill.training.pretraining import ensure_quickstart_pair, quickstart_cache_dir

    needs_draft = kinds.get(recipe.draft.kind).TRAITS.loads_draft_model  # else the draft is built from the target
    if rebuild or not (recipe.target.model and (recipe.draft.model or not needs_draft)):
        target, draft = ensure_quickstart_pair(rebuild=rebuild and is_main, progress=is_main)
        recipe.target.model = recipe.target.model or str(target)
        if needs_draft:
            recipe.draft.model = recipe.draft.model or str(draft)
    if rebuild or not (recipe.data.train_prompts and recipe.data.eval_prompts):
        train_prompts, eval_prompts = ensure_stdlib_prompts(quickstart_cache_dir(), rebuild=rebuild and is_main)
        recipe.data.train_prompts = recipe.data.train_prompts or str(train_prompts)
        recipe.data.eval_prompts = recipe.data.eval_prompts or str(eval_prompts)


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None, on_step: Callable[[StepReport], None] | None = None) -> None:
    """The command line. `on_step` (for benchmarks and tests) is called after every optimizer step."""
    args = parse_args(argv)
    # the training side loads torch and transformers (seconds): imported only past the arguments and the recipe, so
    # --help and --print-config answer at once
    try:
        data = read_recipe_data(args.recipe or QUICKSTART, args.overrides)
        if is_multi_kind(data):  # draft.kind a list or auto: the candidates, each a recipe (distill/search.py)
            from distill.search import load_plan

            recipe, plan = None, load_plan(data)
        else:
            recipe, plan = build_recipe(data), None
    except RecipeError as err:
        from distill.training.helpers import fail

        fail(str(err))
    if args.print_config:
        shown = {f"# candidate {k}\n": r for k, r in plan.recipes.items()} if plan else {"": recipe}
        print("".join(title + dump_commented(r) for title, r in shown.items()), end="")
        return
    from distill.training.checkpoints import DiskFullError
    from distill.training.helpers import fail
    from distill.training.loop import EvaluationFailed, NonFiniteLoss

    interrupt.install()  # SIGTERM stops a run like Ctrl-C; in training, after saving the step's state
    try:
        if plan is not None:
            from distill.training.search_run import run_search

            run_search(plan, args, run, on_step=on_step)
        else:
            run(recipe, args, on_step=on_step)
    except KeyboardInterrupt as err:
        fail(interrupt.stopped(err))
    except (RecipeError, ValueError, FileNotFoundError, DiskFullError, NonFiniteLoss, EvaluationFailed) as err:
        fail(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)


def run(
    recipe: Recipe,
    args: argparse.Namespace,
    on_step: Callable[[StepReport], None] | None = None,
    shared: Any = None,
) -> None:
    """One draft's training run. `shared` (a multi-kind run's candidate, distill.training.search_run.Shared): the
    target and tokenizer already loaded, the kinds' stores of the target's side filled as it generated the data
    once for every candidate, and the training minutes this round stops at (train.max_minutes stays the lr
    schedule's horizon)."""
    import torch
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    from distill import draft_init, kinds, models
    from distill.data.prompts import collate_training
    from distill.publishing import gguf
    from distill.training import distributed, preflight, schedule
    from distill.training.build import build_accelerator, build_data, build_source, pregenerate, resume_state
    from distill.training.checkpoints import newest_checkpoint
    from distill.training.engines import measure_extra_engines
    from distill.training.helpers import (
        MetricsLog,
        Timer,
        batch_indices,
        build_optimizer,
        param_checksum,
        step_generator,
    )
    from distill.training.loop import (
        CheckpointContext,
        StepTally,
        check_finite,
        check_weights_finite,
        crossed_minute_mark,
        evaluate_and_save,
        save_state_only,
        shared_elapsed_s,
        step_metrics,
        time_is_up,
        write_report,
    )
    from distill.training.run_state import RunState, check_resume_recipe, prepare_output_dir, run_inputs

    # ---- setup
    kind = kinds.get(recipe.draft.kind)  # how this draft is built, trained, evaluated and saved (distill/kinds/)
    distributed.check_launch(recipe)  # DeepSpeed without CUDA, FSDP with on-policy rollouts...: refuse up front
    preflight.check_inputs(recipe)  # configs, tokenizers, GGUF headers, prompt files: refuse before writing anything
    gguf_plan = gguf.run_plan(recipe)  # export.gguf: llama.cpp, its converter and --spec-type found, or refused
    state = RunState(Path(recipe.output_dir).resolve(), recipe)
    out, ckpt_root = state.out, state.ckpt_root
    is_main = int(os.environ.get("RANK", "0")) == 0
    run_id = prepare_output_dir(out, args.resume, args.overwrite, run_inputs(recipe, args.recipe)) if is_main else None
    accelerator, init_kwargs, mixed_precision = build_accelerator(recipe, out, is_main, run_id)
    set_seed(recipe.train.seed)
    with accelerator.main_process_first():
        resolve_local_artifacts(recipe, args.rebuild, accelerator.is_main_process)
        draft_init.resolve_draft_init(recipe, out)  # draft.init=truncate: build the draft from the target once
    if (note := kinds.engine_limits(recipe, kind)) and accelerator.is_main_process:
        print(note)  # e.g. eval.hf_assisted turned off for a draft HF assisted generation cannot run
    if accelerator.is_main_process:
        if args.resume:  # the resolved recipe is compared with the run's before it is replaced
            for change in check_resume_recipe(out, recipe, args.allow_recipe_change):
                print(f"--resume: recipe changed: {change}")
        state.clean_temporaries()
        state.save_recipe()  # atomic: --resume compares the recipe with it
    rank, world = accelerator.process_index, accelerator.num_processes

    # ---- models
    with accelerator.main_process_first():
        if shared is None:
            tokenizer = models.load_tokenizer(recipe.target.model, recipe.target, key="target.model")
            target = models.load_target(recipe.target, device=accelerator.device)
        else:
            tokenizer, target = shared.tokenizer, shared.target
        draft, draft_tokenizer = kind.load_draft(recipe, accelerator.device)  # None: built below, from the data
    vocab_size = models.check_compatible(target, draft or target, tokenizer, draft_tokenizer or tokenizer)

    # ---- data
    train_prompts, eval_rows = build_data(recipe, accelerator, target, tokenizer, draft, out)
    if accelerator.is_main_process and recipe.train.mixed_precision == "auto":
        print(f"mixed precision: {mixed_precision} (auto)")
    # distill.cache_teacher: the target's side of sequences that come back in later epochs
    teachers = kind.cache_teacher(recipe, target) if shared is None else shared.teachers_of(kind)
    source, pregen = None, Timer(0.0)
    if draft is None:  # built from the target's continuations (a head counts its draft vocabulary on them)
        source = build_source(recipe, target, tokenizer, out, rank, vocab_size)
        recorder = kind.generation_recorder(teachers, recipe, target)
        pregenerate(recipe, source, train_prompts, accelerator, pregen, None, recorder, clock=state.clock)
        found = newest_checkpoint(ckpt_root) if args.resume else None
        draft = kind.build_draft(
            recipe, target, source, train_prompts, vocab_size, teachers, found[1] if found else None, is_main
        )

    # ---- optimizer
    optimizer = build_optimizer(draft, recipe.train)
    clock = schedule.TrainClock()  # the lr decays over train.schedule_by's horizon: steps or training minutes
    scheduler = schedule.build_budget_scheduler(optimizer, recipe.train, clock)

    # ---- prepare
    draft, optimizer, scheduler = accelerator.prepare(draft, optimizer, scheduler)
    engine = distributed.report_engine(accelerator, accelerator.unwrap_model(draft))
    # None (the target alone): a sharded draft, or a kind that cannot draft without the target's states
    rollouts = kind.TRAITS.generates_rollouts
    rollout_draft = distributed.rollout_draft(accelerator.unwrap_model(draft)) if rollouts else None
    accelerator.init_trackers(
        recipe.log.project, config={**to_dict(recipe), "distributed": engine}, init_kwargs=init_kwargs
    )
    metrics = MetricsLog(accelerator, out / "metrics.jsonl")
    start_step = resume_state(accelerator, state, args.resume)
    metrics.log({"distributed": engine}, step=start_step)
    stop_minutes = recipe.train.max_minutes if shared is None else shared.stop_minutes
    timer = Timer(stop_minutes, elapsed_s=state.train_s + pregen.elapsed_s)
    if source is None:  # a loaded draft: the target's continuations are generated now, sped up by it
        source = build_source(recipe, target, tokenizer, out, rank, vocab_size)
        pregenerate(recipe, source, train_prompts, accelerator, timer, rollout_draft, clock=state.clock)
    draft_vocab = kind.decoding_vocab(recipe, source, train_prompts, vocab_size, state, accelerator.is_main_process)
    loss_step = kind.loss_step(accelerator, draft, target, recipe, vocab_size, teachers, draft_vocab)
    checkpoint = CheckpointContext(
        accelerator, draft, kind.served, target, tokenizer, eval_rows, recipe, state, metrics, draft_vocab
    )

    # ---- loop
    step = start_step
    interrupt.arm(accelerator, state, lambda: step, lambda at: save_state_only(accelerator, state, at))
    if state.evaluate_first(recipe.eval.at_start):  # the starting draft; on --resume, an evaluation cut short
        evaluate_and_save(checkpoint, start_step, state.pending_loss, state.train_s)
    clock.elapsed_s = shared_elapsed_s(accelerator, timer)
    clock.start_steps(state.clock.step_s)  # eval.every_minutes counts minutes of steps, continued by --resume
    draft.train()
    with tqdm(
        # schedule_by=minutes: max_steps is only a cap, so the bar counts steps without a misleading total
        total=recipe.train.max_steps if recipe.train.schedule_by == "steps" else None,
        initial=start_step,
        desc="distill",
        disable=not accelerator.is_main_process,
    ) as bar:
        while step < recipe.train.max_steps:
            interrupt.check()  # Ctrl-C, SIGTERM: every process stops here, at the same step, and saves it
            with timer.running():
                t0 = time.perf_counter()
                tally = StepTally(recipe.train.grad_accum)
                clock_before_s = clock.step_s
                for micro in range(recipe.train.grad_accum):
                    idx = batch_indices(step, micro, recipe.train, len(train_prompts), rank, world)
                    g0 = time.perf_counter()
                    try:
                        pairs = source.sample(
                            [train_prompts[i] for i in idx],
                            rollout_draft,
                            step_generator(recipe.train.seed, step, rank),
                            progress=schedule.budget_progress(step, clock.elapsed_s, recipe.train),
                        )
                    except RuntimeError:
                        check_weights_finite(draft, step, ckpt_root)  # diverged weights make sampling fail first
                        raise
                    tally.rollout_s += time.perf_counter() - g0
                    batch = collate_training(
                        pairs, tokenizer.pad_token_id, device=accelerator.device,
                        loss_positions=recipe.distill.loss_positions,
                    )  # fmt: skip
                    with accelerator.accumulate(draft):
                        micro_step = loss_step(batch, pairs, source.last_source == "draft")
                        check_finite(accelerator, micro_step.loss, step, ckpt_root)
                        accelerator.backward(micro_step.loss)
                        if accelerator.sync_gradients and recipe.train.max_grad_norm > 0:
                            accelerator.clip_grad_norm_(draft.parameters(), recipe.train.max_grad_norm)
                        optimizer.step()
                        optimizer.zero_grad()
                    tally.add(micro_step, batch)
                clock.elapsed_s = shared_elapsed_s(accelerator, timer)
                scheduler.step()  # once per optimizer step, on every process alike
                step += 1
                elapsed = time.perf_counter() - t0
                tokens = int(accelerator.gather(torch.tensor([tally.loss_tokens], device=accelerator.device)).sum())
            bar.update(1)
            if step % recipe.log.every == 0 or step == recipe.train.max_steps:
                on_policy = source.last_source == "draft"
                lr = scheduler.get_last_lr()[0]
                figures = step_metrics(
                    accelerator, tally, lr, tokens, elapsed, on_policy, timer.elapsed_s, clock.step_s, teachers
                )
                metrics.log(figures, step=step)
            bar.set_postfix(loss=f"{tally.loss:.4f}", tok_s=f"{tokens / elapsed:.0f}")
            if on_step is not None:
                on_step(StepReport(step, tally.loss, tally.batch_tokens, recipe.train.grad_accum, timer.elapsed_s))
            out_of_time = time_is_up(accelerator, timer)
            state.after_step(step, timer.elapsed_s, clock.step_s)
            # the minute marks are read off the shared clock, so every rank evaluates at the same step
            minute_mark = crossed_minute_mark(clock_before_s, clock.step_s, recipe.eval.every_minutes)
            if step % recipe.eval.every == 0 or step == recipe.train.max_steps or out_of_time or minute_mark:
                evaluate_and_save(checkpoint, step, tally.loss, timer.elapsed_s)
            elif recipe.train.save_every and step % recipe.train.save_every == 0:
                save_state_only(accelerator, state, step)
            if out_of_time:
                if accelerator.is_main_process:
                    what = "train.max_minutes" if shared is None else "this round's training minutes"
                    tqdm.write(f"{what}={stop_minutes:g} reached at step {step}")
                break
    interrupt.finish()  # interrupted in the last step or its evaluation: stop before the report, as check() does

    # ---- save
    checksums = accelerator.gather(
        torch.tensor([param_checksum(draft)], dtype=torch.float64, device="cpu").to(accelerator.device)
    )
    if accelerator.is_main_process:
        write_report(state, checksums.tolist(), world)
        measure_extra_engines(out / "best", recipe, eval_rows)  # best/eval_<engine>.json (eval.extra_engines)
        gguf.export_run(out / "best", recipe, gguf_plan)  # best/draft-<type>.gguf, report.json's gguf
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if accelerator.is_main_process and recipe.publish.push_to_hub:
        from distill.publishing.publish import publish

        trust = recipe.draft.trust_remote_code or recipe.target.trust_remote_code  # this recipe is the user's own
        where = publish(out / "best", recipe.publish.repo_id, private=recipe.publish.private, trust_remote_code=trust)
        print(f"published: {where}")


if __name__ == "__main__":
    main()
