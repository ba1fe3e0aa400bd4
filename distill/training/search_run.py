"""A multi-kind run (distill.search's plan): the target's data generated once for every candidate, the candidates
trained in rounds on one clock, the slower ones dropped beyond the timing noise, the survivor given the rest, and
best/ the fastest checkpoint of any candidate (docs/kind-search.md).

    run_search(plan, args, run_one)   # run_one: train/distill.py's run(recipe, args, shared=...)

Each candidate is an ordinary run in OUT/candidates/<kind>/ (checkpoints, best/, report.json, its own W&B run in the
run's group), continued by --resume from round to round. OUT/search.json holds the plan and every round's
measurements; OUT/report.json the candidates side by side; OUT/best/ the winner's best/.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import yaml

from distill import search
from distill.config import Recipe, RecipeError, build_recipe
from distill.training.checkpoints import (
    CheckpointInfo,
    tokens_per_pass,
    versus,
    write_json_atomic,
    write_text_atomic,
)
from distill.training.run_state import RUN_MARKER, export_best, read_eval

PLOT = "speed_by_kind.png"


@dataclass
class Shared:
    """What a candidate's run takes from the multi-kind run instead of making it itself (train/distill.py run)."""

    target: Any
    tokenizer: Any
    teachers: dict[str, Any]  # kind -> its store of the target's side (distill.cache_teacher), or None
    stop_minutes: float  # the candidate's training minutes this round ends at

    def teachers_of(self, kind: Any) -> Any:
        """The store of the target's side kept for ``kind`` (its training module), or None."""
        return self.teachers.get(kind.TRAITS.name)


class MultiRecorder:
    """Several kinds' generation recorders fed by one generation: the target's forwards give the hidden states of
    every layer any of them reads, and each is handed its own layers, in its own order."""

    def __init__(self, recorders: Sequence[Any]) -> None:
        self.recorders = list(recorders)
        wanted = [layer for r in recorders for layer in r.layers if layer != -1]
        self.layers = [*dict.fromkeys(wanted), -1]  # each once, the last hidden state last (as every recorder has)
        self.picks = [[self.layers.index(layer) for layer in r.layers] for r in recorders]

    @property
    def cache(self) -> Any:
        """The first recorder's store (its size is what the data line prints)."""
        return self.recorders[0].cache

    def seen(self, rows: list[int], logits: Any, states: Any, valid: Any) -> None:
        hidden = states.shape[-1] // len(self.layers)
        parts = states.split(hidden, dim=-1)
        for recorder, pick in zip(self.recorders, self.picks):
            recorder.seen(rows, logits, torch.cat([parts[i] for i in pick], dim=-1), valid)

    def finish(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]) -> None:
        for recorder in self.recorders:
            recorder.finish(prompts, completions)


# ---------------------------------------------------------------- before anything is written


def final_recipe(plan: search.KindSearch, kind: str) -> Recipe:
    """The recipe of ``kind`` as the run's end uses it for the winner: its candidate recipe with the run's own
    extra engines, GGUF export and publish keys."""
    data = search.candidate_data(plan.data, kind, plan.out)
    for section in ("eval", "export", "publish"):
        given = plan.data.get(section) or {}
        for key in ("extra_engines", "gguf", "push_to_hub"):
            if key in given:
                data[section][key] = given[key]
    return build_recipe(data)


