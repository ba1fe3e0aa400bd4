"""Distil a draft model toward its target; pick the checkpoint by measured speculative-decoding speedup.

    # offline quickstart (builds a small local target/draft pair on first use, ~15 min on 2 CPU cores)
    python train/distill.py
    # a recipe, with overrides
    accelerate launch train/distill.py --recipe recipes/quickstart.yaml train.max_steps=100 eval.every=25
    # 2 CPU processes (DDP over gloo); GPUs: --config_file recipes/accelerate/multi_gpu.yaml
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 train/distill.py --recipe R.yaml
    # continue after a crash or kill, from the newest complete checkpoint
    accelerate launch train/distill.py --recipe R.yaml --resume
    # show the resolved recipe and exit
    python train/distill.py --recipe R.yaml --print-config

Writes under output_dir (DESIGN.md "Distill run directory"): resolved_recipe.yaml, metrics.jsonl,
checkpoints/step-N/ (draft + eval.json + training state), best/ (merged, loadable), report.json.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a source checkout without installing

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from distill.checkpoints import (  # noqa: E402
    CheckpointInfo,
    DiskFullError,
    as_disk_error,
    atomic_dir,
    clean_temporaries,
    disk_error_message,
    newest_checkpoint,
    prune_checkpoints,
    select_best,
    steps_to_keep,
    write_json_atomic,
)
from distill.config import Recipe, RecipeError, dump_recipe, load_recipe, save_recipe, to_dict  # noqa: E402
from distill.training import (  # noqa: E402
    MetricsLog,
    Timer,
    batch_indices,
    build_optimizer,
    build_scheduler,
    eval_metrics,
    fail,
    param_checksum,
    plot_base_vs_best,
    plot_eval,
    read_json,
    read_samples,
    step_generator,
    summary_table,
    tracker_setup,
)

QUICKSTART = REPO / "recipes" / "quickstart.yaml"


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or inf; the message names the step and the last good checkpoint."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", help=f"YAML recipe (default: {QUICKSTART.relative_to(REPO)})")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    parser.add_argument("--overwrite", action="store_true", help="delete an earlier run in output_dir first")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the cached quickstart pair")
    parser.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-4 eval.every=50")
    return parser.parse_intermixed_args(argv)


# ---------------------------------------------------------------- setup helpers


def prepare_output_dir(out: Path, resume: bool, overwrite: bool) -> None:
    """Create output_dir, refusing to mix two runs in one directory."""
    try:
        if overwrite and out.exists() and not resume:
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise DiskFullError(err.errno, disk_error_message(err, out)) from None
    if not resume and ((out / "checkpoints").exists() or (out / "report.json").exists()):
        raise RecipeError(
            f"output_dir {str(out)!r} holds an earlier run: pass --resume to continue it, --overwrite to replace "
            "it, or set output_dir=... to a new directory"
        )


def resolve_local_artifacts(recipe: Recipe, rebuild: bool, is_main: bool) -> None:
    """Fill in the quickstart pair and prompt files when the recipe asks for them (build_pair: quickstart)."""
    if recipe.build_pair != "quickstart":
        return
    from distill.quickstart import ensure_quickstart_assets

    assets = ensure_quickstart_assets(rebuild=rebuild and is_main, progress=is_main)
    recipe.target.model = recipe.target.model or str(assets["target"])
    recipe.draft.model = recipe.draft.model or str(assets["draft"])
    recipe.data.train_prompts = recipe.data.train_prompts or str(assets["train_prompts"])
    recipe.data.eval_prompts = recipe.data.eval_prompts or str(assets["eval_prompts"])


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        recipe = load_recipe(args.recipe or QUICKSTART, args.overrides)
    except RecipeError as err:
        fail(str(err))
    if args.print_config:
        print(dump_recipe(recipe), end="")
        return
    try:
        run(recipe, args)
    except KeyboardInterrupt:
        fail("interrupted; resume with --resume")
    except (RecipeError, ValueError, FileNotFoundError, DiskFullError, NonFiniteLoss) as err:
        fail(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)


def run(recipe: Recipe, args: argparse.Namespace) -> None:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from distill import data, draft_init, losses, models, prompt_gen, rollouts

    # ---- setup
    out = Path(recipe.output_dir).resolve()
    ckpt_root = out / "checkpoints"
    is_main = int(os.environ.get("RANK", "0")) == 0
    if is_main:
        prepare_output_dir(out, args.resume, args.overwrite)
    log_with, init_kwargs = tracker_setup(recipe.log, out, is_main)
    accelerator = Accelerator(
        log_with=log_with or None,
        project_dir=str(out),
        gradient_accumulation_steps=recipe.train.grad_accum,
        mixed_precision=recipe.train.mixed_precision,
    )
    set_seed(recipe.train.seed)
    with accelerator.main_process_first():
        resolve_local_artifacts(recipe, args.rebuild, accelerator.is_main_process)
        draft_init.resolve_draft_init(recipe, out)  # draft.init=truncate: build the draft from the target once
    if accelerator.is_main_process:
        clean_temporaries(ckpt_root)
        save_recipe(recipe, out)
    rank, world = accelerator.process_index, accelerator.num_processes

    # ---- models
    with accelerator.main_process_first():
        tokenizer = models.load_tokenizer(recipe.target.model, recipe.target, key="target.model")
        target = models.load_target(recipe.target, device=accelerator.device)
        draft = models.load_draft(
            recipe.draft, device=accelerator.device, gradient_checkpointing=recipe.train.gradient_checkpointing
        )
        draft_tokenizer = models.load_tokenizer(recipe.draft.model, recipe.draft, key="draft.model")
    vocab_size = models.check_compatible(target, draft, tokenizer, draft_tokenizer)

    # ---- data
    with accelerator.main_process_first():  # generate:magpie prompts are sampled once, by the main process
        train_rows, eval_rows = prompt_gen.load_train_eval(
            recipe.data, target, tokenizer, target_name=recipe.target.model, seed=recipe.train.seed,
            cache_dir=Path(recipe.distill.cache_dir) if recipe.distill.cache_dir else out / "rollout_cache",
        )  # fmt: skip
    context = models.context_length(target, draft)
    train_prompts = data.encode_prompts(
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

    # ---- optimizer
    optimizer = build_optimizer(draft, recipe.train)
    scheduler = build_scheduler(optimizer, recipe.train)

    # ---- prepare
    draft, optimizer, scheduler = accelerator.prepare(draft, optimizer, scheduler)
    accelerator.init_trackers(recipe.log.project, config=to_dict(recipe), init_kwargs=init_kwargs)
    metrics = MetricsLog(accelerator, out / "metrics.jsonl")
    history: list[dict] = []
    start_step = 0
    if args.resume:
        found = newest_checkpoint(ckpt_root)
        if found is None:
            if accelerator.is_main_process:
                print(f"--resume: no complete checkpoint in {ckpt_root}, starting from step 0")
        else:
            start_step, path = found
            accelerator.load_state(str(path / "state"))
            history = read_json(path / "trainer_state.json")["history"]
            if accelerator.is_main_process:
                print(f"resumed from {path} (step {start_step})")
    source = rollouts.RolloutSource(
        recipe.distill,
        target,
        tokenizer,
        cache_dir=Path(recipe.distill.cache_dir) if recipe.distill.cache_dir else out / "rollout_cache",
        seed=recipe.train.seed,
        process_index=rank,
        num_draft_tokens=recipe.distill.num_draft_tokens,
    )
    if recipe.distill.source in ("target", "mix") and recipe.distill.cache_rollouts:
        source.pregenerate(
            train_prompts, accelerator.unwrap_model(draft), accelerator=accelerator, batch_size=recipe.train.batch_size
        )

    def evaluate_and_save(step: int, loss: float | None) -> None:
        """Eval on the main process, checkpoint atomically (all ranks write their state), keep top-k."""
        tmp = ckpt_root / f".tmp-step-{step}"
        result = None
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            result = evaluate_checkpoint(accelerator.unwrap_model(draft), step, loss, tmp)
        accelerator.wait_for_everyone()
        try:
            accelerator.save_state(str(tmp / "state"))
            if accelerator.is_main_process:
                finish_checkpoint(accelerator.unwrap_model(draft), step, result, tmp)
        except Exception as err:
            shutil.rmtree(tmp, ignore_errors=True)
            disk = as_disk_error(err, ckpt_root / f"step-{step}")
            if disk is None:
                raise
            raise disk from None
        accelerator.wait_for_everyone()

    def evaluate_checkpoint(unwrapped: torch.nn.Module, step: int, loss: float | None, tmp: Path) -> dict:
        from distill.training import evaluate

        result = evaluate(target, unwrapped, tokenizer, eval_rows, recipe, samples_out=tmp / "samples.jsonl")
        result["train_loss"] = loss
        result["step"] = step
        values = eval_metrics(result)
        metrics.log(values, step=step)
        plot = plot_eval(result, tmp / "per_position_acceptance.png", step)
        metrics.log_rich(result, read_samples(tmp / "samples.jsonl", eval_rows), step, plot)
        tqdm.write(
            f"eval step {step}: acceptance {result['acceptance_rate']:.3f}  tau {result['mean_accepted_length']:.2f}"
            f"  speedup {result['speedup']['vs_target']:.2f}x"
        )
        return result

    def finish_checkpoint(unwrapped: torch.nn.Module, step: int, result: dict, tmp: Path) -> None:
        nonlocal history
        models.save_draft(unwrapped, tmp, tokenizer)
        write_json_atomic(tmp / "eval.json", result)
        if step == 0:
            write_json_atomic(out / "base_eval.json", result)  # step-0 may be pruned; report.json needs it
        save_recipe(recipe, tmp)
        history = [h for h in history if h["step"] != step]
        history.append(
            CheckpointInfo(
                step, result["speedup"]["vs_target"], result["acceptance_rate"], result["train_loss"]
            ).as_dict()
        )
        write_json_atomic(tmp / "trainer_state.json", {"step": step, "history": history})
        final = ckpt_root / f"step-{step}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        infos = [CheckpointInfo(**h) for h in history]
        best = select_best(infos)
        if best.step == step:
            export_best(final, out / "best")
        prune_checkpoints(ckpt_root, steps_to_keep(infos, recipe.eval.keep_top_k, newest_step=step))

    # ---- loop
    if start_step == 0:
        evaluate_and_save(0, None)
    timer = Timer(recipe.train.max_minutes)
    draft.train()
    last_loss: float | None = None
    step = start_step
    with tqdm(
        total=recipe.train.max_steps, initial=start_step, desc="distill", disable=not accelerator.is_main_process
    ) as bar:
        while step < recipe.train.max_steps:
            t0 = time.perf_counter()
            gen_s, n_tokens, loss_sum, agree_sum = 0.0, 0, 0.0, 0.0
            for micro in range(recipe.train.grad_accum):
                idx = batch_indices(step, micro, recipe.train, len(train_prompts), rank, world)
                g0 = time.perf_counter()
                try:
                    pairs = source.sample(
                        [train_prompts[i] for i in idx],
                        accelerator.unwrap_model(draft),
                        step_generator(recipe.train.seed, step, rank),
                    )
                except RuntimeError:
                    check_weights_finite(draft, step, ckpt_root)  # diverged weights make sampling fail first
                    raise
                gen_s += time.perf_counter() - g0
                batch = data.collate_training(pairs, tokenizer.pad_token_id, device=accelerator.device)
                with accelerator.accumulate(draft):
                    student = draft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                    with torch.no_grad():
                        teacher = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                    loss = losses.distill_loss(
                        student,
                        teacher,
                        batch["loss_mask"],
                        loss=recipe.distill.loss,
                        beta=recipe.distill.beta,
                        temperature=recipe.distill.temperature,
                        top_k=recipe.distill.top_k,
                        vocab_size=vocab_size,
                    )
                    check_finite(accelerator, loss, step, ckpt_root)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients and recipe.train.max_grad_norm > 0:
                        accelerator.clip_grad_norm_(draft.parameters(), recipe.train.max_grad_norm)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                n_tokens += int(batch["loss_mask"].sum())
                loss_sum += float(loss.detach())
                agree_sum += float(
                    losses.top1_agreement(student.detach(), teacher, batch["loss_mask"], vocab_size=vocab_size)
                )
            step += 1
            bar.update(1)
            elapsed = time.perf_counter() - t0
            last_loss = loss_sum / recipe.train.grad_accum
            tokens = int(accelerator.gather(torch.tensor([n_tokens], device=accelerator.device)).sum())
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
                    },
                    step=step,
                )
            bar.set_postfix(loss=f"{last_loss:.4f}", tok_s=f"{tokens / elapsed:.0f}")
            out_of_time = time_is_up(accelerator, timer)
            if step % recipe.eval.every == 0 or step == recipe.train.max_steps or out_of_time:
                evaluate_and_save(step, last_loss)
            elif recipe.train.save_every and step % recipe.train.save_every == 0:
                save_state_only(accelerator, ckpt_root, step, history)
            if out_of_time:
                if accelerator.is_main_process:
                    tqdm.write(f"train.max_minutes={recipe.train.max_minutes} reached at step {step}")
                break

    # ---- save
    checksums = accelerator.gather(
        torch.tensor([param_checksum(draft)], dtype=torch.float64, device="cpu").to(accelerator.device)
    )
    if accelerator.is_main_process:
        write_report(out, ckpt_root, history, checksums.tolist(), world)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if accelerator.is_main_process and recipe.publish.push_to_hub:
        from distill.publish import publish

        print(f"published: {publish(out / 'best', recipe.publish.repo_id, private=recipe.publish.private)}")


def export_best(checkpoint: Path, best: Path) -> None:
    """best/ = the winning checkpoint's merged model, tokenizer, eval.json and recipe (no training state)."""
    with atomic_dir(best) as tmp:
        for item in checkpoint.iterdir():
            if item.name in ("state", "trainer_state.json"):
                continue
            copy = shutil.copytree if item.is_dir() else shutil.copy2
            copy(item, tmp / item.name)


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


