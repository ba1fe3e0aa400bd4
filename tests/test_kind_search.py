"""Picking the kind by measured speed (distill/search.py, distill/training/search_run.py): the plan of a multi-kind
recipe, the rounds on one clock, the drop rule inside the timing noise, one generation of the target's data for
every candidate, the report, --resume, and each bad input as one error line before anything is written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from distill import search
from distill.config import RecipeError
from distill.training.checkpoints import CheckpointInfo, clearly_slower
from distill.training.search_run import MultiRecorder, next_round
from tests.procs import REPO, run_distill, tiny_run_paths

KINDS = ["standalone", "eagle3", "dflash"]


def info(step: int, speedup: float, lo: float, hi: float, tau: float = 2.0) -> CheckpointInfo:
    return CheckpointInfo(step, speedup, 0.5, None, (lo, hi), 1.0, tau)


# ---------------------------------------------------------------- the drop rule and the rounds


def test_no_candidate_is_dropped_on_a_difference_inside_the_noise():
    measured = {"a": info(0, 1.50, 1.40, 1.60), "b": info(1, 1.45, 1.35, 1.55), "c": info(2, 1.42, 1.30, 1.52)}
    assert search.to_drop(measured) == {}


def test_a_round_drops_at_most_the_slower_half_and_only_beyond_the_noise():
    measured = {
        "a": info(0, 2.00, 1.90, 2.10),
        "b": info(1, 1.20, 1.10, 1.30),
        "c": info(2, 1.00, 0.95, 1.05),
        "d": info(3, 1.95, 1.85, 2.05, tau=1.9),  # inside a's noise, fewer tokens a pass: kept, a the fastest
    }
    dropped = search.to_drop(measured)
    assert sorted(dropped) == ["b", "c"]
    assert all(w.startswith("slower") and w.endswith("than a") for w in dropped.values())
    five = {**measured, "e": info(4, 0.90, 0.85, 0.95)}
    assert sorted(search.to_drop(five)) == ["c", "e"]  # half of 5 is 2: the two slowest


def test_the_rounds_split_the_clock_and_the_last_one_gets_the_rest():
    state = {"kinds": KINDS, "alive": list(KINDS), "minutes": dict.fromkeys(KINDS, 0.0), "rounds": [],
             "budget_minutes": 24.0, "explore": 0.5}  # fmt: skip
    first = next_round(state)
    assert not first["last"] and first["stops"] == dict.fromkeys(KINDS, 2.0)  # 24 x 0.5 / 2 rounds / 3 alive
    state["rounds"].append(first)
    state["minutes"] = dict.fromkeys(KINDS, 2.0)
    state["alive"] = ["eagle3", "dflash"]
    second = next_round(state)
    assert not second["last"] and second["stops"] == {"eagle3": 5.0, "dflash": 5.0}
    state["rounds"].append(second)
    state["minutes"].update(eagle3=5.0, dflash=5.0)
    state["alive"] = ["dflash"]
    last = next_round(state)
    assert last["last"] and last["stops"] == {"dflash": 5.0 + 24.0 - 12.0}
    assert search.survivor_minutes(24.0, 3, 0.5) == pytest.approx(2.0 + 3.0 + 12.0)


def test_a_tie_after_the_halving_rounds_shares_the_rest_of_the_clock():
    state = {"kinds": ["a", "b"], "alive": ["a", "b"], "minutes": {"a": 6.0, "b": 6.0}, "rounds": [{}],
             "budget_minutes": 24.0, "explore": 0.5}  # fmt: skip
    last = next_round(state)
    assert last["last"] and last["stops"] == {"a": 12.0, "b": 12.0}


def test_the_minimum_budget_gives_each_candidate_its_minutes_before_the_first_measurement():
    assert search.minimum_minutes(6, 0.5, 0.5) == pytest.approx(18.0)
    assert search.round_minutes(18.0, 6, 6, 0.5) == pytest.approx(0.5)


def test_one_generation_feeds_each_recorder_its_own_layers_in_its_own_order():
    class Keep:
        def __init__(self, layers):
            self.layers, self.got, self.cache = layers, None, {}

        def seen(self, rows, logits, states, valid):
            self.got = states

        def finish(self, prompts, completions):
            pass

    a, b = Keep([3, 1, 5, -1]), Keep([1, 2, -1])
    both = MultiRecorder([a, b])
    assert both.layers == [3, 1, 5, 2, -1]
    hidden = 4
    states = torch.cat([torch.full((1, 2, hidden), float(layer)) for layer in both.layers], dim=-1)
    both.seen([0], torch.zeros(1, 2, 7), states, None)
    assert [int(v) for v in a.got[0, 0, ::hidden]] == [3, 1, 5, -1]
    assert [int(v) for v in b.got[0, 0, ::hidden]] == [1, 2, -1]


# ---------------------------------------------------------------- the plan: one error line each


def base_data(paths: dict, out: Path, kinds=KINDS, minutes: float = 0.3) -> dict:
    return {
        "target": {"model": str(paths["target"]), "dtype": "float32"},
        "draft": {"kind": kinds, "model": str(paths["draft"]), "dtype": "float32"},
        "data": {"train_prompts": str(paths["train"]), "eval_prompts": str(paths["eval"]), "max_prompt_tokens": 32},
        "distill": {"source": "target", "max_new_tokens": 12, "loss": "fkl"},
        "train": {"lr": 3e-3, "batch_size": 4, "warmup_steps": 1, "max_minutes": minutes, "schedule_by": "minutes",
                  "max_steps": 100000},
        "eval": {"every": 100000, "num_prompts": 2, "max_new_tokens": 12, "num_draft_tokens": 3, "repeats": 1,
                 "hf_assisted": False, "at_start": False},
        "search": {"min_minutes": 0.02},
        "candidates": {"eagle3": {"draft": {"vocab_subset": 128}, "distill": {"cache_teacher": True}},
                       "dflash": {"draft": {"block_size": 3, "num_layers": 1}, "distill": {"cache_teacher": True}}},
        "log": {"report_to": "wandb", "every": 1},
        "output_dir": str(out),
    }  # fmt: skip


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    return tiny_run_paths(tmp_path_factory.mktemp("pair"), train_prompts=16)


def test_the_plan_gives_each_candidate_its_own_recipe_and_shares_the_rest(paths, tmp_path):
    plan = search.load_plan(base_data(paths, tmp_path / "run"))
    assert plan.kinds == KINDS
    own = plan.recipes["dflash"]
    assert own.draft.block_size == 3 and own.output_dir == str(tmp_path / "run" / "candidates" / "dflash")
    assert own.draft.model == ""  # the given draft LM is for the kinds that load one
    assert plan.recipes["standalone"].draft.model == str(paths["draft"])
    assert {r.distill.cache_dir for r in plan.recipes.values()} == {str(tmp_path / "run" / "rollout_cache")}
    assert {r.log.group for r in plan.recipes.values()} == {"run"}
    assert [r.log.run_name for r in plan.recipes.values()] == [f"run-{k}" for k in KINDS]
    assert search.load_plan({"draft": {"kind": "eagle3"}}) is None


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda d: d["draft"].update(kind=["eagle3", "dflash", "eagle3"]), "draft.kind lists eagle3 more than once"),
        (lambda d: d["draft"].update(kind=["eagle3", "medusa"]), "draft.kind: 'medusa' is not a draft kind"),
        (lambda d: d["candidates"].update(pard={"train": {"lr": 1e-3}}), "candidates.pard: pard is not among"),
        (
            lambda d: d["candidates"]["dflash"].update(data={"max_prompt_tokens": 16}),
            "candidates.dflash.data.max_prompt_tokens: every candidate shares it",
        ),
        (lambda d: d["distill"].update(source="schedule"), "distill.source=schedule: a multi-kind run generates"),
        (
            lambda d: d["candidates"]["eagle3"].update(draft={"lora": {"enabled": True}}),
            "draft.kind: eagle3 cannot train on this recipe: draft.kind=eagle3: eagle3 trains its whole",
        ),
        (
            lambda d: d["candidates"]["dflash"].update(draft={"aux_layers": [0, 1, 9]}),
            "draft.kind: dflash cannot serve this target: ",
        ),
        (
            lambda d: d["train"].update(max_minutes=0.05),
            "train.max_minutes=0.05 is too small for 3 candidates: each needs search.min_minutes=0.02 before its "
            "first measurement, over 2 halving round(s) with search.explore=0.5: set train.max_minutes >= 0.24",
        ),
    ],
    ids=[
        "repeated",
        "unknown",
        "section-not-listed",
        "shared-key",
        "source",
        "cannot-train",
        "cannot-serve",
        "budget",
    ],  # fmt: skip
)
def test_a_bad_multi_kind_recipe_is_one_error_line_and_writes_nothing(paths, tmp_path, change, expected):
    data = base_data(paths, tmp_path / "run")
    change(data)
    proc = run_distill(data, tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: " + expected), lines[0]
    assert not (tmp_path / "run").exists()


def test_auto_leaves_out_the_kinds_that_cannot_train_and_says_why(paths, tmp_path):
    data = base_data(paths, tmp_path / "run")
    data["draft"]["kind"] = "auto"
    data["candidates"]["pard"] = {"distill": {"cache_teacher": True}}  # PARD runs the target every step
    plan = search.load_plan(data)
    assert "pard" not in plan.kinds and "distill.cache_teacher" in plan.skipped["pard"]
    assert set(plan.kinds) >= set(KINDS)
    del data["draft"]["model"]  # no draft LM: the kinds that load one are out at the preflight
    data["candidates"] = {}
    proc = run_distill({**data, "train": {**data["train"], "max_minutes": 0.05}}, tmp_path)
    assert proc.returncode == 2
    assert "error: train.max_minutes=0.05 is too small for 4 candidates" in proc.stderr, proc.stderr[-2000:]
    assert "draft.kind=auto: standalone left out: " in proc.stdout, proc.stdout[-2000:]


def test_each_candidate_is_a_wandb_run_in_the_runs_group(tmp_path, monkeypatch):
    from distill.config import LogConfig
    from distill.training.tracking import tracker_setup

    monkeypatch.setenv("WANDB_MODE", "offline")
    _, init = tracker_setup(LogConfig(run_name="run-dflash", group="run"), tmp_path, is_main=True)
    assert init["wandb"]["group"] == "run" and init["wandb"]["name"] == "run-dflash"
    _, init = tracker_setup(LogConfig(), tmp_path, is_main=True)
    assert "group" not in init["wandb"]


def test_overwrite_empties_the_runs_own_continuation_cache_but_no_cache_the_recipe_names(paths, tmp_path):
    from distill.training.run_state import run_inputs
    from distill.training.search_run import own_inputs

    plan = search.load_plan(base_data(paths, tmp_path / "run"))
    assert "distill.cache_dir" not in own_inputs(plan, run_inputs(plan.base, None))
    data = base_data(paths, tmp_path / "run")
    data["distill"]["cache_dir"] = str(tmp_path / "run" / "mine")
    plan = search.load_plan(data)
    assert own_inputs(plan, run_inputs(plan.base, None))["distill.cache_dir"] == str(tmp_path / "run" / "mine")


def test_a_single_kind_recipe_refuses_candidates_sections():
    with pytest.raises(RecipeError, match="candidates: per-kind sections need draft.kind to be a list"):
        search.load_plan({"draft": {"kind": "eagle3"}, "candidates": {"eagle3": {}}})


# ---------------------------------------------------------------- the run


def launch(recipe: dict, tmp_path: Path, *extra: str) -> subprocess.Popen:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    return subprocess.Popen(
        [sys.executable, str(REPO / "train" / "distill.py"), "--recipe", str(path), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
    )  # fmt: skip


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=600)
    return proc.returncode, out, err


def metric_rows(run: Path, kind: str) -> list[dict]:
    return [json.loads(line) for line in (run / "candidates" / kind / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def search_run(paths, tmp_path_factory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("search")
    code, out, err = finish(launch(base_data(paths, tmp / "run"), tmp))
    assert code == 0, err[-3000:]
    return tmp / "run", out


@pytest.mark.slow
def test_one_run_trains_every_candidate_from_one_generation_and_keeps_the_fastest(search_run, paths):
    run, stdout = search_run
    report = json.loads((run / "report.json").read_text())
    state = json.loads((run / "search.json").read_text())
    assert [row["kind"] for row in report["candidates"]] == KINDS and state["finished"]
    winner = report["kind"]
    assert json.loads((run / "best" / "eval.json").read_text()) == json.loads(
        (run / "candidates" / winner / "best" / "eval.json").read_text()
    )
    assert report["best"] == json.loads((run / "best" / "eval.json").read_text())
    # one generation: one cache file of every prompt's continuation, none in the candidates, no target forward in a
    # step of the kinds that read its hidden states (their stores were filled as it generated)
    caches = sorted((run / "rollout_cache").glob("target-*-p0.jsonl"))
    assert len(caches) == 1 and len(caches[0].read_text().splitlines()) == 16
    for kind in ("eagle3", "dflash"):
        forwards = [r["train/teacher_forwards"] for r in metric_rows(run, kind) if "train/teacher_forwards" in r]
        assert forwards and sum(forwards) == 0, kind
    for kind in KINDS:
        own = json.loads((run / "candidates" / kind / "report.json").read_text())
        assert own["clock"]["generate_minutes"] < 0.01
        assert list((run / "candidates" / kind / "wandb").glob("offline-run-*")), kind  # a W&B run of its own
    assert report["clock"]["generate_minutes"] == pytest.approx(state["generation_minutes"])
    # the clock: the generation and every candidate's minutes add up to train.max_minutes (a step's overshoot)
    assert report["clock"]["train_minutes"] == pytest.approx(0.3, abs=0.05)
    # every drop was beyond the noise against that round's fastest
    for rnd in state["rounds"]:
        measured = {k: CheckpointInfo.from_dict(v) for k, v in rnd["measured"].items()}
        fastest = search.fastest(measured)
        for kind in rnd["dropped"]:
            assert clearly_slower(measured[kind], measured[fastest])
    assert (run / "speed_by_kind.png").stat().st_size > 0
    table = stdout[stdout.rindex("kind  ") :]
    assert all(k in table for k in KINDS) and "best/" in table and "clock: " in table
    assert report["selection"] and report["selection"][0].startswith(f"best/ is {winner}'s best/")


@pytest.mark.slow
def test_publish_takes_the_winner_of_a_multi_kind_run(search_run, tmp_path):
    run, _ = search_run
    winner = json.loads((run / "report.json").read_text())["kind"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "train/publish.py", str(run), "--repo-id", "user/draft", "--dry-run", str(tmp_path / "pub")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    recipe = yaml.safe_load((tmp_path / "pub" / "resolved_recipe.yaml").read_text())
    assert recipe["draft"]["kind"] == winner  # the winner's own recipe, not the list of candidates


@pytest.mark.slow
def test_resume_continues_a_stopped_multi_kind_run_and_refuses_another_list(paths, tmp_path):
    data = base_data(paths, tmp_path / "run", minutes=0.4)
    data["train"]["mixed_precision"] = "bf16"  # not the generation's accelerator's: each candidate makes its own
    proc = launch(data, tmp_path)
    state_file = tmp_path / "run" / "search.json"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:  # stop it once the first round is measured
        if state_file.is_file() and json.loads(state_file.read_text())["rounds"]:
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.2)
    code, _, err = finish(proc)
    assert code == 2 and "--resume" in err, err[-2000:]
    stopped = json.loads(state_file.read_text())
    assert not stopped["finished"]
    before = {k: max(r["step"] for r in metric_rows(tmp_path / "run", k)) for k in KINDS}

    changed = {**data, "draft": {**data["draft"], "kind": ["eagle3", "dflash"]}}
    saved = state_file.read_bytes()
    code, _, err = finish(launch(changed, tmp_path, "--resume"))
    assert code == 2 and err.strip().splitlines() == [
        "error: --resume: the run's candidates are standalone, eagle3, dflash, the recipe now gives eagle3, dflash: "
        "resume with the run's draft.kind, or start a new output_dir"
    ]
    assert state_file.read_bytes() == saved

    code, _, err = finish(launch(data, tmp_path, "--resume"))
    assert code == 0, err[-3000:]
    done = json.loads(state_file.read_text())
    assert done["finished"] and done["rounds"][: len(stopped["rounds"])] == stopped["rounds"]
    for kind in done["alive"]:  # the survivor continued its own run: its steps go on from where they were
        steps = [r["step"] for r in metric_rows(tmp_path / "run", kind) if "train/loss" in r]
        assert max(steps) > before[kind] and len(steps) == len(set(steps))
    assert (tmp_path / "run" / "best" / "eval.json").is_file()
