"""The distill run directory: best selection beyond timing noise, output_dir safety, durable writes, the
training-time budget across --resume, and building only the missing quickstart assets."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from distill.config import LogConfig, Recipe, RecipeError, load_recipe, save_recipe
from distill.training.checkpoints import (
    CheckpointInfo,
    beats,
    replace_dir,
    select_best,
    selection_note,
    steps_to_keep,
    write_json_atomic,
)
from distill.training.helpers import Timer, eval_metrics, summary_table
from distill.training.run_state import (
    RUN_DIRS,
    RUN_FILES,
    RUN_MARKER,
    RunClock,
    RunState,
    check_resume_recipe,
    is_run_dir,
    prepare_output_dir,
    read_run_id,
    run_entries,
    run_inputs,
    trim_metrics,
)
from distill.training.tracking import tracker_setup
from tests.procs import (
    HAS_PROC,
    free_port,
    load_script,
    running,
    stop_tree,
    tiny_recipe,
    tiny_run_paths,
    wait_for_child,
)

REPO = Path(__file__).resolve().parent.parent


def info(step: int, speedup: float, ci: tuple[float, float] | None, acceptance: float = 0.5) -> CheckpointInfo:
    return CheckpointInfo(step, speedup=speedup, acceptance_rate=acceptance, loss=None, speedup_ci95=ci)


# ---------------------------------------------------------------- selection


def test_a_noisy_higher_speedup_does_not_replace_the_incumbent():
    base = info(0, 1.20, (1.10, 1.30), acceptance=0.50)
    noisy = info(10, 1.25, (1.05, 1.45), acceptance=0.45)  # higher point value, interval reaches below 1.20
    assert not beats(noisy, base)
    assert select_best([base, noisy]).step == 0


def test_a_clear_win_replaces_and_ties_go_to_acceptance():
    base = info(0, 1.20, (1.15, 1.25), acceptance=0.50)
    clear = info(10, 1.40, (1.30, 1.50), acceptance=0.40)  # lower bound 1.30 > 1.20
    assert select_best([base, clear]).step == 10
    within = info(20, 1.38, (1.20, 1.56), acceptance=0.60)  # within the noise of step 10, higher acceptance
    assert select_best([base, clear, within]).step == 20
    worse = info(30, 1.10, (1.05, 1.15), acceptance=0.90)  # incumbent's lower bound 1.20 > 1.10: clearly slower
    assert select_best([base, clear, within, worse]).step == 20
    # The order of the list does not matter: checkpoints are walked in step order.
    assert select_best([worse, within, base, clear]).step == 20


def test_ties_go_to_tau_where_both_have_it():
    """With num_draft_tokens=auto a draft that drafts longer accepts a smaller share of more tokens: within the
    noise, the checkpoint with more tokens per target pass wins, whatever the acceptance rates say."""
    early = CheckpointInfo(10, 1.08, 0.377, None, (1.00, 1.16), tau=1.43)  # the figures of a real auto run
    later = CheckpointInfo(20, 1.13, 0.360, None, (1.05, 1.21), tau=1.63)
    last = CheckpointInfo(30, 1.09, 0.359, None, (1.02, 1.17), tau=1.57)
    assert beats(later, early) and not beats(last, later)
    assert select_best([early, later, last]).step == 20
    # rows without tau (written before it was recorded) still compare by acceptance
    assert select_best([info(10, 1.08, (1.0, 1.16), 0.377), info(20, 1.13, (1.05, 1.21), 0.360)]).step == 10
    assert CheckpointInfo.from_dict(later.as_dict()) == later


def test_without_intervals_selection_is_by_point_speedup():
    infos = [info(0, 1.1, None), info(5, 1.3, None, 0.4), info(9, 1.3, None, 0.4), info(12, 1.2, None, 0.9)]
    assert select_best(infos).step == 9


def test_the_end_table_says_when_the_measurement_could_not_separate_best_from_the_others_or_the_base():
    """A quickstart on a loaded CPU printed base 0.72x and best (step 64) 0.35x: best/ had been walked to by tau
    through a noisy step 32 although step 64 is slower than the base beyond the noise. Now such a checkpoint is
    out, each speedup is shown with its interval, and the table says in words what decided."""
    base = CheckpointInfo(0, 0.72, 0.30, None, (0.40, 1.10), tau=1.3)
    noisy = CheckpointInfo(32, 0.80, 0.31, None, (0.35, 1.20), tau=1.4)
    slower = CheckpointInfo(64, 0.35, 0.40, None, (0.20, 0.90), tau=1.9)  # the base's lower bound 0.40 > 0.35
    assert select_best([base, noisy, slower]).step == 32
    notes = selection_note([base, noisy, slower], base)
    assert "step 0" in notes[0] and "could not separate them" in notes[0] and "1.40 against 1.30" in notes[0]
    assert "base draft" in notes[1] and "inside the noise" in notes[1]
    clear = CheckpointInfo(96, 1.60, 0.50, None, (1.50, 1.70), tau=2.5)
    notes = selection_note([base, noisy, slower, clear], base)
    assert notes == ["best/ (step 96) is faster (1.60x [1.50, 1.70] against 0.80x) than the next fastest, step 32."]
    result = {**bench_result(5, 1.3), "tokens_per_s": {"speculative": 100.0}}
    result["speedup"]["vs_target_ci95"] = [1.1, 1.5]
    table = summary_table(None, result, 5, selection=["the note"])
    assert "1.30x [1.10, 1.50]" in table and table.splitlines()[-1] == "the note"


PROMPT_SPREAD = [0.90, 1.00, 1.10, 1.20, 1.30, 1.40, 1.50, 1.60]  # one checkpoint's speedup on 8 eval prompts


def _eval(ratio: float, ci: list[float], tau: float, jitter: float = 0.01, ids: str = "p") -> dict:
    """A bench result whose per-prompt speedups are PROMPT_SPREAD times `ratio`, give or take `jitter` (timing
    noise), and whose own interval `ci` (the bootstrap over prompts) holds the prompt spread."""
    per_prompt = [s * ratio * (1 + jitter * (-1) ** i) for i, s in enumerate(PROMPT_SPREAD)]
    return {
        "speedup": {"vs_target": sum(per_prompt) / len(per_prompt), "vs_target_ci95": ci},
        "speedup_per_batch": {"prompt_ids": [[f"{ids}{i}"] for i in range(8)], "vs_target": per_prompt},
        "acceptance_rate": 0.5,
        "mean_accepted_length": tau,
    }


def _select(tmp_path, results: dict[int, dict]) -> int:
    """The step select_best picks from these eval results, recorded as a run records them."""
    state = RunState(tmp_path, Recipe())
    for step, result in results.items():
        state.record(step, result)
    return select_best(state.infos()).step


def test_paired_per_prompt_speedups_decide_what_prompt_spread_hides(tmp_path):
    """The incumbent's interval over prompts ([1.05, 1.45]) overlaps the challenger's, so each one's own interval
    calls the two a tie and tau picks; on the same prompts the challenger is 6% faster on every one (and 5%
    slower on every one in the converse): beyond the timing noise, whatever tau says."""
    incumbent = _eval(1.00, [1.05, 1.45], tau=2.0)
    faster = _eval(1.06, [1.11, 1.54], tau=1.9)
    assert _select(tmp_path, {10: incumbent, 20: faster}) == 20
    slower = _eval(0.95, [1.00, 1.38], tau=2.1)
    assert _select(tmp_path, {10: incumbent, 20: slower}) == 10
    # Per prompt as often faster as slower (6% either way): within the noise, so tau decides.
    mixed = _eval(1.00, [1.05, 1.45], tau=2.1, jitter=0.06)
    assert _select(tmp_path, {10: incumbent, 20: mixed}) == 20
    assert _select(tmp_path, {10: incumbent, 20: {**mixed, "mean_accepted_length": 1.9}}) == 10


def test_without_pairs_on_the_same_prompts_each_ones_interval_decides(tmp_path):
    incumbent = _eval(1.00, [1.05, 1.45], tau=2.0)
    faster = _eval(1.06, [1.11, 1.54], tau=1.9)
    # eval.json written without per-batch figures: the interval rule, a tie that tau settles
    old = {k: v for k, v in faster.items() if k != "speedup_per_batch"}
    assert _select(tmp_path, {10: incumbent, 20: old}) == 10
    # other prompts: nothing to pair
    assert _select(tmp_path, {10: incumbent, 20: _eval(1.06, [1.11, 1.54], tau=1.9, ids="q")}) == 10
    # one batch: no interval over pairs; the own interval (its repeats) decides
    one = {**faster, "speedup_per_batch": {"prompt_ids": [["p0"]], "vs_target": [1.3]}}
    assert _select(tmp_path, {10: {**incumbent, "speedup_per_batch": one["speedup_per_batch"]}, 20: one}) == 10


def test_the_selected_best_is_always_kept():
    base = info(0, 1.20, (1.15, 1.25), acceptance=0.50)
    noisy = [info(s, 1.22, (1.0, 1.44), acceptance=0.40) for s in (10, 20)]  # higher points, all noise
    assert select_best([base, *noisy]).step == 0
    assert 0 in steps_to_keep([base, *noisy], keep_top_k=1, newest_step=20)


def test_interval_recorded_in_history_report_and_metrics(tmp_path):
    state = RunState(tmp_path, Recipe())
    result = {"speedup": {"vs_target": 1.3, "vs_target_ci95": [1.1, 1.5]}, "acceptance_rate": 0.6, "train_loss": 2.0}
    state.record(4, result)
    row = {"step": 4, "speedup": 1.3, "speedup_ci95": [1.1, 1.5], "acceptance_rate": 0.6, "loss": 2.0}
    # the result carries no training clock, no tau, no per-batch speedups
    row["train_minutes"] = row["mean_accepted_length"] = row["speedup_per_batch"] = None
    assert state.history == [row]
    assert CheckpointInfo.from_dict(state.history[0]).interval == (1.1, 1.5)
    full = {
        **result,
        "mean_accepted_length": 2.0,
        "theoretical_speedup": 1.5,
        "tokens_per_s": {"speculative": 10.0, "target": 8.0},
        "mean_num_draft_tokens": 3.0,
        "per_position_acceptance": [0.7],
    }
    assert (eval_metrics(full)["eval/speedup_ci95_lo"], eval_metrics(full)["eval/speedup_ci95_hi"]) == (1.1, 1.5)
    full["speedup"] = {"vs_target": 1.3, "vs_target_ci95": None}  # no interval: the point value on both ends
    assert (eval_metrics(full)["eval/speedup_ci95_lo"], eval_metrics(full)["eval/speedup_ci95_hi"]) == (1.3, 1.3)


# ---------------------------------------------------------------- output_dir, durable writes


def test_overwrite_refuses_a_directory_that_is_not_a_run(tmp_path):
    precious = tmp_path / "thesis"
    precious.mkdir()
    (precious / "chapter1.tex").write_text("years of work")
    with pytest.raises(RecipeError, match="not empty and holds no draftsmith run"):
        prepare_output_dir(precious, resume=False, overwrite=True)
    assert (precious / "chapter1.tex").read_text() == "years of work"


def test_overwrite_never_takes_a_checkpoints_folder_for_a_run(tmp_path):
    """`mkdir -p x/checkpoints; echo hi > x/thesis.tex`: a common folder name does not make a run."""
    precious = tmp_path / "x"
    (precious / "checkpoints").mkdir(parents=True)
    (precious / "thesis.tex").write_text("hi")
    (precious / "report.json").write_text("{}")
    for resume, overwrite, match in (
        (False, True, "refusing to delete it"),
        (True, False, "--resume"),
        (False, False, "no draftsmith-run.json"),
    ):
        with pytest.raises(RecipeError, match=match):
            prepare_output_dir(precious, resume=resume, overwrite=overwrite)
    assert (precious / "thesis.tex").read_text() == "hi"
    assert sorted(p.name for p in precious.iterdir()) == ["checkpoints", "report.json", "thesis.tex"]


def test_a_run_is_marked_when_it_starts_and_only_runs_are_overwritten(tmp_path):
    run = tmp_path / "run"
    prepare_output_dir(run, resume=False, overwrite=False)
    assert sorted(p.name for p in run.iterdir()) == [RUN_MARKER]
    (run / "checkpoints").mkdir()
    (run / "report.json").write_text("{}")
    with pytest.raises(RecipeError, match="already holds a run: pass --resume"):
        prepare_output_dir(run, resume=False, overwrite=False)
    prepare_output_dir(run, resume=True, overwrite=False)  # continued in place
    assert (run / "report.json").is_file()
    prepare_output_dir(run, resume=False, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == [RUN_MARKER]
    # a run written before the marker: recognised by the two files every run writes at its start
    legacy = tmp_path / "legacy"
    (legacy / "checkpoints" / "step-0").mkdir(parents=True)
    (legacy / "resolved_recipe.yaml").write_text("output_dir: legacy\n")
    (legacy / "metrics.jsonl").write_text("")
    assert is_run_dir(legacy) and not is_run_dir(legacy / "checkpoints")
    prepare_output_dir(legacy, resume=False, overwrite=True)
    assert sorted(p.name for p in legacy.iterdir()) == [RUN_MARKER]


def finished_run(out: Path, *user_files: str) -> Path:
    """A run directory holding every name a run writes (RUN_FILES, RUN_DIRS, a TensorBoard folder, a temporary)
    and `user_files` (names the run never writes)."""
    out.mkdir(parents=True)
    for name in RUN_FILES:
        (out / name).write_text("{}")
    recipe = Recipe()
    recipe.log.report_to, recipe.log.project = "tensorboard", "tb-project"
    save_recipe(recipe, out)
    for name in RUN_DIRS:
        (out / name / "sub").mkdir(parents=True)
        (out / name / "sub" / "file").write_text("run data")
    (out / "tb-project").mkdir()
    (out / "tb-project" / "events.out.tfevents.1.host").write_text("")
    (out / ".tmp-report.json-123").write_text("")
    for name in user_files:
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("years of work")
    return out


def test_overwrite_deletes_what_the_run_wrote_and_nothing_else(tmp_path):
    """A run directory that is also where the user keeps `thesis.tex` (and a folder named like the run's
    TensorBoard project, without event files): --overwrite removes the old run and leaves the rest."""
    out = finished_run(tmp_path / "run", "thesis.tex", "notes/chapter1.tex", "draftsmith/keep.txt")
    assert sorted(p.name for p in run_entries(out)) == sorted(
        [*RUN_FILES, *RUN_DIRS, "tb-project", ".tmp-report.json-123"]
    )
    prepare_output_dir(out, resume=False, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == sorted([RUN_MARKER, "thesis.tex", "notes", "draftsmith"])
    assert (out / "thesis.tex").read_text() == (out / "notes" / "chapter1.tex").read_text() == "years of work"
    # a run written before the marker, recognised by resolved_recipe.yaml + metrics.jsonl alone
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for name in ("resolved_recipe.yaml", "metrics.jsonl", "thesis.tex"):
        (legacy / name).write_text("x")
    prepare_output_dir(legacy, resume=False, overwrite=True)
    assert sorted(p.name for p in legacy.iterdir()) == [RUN_MARKER, "thesis.tex"]


def test_overwrite_refuses_when_an_input_lies_in_output_dir(tmp_path):
    """`output_dir=RUN draft.model=RUN/best --overwrite` would delete the model the run is to start from (and the
    same for the target, the prompt files, the rollout cache and the recipe file): refused, nothing deleted."""
    out = finished_run(tmp_path / "run")
    (out / "mine").mkdir()
    for name in ("train.jsonl", "eval.jsonl", "recipe.yaml"):
        (out / "mine" / name).write_text("{}")
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    recipe = Recipe()
    recipe.target.model = str(tmp_path / "elsewhere")  # not in output_dir (and not on disk): never matches
    recipe.draft.model = str(out / "best")
    cases = {
        "draft.model": {},
        "target.model": {"target": out / "checkpoints" / "sub", "draft": "HuggingFaceTB/SmolLM2-135M"},
        "data.train_prompts": {"draft": "", "train": out / "mine" / "train.jsonl"},
        "data.eval_prompts": {"draft": "", "eval": out / "mine" / "eval.jsonl"},
        "distill.cache_dir": {"draft": "", "cache": out / "rollout_cache"},
        "--recipe": {"draft": "", "recipe": out / "mine" / "recipe.yaml"},
    }
    for key, change in cases.items():
        case = Recipe()
        case.draft.model = str(change.get("draft", recipe.draft.model))
        case.target.model = str(change.get("target", recipe.target.model))
        case.data.train_prompts = str(change.get("train", "prompts.jsonl"))
        case.data.eval_prompts = str(change.get("eval", ""))
        case.distill.cache_dir = str(change.get("cache", ""))
        inputs = run_inputs(case, str(change["recipe"]) if "recipe" in change else None)
        with pytest.raises(RecipeError) as err:
            prepare_output_dir(out, resume=False, overwrite=True, inputs=inputs)
        line = str(err.value)
        assert f"--overwrite: {key} " in line and "lies in output_dir" in line and "copy it out" in line, line
        assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
    # --resume deletes nothing: an input in output_dir is no harm there
    prepare_output_dir(out, resume=True, overwrite=True, inputs=run_inputs(recipe, None))
    assert (out / "best" / "sub" / "file").is_file()


def test_resume_keeps_the_run_id_and_overwrite_makes_a_new_one(tmp_path):
    """The id names the W&B run: a resumed run continues it, a replaced one starts its own."""
    out = tmp_path / "run"
    first = prepare_output_dir(out, resume=False, overwrite=False)
    assert read_run_id(out) == first and len(first) == 8
    assert prepare_output_dir(out, resume=True, overwrite=False) == first
    assert prepare_output_dir(out, resume=False, overwrite=True) != first
    # a run whose marker holds no id: the one of its newest W&B run folder
    (out / RUN_MARKER).write_text("{}")
    (out / "wandb" / "offline-run-20240101_000000-aaaa1111").mkdir(parents=True)
    (out / "wandb" / "offline-run-20240102_000000-bbbb2222").mkdir()
    assert prepare_output_dir(out, resume=True, overwrite=False) == "bbbb2222"
    _, kwargs = tracker_setup(LogConfig(report_to="wandb"), out, is_main=True, run_id="bbbb2222")
    assert kwargs["wandb"]["id"] == "bbbb2222" and kwargs["wandb"]["resume"] == "allow"


def test_trim_metrics_keeps_one_row_per_step_of_each_kind(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [
        {"step": 0, "distributed": {"engine": "ddp"}}, {"step": 0, "eval/speedup": 1.0},
        *({"step": s, "train/loss": 1.0 / s} for s in range(1, 6)),
        {"step": 4, "eval/speedup": 1.5}, {"step": 4, "distributed": {"engine": "ddp"}},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "train/lo')  # a line cut by a kill
    assert trim_metrics(path, 4) == 3  # step 5, the start record at step 4 (written again), the cut line
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert kept == [r for r in rows if r["step"] < 4 or (r["step"] == 4 and "distributed" not in r)]


def test_write_json_atomic_fsyncs_file_and_directory(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}") if Path("/proc/self/fd").is_dir() else str(fd))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    write_json_atomic(tmp_path / "eval.json", {"a": 1})
    assert json.loads((tmp_path / "eval.json").read_text()) == {"a": 1}
    assert len(synced) == 2  # the file's data, then the directory holding the rename
    if Path("/proc/self/fd").is_dir():
        assert synced[1] == str(tmp_path)


def test_replace_dir_swaps_whole_directories(tmp_path):
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "old").write_text("old")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "model").write_text("new")
    replace_dir(tmp_path / "new", tmp_path / "best")
    assert [p.name for p in (tmp_path / "best").iterdir()] == ["model"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]


def test_a_replace_killed_between_its_renames_keeps_the_old_best(tmp_path):
    state = RunState(tmp_path, Recipe())
    aside = tmp_path / ".tmp-old-best-123"  # the old best/, renamed aside; the new one never arrived
    aside.mkdir()
    (aside / "model.safetensors").write_text("old weights")
    (tmp_path / ".tmp-best-123").mkdir()  # the new one, half-written
    state.clean_temporaries()
    assert (tmp_path / "best" / "model.safetensors").read_text() == "old weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]


def bench_result(step: int, speedup: float) -> dict:
    """The figures a checkpoint's eval.json holds (what train/distill.py adds included)."""
    return {
        "step": step, "speedup": {"vs_target": speedup, "vs_target_ci95": None}, "acceptance_rate": 0.5,
        "mean_accepted_length": 2.0, "num_draft_tokens": 3, "temperature": 0.0, "new_tokens": 12, "train_loss": None,
    }  # fmt: skip


