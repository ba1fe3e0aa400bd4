"""Building blocks of train/distill.py: trackers, optimizer, data order, evaluation, checkpoint export.

The entry script keeps the loop itself in view (STYLE.md #3/#4); everything here is a small helper it calls.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from distill.config import LogConfig, Recipe, TrainConfig

# ---------------------------------------------------------------- trackers


def wandb_has_credentials() -> bool:
    """True when W&B can log online: an API key in the environment or a saved login (~/.netrc)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


def tracker_setup(log: LogConfig, output_dir: Path, is_main: bool) -> tuple[list[str], dict[str, Any]]:
    """accelerate's `log_with` and `init_kwargs` for the recipe's tracker.

    With no W&B login, `wandb.init` raises instead of falling back; we switch to offline mode ourselves and
    say once how to upload the run later.
    """
    if log.report_to == "none":
        return [], {}
    if log.report_to == "tensorboard":
        return ["tensorboard"], {}
    if not os.environ.get("WANDB_MODE") and not wandb_has_credentials():
        os.environ["WANDB_MODE"] = "offline"
        if is_main:
            sync = f"wandb sync {output_dir}/wandb/offline-run-*"
            print(f"W&B: no login found, logging offline; upload later with `{sync}`")
    os.environ.setdefault("WANDB_DIR", str(output_dir))
    os.environ.setdefault("WANDB_SILENT", "true")
    return ["wandb"], {"wandb": {"name": log.run_name or output_dir.name, "dir": str(output_dir)}}


class MetricsLog:
    """Every logged value goes to the trackers (accelerate) and, on the main process, to metrics.jsonl."""

    def __init__(self, accelerator: Any, path: Path) -> None:
        self.accelerator = accelerator
        self.path = path

    def log(self, values: dict[str, Any], step: int) -> None:
        scalars = {k: v for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        self.accelerator.log(scalars, step=step)
        if self.accelerator.is_main_process:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": step, **values}) + "\n")

    def log_rich(self, eval_result: dict, samples: list[dict], step: int, plot_path: Path | None) -> None:
        """W&B extras: the per-position acceptance plot and a table of eval samples."""
        if not self.accelerator.is_main_process:
            return
        try:
            tracker = self.accelerator.get_tracker("wandb", unwrap=True)
        except (ValueError, KeyError):
            return
        if tracker is None or not hasattr(tracker, "log"):
            return
        import wandb

        rich: dict[str, Any] = {}
        if plot_path is not None and plot_path.is_file():
            rich["eval/per_position_acceptance"] = wandb.Image(str(plot_path))
        if samples:
            table = wandb.Table(columns=["id", "prompt", "completion"])
            for row in samples:
                table.add_data(row["id"], row["prompt"], row["completion"])
            rich["eval/samples"] = table
        if rich:
            tracker.log(rich, step=step)


# ---------------------------------------------------------------- optimisation


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (all of them, or only the LoRA adapters)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the draft has no trainable parameters: check draft.lora settings")
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak lr at `step`: linear warm-up, then cosine / linear decay to 10%, or constant."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.lr_scheduler == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    if cfg.lr_scheduler == "linear":
        return 1.0 - 0.9 * progress
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))


def batch_indices(step: int, micro: int, cfg: TrainConfig, n: int, rank: int, world: int) -> list[int]:
    """Prompt indices for one micro-batch of one process, a pure function of (step, micro, rank).

    Each epoch is a seeded permutation; global micro-batch g covers positions [g*B*world, (g+1)*B*world) of
    the epoch stream and each rank takes its own B. Because the order depends on nothing but the step,
    `--resume` replays exactly the data a run without interruption would have seen.
    """
    per_global = cfg.batch_size * world
    start = (step * cfg.grad_accum + micro) * per_global + rank * cfg.batch_size
    out = []
    for pos in range(start, start + cfg.batch_size):
        epoch, offset = divmod(pos, n)
        out.append(_epoch_order(cfg.seed, epoch, n)[offset])
    return out


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()


def step_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """The sampling RNG for one step on one rank: deterministic, so a resumed run samples the same rollouts."""
    return torch.Generator().manual_seed(hash((seed, step, rank)) % (2**63))


# ---------------------------------------------------------------- evaluation


def evaluate(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[dict],
    recipe: Recipe,
    samples_out: Path | None = None,
) -> dict:
    """Bench the draft against the target on the eval prompts (DESIGN.md bench JSON).

    A LoRA draft is merged for the measurement and unmerged afterwards: unmerged adapters add matmuls to
    every draft forward and would understate the speedup the published (merged) draft gives. A draft trained in
    float32 next to a bf16/fp16 target is measured as a copy in the target's dtype, the way it is served.
    """
    from decode.bench import run_bench
    from distill.engines import evaluate_vllm

    merged = _merge_lora_for_eval(draft)
    was_training = draft.training
    draft.eval()
    # A merged LoRA draft's base model holds the merged weights: a plain model, as HF's assisted generation needs.
    plain = draft.get_base_model() if merged else draft
    hf = recipe.eval.hf_assisted and recipe.eval.batch_size == 1 and not hasattr(plain, "peft_config")
    try:
        if recipe.eval.engine == "vllm":  # the same measurement inside vLLM (distill/engines.py)
            return evaluate_vllm(target, draft, tokenizer, prompts, recipe, samples_out)
        result = run_bench(
            target,
            _in_serving_dtype(plain, target),
            tokenizer,
            list(prompts),
            target_name=recipe.target.model,
            draft_name=recipe.draft.model,
            max_new_tokens=recipe.eval.max_new_tokens,
            temperature=recipe.eval.temperature,
            top_p=recipe.eval.top_p,
            top_k=recipe.eval.top_k,
            num_draft_tokens=recipe.eval.num_draft_tokens,
            batch_size=recipe.eval.batch_size,
            repeats=recipe.eval.repeats,
            seed=recipe.train.seed,
            baselines=("target", "hf") if hf else ("target",),
            samples_out=samples_out,
            progress=True,
        )
    finally:
        if merged:
            draft.unmerge_adapter()
        draft.train(was_training)
    return result