def time_is_up(accelerator, timer: Timer) -> bool:
    """All ranks stop together when the main process's clock runs out."""
    flag = torch.tensor([1.0 if timer.expired() else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum") > 0) if accelerator.num_processes > 1 else bool(flag)


def save_state_only(accelerator, ckpt_root: Path, step: int, history: list[dict]) -> None:
    """A resume-only checkpoint (no eval) between evaluations: train.save_every."""
    tmp = ckpt_root / f".tmp-step-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp / "state"))
    if accelerator.is_main_process:
        write_json_atomic(tmp / "trainer_state.json", {"step": step, "history": history})
        os.replace(tmp, ckpt_root / f"step-{step}")
    accelerator.wait_for_everyone()


def write_report(out: Path, ckpt_root: Path, history: list[dict], checksums: list[float], world: int) -> None:
    """report.json (DESIGN.md), the base-vs-best table and the per-position acceptance plot."""
    infos = [CheckpointInfo(**h) for h in history]
    best = select_best(infos)
    best_eval = read_json(out / "best" / "eval.json")
    base_eval = read_json(out / "base_eval.json")
    report = {
        "base": base_eval,
        "best": best_eval,
        "best_step": best.step,
        "checkpoints": sorted(history, key=lambda h: h["step"]),
        "world_size": world,
        "param_checksums": checksums,
    }
    write_json_atomic(out / "report.json", report)
    plot = plot_base_vs_best(base_eval, best_eval, out / "acceptance_base_vs_best.png")
    print("\n" + summary_table(base_eval, best_eval, best.step))
    print(f"\nbest draft: {out / 'best'}\nreport: {out / 'report.json'}\nplot: {plot}")


if __name__ == "__main__":
    main()
