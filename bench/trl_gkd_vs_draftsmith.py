"""draftsmith's train/distill.py against TRL's GKDTrainer: same pair, prompts, loss and budget, one evaluator.

Both sides train the recipe's draft toward its target with the recipe's own settings (`Shared` below, printed at
the start): its loss, batch size, lr, warm-up, optimizer settings, max prompt length, new tokens per continuation,
generation temperature and share of on-policy (draft-generated) continuations. Each side trains for `--minutes` of
*training* wall-clock (model loading, snapshots and evaluation are off the clock on both sides) and keeps a
snapshot of its draft at `--marks` equally spaced minute marks up to `--minutes`. Then one function
(`distill.training.helpers.evaluate`, what train/distill.py evaluates with: greedy speculative decoding, gamma 4,
64 new tokens, the first `--eval-prompts` dev prompts) evaluates the base draft and every snapshot of both sides.

Printed: a markdown table with, per side and per mark, training minutes, optimizer steps, training tokens/s,
acceptance, tau (mean accepted length) and measured speedup over target-only decoding; then per side the final
draft's acceptance and speedup and the minutes it took to first pass the base draft's acceptance.

    pip install trl==1.16.0     # not a draftsmith dependency; tested with 1.16.0
    OMP_NUM_THREADS=1 python bench/trl_gkd_vs_draftsmith.py --minutes 20 --parallel --json trl.json \\
        [key.sub=value ...]     # recipe overrides for both sides, e.g. target.model=PAIR/target

`--parallel` trains both sides at the same time, each process pinned to its own CPUs (`--threads` each, so it
needs 2 x --threads CPUs), and splits the evaluation over two pinned processes; without it the processes run
one after the other (the default). Expected wall time of `--minutes 20 --parallel` with the defaults (5 marks,
30 eval prompts) on 2 CPU cores: about 32 min: 20 min of training, ~2 min of loading and draftsmith's
1-prompt in-run evaluations, ~10 min evaluating 11 drafts (base + 5 per side, 6 per process at ~1.5 min each;
evaluate() also times target-only decoding, for the speedup column). Sequential: about 60 min.

`--stop-after M` trains only the first M minutes of the `--minutes` budget (both sides keep that budget's lr and
data schedule) and keeps the marks up to M: fine marks where they matter for "minutes to first pass the base
draft", without evaluating a snapshot every half minute of the whole budget. E.g. `--minutes 20 --marks 40
--stop-after 4`: the first 4 minutes of the 20-minute runs, a snapshot every 30 s.

The mapping (TRL 1.16.0, `trl.experimental.gkd`):
* Loss: TRL's generalized JSD(beta) uses `F.kl_div(student_log_probs, teacher_log_probs)` at beta = 0, which is
  KL(teacher || student): forward KL. So the recipe's `fkl` is beta = 0, `rkl` beta = 1 (KL(student ||
  teacher)), `jsd` the recipe's `distill.beta` (the same convention as draftsmith's). TRL has no TVD, and its
  loss runs at temperature 1.0 over the full vocabulary: recipes with `distill.loss: tvd`,
  `distill.temperature` other than 1 or `distill.top_k` are refused.
* On-policy share: TRL's `lmbda` is the probability that a batch is draft-generated; the rest is
  target-generated (`seq_kd=True`). The recipe's `source: schedule` (target until `switch_at`, on-policy after)
  maps to lmbda = 1 - switch_at; `mix` to its `mix_lambda`; `draft` to 1 and `target` to 0.
* Generation: `max_new_tokens` and the recipe's `distill.gen_temperature`; at 0 the TRL side generates greedily
  (the subclass sets `do_sample=False`, as GKD samples by default).
* Prompts: tokenised once by draftsmith's `encode_examples` (left cut to `data.max_prompt_tokens`, BOS kept) and
  given to TRL as token ids, so both see identical prompt tokens. The data order differs (each side's seeded
  shuffle).
* Loss normalisation: TRL's trainer divides by `num_items_in_batch`, counted from the collator's labels before
  GKD replaces them with generated ones (0 here, as prompts have no completions); the subclass passes None so
  that TRL averages over the generated tokens, as draftsmith does.
* Throughput: tokens are the non-padding prompt + completion tokens of every training batch (attention mask sum
  after generation), counted by the same rule on both sides, over each side's training clock.

Differences by design (`differences`, printed too where they apply):
* Order of the continuations: draftsmith's `source: schedule` trains on target continuations for the first
  `switch_at` of the clock, then on-policy; TRL draws the source at random per step with probability lmbda.
* Loss positions: draftsmith's `distill.loss_positions: all` also trains on the prompt's positions; TRL only on
  the completion.
* lr schedule: draftsmith's decays (`train.lr_scheduler`) over the training minutes (`train.schedule_by:
  minutes`, forced here so that the schedule and `switch_at` span `--minutes`); TRL's schedulers count steps,
  so its lr stays constant after the same warm-up.
* Clocks: draftsmith's is its own `train.max_minutes` clock (training steps only); TRL's a TrainerCallback
  started at `on_train_begin` and paused while it saves a snapshot. Each stops after the step that crosses the
  budget. draftsmith's snapshots are the checkpoints of one run with `eval.every_minutes = minutes / marks`.

Internal: `--worker draftsmith|trl|eval --spec JSON` runs one side in a subprocess (started by this script).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_RECIPE = "recipes/stdlib-30m_stdlib-3.7m_full_greedy.yaml"
TRL_VERSION = "1.16.0"
NO_STEP_LIMIT = 100_000  # the wall-clock budget ends training, never the step count
STATS_FILE = "bench_stats.json"
SNAPSHOT_FILE = "snapshot.json"  # beside each TRL snapshot: training seconds, step and tokens at that point
RECIPE_FILE = "bench_recipe.yaml"  # the resolved recipe (overrides applied) every worker reads
SIDES = {"trl": "TRL GKDTrainer", "draftsmith": "draftsmith"}


@dataclasses.dataclass(frozen=True)
class Shared:
    """Every setting both sides train and evaluate with, read from the recipe; each side's config is derived."""

    loss: str = "fkl"  # the recipe's distill.loss
    beta: float = 0.0  # TRL's generalized-JSD beta for that loss (trl_beta: 0 is forward KL)
    source: str = "schedule"  # the recipe's distill.source
    lmbda: float = 0.7  # TRL: probability that a batch is draft-generated (trl_lmbda); target-generated else
    max_new_tokens: int = 64  # continuation length
    gen_temperature: float = 1.0  # generation temperature of the continuations (0: greedy)
    loss_positions: str = "completion"  # draftsmith's distill.loss_positions (TRL: the completion)
    lr: float = 1e-3
    warmup_steps: int = 20  # linear warm-up
    lr_scheduler: str = "cosine"  # draftsmith's decay after warm-up, over the training minutes
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.95)  # draftsmith's AdamW betas
    max_grad_norm: float = 1.0
    batch_size: int = 16  # prompts per optimizer step
    grad_accum: int = 1
    max_prompt_tokens: int = 192
    seed: int = 0
    mixed_precision: str = "no"
    log_every: int = 5  # optimizer steps between train logs (both log at the same rate)
    eval_gamma: int = 4
    eval_new_tokens: int = 64


