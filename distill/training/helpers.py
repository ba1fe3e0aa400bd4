"""Building blocks of train/distill.py: trackers, optimizer, data order, evaluation, checkpoint export.

The entry script keeps the loop itself in view; everything here is a small helper it calls.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from decode import kernels
from decode.kinds.dispatch import kind_of
from distill import kinds
from distill.config import Recipe, TrainConfig
from distill.training.checkpoints import DiskFullError, disk_error_message, speedup_ci95
from distill.training.engines import bench_by_recipe, evaluate_vllm

# ---------------------------------------------------------------- trackers


def append_line(path: Path, line: str) -> None:
    """Append `line` to `path` whole or not at all: a failed write (a full disk) is cut off again and raised as a
    one-line DiskFullError naming `path`."""
    size = path.stat().st_size if path.is_file() else None
    try:
        with path.open("a") as f:
            f.write(line + "\n")
    except OSError as err:
        with contextlib.suppress(OSError):  # shrinking a file needs no space
            if size is None:
                path.unlink(missing_ok=True)
            else:
                os.truncate(path, size)
        raise DiskFullError(err.errno, disk_error_message(err, path), path) from None


class MetricsLog:
    """Every logged value goes to the trackers (accelerate) and, on the main process, to metrics.jsonl."""

    def __init__(self, accelerator: Any, path: Path) -> None:
        self.accelerator = accelerator
        self.path = path

    def log(self, values: dict[str, Any], step: int) -> None:
        scalars = {k: v for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        self.accelerator.log(scalars, step=step)
        if self.accelerator.is_main_process:
            append_line(self.path, json.dumps({"step": step, **values}))

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


def batch_indices(step: int, micro: int, cfg: TrainConfig, n: int, rank: int, world: int) -> list[int]:
    """Prompt indices for one micro-batch of one process, a pure function of (step, micro, rank).

    Each process draws from its own fixed share of the n prompts (every world-th one, from its rank), in a
    seeded permutation of that share each epoch, `batch_size` per micro-batch: the processes never train on the
    same prompt in a step, together they cover every prompt once an epoch, and a process meets the same
    sequences again each epoch, so what it keeps (distill.cache_teacher) is found again. With one process this is
    a seeded permutation of all prompts. Because the order depends on nothing but the step, `--resume` replays
    exactly the data a run without interruption would have seen.
    """
    share = range(rank, n, world) if n >= world else range(rank % n, rank % n + 1)
    start = (step * cfg.grad_accum + micro) * cfg.batch_size
    out = []
    for pos in range(start, start + cfg.batch_size):
        epoch, offset = divmod(pos, len(share))
        out.append(share[_epoch_order(cfg.seed, epoch, len(share))[offset]])
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
    draft_vocab: Sequence[int] | None = None,
) -> dict:
    """Bench the draft against the target on the eval prompts (the bench JSON of docs/bench.md).

    What is measured is the draft as it is served, built as a separate copy so that the training draft is never
    touched: a LoRA draft is measured merged (unmerged adapters add matmuls to every draft forward and would
    understate the speedup the published, merged draft gives), and a draft trained in float32 next to a bf16/fp16
    target is measured in the target's dtype.
    """
    was_training = draft.training
    draft.eval()
    wrapper = _drop_autocast_wrapper(draft)  # measured as served: no training-time autocast around its forward
    served = _served_draft(draft, target)
    try:
        if recipe.eval.engine == "vllm":  # the same measurement inside vLLM (distill/training/engines.py)
            return evaluate_vllm(target, draft, tokenizer, prompts, recipe, samples_out)
        result = bench_by_recipe(
            target,
            served,
            tokenizer,
            prompts,
            recipe,
            draft_name=recipe.draft.model,
            # HF assisted generation runs standalone LMs only (no LoRA wrapper; an EAGLE-3 head has no forward of
            # its own as an LM)
            hf_assisted=not hasattr(served, "peft_config") and kinds.get(kind_of(served)).TRAITS.hf_assisted,
            samples_out=samples_out,
            progress=True,
            draft_vocab=draft_vocab,
        )
    finally:
        if wrapper is not None:
            draft.forward = wrapper
        draft.train(was_training)
        kernels.release(target)  # the target stays loaded all run: its packed weights go until the next decoding
    return result


def _drop_autocast_wrapper(model: torch.nn.Module) -> Any:
    """Take away accelerate's mixed-precision wrapper of `model.forward` (an instance attribute that runs the class
    forward under autocast) and return it, for putting back; None when there is none.

    A served draft runs no autocast: under it every linear layer takes PyTorch's autocast path instead of
    draftsmith's prepacked CPU kernels (decode/kernels.py), which made a 2-layer SmolLM2 draft measure 2-4x its
    served cost inside a bf16 training run, and the run's speedups correspondingly low.
    """
    if "_original_forward" not in model.__dict__ or "forward" not in model.__dict__:
        return None
    return model.__dict__.pop("forward")


def _served_draft(draft: torch.nn.Module, target: torch.nn.Module) -> torch.nn.Module:
    """The model evaluate() measures: a merged copy of a LoRA draft, else the draft in its serving dtype."""
    merged = _merge_lora_for_eval(draft, _serving_dtype(draft, target))
    return merged if merged is not None else _in_serving_dtype(draft, target)


def _serving_dtype(draft: torch.nn.Module, target: torch.nn.Module) -> torch.dtype | None:
    """The target's half-precision dtype when a float32 draft is served next to it; None: keep the draft's."""
    if any(getattr(m, attr, False) for m in (draft, target) for attr in ("is_loaded_in_4bit", "is_loaded_in_8bit")):
        return None
    want = next(target.parameters()).dtype
    have = next(draft.parameters()).dtype
    if want not in (torch.bfloat16, torch.float16) or have != torch.float32:
        return None
    return want


def _in_serving_dtype(draft: torch.nn.Module, target: torch.nn.Module) -> torch.nn.Module:
    """The draft, or an eval-mode copy of it in the target's half-precision dtype (float32 master weights are
    not how a draft is served next to a half-precision target)."""
    dtype = _serving_dtype(draft, target)
    return draft if dtype is None else copy.deepcopy(draft).to(dtype).eval()


def _merge_lora_for_eval(draft: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module | None:
    """A merged, plain copy of a LoRA draft (the model checkpoints save), or None for a draft without adapters.

    Merging and unmerging in place would round the frozen base weights at every evaluation in bf16/fp16 (W + BA
    - BA != W in half precision), drifting the base the adapters are trained against; a copy leaves it bitwise
    as it was. A quantized (QLoRA) draft is measured as it is, unmerged: merging into 4/8-bit weights is lossy.
    """
    if not (hasattr(draft, "merge_adapter") and hasattr(draft, "peft_config")):
        return None
    if getattr(draft, "is_loaded_in_4bit", False) or getattr(draft, "is_loaded_in_8bit", False):
        return None
    from distill.models import export_draft

    return export_draft(draft, dtype)


def eval_metrics(result: dict, prefix: str = "eval/") -> dict[str, float]:
    """The scalar figures of a bench result, named as logged to W&B and metrics.jsonl."""
    lo, hi = speedup_ci95(result) or (result["speedup"]["vs_target"],) * 2
    out = {
        f"{prefix}acceptance_rate": result["acceptance_rate"],
        f"{prefix}mean_accepted_length": result["mean_accepted_length"],
        f"{prefix}speedup": result["speedup"]["vs_target"],
        # the 95% interval on the speedup; the point value on both ends when the bench gave none
        f"{prefix}speedup_ci95_lo": lo,
        f"{prefix}speedup_ci95_hi": hi,
        f"{prefix}theoretical_speedup": result["theoretical_speedup"],
        f"{prefix}tokens_per_s": result["tokens_per_s"]["speculative"],
        f"{prefix}target_tokens_per_s": result["tokens_per_s"]["target"],
        f"{prefix}mean_num_draft_tokens": result["mean_num_draft_tokens"],
    }
    for i, a in enumerate(result["per_position_acceptance"]):
        out[f"{prefix}acceptance_pos_{i + 1}"] = a
    return out


# ---------------------------------------------------------------- output


def speedup_text(result: dict) -> str:
    """The speedup over target-only with its 95% interval, e.g. "1.35x [1.21, 1.52]" (the point alone without one)."""
    ci = speedup_ci95(result)
    point = f"{result['speedup']['vs_target']:.2f}x"
    return f"{point} [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else point


def summary_table(
    base: dict | None, best: dict, best_step: int, clock: dict | None = None, selection: Sequence[str] = ()
) -> str:
    """Base vs best, as printed at the end of a run (base "-" when eval.at_start=false skipped it), each speedup
    with its 95% interval; under it `selection` (report.json's: what the noise let the measurement separate and
    what decided best/) and with `clock` (report.json's) the line of where the run's minutes went
    (:func:`clock_line`)."""
    figures = [
        ("acceptance rate", lambda r: f"{r['acceptance_rate']:.3f}"),
        ("tau (tokens / target pass)", lambda r: f"{r['mean_accepted_length']:.2f}"),
        ("speedup vs target [95%]", speedup_text),
        ("tokens/s speculative", lambda r: f"{r['tokens_per_s']['speculative']:.1f}"),
    ]
    width = max(len(name) for name, _ in figures)
    cols = [get(base) if base is not None else "-" for _, get in figures], [get(best) for _, get in figures]
    left = max(9, *(len(v) for v in cols[0]))
    right = max(len(f"best (step {best_step})"), *(len(v) for v in cols[1]))
    lines = [f"{'':<{width}}  {'base':>{left}}  {f'best (step {best_step})':>{right}}"]
    for (name, _), a, b in zip(figures, *cols):
        lines.append(f"{name:<{width}}  {a:>{left}}  {b:>{right}}")
    if selection:
        lines += ["", *selection]
    if clock is not None:
        lines += ["", clock_line(clock)]
    return "\n".join(lines)


def clock_line(clock: dict) -> str:
    """Where a run's minutes went, in one line, from report.json's `clock`
    (distill.training.run_state.RunClock.summary),
    e.g. "clock: 44.0 training minutes: 12.7 generating the target's data, 31.3 in 849 steps; 6.1 minutes
    evaluating (off the training clock)"."""
    return (
        f"clock: {clock['train_minutes']:.1f} training minutes: {clock['generate_minutes']:.1f} generating the "
        f"target's data, {clock['step_minutes']:.1f} in {clock['steps']} steps; {clock['eval_minutes']:.1f} minutes "
        "evaluating (off the training clock)"
    )


def plot_base_vs_best(base: dict | None, best: dict, path: Path) -> Path:
    """Per-position acceptance of the base draft (when evaluated) and of best/ (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, result in (("base draft", base), ("best", best)):
        if result is None:
            continue
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
    """Training-time budget (train.max_minutes): only the time spent inside `running()` counts, so evaluation
    and checkpointing do not eat the budget, and `elapsed_s` (saved in a checkpoint) lets a resumed run
    continue it instead of starting from zero."""

    def __init__(self, max_minutes: float, elapsed_s: float = 0.0) -> None:
        self.max_s = max_minutes * 60.0
        self._done_s = elapsed_s
        self._since: float | None = None

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        self._since = time.perf_counter()
        try:
            yield
        finally:
            self._done_s += time.perf_counter() - self._since
            self._since = None

    @property
    def elapsed_s(self) -> float:
        """Training seconds so far, including a block still running."""
        running = time.perf_counter() - self._since if self._since is not None else 0.0
        return self._done_s + running

    def expired(self) -> bool:
        return self.max_s > 0 and self.elapsed_s >= self.max_s


def fail(message: str) -> None:
    """One clear line on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
