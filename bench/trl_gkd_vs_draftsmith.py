"""draftsmith's train/distill.py against TRL's GKDTrainer: same pair, prompts, loss and budget, one evaluator.

Both sides train the recipe's draft toward its target with generalized JSD(beta=0.5) on a lambda=0.5 mix of
on-policy (draft-sampled) and target-sampled continuations, 64 new tokens at temperature 1.0, the same batch size,
lr, warm-up, optimizer settings and max prompt length (`Shared` below; printed at the start). Each side trains
for `--minutes` of *training* wall-clock (model loading and evaluation are off the clock on both sides), each
in its own subprocess, one after the other. draftsmith also trains for the shorter budgets in `--fractions`.
Then one process evaluates every final draft, and the base draft, with the function train/distill.py evaluates
with (`distill.training.evaluate`: greedy speculative decoding, gamma 4, 64 new tokens, the first
`--eval-prompts` dev prompts). Printed: a markdown table of training throughput (prompt + completion tokens/s,
optimizer steps/s), acceptance and tau per run, and the draftsmith budget that first matches TRL's acceptance.

    pip install trl==1.16.0     # not a draftsmith dependency; tested with 1.16.0
    OMP_NUM_THREADS=1 python bench/trl_gkd_vs_draftsmith.py --minutes 6 --json trl.json

Expected wall time with the defaults (6 min, fractions 0.333,0.667,1.0, 30 eval prompts) on 2 CPU cores: about
30 min: 18 min of training (TRL 6 + draftsmith 2 + 4 + 6), ~3 min of loading and draftsmith's own 1-prompt
evals, ~6-10 min evaluating 5 drafts (evaluate() also times target-only decoding, for the speedup column).

What "the same" means where the two differ by design:
* The off-policy half: draftsmith's `source: mix` samples from the target; TRL's GKD samples from the target
  only with `seq_kd=True` (else it trains on dataset completions, which a prompt file lacks). Both sample
  during training, on the clock (draftsmith: `distill.cache_rollouts=false`, so nothing is pregenerated).
* Prompts: tokenised once by draftsmith's `encode_examples` (left cut to `data.max_prompt_tokens`, BOS kept)
  and given to TRL as token ids, so both see identical prompt tokens (the reference tokenizer has no chat
  template). The data order differs (each side's own seeded shuffle).
* Loss normalisation: TRL's trainer divides by `num_items_in_batch`, counted from the collator's labels
  *before* GKD replaces them with generated ones (0 here, as prompts have no completions); the subclass below
  passes None so that TRL averages over the generated tokens, as draftsmith does.
* Clocks: draftsmith's is its own `train.max_minutes` clock (training steps only, reported to the `on_step`
  hook of train/distill.py's `main` after every optimizer step); TRL's a TrainerCallback started at
  `on_train_begin` (after loading and `Trainer.__init__`) and read after every optimizer step. Each stops after
  the step that crosses the budget.
* Throughput: tokens are the non-padding prompt + completion tokens of every training batch (attention mask
  sum after generation), counted by the same rule on both sides, over each side's measured training clock.

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
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_RECIPE = "recipes/stdlib-30m_stdlib-3.7m_full_greedy.yaml"
TRL_VERSION = "1.16.0"
NO_STEP_LIMIT = 100_000  # the wall-clock budget ends training, never the step count
STATS_FILE = "bench_stats.json"


@dataclasses.dataclass(frozen=True)
class Shared:
    """Every setting both sides train and evaluate with; each side's config below is derived from this."""

    beta: float = 0.5  # generalized JSD interpolation (0: forward KL, 1: reverse KL; same convention)
    lmbda: float = 0.5  # probability that a batch is draft-sampled (on-policy); else target-sampled
    max_new_tokens: int = 64  # sampled continuation length
    gen_temperature: float = 1.0  # sampling temperature of the continuations (and loss temperature 1.0)
    lr: float = 1e-3
    warmup_steps: int = 20  # linear warm-up, then constant lr
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.95)  # draftsmith's AdamW betas
    max_grad_norm: float = 1.0
    batch_size: int = 16  # prompts per optimizer step, gradient accumulation 1
    max_prompt_tokens: int = 192
    seed: int = 0
    mixed_precision: str = "no"
    log_every: int = 5  # optimizer steps between train logs (both log at the same rate)
    eval_gamma: int = 4
    eval_new_tokens: int = 64


