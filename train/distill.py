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
current step and saves that step's resume state (distill/interrupt.py); an evaluation is cut short at once.

From Python: `main(argv, on_step=callback)` calls `callback(StepReport)` after every optimizer step.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a source checkout without installing

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from distill import interrupt  # noqa: E402
from distill.checkpoints import (  # noqa: E402
    DiskFullError,
    as_disk_error,
    newest_checkpoint,
)
from distill.config import Recipe, RecipeError, dump_recipe, load_recipe, save_recipe, to_dict  # noqa: E402
from distill.engines import measure_extra_engines  # noqa: E402
from distill.models import resolve_mixed_precision, slow_bf16_warning  # noqa: E402
from distill.run_state import RunState, check_resume_recipe, prepare_output_dir, run_inputs, trim_metrics  # noqa: E402
from distill.training import (  # noqa: E402
    MetricsLog,
    Timer,
    batch_indices,
    build_optimizer,
    eval_metrics,
    fail,
    param_checksum,
    plot_base_vs_best,
    plot_eval,
    read_samples,
    step_generator,
    summary_table,
    tracker_setup,
)

QUICKSTART = REPO / "recipes" / "quickstart.yaml"


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or inf; the message names the step and the last good checkpoint."""


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
    parser.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-4 eval.every=50")
    return parser.parse_intermixed_args(argv)


# ---------------------------------------------------------------- setup helpers


def resolve_local_artifacts(recipe: Recipe, rebuild: bool, is_main: bool) -> None:
    """Fill in what the recipe leaves empty with the quickstart assets (build_pair: quickstart), building only
    what is missing: the pair (minutes) when target.model or draft.model is empty, the prompt files (seconds)
    when a prompt file is."""
    if recipe.build_pair != "quickstart":
        return
    from distill.pretraining import ensure_quickstart_pair, quickstart_cache_dir
    from distill.quickstart import ensure_stdlib_prompts

    needs_draft = recipe.draft.kind == "standalone"  # an EAGLE-3 head is built from the target
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
    try:
        recipe = load_recipe(args.recipe or QUICKSTART, args.overrides)
    except RecipeError as err:
        fail(str(err))
    if args.print_config:
        print(dump_recipe(recipe), end="")
        return
    interrupt.install()  # SIGTERM stops a run like Ctrl-C; in training, after saving the step's state
    try:
        run(recipe, args, on_step=on_step)
    except KeyboardInterrupt as err:
        fail(interrupt.stopped(err))
    except (RecipeError, ValueError, FileNotFoundError, DiskFullError, NonFiniteLoss) as err:
        fail(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)


def run(recipe: Recipe, args: argparse.Namespace, on_step: Callable[[StepReport], None] | None = None) -> None:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from distill import (
        data,
        distributed,
        draft_init,
        eagle3_train,
        models,
        preflight,
        prompt_gen,
        rollouts,
        schedule,
        subset_loss,
        teacher_cache,
    )

    # ---- setup
    distributed.check_launch(recipe)  # DeepSpeed without CUDA, FSDP with on-policy rollouts...: refuse up front
    preflight.check_inputs(recipe)  # configs, tokenizers, GGUF headers, prompt files: refuse before writing anything
    state = RunState(Path(recipe.output_dir).resolve(), recipe)
    out, ckpt_root = state.out, state.ckpt_root
    is_main = int(os.environ.get("RANK", "0")) == 0
    run_id = prepare_output_dir(out, args.resume, args.overwrite, run_inputs(recipe, args.recipe)) if is_main else None
    log_with, init_kwargs = tracker_setup(recipe.log, out, is_main, run_id=run_id)
    mixed_precision = resolve_mixed_precision(recipe.train.mixed_precision)  # auto: bf16 only where it is native
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
    set_seed(recipe.train.seed)
    with accelerator.main_process_first():
        resolve_local_artifacts(recipe, args.rebuild, accelerator.is_main_process)
        draft_init.resolve_draft_init(recipe, out)  # draft.init=truncate: build the draft from the target once
    head_kind = recipe.draft.kind == "eagle3"  # an EAGLE-3 head over the target's hidden states (distill.eagle3_train)
    if head_kind and recipe.eval.hf_assisted:
        recipe.eval.hf_assisted = False
        if accelerator.is_main_process:
            print("note: eval.hf_assisted=false: HF assisted generation cannot run an EAGLE-3 head")
    if accelerator.is_main_process:
        if args.resume:  # the resolved recipe is compared with the run's before it is replaced
            for change in check_resume_recipe(out, recipe, args.allow_recipe_change):
                print(f"--resume: recipe changed: {change}")
        state.clean_temporaries()
        save_recipe(recipe, out)
    rank, world = accelerator.process_index, accelerator.num_processes

    # ---- models
    with accelerator.main_process_first():
        tokenizer = models.load_tokenizer(recipe.target.model, recipe.target, key="target.model")
        target = models.load_target(recipe.target, device=accelerator.device)
        if head_kind:  # built below, once its draft vocabulary is known
            draft, draft_tokenizer = None, tokenizer
        else:
            draft = models.load_draft(
                recipe.draft, device=accelerator.device, gradient_checkpointing=recipe.train.gradient_checkpointing
            )
            draft_tokenizer = models.load_tokenizer(recipe.draft.model, recipe.draft, key="draft.model")
    vocab_size = models.check_compatible(target, draft or target, tokenizer, draft_tokenizer)

    # ---- data
    prompt_args = dict(
        target_name=recipe.target.model, seed=recipe.train.seed,
        cache_dir=Path(recipe.distill.cache_dir) if recipe.distill.cache_dir else out / "rollout_cache",
    )  # fmt: skip
    if prompt_gen.is_generated(recipe.data.train_prompts):  # every process samples a share of the Magpie prompts
        train_rows, eval_rows = prompt_gen.load_train_eval(
            recipe.data, target, tokenizer, accelerator=accelerator, **prompt_args
        )
    else:
        with accelerator.main_process_first():  # a Hub data set is downloaded once
            train_rows, eval_rows = prompt_gen.load_train_eval(recipe.data, target, tokenizer, **prompt_args)
    context = models.context_length(*[m for m in (target, draft) if m is not None])
    train_prompts = data.encode_examples(
        train_rows,
        tokenizer,
        recipe.data,
        context,
        recipe.distill.max_new_tokens,
        completion_field=recipe.distill.completion_field if recipe.distill.source == "fixed" else None,
    )
    eval_rows = eval_rows[: recipe.eval.num_prompts]
    if accelerator.is_main_process:
        print(f"data: {len(train_prompts)} training prompts, {len(eval_rows)} eval prompts, {world} process(es)")
        if recipe.train.mixed_precision == "auto":
            print(f"mixed precision: {mixed_precision} (auto)")

    def make_source() -> rollouts.RolloutSource:
        return rollouts.RolloutSource(
            recipe.distill,
            target,
            tokenizer,
            cache_dir=Path(recipe.distill.cache_dir) if recipe.distill.cache_dir else out / "rollout_cache",
            seed=recipe.train.seed,
            process_index=rank,
            num_draft_tokens=recipe.distill.num_draft_tokens,
            vocab=vocab_size,
        )

    def pregenerate(
        source: rollouts.RolloutSource, timer: Timer, rollout_draft: torch.nn.Module | None, recorder: Any = None
    ) -> None:
        """The target's continuations, generated before the first step on the training clock (source target/mix
        with the cache): a run is charged for every target forward it needs, as source=schedule's on-demand
        target phase is. `recorder`: an EAGLE-3 head's TargetCache filled as they are generated."""
        if recipe.distill.source not in ("target", "mix") or not recipe.distill.cache_rollouts:
            return
        with timer.running():
            made = source.pregenerate(
                train_prompts,
                rollout_draft,
                accelerator=accelerator,
                batch_size=recipe.distill.pregenerate_batch_size,
                recorder=recorder,
            )
        if accelerator.is_main_process and made:
            total = len(source.cache) if source.cache is not None else made  # every process's, once all are done
            print(f"data: {total} target continuations in {timer.elapsed_s:.2f} s (on the training clock)")
            if recorder is not None:
                kept = len(recorder.cache)
                note = f"({kept} of this process's {made})"
                print(f"distill.cache_teacher: the target's states kept as it generated them {note}")

    def frequent_tokens(source: rollouts.RolloutSource, size: int) -> tuple[list[int], str]:
        """draft.vocab_subset: the `size` tokens most frequent in the training continuations, and where from."""
        cached = source.cache.completions() if source.cache is not None else []
        return draft_vocabulary(size, train_prompts, cached, vocab_size, source.eos_token_id)

    # distill.cache_teacher: the target's side of sequences that come back in later epochs (a standalone draft's
    # top-k teacher rows; a head's hidden states, kept as the target generates the continuations)
    teachers = None
    if recipe.distill.cache_teacher:
        cfg = recipe.distill
        teachers = (
            eagle3_train.TargetCache(target, cfg.temperature, cfg.cache_teacher_gb)
            if head_kind
            else teacher_cache.TeacherCache(cfg.top_k, cfg.temperature, cfg.cache_teacher_gb)
        )
    pregen = Timer(0.0)  # draft.kind=eagle3: its continuations are generated before the head is built
    if head_kind:
        source = make_source()
        aux = eagle3_train.planned_aux_layers(recipe, target)
        recorder = None if teachers is None else eagle3_train.GenerationRecorder(teachers, aux)
        pregenerate(source, pregen, None, recorder)  # the target alone: a fresh head would not speed it up
        ids, where = frequent_tokens(source, eagle3_train.vocab_size(recipe.draft.vocab_subset, vocab_size))
        # --resume: the newest checkpoint's head (its own vocabulary); a resume-only checkpoint holds no head, and
        # the vocabulary above, from the same cached continuations, is the one the run started with
        found = newest_checkpoint(ckpt_root) if args.resume else None
        head = eagle3_train.initial_head(recipe, target, ids, found[1] if found else None)
        if accelerator.is_main_process:
            size, layers = len(head.draft_ids), head.aux_layers
            print(f"eagle3 head: draft vocabulary of {size} of {vocab_size} tokens ({where}), aux layers {layers}")
        if teachers is not None and head.aux_layers != aux:
            teachers.clear()  # draft.model's head reads other layers than those kept while generating
        draft = eagle3_train.Unrolled(head)

    # ---- optimizer
    optimizer = build_optimizer(draft, recipe.train)
    clock = schedule.TrainClock()  # the lr decays over train.schedule_by's horizon: steps or training minutes
    scheduler = schedule.build_budget_scheduler(optimizer, recipe.train, clock)

    # ---- prepare
    draft, optimizer, scheduler = accelerator.prepare(draft, optimizer, scheduler)
    engine = distributed.report_engine(accelerator, accelerator.unwrap_model(draft))
    # None (the target alone): a sharded draft, or an EAGLE-3 head, which cannot generate without the target
    rollout_draft = None if head_kind else distributed.rollout_draft(accelerator.unwrap_model(draft))
    accelerator.init_trackers(
        recipe.log.project, config={**to_dict(recipe), "distributed": engine}, init_kwargs=init_kwargs
    )
    metrics = MetricsLog(accelerator, out / "metrics.jsonl")
    start_step = 0
    if args.resume:
        found = state.restore()
        if found is None:
            if accelerator.is_main_process:
                print(f"--resume: no complete checkpoint in {ckpt_root}, starting from step 0")
        else:
            start_step, path = found
            accelerator.load_state(str(path / "state"))
            if accelerator.is_main_process:
                print(f"resumed from {path} (step {start_step}, {state.train_s / 60:.1f} training minutes)")
        if accelerator.is_main_process:
            trim_metrics(metrics.path, start_step)  # the rows this run writes again
    metrics.log({"distributed": engine}, step=start_step)
    if not head_kind:
        source = make_source()
    timer = Timer(recipe.train.max_minutes, elapsed_s=state.train_s + pregen.elapsed_s)
    if not head_kind:
        pregenerate(source, timer, rollout_draft)

    draft_vocab = None  # an EAGLE-3 head carries its own (head.draft_ids)
    if recipe.draft.vocab_subset and not head_kind:
        cached = source.cache.completions() if source.cache is not None else []  # read once for both uses
        size = recipe.draft.vocab_subset
        draft_vocab, where = draft_vocabulary(size, train_prompts, cached, vocab_size, source.eos_token_id)
        state.draft_vocab = (draft_vocab, vocab_size, where, vocabulary_text(train_prompts, cached)[0])
        if accelerator.is_main_process:
            print(f"draft vocabulary: the {len(draft_vocab)} of {vocab_size} tokens most frequent in the {where}")
    # distill.loss_vocab=subset: the draft's head and the loss cover the draft vocabulary alone
    trained, subset_head, subset_position = accelerator.unwrap_model(draft), None, None
    if recipe.distill.loss_vocab == "subset":
        subset_head = subset_loss.restricted(trained, draft_vocab)
        subset_position = subset_loss.index_of(draft_vocab, vocab_size, device=accelerator.device)

    checkpoint = CheckpointContext(
        accelerator, draft, head_kind, target, tokenizer, eval_rows, recipe, state, metrics, draft_vocab
    )

    # ---- loop
    step = start_step
    interrupt.arm(accelerator, state, lambda: step, lambda at: save_state_only(accelerator, state, at))
    if state.evaluate_first(recipe.eval.at_start):  # the starting draft; on --resume, an evaluation cut short
        evaluate_and_save(checkpoint, start_step, state.pending_loss, state.train_s)
    clock.elapsed_s = shared_elapsed_s(accelerator, timer)
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
                gen_s, n_tokens, batch_tokens, loss_sum, agree_sum = 0.0, 0, 0, 0.0, 0.0
                teacher_forwards = 0
                step_stats: dict[str, float] = {}  # eagle3: per unrolled step k, train/loss_k and train/acc_k
                clock_before_s = clock.elapsed_s
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
                    gen_s += time.perf_counter() - g0
                    batch = data.collate_training(
                        pairs, tokenizer.pad_token_id, device=accelerator.device,
                        loss_positions=recipe.distill.loss_positions,
                    )  # fmt: skip
                    with accelerator.accumulate(draft):
                        if head_kind:  # the target's hidden states and logits, the head unrolled over them
                            keys = None if teachers is None else [teacher_cache.sequence_key(*p) for p in pairs]
                            loss, unrolled = eagle3_train.step_loss(
                                draft, target, batch, recipe.distill, cache=teachers, keys=keys
                            )
                            agreement = unrolled.get("train/acc_0", 0.0)
                            scored = int(unrolled.pop("train/teacher_forwards"))
                            for key, value in unrolled.items():
                                step_stats[key] = step_stats.get(key, 0.0) + value / recipe.train.grad_accum
                        else:
                            with training_head(trained, subset_head):
                                student = draft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                            loss, agreement, scored = step_loss(
                                student.logits, batch, pairs, target, recipe, vocab_size, teachers,
                                source.last_source == "draft", position=subset_position,
                            )  # fmt: skip
                        teacher_forwards += scored
                        check_finite(accelerator, loss, step, ckpt_root)
                        accelerator.backward(loss)
                        if accelerator.sync_gradients and recipe.train.max_grad_norm > 0:
                            accelerator.clip_grad_norm_(draft.parameters(), recipe.train.max_grad_norm)
                        optimizer.step()
                        optimizer.zero_grad()
                    n_tokens += int(batch["loss_mask"].sum())
                    batch_tokens += int(batch["attention_mask"].sum())
                    loss_sum += float(loss.detach())
                    agree_sum += agreement
                clock.elapsed_s = shared_elapsed_s(accelerator, timer)
                scheduler.step()  # once per optimizer step, on every process alike
                step += 1
                elapsed = time.perf_counter() - t0
                last_loss = loss_sum / recipe.train.grad_accum
                tokens = int(accelerator.gather(torch.tensor([n_tokens], device=accelerator.device)).sum())
            bar.update(1)
            if step % recipe.log.every == 0 or step == recipe.train.max_steps:
                metrics.log(
                    {
                        "train/loss": accelerator.gather(torch.tensor([last_loss], device=accelerator.device))
                        .mean()
                        .item(),
                        "train/lr": scheduler.get_last_lr()[0],
                        "train/tokens_per_s": tokens / elapsed,
                        "train/top1_agreement": agree_sum / recipe.train.grad_accum,
                        "train/rollout_s": gen_s,
                        "train/on_policy": float(source.last_source == "draft"),
                        "train/minutes": timer.elapsed_s / 60.0,
                        **step_stats,
                        **(
                            {
                                # sequences of this step the target had to score (the rest came from the cache)
                                "train/teacher_forwards": teacher_forwards,
                                "train/teacher_cache_gb": teachers.nbytes / 1e9,
                            }
                            if teachers is not None
                            else {}
                        ),
                    },
                    step=step,
                )
            bar.set_postfix(loss=f"{last_loss:.4f}", tok_s=f"{tokens / elapsed:.0f}")
            if on_step is not None:
                on_step(StepReport(step, last_loss, batch_tokens, recipe.train.grad_accum, timer.elapsed_s))
            out_of_time = time_is_up(accelerator, timer)
            state.train_s = timer.elapsed_s
            # the minute marks are read off the shared clock, so every rank evaluates at the same step
            minute_mark = crossed_minute_mark(clock_before_s, clock.elapsed_s, recipe.eval.every_minutes)
            if step % recipe.eval.every == 0 or step == recipe.train.max_steps or out_of_time or minute_mark:
                evaluate_and_save(checkpoint, step, last_loss, timer.elapsed_s)
            elif recipe.train.save_every and step % recipe.train.save_every == 0:
                save_state_only(accelerator, state, step)
            if out_of_time:
                if accelerator.is_main_process:
                    tqdm.write(f"train.max_minutes={recipe.train.max_minutes} reached at step {step}")
                break
    interrupt.finish()  # interrupted in the last step or its evaluation: stop before the report, as check() does

    # ---- save
    checksums = accelerator.gather(
        torch.tensor([param_checksum(draft)], dtype=torch.float64, device="cpu").to(accelerator.device)
    )
    if accelerator.is_main_process:
        write_report(state, checksums.tolist(), world)
        measure_extra_engines(out / "best", recipe, eval_rows)  # best/eval_<engine>.json (eval.extra_engines)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if accelerator.is_main_process and recipe.publish.push_to_hub:
        from distill.publish import publish

        print(f"published: {publish(out / 'best', recipe.publish.repo_id, private=recipe.publish.private)}")