def check_plan(plan: search.KindSearch, resume: bool) -> None:
    """Refuse, before anything is written: a candidate that cannot train on this target (an explicit list; auto
    leaves it out and says why), a budget too small to measure every candidate, more than one process, and
    --resume with another list of candidates.

    Raises:
        RecipeError: one line naming the problem and the fix.
    """
    from distill.publishing import gguf
    from distill.training import distributed, preflight

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RecipeError(
            "draft.kind: a multi-kind run trains its candidates one after the other in one process: run it with "
            "python train/distill.py or accelerate launch --num_processes 1"
        )
    auto = plan.data["draft"]["kind"] == search.AUTO
    for kind, why in plan.skipped.items():
        print(f"draft.kind=auto: {kind} left out: {why}")
    for kind in list(plan.kinds):
        try:
            distributed.check_launch(plan.recipes[kind])
            preflight.check_inputs(plan.recipes[kind])
            gguf.run_plan(final_recipe(plan, kind))  # the extra engines and export the winner gets: llama.cpp found
        except (RecipeError, ValueError, FileNotFoundError) as err:
            why = str(err).strip().splitlines()[0]
            if not auto:
                raise RecipeError(f"draft.kind: {kind} cannot serve this target: {why}") from None
            plan.skipped[kind] = why
            print(f"draft.kind=auto: {kind} left out: {why}")
            plan.kinds.remove(kind)
            del plan.recipes[kind]
    if not plan.kinds:
        raise RecipeError(f"draft.kind=auto: no kind fits this target ({'; '.join(plan.skipped.values())})")
    base = plan.base
    n, cfg = len(plan.kinds), base.search
    if base.train.max_minutes <= 0:
        raise RecipeError("train.max_minutes: a multi-kind run shares one clock between its candidates: set it (> 0)")
    need = search.minimum_minutes(n, cfg.explore, cfg.min_minutes)
    if n > 1 and base.train.max_minutes < need:
        raise RecipeError(
            f"train.max_minutes={base.train.max_minutes:g} is too small for {n} candidates: each needs "
            f"search.min_minutes={cfg.min_minutes:g} before its first measurement, over "
            f"{search.halving_rounds(n)} halving round(s) with search.explore={cfg.explore:g}: set train.max_minutes "
            f">= {need:g} (or list fewer kinds, or lower search.min_minutes)"
        )
    saved = read_state(plan.out) if resume else None
    if saved is not None and saved["kinds"] != plan.kinds:
        raise RecipeError(
            f"--resume: the run's candidates are {', '.join(saved['kinds'])}, the recipe now gives "
            f"{', '.join(plan.kinds)}: resume with the run's draft.kind, or start a new output_dir"
        )


def read_state(out: Path) -> dict | None:
    """search.json of the run in ``out``, or None before it has one."""
    path = out / search.SEARCH_FILE
    return json.loads(path.read_text()) if path.is_file() else None


# ---------------------------------------------------------------- the run


def run_search(
    plan: search.KindSearch, args: argparse.Namespace, run_one: Callable[..., None], on_step: Any = None
) -> None:
    """Carry out ``plan``: generate once, train in rounds, drop beyond the noise, write best/ and report.json."""
    from distill.training.run_state import prepare_output_dir, run_inputs

    check_plan(plan, args.resume)
    out = plan.out.resolve()
    plan.out = out
    prepare_output_dir(out, args.resume, args.overwrite, own_inputs(plan, run_inputs(plan.base, args.recipe)))
    write_text_atomic(out / "resolved_recipe.yaml", yaml.safe_dump(plan.data, sort_keys=False))
    state = read_state(out) if args.resume else None
    shared, eval_rows, generation_s = generate_once(plan, state)
    if state is None:
        state = new_state(plan, generation_s)
        save_state(out, state)
    print(
        f"kind search: {', '.join(plan.kinds)} on one clock of {plan.base.train.max_minutes:g} training minutes: "
        f"{state['generation_minutes']:.1f} generating the target's data once, {state['budget_minutes']:.1f} "
        f"training the candidates in {search.halving_rounds(len(plan.kinds))} halving round(s) and a last one"
    )
    while not state["finished"]:
        run_round(plan, state, shared, args, run_one, on_step)
    finish(plan, state, eval_rows, final_recipe(plan, state["winner"]))


def own_inputs(plan: search.KindSearch, inputs: dict[str, str | None]) -> dict[str, str | None]:
    """The run's inputs (what --overwrite must not delete) less the continuation cache the run itself keeps in
    OUT/rollout_cache when the recipe sets no distill.cache_dir: --overwrite empties it with the rest."""
    if not (plan.data.get("distill") or {}).get("cache_dir"):
        inputs = {k: v for k, v in inputs.items() if k != "distill.cache_dir"}
    return inputs


def generate_once(plan: search.KindSearch, state: dict | None) -> tuple[Shared, list, float]:
    """The target, its tokenizer and the candidates' stores of its side, filled by one generation of its
    continuations for every candidate (on --resume the continuations come from the cache on disk, and the stores
    fill in the candidates' first steps). Returns (shared, the eval rows, the seconds generating)."""
    from accelerate import Accelerator

    from distill import kinds, models
    from distill.training.build import build_data, build_source, pregenerate
    from distill.training.helpers import Timer
    from distill.training.run_state import RunClock

    base = plan.base
    accelerator = Accelerator()  # for the generation alone; each candidate's run makes its own
    tokenizer = models.load_tokenizer(base.target.model, base.target, key="target.model")
    target = models.load_target(base.target, device=accelerator.device)
    vocab_size = models.check_compatible(target, target, tokenizer, tokenizer)
    teachers = {k: kinds.get(k).cache_teacher(plan.recipes[k], target) for k in plan.kinds}
    recorders = [kinds.get(k).generation_recorder(teachers[k], plan.recipes[k], target) for k in plan.kinds]
    recorders = [r for r in recorders if r is not None]
    recorder = MultiRecorder(recorders) if recorders else None
    train_prompts, eval_rows = build_data(base, accelerator, target, tokenizer, None, plan.out)
    source = build_source(base, target, tokenizer, plan.out, 0, vocab_size)
    timer = Timer(base.train.max_minutes)
    pregenerate(base, source, train_prompts, accelerator, timer, None, recorder, clock=RunClock())
    generation_s = timer.elapsed_s if state is None else state["generation_minutes"] * 60.0
    return Shared(target, tokenizer, teachers, 0.0), eval_rows, generation_s


