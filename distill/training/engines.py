"""Measuring a draft with the recipe's eval settings in each engine: draftsmith's own decoder
(:func:`bench_by_recipe`), vLLM, and llama.cpp at the end (recipe keys ``eval.engine`` and ``eval.extra_engines``).

vLLM loads models from directories, so the draft is first saved the way vLLM serves it: in the target's dtype
and with the target's vocab_size. Each vLLM measurement runs ``python -m decode bench --engine vllm`` in a
subprocess, which keeps vLLM's global state out of the training process.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from distill.config import ModelConfig, Recipe
from distill.training.checkpoints import update_json_atomic, write_json_atomic


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _bench_settings(recipe: Recipe, dtype: str) -> dict[str, Any]:
    ev = recipe.eval
    return {
        "max_new_tokens": ev.max_new_tokens,
        "temperature": ev.temperature,
        "top_p": ev.top_p,
        "top_k": ev.top_k,
        "num_draft_tokens": ev.num_draft_tokens,
        "batch_size": ev.batch_size,
        "repeats": ev.repeats,
        "seed": recipe.train.seed,
        "dtype": dtype,
        # the recipe is the user's command line here: its trust_remote_code is theirs
        "trust_remote_code": recipe.target.trust_remote_code or recipe.draft.trust_remote_code,
    }


def bench_by_recipe(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[dict],
    recipe: Recipe,
    *,
    draft_name: str,
    progress: bool,
    hf_assisted: bool = True,
    num_draft_tokens: int | str | None = None,
    samples_out: Path | None = None,
    draft_vocab: Sequence[int] | None = None,
) -> dict:
    """draftsmith's bench (decode.bench.run_bench) of loaded models with the recipe's eval settings: new tokens,
    sampling, gamma (unless `num_draft_tokens`), batch size, repeats and seed. HF assisted generation runs as a
    baseline where the recipe asks for it, the batch is 1, the caller allows it (`hf_assisted`) and it can run the
    draft's kind (a PARD draft or a head: no)."""
    from decode.bench import run_bench
    from decode.kinds.dispatch import kind_of
    from distill import kinds

    ev = recipe.eval
    hf = ev.hf_assisted and ev.batch_size == 1 and hf_assisted and kinds.get(kind_of(draft)).TRAITS.hf_assisted
    return run_bench(
        target,
        draft,
        tokenizer,
        list(prompts),
        target_name=recipe.target.model,
        draft_name=draft_name,
        max_new_tokens=ev.max_new_tokens,
        temperature=ev.temperature,
        top_p=ev.top_p,
        top_k=ev.top_k,
        num_draft_tokens=ev.num_draft_tokens if num_draft_tokens is None else num_draft_tokens,
        batch_size=ev.batch_size,
        repeats=ev.repeats,
        seed=recipe.train.seed,
        baselines=("target", "hf") if hf else ("target",),
        samples_out=samples_out,
        progress=progress,
        draft_vocab=draft_vocab,
    )


def evaluate_vllm(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[dict],
    recipe: Recipe,
    samples_out: Path | None = None,
) -> dict:
    """Bench ``draft`` (a loaded, plain model) next to ``recipe.target.model`` inside vLLM; the bench JSON dict.

    The target is loaded by vLLM from its recipe path in the dtype of the loaded ``target``; the draft is saved
    to a temporary directory in that dtype with the target's vocab_size.
    """
    from decode import kinds
    from decode.kinds.dispatch import kind_of
    from decode.vllm_engine import bench_in_subprocess, save_draft_for_vllm

    dtype = next(target.parameters()).dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):  # a quantized target: vLLM loads it unquantized
        dtype = torch.bfloat16
    with tempfile.TemporaryDirectory(prefix="draftsmith-vllm-draft-") as tmp:
        kind = kind_of(draft)
        if not kinds.traits(kind).loads_draft_model:  # its served layout; vLLM takes the rest from the target
            draft_dir = kinds.decoding(kind).save(draft, Path(tmp) / "draft", dtype=dtype)
        else:
            draft_dir = save_draft_for_vllm(draft, tokenizer, target.config, Path(tmp) / "draft", dtype=dtype)
        settings = _bench_settings(recipe, _dtype_name(dtype))
        settings["draft_sample_method"] = recipe.eval.vllm_draft_sample_method
        settings["samples_out"] = str(samples_out) if samples_out is not None else None
        result = bench_in_subprocess(
            recipe.target.model, draft_dir, prompts, settings=settings, out_json=Path(tmp) / "eval.json"
        )
    result["draft"] = recipe.draft.model
    return result


def _bench_draftsmith(best: Path, recipe: Recipe, prompts: Sequence[dict], dtype: str) -> dict:
    """draftsmith's own bench of best/ next to the recipe's target, both loaded in ``dtype``.

    Through training's loaders, so the target is the one the run measured (a .gguf file, ``target.revision``,
    its quantization), and the draft drafts from best/'s ``draft_vocab.json`` when it has one. A draft built from
    the target (a head, a DFlash or DSpark draft) is loaded by its kind onto the target (its embedding); HF assisted
    generation cannot run it.
    """
    from decode import kinds
    from decode.draft_vocab import load_ids
    from decode.kinds.dispatch import folder_kind
    from distill.models import load_target, load_tokenizer

    target = load_target(dataclasses.replace(recipe.target, dtype=dtype))
    kind = folder_kind(str(best))
    head = kind is not None and not kinds.traits(kind).loads_draft_model
    if head:
        draft = kinds.decoding(kind).load(best, target)
    else:  # best/ is served frozen: loaded as a target is (eval mode, no gradients), in the same dtype
        draft = load_target(
            ModelConfig(model=str(best), dtype=dtype, trust_remote_code=recipe.draft.trust_remote_code)
        )
    tokenizer = load_tokenizer(recipe.target.model, recipe.target, key="target.model")
    return bench_by_recipe(
        target, draft, tokenizer, prompts, recipe, draft_name=str(best), progress=False, hf_assisted=not head,
        draft_vocab=None if head else load_ids(best),
    )  # fmt: skip


