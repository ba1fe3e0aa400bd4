"""Pick the kind by measured speed: a recipe whose ``draft.kind`` is a list of kinds, or ``auto`` (every kind that fits
the target and the draft given), trains the candidates on one clock and keeps the fastest (docs/kind-search.md).

This module is the plan, torch-free: which candidates (each one an ordinary single-kind recipe), how the clock is
split into rounds, and which measurements drop a candidate. distill.training.search_run carries it out.

    plan = load_plan(data)          # data: the recipe's YAML after overrides; None for a single-kind recipe
    plan.recipes["<kind>"]          # that candidate's resolved Recipe (its run: OUT/candidates/<kind>)
    round_minutes(plan, alive=3)    # the minutes each of 3 candidates alive trains in a halving round
    to_drop(measured)               # the slower half, only where the timing noise separates them
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from decode import kinds as registry
from distill.config import AUTO, Recipe, RecipeError, build_recipe
from distill.training.checkpoints import CheckpointInfo, clearly_slower, select_best, versus
from distill.training.run_state import flatten

CANDIDATES_DIR = "candidates"  # OUT/candidates/<kind>: each candidate's own run directory
SEARCH_FILE = "search.json"  # OUT/search.json: the candidates, the rounds and the drops (--resume reads it)

# Keys every candidate shares: one generation of the target's data and one measurement of every candidate. A
# candidate's own section (candidates.<kind>) may not set them; a prefix ending in "." covers its section.
SHARED_KEYS = (
    "target.", "data.", "output_dir", "build_pair", "log.", "publish.", "export.", "search.",
    "train.max_minutes", "train.max_steps", "train.seed", "train.schedule_by",
    "distill.source", "distill.max_new_tokens", "distill.gen_temperature", "distill.cache_rollouts",
    "distill.cache_dir", "eval.",
)  # fmt: skip
OWN_EVAL_KEYS = ("eval.num_draft_tokens",)  # the draft length is the kind's: a block kind drafts a longer one
SHARED_SOURCES = ("target", "fixed")  # distill.source values whose training data all candidates can share


@dataclass
class KindSearch:
    """A multi-kind run's plan: its candidates (each an ordinary single-kind recipe) and the keys they share."""

    kinds: list[str]  # the candidates, in the order given (auto: the registry's)
    recipes: dict[str, Recipe]  # each candidate's resolved recipe; its output_dir is OUT/candidates/<kind>
    out: Path  # the run directory (output_dir)
    data: dict  # the recipe as given, after overrides (resolved_recipe.yaml of the run)
    skipped: dict[str, str] = field(default_factory=dict)  # auto: the kinds left out, each with why

    @property
    def base(self) -> Recipe:
        """The first candidate's recipe: what every candidate shares (SHARED_KEYS) is read from it."""
        return self.recipes[self.kinds[0]]


def load_plan(data: dict) -> KindSearch | None:
    """The candidates of a multi-kind recipe (``data``: its YAML after overrides), or None for a single-kind one.

    Raises:
        RecipeError: one line: a kind listed twice, an unknown kind, a candidates section for a kind not listed or
            setting a shared key, a data source the candidates cannot share, a kind of the list that cannot train
            on this recipe (naming why), or an auto list where no kind fits.
    """
    given = (data.get("draft") or {}).get("kind") if isinstance(data.get("draft"), dict) else None
    if not (isinstance(given, list) or given == AUTO):
        if "candidates" in data:
            raise RecipeError(
                "candidates: per-kind sections need draft.kind to be a list of kinds or auto: set draft.kind, or "
                "remove candidates"
            )
        return None
    sections = data.get("candidates") or {}
    if not isinstance(sections, dict):
        raise RecipeError(f"candidates: expected a mapping of kind -> keys, got {sections!r}")
    auto = given == AUTO
    names = registry.names() if auto else check_kind_list(given)
    for kind, section in sections.items():
        if kind not in names:
            raise RecipeError(
                f"candidates.{kind}: {kind} is not among draft.kind's candidates ({', '.join(names)}): add it to "
                "draft.kind or remove its section"
            )
        check_section(kind, section)
    check_shared_source(data)
    out = Path(str(data.get("output_dir") or build_recipe({}).output_dir))
    recipes, skipped = {}, {}
    for kind in names:
        try:
            recipes[kind] = build_recipe(candidate_data(data, kind, out))
        except RecipeError as err:
            if not auto:
                raise RecipeError(f"draft.kind: {kind} cannot train on this recipe: {err}") from None
            skipped[kind] = str(err)
    if not recipes:
        why = "; ".join(f"{k}: {v}" for k, v in skipped.items())
        raise RecipeError(f"draft.kind=auto: no kind fits this recipe ({why})")
    if len(recipes) == 1 and not auto:
        raise RecipeError(f"draft.kind: a list of one kind: set draft.kind: {next(iter(recipes))}")
    return KindSearch(list(recipes), recipes, out, data, skipped)


def check_kind_list(given: list) -> list[str]:
    """draft.kind's list: known kinds, each once."""
    names = [str(k) for k in given]
    for kind in names:
        if kind not in registry.names():
            raise RecipeError(f"draft.kind: {kind!r} is not a draft kind: use kinds of {', '.join(registry.names())}")
    repeated = sorted({k for k in names if names.count(k) > 1})
    if repeated:
        raise RecipeError(f"draft.kind lists {', '.join(repeated)} more than once: list each kind once")
    return names