def differences(s: Shared) -> list[str]:
    """What the two sides do differently by design, for these settings (printed and in the JSON)."""
    found = []
    if s.source == "schedule":
        found.append(
            "continuation order: draftsmith's source=schedule is target-generated until switch_at of the clock, "
            "then on-policy; TRL draws draft or target at random per step (probability lmbda)"
        )
    if s.loss_positions == "all":
        found.append(
            "loss positions: draftsmith's distill.loss_positions=all also trains on the prompt's positions; TRL "
            "on the completion only"
        )
    if s.lr_scheduler != "constant":
        found.append(
            f"lr schedule: draftsmith decays ({s.lr_scheduler}) over the training minutes after warm-up; TRL's "
            "schedulers count steps, so its lr is constant after the same warm-up"
        )
    found.append("data order: each side's own seeded shuffle of the same prompt tokens")
    return found


def trl_beta(loss: str, beta: float) -> float:
    """TRL's generalized-JSD beta for a draftsmith loss: beta 0 is KL(teacher || student) in TRL's
    `generalized_jsd_loss` (forward KL), beta 1 KL(student || teacher) (reverse KL)."""
    mapping = {"fkl": 0.0, "rkl": 1.0, "jsd": beta}
    if loss not in mapping:
        raise ValueError(f"distill.loss={loss}: TRL's GKD has no such loss; use fkl, rkl or jsd")
    return mapping[loss]


def trl_lmbda(source: str, switch_at: float, mix_lambda: float) -> float:
    """TRL's on-policy probability for a draftsmith data source (the rest is target-generated, seq_kd)."""
    mapping = {"schedule": 1.0 - switch_at, "mix": mix_lambda, "draft": 1.0, "target": 0.0}
    if source not in mapping:
        raise ValueError(
            f"distill.source={source}: TRL's GKD needs generated continuations; use schedule, mix, draft or target"
        )
    return round(mapping[source], 6)


def shared_from_recipe(recipe: Any) -> Shared:
    """The recipe's settings as both sides use them; ValueError (one line) for what TRL's GKD cannot match."""
    d, t = recipe.distill, recipe.train
    if d.temperature != 1.0 or d.top_k:
        raise ValueError(
            "TRL's GKD loss runs at temperature 1.0 over the full vocabulary: set distill.temperature=1.0 "
            "distill.top_k=0"
        )
    gamma = recipe.eval.num_draft_tokens if isinstance(recipe.eval.num_draft_tokens, int) else 4
    return Shared(
        loss=d.loss,
        beta=trl_beta(d.loss, d.beta),
        source=d.source,
        lmbda=trl_lmbda(d.source, d.switch_at, d.mix_lambda),
        max_new_tokens=d.max_new_tokens,
        gen_temperature=d.gen_temperature,
        loss_positions=d.loss_positions,
        lr=t.lr,
        warmup_steps=t.warmup_steps,
        lr_scheduler=t.lr_scheduler,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        batch_size=t.batch_size,
        grad_accum=t.grad_accum,
        max_prompt_tokens=recipe.data.max_prompt_tokens,
        seed=t.seed,
        mixed_precision=t.mixed_precision,
        log_every=recipe.log.every,
        eval_gamma=gamma,
        eval_new_tokens=recipe.eval.max_new_tokens,
    )