# The crash point: checkpoints/step-3, the new best, has been renamed into place; best/ is not yet replaced.
KILLED_BEFORE_EXPORT = """
import json, os, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import distill.training.run_state as rs
from distill.config import Recipe
from tests.tiny import CHAR_VOCAB, char_tokenizer, tiny_llama

export = rs.export_best
def export_or_die(checkpoint, best):
    if checkpoint.name != "step-0":
        os.kill(os.getpid(), signal.SIGKILL)
    export(checkpoint, best)
rs.export_best = export_or_die

state = rs.RunState(Path(sys.argv[2]), Recipe())
draft, tokenizer = tiny_llama(CHAR_VOCAB, 0), char_tokenizer()
for step, result in json.loads(sys.argv[3]):
    tmp = state.tmp_dir(step)
    (tmp / "state").mkdir(parents=True)  # what accelerator.save_state writes first
    state.finish_checkpoint(draft, tokenizer, step, result, tmp)
"""


def test_a_kill_before_best_is_exported_is_repaired_by_resume_and_never_published(tmp_path):
    from distill.publishing.hub import PublishError
    from distill.publishing.publish_source import resolve_source

    out = tmp_path / "run"
    results = [(0, bench_result(0, 1.0)), (3, bench_result(3, 2.0))]  # step 3 is clearly faster: the new best
    env = dict(os.environ, OMP_NUM_THREADS="1")
    code = [sys.executable, "-c", KILLED_BEFORE_EXPORT, str(REPO), str(out), json.dumps(results)]
    proc = subprocess.run(code, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert (out / "checkpoints" / "step-3" / "eval.json").is_file()
    assert json.loads((out / "best" / "eval.json").read_text())["step"] == 0  # the crash left the old best
    with pytest.raises(PublishError, match="best/ is not step-3, the checkpoint the run's history selects"):
        resolve_source(out / "best")

    state = RunState(out, Recipe())  # what --resume does first: the main process cleans up, every one restores
    state.clean_temporaries()
    assert state.restore()[0] == 3
    assert json.loads((out / "best" / "eval.json").read_text()) == results[1][1]
    report = state.report(checksums=[0.0], world=1)
    assert report["best_step"] == 3 and report["best"]["step"] == 3
    write_json_atomic(out / "report.json", report)
    assert resolve_source(out).step == 3 and resolve_source(out / "best").eval == results[1][1]


def test_publish_refuses_a_report_that_is_not_best(tmp_path):
    """A finished run resumed to train longer and stopped after a new best: report.json still states the old one."""
    best = tmp_path / "run" / "best"
    best.mkdir(parents=True)
    (best / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    write_json_atomic(best / "eval.json", bench_result(9, 2.0))
    write_json_atomic(tmp_path / "run" / "report.json", {"base": {}, "best": bench_result(6, 1.5), "best_step": 6})
    from distill.publishing.hub import PublishError
    from distill.publishing.publish_source import resolve_source

    for source in (tmp_path / "run", best):
        with pytest.raises(PublishError, match="report.json states other figures than best/eval.json"):
            resolve_source(source)


# ---------------------------------------------------------------- --resume with a changed recipe


def saved_recipe(tmp_path: Path, *overrides: str) -> tuple[Path, Recipe]:
    out = tmp_path / "run"
    recipe = load_recipe(None, [f"output_dir={out}", "train.lr=3e-3", *overrides])
    save_recipe(recipe, out)
    return out, recipe


def test_resume_refuses_a_changed_recipe_naming_each_key(tmp_path):
    out, recipe = saved_recipe(tmp_path)
    assert check_resume_recipe(out, recipe, allow_change=False) == []
    changed = load_recipe(None, [f"output_dir={out}", "train.lr=1e-3", "distill.loss=rkl"])
    with pytest.raises(RecipeError) as err:
        check_resume_recipe(out, changed, allow_change=False)
    line = str(err.value)
    assert "\n" not in line and "--allow-recipe-change" in line
    assert "distill.loss: 'fkl' -> 'rkl'" in line and "train.lr: 0.003 -> 0.001" in line
    allowed = check_resume_recipe(out, changed, allow_change=True)
    assert sorted(allowed) == ["distill.loss: 'fkl' -> 'rkl'", "train.lr: 0.003 -> 0.001"]


def test_resume_accepts_keys_that_change_neither_training_nor_measurement(tmp_path):
    out, recipe = saved_recipe(tmp_path)
    free = ["log.every=7", "publish.repo_id=me/draft", "eval.keep_top_k=5", "train.max_minutes=30"]
    changed = load_recipe(None, [f"output_dir={out}", "train.lr=3e-3", *free])
    assert len(check_resume_recipe(out, changed, allow_change=False)) == 4
    # with schedule_by=minutes max_minutes is the lr schedule's horizon, and max_steps only caps the run
    out, recipe = saved_recipe(tmp_path, "train.schedule_by=minutes", "train.max_minutes=10")
    longer = load_recipe(
        None, [f"output_dir={out}", "train.lr=3e-3", "train.schedule_by=minutes", "train.max_minutes=20"]
    )
    longer.train.max_steps = 10_000
    with pytest.raises(RecipeError, match=r"in train.max_minutes: 10.0 -> 20.0: resume"):
        check_resume_recipe(out, longer, allow_change=False)


def test_resume_compares_keys_a_saved_recipe_lacks_at_their_default(tmp_path):
    out, recipe = saved_recipe(tmp_path)
    saved = yaml.safe_load((out / "resolved_recipe.yaml").read_text())
    del saved["distill"]["loss_positions"]  # a key the run's version of draftsmith did not have
    (out / "resolved_recipe.yaml").write_text(yaml.safe_dump(saved))
    assert check_resume_recipe(out, recipe, allow_change=False) == []
    recipe.distill.loss_positions = "all"
    with pytest.raises(RecipeError, match="distill.loss_positions: 'completion' -> 'all'"):
        check_resume_recipe(out, recipe, allow_change=False)


# ---------------------------------------------------------------- the training-time budget


def test_timer_counts_only_training_blocks_and_continues_a_saved_budget():
    timer = Timer(max_minutes=1.0)
    with timer.running():
        time.sleep(0.05)
    time.sleep(0.2)  # evaluation, checkpointing: off the clock
    assert 0.05 <= timer.elapsed_s < 0.2
    assert not timer.expired()
    resumed = Timer(max_minutes=1.0, elapsed_s=59.99)
    with resumed.running():
        time.sleep(0.02)
    assert resumed.expired()


def test_training_minutes_survive_a_restore(tmp_path):
    state = RunState(tmp_path, Recipe())
    state.train_s = 90.0
    step_dir = state.ckpt_root / "step-3"
    (step_dir / "state").mkdir(parents=True)
    write_json_atomic(step_dir / "trainer_state.json", state.trainer_state(3))
    again = RunState(tmp_path, Recipe())
    assert again.restore() == (3, step_dir)
    assert again.train_s == pytest.approx(90.0)


def test_the_run_clock_splits_generation_steps_and_evaluation():
    clock = RunClock()
    with clock.generating():
        time.sleep(0.03)
    with clock.evaluating():
        time.sleep(0.02)
    time.sleep(0.05)  # neither
    assert 0.03 <= clock.generate_s < 0.05 and 0.02 <= clock.eval_s < 0.04 and clock.step_s == 0.0
    clock.step_s = 120.0
    assert clock.summary(train_s=120.0 + clock.generate_s, steps=7) == {
        "generate_minutes": pytest.approx(clock.generate_s / 60),
        "step_minutes": 2.0,
        "train_minutes": pytest.approx(2.0 + clock.generate_s / 60),
        "eval_minutes": pytest.approx(clock.eval_s / 60),
        "steps": 7,
    }


def saved_run(tmp_path: Path, step: int, trainer_state: dict | None = None) -> Path:
    """A checkpoint step-N holding `trainer_state` (default: a RunState's after 3 minutes generating, 5 of steps
    and 1 evaluating)."""
    if trainer_state is None:
        state = RunState(tmp_path, Recipe())
        state.clock.generate_s, state.clock.eval_s = 180.0, 60.0
        state.after_step(step, train_s=480.0, step_s=300.0)
        trainer_state = state.trainer_state(step)
    step_dir = tmp_path / "checkpoints" / f"step-{step}"
    (step_dir / "state").mkdir(parents=True)
    write_json_atomic(step_dir / "trainer_state.json", trainer_state)
    return step_dir


def test_the_run_clock_continues_across_a_resume(tmp_path):
    step_dir = saved_run(tmp_path, 40)
    again = RunState(tmp_path, Recipe())
    again.clock.generate_s = 2.0  # an EAGLE-3 head's continuations, generated (from the cache) before restoring
    assert again.restore() == (40, step_dir)
    assert (again.steps, again.train_s) == (40, pytest.approx(480.0))
    assert (again.clock.generate_s, again.clock.step_s, again.clock.eval_s) == pytest.approx((182.0, 300.0, 60.0))
    # the resumed run's steps go on from there: the training clock is the timer's, the minutes of steps the clock
    # the processes share (both continued from the checkpoint by the loop)
    again.after_step(50, train_s=482.0 + 40.0, step_s=340.0)
    assert again.clock.summary(again.train_s, again.steps) == pytest.approx(
        {"generate_minutes": 182 / 60, "step_minutes": 340 / 60, "train_minutes": 522 / 60, "eval_minutes": 1.0,
         "steps": 50}
    )  # fmt: skip


def test_a_checkpoint_without_the_split_counts_its_clock_as_steps(tmp_path):
    saved_run(tmp_path, 3, {"step": 3, "history": [], "train_minutes": 1.5})
    again = RunState(tmp_path, Recipe())
    again.restore()
    assert (again.clock.generate_s, again.clock.step_s, again.clock.eval_s) == (0.0, pytest.approx(90.0), 0.0)


def test_the_report_and_the_marker_say_where_the_clock_went(tmp_path):
    prepare_output_dir(tmp_path / "run", resume=False, overwrite=False)
    state = RunState(tmp_path / "run", Recipe())
    result = {**bench_result(5, 1.3), "tokens_per_s": {"speculative": 100.0}}
    (state.out / "best").mkdir()
    (state.out / "best" / "eval.json").write_text(json.dumps(result))
    state.record(5, result)
    state.clock.generate_s, state.clock.eval_s = 762.0, 366.0
    state.after_step(849, train_s=2640.0, step_s=1878.0)
    report = state.report([1.0, 1.0], 2)
    clock = {"generate_minutes": 12.7, "step_minutes": 31.3, "train_minutes": 44.0, "eval_minutes": 6.1, "steps": 849}
    assert report["clock"] == pytest.approx(clock) and report["train_minutes"] == pytest.approx(44.0)
    state.write_marker(report["clock"])
    marker = json.loads((state.out / RUN_MARKER).read_text())
    assert marker["clock"] == pytest.approx(clock) and marker["tool"] == "draftsmith"
    assert is_run_dir(state.out)
    assert summary_table(None, result, 5, report["clock"]).splitlines()[-1] == (
        "clock: 44.0 training minutes: 12.7 generating the target's data, 31.3 in 849 steps; 6.1 minutes "
        "evaluating (off the training clock)"
    )


# ---------------------------------------------------------------- quickstart assets


def test_given_models_and_prompts_build_nothing(tmp_path, monkeypatch):
    # The cache path is a file: any attempt to build or reuse quickstart assets fails at once.
    blocker = tmp_path / "cache"
    blocker.write_text("not a directory")
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(blocker))
    recipe = Recipe(build_pair="quickstart")
    recipe.target.model, recipe.draft.model = "my/target", "my/draft"
    recipe.data.train_prompts, recipe.data.eval_prompts = "train.jsonl", "eval.jsonl"
    load_script("train/distill.py").resolve_local_artifacts(recipe, rebuild=False, is_main=True)
    assert (recipe.target.model, recipe.data.eval_prompts) == ("my/target", "eval.jsonl")


@pytest.mark.slow
def test_given_models_build_only_the_prompt_files(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    (cache / "quickstart").mkdir(parents=True)
    (cache / "quickstart" / "target").write_text("a file: building the pair here fails")
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(cache))
    recipe = Recipe(build_pair="quickstart")
    recipe.target.model, recipe.draft.model = "my/target", "my/draft"
    load_script("train/distill.py").resolve_local_artifacts(recipe, rebuild=False, is_main=True)
    assert Path(recipe.data.train_prompts).is_file() and Path(recipe.data.eval_prompts).is_file()
    assert recipe.target.model == "my/target"


# ---------------------------------------------------------------- Ctrl-C / SIGTERM saves the step, --resume goes on

# train/distill.py's main, each optimizer step slowed by `step_s` (through its on_step hook) and the evaluation of
# step `hold_at` held (it writes `evaluating` beside output_dir, then sleeps until a signal cuts it short): a real
# run, slowed so that a signal lands where a test wants it.
SLOWED = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from tests.procs import load_script
from distill.training import loop
distill = load_script("train/distill.py")
step_s, hold_at = float(sys.argv[2]), int(sys.argv[3])
evaluate = loop.evaluate_checkpoint

def held(*args, **kwargs):
    samples_out = Path(args[5])  # output_dir/checkpoints/.tmp-step-N/samples.jsonl
    if samples_out.parent.name == f".tmp-step-{hold_at}":
        (samples_out.parents[3] / "evaluating").write_text("")
        time.sleep(600)
    return evaluate(*args, **kwargs)

loop.evaluate_checkpoint = held  # what evaluate_and_save calls
distill.main(sys.argv[4:], on_step=lambda report: time.sleep(step_s))
"""


def start_slowed(tmp_path: Path, name: str, recipe: dict, *args: str, step_s: float = 0.0, hold_at: int = -1,
                 processes: int = 1, source: str = SLOWED) -> tuple[subprocess.Popen, Path]:  # fmt: skip
    """train/distill.py on `recipe` (`source`: SLOWED or a variant) in a fresh process, or `processes` over gloo
    under accelerate launch; stdout and stderr go to tmp_path/NAME.log, returned with the process."""
    recipe_path, script, log = tmp_path / f"{name}.yaml", tmp_path / "slowed.py", tmp_path / f"{name}.log"
    recipe_path.write_text(yaml.safe_dump(recipe))
    script.write_text(source)
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONFAULTHANDLER"] = "1"  # a run that hangs is stopped with SIGABRT by finish(): its stacks in the log
    env.pop("WANDB_DIR", None)
    cmd = [sys.executable, str(script)]
    if processes > 1:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes), "--multi_gpu"]
        cmd += ["--main_process_port", str(free_port()), str(script)]
        env["ACCELERATE_USE_CPU"] = "1"
    cmd += [str(REPO), str(step_s), str(hold_at), "--recipe", str(recipe_path), *args]
    with log.open("w") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO, start_new_session=True
        )
        return proc, log


def finish(proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> tuple[int, str]:
    """Wait for `proc`; past `timeout_s` its process group is stopped with SIGABRT (each process writes its stacks
    to the log) and the test fails with them."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_tree(proc.pid)
        pytest.fail(f"the run ran past {timeout_s:.0f} s; its stacks:\n{log.read_text()[-12000:]}")
    return proc.returncode, log.read_text()


def interrupt_when(proc: subprocess.Popen, log: Path, ready, timeout_s: float = 300) -> tuple[int, str]:
    """SIGTERM `proc` once `ready()` holds; its exit status and output."""
    deadline = time.time() + timeout_s
    while not ready():
        assert proc.poll() is None, f"the run ended before it could be interrupted:\n{log.read_text()[-3000:]}"
        assert time.time() < deadline, "the run never got where it was to be interrupted"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    return finish(proc, log, timeout_s=120)


def metric_rows(out: Path, key: str) -> list[dict]:
    path = out / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [row for row in rows if key in row]


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


SAVED = (
    r"error: interrupted at step (\d+); saved a resume state \(checkpoints/step-\1: weights, optimizer, scheduler, "
    r"data position, RNG\); resume with --resume"
)


def test_signals_in_training_wait_for_the_step_and_cut_an_evaluation_short(tmp_path, monkeypatch):
    """Real signals to this process: armed, a SIGTERM (and the same stop passed on again) lets the step finish and
    stops at the next step's start, saving that step; in an evaluation it stops the evaluation at once; a signal
    REPEAT_S after the first stops at once and saves nothing; unarmed (loading) it stops at once."""
    from accelerate import PartialState

    from distill.training import interrupt

    monkeypatch.setattr(interrupt, "REPEAT_S", 0.5)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    state, saved, step = RunState(tmp_path, Recipe()), [], 3
    try:
        interrupt.install()
        with pytest.raises(KeyboardInterrupt):  # nothing armed: at once, as Python's Ctrl-C
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        assert interrupt.stopped(KeyboardInterrupt()) == "interrupted; resume with --resume"

        interrupt.arm(PartialState(), state, lambda: step, saved.append)
        interrupt.check()  # no stop yet
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # a launcher passing the stop on: the same one
        step = 4  # the step in progress finished
        with pytest.raises(interrupt.StopRequested) as stop:
            interrupt.check()
        assert interrupt.stopped(stop.value) == (
            "interrupted at step 4; saved a resume state (checkpoints/step-4: weights, optimizer, scheduler, data "
            "position, RNG); resume with --resume"
        )
        assert saved == [4]

        interrupt.arm(PartialState(), state, lambda: step, saved.append)

        def evaluate() -> dict:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            return {}

        assert interrupt.evaluation(state, 1.5, evaluate) is None and state.pending_eval == {"loss": 1.5}
        state.pending_eval = None
        assert interrupt.evaluation(state, 2.0, lambda: {}) is None  # a stop is pending: no evaluation starts
        assert state.pending_eval == {"loss": 2.0}
        time.sleep(0.6)
        with pytest.raises(KeyboardInterrupt) as again:  # REPEAT_S after the first: at once
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        assert interrupt.stopped(again.value).startswith("interrupted again before step 5 ended: nothing more saved")
        assert saved == [4]
    finally:
        interrupt.disarm()
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])