def check_section(kind: str, section: Any) -> None:
    """candidates.<kind>: a mapping of the kind's own keys (nested or dotted), none of SHARED_KEYS."""
    if not isinstance(section, dict):
        raise RecipeError(f"candidates.{kind}: expected a mapping of recipe keys, got {section!r}")
    for key in flatten(section):
        shared = any(key == s or (s.endswith(".") and key.startswith(s)) for s in SHARED_KEYS)
        if shared and key not in OWN_EVAL_KEYS:
            raise RecipeError(
                f"candidates.{kind}.{key}: every candidate shares it (one generation of the target's data, one "
                "measurement): set it outside candidates"
            )
        if key == "draft.kind":
            raise RecipeError(f"candidates.{kind}.draft.kind: the section's kind is its name: remove the key")


def check_shared_source(data: dict) -> None:
    """The candidates share one set of training sequences: the target's cached continuations or fixed data."""
    distill = data.get("distill") or {}
    source = distill.get("source", "target")
    if source not in SHARED_SOURCES:
        raise RecipeError(
            f"distill.source={source}: a multi-kind run generates the target's data once for every candidate: set "
            "distill.source: target (or fixed)"
        )
    if source == "target" and distill.get("cache_rollouts") is False:
        raise RecipeError(
            "distill.cache_rollouts=false: a multi-kind run keeps the target's continuations for every candidate: "
            "set distill.cache_rollouts: true"
        )


def candidate_data(data: dict, kind: str, out: Path) -> dict:
    """One candidate's recipe data: the shared keys, draft.kind, its own section, its run directory under ``out``,
    the shared cache of the target's continuations, a W&B run of its own in the run's group, and nothing that
    happens once at the end (extra engines, GGUF export, publish: the run does them for the winner)."""
    section = (data.get("candidates") or {}).get(kind) or {}
    mine = copy.deepcopy({k: v for k, v in data.items() if k != "candidates"})
    draft = mine.setdefault("draft", {})
    draft["kind"] = kind
    traits = registry.traits(kind)
    own_folder = bool(draft.get("model")) and folder_of(draft["model"]) in traits.folder_kinds
    if not traits.loads_draft_model and not own_folder:
        # the given draft (or draft.init) is for the kinds that load a draft LM; this kind builds its own from the
        # target
        for key in ("model", "init", "init_layers"):
            draft.pop(key, None)
    for key, value in flatten(section).items():
        set_dotted(mine, key, copy.deepcopy(value))
    mine["output_dir"] = str(out / CANDIDATES_DIR / kind)
    mine.setdefault("distill", {}).setdefault("cache_dir", str(out / "rollout_cache"))
    log = mine.setdefault("log", {})
    name = log.get("run_name") or out.name
    log.update(run_name=f"{name}-{kind}", group=name)
    mine.setdefault("eval", {})["extra_engines"] = []
    mine.setdefault("export", {})["gguf"] = False
    mine.setdefault("publish", {})["push_to_hub"] = False
    return mine


def set_dotted(tree: dict, key: str, value: Any) -> None:
    """tree["a"]["b"] = value for key "a.b" (sections made as needed)."""
    *parents, last = key.split(".")
    for part in parents:
        if not isinstance(tree.get(part), dict):
            tree[part] = {}
        tree = tree[part]
    tree[last] = value


def folder_of(path: str) -> str | None:
    from decode.kinds.dispatch import folder_kind

    return folder_kind(path)


# ---------------------------------------------------------------- the clock's rounds


def halving_rounds(n: int) -> int:
    """Rounds that halve n candidates down to one: ceil(log2 n)."""
    return max(1, math.ceil(math.log2(n)))


def round_minutes(budget_minutes: float, n: int, alive: int, explore: float) -> float:
    """The training minutes each of ``alive`` candidates gets in one halving round: the ``explore`` share of the
    training budget, split evenly over the halving rounds of ``n`` candidates and the candidates alive."""
    return budget_minutes * explore / halving_rounds(n) / alive


def minimum_minutes(n: int, explore: float, min_minutes: float) -> float:
    """The smallest train.max_minutes that gives each of n candidates ``min_minutes`` before its first measurement
    (search.min_minutes), before the generation of the target's data is counted."""
    return min_minutes * n * halving_rounds(n) / explore


def survivor_minutes(budget_minutes: float, n: int, explore: float) -> float:
    """The minutes the last candidate trains when each round drops the slower half: the lr schedule's horizon of
    every candidate (train.schedule_by=minutes), so the one that wins continues its schedule without a jump."""
    alive, total = n, 0.0
    for _ in range(halving_rounds(n)):
        total += round_minutes(budget_minutes, n, alive, explore)
        alive = max(1, alive - alive // 2)
    return total + budget_minutes * (1.0 - explore)


def to_drop(measured: dict[str, CheckpointInfo]) -> dict[str, str]:
    """The candidates a round drops, each with why: at most the slower half, and only those slower than the fastest
    beyond the timing noise (the paired interval best/ selection uses, distill.training.checkpoints)."""
    if len(measured) < 2:
        return {}
    infos = list(measured.values())
    fastest_info = select_best(infos)
    fastest = next(k for k, v in measured.items() if v is fastest_info)
    slower = sorted(
        (k for k, v in measured.items() if k != fastest and clearly_slower(v, fastest_info)),
        key=lambda k: measured[k].speedup,
    )
    return {k: f"{versus(measured[k], fastest_info)} than {fastest}" for k in slower[: len(measured) // 2]}


def fastest(measured: dict[str, CheckpointInfo]) -> str:
    """The candidate whose measurement best/ selection would keep (beyond the noise; inside it, tau decides)."""
    best = select_best(list(measured.values()))
    return next(k for k, v in measured.items() if v is best)