def shared_from_recipe(recipe: Any) -> Shared:
    """The recipe's optimisation settings; the GKD settings (beta, lambda, tokens, temperature) are fixed above."""
    t = recipe.train
    return Shared(
        lr=t.lr,
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        batch_size=t.batch_size,
        max_prompt_tokens=recipe.data.max_prompt_tokens,
        seed=t.seed,
        mixed_precision=t.mixed_precision,
        log_every=recipe.log.every,
    )


def draftsmith_overrides(s: Shared, minutes: float, output_dir: Path) -> list[str]:
    """train/distill.py overrides for one budget (the override style of bench/ablation.sh)."""
    return [
        "distill.loss=jsd",
        f"distill.beta={s.beta}",
        "distill.source=mix",
        f"distill.mix_lambda={s.lmbda}",
        f"distill.max_new_tokens={s.max_new_tokens}",
        f"distill.gen_temperature={s.gen_temperature}",
        "distill.temperature=1.0",
        "distill.cache_rollouts=false",  # target samples are drawn during training, on the clock, as in TRL
        f"train.lr={s.lr}",
        f"train.warmup_steps={s.warmup_steps}",
        "train.lr_scheduler=constant",
        f"train.weight_decay={s.weight_decay}",
        f"train.max_grad_norm={s.max_grad_norm}",
        f"train.batch_size={s.batch_size}",
        "train.grad_accum=1",
        f"train.seed={s.seed}",
        f"train.mixed_precision='{s.mixed_precision}'",  # quoted: YAML reads a bare no as false
        f"train.max_minutes={minutes}",
        f"train.max_steps={NO_STEP_LIMIT}",
        f"data.max_prompt_tokens={s.max_prompt_tokens}",
        f"log.every={s.log_every}",
        "log.report_to=none",
        f"eval.every={NO_STEP_LIMIT}",
        # Its own step-0 and final evals run off the clock; 1 prompt keeps them short, since every draft is
        # evaluated again below, on --eval-prompts prompts, by one process.
        "eval.num_prompts=1",
        f"eval.max_new_tokens={s.eval_new_tokens}",
        "eval.temperature=0",
        f"eval.num_draft_tokens={s.eval_gamma}",
        "eval.repeats=1",
        f"output_dir={output_dir}",
    ]