# ---------------------------------------------------------------- checkpoints


@dataclass
class CheckpointContext:
    """What evaluating and saving a checkpoint needs from the run."""

    accelerator: Any
    draft: torch.nn.Module  # as prepared (wrapped)
    head_kind: bool  # an EAGLE-3 head: evaluated and saved as served, not as its training unroll
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
    from distill import distributed, eagle3_train

    acc = ctx.accelerator
    result = None
    # all ranks join the gather of a sharded draft; the others then wait (train.dist_timeout_minutes)
    full = distributed.full_draft(ctx.draft, acc.unwrap_model(ctx.draft), acc.is_main_process, acc.device)
    if ctx.head_kind and full is not None:
        full = eagle3_train.head_of(full)
    if acc.is_main_process:
        tmp = ctx.state.tmp_dir(step)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        result = interrupt.evaluation(ctx.state, loss, lambda: evaluate_checkpoint(
            full, ctx.target, ctx.tokenizer, ctx.eval_rows, ctx.recipe, tmp / "samples.jsonl",
            draft_vocab=ctx.draft_vocab,
        ))  # fmt: skip
        if result is not None:  # None: an interrupt cut it short, and the checkpoint keeps the training state alone
            result.update(train_loss=loss, step=step, train_minutes=train_s / 60.0)
            log_evaluation(ctx.metrics, result, ctx.eval_rows, step, tmp)
    save_checkpoint(acc, ctx.state, full, ctx.tokenizer, step, result)


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
    from distill.training import evaluate

    result = evaluate(target, draft, tokenizer, eval_rows, recipe, samples_out=samples_out, draft_vocab=draft_vocab)
    result["speedup"].setdefault("vs_target_ci95", None)
    return result


