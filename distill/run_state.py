"""A distill run's directory and bookkeeping: output_dir checks, checkpoints, best/, report.json.

train/distill.py owns the loop; everything it writes to disk goes through `RunState`, which holds the two
things that survive a restart: the evaluated checkpoints' history and the training minutes spent so far (both
in each checkpoint's trainer_state.json, so `--resume` continues the best selection and the time budget).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from distill.checkpoints import (
    CheckpointInfo,
    DiskFullError,
    atomic_dir,
    clean_temporaries,
    disk_error_message,
    newest_checkpoint,
    prune_checkpoints,
    recover_replace,
    replace_dir,
    select_best,
    steps_to_keep,
    write_json_atomic,
)
from distill.config import RecipeError, dump_recipe, save_recipe

RUN_MARKER = "draftsmith-run.json"  # written into output_dir when a run starts: what --overwrite trusts
LEGACY_RUN_FILES = ("resolved_recipe.yaml", "metrics.jsonl")  # a run from before the marker holds both
TRAINER_STATE = "trainer_state.json"


def is_run_dir(path: Path) -> bool:
    """True when `path` holds a distill run: its marker, or both files every run writes at its start.

    Never a common name alone (a `checkpoints/` folder is in many projects): --overwrite deletes what this
    accepts."""
    path = Path(path)
    return (path / RUN_MARKER).is_file() or all((path / name).is_file() for name in LEGACY_RUN_FILES)


def prepare_output_dir(out: Path, resume: bool, overwrite: bool) -> None:
    """Create output_dir and mark it as a run, refusing to mix two runs in one directory or to delete (or
    write into) a non-empty directory that is not a run."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise RecipeError(f"output_dir {str(out)!r} is a file: choose a directory path for output_dir")
    occupied = out.is_dir() and any(out.iterdir())
    if occupied and not is_run_dir(out):
        what = "--resume: " if resume else "--overwrite: " if overwrite else ""
        action = "refusing to delete it" if overwrite and not resume else "refusing to write into it"
        raise RecipeError(
            f"{what}output_dir {str(out)!r} is not empty and holds no draftsmith run (no {RUN_MARKER}); "
            f"{action}: set output_dir=... to a new or empty directory"
        )
    if occupied and not resume and not overwrite:
        raise RecipeError(
            f"output_dir {str(out)!r} already holds a run: pass --resume to continue it, --overwrite to replace "
            "it, or set output_dir=... to a new directory"
        )
    try:
        if overwrite and not resume and occupied:
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
        # first write of every start: marks the run and tests that output_dir is writable
        write_json_atomic(out / RUN_MARKER, {"tool": "draftsmith", "kind": "distill run"})
    except OSError as err:
        raise DiskFullError(err.errno, disk_error_message(err, out)) from None


# Keys --resume may change without --allow-recipe-change: they decide where the run logs and publishes, how
# long processes wait for each other and which checkpoints stay on disk, never what is trained or measured.
FREE_ON_RESUME = (
    "output_dir", "log.", "publish.", "train.dist_timeout_minutes", "train.save_every", "eval.keep_top_k",
    "eval.extra_engines",
)  # fmt: skip


def free_on_resume(key: str, recipe: Any) -> bool:
    """Whether `key` may differ from the run's recipe on --resume. The training budget that is not the schedule's
    horizon (train.schedule_by) only says when to stop, so a run can be extended or cut short through it."""
    if key == "train.max_minutes":
        return recipe.train.schedule_by == "steps"
    if key == "train.max_steps":
        return recipe.train.schedule_by == "minutes"
    return any(key == free or (free.endswith(".") and key.startswith(free)) for free in FREE_ON_RESUME)


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1}} -> {"train.lr": 1}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def recipe_changes(saved: dict, recipe: Any) -> dict[str, tuple[Any, Any]]:
    """key -> (saved value, value now) for every key of `recipe` that differs from the `saved` resolved recipe.
    A key `saved` lacks (one draftsmith added since) counts at its default; one it alone has is ignored."""
    now = flatten(yaml.safe_load(dump_recipe(recipe)))
    before = {**flatten(yaml.safe_load(dump_recipe(type(recipe)()))), **flatten(saved)}
    return {key: (before.get(key), value) for key, value in now.items() if before.get(key) != value}