@pytest.mark.slow
def test_sigterm_in_training_saves_the_step_and_resume_goes_on_from_it(tmp_path):
    """Interrupted at step k > 0 of 8 (evaluations at step 0 and 8): the state of step k is saved, and --resume
    continues at step k, does not measure the base again, logs each step once, continues the W&B run and ends
    with the weights of the run that was never interrupted."""
    paths = tiny_run_paths(tmp_path / "assets")

    def recipe(out: Path) -> dict:
        return tiny_recipe(paths, out, {"max_new_tokens": 8}, {"max_steps": 8, "batch_size": 2},
                           log={"report_to": "wandb"})  # fmt: skip

    ref = tmp_path / "ref"
    rc, output = finish(*start_slowed(tmp_path, "ref", recipe(ref)))
    assert rc == 0, output[-3000:]
    out = tmp_path / "run"
    proc, log = start_slowed(tmp_path, "run", recipe(out), step_s=0.5)
    rc, output = interrupt_when(proc, log, lambda: any(r["step"] >= 2 for r in metric_rows(out, "train/loss")))
    assert rc == 2, output[-3000:]
    assert len(error_lines(output)) == 1, output[-3000:]
    saved = re.fullmatch(SAVED, error_lines(output)[0])
    assert saved, error_lines(output)
    step = int(saved.group(1))
    assert 2 <= step < 8
    checkpoint = out / "checkpoints" / f"step-{step}"
    assert (checkpoint / "state").is_dir() and not (checkpoint / "eval.json").exists()
    assert json.loads((checkpoint / "trainer_state.json").read_text())["step"] == step
    assert [r["step"] for r in metric_rows(out, "train/loss")] == list(range(1, step + 1))
    base = (out / "base_eval.json").read_text()

    rc, output = finish(*start_slowed(tmp_path, "resumed", recipe(out), "--resume"))
    assert rc == 0, output[-3000:]
    assert f"resumed from {checkpoint} (step {step}," in output
    assert "eval step 0:" not in output and "eval step 8:" in output
    assert (out / "base_eval.json").read_text() == base  # the base measured once
    assert [r["step"] for r in metric_rows(out, "train/loss")] == list(range(1, 9))
    assert [r["step"] for r in metric_rows(out, "eval/speedup")] == [0, 8]
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and {r.name.rsplit("-", 1)[-1] for r in runs} == {read_run_id(out)}
    mine, theirs = (json.loads((d / "report.json").read_text()) for d in (out, ref))
    assert [c["step"] for c in mine["checkpoints"]] == [0, 8]
    assert mine["param_checksums"] == pytest.approx(theirs["param_checksums"], rel=1e-9)