def new_state(plan: search.KindSearch, generation_s: float) -> dict:
    """search.json at the start: the candidates, the clock's split, no round run yet."""
    base = plan.base
    budget = max(0.0, base.train.max_minutes - generation_s / 60.0)
    return {
        "kinds": plan.kinds,
        "skipped": plan.skipped,
        "generation_minutes": generation_s / 60.0,
        "budget_minutes": budget,  # training minutes for the candidates (the clock less the generation)
        "explore": base.search.explore,
        "alive": list(plan.kinds),
        "minutes": {k: 0.0 for k in plan.kinds},  # each candidate's training minutes so far
        "rounds": [],
        "current": None,  # the round under way: {"round", "last", "stops": {kind: minutes}, "done": [kinds]}
        "dropped": {},
        "finished": False,
        "winner": None,
    }


def save_state(out: Path, state: dict) -> None:
    write_json_atomic(out / search.SEARCH_FILE, state)


def next_round(state: dict) -> dict:
    """The round to run next: a halving round (each candidate alive gets its share of the explore minutes) while
    more than one is alive and halving rounds are left, else the last round, which splits what is left of the
    clock between those alive (one alone gets it all)."""
    n, alive = len(state["kinds"]), state["alive"]
    number = len(state["rounds"]) + 1
    last = len(alive) == 1 or number > search.halving_rounds(n)
    if last:
        spent = sum(state["minutes"].values())
        share = max(0.0, state["budget_minutes"] - spent) / len(alive)
    else:
        share = search.round_minutes(state["budget_minutes"], n, len(alive), state["explore"])
    stops = {k: state["minutes"][k] + share for k in alive}
    return {"round": number, "last": last, "stops": stops, "done": []}


def run_round(
    plan: search.KindSearch, state: dict, shared: Shared, args: argparse.Namespace, run_one: Callable, on_step: Any
) -> None:
    """Train every candidate alive up to the round's minutes (each run continued by --resume), measure, drop."""
    if state["current"] is None:
        state["current"] = next_round(state)
        save_state(plan.out, state)
    current = state["current"]
    what = "last round" if current["last"] else f"round {current['round']}"
    for kind in state["alive"]:
        if kind in current["done"]:
            continue
        stop = current["stops"][kind]
        print(f"\n== kind search, {what}: {kind} trains to {stop:.1f} minutes")
        run_candidate(plan, kind, shared, stop, args, run_one, on_step)
        info = latest(plan.out, kind)
        state["minutes"][kind] = info.train_minutes or stop
        current["done"].append(kind)
        save_state(plan.out, state)
    measured = {k: latest(plan.out, k) for k in state["alive"]}
    dropped = {} if current["last"] else search.to_drop(measured)
    for kind, why in dropped.items():
        state["dropped"][kind] = {"round": current["round"], "train_minutes": state["minutes"][kind], "why": why}
        state["alive"].remove(kind)
        print(f"kind search: {kind} dropped after {what}: {why}")
    if not current["last"] and not dropped and len(measured) > 1:
        print(f"kind search: {what} dropped none: the measurement could not separate {', '.join(measured)}")
    state["rounds"].append({**current, "measured": {k: v.as_dict() for k, v in measured.items()}, "dropped": dropped})
    state["current"] = None
    if current["last"]:
        state["finished"] = True
        state["winner"] = winner(plan.out, state["kinds"])
    save_state(plan.out, state)