def check_resume_recipe(out: Path, recipe: Any, allow_change: bool) -> list[str]:
    """--resume: refuse a recipe that differs from the run's resolved_recipe.yaml in a key that changes what is
    trained or measured, unless `allow_change` (--allow-recipe-change). Returns "key: old -> new" for every
    changed key, to print."""
    path = Path(out) / "resolved_recipe.yaml"
    if not path.is_file():
        return []
    try:
        saved = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        saved = None
    if not isinstance(saved, dict):
        if allow_change:
            return []
        raise RecipeError(f"--resume: {path} is not a YAML mapping: restore it, or pass --allow-recipe-change")
    changes = recipe_changes(saved, recipe)
    described = {key: f"{key}: {old!r} -> {new!r}" for key, (old, new) in changes.items()}
    blocking = [described[key] for key in changes if not free_on_resume(key, recipe)]
    if blocking and not allow_change:
        raise RecipeError(
            f"--resume: the recipe differs from the run's resolved_recipe.yaml in {'; '.join(blocking)}: resume "
            "with the run's values, or pass --allow-recipe-change to continue with the new ones"
        )
    return list(described.values())


def export_best(checkpoint: Path, best: Path) -> None:
    """best/ = the winning checkpoint's merged model, tokenizer, eval.json and recipe (no training state)."""
    with atomic_dir(best) as tmp:
        for item in checkpoint.iterdir():
            if item.name in ("state", TRAINER_STATE):
                continue
            copy = shutil.copytree if item.is_dir() else shutil.copy2
            copy(item, tmp / item.name)


def read_eval(directory: Path) -> dict | None:
    """A checkpoint's (or best/'s) eval.json, or None when it has none."""
    path = Path(directory) / "eval.json"
    return json.loads(path.read_text()) if path.is_file() else None


def selected_checkpoint(out: Path) -> Path | None:
    """checkpoints/step-N that the history of the run's newest checkpoint selects as best, or None (no history)."""
    found = newest_checkpoint(Path(out) / "checkpoints", require=TRAINER_STATE)
    history = json.loads((found[1] / TRAINER_STATE).read_text()).get("history") if found else None
    if not history:
        return None
    return Path(out) / "checkpoints" / f"step-{select_best([CheckpointInfo.from_dict(h) for h in history]).step}"


def stale_best(out: Path) -> str | None:
    """Why the run's best/ is not what the run selected, or None when it is (or there is nothing to compare).

    best/ must be the checkpoint the newest history selects, and report.json (written when the run ends) must
    state best/'s figures. A run stopped between renaming a new best into checkpoints/ and exporting it, or
    resumed and stopped before its end, breaks one of the two until `--resume` finishes it."""
    out = Path(out)
    best = read_eval(out / "best")
    if best is None:
        return None
    chosen = selected_checkpoint(out)
    if chosen is not None and read_eval(chosen) not in (None, best):
        return f"best/ is not {chosen.name}, the checkpoint the run's history selects"
    report = out / "report.json"
    if report.is_file() and json.loads(report.read_text()).get("best") != best:
        return "report.json states other figures than best/eval.json"
    return None