def trl_config_kwargs(s: Shared, output_dir: Path) -> dict[str, Any]:
    """GKDConfig arguments, from the same settings."""
    return {
        "output_dir": str(output_dir),
        "beta": s.beta,
        "lmbda": s.lmbda,
        "seq_kd": True,  # the off-policy half samples the target, like draftsmith's source=mix
        "max_new_tokens": s.max_new_tokens,
        "temperature": s.gen_temperature,  # generation; TRL's loss uses temperature 1.0
        "max_length": s.max_prompt_tokens + s.max_new_tokens,
        "learning_rate": s.lr,
        "warmup_steps": s.warmup_steps,
        "lr_scheduler_type": "constant_with_warmup",
        "weight_decay": s.weight_decay,
        "adam_beta1": s.adam_betas[0],
        "adam_beta2": s.adam_betas[1],
        "max_grad_norm": s.max_grad_norm,
        "per_device_train_batch_size": s.batch_size,
        "gradient_accumulation_steps": 1,
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


# ---------------------------------------------------------------- workers (one subprocess each)


def load_distill_script() -> Any:
    """train/distill.py as a module (it is a script, not part of the installed package)."""
    spec = importlib.util.spec_from_file_location("draftsmith_distill_script", REPO / "train" / "distill.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def worker_draftsmith(spec: dict) -> None:
    """Run train/distill.py's `main`, observing batch tokens and the training clock through its `on_step` hook.

    The clock is distill.py's own train.max_minutes clock (training steps only: model loading, evaluations
    and rollout pregeneration are off it); we keep its reading after the last step.
    """
    import torch

    torch.set_num_threads(spec["threads"])
    stats = {"tokens": 0, "micro_batches": 0, "train_s": 0.0}

    def on_step(report: Any) -> None:
        stats["tokens"] += report.tokens
        stats["micro_batches"] += report.micro_batches
        stats["train_s"] = report.train_s

    load_distill_script().main(spec["argv"], on_step=on_step)
    ckpt = newest_checkpoint_dir(Path(spec["output_dir"]))
    stats.update(steps=int(ckpt.name.split("-")[1]), final_draft=str(ckpt))
    (Path(spec["output_dir"]) / STATS_FILE).write_text(json.dumps(stats, indent=1))


def newest_checkpoint_dir(run_dir: Path) -> Path:
    """checkpoints/step-N with the largest N (the last weights; best/ is chosen by speedup, not wanted here)."""
    steps = [p for p in (run_dir / "checkpoints").glob("step-*") if p.name.split("-")[1].isdigit()]
    if not steps:
        raise FileNotFoundError(f"no checkpoints/step-N in {run_dir}")
    return max(steps, key=lambda p: int(p.name.split("-")[1]))


def load_trl() -> tuple[type, type]:
    """(GKDConfig, GKDTrainer): under trl.experimental.gkd in TRL 1.x, top-level in older releases."""
    try:
        from trl.experimental.gkd import GKDConfig, GKDTrainer
    except ImportError:
        from trl import GKDConfig, GKDTrainer
    return GKDConfig, GKDTrainer


def worker_trl(spec: dict) -> None:
    """TRL's GKDTrainer on the same models (draftsmith's loaders: same dtypes and device) and prompt tokens."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from distill import data, models
    from distill.config import load_recipe

    torch.set_num_threads(spec["threads"])
    GKDConfig, GKDTrainer = load_trl()
    s = Shared(**{**spec["shared"], "adam_betas": tuple(spec["shared"]["adam_betas"])})
    recipe = load_recipe(spec["recipe"])
    tokenizer = models.load_tokenizer(recipe.target.model, recipe.target, key="target.model")
    target = models.load_target(recipe.target)
    draft = models.load_draft(recipe.draft)
    recipe.data.max_prompt_tokens = s.max_prompt_tokens
    rows, _ = data.load_train_eval(recipe.data)
    examples = data.encode_examples(
        rows, tokenizer, recipe.data, models.context_length(target, draft), s.max_new_tokens
    )
    # Prompt-only rows as token ids: completion_mask all 0 makes the whole row the prompt in TRL's collator.
    dataset = Dataset.from_list(
        [{"prompt": "", "input_ids": e.prompt_ids, "completion_mask": [0] * len(e.prompt_ids)} for e in examples]
    )

    class BenchGKDTrainer(GKDTrainer):
        tokens = 0

        def compute_loss(
            self, model: Any, inputs: dict, return_outputs: bool = False, num_items_in_batch: Any = None
        ) -> Any:
            # inputs hold the generated batch here; count its tokens like draftsmith counts its batches
            BenchGKDTrainer.tokens += int(inputs["attention_mask"].sum())
            # num_items_in_batch counts the collator's labels, before generation replaced them (0 here)
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch=None)

    class WallClockBudget(TrainerCallback):
        """Stop after the optimizer step that reaches the budget, like distill.py's Timer."""

        def __init__(self, seconds: float) -> None:
            self.seconds, self.start, self.train_s = seconds, 0.0, 0.0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.train_s = time.perf_counter() - self.start
            if self.train_s >= self.seconds:
                control.should_training_stop = True

    out = Path(spec["output_dir"])
    budget = WallClockBudget(spec["minutes"] * 60.0)
    trainer = BenchGKDTrainer(
        model=draft,
        teacher_model=target,
        args=GKDConfig(**trl_config_kwargs(s, out)),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[budget],
    )
    trainer.train()
    final = out / "final"
    trainer.save_model(str(final))
    stats = {
        "tokens": BenchGKDTrainer.tokens,
        "steps": trainer.state.global_step,
        "train_s": budget.train_s,
        "final_draft": str(final),
        "target_dtype": str(next(target.parameters()).dtype),
        "draft_dtype": str(next(draft.parameters()).dtype),
    }
    (out / STATS_FILE).write_text(json.dumps(stats, indent=1))


def worker_eval(spec: dict) -> None:
    """Every draft through distill.training.evaluate, one process, one target, the same prompts."""
    import torch

    from distill import data, models
    from distill.config import load_recipe
    from distill.training import evaluate

    torch.set_num_threads(spec["threads"])
    s = Shared(**{**spec["shared"], "adam_betas": tuple(spec["shared"]["adam_betas"])})
    overrides = [
        "eval.temperature=0",
        f"eval.num_draft_tokens={s.eval_gamma}",
        f"eval.max_new_tokens={s.eval_new_tokens}",
        "eval.batch_size=1",
        "eval.repeats=1",
    ]
    recipe = load_recipe(spec["recipe"], overrides)
    tokenizer = models.load_tokenizer(recipe.target.model, recipe.target, key="target.model")
    target = models.load_target(recipe.target)
    _, eval_rows = data.load_train_eval(recipe.data)
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


def run_worker(kind: str, spec: dict, log: Path, threads: int) -> None:
    """One side in its own process (its own threads and memory); exits with an error line if it fails."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--spec", json.dumps(spec)]
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    print(f"  {kind} process: {time.perf_counter() - t0:.0f} s wall (log: {log})", flush=True)
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        print(tail, file=sys.stderr)
        fail(f"the {kind} run failed (exit {code}); full log: {log}")


def train_trl(recipe_path: str, s: Shared, minutes: float, out: Path, threads: int) -> dict:
    run_dir = out / "trl"
    shutil.rmtree(run_dir, ignore_errors=True)
    spec = {"recipe": recipe_path, "shared": dataclasses.asdict(s), "minutes": minutes, "threads": threads}
    spec["output_dir"] = str(run_dir)
    run_worker("trl", spec, out / "trl.log", threads)
    return json.loads((run_dir / STATS_FILE).read_text())


def train_draftsmith(recipe_path: str, s: Shared, minutes: float, run_dir: Path, threads: int) -> dict:
    argv = ["--recipe", recipe_path, "--overwrite", *draftsmith_overrides(s, minutes, run_dir)]
    spec = {"argv": argv, "output_dir": str(run_dir), "threads": threads}
    run_worker("draftsmith", spec, run_dir.parent / f"{run_dir.name}.log", threads)
    stats = json.loads((run_dir / STATS_FILE).read_text())
    stats["command"] = "python train/distill.py " + " ".join(argv)
    return stats


def throughput(stats: dict) -> dict:
    """Prompt + completion tokens and optimizer steps per second of the run's own training clock."""
    train_s = max(stats["train_s"], 1e-9)
    return {"tokens_per_s": stats["tokens"] / train_s, "steps_per_s": stats["steps"] / train_s}


def time_to_trl_acceptance(runs: list[dict], trl_acceptance: float) -> dict | None:
    """The smallest draftsmith budget whose draft reaches TRL's full-budget acceptance, and the speed-up 1/f."""
    for run in sorted(runs, key=lambda r: r["fraction"]):
        if run["acceptance_rate"] >= trl_acceptance:
            return {"fraction": run["fraction"], "speedup": 1.0 / run["fraction"], "name": run["name"]}
    return None


def markdown_table(base: dict, rows: list[dict]) -> str:
    """One row per run; speedup is measured wall-clock decoding vs the target alone (noisy on a busy machine)."""
    lines = [
        "| run | budget (min) | train s | steps | steps/s | tokens/s | acceptance | tau | speedup |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| base draft | - | - | - | - | - | {base['acceptance_rate']:.3f} | {base['mean_accepted_length']:.2f} "
        f"| {base['speedup_vs_target']:.2f}x |",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['budget_min']:.2f} | {r['train_s']:.1f} | {r['steps']} | {r['steps_per_s']:.3f} "
            f"| {r['tokens_per_s']:.0f} | {r['acceptance_rate']:.3f} | {r['mean_accepted_length']:.2f} "
            f"| {r['speedup_vs_target']:.2f}x |"
        )
    return "\n".join(lines)


def check_trl() -> str:
    """The installed TRL version; one error line if TRL is missing."""
    if importlib.util.find_spec("trl") is None:
        fail(f"TRL is not installed (it is not a draftsmith dependency): pip install trl=={TRL_VERSION}")
    version = importlib.metadata.version("trl")
    if version != TRL_VERSION:
        print(f"warning: trl {version} installed; this benchmark was written against trl {TRL_VERSION}")
    return version


def parse_fractions(text: str) -> list[float]:
    try:
        fractions = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        fractions = []
    if not fractions or any(not 0 < f <= 1 for f in fractions):
        fail(f"--fractions {text!r}: give comma-separated numbers in (0, 1], e.g. 0.333,0.667,1.0")
    return fractions


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"full fine-tune recipe (default: {DEFAULT_RECIPE})")
    p.add_argument("--minutes", type=float, default=6.0, help="training wall-clock of each side (default: 6)")
    p.add_argument("--fractions", default="0.333,0.667,1.0", help="draftsmith budgets as fractions of --minutes")
    p.add_argument("--eval-prompts", type=int, default=30, help="first N dev prompts to evaluate on (default: 30)")
    p.add_argument("--out", default="runs/trl-vs-draftsmith", help="run directories and logs (replaced)")
    p.add_argument("--json", help="write the results as JSON here")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each subprocess (default: 1)")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def load_bench_recipe(path: str) -> Any:
    """The recipe, checked to be a full fine-tune of a given draft (what both trainers here support alike)."""
    from distill.config import RecipeError, load_recipe

    try:
        recipe = load_recipe(path)
    except (RecipeError, FileNotFoundError) as err:
        fail(str(err))
    if recipe.draft.lora.enabled or recipe.draft.quantization.enabled or not recipe.draft.model:
        fail(f"{path}: this benchmark compares full fine-tunes of a given draft (no LoRA, no quantization)")
    return recipe