def draft_vocabulary(
    size: int, examples: list, continuations: list[list[int]], vocab: int, always: list[int]
) -> tuple[list[int], str]:
    """draft.vocab_subset: the `size` ids most frequent in `vocabulary_text`, and where they came from; EOS ids
    are always in."""
    from decode.draft_vocab import frequent_ids

    lists, where = vocabulary_text(examples, continuations)
    return frequent_ids(lists, size, always=always, vocab=vocab), where


def vocabulary_text(examples: list, continuations: list[list[int]]) -> tuple[list[list[int]], str]:
    """The text the draft will draft, as token id lists, and its name: the target's continuations when the run has
    them before its first step (source target/mix with the cache, or a fixed dataset's completions), else the
    training prompts. The draft vocabulary is counted on it and a masked head fitted to it."""
    fixed = [e.completion_ids for e in examples if e.completion_ids]
    if continuations or fixed:
        return continuations + fixed, f"{len(continuations) + len(fixed)} training continuations"
    return [e.prompt_ids for e in examples], f"{len(examples)} training prompts"


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
    tmp = state.tmp_dir(step)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp / "state"))
        if accelerator.is_main_process:
            state.finish_checkpoint(full, tokenizer, step, result, tmp)
    except Exception as err:
        shutil.rmtree(tmp, ignore_errors=True)
        disk = as_disk_error(err, state.ckpt_root / f"step-{step}")
        if disk is None:
            raise
        raise disk from None
    accelerator.wait_for_everyone()