@pytest.mark.slow
def test_sigterm_in_the_last_evaluation_keeps_every_step(tmp_path):
    """eval.at_start false (as the EAGLE-3 recipes), interrupted in its one evaluation, at the last step: the
    4 steps are kept, and --resume evaluates step 4 and finishes the run without training again."""
    paths = tiny_run_paths(tmp_path / "assets")
    recipe = tiny_recipe(paths, tmp_path / "run", {"max_new_tokens": 8}, {"max_steps": 4, "batch_size": 2},
                         eval={"at_start": False})  # fmt: skip
    out = tmp_path / "run"
    proc, log = start_slowed(tmp_path, "run", recipe, hold_at=4)
    rc, output = interrupt_when(proc, log, (tmp_path / "evaluating").is_file)
    assert rc == 2, output[-3000:]
    assert error_lines(output) == [
        "error: interrupted at step 4; its resume state is checkpoints/step-4 (its evaluation was cut short: "
        "--resume runs it first); resume with --resume"
    ], output[-3000:]
    checkpoint = out / "checkpoints" / "step-4"
    assert sorted(p.name for p in checkpoint.iterdir()) == ["state", "trainer_state.json"]
    pending = json.loads((checkpoint / "trainer_state.json").read_text())["pending_eval"]
    assert pending["loss"] == pytest.approx(metric_rows(out, "train/loss")[-1]["train/loss"])
    assert not (out / "best").exists() and not (out / "report.json").exists()

    rc, output = finish(*start_slowed(tmp_path, "resumed", recipe, "--resume"))
    assert rc == 0, output[-3000:]
    assert f"resumed from {checkpoint} (step 4," in output and "eval step 4:" in output
    assert [r["step"] for r in metric_rows(out, "train/loss")] == [1, 2, 3, 4]
    assert [r["step"] for r in metric_rows(out, "eval/speedup")] == [4]
    report = json.loads((out / "report.json").read_text())
    assert report["base"] is None and report["best_step"] == 4
    assert report["checkpoints"][0]["loss"] == pytest.approx(pending["loss"])