def _bench_vllm(best: Path, recipe: Recipe, prompts: Sequence[dict], dtype: str) -> dict:
    from decode.vllm_engine import bench_in_subprocess, draft_dir_for_vllm

    with tempfile.TemporaryDirectory(prefix="draftsmith-vllm-") as tmp:
        trust = recipe.target.trust_remote_code or recipe.draft.trust_remote_code
        draft_dir = draft_dir_for_vllm(recipe.target.model, str(best), dtype, Path(tmp), trust)
        settings = {**_bench_settings(recipe, dtype), "draft_sample_method": recipe.eval.vllm_draft_sample_method}
        return bench_in_subprocess(
            recipe.target.model, draft_dir, prompts, settings=settings, out_json=Path(tmp) / "e.json"
        )


def _bench_llamacpp(best: Path, recipe: Recipe, prompts: Sequence[dict], dtype: str) -> dict:
    """llama-server with best/ against llama-server target-only (``decode.llamacpp.bench``): best/ and an HF target
    converted to GGUF in the eval's ``dtype`` (cached), the recipe's eval settings; one request at a time."""
    from decode.llamacpp.bench import run_llamacpp_bench

    s = _bench_settings(recipe, dtype)
    return run_llamacpp_bench(
        recipe.target.model, str(best), list(prompts), llama_cpp=recipe.export.llama_cpp,
        max_new_tokens=s["max_new_tokens"], temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"],
        num_draft_tokens=s["num_draft_tokens"], repeats=s["repeats"], seed=s["seed"], dtype=dtype, progress=False,
    )  # fmt: skip


Z_NOISE = 3.0  # two-proportion z beyond which two engines' acceptance at a position differs
KERNEL_TOLERANCE = 0.03  # engines run the same weights with their own kernels: bf16 rounding moves a few drafts


def acceptance_gaps(ours: dict, theirs: dict) -> list[dict]:
    """The draft positions where two bench JSONs' acceptance differs beyond noise: by more than
    :data:`KERNEL_TOLERANCE` plus :data:`Z_NOISE` standard errors of the difference of two proportions (from each
    engine's ``per_position_judged`` counts). A served draft that is not the trained one (wrong aux layers, a
    misread mask token) shows here. [] when they agree or either lacks the counts."""
    gaps = []
    rows = zip(
        ours.get("per_position_acceptance") or [],
        ours.get("per_position_judged") or [],
        theirs.get("per_position_acceptance") or [],
        theirs.get("per_position_judged") or [],
    )
    for i, (p1, n1, p2, n2) in enumerate(rows):
        if not n1 or not n2:
            continue
        pooled = (p1 * n1 + p2 * n2) / (n1 + n2)
        se = math.sqrt(max(pooled * (1 - pooled), 1e-12) * (1 / n1 + 1 / n2))
        if abs(p1 - p2) > KERNEL_TOLERANCE + Z_NOISE * se:
            gaps.append({"position": i + 1, "ours": p1, "theirs": p2, "judged": [n1, n2], "z": (p1 - p2) / se})
    return gaps


def record_served_acceptance(run_dir: Path, engine: str, measured_by: str, gaps: list[dict]) -> None:
    """Warn when ``engine`` accepts the best draft differently from ``measured_by`` beyond noise, and record the
    comparison in report.json's ``served_acceptance`` (the report is rewritten atomically)."""
    if gaps:
        where = ", ".join(f"position {g['position']}: {g['theirs']:.3f} vs {g['ours']:.3f}" for g in gaps)
        print(
            f"warning: {engine} accepts the best draft differently from {measured_by} beyond noise ({where}): the "
            "draft it serves may not be the one trained (its format, aux layers or mask token); see report.json"
        )
    entry = {"measured_by": measured_by, "differs": bool(gaps), "gaps": gaps}
    update_json_atomic(
        run_dir / "report.json", lambda report: report.setdefault("served_acceptance", {}).update({engine: entry})
    )


def measure_extra_engines(best: Path, recipe: Recipe, prompts: Sequence[dict]) -> list[Path]:
    """``best/eval_<engine>.json`` for every engine of ``eval.extra_engines`` other than ``eval.engine``
    (whose figures are ``best/eval.json``), measured on the same prompts and settings, each engine's per-position
    acceptance compared with ``eval.engine``'s (:func:`record_served_acceptance`). Returns the files."""
    benches = {"draftsmith": _bench_draftsmith, "vllm": _bench_vllm, "llamacpp": _bench_llamacpp}
    written = []
    engines = [e for e in dict.fromkeys(recipe.eval.extra_engines) if e != recipe.eval.engine]
    if not engines:
        return written
    measured = json.loads((best / "eval.json").read_text())
    dtype = measured.get("dtype") or "float32"  # the eval's own dtype: every engine sees the same weights
    for engine in engines:
        result = benches[engine](best, recipe, prompts, dtype)
        result["draft"] = str(best)
        out = best / f"eval_{engine}.json"
        write_json_atomic(out, result)  # never a half-written eval file
        written.append(out)
        record_served_acceptance(best.parent, engine, recipe.eval.engine, acceptance_gaps(measured, result))
    return written
