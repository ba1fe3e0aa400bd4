"""Budget-driven distillation: the lr and the data source follow the training clock (train.schedule_by,
distill.source=schedule), and the reference recipes spend their whole time budget."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import torch

from distill.config import DistillConfig, RecipeError, TrainConfig, load_recipe
from distill.data import rollouts
from distill.training.schedule import (
    GenerationWatch,
    TrainClock,
    budget_progress,
    build_budget_scheduler,
    generation_warning,
    lr_multiplier,
)
from tests.procs import run_distill, tiny_recipe

REPO = Path(__file__).resolve().parent.parent
REFERENCE_RECIPES = sorted((REPO / "recipes").glob("stdlib-*.yaml"))


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def by_minutes(**kw) -> TrainConfig:
    base = {"lr": 1e-3, "warmup_steps": 20, "max_steps": 100_000, "max_minutes": 30.0, "schedule_by": "minutes"}
    return TrainConfig(**{**base, **kw})


# ---------------------------------------------------------------- progress and lr


def test_progress_by_steps_ignores_the_clock():
    cfg = TrainConfig(max_steps=200, max_minutes=1.0)
    assert budget_progress(50, 10_000.0, cfg) == 0.25
    assert budget_progress(400, 0.0, cfg) == 1.0


def test_progress_by_minutes_follows_the_clock_with_max_steps_as_a_cap():
    cfg = by_minutes(max_steps=1000)
    assert budget_progress(10, 0.0, cfg) == pytest.approx(0.01)
    assert budget_progress(10, 9 * 60.0, cfg) == pytest.approx(0.3)
    assert budget_progress(900, 9 * 60.0, cfg) == pytest.approx(0.9)  # the step cap comes first here
    assert budget_progress(10, 3600.0, cfg) == 1.0


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_lr_by_steps_is_the_step_schedule(kind):
    cfg = TrainConfig(max_steps=120, warmup_steps=10, lr_scheduler=kind, max_minutes=5.0)
    steps = range(0, 140, 3)
    assert [lr_multiplier(s, 1e6, cfg) for s in steps] == [lr_multiplier(s, 0.0, cfg) for s in steps]  # no clock
    assert [lr_multiplier(s, 0.0, cfg) for s in range(10)] == pytest.approx([(s + 1) / 11 for s in range(10)])
    peak, middle, end = (lr_multiplier(s, 0.0, cfg) for s in (10, 65, 130))
    assert (peak, middle, end) == pytest.approx(
        {"cosine": (1, 0.55, 0.1), "linear": (1, 0.55, 0.1)}.get(kind, (1, 1, 1))
    )


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_lr_by_minutes_reaches_its_floor_when_the_time_runs_out(kind):
    cfg = by_minutes(lr_scheduler=kind)
    # a 30-minute run takes ~900 steps here: by steps (max_steps 100000) its lr would still be at its peak
    assert lr_multiplier(900, 30 * 60.0, by_minutes(lr_scheduler=kind, schedule_by="steps")) > 0.99
    assert lr_multiplier(900, 30 * 60.0, cfg) == pytest.approx(0.1)
    assert lr_multiplier(450, 15 * 60.0, cfg) == pytest.approx(0.55)
    mid = [lr_multiplier(100 + i, t, cfg) for i, t in enumerate(range(0, 1801, 60))]
    assert mid == sorted(mid, reverse=True) and mid[0] > 0.99


def test_lr_by_minutes_warms_up_by_steps():
    cfg = by_minutes(warmup_steps=4)
    assert [lr_multiplier(s, 0.0, cfg) for s in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])


def test_scheduler_reads_the_clock_and_its_state_resumes():
    model = torch.nn.Linear(2, 2)
    cfg = by_minutes(lr=1.0, warmup_steps=0, max_minutes=1.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    clock = TrainClock()
    scheduler = build_budget_scheduler(optimizer, cfg, clock)
    lrs = []
    for elapsed in (15.0, 30.0, 60.0):
        clock.elapsed_s = elapsed
        optimizer.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    assert lrs == pytest.approx([lr_multiplier(s, t, cfg) for s, t in ((1, 15.0), (2, 30.0), (3, 60.0))])
    assert lrs[-1] == pytest.approx(0.1)
    # the checkpoint's scheduler state holds numbers only (no pickled recipe or clock): it loads weights-only
    buffer = io.BytesIO()
    torch.save(scheduler.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    resumed = build_budget_scheduler(torch.optim.AdamW(model.parameters(), lr=cfg.lr), cfg, TrainClock())
    resumed.load_state_dict(state)
    assert resumed.last_epoch == 3


# ---------------------------------------------------------------- minutes of steps and the generation's share


def minute_marks(generate_s: float, step_s: float, steps: int, every_minutes: float, done_s: float = 0.0) -> list:
    """The steps train/distill.py's loop evaluates at by eval.every_minutes: the clock starts at `generate_s`
    (the target's continuations, plus a resumed run's `done_s` of steps), each step adds `step_s`."""
    from distill.training.loop import crossed_minute_mark as crossed  # what train/distill.py's loop calls

    clock = TrainClock()
    clock.elapsed_s = generate_s + done_s
    clock.start_steps(done_s)
    marks = []
    for step in range(1, steps + 1):
        before = clock.step_s
        clock.elapsed_s += step_s
        if crossed(before, clock.step_s, every_minutes):
            marks.append(step)
    return marks


def test_minute_marks_count_minutes_of_steps_not_the_generation_before_them():
    # 21 minutes generating, 4 s steps, an evaluation every 22 minutes: the clock since its start would pass 22
    # minutes at step 15, on a draft trained for 1 minute; the minutes of steps pass it at step 330
    assert minute_marks(21 * 60.0, 4.0, 600, 22.0) == [330]
    assert minute_marks(0.0, 4.0, 700, 22.0) == [330, 660]  # no generation: the same marks as before
    assert minute_marks(21 * 60.0, 4.0, 600, 0.0) == []  # off


def test_minute_marks_continue_across_a_resume():
    # resumed at step 100 (400 s of steps done): the marks fall where the uninterrupted run's do, whatever the
    # generation the resumed run repeats (here 3 s: its continuations come from the cache)
    resumed = [100 + m for m in minute_marks(3.0, 4.0, 560, 22.0, done_s=400.0)]
    assert resumed == [330, 660]


def test_the_step_clock_reads_the_shared_clock_from_the_first_step():
    clock = TrainClock()
    assert clock.step_s == 0.0
    clock.elapsed_s = 90.0  # generation before the first step
    clock.start_steps()
    assert clock.step_s == 0.0
    clock.elapsed_s = 100.0
    assert clock.step_s == pytest.approx(10.0)
    resumed = TrainClock()
    resumed.elapsed_s = 150.0
    resumed.start_steps(40.0)
    resumed.elapsed_s = 160.0
    assert resumed.step_s == pytest.approx(50.0)


def test_generation_warning_projects_the_rate_so_far_onto_every_prompt():
    assert generation_warning(60.0, 10, 100, max_minutes=0.0) is None  # no budget
    assert generation_warning(60.0, 10, 100, max_minutes=20.0) is None  # 10 of 20 minutes: not more than half
    line = generation_warning(120.0, 100, 1000, max_minutes=30.0)  # 2 min for a tenth: 20 of the 30 minutes
    assert line == (
        "warning: generating the target's continuations will take about 20.0 of the train.max_minutes=30 training "
        "minutes (100 of 1000 prompts in 2.0 min), leaving under half for training steps: use fewer prompts "
        "(data.max_train_prompts), shorter continuations (distill.max_new_tokens) or a larger train.max_minutes"
    )
    assert generation_warning(16 * 60.0, 100, 100, max_minutes=30.0) is not None  # done: it took more than half
    # 90 s of start-up in the first batch of 10, then 1 s a prompt: 90 + 990 s projected (18 of 30 minutes) ...
    assert generation_warning(100.0, 20, 1000, 30.0, first_s=90.0, first_done=10) is not None
    # ... 0.5 s a prompt: 90 + 495 s (9.8 minutes): no warning, where the rate with the start-up gave 75 minutes
    assert generation_warning(95.0, 20, 1000, 30.0, first_s=90.0, first_done=10) is None
    assert generation_warning(95.0, 20, 1000, 30.0) is not None
    assert generation_warning(90.0, 10, 1000, 30.0, first_s=90.0, first_done=10) is None  # no rate yet: 1.5 min


def test_generation_watch_warns_once_and_only_where_enabled():
    lines: list[str] = []
    watch = GenerationWatch(max_minutes=1.0, write=lines.append)
    watch.start -= 20.0  # the first batch took 20 s (start-up): no rate yet, 20 s is under half a minute
    watch(1, 100)
    assert lines == []
    watch.start -= 20.0  # 20 s for the next 9 prompts: over 200 s projected
    watch(10, 100)
    watch(20, 100)
    assert len(lines) == 1 and "train.max_minutes=1 " in lines[0] and "(10 of 100 prompts" in lines[0]
    quiet = GenerationWatch(max_minutes=1.0, enabled=False, write=lines.append)
    quiet.start -= 20.0
    quiet(10, 100)
    assert len(lines) == 1


# ---------------------------------------------------------------- recipe keys


def test_schedule_by_minutes_needs_a_time_budget():
    with pytest.raises(RecipeError, match=r"train.schedule_by: .*set train.max_minutes > 0"):
        load_recipe(None, ["train.schedule_by=minutes"])
    with pytest.raises(RecipeError, match="did you mean 'minutes'"):
        load_recipe(None, ["train.schedule_by=minute", "train.max_minutes=5"])
    assert load_recipe(None, []).train.schedule_by == "steps"  # the default keeps the step schedule


def test_switch_at_is_a_fraction():
    assert DistillConfig().switch_at == 0.3
    with pytest.raises(RecipeError, match=r"distill.switch_at: must be in \[0, 1\], got 1.5"):
        load_recipe(None, ["distill.source=schedule", "distill.switch_at=1.5"])
    assert load_recipe(None, ["distill.source=schedule"]).distill.source == "schedule"


@pytest.mark.parametrize("path", REFERENCE_RECIPES, ids=lambda p: p.name)
def test_reference_recipes_spend_their_whole_time_budget(path):
    from distill.config import is_multi_kind, read_recipe_data
    from distill.search import load_plan

    data = read_recipe_data(path)
    recipe = load_plan(data).base if is_multi_kind(data) else load_recipe(path)  # a multi-kind run: shared keys
    train = recipe.train
    assert train.max_minutes > 0 and train.schedule_by == "minutes"
    # even at 0.5 s a step (the reference pair takes 2-6 s on one core) the step cap must not end the run early
    assert train.max_steps * 0.5 >= train.max_minutes * 60
    # target-generated data: throughout (generated once, reused each epoch) or scheduled before on-policy data
    assert recipe.distill.source in ("target", "schedule")
    if recipe.distill.source == "schedule":
        assert 0 < recipe.distill.switch_at < 1
    else:
        assert recipe.distill.cache_rollouts


# ---------------------------------------------------------------- the data schedule


def test_schedule_source_switches_at_switch_at():
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    picks = [rollouts.choose_source("schedule", 0.5, g, progress=p / 10, switch_at=0.3) for p in range(11)]
    assert picks == ["target"] * 3 + ["draft"] * 8
    assert torch.equal(g.get_state(), state)  # no coin drawn: the other sampling of a step stays the same
    assert rollouts.choose_source("schedule", 0.5, progress=0.0, switch_at=0.0) == "draft"
    assert rollouts.choose_source("schedule", 0.5, progress=1.0, switch_at=1.0) == "draft"
    assert rollouts.choose_source("schedule", 0.5, progress=0.99, switch_at=1.0) == "target"


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict:
    from tests.tiny import make_pair, make_prompts

    root = tmp_path_factory.mktemp("pair")
    target, draft = make_pair(root)
    return {
        "target": target,
        "draft": draft,
        "train": make_prompts(root / "train.jsonl", 24, seed=1),
        "eval": make_prompts(root / "eval.jsonl", 4, seed=2),
    }


def test_rollout_source_schedule_gives_target_then_draft_rollouts(pair, tmp_path):
    from distill.config import DataConfig, ModelConfig
    from distill.data.prompts import encode_examples, load_train_eval
    from distill.models import load_draft, load_target, load_tokenizer

    tok = load_tokenizer(str(pair["target"]), ModelConfig(), key="target.model")
    target = load_target(ModelConfig(model=str(pair["target"]), dtype="float32"), device="cpu")
    draft = load_draft(ModelConfig(model=str(pair["draft"]), dtype="float32"), device="cpu")
    data_cfg = DataConfig(train_prompts=str(pair["train"]), eval_prompts=str(pair["eval"]), max_prompt_tokens=32)
    rows, _ = load_train_eval(data_cfg)
    examples = encode_examples(rows[:3], tok, data_cfg, 512, 8)
    cfg = DistillConfig(source="schedule", switch_at=0.4, max_new_tokens=8, gen_temperature=1.0)
    source = rollouts.RolloutSource(cfg, target, tok, cache_dir=tmp_path)
    assert source.cache is not None and source.pregenerate(examples, draft) == 0  # on demand, on the clock

    def expected(kind: str) -> list:
        return rollouts.make_rollouts(
            examples,
            kind,
            target,
            draft,
            cfg,
            eos_token_id=source.eos_token_id,
            pad_token_id=source.pad_token_id,
            generator=torch.Generator().manual_seed(7),
        )

    early = source.sample(examples, draft, torch.Generator().manual_seed(7), progress=0.1)
    assert source.last_source == "target" and early == expected("target")
    assert len(source.cache) == len(examples)  # cached: a later epoch's target batch costs nothing
    late = source.sample(examples, draft, torch.Generator().manual_seed(7), progress=0.4)
    assert source.last_source == "draft" and late == expected("draft")
    assert late != early


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
def test_time_budgeted_run_switches_source_and_ends_its_lr_decay(pair, tmp_path):
    out = tmp_path / "run"
    recipe = tiny_recipe(
        pair,
        out,
        {"source": "schedule", "switch_at": 0.5, "max_new_tokens": 8},
        {"max_steps": 100_000, "max_minutes": 0.1, "schedule_by": "minutes", "batch_size": 2},
    )
    proc = run_distill(recipe, tmp_path, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train.max_minutes=0.1 reached" in proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/lr" in r]
    on_policy = [r["train/on_policy"] for r in train]
    assert on_policy[0] == 0.0 and on_policy[-1] == 1.0 and on_policy == sorted(on_policy)
    # the lr decayed over the 6 s of clock: its last step sits near the 10% floor, not at the peak
    assert train[-1]["train/lr"] < 0.25 * recipe["train"]["lr"]
    assert max(r["train/lr"] for r in train) > 0.8 * recipe["train"]["lr"]


@pytest.mark.slow
def test_pregenerated_target_continuations_count_against_the_training_clock(pair, tmp_path):
    # 24 prompts x 24 tokens generated up front, then steps of one cached sequence: off the clock, the first
    # step's clock would be that one short step; on it, the clock starts at the pregeneration's seconds
    out = tmp_path / "run"
    recipe = tiny_recipe(
        pair,
        out,
        {"source": "target", "max_new_tokens": 24, "num_draft_tokens": 0},
        {"max_steps": 2, "max_minutes": 10.0, "batch_size": 1},
    )
    proc = run_distill(recipe, tmp_path, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.search(r"data: 24 target continuations in ([\d.]+) s \(on the training clock\)", proc.stdout)
    assert found, proc.stdout[-2000:]
    pregen_s = float(found.group(1))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r.get("step") == 1 and "train/minutes" in r)
    assert pregen_s > 0
    # (the printed seconds are rounded to 0.01)
    assert first["train/minutes"] * 60 >= pregen_s - 0.006
    assert json.loads((out / "report.json").read_text())["train_minutes"] * 60 >= pregen_s - 0.006


@pytest.mark.slow
def test_minutes_scheduled_evaluations_wait_for_minutes_of_steps_and_the_summary_splits_the_clock(pair, tmp_path):
    # The target's 24 continuations of 48 tokens (about 0.2 s on a 2-core EPYC) take longer than the 0.09 s
    # evaluation interval; the clock since its start passes its first multiple within the first steps, the minutes
    # of steps only after ~0.09 s of them
    every = 0.0015
    read_apart = 0.001  # minutes: two reads of the clock a few ms apart, on a loaded machine
    out = tmp_path / "run"
    recipe = tiny_recipe(
        pair,
        out,
        {"source": "target", "max_new_tokens": 48, "num_draft_tokens": 0},
        {"max_steps": 16, "batch_size": 1},
        eval={"at_start": False, "every_minutes": every},
    )
    proc = run_distill(recipe, tmp_path, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    clock = report["clock"]
    assert clock["generate_minutes"] > every  # what this test is about: the generation outlasts the interval
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in rows if "train/loss" in r}
    evaluated = [r["step"] for r in rows if "eval/speedup" in r]
    by_minutes = [step for step in evaluated if step != 16]  # the last step is evaluated anyway
    assert by_minutes, f"no evaluation by minutes in 16 steps: {clock}"
    first = by_minutes[0]
    # the first one comes after one interval of steps (the training clock since the first step), not before
    assert train[first]["train/step_minutes"] >= every
    assert first == 1 or train[first - 1]["train/step_minutes"] < every
    assert train[first]["train/minutes"] >= clock["generate_minutes"] + every
    # and every one after a step that passed a multiple of the interval, none elsewhere
    minutes = [0.0] + [train[step]["train/step_minutes"] for step in range(1, 17)]
    passed = [s for s in range(1, 16) if int(minutes[s] / every) > int(minutes[s - 1] / every)]
    assert by_minutes == passed
    # the training clock is the generation plus the minutes of steps (read a few ms apart)
    for step in range(1, 17):
        assert train[step]["train/minutes"] == pytest.approx(
            clock["generate_minutes"] + train[step]["train/step_minutes"], abs=read_apart
        )
    # where the clock went: numeric minutes generating, stepping and evaluating, and the steps
    assert clock["steps"] == 16
    for key in ("generate_minutes", "step_minutes", "eval_minutes"):
        assert isinstance(clock[key], float) and clock[key] > 0, clock
    assert clock["step_minutes"] == pytest.approx(train[16]["train/step_minutes"])
    assert clock["train_minutes"] == pytest.approx(report["train_minutes"])
    assert clock["generate_minutes"] + clock["step_minutes"] == pytest.approx(clock["train_minutes"], abs=read_apart)
    assert json.loads((out / "draftsmith-run.json").read_text())["clock"] == clock
    assert f"generating the target's data, {clock['step_minutes']:.1f} in 16 steps;" in proc.stdout