def save_state_only(accelerator, state: RunState, step: int) -> None:
    """A resume-only checkpoint (no eval) between evaluations: train.save_every. Collective."""
    tmp = state.tmp_dir(step)
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp / "state"))
    if accelerator.is_main_process:
        state.finish_state_only(step, tmp)
    accelerator.wait_for_everyone()


def write_report(state: RunState, checksums: list[float], world: int) -> None:
    """report.json, the base-vs-best table and the per-position acceptance plot."""
    from distill.checkpoints import write_json_atomic

    report = state.report(checksums, world)
    write_json_atomic(state.out / "report.json", report)
    plot = plot_base_vs_best(report["base"], report["best"], state.out / "acceptance_base_vs_best.png")
    print("\n" + summary_table(report["base"], report["best"], report["best_step"]))
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


def step_loss(
    student: torch.Tensor,
    batch: dict[str, torch.Tensor],
    pairs: list,
    target: torch.nn.Module,
    recipe: Recipe,
    vocab_size: int | None,
    teachers,
    on_policy: bool,
    position: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float, int]:
    """The recipe's divergence on one micro-batch, the draft's top-1 agreement with the target there, and how many
    of its sequences the target scored: all of them, unless `teachers` (distill.cache_teacher) kept their top-k
    rows from an earlier epoch; on-policy sequences are scored but not kept (they never come back).

    `position` (distill.loss_vocab=subset): the student's logits are over the draft vocabulary (plus its absent
    column) and the teacher's top-k rows are mapped there (distill.subset_loss.restrict_top_k)."""
    from distill import losses, subset_loss, teacher_cache

    cfg, mask = recipe.distill, batch["loss_mask"]
    keep = not on_policy
    if position is not None and teachers is None:  # the top-k rows are computed for this step only
        teachers, keep = teacher_cache.TeacherCache(cfg.top_k, cfg.temperature), False
    if teachers is None:
        with torch.no_grad():
            teacher = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = losses.distill_loss(
            student, teacher, mask, loss=cfg.loss, beta=cfg.beta, temperature=cfg.temperature, top_k=cfg.top_k,
            vocab_size=vocab_size,
        )  # fmt: skip
        agreement = losses.top1_agreement(student.detach(), teacher, mask, vocab_size=vocab_size)
        return loss, float(agreement), len(pairs)
    keys = [teacher_cache.sequence_key(p, c) for p, c in pairs]
    top_ids, log_pt, scored = teacher_cache.teacher_rows(
        teachers, keys, batch, target, keep=keep, vocab_size=vocab_size
    )
    width = vocab_size
    if position is not None:
        top_ids, log_pt = subset_loss.restrict_top_k(top_ids, log_pt, position)
        width = None  # the restricted logits are all compared
    loss = losses.distill_loss_top_k(
        student, mask, top_ids, log_pt, loss=cfg.loss, beta=cfg.beta, temperature=cfg.temperature,
        vocab_size=width,
    )  # fmt: skip
    agreement = teacher_cache.top1_agreement_top_k(student.detach(), mask, top_ids, width)
    return loss, float(agreement), scored