def train_all(args: argparse.Namespace, recipe_path: str, s: Shared, fractions: list[float], out: Path) -> list[dict]:
    """TRL at the full budget, then draftsmith at each fraction of it; one subprocess at a time."""
    print(f"[trl] GKDTrainer, {args.minutes:g} min of training ...", flush=True)
    stats = train_trl(recipe_path, s, args.minutes, out, args.threads)
    runs = [{"name": "TRL GKDTrainer", "side": "trl", "fraction": 1.0, "budget_min": args.minutes, **stats}]
    for f in fractions:
        minutes = round(args.minutes * f, 4)
        print(f"[draftsmith] train/distill.py, {minutes:g} min of training ...", flush=True)
        stats = train_draftsmith(recipe_path, s, minutes, out / f"draftsmith-{f:g}", args.threads)
        runs.append({"name": f"draftsmith x{f:g}", "side": "draftsmith", "fraction": f, "budget_min": minutes})
        runs[-1].update(stats)
    return runs


def evaluate_all(
    args: argparse.Namespace, recipe: Any, recipe_path: str, s: Shared, runs: list[dict], out: Path
) -> dict:
    """Base draft and every run's final draft, evaluated in one subprocess by one function."""
    print(f"[eval] base + {len(runs)} drafts on {args.eval_prompts} dev prompts ...", flush=True)
    drafts = {"base": recipe.draft.model, **{r["name"]: r["final_draft"] for r in runs}}
    spec = {"recipe": recipe_path, "shared": dataclasses.asdict(s), "drafts": drafts, "threads": args.threads}
    spec.update(eval_prompts=args.eval_prompts, result=str(out / "eval.json"))
    run_worker("eval", spec, out / "eval.log", args.threads)
    return json.loads((out / "eval.json").read_text())