def minute_marks(minutes: float, marks: int, stop_after: float | None = None) -> list[float]:
    """`marks` equally spaced snapshot times (minutes) up to and including `minutes`; with `stop_after`, only
    those up to it (the early part of a `minutes` run)."""
    every = [round(minutes * i / marks, 6) for i in range(1, marks + 1)]
    return every if stop_after is None else [m for m in every if m <= stop_after + 1e-9]


def marks_passed(marks: Sequence[float], minutes: float) -> int:
    """How many of the (sorted) marks a clock reading of `minutes` has reached."""
    return sum(1 for m in marks if minutes >= m - 1e-9)


def mark_of(marks: Sequence[float], minutes: float) -> float | None:
    """The last mark a snapshot taken at `minutes` of training has reached (None: before the first)."""
    n = marks_passed(marks, minutes)
    return marks[n - 1] if n else None


def first_pass(base_acceptance: float, rows: Sequence[dict]) -> dict | None:
    """The earliest snapshot (by training minutes) whose acceptance is above the base draft's; None if none."""
    for row in sorted(rows, key=lambda r: r["train_minutes"]):
        if row["acceptance_rate"] > base_acceptance:
            return row
    return None


def cpu_sets(threads: int, available: Sequence[int], workers: int = 2) -> list[list[int]]:
    """Disjoint CPU sets of `threads` CPUs each, one per parallel worker; ValueError when there are too few."""
    cpus = sorted(available)
    if len(cpus) < workers * threads:
        raise ValueError(
            f"--parallel needs {workers} x --threads = {workers * threads} CPUs, this process may use {len(cpus)}: "
            "lower --threads or drop --parallel"
        )
    return [cpus[i * threads : (i + 1) * threads] for i in range(workers)]


def split_round_robin(names: Sequence[str], parts: int) -> list[list[str]]:
    """Deal the drafts out in turn, so that each evaluation process gets both sides' early and late drafts."""
    return [list(names[i::parts]) for i in range(parts)]


def draftsmith_overrides(s: Shared, minutes: float, marks: int, output_dir: Path) -> list[str]:
    """train/distill.py overrides: one run of `minutes`, a checkpoint at each of `marks` minute marks."""
    return [
        f"train.max_minutes={minutes}",
        f"train.max_steps={NO_STEP_LIMIT}",
        "train.schedule_by=minutes",  # the lr decay and switch_at span the bench's budget
        f"eval.every={NO_STEP_LIMIT}",
        f"eval.every_minutes={minutes / marks}",
        f"eval.keep_top_k={marks + 2}",  # step 0, every mark and the last step: nothing is pruned
        # Its own evaluations are off the clock; 1 prompt, 1 repeat and no HF-assisted timing keep them short,
        # since every snapshot is evaluated again afterwards, on --eval-prompts prompts, by one function.
        "eval.num_prompts=1",
        "eval.repeats=1",
        "eval.hf_assisted=false",
        f"eval.max_new_tokens={s.eval_new_tokens}",
        "eval.temperature=0",
        f"eval.num_draft_tokens={s.eval_gamma}",
        "log.report_to=none",
        f"output_dir={output_dir}",
    ]


def trl_config_kwargs(s: Shared, output_dir: Path) -> dict[str, Any]:
    """GKDConfig arguments, from the same settings."""
    return {
        "output_dir": str(output_dir),
        "beta": s.beta,
        "lmbda": s.lmbda,
        "seq_kd": True,  # the off-policy batches are target-generated, like draftsmith's target source
        "max_new_tokens": s.max_new_tokens,
        # generation only (TRL's loss runs at 1.0); greedy at 0 is set in the trainer subclass
        "temperature": s.gen_temperature if s.gen_temperature > 0 else 1.0,
        "max_length": s.max_prompt_tokens + s.max_new_tokens,
        "learning_rate": s.lr,
        "warmup_steps": s.warmup_steps,
        "lr_scheduler_type": "constant_with_warmup",
        "weight_decay": s.weight_decay,
        "adam_beta1": s.adam_betas[0],
        "adam_beta2": s.adam_betas[1],
        "max_grad_norm": s.max_grad_norm,
        "per_device_train_batch_size": s.batch_size,
        "gradient_accumulation_steps": s.grad_accum,
        "max_steps": NO_STEP_LIMIT,
        "seed": s.seed,
        "bf16": s.mixed_precision == "bf16",  # SFTConfig defaults bf16 on; draftsmith's recipe says "no"
        "fp16": s.mixed_precision == "fp16",
        "gradient_checkpointing": False,  # SFTConfig defaults it on, which also turns off the KV cache in generate
        "logging_steps": s.log_every,
        "save_strategy": "no",
        "eval_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
    }


