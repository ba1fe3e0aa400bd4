"""The published draft's model card (README.md), rendered with huggingface_hub's `ModelCard`.

The metadata block (base_model, license, datasets, tags, ...) and the measured figures as `model-index`
evaluation results come from `ModelCardData` / `EvalResult`, so the Hub reads them; the body states the same
figures for people, per measuring engine, with the launch lines for Transformers, vLLM and SGLang.

`info` is the content of draftsmith_eval.json (built by distill.publishing.publish, already free of local paths):
target, base_model, repo figures (`best`, `base`, `engines`), gamma, hardware, prompts, notes, ...
"""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from decode import kinds
from decode.draft_vocab import MAX_MASS
from distill.publishing.hub import is_hub_id

TAGS = ["speculative-decoding", "draft-model", "draftsmith"]
ENGINE_NAMES = {"draftsmith": "draftsmith's speculative decoder (`python -m decode bench`)", "vllm": "vLLM"}


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float):
        return spec.format(value)
    return str(value)


def _speedup(value: Any, ci: Any = None) -> str:
    text = _fmt(value, "{:.2f}x")
    if isinstance(ci, list | tuple) and len(ci) == 2 and all(isinstance(x, int | float) for x in ci):
        text += f" (95% CI {ci[0]:.2f}-{ci[1]:.2f}x)"
    return text


def slower_than_target(ev: dict) -> float | None:
    """The measured speedup vs target-only decoding when it is below 1 (the draft slows the target), else None."""
    value = (ev.get("speedup") or {}).get("vs_target")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value < 1 else None


def engine_of(ev: dict) -> str:
    """The engine that measured a bench JSON ("draftsmith" when it does not say)."""
    return str(ev.get("engine") or "draftsmith")


def _rows(ev: dict) -> list[tuple[str, str]]:
    """(label, formatted value) for one bench JSON: the card's table column."""
    tps, sp = ev.get("tokens_per_s") or {}, ev.get("speedup") or {}
    return [
        ("acceptance rate (accepted / drafted tokens)", _fmt(ev.get("acceptance_rate"), "{:.3f}")),
        ("τ, mean accepted length (tokens per target pass)", _fmt(ev.get("mean_accepted_length"), "{:.2f}")),
        ("speedup vs target-only decoding", _speedup(sp.get("vs_target"), sp.get("vs_target_ci95"))),
        ("speedup vs HF assisted generation (transformers defaults)", _fmt(sp.get("vs_hf_assisted"), "{:.2f}x")),
        (
            "speedup vs HF assisted generation (the measured γ, constant)",
            _fmt(sp.get("vs_hf_assisted_published"), "{:.2f}x"),
        ),
        ("… with HF on draftsmith's CPU kernels", _fmt(sp.get("vs_hf_assisted_same_kernels"), "{:.2f}x")),
        ("tokens/s: speculative", _fmt(tps.get("speculative"), "{:.1f}")),
        ("tokens/s: target only", _fmt(tps.get("target"), "{:.1f}")),
        ("tokens/s: HF assisted generation (transformers defaults)", _fmt(tps.get("hf_assisted"), "{:.1f}")),
        (
            "tokens/s: HF assisted generation (the measured γ, constant)",
            _fmt(tps.get("hf_assisted_published"), "{:.1f}"),
        ),
        ("γ, draft tokens per round", _fmt(ev.get("num_draft_tokens"), "{}")),
        ("draft cost ratio c", _fmt(ev.get("draft_cost_ratio"), "{:.3f}")),
        ("theoretical speedup (forward times only)", _fmt(ev.get("theoretical_speedup"), "{:.2f}x")),
        ("outputs match the target's (greedy)", _fmt(ev.get("outputs_match_target"), "{}")),
    ]


