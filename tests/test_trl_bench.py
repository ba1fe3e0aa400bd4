"""bench/trl_gkd_vs_draftsmith.py and the training curve it reads: the pure parts of the benchmark (marks,
first pass of the base draft, CPU sets, the TRL mapping), checked against TRL's own loss where TRL is installed,
and `train_minutes` / `eval.every_minutes` in a tiny real train/distill.py run."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distill.config import RecipeError, load_recipe
from distill.training import losses
from distill.training.checkpoints import CheckpointInfo, load_infos
from tests.procs import load_script, run_distill
from tests.tiny import make_pair, make_prompts

REPO = Path(__file__).resolve().parent.parent
HAS_TRL = importlib.util.find_spec("trl") is not None


bench = load_script("bench/trl_gkd_vs_draftsmith.py", "trl_gkd_vs_draftsmith")


# ---------------------------------------------------------------- the TRL mapping


def test_trl_beta_maps_each_loss_and_refuses_tvd():
    assert bench.trl_beta("fkl", 0.5) == 0.0
    assert bench.trl_beta("rkl", 0.5) == 1.0
    assert bench.trl_beta("jsd", 0.3) == 0.3
    with pytest.raises(ValueError, match="distill.loss=tvd"):
        bench.trl_beta("tvd", 0.5)


def test_trl_lmbda_is_the_on_policy_share_of_each_source():
    assert bench.trl_lmbda("schedule", 0.3, 0.5) == pytest.approx(0.7)
    assert bench.trl_lmbda("mix", 0.3, 0.4) == 0.4
    assert (bench.trl_lmbda("draft", 0.3, 0.5), bench.trl_lmbda("target", 0.3, 0.5)) == (1.0, 0.0)
    with pytest.raises(ValueError, match="distill.source=fixed"):
        bench.trl_lmbda("fixed", 0.3, 0.5)


def test_shared_settings_come_from_the_default_recipe():
    s = bench.shared_from_recipe(load_recipe(REPO / bench.DEFAULT_RECIPE))
    assert (s.loss, s.beta, s.source, s.lmbda) == ("fkl", 0.0, "schedule", pytest.approx(0.7))
    # the greedy recipe samples its continuations greedily (gen_temperature 0)
    assert (s.lr, s.warmup_steps, s.batch_size, s.max_new_tokens, s.gen_temperature) == (1e-3, 20, 16, 64, 0.0)
    kwargs = bench.trl_config_kwargs(s, Path("out"))
    assert (kwargs["beta"], kwargs["lmbda"], kwargs["seq_kd"], kwargs["learning_rate"]) == (0.0, 0.7, True, 1e-3)
    assert kwargs["temperature"] > 0  # greedy is do_sample=False instead
    sampled = bench.shared_from_recipe(load_recipe(REPO / bench.DEFAULT_RECIPE, ["distill.gen_temperature=0.8"]))
    assert bench.trl_config_kwargs(sampled, Path("out"))["temperature"] == pytest.approx(0.8)
    with pytest.raises(ValueError, match="distill.temperature=1.0"):
        bench.shared_from_recipe(load_recipe(REPO / bench.DEFAULT_RECIPE, ["distill.temperature=2.0"]))


def test_draftsmith_overrides_resolve_to_one_run_with_a_checkpoint_per_mark():
    s = bench.shared_from_recipe(load_recipe(REPO / bench.DEFAULT_RECIPE))
    recipe = load_recipe(REPO / bench.DEFAULT_RECIPE, bench.draftsmith_overrides(s, 20.0, 5, Path("out")))
    assert (recipe.eval.every_minutes, recipe.train.max_minutes, recipe.train.schedule_by) == (4.0, 20.0, "minutes")
    assert recipe.eval.keep_top_k >= 5 + 1 and recipe.eval.repeats == 1 and recipe.eval.hf_assisted is False
    assert recipe.distill.source == "schedule"  # the recipe's own data source, not forced


@pytest.mark.skipif(not HAS_TRL, reason="needs trl (pip install trl==1.16.0)")
@pytest.mark.parametrize(("loss", "beta"), [("fkl", 0.5), ("rkl", 0.5), ("jsd", 0.3)])
def test_trl_beta_gives_trls_loss_the_value_of_draftsmiths(loss, beta):
    _, GKDTrainer = bench.load_trl()
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    labels = torch.ones(2, 5, dtype=torch.long)
    theirs = GKDTrainer.generalized_jsd_loss(student, teacher, labels, beta=bench.trl_beta(loss, beta))
    ours = losses.distill_loss(student, teacher, torch.ones(2, 5), loss=loss, beta=beta)
    assert float(theirs) == pytest.approx(float(ours), rel=1e-5)


# ---------------------------------------------------------------- marks, first pass, CPU sets


def test_minute_marks_are_equally_spaced_up_to_the_budget():
    assert bench.minute_marks(20, 5) == [4, 8, 12, 16, 20]
    assert bench.minute_marks(0.3, 2) == [0.15, 0.3]
    marks = bench.minute_marks(0.3, 3)
    assert bench.marks_passed(marks, 0.0999) == 0 and bench.marks_passed(marks, 0.1) == 1
    assert bench.marks_passed(marks, 0.35) == 3
    assert bench.mark_of(marks, 0.05) is None and bench.mark_of(marks, 0.25) == 0.2 and bench.mark_of(marks, 1) == 0.3


def test_stop_after_keeps_the_early_marks_of_the_full_budget(capsys):
    assert bench.minute_marks(20, 40, 2) == [0.5, 1, 1.5, 2]
    assert bench.minute_marks(20, 5, 10) == [4, 8]  # a mark past --stop-after is dropped, not moved
    assert bench.minute_marks(20, 5, 20) == bench.minute_marks(20, 5)
    args = argparse.Namespace(minutes=20.0, eval_prompts=2, threads=1, marks=5, stop_after=3.0, parallel=False)
    with pytest.raises(SystemExit) as exit_info:
        bench.check_args(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "before the first mark (4 min)" in err[0]


def test_first_pass_is_the_earliest_snapshot_above_the_base():
    rows = [
        {"name": "c", "train_minutes": 12.0, "acceptance_rate": 0.50},
        {"name": "a", "train_minutes": 4.0, "acceptance_rate": 0.30},
        {"name": "b", "train_minutes": 8.0, "acceptance_rate": 0.36},  # equal is not above
        {"name": "d", "train_minutes": 9.0, "acceptance_rate": 0.40},
    ]
    assert bench.first_pass(0.36, rows)["name"] == "d"
    assert bench.first_pass(0.6, rows) is None


def test_side_summary_and_its_line_say_not_within_budget():
    base = {"acceptance_rate": 0.5}
    rows = [
        {"side": "trl", "name": "trl@step-3", "mark": 1.0, "train_minutes": 1.01, "steps": 3, "acceptance_rate": 0.4}
    ]
    rows[0].update(mean_accepted_length=1.5, speedup_vs_target=0.9)
    summaries = {
        "trl": bench.side_summary("trl", base, rows),
        "draftsmith": bench.side_summary("draftsmith", base, []),
    }
    assert summaries["trl"]["final"]["name"] == "trl@step-3" and summaries["trl"]["first_pass_base"] is None
    trl_line, ds_line = bench.summary_lines(base, summaries)
    assert "not by the last mark" in trl_line and "no snapshot" in ds_line


def test_cpu_sets_are_disjoint_and_refuse_too_few_cpus():
    assert bench.cpu_sets(1, [3, 1]) == [[1], [3]]
    assert bench.cpu_sets(2, range(5)) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="needs 2 x --threads = 4 CPUs, this process may use 2"):
        bench.cpu_sets(2, [0, 1])
    assert bench.split_round_robin(["a", "b", "c"], 2) == [["a", "c"], ["b"]]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs os.sched_getaffinity (Linux)")
def test_parallel_with_too_few_cpus_is_one_error_line(capsys):
    args = argparse.Namespace(minutes=1.0, eval_prompts=2, threads=len(os.sched_getaffinity(0)), marks=2)
    args.parallel = True
    with pytest.raises(SystemExit) as exit_info:
        bench.check_args(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "lower --threads or drop --parallel" in err[0]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux)")
def test_a_worker_pins_itself_to_its_cpus():
    cpu = min(os.sched_getaffinity(0))
    script = REPO / "bench" / "trl_gkd_vs_draftsmith.py"
    code = (
        "import importlib.util, os, sys\n"
        f"spec = importlib.util.spec_from_file_location('bench', {str(script)!r})\n"
        "module = importlib.util.module_from_spec(spec); sys.modules['bench'] = module\n"
        "spec.loader.exec_module(module)\n"
        f"module.pin_to([{cpu}])\n"
        "print(sorted(os.sched_getaffinity(0)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [cpu]


# ---------------------------------------------------------------- train_minutes and eval.every_minutes


def test_every_minutes_is_validated():
    assert load_recipe(None).eval.every_minutes == 0
    with pytest.raises(RecipeError, match=r"eval.every_minutes: must be >= 0"):
        load_recipe(None, ["eval.every_minutes=-1"])


def test_crossed_minute_mark():
    from distill.training.loop import crossed_minute_mark as crossed  # what train/distill.py's loop calls

    assert crossed(50.0, 61.0, 1.0) and crossed(0.0, 60.0, 1.0)
    assert not crossed(61.0, 119.0, 1.0) and not crossed(0.0, 1e6, 0.0)
    assert crossed(119.0, 241.0, 1.0)  # two marks in one step: one evaluation


def test_checkpoint_rows_without_train_minutes_still_load(tmp_path):
    old = {"step": 10, "speedup": 1.2, "speedup_ci95": None, "acceptance_rate": 0.5, "loss": 1.0}
    assert CheckpointInfo.from_dict(old).train_minutes is None
    new = CheckpointInfo(20, speedup=1.3, acceptance_rate=0.6, loss=0.9, train_minutes=2.5)
    assert CheckpointInfo.from_dict(new.as_dict()) == new
    step = tmp_path / "step-10"
    step.mkdir()
    (step / "eval.json").write_text(json.dumps({"speedup": {"vs_target": 1.2}, "acceptance_rate": 0.5}))
    assert load_infos(tmp_path)[0].train_minutes is None


@pytest.mark.slow
def test_a_run_evaluates_at_minute_marks_and_records_train_minutes(tmp_path):
    target, draft = make_pair(tmp_path / "pair")
    out = tmp_path / "run"
    recipe = {
        "target": {"model": str(target), "dtype": "float32"},
        "draft": {"model": str(draft), "dtype": "float32"},
        "data": {
            "train_prompts": str(make_prompts(tmp_path / "train.jsonl", 16, seed=1)),
            "eval_prompts": str(make_prompts(tmp_path / "eval.jsonl", 2, seed=2)),
            "max_prompt_tokens": 32,
        },
        "distill": {"loss": "fkl", "source": "draft", "max_new_tokens": 6},
        "train": {"lr": 3e-3, "max_steps": 3, "batch_size": 2, "warmup_steps": 1},
        # every step takes far longer than 1e-5 minutes, so each crosses a mark; eval.every alone gives 0 and 3
        "eval": {"every": 100, "every_minutes": 1e-5, "num_prompts": 1, "max_new_tokens": 6, "repeats": 1},
        "log": {"report_to": "none", "every": 1},
        "output_dir": str(out),
    }
    recipe["eval"].update(hf_assisted=False, num_draft_tokens=2, keep_top_k=10)
    proc = run_distill(recipe, tmp_path, WANDB_MODE="disabled")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    rows = report["checkpoints"]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    minutes = [r["train_minutes"] for r in rows]
    assert minutes[0] == 0 and all(a < b for a, b in zip(minutes, minutes[1:]))
    assert minutes[-1] == pytest.approx(report["train_minutes"], rel=1e-6)
    step2 = json.loads((out / "checkpoints" / "step-2" / "eval.json").read_text())
    assert step2["train_minutes"] == pytest.approx(minutes[2])
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in logged if "train/loss" in r]
    assert len(train_rows) == 3
    assert [r["train/minutes"] for r in train_rows] == pytest.approx(minutes[1:], rel=1e-3)


@pytest.mark.skipif(not HAS_TRL, reason="needs trl (pip install trl==1.16.0)")
@pytest.mark.parametrize("gen_temperature", [0.0, 1.0])
def test_trl_side_generates_greedily_when_the_recipe_does(tmp_path, gen_temperature):
    from datasets import Dataset

    from distill import models
    from distill.config import ModelConfig

    GKDConfig, GKDTrainer = bench.load_trl()
    target_dir, draft_dir = make_pair(tmp_path / "pair")
    tokenizer = models.load_tokenizer(str(target_dir))
    target = models.load_target(ModelConfig(model=str(target_dir), dtype="float32"))
    draft = models.load_draft(ModelConfig(model=str(draft_dir), dtype="float32"))
    s = bench.Shared(gen_temperature=gen_temperature, max_new_tokens=8, batch_size=2, max_prompt_tokens=16)
    prompts = [tokenizer("def add(a, b):")["input_ids"], tokenizer("class Point:")["input_ids"]]
    dataset = Dataset.from_list([{"prompt": "", "input_ids": p, "completion_mask": [0] * len(p)} for p in prompts])
    trainer_class = bench.bench_trainer_class(GKDTrainer, greedy=gen_temperature == 0)
    trainer = trainer_class(
        model=draft,
        teacher_model=target,
        args=GKDConfig(**bench.trl_config_kwargs(s, tmp_path / "trl")),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    batch = next(iter(trainer.get_train_dataloader()))
    runs = [trainer.generate_on_policy_outputs(draft, batch, trainer.generation_config)[0] for _ in range(3)]
    same = all(torch.equal(runs[0], r) for r in runs[1:])
    assert trainer.generation_config.do_sample is (gen_temperature > 0)
    assert same is (gen_temperature == 0)  # sampling at temperature 1 differs between draws; greedy never does


@pytest.fixture(scope="module")
def tiny_overrides(tmp_path_factory) -> list[str]:
    """Recipe overrides pointing the default recipe at a tiny pair and prompt files."""
    root = tmp_path_factory.mktemp("tiny")
    target, draft = make_pair(root)
    train, dev = make_prompts(root / "train.jsonl", 4), make_prompts(root / "dev.jsonl", 2, seed=1)
    return [
        f"target.model={target}",
        f"draft.model={draft}",
        f"data.train_prompts={train}",
        f"data.eval_prompts={dev}",
    ]


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        (["target.model=no/such/dir"], "target.model"),
        (["data.train_prompts=missing.jsonl"], "data.train_prompts"),
        (["distill.loss=tvd"], "distill.loss=tvd"),
        (["distill.temperature=2.0"], "distill.temperature=1.0"),
        (["--marks", "0"], "--marks"),
    ],
)
def test_bad_inputs_are_one_error_line(capsys, tmp_path, tiny_overrides, extra, names):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(
            ["--recipe", str(REPO / bench.DEFAULT_RECIPE), "--out", str(tmp_path / "out"), *tiny_overrides, *extra]
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and names in err[0], err
    assert not (tmp_path / "out").exists()  # nothing written before the inputs are checked


@pytest.mark.slow
def test_stop_after_ends_the_draftsmith_side_after_the_last_kept_mark(tmp_path):
    """A draftsmith run of a long budget, ended by --stop-after's hook: the crossing step's checkpoint is
    saved, the step after it is neither saved nor counted, and the stats are written."""
    target, draft = make_pair(tmp_path / "pair")
    train, dev = make_prompts(tmp_path / "train.jsonl", 8, seed=1), make_prompts(tmp_path / "dev.jsonl", 1, seed=2)
    out = tmp_path / "ds"
    s = bench.Shared(max_new_tokens=6, batch_size=2, max_prompt_tokens=16, eval_new_tokens=6, eval_gamma=2)
    argv = ["--recipe", str(REPO / bench.DEFAULT_RECIPE), "--overwrite"]
    argv += [f"target.model={target}", f"draft.model={draft}", f"data.train_prompts={train}"]
    argv += [f"data.eval_prompts={dev}", "target.dtype=float32", "distill.max_new_tokens=6", "train.batch_size=2"]
    # 60 budget minutes, a mark every 1e-6 minutes (every step crosses one); stop once 1e-9 s have passed
    argv += bench.draftsmith_overrides(s, 60.0, 60_000_000, out)
    spec = {"argv": argv, "output_dir": str(out), "threads": 1, "stop_after_s": 1e-9}
    cmd = [sys.executable, str(REPO / "bench" / "trl_gkd_vs_draftsmith.py"), "--worker", "draftsmith"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, "--spec", json.dumps(spec)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-0", "step-1"]
    stats = json.loads((out / bench.STATS_FILE).read_text())
    assert stats["steps"] == 1 and stats["micro_batches"] == 1 and len(stats["snapshots"]) == 1
    assert stats["snapshots"][0]["tokens"] == stats["tokens"] > 0