@pytest.mark.slow
def test_resume_from_step_0_does_not_measure_the_base_again(tmp_path):
    """Killed (-9) after the base evaluation and a step or two: --resume starts at step 0 from checkpoints/step-0,
    which holds the base's evaluation: it is not measured again, and the rows the killed run logged past step 0
    are logged once, by the resumed run."""
    paths = tiny_run_paths(tmp_path / "assets")
    recipe = tiny_recipe(paths, tmp_path / "run", {"max_new_tokens": 8}, {"max_steps": 4, "batch_size": 2})
    out = tmp_path / "run"
    proc, log = start_slowed(tmp_path, "run", recipe, step_s=0.5)
    deadline = time.time() + 300
    while not ((out / "checkpoints" / "step-0").is_dir() and metric_rows(out, "train/loss")):
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    base = (out / "base_eval.json").read_text()
    rc, output = finish(*start_slowed(tmp_path, "resumed", recipe, "--resume"))
    assert rc == 0, output[-3000:]
    assert f"resumed from {out / 'checkpoints' / 'step-0'} (step 0," in output and "eval step 0:" not in output
    assert (out / "base_eval.json").read_text() == base
    assert [r["step"] for r in metric_rows(out, "eval/speedup")] == [0, 4]
    assert [r["step"] for r in metric_rows(out, "train/loss")] == [1, 2, 3, 4]