def shared_block(s: Shared, recipe: Any, recipe_name: str) -> str:
    """The printed `Shared` block: what both sides do alike, and what differs by design."""
    lines = [f"Shared (recipe {recipe_name}):"]
    lines.append(f"  pair: target {recipe.target.model} ({recipe.target.dtype}), draft {recipe.draft.model}")
    lines.append(
        f"  prompts: {recipe.data.train_prompts}, tokenised once by draftsmith's encode_examples (at most "
        f"{s.max_prompt_tokens} tokens): identical prompt token ids on both sides"
    )
    lines += [f"  {k}: {v}" for k, v in dataclasses.asdict(s).items()]
    lines.append(f"  TRL: beta {s.beta} for {s.loss}, lmbda {s.lmbda} on-policy + seq_kd target-generated")
    lines.append(f"  generation: {'greedy' if s.gen_temperature == 0 else f'temperature {s.gen_temperature}'}")
    lines.append("Differences by design:")
    lines += [f"  * {d}" for d in differences(s)]
    return "\n".join(lines)


# ---------------------------------------------------------------- workers (one subprocess each)


def load_distill_script() -> Any:
    """train/distill.py as a module (it is a script, not part of the installed package)."""
    spec = importlib.util.spec_from_file_location("draftsmith_distill_script", REPO / "train" / "distill.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


class StopAfterLastMark(Exception):
    """Ends a draftsmith run early (--stop-after) from its on_step hook."""


def worker_draftsmith(spec: dict) -> None:
    """Run train/distill.py's `main`, observing batch tokens and the training clock through its `on_step` hook.

    The clock is distill.py's own train.max_minutes clock (training steps only: model loading, evaluations
    and rollout pregeneration are off it). Its snapshots are the run's evaluated checkpoints. With
    `stop_after_s` (--stop-after) the run keeps the full budget's lr and data schedule and is ended at the step
    after the one that crossed that clock reading: distill.py evaluates and saves a mark's checkpoint right after
    the hook of the step that crossed it, so the last kept mark is saved before the run ends.
    """
    import torch

    torch.set_num_threads(spec["threads"])
    stats = {"tokens": 0, "micro_batches": 0, "train_s": 0.0}
    tokens_at: dict[int, int] = {0: 0}  # step -> tokens trained on so far
    stop_s = spec.get("stop_after_s")

    def on_step(report: Any) -> None:
        if stop_s is not None and stats["train_s"] >= stop_s:
            raise StopAfterLastMark  # the previous step crossed the last mark; this one is not counted
        stats["tokens"] += report.tokens
        stats["micro_batches"] += report.micro_batches
        stats["train_s"] = report.train_s
        tokens_at[report.step] = stats["tokens"]

    try:
        load_distill_script().main(spec["argv"], on_step=on_step)
    except StopAfterLastMark:
        pass
    run_dir = Path(spec["output_dir"])
    ckpt = newest_checkpoint_dir(run_dir)
    stats.update(steps=int(ckpt.name.split("-")[1]), final_draft=str(ckpt))
    stats["snapshots"] = draftsmith_snapshots(run_dir, tokens_at)
    (run_dir / STATS_FILE).write_text(json.dumps(stats, indent=1))


def checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, checkpoints/step-N) in step order."""
    steps = [p for p in (run_dir / "checkpoints").glob("step-*") if p.name.split("-")[1].isdigit()]
    return sorted((int(p.name.split("-")[1]), p) for p in steps)


def newest_checkpoint_dir(run_dir: Path) -> Path:
    """checkpoints/step-N with the largest N (the last weights; best/ is chosen by speedup, not wanted here)."""
    found = checkpoint_dirs(run_dir)
    if not found:
        raise FileNotFoundError(f"no checkpoints/step-N in {run_dir}")
    return found[-1][1]


def draftsmith_snapshots(run_dir: Path, tokens_at: dict[int, int]) -> list[dict]:
    """Every trained checkpoint as a snapshot row: its step, its training clock (eval.json's train_minutes)
    and the tokens trained on up to it."""
    rows = []
    for step, path in checkpoint_dirs(run_dir):
        if step == 0:
            continue  # the base draft, evaluated from the recipe's draft.model
        result = json.loads((path / "eval.json").read_text())
        rows.append({"step": step, "train_s": result["train_minutes"] * 60.0, "tokens": tokens_at[step]})
        rows[-1]["path"] = str(path)
    return rows


def load_trl() -> tuple[type, type]:
    """(GKDConfig, GKDTrainer): under trl.experimental.gkd in TRL 1.x, top-level in older releases."""
    try:
        from trl.experimental.gkd import GKDConfig, GKDTrainer
    except ImportError:
        from trl import GKDConfig, GKDTrainer
    return GKDConfig, GKDTrainer


def bench_trainer_class(gkd_trainer: type, greedy: bool) -> type:
    """GKDTrainer counting the tokens it trains on, averaging its loss over the generated tokens, and
    generating greedily when the recipe's distill.gen_temperature is 0 (GKD samples by default)."""

    class BenchGKDTrainer(gkd_trainer):
        tokens = 0

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if greedy:  # both: generate() gets the config, and the kwargs override the model's own config
                self.generation_config.do_sample = False
                self.generation_kwargs["do_sample"] = False

        def compute_loss(
            self, model: Any, inputs: dict, return_outputs: bool = False, num_items_in_batch: Any = None
        ) -> Any:
            # inputs hold the generated batch here; count its tokens like draftsmith counts its batches
            BenchGKDTrainer.tokens += int(inputs["attention_mask"].sum())
            # num_items_in_batch counts the collator's labels, before generation replaced them (0 here)
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch=None)

    return BenchGKDTrainer


