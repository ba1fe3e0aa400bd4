"""A draft's GGUF files for llama.cpp (``draft-<type>.gguf``), written beside what a run or a publish writes: the
recipe's ``export.gguf`` into best/ when a run ends, ``train/publish.py --gguf`` into the published folder.

:func:`decode.llamacpp.export.plan` makes every check before anything is written (the kind, the target's HF
folder, llama.cpp, its converter and its ``--spec-type``); :func:`write` exports, each file whole or not at all.
"""

from __future__ import annotations

from pathlib import Path

from decode.llamacpp import export


def run_plan(recipe) -> export.Plan | None:
    """The checks of a run's ``export.gguf`` (None: off), made before the run writes anything. A target the run
    builds itself (``build_pair``, target.model empty) is resolved when the run ends.

    Raises:
        ValueError: one line (the kind, the target, llama.cpp).
    """
    types = export.parse_types(recipe.export.gguf)
    if not types:
        return None
    target = recipe.target.model or None
    return export.plan(recipe.draft.kind, target, types, recipe.export.llama_cpp, recipe.target.revision)


def write(folder: Path, plan: export.Plan, target: str | None = None, revision: str | None = None) -> list[Path]:
    """Export the draft saved in ``folder`` into ``folder/draft-<type>.gguf``, one file per type of ``plan``
    (``target``: the target's name when the plan was made without it)."""
    target_dir = plan.target_dir or export.target_folder(target or "", revision)
    return [
        export.export_draft(folder, target_dir, Path(folder) / export.gguf_name(t), t, plan.llama_cpp)
        for t in plan.types
    ]


def export_run(best: Path, recipe, plan: export.Plan | None) -> list[Path]:
    """A run's best/ as GGUF files (``export.gguf``), when the run ends, recorded in the run's report.json under
    ``gguf`` (:func:`report_entry`); [] when the plan is None."""
    if plan is None:
        return []
    best = Path(best)
    print(f"llama.cpp: writing {', '.join(export.gguf_name(t) for t in plan.types)} into {best}", flush=True)
    paths = write(best, plan, recipe.target.model, recipe.target.revision)
    from decode.metrics import best_gamma
    from distill.training.checkpoints import update_json_atomic

    def add_entry(report: dict) -> None:
        report["gguf"] = report_entry(paths, plan, best_gamma(report.get("best") or {}))

    update_json_atomic(best.parent / "report.json", add_entry)
    for path in paths:
        print(f"llama.cpp: wrote {path}")
    return paths


def report_entry(paths: list[Path], plan: export.Plan, num_draft_tokens: int) -> dict:
    """report.json's ``gguf``: the files, the kind's ``--spec-type``, the K the run measured best and the
    ``llama-server`` line that serves the first file."""
    return {
        "files": [str(p) for p in paths],
        "spec_type": plan.spec_type,
        "num_draft_tokens": int(num_draft_tokens),
        "launch": export.launch_line(
            plan.spec_type, num_draft_tokens, draft=Path(paths[0]).name if paths else "DRAFT.gguf"
        ),
    }


def card_info(plan: export.Plan) -> dict:
    """What the model card says of the GGUF files published (``distill.publishing.card``'s llama.cpp section)."""
    return {"files": [export.gguf_name(t) for t in plan.types], "spec_type": plan.spec_type}