@pytest.mark.slow
def test_sigterm_to_two_processes_saves_the_same_step_on_both(tmp_path):
    """accelerate launch, 2 processes over gloo: the launcher passes SIGTERM on to both, they stop at the same
    step and save it together (each one's RNG state), and a 2-process --resume finishes the run."""
    paths = tiny_run_paths(tmp_path / "assets")
    recipe = tiny_recipe(paths, tmp_path / "run", {"max_new_tokens": 8}, {"max_steps": 8, "batch_size": 1},
                         eval={"at_start": False})  # fmt: skip
    out = tmp_path / "run"
    proc, log = start_slowed(tmp_path, "run", recipe, step_s=0.5, processes=2)
    rc, output = interrupt_when(proc, log, lambda: any(r["step"] >= 2 for r in metric_rows(out, "train/loss")))
    assert rc != 0, output[-3000:]
    # one line per process, the same step; found in the text, not by lines: the two processes share one output,
    # and their lines can land in it without a newline between them
    steps = re.findall(SAVED, output)
    assert len(steps) == 2 and steps[0] == steps[1], output[-3000:]
    state = out / "checkpoints" / f"step-{steps[0]}" / "state"
    assert (state / "random_states_0.pkl").is_file() and (state / "random_states_1.pkl").is_file()

    rc, output = finish(*start_slowed(tmp_path, "resumed", recipe, "--resume", processes=2))
    assert rc == 0, output[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["world_size"] == 2 and report["param_checksums"][0] == report["param_checksums"][1]
    assert [r["step"] for r in metric_rows(out, "train/loss")] == list(range(1, 9))


# SLOWED, holding instead the checkpoint of step `hold_at` once evaluated and logged, before it is written (it writes
# `saving` beside output_dir, then sleeps until the test kills it)
HELD_SAVE = SLOWED.replace(
    "loop.evaluate_checkpoint = held  # what evaluate_and_save calls\n",
    """from distill.training import run_state
finish = run_state.RunState.finish_checkpoint

def finish_held(self, draft, tokenizer, step, result, tmp):
    if step == hold_at:
        (self.out.parent / "saving").write_text("")
        time.sleep(600)
    return finish(self, draft, tokenizer, step, result, tmp)

run_state.RunState.finish_checkpoint = finish_held
""",
)


def row_kinds(out: Path) -> list[tuple[int, str]]:
    """metrics.jsonl's rows as (step, kind): the start record, a step's train/ figures, an evaluation."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], "start" if "distributed" in r else "eval" if "eval/speedup" in r else "train") for r in rows]


@pytest.mark.slow
def test_metrics_keep_one_row_per_step_and_kind_across_kills(tmp_path):
    """Killed before the first checkpoint (its evaluation logged), interrupted in step 0's evaluation and after a
    checkpoint, each time resumed: metrics.jsonl ends with one row of each kind per step, and step 0's evaluation
    row is the one its checkpoint holds."""
    paths = tiny_run_paths(tmp_path / "assets")
    out = tmp_path / "run"
    recipe = tiny_recipe(paths, out, {"max_new_tokens": 8}, {"max_steps": 4, "batch_size": 2}, eval={"every": 2})
    # killed (-9) while step 0's checkpoint is written, its evaluation logged: no checkpoint
    proc, log = start_slowed(tmp_path, "first", recipe, hold_at=0, source=HELD_SAVE)
    deadline = time.time() + 300
    while not (tmp_path / "saving").is_file():
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert not (out / "checkpoints" / "step-0").exists() and (0, "eval") in row_kinds(out)

    # interrupted in step 0's evaluation: a resume-only step-0, its evaluation due
    rc, output = interrupt_when(
        *start_slowed(tmp_path, "second", recipe, "--resume", hold_at=0), (tmp_path / "evaluating").is_file
    )
    assert rc == 2 and "its evaluation was cut short" in output, output[-3000:]

    # interrupted past step 2's checkpoint
    proc, log = start_slowed(tmp_path, "third", recipe, "--resume", step_s=0.5)
    rc, output = interrupt_when(proc, log, lambda: any(r["step"] >= 3 for r in metric_rows(out, "train/loss")))
    assert rc == 2 and re.fullmatch(SAVED, error_lines(output)[0]), output[-3000:]
    stopped = int(re.fullmatch(SAVED, error_lines(output)[0]).group(1))

    rc, output = finish(*start_slowed(tmp_path, "last", recipe, "--resume"))
    assert rc == 0, output[-3000:]
    kinds = row_kinds(out)
    assert len(kinds) == len(set(kinds)), kinds
    assert sorted(kinds) == sorted(
        [(0, "start"), (stopped, "start"), (0, "eval"), (2, "eval"), (4, "eval"), *((s, "train") for s in range(1, 5))]
    )
    base = json.loads((out / "base_eval.json").read_text())
    assert metric_rows(out, "eval/speedup")[0]["eval/speedup"] == pytest.approx(base["speedup"]["vs_target"])


# ---------------------------------------------------------------- SIGTERM stops the quickstart build


@pytest.mark.slow
@pytest.mark.skipif(not HAS_PROC, reason="needs /proc to find the child process")
def test_sigterm_stops_the_pretraining_child(tmp_path):
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "from distill.training.pretraining import ensure_quickstart_pair; "
        "ensure_quickstart_pair(cache_dir=sys.argv[2])"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    parent = subprocess.Popen([sys.executable, "-c", code, str(REPO), str(tmp_path / "cache")], env=env)
    child = None
    try:
        child = wait_for_child(parent.pid, "pretrain.py", timeout_s=60)
        time.sleep(0.5)  # the parent is waiting on its child now
        parent.send_signal(signal.SIGTERM)
        parent.wait(timeout=30)
        deadline = time.time() + 15
        while running(child) and time.time() < deadline:
            time.sleep(0.05)
        assert not running(child), "the pretraining child outlived its parent"
        assert parent.returncode != 0
    finally:
        for pid in (parent.pid, child):
            if pid is not None and running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_an_evaluation_that_fails_keeps_the_training_and_resume_evaluates_it(tmp_path, monkeypatch, capsys):
    """The one evaluation (eval.at_start false, at the last step) raises: the run stops with one error line naming
    the step, the traceback file and --resume; the step's training state is saved (resume-only, pending
    evaluation), and --resume evaluates step 4 and finishes without training again."""
    from distill.training import loop

    paths = tiny_run_paths(tmp_path / "assets")
    recipe = tiny_recipe(paths, tmp_path / "run", {"max_new_tokens": 8}, {"max_steps": 4, "batch_size": 2},
                         eval={"at_start": False})  # fmt: skip
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "run"
    real = loop.evaluate_checkpoint

    def broken(*args, **kwargs):
        raise RuntimeError("the bench broke\nsecond line")

    monkeypatch.setattr(loop, "evaluate_checkpoint", broken)
    with pytest.raises(SystemExit) as code:
        load_script("train/distill.py").main(["--recipe", str(path)])
    assert code.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: the evaluation of step 4 failed (RuntimeError: the bench broke; traceback in "
        f"{out / 'eval_error.txt'}); the training state of step 4 is saved: fix the cause and rerun with --resume, "
        "which evaluates it first"
    ]
    assert "RuntimeError: the bench broke" in (out / "eval_error.txt").read_text()
    checkpoint = out / "checkpoints" / "step-4"
    assert sorted(p.name for p in checkpoint.iterdir()) == ["state", "trainer_state.json"]
    assert json.loads((checkpoint / "trainer_state.json").read_text())["pending_eval"] is not None

    monkeypatch.setattr(loop, "evaluate_checkpoint", real)
    load_script("train/distill.py").main(["--recipe", str(path), "--resume"])
    report = json.loads((out / "report.json").read_text())
    assert report["best_step"] == 4 and [c["step"] for c in report["checkpoints"]] == [4]
    assert [r["step"] for r in metric_rows(out, "train/loss")] == [1, 2, 3, 4]
