"""Budget-driven distillation: the lr and the data source follow the training clock (train.schedule_by,
distill.source=schedule), and the reference recipes spend their whole time budget."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import torch

from distill import rollouts
from distill.config import DistillConfig, RecipeError, TrainConfig, load_recipe
from distill.schedule import TrainClock, budget_progress, build_budget_scheduler, lr_multiplier
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
    recipe = load_recipe(path)
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
    from distill.data import encode_examples, load_train_eval
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