def _in_serving_dtype(draft: torch.nn.Module, target: torch.nn.Module) -> torch.nn.Module:
    """The draft, or an eval-mode copy of it in the target's half-precision dtype (float32 master weights are
    not how a draft is served next to a half-precision target)."""
    if any(getattr(m, attr, False) for m in (draft, target) for attr in ("is_loaded_in_4bit", "is_loaded_in_8bit")):
        return draft
    want = next(target.parameters()).dtype
    have = next(draft.parameters()).dtype
    if want not in (torch.bfloat16, torch.float16) or have != torch.float32:
        return draft
    return copy.deepcopy(draft).to(want).eval()


def _merge_lora_for_eval(draft: torch.nn.Module) -> bool:
    if hasattr(draft, "merge_adapter") and hasattr(draft, "peft_config"):
        if getattr(draft, "is_loaded_in_4bit", False) or getattr(draft, "is_loaded_in_8bit", False):
            return False  # merging into quantized weights is lossy; measure the adapter as it is
        draft.merge_adapter()
        return True
    return False


def eval_metrics(result: dict, prefix: str = "eval/") -> dict[str, float]:
    """The scalar figures of a bench result, named as logged to W&B and metrics.jsonl."""
    out = {
        f"{prefix}acceptance_rate": result["acceptance_rate"],
        f"{prefix}mean_accepted_length": result["mean_accepted_length"],
        f"{prefix}speedup": result["speedup"]["vs_target"],
        f"{prefix}theoretical_speedup": result["theoretical_speedup"],
        f"{prefix}tokens_per_s": result["tokens_per_s"]["speculative"],
        f"{prefix}target_tokens_per_s": result["tokens_per_s"]["target"],
        f"{prefix}mean_num_draft_tokens": result["mean_num_draft_tokens"],
    }
    for i, a in enumerate(result["per_position_acceptance"]):
        out[f"{prefix}acceptance_pos_{i + 1}"] = a
    return out


# ---------------------------------------------------------------- output


def summary_table(base: dict, best: dict, best_step: int) -> str:
    """Base vs best, as printed at the end of a run."""
    rows = [
        ("acceptance rate", base["acceptance_rate"], best["acceptance_rate"], "{:.3f}"),
        ("tau (tokens / target pass)", base["mean_accepted_length"], best["mean_accepted_length"], "{:.2f}"),
        ("speedup vs target", base["speedup"]["vs_target"], best["speedup"]["vs_target"], "{:.2f}x"),
        ("tokens/s speculative", base["tokens_per_s"]["speculative"], best["tokens_per_s"]["speculative"], "{:.1f}"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':<{width}}  {'base':>9}  {f'best (step {best_step})':>16}"]
    for name, a, b, fmt in rows:
        lines.append(f"{name:<{width}}  {fmt.format(a):>9}  {fmt.format(b):>16}")
    return "\n".join(lines)


def plot_base_vs_best(base: dict, best: dict, path: Path) -> Path:
    """Per-position acceptance of the base draft and of best/ (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, result in (("base draft", base), ("best", best)):
        ys = result["per_position_acceptance"]
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=f"{label} (a={result['acceptance_rate']:.2f})")
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(accept i | accepted < i)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("per-position acceptance")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_eval(result: dict, path: Path, step: int) -> Path:
    """Per-position acceptance of one evaluation (logged to W&B as an image)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ys = result["per_position_acceptance"]
    ax.bar(range(1, len(ys) + 1), ys)
    ax.set_ylim(0, 1)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("acceptance")
    ax.set_title(f"step {step}: a={result['acceptance_rate']:.2f}, speedup {result['speedup']['vs_target']:.2f}x")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def read_samples(path: Path, prompts: Sequence[dict], limit: int = 8) -> list[dict]:
    """Speculative completions written by the bench (--samples-out format), joined with their prompts."""
    if not Path(path).is_file():
        return []
    by_id = {str(p.get("id", i)): p for i, p in enumerate(prompts)}
    rows = []
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        if row.get("method") == "speculative" and len(rows) < limit:
            prompt = by_id.get(str(row["id"]), {})
            rows.append(
                {
                    "id": row["id"],
                    "prompt": prompt.get("prompt") or str(prompt.get("messages", "")),
                    "completion": row["text"],
                }
            )
    return rows


def param_checksum(model: torch.nn.Module) -> float:
    """A cheap fingerprint of the trainable weights (identical on every DDP rank)."""
    with torch.no_grad():
        return float(sum(p.double().sum().item() for p in model.parameters() if p.requires_grad))


class Timer:
    """Wall-clock budget for training (train.max_minutes)."""

    def __init__(self, max_minutes: float) -> None:
        self.start = time.perf_counter()
        self.max_s = max_minutes * 60.0

    def expired(self) -> bool:
        return self.max_s > 0 and time.perf_counter() - self.start >= self.max_s


def fail(message: str) -> None:
    """One clear line on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
