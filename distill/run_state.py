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
from distill.config import RecipeError, save_recipe

RUN_MARKERS = ("resolved_recipe.yaml", "checkpoints", "report.json")  # what marks a directory as a distill run
TRAINER_STATE = "trainer_state.json"


def looks_like_run_dir(path: Path) -> bool:
    """True when `path` holds something only a distill run writes."""
    return any((Path(path) / name).exists() for name in RUN_MARKERS)


def prepare_output_dir(out: Path, resume: bool, overwrite: bool) -> None:
    """Create output_dir, refusing to mix two runs in one directory or to delete a directory that is not a run."""
    out = Path(out)
    if overwrite and not resume and out.exists():
        if not out.is_dir():
            raise RecipeError(f"output_dir {str(out)!r} is a file: choose a directory path for output_dir")
        if any(out.iterdir()) and not looks_like_run_dir(out):
            raise RecipeError(
                f"--overwrite: output_dir {str(out)!r} is not empty and holds no draftsmith run "
                f"({', '.join(RUN_MARKERS)}); refusing to delete it: set output_dir=... to a new directory"
            )
    try:
        if overwrite and not resume and out.exists():
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


def export_best(checkpoint: Path, best: Path) -> None:
    """best/ = the winning checkpoint's merged model, tokenizer, eval.json and recipe (no training state)."""
    with atomic_dir(best) as tmp:
        for item in checkpoint.iterdir():
            if item.name in ("state", TRAINER_STATE):
                continue
            copy = shutil.copytree if item.is_dir() else shutil.copy2
            copy(item, tmp / item.name)


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
        self.draft_vocab: tuple[list[int], int, str] | None = None  # draft.vocab_subset: (ids, vocab, source)

    # ---- start

    def clean_temporaries(self) -> None:
        """Remove what an interrupted earlier run left half-written, restoring a best/ it was replacing."""
        recover_replace(self.out / "best")
        clean_temporaries(self.out)
        clean_temporaries(self.ckpt_root)

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

            eagle3.save(draft, tmp)
            tokenizer.save_pretrained(tmp)  # the head has the target's tokenizer; engines and the card read it
        elif self.draft_vocab is None:
            models.save_draft(draft, tmp, tokenizer)
        else:
            ids, vocab, source = self.draft_vocab
            # Trained over its draft vocabulary: the head's other rows are stale, so engines that run the full
            # head get them masked (decode.draft_vocab.with_masked_head); the training draft keeps its tied head.
            subset_trained = self.recipe.distill.loss_vocab == "subset"
            models.save_draft(with_masked_head(draft, ids) if subset_trained else draft, tmp, tokenizer)
            save_ids(tmp, ids, vocab=vocab, source=source)
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
            "base": json.loads((self.out / "base_eval.json").read_text()),
            "best": json.loads((self.out / "best" / "eval.json").read_text()),
            "best_step": best.step,
            "checkpoints": sorted(self.history, key=lambda h: h["step"]),
            "world_size": world,
            "param_checksums": checksums,
            "train_minutes": self.train_s / 60.0,
        }
