"""A distill run's directory and bookkeeping: output_dir checks, checkpoints, best/, report.json.

train/distill.py owns the loop; everything it writes to disk goes through `RunState`, which holds what survives
a restart: the evaluated checkpoints' history, the training minutes spent so far and where they went
(`RunClock`), all in each checkpoint's trainer_state.json, so `--resume` continues the best selection, the time
budget and the run's clock.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from distill.config import RecipeError, dump_recipe, save_recipe
from distill.training.checkpoints import (
    TMP_PREFIX,
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
    selection_note,
    steps_to_keep,
    write_json_atomic,
    write_text_atomic,
)

RUN_MARKER = "draftsmith-run.json"  # written into output_dir when a run starts: what --overwrite trusts
LEGACY_RUN_FILES = ("resolved_recipe.yaml", "metrics.jsonl")  # a run from before the marker holds both
TRAINER_STATE = "trainer_state.json"
# Everything a run writes at the top of output_dir (train/distill.py, RunState, distill.draft_init, the rollout
# cache, the trackers), and so all that --overwrite deletes; anything else there is the user's and is kept.
RUN_FILES = (
    RUN_MARKER, "resolved_recipe.yaml", "metrics.jsonl", "base_eval.json", "report.json",
    "acceptance_base_vs_best.png", "search.json", "speed_by_kind.png",
)  # fmt: skip
# candidates: the runs of a multi-kind run's kinds
RUN_DIRS = ("checkpoints", "best", "draft_init", "rollout_cache", "wandb", "candidates")


def is_run_dir(path: Path) -> bool:
    """True when `path` holds a distill run: its marker, or both files every run writes at its start.

    Never a common name alone (a `checkpoints/` folder is in many projects): --overwrite deletes what this
    accepts."""
    path = Path(path)
    return (path / RUN_MARKER).is_file() or all((path / name).is_file() for name in LEGACY_RUN_FILES)


def run_entries(out: Path) -> list[Path]:
    """The entries of the run directory `out` that a run wrote: RUN_FILES, RUN_DIRS, leftovers of atomic writes
    (`.tmp-*`) and a TensorBoard folder (`<log.project>/`, when the run's recipe logged to TensorBoard and the
    folder holds its event files). What --overwrite deletes."""
    out = Path(out)
    names = {*RUN_FILES, *RUN_DIRS}
    tensorboard = _tensorboard_dir(out)
    if tensorboard is not None:
        names.add(tensorboard)
    return sorted(p for p in out.iterdir() if p.name in names or p.name.startswith(TMP_PREFIX))


def _tensorboard_dir(out: Path) -> str | None:
    """The folder accelerate's TensorBoard tracker wrote into `out` (`<log.project>`), or None."""
    try:
        log = (yaml.safe_load((out / "resolved_recipe.yaml").read_text()) or {}).get("log") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    project = log.get("project") if log.get("report_to") == "tensorboard" else None
    if not isinstance(project, str) or not project or "/" in project or project in (".", ".."):
        return None
    return project if any((out / project).rglob("events.out.tfevents.*")) else None


def inputs_under(out: Path, inputs: dict[str, str | None]) -> list[str]:
    """`key 'value'` for every input (recipe key -> path; the recipe file as --recipe) that exists on disk at or
    under `out`. A hub id or an empty key is no local path and never matches."""
    out = Path(out).resolve()
    found = []
    for key, value in inputs.items():
        if not value:
            continue
        path = Path(value).expanduser()
        if path.exists() and path.resolve().is_relative_to(out):
            found.append(f"{key} {value!r}")
    return found


def run_inputs(recipe: Any, recipe_path: str | None) -> dict[str, str | None]:
    """The files and folders a run reads, by recipe key: what --overwrite must not delete."""
    return {
        "--recipe": recipe_path, "target.model": recipe.target.model, "draft.model": recipe.draft.model,
        "data.train_prompts": recipe.data.train_prompts, "data.eval_prompts": recipe.data.eval_prompts,
        "distill.cache_dir": recipe.distill.cache_dir,
    }  # fmt: skip


def prepare_output_dir(out: Path, resume: bool, overwrite: bool, inputs: dict[str, str | None] | None = None) -> str:
    """Create output_dir and mark it as a run, refusing to mix two runs in one directory or to delete (or
    write into) a non-empty directory that is not a run. `--overwrite` deletes what the old run wrote
    (:func:`run_entries`) and nothing else, and refuses when one of the run's `inputs` (:func:`run_inputs`)
    lies in output_dir. Returns the run's id (kept by --resume: the W&B run it continues)."""
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
    replace = overwrite and not resume and occupied
    if replace and (inside := inputs_under(out, inputs or {})):
        raise RecipeError(
            f"--overwrite: {', '.join(inside)} lies in output_dir {str(out)!r}, which --overwrite empties: copy it "
            "out of output_dir first, or set output_dir=... to a new directory"
        )
    run_id = (read_run_id(out) if resume else None) or uuid.uuid4().hex[:8]
    try:
        if replace:
            for entry in run_entries(out):
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        out.mkdir(parents=True, exist_ok=True)
        # first write of every start: marks the run and tests that output_dir is writable
        write_json_atomic(out / RUN_MARKER, {"tool": "draftsmith", "kind": "distill run", "run_id": run_id})
    except OSError as err:
        raise DiskFullError(err.errno, disk_error_message(err, out), out) from None
    return run_id