def worker_trl(spec: dict) -> None:
    """TRL's GKDTrainer on the same models (draftsmith's loaders: same dtypes and device) and prompt tokens,
    saving a snapshot at every minute mark."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from distill import models
    from distill.config import load_recipe
    from distill.data.prompts import encode_examples, load_train_eval

    torch.set_num_threads(spec["threads"])
    GKDConfig, GKDTrainer = load_trl()
    s = Shared(**{**spec["shared"], "adam_betas": tuple(spec["shared"]["adam_betas"])})
    recipe = load_recipe(spec["recipe"])
    tokenizer = models.load_tokenizer(recipe.target.model, recipe.target, key="target.model")
    target = models.load_target(recipe.target)
    draft = models.load_draft(recipe.draft)
    rows, _ = load_train_eval(recipe.data)
    examples = encode_examples(rows, tokenizer, recipe.data, models.context_length(target, draft), s.max_new_tokens)
    # Prompt-only rows as token ids: completion_mask all 0 makes the whole row the prompt in TRL's collator.
    dataset = Dataset.from_list(
        [{"prompt": "", "input_ids": e.prompt_ids, "completion_mask": [0] * len(e.prompt_ids)} for e in examples]
    )

    BenchGKDTrainer = bench_trainer_class(GKDTrainer, greedy=s.gen_temperature == 0)

    class SnapshotAtMarks(TrainerCallback):
        """Save the draft when the training clock passes each mark (the clock paused while saving); stop
        after the step that passes the last one, like distill.py's Timer."""

        def __init__(self, marks_min: list[float], out: Path) -> None:
            self.marks, self.out = marks_min, out
            self.start, self.paused_s, self.train_s, self.saved = 0.0, 0.0, 0.0, 0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.train_s = time.perf_counter() - self.start - self.paused_s
            reached = marks_passed(self.marks, self.train_s / 60.0)
            if reached > self.saved:
                t0 = time.perf_counter()
                path = self.out / "snapshots" / f"step-{state.global_step}"
                draft.save_pretrained(str(path))
                tokenizer.save_pretrained(str(path))
                row = {"step": state.global_step, "train_s": self.train_s, "tokens": BenchGKDTrainer.tokens}
                (path / SNAPSHOT_FILE).write_text(json.dumps(row))
                self.saved = reached
                self.paused_s += time.perf_counter() - t0
            if self.saved == len(self.marks):
                control.should_training_stop = True

    out = Path(spec["output_dir"])
    clock = SnapshotAtMarks(spec["marks"], out)
    trainer = BenchGKDTrainer(
        model=draft,
        teacher_model=target,
        args=GKDConfig(**trl_config_kwargs(s, out)),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.train()
    snapshots = []
    for path in sorted((out / "snapshots").glob("step-*"), key=lambda p: int(p.name.split("-")[1])):
        snapshots.append({**json.loads((path / SNAPSHOT_FILE).read_text()), "path": str(path)})
    stats = {
        "tokens": BenchGKDTrainer.tokens,
        "steps": trainer.state.global_step,
        "train_s": clock.train_s,
        "snapshots": snapshots,
        "target_dtype": str(next(target.parameters()).dtype),
        "draft_dtype": str(next(draft.parameters()).dtype),
    }
    (out / STATS_FILE).write_text(json.dumps(stats, indent=1))


def worker_eval(spec: dict) -> None:
    """Every given draft through distill.training.helpers.evaluate, one target, the same prompts."""
    import torch

    from distill import models
    from distill.config import load_recipe
    from distill.data.prompts import load_train_eval
    from distill.training.helpers import evaluate

    torch.set_num_threads(spec["threads"])
    s = Shared(**{**spec["shared"], "adam_betas": tuple(spec["shared"]["adam_betas"])})
    overrides = [
        "eval.temperature=0",
        f"eval.num_draft_tokens={s.eval_gamma}",
        f"eval.max_new_tokens={s.eval_new_tokens}",
        "eval.batch_size=1",
        "eval.repeats=1",
        "eval.hf_assisted=false",
    ]
    recipe = load_recipe(spec["recipe"], overrides)
    tokenizer = models.load_tokenizer(recipe.target.model, recipe.target, key="target.model")
    target = models.load_target(recipe.target)
    _, eval_rows = load_train_eval(recipe.data)
    rows = eval_rows[: spec["eval_prompts"]]
    results = {}
    for name, path in spec["drafts"].items():
        cfg = dataclasses.replace(recipe.draft, model=path)
        draft = models.load_draft(cfg, device=next(target.parameters()).device)
        result = evaluate(target, draft, tokenizer, rows, recipe)
        results[name] = {
            "acceptance_rate": result["acceptance_rate"],
            "mean_accepted_length": result["mean_accepted_length"],
            "speedup_vs_target": result["speedup"]["vs_target"],
            "outputs_match_target": result["outputs_match_target"],
            "n_prompts": result["n_prompts"],
        }
        print(f"eval {name}: acceptance {result['acceptance_rate']:.3f}", flush=True)
    Path(spec["result"]).write_text(json.dumps(results, indent=1))


WORKERS = {"draftsmith": worker_draftsmith, "trl": worker_trl, "eval": worker_eval}


# ---------------------------------------------------------------- driver


@dataclasses.dataclass
class Job:
    """One worker subprocess, started and not yet waited for."""

    kind: str
    log: Path
    proc: subprocess.Popen
    started: float


def start_worker(kind: str, spec: dict, log: Path, threads: int, cpus: list[int] | None = None) -> Job:
    """One side in its own process (its own threads and memory), pinned to `cpus` when given."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    spec = {**spec, "threads": threads, "cpus": cpus}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--spec", json.dumps(spec)]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    return Job(kind, log, proc, time.perf_counter())


def wait_workers(jobs: list[Job]) -> None:
    """Wait for every job; on a failure, stop the others and exit with one error line (and the log's tail)."""
    for job in jobs:
        code = job.proc.wait()
        print(f"  {job.kind} process: {time.perf_counter() - job.started:.0f} s wall (log: {job.log})", flush=True)
        if code != 0:
            for other in jobs:
                if other.proc.poll() is None:
                    other.proc.terminate()
                    other.proc.wait()
            tail = "\n".join(job.log.read_text(errors="replace").splitlines()[-15:])
            print(tail, file=sys.stderr)
            fail(f"the {job.kind} run failed (exit {code}); full log: {job.log}")


def pin_to(cpus: list[int] | None) -> None:
    """Pin this (worker) process, and the threads torch starts after, to `cpus`."""
    if cpus:
        os.sched_setaffinity(0, set(cpus))


def run_jobs(starters: list[tuple[str, dict, Path]], args: argparse.Namespace) -> None:
    """Start the workers one after the other, or all at once, each pinned to its CPU set (--parallel)."""
    if not args.parallel:
        for kind, spec, log in starters:
            wait_workers([start_worker(kind, spec, log, args.threads)])
        return
    sets = cpu_sets(args.threads, sorted(os.sched_getaffinity(0)), workers=len(starters))
    wait_workers([start_worker(k, spec, log, args.threads, cpus) for (k, spec, log), cpus in zip(starters, sets)])


def train_both(args: argparse.Namespace, recipe_path: str, s: Shared, out: Path) -> dict[str, dict]:
    """Both sides for --minutes, with a snapshot at every mark; returns each side's stats."""
    marks = minute_marks(args.minutes, args.marks, args.stop_after)
    shutil.rmtree(out / "trl", ignore_errors=True)
    trl_spec = {"recipe": recipe_path, "shared": dataclasses.asdict(s), "marks": marks}
    trl_spec["output_dir"] = str(out / "trl")
    ds_dir = out / "draftsmith"
    argv = ["--recipe", recipe_path, "--overwrite", *draftsmith_overrides(s, args.minutes, args.marks, ds_dir)]
    ds_spec = {"argv": argv, "output_dir": str(ds_dir)}
    if args.stop_after is not None and args.stop_after < args.minutes:
        ds_spec["stop_after_s"] = marks[-1] * 60.0
    how = "at the same time, pinned" if args.parallel else "one after the other"
    budget = f"{args.minutes:g} min each" + (f", stopped after {marks[-1]:g}" if "stop_after_s" in ds_spec else "")
    print(f"[train] TRL GKDTrainer and draftsmith, {budget}, {how}; marks {marks} ...", flush=True)
    run_jobs([("trl", trl_spec, out / "trl.log"), ("draftsmith", ds_spec, out / "draftsmith.log")], args)
    stats = {side: json.loads((out / side / STATS_FILE).read_text()) for side in SIDES}
    stats["draftsmith"]["command"] = "python train/distill.py " + " ".join(argv)
    return stats


def evaluate_all(args: argparse.Namespace, recipe_path: str, s: Shared, drafts: dict, out: Path) -> dict:
    """The base draft and every snapshot, by one function; split over two pinned processes with --parallel."""
    parts = 2 if args.parallel else 1
    print(f"[eval] {len(drafts)} drafts on {args.eval_prompts} dev prompts, {parts} process(es) ...", flush=True)
    starters = []
    for i, names in enumerate(split_round_robin(list(drafts), parts)):
        spec = {"recipe": recipe_path, "shared": dataclasses.asdict(s), "eval_prompts": args.eval_prompts}
        spec.update(drafts={n: drafts[n] for n in names}, result=str(out / f"eval-{i}.json"))
        starters.append(("eval", spec, out / f"eval-{i}.log"))
    run_jobs(starters, args)
    results = {}
    for i in range(parts):
        results.update(json.loads((out / f"eval-{i}.json").read_text()))
    return results


def snapshot_rows(side: str, stats: dict, marks: list[float], evals: dict) -> list[dict]:
    """One row per snapshot of a side: its mark, clock, steps, throughput and evaluation."""
    rows = []
    for snap in stats["snapshots"]:
        name = f"{side}@step-{snap['step']}"
        minutes = snap["train_s"] / 60.0
        row = {"side": side, "name": name, "mark": mark_of(marks, minutes), "train_minutes": minutes}
        row.update(steps=snap["step"], tokens_per_s=snap["tokens"] / max(snap["train_s"], 1e-9), path=snap["path"])
        rows.append({**row, **evals[name]})
    return rows


def markdown_table(base: dict, rows: list[dict]) -> str:
    """One row per snapshot; speedup is measured wall-clock decoding vs the target alone (noisy on a busy
    machine)."""
    lines = [
        "| side | mark (min) | train min | steps | tokens/s | acceptance | tau | speedup |",
        "|---|---|---|---|---|---|---|---|",
        f"| base draft | 0 | 0 | 0 | - | {base['acceptance_rate']:.3f} | {base['mean_accepted_length']:.2f} "
        f"| {base['speedup_vs_target']:.2f}x |",
    ]
    for r in rows:
        mark = "-" if r["mark"] is None else f"{r['mark']:g}"
        lines.append(
            f"| {SIDES[r['side']]} | {mark} | {r['train_minutes']:.2f} | {r['steps']} | {r['tokens_per_s']:.0f} "
            f"| {r['acceptance_rate']:.3f} | {r['mean_accepted_length']:.2f} | {r['speedup_vs_target']:.2f}x |"
        )
    return "\n".join(lines)


def side_summary(side: str, base: dict, rows: list[dict]) -> dict:
    """The final draft's figures and the minutes to first pass the base draft's acceptance."""
    mine = sorted((r for r in rows if r["side"] == side), key=lambda r: r["train_minutes"])
    final = mine[-1] if mine else None
    passed = first_pass(base["acceptance_rate"], mine)
    final_keys = ("name", "train_minutes", "steps", "acceptance_rate", "mean_accepted_length", "speedup_vs_target")
    return {
        "final": {k: final[k] for k in final_keys} if final else None,
        "first_pass_base": {k: passed[k] for k in ("name", "mark", "train_minutes")} if passed else None,
    }


def summary_lines(base: dict, summaries: dict) -> list[str]:
    lines = []
    for side, summary in summaries.items():
        final, passed = summary["final"], summary["first_pass_base"]
        if final is None:
            lines.append(f"{SIDES[side]}: no snapshot (a step took longer than the whole budget)")
            continue
        when = "not by the last mark" if passed is None else f"{passed['mark']:g} min (mark)"
        lines.append(
            f"{SIDES[side]}: final draft ({final['train_minutes']:.2f} min, {final['steps']} steps) acceptance "
            f"{final['acceptance_rate']:.3f}, speedup {final['speedup_vs_target']:.2f}x; minutes to first pass the "
            f"base draft's acceptance ({base['acceptance_rate']:.3f}): {when}"
        )
    return lines


def check_trl() -> str:
    """The installed TRL version; one error line if TRL is missing."""
    if importlib.util.find_spec("trl") is None:
        fail(f"TRL is not installed (it is not a draftsmith dependency): pip install trl=={TRL_VERSION}")
    version = importlib.metadata.version("trl")
    if version != TRL_VERSION:
        print(f"warning: trl {version} installed; this benchmark was written against trl {TRL_VERSION}")
    return version


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"full fine-tune recipe (default: {DEFAULT_RECIPE})")
    p.add_argument("--minutes", type=float, default=20.0, help="training wall-clock of each side (default: 20)")
    p.add_argument("--marks", type=int, default=5, help="snapshots at equally spaced minute marks (default: 5)")
    p.add_argument(
        "--stop-after",
        type=float,
        help="end both sides after this many training minutes, keeping the --minutes budget's lr and data "
        "schedule: the early part of a --minutes run, e.g. --minutes 20 --marks 40 --stop-after 4",
    )
    p.add_argument("--eval-prompts", type=int, default=30, help="first N dev prompts to evaluate on (default: 30)")
    p.add_argument("--parallel", action="store_true", help="train (and evaluate) the two sides at the same time")
    p.add_argument("--out", default="runs/trl-vs-draftsmith", help="run directories and logs (replaced)")
    p.add_argument("--json", help="write the results as JSON here")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each subprocess (default: 1)")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="recipe overrides for both sides, e.g. target.model=PATH")
    return p.parse_args(argv)


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def load_bench_recipe(path: str, overrides: list[str]) -> Any:
    """The recipe, checked to be a full fine-tune of a given draft (what both trainers here support alike)."""
    from distill.config import RecipeError, load_recipe

    try:
        recipe = load_recipe(path, overrides)
    except (RecipeError, FileNotFoundError) as err:
        fail(str(err))
    if recipe.draft.lora.enabled or recipe.draft.quantization.enabled or not recipe.draft.model:
        fail(f"{path}: this benchmark compares full fine-tunes of a given draft (no LoRA, no quantization)")
    from distill.models import resolve_model_path

    try:  # a missing pair fails here, in one line, not in a worker's log
        for key, section in (("target.model", recipe.target), ("draft.model", recipe.draft)):
            resolve_model_path(section.model, key, section.revision)
        for key in ("train_prompts", "eval_prompts"):
            value = getattr(recipe.data, key)
            if value and value.endswith(".jsonl") and not Path(value).is_file():
                raise ValueError(f"data.{key} {value!r} not found: build the prompt files or pass data.{key}=PATH")
    except ValueError as err:
        fail(str(err))
    return recipe


def check_args(args: argparse.Namespace) -> None:
    if args.minutes <= 0 or args.eval_prompts < 1 or args.threads < 1 or args.marks < 1:
        fail("--minutes, --marks, --eval-prompts and --threads must be positive")
    stop = getattr(args, "stop_after", None)
    if stop is not None and not minute_marks(args.minutes, args.marks, stop):
        first = minute_marks(args.minutes, args.marks)[0]
        fail(f"--stop-after {stop:g} is before the first mark ({first:g} min): raise it or --marks")
    if args.parallel:
        if not hasattr(os, "sched_getaffinity"):
            fail("--parallel pins each process to its CPUs with os.sched_setaffinity (Linux): drop --parallel")
        try:
            cpu_sets(args.threads, sorted(os.sched_getaffinity(0)))
        except ValueError as err:
            fail(str(err))


def report(args: argparse.Namespace, s: Shared, trl_version: str, base: dict, rows: list[dict], extra: dict) -> None:
    """The markdown table, the per-side lines and the JSON file."""
    summaries = {side: side_summary(side, base, rows) for side in SIDES}
    print("\n" + markdown_table(base, rows) + "\n")
    print("\n".join(summary_lines(base, summaries)))
    if args.json:
        result = {
            "shared": dataclasses.asdict(s),
            "differences": differences(s),
            "trl_config": trl_config_kwargs(s, Path(args.out) / "trl"),
            "recipe": args.recipe,
            "overrides": args.overrides,
            "minutes": args.minutes,
            "marks": minute_marks(args.minutes, args.marks, args.stop_after),
            "stop_after": args.stop_after,
            "eval_prompts": args.eval_prompts,
            "threads": args.threads,
            "parallel": args.parallel,
            "trl_version": trl_version,
            "base": base,
            "rows": rows,
            "summary": summaries,
            **extra,
        }
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"json: {args.json}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))  # run from a source checkout without installing
    if args.worker:
        spec = json.loads(args.spec)
        pin_to(spec.get("cpus"))  # before torch starts its threads
        WORKERS[args.worker](spec)
        return
    check_args(args)
    recipe = load_bench_recipe(args.recipe, args.overrides)
    try:
        s = shared_from_recipe(recipe)
    except ValueError as err:
        fail(str(err))
    trl_version = check_trl()
    from distill.config import save_recipe

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    recipe_path = str(save_recipe(recipe, out, RECIPE_FILE))  # overrides applied: every worker reads this
    print(f"recipe {args.recipe}: target {recipe.target.model} ({recipe.target.dtype}), draft {recipe.draft.model}")
    print(shared_block(s, recipe, args.recipe))
    overrides = " ".join(draftsmith_overrides(s, args.minutes, args.marks, out / "draftsmith"))
    print(f"draftsmith: python train/distill.py --recipe {recipe_path} --overwrite {overrides}")
    print(f"TRL {trl_version}: GKDConfig({json.dumps(trl_config_kwargs(s, out / 'trl'))})")
    stats = train_both(args, recipe_path, s, out)
    marks = minute_marks(args.minutes, args.marks, args.stop_after)
    drafts = {"base": recipe.draft.model}
    for side, side_stats in stats.items():
        drafts.update({f"{side}@step-{snap['step']}": snap["path"] for snap in side_stats["snapshots"]})
    evals = evaluate_all(args, recipe_path, s, drafts, out)
    rows = [row for side in SIDES for row in snapshot_rows(side, stats[side], marks, evals)]
    extra = {"train_stats": {side: {k: v for k, v in st.items() if k != "snapshots"} for side, st in stats.items()}}
    report(args, s, trl_version, evals["base"], rows, extra)


if __name__ == "__main__":
    main()