class RunState:
    """The evaluated checkpoints so far and the training time spent, and the writers of the run directory.

    All methods that write are called on the main process only (the caller checks), except where noted.
    """

    def __init__(self, out: Path, recipe: Any) -> None:
        self.out = Path(out)
        self.ckpt_root = self.out / "checkpoints"
        self.recipe = recipe
        self.history: list[dict] = []  # CheckpointInfo.as_dict() rows, one per evaluated step
        self.train_s = 0.0  # training wall-clock seconds so far (evaluation and saving excluded)
        # draft.vocab_subset: (ids, vocab, source, the token lists the ids came from)
        self.draft_vocab: tuple[list[int], int, str, list[list[int]]] | None = None

    # ---- start

    def clean_temporaries(self) -> None:
        """Remove what an interrupted run left half-written, restoring a best/ it was replacing, and make best/
        the checkpoint the history selects."""
        recover_replace(self.out / "best")
        clean_temporaries(self.out)
        clean_temporaries(self.ckpt_root)
        self.reconcile_best()

    def reconcile_best(self) -> bool:
        """Re-export best/ when it is not the checkpoint the history selects: a run killed after renaming a new
        best step-N into place and before exporting it leaves the old best/ behind (step-N is never pruned
        before its export, so it is there to copy). True when best/ was replaced."""
        chosen = selected_checkpoint(self.out)
        if chosen is None or read_eval(chosen) in (None, read_eval(self.out / "best")):
            return False
        export_best(chosen, self.out / "best")
        return True

    # ---- resume

    def restore(self) -> tuple[int, Path] | None:
        """Load the newest complete checkpoint's bookkeeping; (step, path) or None when there is none."""
        found = newest_checkpoint(self.ckpt_root)
        if found is not None:
            saved = json.loads((found[1] / TRAINER_STATE).read_text())
            self.history = saved["history"]
            self.train_s = float(saved.get("train_minutes", 0.0)) * 60.0
        return found

    def trainer_state(self, step: int) -> dict:
        return {"step": step, "history": self.history, "train_minutes": self.train_s / 60.0}

    # ---- checkpoints

    def tmp_dir(self, step: int) -> Path:
        return self.ckpt_root / f".tmp-step-{step}"

    def record(self, step: int, result: dict) -> CheckpointInfo:
        """Add (or replace) `step` in the history from its bench result."""
        info = CheckpointInfo.from_eval(step, result)
        self.history = [h for h in self.history if h["step"] != step] + [info.as_dict()]
        return info

    def infos(self) -> list[CheckpointInfo]:
        return [CheckpointInfo.from_dict(h) for h in self.history]

    def finish_checkpoint(self, draft: Any, tokenizer: Any, step: int, result: dict, tmp: Path) -> Path:
        """Complete the checkpoint written into `tmp` (training state already there), move it into place,
        export best/ when it is the new best and prune the others. Returns the checkpoint directory."""
        from decode.draft_vocab import save_ids, with_masked_head
        from distill import models

        if getattr(draft, "kind", None) == "eagle3":  # the served format: config.json + model.safetensors
            from decode.kinds import eagle3
            from decode.kinds.eagle3_formats import verifier_name
            from distill.draft_folder import best_gamma

            # speculators keys: `vllm serve best/` runs the recipe's target with the gamma measured here
            verifier = verifier_name(self.recipe.target.model)
            eagle3.save(draft, tmp, verifier=verifier, speculative_tokens=best_gamma(result))
            tokenizer.save_pretrained(tmp)  # the head has the target's tokenizer; engines and the card read it
        elif self.draft_vocab is None:
            models.save_draft(draft, tmp, tokenizer)
        else:
            ids, vocab, source, text = self.draft_vocab
            # Trained over its draft vocabulary: the head's other rows are stale, so engines that run the full
            # head get them masked (decode.draft_vocab.with_masked_head); the training draft keeps its tied head.
            saved, head = draft, None
            if self.recipe.distill.loss_vocab == "subset":
                saved, head = with_masked_head(draft, ids, text)
            models.save_draft(saved, tmp, tokenizer)
            save_ids(tmp, ids, vocab=vocab, source=source, saved_head=head)
        write_json_atomic(tmp / "eval.json", result)
        if step == 0:
            write_json_atomic(self.out / "base_eval.json", result)  # step-0 may be pruned; report.json needs it
        save_recipe(self.recipe, tmp)
        self.record(step, result)
        write_json_atomic(tmp / TRAINER_STATE, self.trainer_state(step))
        final = self.ckpt_root / f"step-{step}"
        replace_dir(tmp, final)
        infos = self.infos()
        if select_best(infos).step == step:
            export_best(final, self.out / "best")
        prune_checkpoints(self.ckpt_root, steps_to_keep(infos, self.recipe.eval.keep_top_k, newest_step=step))
        return final

    def finish_state_only(self, step: int, tmp: Path) -> Path:
        """Complete a resume-only checkpoint (training state, no evaluation): train.save_every."""
        write_json_atomic(tmp / TRAINER_STATE, self.trainer_state(step))
        final = self.ckpt_root / f"step-{step}"
        replace_dir(tmp, final)
        return final

    # ---- the end

    def report(self, checksums: list[float], world: int) -> dict:
        """report.json's content: base and best evaluations, every checkpoint's figures."""
        best = select_best(self.infos())
        return {
            # null when eval.at_start=false skipped the starting draft's evaluation
            "base": json.loads(base.read_text()) if (base := self.out / "base_eval.json").exists() else None,
            "best": json.loads((self.out / "best" / "eval.json").read_text()),
            "best_step": best.step,
            "checkpoints": sorted(self.history, key=lambda h: h["step"]),
            "world_size": world,
            "param_checksums": checksums,
            "train_minutes": self.train_s / 60.0,
        }