def training_head(model: torch.nn.Module, head: torch.nn.Module | None) -> contextlib.AbstractContextManager:
    """distill.loss_vocab=subset: the draft's restricted `head` for the training forward; else nothing."""
    from distill import subset_loss

    return subset_loss.swapped_head(model, head) if head is not None else contextlib.nullcontext()


def shared_elapsed_s(accelerator, timer: Timer) -> float:
    """The training clock all ranks agree on (their mean), so a time-based lr and data schedule stay identical
    across processes."""
    if accelerator.num_processes == 1:
        return timer.elapsed_s
    return float(accelerator.reduce(torch.tensor([timer.elapsed_s], device=accelerator.device), reduction="mean"))


def crossed_minute_mark(before_s: float, after_s: float, every_minutes: float) -> bool:
    """True when the training clock passed a multiple of `every_minutes` (eval.every_minutes; 0: never) during
    the step that moved it from `before_s` to `after_s` seconds."""
    if every_minutes <= 0:
        return False
    period_s = every_minutes * 60.0
    return math.floor(after_s / period_s) > math.floor(before_s / period_s)


def time_is_up(accelerator, timer: Timer) -> bool:
    """All ranks stop together when the main process's clock runs out."""
    flag = torch.tensor([1.0 if timer.expired() else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum") > 0) if accelerator.num_processes > 1 else bool(flag)


if __name__ == "__main__":
    main()