def run_candidate(
    plan: search.KindSearch,
    kind: str,
    shared: Shared,
    stop: float,
    args: argparse.Namespace,
    run_one: Callable,
    on_step: Any,
) -> None:
    """One round of one candidate: its own run, started or continued (--resume), stopping at ``stop`` minutes."""
    out = candidate_dir(plan.out, kind)
    started = (out / RUN_MARKER).is_file()
    own = argparse.Namespace(
        recipe=args.recipe, resume=started, overwrite=False, allow_recipe_change=False, rebuild=False,
        print_config=False, overrides=[],
    )  # fmt: skip
    recipe = copy.deepcopy(plan.recipes[kind])  # the run fills in and turns off keys of the recipe it is given
    recipe.train.max_minutes = horizon(plan)  # the lr schedule's horizon: the same in every round
    fresh_accelerate_state()
    run_one(recipe, own, on_step=on_step, shared=replace(shared, stop_minutes=stop))


def fresh_accelerate_state() -> None:
    """Forget the Accelerator of the generation or of the previous candidate: each candidate's run makes its own
    (accelerate keeps one per process, and refuses another mixed precision otherwise)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def horizon(plan: search.KindSearch) -> float:
    """Every candidate's train.max_minutes (the lr schedule's horizon, schedule_by=minutes): the minutes the last
    one alive trains when each round halves the field, less the generation (search.json keeps the split)."""
    state = read_state(plan.out)
    return search.survivor_minutes(state["budget_minutes"], len(state["kinds"]), state["explore"])


def candidate_dir(out: Path, kind: str) -> Path:
    return out / search.CANDIDATES_DIR / kind


def latest(out: Path, kind: str) -> CheckpointInfo:
    """A candidate's newest evaluation (its run's last checkpoint with an eval.json)."""
    from distill.training.checkpoints import load_infos

    infos = load_infos(candidate_dir(out, kind) / "checkpoints")
    if not infos:
        raise RuntimeError(f"candidate {kind} has no evaluated checkpoint in {candidate_dir(out, kind)}")
    return max(infos, key=lambda i: i.step)


def best_info(out: Path, kind: str, index: int) -> CheckpointInfo | None:
    """A candidate's best/ as a CheckpointInfo whose step is ``index`` (so selection's tie-break is the list's
    order), or None before it has one."""
    result = read_eval(candidate_dir(out, kind) / "best")
    return replace(CheckpointInfo.from_eval(0, result), step=index) if result else None


def winner(out: Path, kinds: list[str]) -> str:
    """The candidate whose best/ is fastest beyond the noise (inside it, the more tokens per target pass)."""
    found = {k: info for i, k in enumerate(kinds) if (info := best_info(out, k, i)) is not None}
    return search.fastest(found)


# ---------------------------------------------------------------- the end


def finish(plan: search.KindSearch, state: dict, eval_rows: list, final: Recipe) -> None:
    """best/ (the winner's best/), report.json with every candidate side by side, the plot and the end table; then
    what the run does once for its best/: the extra engines, the GGUF export, publish."""
    from distill.publishing import gguf
    from distill.training.engines import measure_extra_engines

    out, win = plan.out, state["winner"]
    export_best(candidate_dir(out, win) / "best", out / "best")
    report = search_report(out, state)
    write_json_atomic(out / "report.json", report)
    plot = plot_speed_by_kind(report["candidates"], out / PLOT)
    print("\n" + search_table(report))
    print(f"\nbest draft: {out / 'best'} ({win})\nreport: {out / 'report.json'}\nplot: {plot}")
    measure_extra_engines(out / "best", final, eval_rows)
    gguf.export_run(out / "best", final, gguf.run_plan(final))
    if final.publish.push_to_hub:
        from distill.publishing.publish import publish

        trust = final.draft.trust_remote_code or final.target.trust_remote_code
        where = publish(out / "best", final.publish.repo_id, private=final.publish.private, trust_remote_code=trust)
        print(f"published: {where}")


def candidate_row(out: Path, kind: str, state: dict) -> dict:
    """One candidate in report.json: its figures at its best/, its curve of speed against training minutes, and
    its fate (dropped when and why, or kept to the end)."""
    report = json.loads((candidate_dir(out, kind) / "report.json").read_text())
    best = report["best"]
    return {
        "kind": kind,
        "run_dir": str(candidate_dir(out, kind)),
        "steps": report["clock"]["steps"],
        "train_minutes": state["minutes"][kind],
        "best_step": report["best_step"],
        "mean_accepted_length": best["mean_accepted_length"],
        "per_position_acceptance": best["per_position_acceptance"],
        "speedup": best["speedup"]["vs_target"],
        "speedup_ci95": best["speedup"].get("vs_target_ci95"),
        "dropped": state["dropped"].get(kind),
        "curve": [
            {"train_minutes": c.get("train_minutes"), "speedup": c["speedup"], "speedup_ci95": c.get("speedup_ci95")}
            for c in report["checkpoints"]
        ],
    }


def search_report(out: Path, state: dict) -> dict:
    """report.json of a multi-kind run: the winner's base/best/checkpoints (what publish reads, as from any run),
    every candidate side by side, the rounds, the clock, and in words what decided."""
    win = state["winner"]
    own = json.loads((candidate_dir(out, win) / "report.json").read_text())
    rows = [candidate_row(out, k, state) for k in state["kinds"]]
    reports = [json.loads((candidate_dir(out, k) / "report.json").read_text()) for k in state["kinds"]]
    eval_minutes = sum(r["clock"]["eval_minutes"] for r in reports)
    return {
        "kind": win,
        "base": own["base"],
        "best": own["best"],
        "best_step": own["best_step"],
        "checkpoints": own["checkpoints"],
        "candidates": rows,
        "selection": selection_words(out, state),
        "rounds": state["rounds"],
        "clock": {
            "train_minutes": state["generation_minutes"] + sum(state["minutes"].values()),
            "generate_minutes": state["generation_minutes"],
            "step_minutes": sum(state["minutes"].values()),
            "steps": sum(r["steps"] for r in rows),
            "eval_minutes": eval_minutes,
        },
        "train_minutes": state["generation_minutes"] + sum(state["minutes"].values()),
    }


def selection_words(out: Path, state: dict) -> list[str]:
    """In words: the winner against the fastest other candidate (beyond the noise, or what decided inside it)."""
    kinds, win = state["kinds"], state["winner"]
    infos = {k: info for i, k in enumerate(kinds) if (info := best_info(out, k, i)) is not None}
    others = {k: v for k, v in infos.items() if k != win}
    if not others:
        return [f"best/ is {win}'s best/: the only candidate."]
    runner = max(others, key=lambda k: others[k].speedup)
    verdict = versus(infos[win], others[runner])
    if verdict.startswith("faster"):
        return [f"best/ is {win}'s best/, {verdict} than {runner}'s, the next fastest candidate."]
    mine, theirs = tokens_per_pass(infos[win], others[runner])
    decided = (
        f"the more tokens per target pass decided ({mine:.2f} against {theirs:.2f})"
        if mine != theirs
        else "the order of draft.kind decided"
    )
    return [
        f"best/ is {win}'s best/; against {runner}'s, the fastest other candidate, it is {verdict}: the measurement "
        f"could not separate the two kinds, so {decided}."
    ]


def fate(row: dict, winner_kind: str) -> str:
    if row["kind"] == winner_kind:
        return "best/"
    if row["dropped"]:
        d = row["dropped"]
        return f"dropped after round {d['round']} ({d['train_minutes']:.1f} min): {d['why']}"
    return "kept to the end"


def search_table(report: dict) -> str:
    """The candidates side by side, as printed at the end of a multi-kind run, with what decided and the clock."""
    from distill.training.helpers import clock_line

    header = ("kind", "steps", "minutes", "tau", "acceptance by position", "speedup [95%]")
    rows = []
    for row in report["candidates"]:
        ci = row["speedup_ci95"]
        speed = f"{row['speedup']:.2f}x" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
        accept = " ".join(f"{a:.2f}" for a in row["per_position_acceptance"])
        cells = (row["kind"], str(row["steps"]), f"{row['train_minutes']:.1f}", f"{row['mean_accepted_length']:.2f}")
        rows.append((*cells, accept, speed, fate(row, report["kind"])))
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(f"{c:<{w}}" for c, w in zip(header, widths))]
    lines += ["  ".join(f"{c:<{w}}" for c, w in zip(r[:-1], widths)) + f"  {r[-1]}" for r in rows]
    return "\n".join([*lines, "", *report["selection"], "", clock_line(report["clock"])])


def plot_speed_by_kind(rows: list[dict], path: Path) -> Path:
    """Speedup (95% interval as error bars) against training minutes, one line per candidate (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for row in rows:
        points = [c for c in row["curve"] if c["train_minutes"] is not None]
        xs = [c["train_minutes"] for c in points]
        ys = [c["speedup"] for c in points]
        lo = [c["speedup"] - (c["speedup_ci95"] or (c["speedup"],) * 2)[0] for c in points]
        hi = [(c["speedup_ci95"] or (c["speedup"],) * 2)[1] - c["speedup"] for c in points]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=row["kind"])
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("training minutes (each candidate's own)")
    ax.set_ylabel("speedup vs target")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