def report(args: argparse.Namespace, s: Shared, trl_version: str, base: dict, runs: list[dict]) -> None:
    """The markdown table, the time-to-TRL's-acceptance line, and the JSON file."""
    trl = runs[0]
    reached = time_to_trl_acceptance([r for r in runs if r["side"] == "draftsmith"], trl["acceptance_rate"])
    if reached:
        ds = next(r for r in runs if r["name"] == reached["name"])
        reached["train_s_ratio"] = trl["train_s"] / max(ds["train_s"], 1e-9)  # measured clocks, not budgets
    print("\n" + markdown_table(base, runs) + "\n")
    if trl["acceptance_rate"] <= base["acceptance_rate"]:
        print(f"note: TRL's draft does not improve on the base draft's acceptance ({base['acceptance_rate']:.3f})")
    if reached:
        print(
            f"draftsmith reaches TRL's {args.minutes:g}-min acceptance ({trl['acceptance_rate']:.3f}) with "
            f"{reached['fraction']:g} of the budget: {reached['speedup']:.1f}x less training time"
        )
    else:
        print(f"draftsmith does not reach TRL's acceptance ({trl['acceptance_rate']:.3f}) within {args.minutes:g} min")
    if args.json:
        result = {
            "shared": dataclasses.asdict(s),
            "trl_config": trl_config_kwargs(s, Path(args.out) / "trl"),
            "recipe": args.recipe,
            "minutes": args.minutes,
            "eval_prompts": args.eval_prompts,
            "threads": args.threads,
            "trl_version": trl_version,
            "base": base,
            "runs": runs,
            "time_to_trl_acceptance": reached,
        }
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"json: {args.json}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))  # run from a source checkout without installing
    if args.worker:
        WORKERS[args.worker](json.loads(args.spec))
        return
    trl_version = check_trl()
    fractions = parse_fractions(args.fractions)
    if args.minutes <= 0 or args.eval_prompts < 1 or args.threads < 1:
        fail("--minutes, --eval-prompts and --threads must be positive")
    recipe = load_bench_recipe(args.recipe)
    recipe_path = str(Path(args.recipe).resolve())
    s = shared_from_recipe(recipe)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"recipe {args.recipe}: target {recipe.target.model} ({recipe.target.dtype}), draft {recipe.draft.model}")
    print(f"shared settings: {json.dumps(dataclasses.asdict(s))}")
    overrides = " ".join(draftsmith_overrides(s, args.minutes, out / "draftsmith-1"))  # the full-budget run
    print(f"draftsmith: python train/distill.py --recipe {args.recipe} --overwrite {overrides}")
    print(f"TRL {trl_version}: GKDConfig({json.dumps(trl_config_kwargs(s, out / 'trl'))})")
    runs = train_all(args, recipe_path, s, fractions, out)
    evals = evaluate_all(args, recipe, recipe_path, s, runs, out)
    for r in runs:
        r.update(throughput(r), **evals[r["name"]])
    report(args, s, trl_version, evals["base"], runs)


if __name__ == "__main__":
    main()