def read_run_id(out: Path) -> str | None:
    """The run's id: from its marker, else (a run written before the marker held one) from the id in the name
    of its newest W&B run folder (`wandb/offline-run-DATE-ID`, `wandb/run-DATE-ID`); None when neither."""
    try:
        run_id = json.loads((Path(out) / RUN_MARKER).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        run_id = None
    if isinstance(run_id, str) and run_id:
        return run_id
    folders = sorted(Path(out).glob("wandb/*run-*-*"), key=lambda p: p.name.split("-")[-2])
    return folders[-1].name.rsplit("-", 1)[-1] if folders else None


def trim_metrics(path: Path, step: int | None) -> int:
    """--resume from `step`: drop the rows of metrics.jsonl the resumed run writes again, so that every step keeps
    one row of each kind: those past `step`, the start record at `step` (`{"step", "distributed"}`, logged at
    every start) and a line a kill cut short. `step` None (no complete checkpoint: the run starts over from step
    0, its evaluation included) drops every row. Returns how many rows were dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            keep = step is not None and (
                row["step"] < step or (row["step"] == step and set(row) != {"step", "distributed"})
            )
        except (ValueError, KeyError, TypeError):
            keep = False
        kept += [line] if keep else []
        dropped += not keep
    if dropped:
        write_text_atomic(path, "".join(f"{line}\n" for line in kept))
    return dropped


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


@dataclass
class RunClock:
    """Where a run's time went, in seconds of the main process: report.json's and draftsmith-run.json's "clock".

    The training clock (train.max_minutes, `RunState.train_s`) is `generate_s + step_s`; evaluations are off it.
    Saved in every checkpoint's trainer_state.json, so a resumed run continues all three.
    """

    generate_s: float = 0.0  # the target's continuations generated before the first step (source target/mix)
    step_s: float = 0.0  # since the first optimizer step: steps and what they generate (eval.every_minutes' clock)
    eval_s: float = 0.0  # evaluating checkpoints (the main process; the others wait)

    @contextlib.contextmanager
    def generating(self) -> Iterator[None]:
        """Count the block's wall seconds as generating the target's data."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.generate_s += time.perf_counter() - start

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Count the block's wall seconds as evaluating."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.eval_s += time.perf_counter() - start

    def saved(self) -> dict[str, float]:
        """The minutes, for trainer_state.json."""
        return {
            "generate_minutes": self.generate_s / 60.0,
            "step_minutes": self.step_s / 60.0,
            "eval_minutes": self.eval_s / 60.0,
        }

    def restore(self, saved: dict, train_s: float) -> None:
        """Continue a checkpoint's minutes (`saved`: its trainer_state.json; `train_s`: its training clock). What this
        process generated or evaluated before restoring (an EAGLE-3 head's continuations come first) is added to
        the checkpoint's; a checkpoint written without the split counts its whole training clock as steps."""
        generate_s = float(saved.get("generate_minutes") or 0.0) * 60.0
        self.generate_s += generate_s
        self.eval_s += float(saved.get("eval_minutes") or 0.0) * 60.0
        step_minutes = saved.get("step_minutes")
        self.step_s = float(step_minutes) * 60.0 if step_minutes is not None else max(0.0, train_s - generate_s)

    def summary(self, train_s: float, steps: int) -> dict[str, float | int]:
        """report.json's "clock": minutes generating, stepping (their sum: `train_minutes`, what train.max_minutes
        counts) and evaluating, and the optimizer steps taken."""
        return {
            "generate_minutes": self.generate_s / 60.0,
            "step_minutes": self.step_s / 60.0,
            "train_minutes": train_s / 60.0,
            "eval_minutes": self.eval_s / 60.0,
            "steps": steps,
        }


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
        self.clock = RunClock()  # where the seconds went: generating, stepping, evaluating
        self.steps = 0  # optimizer steps taken
        # draft.vocab_subset: (ids, vocab, source, the token lists the ids came from)
        self.draft_vocab: tuple[list[int], int, str, list[list[int]]] | None = None
        self.resumed_step: int | None = None  # the checkpoint --resume continues from
        # {"loss"} of the step whose evaluation an interrupt cut short (distill.training.interrupt): its checkpoint is
        # saved as a resume-only one that says so, and --resume evaluates that step before training on
        self.pending_eval: dict | None = None

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

    def save_recipe(self) -> None:
        """resolved_recipe.yaml in output_dir, whole or not at all: --resume compares the recipe with it."""
        write_text_atomic(self.out / "resolved_recipe.yaml", dump_recipe(self.recipe))

    # ---- resume

    def restore(self) -> tuple[int, Path] | None:
        """Load the newest complete checkpoint's bookkeeping; (step, path) or None when there is none."""
        found = newest_checkpoint(self.ckpt_root)
        if found is not None:
            saved = json.loads((found[1] / TRAINER_STATE).read_text())
            self.history = saved["history"]
            self.train_s = float(saved.get("train_minutes", 0.0)) * 60.0
            self.steps = found[0]
            self.clock.restore(saved, self.train_s)
            self.resumed_step, self.pending_eval = found[0], saved.get("pending_eval")
        return found

    def after_step(self, step: int, train_s: float, step_s: float) -> None:
        """The loop's bookkeeping after optimizer step `step`: the training clock (this process's timer) and its
        minutes of steps (the clock all processes share, :attr:`distill.training.schedule.TrainClock.step_s`)."""
        self.steps, self.train_s, self.clock.step_s = step, train_s, step_s

    def evaluate_first(self, at_start: bool) -> bool:
        """Whether the run evaluates before its first step: a fresh start its starting draft (eval.at_start), a
        resumed one only the step an interrupt left unmeasured. What was measured is never measured again (a
        second base figure would differ from the first by the timing noise)."""
        return self.pending_eval is not None if self.resumed_step is not None else at_start

    @property
    def pending_loss(self) -> float | None:
        """The training loss of the step whose evaluation is pending (None at step 0 or when none is)."""
        return (self.pending_eval or {}).get("loss")

    def trainer_state(self, step: int) -> dict:
        return {
            "step": step, "history": self.history, "train_minutes": self.train_s / 60.0,
            "pending_eval": self.pending_eval, **self.clock.saved(),
        }  # fmt: skip

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

    def finish_checkpoint(self, draft: Any, tokenizer: Any, step: int, result: dict | None, tmp: Path) -> Path:
        """Complete the checkpoint written into `tmp` (training state already there), move it into place,
        export best/ when it is the new best and prune the others. Returns the checkpoint directory.

        `result` None: an interrupt cut the evaluation short (`pending_eval`), and the checkpoint is kept as a
        resume-only one."""
        from decode.kinds.dispatch import kind_of
        from distill import kinds

        if result is None:
            return self.finish_state_only(step, tmp)
        self.pending_eval = None  # measured: no later checkpoint carries it
        # the draft's files in the format its engines read (distill.kinds: an HF checkpoint, an EAGLE-3 head...)
        kinds.get(kind_of(draft)).save_checkpoint(draft, tmp, tokenizer, self.draft_vocab, self.recipe, result)
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
        """Complete a resume-only checkpoint (training state, no evaluation): train.save_every, an interrupt. It
        holds `state/` and trainer_state.json alone (what an evaluation cut short had begun to write goes)."""
        for item in tmp.iterdir():
            if item.name != "state":
                shutil.rmtree(item) if item.is_dir() else item.unlink()
        write_json_atomic(tmp / TRAINER_STATE, self.trainer_state(step))
        final = self.ckpt_root / f"step-{step}"
        replace_dir(tmp, final)
        return final

    # ---- the end

    def report(self, checksums: list[float], world: int) -> dict:
        """report.json's content: base and best evaluations, every checkpoint's figures, where the clock went."""
        infos = self.infos()
        best = select_best(infos)
        # null when eval.at_start=false skipped the starting draft's evaluation
        base = json.loads(path.read_text()) if (path := self.out / "base_eval.json").exists() else None
        return {
            "base": base,
            "best": json.loads((self.out / "best" / "eval.json").read_text()),
            "best_step": best.step,
            # in words: what the timing noise let the measurement separate, and what decided best/
            "selection": selection_note(infos, CheckpointInfo.from_eval(0, base) if base else None),
            "checkpoints": sorted(self.history, key=lambda h: h["step"]),
            "world_size": world,
            "param_checksums": checksums,
            "train_minutes": self.train_s / 60.0,
            "clock": self.clock.summary(self.train_s, self.steps),
        }

    def write_marker(self, clock: dict) -> None:
        """draftsmith-run.json at the end of the run: the marker written at its start, with the run's `clock`
        (report.json's) added."""
        marker = self.out / RUN_MARKER
        content = json.loads(marker.read_text()) if marker.is_file() else {}
        write_json_atomic(marker, {**(content if isinstance(content, dict) else {}), "clock": clock})