def _table(columns: list[tuple[str, dict]]) -> list[str]:
    """A markdown table: one column per (header, bench JSON); rows every column leaves n/a are dropped."""
    rows = [_rows(ev) for _, ev in columns]
    lines = ["| | " + " | ".join(h for h, _ in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for i, (label, _) in enumerate(rows[0]):
        values = [col[i][1] for col in rows]
        if any(v != "n/a" for v in values):
            lines.append(f"| {label} | " + " | ".join(values) + " |")
    return lines


# ---------------------------------------------------------------- metadata


def eval_results(info: dict) -> list[EvalResult]:
    """The measured figures of every engine as `EvalResult`s (the card's machine-readable model-index)."""
    prompts = str(info.get("prompts") or "not recorded")
    dataset = {
        "task_type": "text-generation",
        "task_name": "speculative decoding",
        "dataset_type": prompts if is_hub_id(prompts) and not prompts.endswith((".jsonl", ".json")) else "local",
        "dataset_name": prompts,
    }
    results = []
    for ev in [info["best"], *(info.get("engines") or {}).values()]:
        engine = engine_of(ev)
        tps, sp = ev.get("tokens_per_s") or {}, ev.get("speedup") or {}
        figures = [
            ("speedup", f"speedup vs target-only ({engine})", sp.get("vs_target")),
            ("acceptance_rate", f"acceptance rate ({engine})", ev.get("acceptance_rate")),
            ("mean_accepted_length", f"mean accepted length ({engine})", ev.get("mean_accepted_length")),
            ("tokens_per_second", f"tokens/s with the draft ({engine})", tps.get("speculative")),
            ("tokens_per_second", f"tokens/s target only ({engine})", tps.get("target")),
            ("tokens_per_second", "tokens/s HF assisted generation (transformers defaults)", tps.get("hf_assisted")),
            (
                "tokens_per_second",
                "tokens/s HF assisted generation (the measured γ, constant)",
                tps.get("hf_assisted_published"),
            ),
        ]
        for metric_type, name, value in figures:
            if isinstance(value, int | float) and not isinstance(value, bool):
                results.append(
                    EvalResult(
                        **dataset, metric_type=metric_type, metric_name=name, metric_value=round(float(value), 4),
                        metric_config=engine,
                    )
                )  # fmt: skip
    return results


def card_data(info: dict, repo_id: str) -> ModelCardData:
    """The card's metadata: Hub fields, the target the draft was made for, and the figures as eval_results."""
    extra: dict[str, Any] = {"target_model": info["target"]}
    # publish records the base's Hub id apart: its public name alone ("draft") could be a Hub id or a folder.
    base = info["base_model_hub_id"] if "base_model_hub_id" in info else info.get("base_model")
    if is_hub_id(base):
        extra["base_model_relation"] = "finetune"
    return ModelCardData(
        base_model=base if is_hub_id(base) else None,
        license=info.get("license") or None,
        datasets=list(info.get("datasets") or []) or None,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=list(TAGS),
        model_name=repo_id.split("/")[-1],
        eval_results=eval_results(info) or None,
        **extra,
    )


# ---------------------------------------------------------------- body


def _columns(info: dict, step: str) -> list[tuple[str, dict]]:
    """The figure table's columns. Where training measured the draft otherwise than as uploaded (QLoRA), each
    column says what it measured and on how many prompts; base and this draft compare within the same kind."""
    best, base, trained_on = info["best"], info.get("base"), info.get("training_measured_on")
    if not trained_on:  # every column measured alike, by the training-time evaluation
        return [*([("base draft", base)] if base else []), (f"this draft ({step})", best)]

    def during_training(ev: dict) -> str:
        return f"training-time eval on {trained_on}, {ev.get('n_prompts', 'n/a')} prompts"

    columns = [(f"base draft ({during_training(base)})", base)] if base else []
    if not info.get("training_eval"):  # not re-measured: this draft's figures are the training-time ones too
        return [*columns, (f"this draft ({step}; {during_training(best)})", best)]
    trained = info["training_eval"]
    uploaded = f"as uploaded: merged, re-measured at publish time, {best.get('n_prompts', 'n/a')} prompts"
    return [
        *columns,
        (f"this draft ({step}; {during_training(trained)})", trained),
        (f"this draft ({uploaded})", best),
    ]


def _figures(info: dict) -> list[str]:
    best = info["best"]
    step = f"step {info['best_step']}" if info.get("best_step") is not None else info["checkpoint"]
    engine = engine_of(best)
    lines = [
        "## Measured speedup",
        "",
        f"Target: `{info['target']}`. Measured by {ENGINE_NAMES.get(engine, engine)} on held-out prompts, "
        "warm-up first, methods interleaved prompt by prompt, median of repeats.",
        "",
    ]
    lines += _table(_columns(info, step))
    ppa = best.get("per_position_acceptance") or []
    lines += [
        "",
        f"- per-position acceptance (draft token 1, 2, ...): {', '.join(f'{p:.3f}' for p in ppa) or 'n/a'}",
        f"- temperature: {best['temperature']}; new tokens per prompt: {best['new_tokens']}; "
        f"prompts: {best.get('n_prompts', 'n/a')}; batch size: {best.get('batch_size', 'n/a')}",
        f"- prompts file: {info['prompts']}",
        f"- hardware: {info['hardware']}",
        f"- `generation_config.json` (what HF assisted generation reads): {_assistant_line(info)}",
    ]
    if best.get("draft_vocab_size"):
        lines.append(_draft_vocab_line(info, best["draft_vocab_size"]))
    settings = best.get("hf_assisted_settings")
    if isinstance(settings, dict):
        for which in ("defaults", "published"):
            if isinstance(settings.get(which), dict):
                lines.append(f"- HF assisted generation settings ({which}): `{json.dumps(settings[which])}`")
    lines += [f"- note: {note}" for note in info.get("notes", [])]
    for engine_name, ev in (info.get("engines") or {}).items():
        lines += ["", f"### {ENGINE_NAMES.get(engine_name, engine_name)}", ""]
        version = ev.get("engine_version")
        lines += [
            f"The same draft measured by {engine_name}{f' {version}' if version else ''} "
            f"(temperature {ev.get('temperature')}, {ev.get('new_tokens')} new tokens, "
            f"{ev.get('n_prompts', 'n/a')} prompts, hardware: {ev.get('hardware') or 'not recorded'}):",
            "",
        ]
        lines += _table([("this draft", ev)])
        patches = ev.get("engine_patches") or []
        if patches:
            lines.append(
                f"- {engine_name} {version} computes {', '.join(f'`{p}`' for p in patches)} wrong on this hardware; "
                "draftsmith measured it with the same computation written in torch in its place"
            )
    if info.get("checkpoints"):
        lines += ["", "Evaluations during training:", "", "| step | speedup vs target | acceptance rate | loss |"]
        lines.append("|---|---|---|---|")
        for c in info["checkpoints"]:
            lines.append(
                f"| {c.get('step')} | {_fmt(c.get('speedup'), '{:.2f}x')} | "
                f"{_fmt(c.get('acceptance_rate'), '{:.3f}')} | {_fmt(c.get('loss'), '{:.4f}')} |"
            )
    return lines


def kind_of_card(info: dict) -> ModuleType:
    """The publishing module of the card's draft kind (``decode.kinds.<kind>.publishing``): its facts, its words
    and its launch lines. A card that records no kind is of a plain causal LM."""
    return kinds.publishing(info.get("draft_kind") or kinds.PLAIN_LM)


def _draft_vocab_line(info: dict, size: int) -> str:
    """What the figures drafted from, for the kind and the files uploaded."""
    own = kind_of_card(info).vocab_line(info, size)
    if own is not None:
        return own
    where = "`draft_vocab.json` (in this repo)" if info.get("draft_vocab_file") else "a draft vocabulary"
    return (
        f"- draftsmith's decoder drafted from the {size} tokens of {where} (the target's most frequent; lossless: "
        "the target verifies over its whole vocabulary). The model keeps its full output layer, which HF assisted "
        "generation, vLLM and SGLang use: their drafts cost more per token"
        + _masked_head_text(info.get("masked_head"))
    )


def _masked_head_text(head: dict | None) -> str:
    """The card's words on a head trained over the draft vocabulary alone (decode.draft_vocab.with_masked_head)."""
    if not head:
        return ""
    measured = (
        f"on {head['heldout_positions']} held-out positions it puts {head['outside_mass_mean']:.1e} of the draft's "
        f"probability outside those tokens at temperature 1 (at most {head['outside_mass_max']:.1e} at one position)"
        f" and its greedy token is outside them at {head['argmax_outside']:.2%} of positions"
    )
    close = head["outside_mass_max"] <= MAX_MASS and head["argmax_outside"] == 0
    return (
        "; it was trained over those tokens alone, and its other rows are one row fitted to score far below theirs "
        f"on the draft's hidden states (a Llama head has no bias to hold -inf): {measured}, "
        + (
            "so those engines draft from the same tokens, sampled or greedy"
            if close
            else "so those engines can draft other tokens"
        )
    )


def _shell(word: str) -> str:
    """A command-line word, quoted when it holds what a shell would split or redirect (a placeholder)."""
    return f"'{word}'" if any(c in word for c in " <>") else word


def _assistant_line(info: dict) -> str:
    """What the published generation_config sets for HF assisted generation, and why (the kind says)."""
    return kind_of_card(info).assistant_line(info)


def _speed_claim(best: dict) -> str:
    """The card's first claim: what the draft does for its target's speed, as measured."""
    lossless = "Speculative decoding is lossless: the text is the target's own"
    slower = slower_than_target(best)
    if slower is None:
        return f"{lossless}; the draft only makes it come out faster."
    engine = ENGINE_NAMES.get(engine_of(best), engine_of(best))
    return (
        f"{lossless}. **This draft makes the target slower**: "
        f"{slower:.2f}x target-only decoding, as measured below by {engine}; it accepts too few tokens for what a "
        "draft forward costs on that hardware."
    )


def llamacpp_usage(info: dict, repo_id: str) -> list[str]:
    """The card's llama.cpp section when GGUF files were published (``info["llamacpp"]``, publish --gguf): the
    ``llama-server`` line with the kind's ``--spec-type`` and the K the figures measured best; [] otherwise."""
    gguf = info.get("llamacpp")
    if not gguf or not gguf.get("files"):
        return []
    from decode.llamacpp.export import launch_line

    k = int(info.get("num_assistant_tokens") or 1)
    if info.get("block_size"):  # a block draft drafts at most its block per forward
        k = min(k, int(info["block_size"]))
    first = gguf["files"][0]
    files = ", ".join(f"`{f}`" for f in gguf["files"])
    return [
        "## llama.cpp",
        "",
        f"This repo has the draft as GGUF ({files}) for llama.cpp's `llama-server`, next to a GGUF of "
        f"{info['target']} (any quantization of it):",
        "",
        "```bash",
        f"hf download {repo_id} {first} --local-dir .",
        launch_line(gguf["spec_type"], k, target="TARGET.gguf", draft=first),
        "```",
        "",
        f"`--spec-draft-n-max {k}`: the draft tokens per round the figures above were measured with.",
        "",
    ]


def render_model_card(info: dict, repo_id: str, recipe_text: str | None = None) -> str:
    """README.md for the published draft, rendered from `info` (the content of draftsmith_eval.json)."""
    best, target = info["best"], info["target"]
    kind = kind_of_card(info)
    lines = [
        f"# {repo_id.split('/')[-1]}",
        "",
        f"A draft model for speculative decoding with **{target}** as the target, {kind.made(info)}. "
        + _speed_claim(best),
        "",
    ]
    lines += _figures(info)
    lines += [""] + kind.usage(info, repo_id)
    lines += llamacpp_usage(info, repo_id)
    supply = info.get("reproduce_inputs") or {}
    prompts_file = info["prompts"] if str(info["prompts"]).endswith(".jsonl") else "PROMPTS.jsonl"
    prompts_file = supply.get("data.eval_prompts", prompts_file)
    bench_target = supply.get("target.model", target)
    lines += [
        "## Reproduce",
        "",
        "Train with the recipe below (also in this repo as `resolved_recipe.yaml`) from a draftsmith checkout, "
        "and measure:",
        "",
        "```bash",
        "accelerate launch train/distill.py --recipe resolved_recipe.yaml",
        f"python -m decode bench --target {_shell(bench_target)} --draft {repo_id} --prompts {_shell(prompts_file)} "
        f"--num-draft-tokens {best['num_draft_tokens']} --temperature {best['temperature']} "
        f"--max-new-tokens {best['new_tokens']}",
        "```",
        "",
    ]
    if supply:
        keys = ", ".join(f"`{k}`" for k in supply)
        lines += [
            f"The run read {keys} from files of its own machine: replace each `<your copy of NAME>` with the path "
            "of your copy of that file (or the model's Hub id).",
            "",
        ]
    if recipe_text:
        lines += ["Recipe:", "", "```yaml", recipe_text.rstrip(), "```", ""]
    else:
        lines += ["The recipe was not found beside the checkpoint.", ""]
    lines += ["The figures above are in `draftsmith_eval.json` in this repo, machine-readable.", ""]
    content = f"---\n{card_data(info, repo_id).to_yaml()}\n---\n\n" + "\n".join(lines)
    return str(ModelCard(content))
