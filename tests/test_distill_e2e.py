"""End-to-end: `accelerate launch train/distill.py` on tiny real models, W&B offline, real processes.

One uninterrupted run is shared (module fixture) by the smoke checks and as the reference for the kill -9 /
--resume test; a 2-process gloo run checks DDP; bad inputs each give one `error:` line and exit status 2.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from distill.config import TrainConfig
from distill.training.checkpoints import CheckpointInfo, select_best
from distill.training.schedule import lr_multiplier
from tests.procs import HAS_PROC, free_port, run_captured, running, wait_for_child
from tests.tiny import make_pair, make_prompts

REPO = Path(__file__).resolve().parent.parent
SCRIPT = str(REPO / "train" / "distill.py")
pytestmark = pytest.mark.slow


def env() -> dict:
    e = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("WANDB_DIR", None)
    return e


def recipe_dict(assets: dict, out: Path, **sections) -> dict:
    recipe = {
        "target": {"model": str(assets["target"]), "dtype": "float32"},
        "draft": {"model": str(assets["draft"]), "dtype": "float32"},
        "data": {"train_prompts": str(assets["train"]), "eval_prompts": str(assets["eval"]), "max_prompt_tokens": 48},
        "distill": {"loss": "jsd", "source": "mix", "max_new_tokens": 12},
        "train": {"lr": 3e-3, "max_steps": 6, "batch_size": 4, "warmup_steps": 1, "seed": 0},
        "eval": {"every": 3, "num_prompts": 3, "max_new_tokens": 12, "num_draft_tokens": 3, "repeats": 1},
        "log": {"report_to": "wandb", "every": 1},
        "output_dir": str(out),
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            recipe[section].update(values)
        else:
            recipe[section] = values
    return recipe


def write_recipe(tmp: Path, recipe: dict, name: str = "recipe.yaml") -> Path:
    path = tmp / name
    path.write_text(yaml.safe_dump(recipe))
    return path


def launch(recipe: Path, *extra: str, processes: int = 1, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes)]
    cmd += ["--multi_gpu", "--main_process_port", str(free_port())] if processes > 1 else ["--cpu"]
    cmd += [SCRIPT, "--recipe", str(recipe), *extra]
    e = env()
    if processes > 1:
        e["ACCELERATE_USE_CPU"] = "1"
    # a 2-process run that hangs fails in minutes, with every process's stacks (tests/procs.py)
    return run_captured(cmd, env=e, timeout=timeout if processes == 1 else min(timeout, 360), cwd=REPO)


def run_script(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env(), timeout=timeout, cwd=REPO
    )


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("assets")
    target, draft = make_pair(root)
    return {
        "root": root,
        "target": target,
        "draft": draft,
        "train": make_prompts(root / "train.jsonl", 40, seed=1),
        "eval": make_prompts(root / "eval.jsonl", 6, seed=2),
    }


@pytest.fixture(scope="module")
def full_run(assets, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("full")
    out = tmp / "run"
    proc = launch(write_recipe(tmp, recipe_dict(assets, out)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_run_directory_contract(full_run):
    out = full_run
    assert (out / "resolved_recipe.yaml").is_file()
    report = json.loads((out / "report.json").read_text())
    assert set(report) >= {"base", "best", "best_step", "checkpoints"}
    assert [c["step"] for c in report["checkpoints"]] == [0, 3, 6]
    for key in ("acceptance_rate", "mean_accepted_length", "per_position_acceptance", "speedup", "tokens_per_s"):
        assert key in report["best"]
    # eval.hf_assisted (default): every evaluation also times HF assisted generation, for the card's figure
    assert all(report[k]["speedup"]["vs_hf_assisted"] > 0 for k in ("base", "best"))
    # best/ is chosen by measured speedup beyond its noise interval, not by the lowest loss
    assert all("speedup_ci95" in c for c in report["checkpoints"])
    # ... compared pairwise on the same prompts: every evaluation records each batch's speedup and prompt ids
    ids = [c["speedup_per_batch"]["prompt_ids"] for c in report["checkpoints"]]
    assert len(ids[0]) > 1 and all(i == ids[0] for i in ids)
    best = select_best([CheckpointInfo.from_dict(c) for c in report["checkpoints"]])
    assert report["best_step"] == best.step
    best_eval = json.loads((out / "best" / "eval.json").read_text())
    assert best_eval["step"] == best.step and "vs_target_ci95" in best_eval["speedup"]
    assert 0 < report["train_minutes"] < 10
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert len(kept) <= 3 and "step-6" in kept  # top-2 by speedup + the newest
    for name in kept:
        assert (out / "checkpoints" / name / "eval.json").is_file()
        assert (out / "checkpoints" / name / "resolved_recipe.yaml").is_file()
    assert (out / "acceptance_base_vs_best.png").stat().st_size > 0


def test_metrics_and_wandb_offline(full_run):
    lines = [json.loads(line) for line in (full_run / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if "train/loss" in m]
    evals = [m for m in lines if "eval/speedup" in m]
    assert [m["step"] for m in train] == [1, 2, 3, 4, 5, 6]
    assert {"train/lr", "train/tokens_per_s", "train/top1_agreement"} <= set(train[0])
    assert [m["step"] for m in evals] == [0, 3, 6]
    assert {"eval/acceptance_rate", "eval/mean_accepted_length", "eval/acceptance_pos_1"} <= set(evals[0])
    assert all(m["eval/speedup_ci95_lo"] <= m["eval/speedup"] <= m["eval/speedup_ci95_hi"] for m in evals)
    runs = list((full_run / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_best_loads_as_plain_hf_model(full_run, assets):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    best = AutoModelForCausalLM.from_pretrained(full_run / "best")
    target = AutoModelForCausalLM.from_pretrained(assets["target"])
    tok = AutoTokenizer.from_pretrained(full_run / "best")
    ids = tok("def main(argv):\n    ", return_tensors="pt").input_ids
    plain = target.generate(ids, max_new_tokens=10, do_sample=False)
    assisted = target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=best)
    assert torch.equal(plain, assisted)


def test_print_config_and_override(assets, tmp_path):
    recipe = write_recipe(tmp_path, recipe_dict(assets, tmp_path / "run"))
    proc = run_script("--recipe", str(recipe), "--print-config", "train.lr=5e-4")
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["train"]["lr"] == 5e-4
    assert not (tmp_path / "run").exists()


def lr_sequence(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [m["train/lr"] for m in rows if "train/lr" in m]


def test_two_processes_one_log_identical_weights_same_schedule(assets, full_run, tmp_path):
    out = tmp_path / "run"
    # 2 processes x 2 prompts: the same global batch and schedule as the 1-process full_run (4 prompts)
    recipe = recipe_dict(assets, out, train={"batch_size": 2}, eval={"every": 6})
    proc = launch(write_recipe(tmp_path, recipe), processes=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["world_size"] == 2
    a, b = report["param_checksums"]
    assert a == b
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps.count(1) == 1  # one set of logs, not one per rank
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1
    # The lr schedule advances once per optimizer step whatever the number of processes.
    cfg = TrainConfig(**recipe["train"])
    expected = [cfg.lr * lr_multiplier(step, 0.0, cfg) for step in range(1, cfg.max_steps + 1)]
    assert lr_sequence(full_run) == pytest.approx(expected)
    assert lr_sequence(out) == pytest.approx(expected)


def kill_at_checkpoint(recipe: Path, out: Path, step: int) -> None:
    """Run the recipe and SIGKILL it as soon as checkpoint ``step`` is complete (before the run can finish)."""
    cmd = [sys.executable, SCRIPT, "--recipe", str(recipe)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env(), cwd=REPO)
    deadline = time.time() + 240
    while not (out / "checkpoints" / f"step-{step}").is_dir():
        assert proc.poll() is None, "run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "report.json").exists()


def test_kill_and_resume_matches_uninterrupted(assets, full_run, tmp_path):
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path, recipe_dict(assets, out))
    kill_at_checkpoint(recipe, out, step=3)
    saved = json.loads((out / "checkpoints" / "step-3" / "trainer_state.json").read_text())
    resumed = launch(recipe, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert not list((out / "checkpoints").glob(".tmp-*"))
    mine = json.loads((out / "report.json").read_text())
    ref = json.loads((full_run / "report.json").read_text())
    # same data order, optimizer and scheduler state: the resumed run ends where the uninterrupted one did
    assert mine["param_checksums"] == pytest.approx(ref["param_checksums"], rel=1e-9)
    assert [c["loss"] for c in mine["checkpoints"]] == pytest.approx([c["loss"] for c in ref["checkpoints"]])
    # the clock's split continues from the checkpoint: generating (the cached continuations cost next to nothing
    # again), the minutes of steps (steps 4-6 added to 1-3's) and evaluating (step 6's added)
    clock = mine["clock"]
    assert clock["steps"] == 6 and saved["generate_minutes"] > 0
    assert saved["generate_minutes"] <= clock["generate_minutes"] < saved["generate_minutes"] + 0.05
    assert clock["step_minutes"] > saved["step_minutes"] > 0 and clock["eval_minutes"] > saved["eval_minutes"] > 0
    resumed_rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_minutes = [r["train/step_minutes"] for r in resumed_rows if "train/step_minutes" in r][-3:]  # steps 4-6
    assert saved["step_minutes"] < step_minutes[0] < step_minutes[1] < step_minutes[2] == clock["step_minutes"]


def test_bench_worker_observes_training_through_on_step(assets, tmp_path):
    # bench/trl_gkd_vs_draftsmith.py's draftsmith side: train/distill.py's main with the on_step hook
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path, recipe_dict(assets, out, eval={"every": 100, "num_prompts": 1}))
    spec = {"argv": ["--recipe", str(recipe), "train.max_steps=2", "log.report_to=none"], "output_dir": str(out)}
    spec["threads"] = 1
    bench = str(REPO / "bench" / "trl_gkd_vs_draftsmith.py")
    proc = subprocess.run(
        [sys.executable, bench, "--worker", "draftsmith", "--spec", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env(),
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads((out / "bench_stats.json").read_text())
    assert stats["steps"] == 2 and stats["micro_batches"] == 2
    assert stats["tokens"] > 2 * 4 * 12  # 2 steps x 4 prompts x (prompt + 12 new tokens)
    report = json.loads((out / "report.json").read_text())
    assert 0 < stats["train_s"] == pytest.approx(report["train_minutes"] * 60, rel=0.05)


@pytest.mark.skipif(not HAS_PROC, reason="needs /proc to find the child process")
def test_sigterm_during_the_quickstart_build_stops_it(assets, tmp_path):
    recipe = recipe_dict(assets, tmp_path / "run", target={"model": ""}, draft={"model": ""})
    recipe["build_pair"] = "quickstart"
    cmd = [sys.executable, SCRIPT, "--recipe", str(write_recipe(tmp_path, recipe))]
    e = dict(env(), DRAFTSMITH_CACHE=str(tmp_path / "cache"))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e, cwd=REPO)
    builder = None
    try:
        builder = wait_for_child(proc.pid, "pretrain.py", timeout_s=120)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        deadline = time.time() + 15
        while running(builder) and time.time() < deadline:
            time.sleep(0.05)
        assert not running(builder), "the pretraining child outlived train/distill.py"
        assert proc.returncode == 2
        assert [line for line in stderr.splitlines() if line.startswith("error:")] == [
            "error: interrupted; resume with --resume"
        ]
    finally:
        for pid in (proc.pid, builder):
            if pid is not None and running(pid):
                os.kill(pid, signal.SIGKILL)


def error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


def test_recipe_typo(assets, tmp_path):
    recipe = recipe_dict(assets, tmp_path / "run")
    recipe["train"]["max_step"] = 3
    line = error_line(run_script("--recipe", str(write_recipe(tmp_path, recipe))))
    assert "unknown key 'train.max_step'" in line and "max_steps" in line


def test_missing_model(assets, tmp_path):
    recipe = recipe_dict(assets, tmp_path / "run", target={"model": str(tmp_path / "nope")})
    line = error_line(run_script("--recipe", str(write_recipe(tmp_path, recipe))))
    assert "target.model" in line and "nope" in line
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("content, needle", [("", "empty"), ('{"prompt": "a"}\n{oops\n', "bad.jsonl:2")])
def test_bad_prompt_file(assets, tmp_path, content, needle):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    recipe = recipe_dict(assets, tmp_path / "run", data={"train_prompts": str(bad)})
    line = error_line(run_script("--recipe", str(write_recipe(tmp_path, recipe))))
    assert "bad.jsonl" in line and needle in line
    assert not (tmp_path / "run").exists()  # refused before anything is written: the corrected rerun starts clean


def test_nan_loss_stops_naming_step_and_checkpoint(assets, tmp_path):
    # An absurd learning rate with no clipping overflows the weights within a few steps.
    recipe = recipe_dict(assets, tmp_path / "run", train={"lr": 1e30, "max_grad_norm": 0.0, "max_steps": 6})
    line = error_line(run_script("--recipe", str(write_recipe(tmp_path, recipe))))
    assert "step" in line and "NaN" in line and "last good checkpoint" in line and "step-0" in line


def test_existing_run_is_not_clobbered(full_run, assets, tmp_path):
    recipe = recipe_dict(assets, full_run)
    line = error_line(run_script("--recipe", str(write_recipe(tmp_path, recipe))))
    assert "--resume" in line and "--overwrite" in line


@pytest.mark.parametrize("folder", ["", "checkpoints"])  # `mkdir -p x/checkpoints; echo hi > x/thesis.tex`
def test_overwrite_refuses_a_directory_that_is_not_a_run(assets, tmp_path, folder):
    precious = tmp_path / "notes"
    (precious / folder).mkdir(parents=True)
    (precious / "thesis.tex").write_text("keep me")
    recipe = write_recipe(tmp_path, recipe_dict(assets, precious))
    line = error_line(run_script("--recipe", str(recipe), "--overwrite"))
    assert "--overwrite" in line and "not empty" in line
    assert (precious / "thesis.tex").read_text() == "keep me"
    assert sorted(p.name for p in precious.iterdir()) == sorted({"thesis.tex", folder or "thesis.tex"})


def test_resume_refuses_a_changed_recipe(assets, tmp_path):
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path, recipe_dict(assets, out))
    resolved = run_script("--recipe", str(recipe), "--print-config").stdout
    out.mkdir()
    (out / "resolved_recipe.yaml").write_text(resolved)  # a run started with this recipe, before any checkpoint
    (out / "draftsmith-run.json").write_text("{}")
    line = error_line(run_script("--recipe", str(recipe), "--resume", "train.lr=1e-3", "distill.loss=fkl"))
    assert "train.lr: 0.003 -> 0.001" in line and "distill.loss: 'jsd' -> 'fkl'" in line
    assert "--allow-recipe-change" in line
    assert (out / "resolved_recipe.yaml").read_text() == resolved
    assert "--allow-recipe-change" in run_script("--help").stdout


def test_full_disk(assets, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        recipe = recipe_dict(assets, mnt / "run")
        line = error_line(run_script("--recipe", str(write_recipe(tmp_path, recipe))))
        assert "no space left" in line
        leftovers = list((mnt / "run" / "checkpoints").glob("*")) if (mnt / "run" / "checkpoints").exists() else []
        assert not [p for p in leftovers if p.name.startswith(".tmp-")]
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
