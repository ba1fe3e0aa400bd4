"""Publish a distilled draft: merge LoRA, match the target's vocabulary, write a model card, push to the Hub.

The published folder is a plain Transformers repo that HF assisted generation (`assistant_model=`), vLLM
(`method: draft_model`) and SGLang (`STANDALONE`) take unchanged:

    model.safetensors (+ config.json)   merged weights; vocab_size equal to the target's (rows padded if needed)
    tokenizer files                     the target's, so both models tokenize identically
    generation_config.json              HF assisted settings: the measured gamma, or HF's defaults if faster
    README.md                           model card: measured figures per engine, hardware, prompts, recipe, usage
    draftsmith_eval.json                the same figures, machine-readable (the card is rendered from it)
    resolved_recipe.yaml                the recipe that trained the draft

No uploaded text names a path of this machine: a Hub id stays, a local path becomes its base name.
The figures describe the uploaded weights: a QLoRA checkpoint (measured on a 4-bit base with unmerged adapters)
is re-measured on the merged folder before the upload, unless `remeasure=False` (then the card says so).

`build_publish_folder` does everything but the upload; `push_folder` uploads; `publish` is both (or a dry
run). Every user-facing failure is a `PublishError` whose message is one line. The pieces live beside it in
distill.publishing: publish_source (what to publish, name checks, path scrubbing), draft_folder (weights, vocab,
tokenizer), card (README.md) and hub (the Hub).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decode import kinds
from decode.compat import match_vocab
from decode.draft_vocab import FILE as DRAFT_VOCAB
from decode.draft_vocab import load_saved_head
from decode.metrics import best_gamma
from distill.publishing.card import engine_of, render_model_card, slower_than_target
from distill.publishing.draft_folder import (
    assistant_settings,
    copy_tokenizer,
    declared_dtype,
    generation_config_for,
    load_merged_draft,
    recipe_get,
)
from distill.publishing.hub import (
    OFFLINE_MSG,
    PublishError,
    check_hub_access,
    first_line,
    hub_offline,
    is_hub_id,
    upload_folder,
)
from distill.publishing.publish_source import (
    PublishSource,
    check_name_words,
    check_plain_draft_config,
    check_repo_id,
    copied_as_saved,
    public_name,
    read_json,
    reproducible_recipe,
    resolve_source,
    scrub,
    scrub_text,
    served_kind,
)

__all__ = [
    "OFFLINE_MSG",
    "PublishError",
    "best_gamma",
    "build_publish_folder",
    "check_hub_access",
    "hub_offline",
    "match_vocab",
    "publish",
    "push_folder",
    "render_model_card",
]

log = logging.getLogger("draftsmith.publish")

REMEASURE_PROMPTS = 8  # eval prompts used to re-measure a merged QLoRA draft: the figure, not a full eval


# ---------------------------------------------------------------- which figures describe the upload


def local_hardware() -> str:
    """What this machine has (used only when the eval figures do not record their hardware)."""
    import torch

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return f"{n} x {torch.cuda.get_device_name(0)}" if n > 1 else torch.cuda.get_device_name(0)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {cpu}, {os.cpu_count()} cores"


def training_measured_on(src: PublishSource) -> str | None:
    """What training measured the draft as, where that is not the weights that are uploaded; None when it is.

    The upload is always dense merged weights. Training measures a LoRA draft merged (the same weights), but a
    QLoRA draft on its quantized base with the adapters unmerged: other weights, other speed.
    """
    quant = recipe_get(src.recipe, "draft.quantization") or {}
    if isinstance(quant, dict) and (quant.get("load_in_4bit") or quant.get("load_in_8bit")):
        bits = "4-bit" if quant.get("load_in_4bit") else "8-bit"
        return f"the {bits} base with unmerged LoRA adapters (QLoRA)"
    return None


def eval_not_on_upload(src: PublishSource) -> str | None:
    """Why the checkpoint's eval was not measured on the weights that are uploaded, or None when it was."""
    measured_on = training_measured_on(src)
    return f"was measured on {measured_on}" if measured_on else None


def _eval_prompts(recipe_path: Path, limit: int) -> list[dict]:
    """The first `limit` eval prompts of the run's resolved recipe (as train/distill.py chose them)."""
    from distill.config import load_recipe
    from distill.data.prompts import load_rows, load_train_eval

    cfg = load_recipe(recipe_path).data
    if cfg.eval_prompts:
        rows = load_rows(cfg.eval_prompts, key="data.eval_prompts", prompt_field=cfg.prompt_field)
    else:
        rows = load_train_eval(cfg)[1]
    return rows[:limit]


def _cannot_remeasure(reason: str, why: str) -> PublishError:
    return PublishError(
        f"the checkpoint's eval {reason}, so publish re-measures the merged draft, but {why}: fix that, or pass "
        "--no-remeasure to publish the training-time figures with a note saying they are not the upload's"
    )


def remeasure_prompts(src: PublishSource, reason: str, n_prompts: int) -> list[dict]:
    """The eval prompts a re-measurement uses (checked before the build); a one-line PublishError when none."""
    if src.recipe_path is None:
        raise _cannot_remeasure(reason, "no resolved_recipe.yaml was found beside the checkpoint")
    try:
        prompts = _eval_prompts(src.recipe_path, n_prompts)
    except (OSError, ValueError) as e:
        raise _cannot_remeasure(reason, f"its eval prompts could not be loaded ({first_line(e)})") from None
    if not prompts:
        raise _cannot_remeasure(reason, "the recipe's eval prompts are empty")
    return prompts


def remeasure(
    folder: Path, src: PublishSource, repo_id: str, reason: str, prompts: list[dict], trust_remote_code: bool = False
) -> dict:
    """The bench JSON of the built folder's weights, measured by draftsmith's decoder on the run's eval prompts.

    Uses the recipe's eval settings (new tokens, temperature, gamma, batch size, repeats) with the target as the
    recipe loads it, except its trust_remote_code: ``trust_remote_code`` (the command line's) decides whether
    shipped code runs. A one-line PublishError when the target cannot be loaded.
    """
    import dataclasses

    from transformers import AutoModelForCausalLM

    from decode.draft_vocab import load_ids
    from distill import models
    from distill.config import load_recipe
    from distill.training.engines import bench_by_recipe

    recipe = load_recipe(src.recipe_path)
    target_cfg = dataclasses.replace(recipe.target, trust_remote_code=trust_remote_code)
    try:
        target = models.load_target(target_cfg)
        tokenizer = models.load_tokenizer(recipe.target.model, target_cfg)
    except (OSError, ValueError) as e:
        raise _cannot_remeasure(reason, f"the target could not be loaded ({first_line(e)})") from None
    device = next(target.parameters()).device
    draft = AutoModelForCausalLM.from_pretrained(folder, dtype="auto", trust_remote_code=trust_remote_code)
    draft = draft.to(device).eval()
    ev = recipe.eval
    log.warning(f"re-measuring the merged draft on {len(prompts)} eval prompts: the checkpoint's eval {reason}")
    result = bench_by_recipe(
        target,
        draft,
        tokenizer,
        prompts,
        recipe,
        draft_name=repo_id,
        num_draft_tokens=src.eval.get("num_draft_tokens", ev.num_draft_tokens),  # the gamma the card publishes
        progress=False,
        draft_vocab=load_ids(folder),  # the run's draft vocabulary, copied beside the weights
    )
    result.setdefault("engine", "draftsmith")
    result["hardware"] = local_hardware()
    result["prompts"] = src.eval.get("prompts") or _prompts_name(src)
    return result


# ---------------------------------------------------------------- build, push, publish


def _describe_method(recipe: dict, lora: bool) -> str:
    loss = recipe_get(recipe, "distill.loss")
    source = recipe_get(recipe, "distill.source")
    quant = recipe_get(recipe, "draft.quantization") or {}
    q = isinstance(quant, dict) and (quant.get("load_in_4bit") or quant.get("load_in_8bit"))
    kind = "QLoRA" if q else "LoRA"
    how = f"{kind} r={recipe_get(recipe, 'draft.lora.r', '?')}, merged" if lora else "full fine-tune"
    if recipe_get(recipe, "draft.init") == "truncate":
        how = f"the target cut to its first {recipe_get(recipe, 'draft.init_layers', '?')} layers, {how}"
    return f"{loss} distillation on {source} sequences, {how}" if loss else how


def _prompts_name(src: PublishSource) -> str:
    if src.eval.get("prompts"):
        return public_name(str(src.eval["prompts"]), "local prompt file")
    eval_prompts = recipe_get(src.recipe, "data.eval_prompts")
    if eval_prompts:
        return public_name(eval_prompts, "local prompt file")
    train = recipe_get(src.recipe, "data.train_prompts")
    if train:
        train = public_name(train, "local prompt file")
        return f"held-out {recipe_get(src.recipe, 'data.eval_split', 0.05)} of {train} (from the recipe)"
    return "not recorded"


def _datasets(recipe: dict) -> list[str]:
    """The Hub datasets the draft was trained / measured on (local prompt files are not Hub datasets)."""
    names = [recipe_get(recipe, "data.train_prompts"), recipe_get(recipe, "data.eval_prompts")]
    return list(dict.fromkeys(n for n in names if n and is_hub_id(n) and not n.endswith((".jsonl", ".json"))))


def _license(base_id: str | None) -> str | None:
    """The base draft's license, from its model card when it is local or in the Hub cache (no download)."""
    if not base_id:
        return None
    readme: Any = Path(base_id) / "README.md"
    if not readme.is_file() and is_hub_id(base_id):
        from huggingface_hub import try_to_load_from_cache

        readme = try_to_load_from_cache(base_id, "README.md")
    if not isinstance(readme, str | Path) or not Path(readme).is_file():
        return None
    from huggingface_hub import ModelCard

    try:
        return ModelCard.load(readme).data.license
    except Exception:  # noqa: BLE001 - a malformed card: no license rather than no publish
        return None


HALF = ("bfloat16", "float16")


def publish_dtype(ev: dict, base_dtype: str | None) -> tuple[str | None, str]:
    """The half-precision dtype a float32 draft is published in, and why; None: keep float32.

    The dtype its figures were measured in (the bench JSON's `draft_dtype`: training measures a float32 draft in
    its bf16/fp16 target's dtype), else the dtype its base model declares (a cut draft's base is the target)."""
    measured = ev.get("draft_dtype")
    if measured in HALF:
        return measured, "the dtype its figures were measured in (the target's)"
    if base_dtype in HALF:
        return base_dtype, "the dtype of the base draft"
    return None, ""


def warn_if_slower(info: dict) -> None:
    """Say at publish time that the draft makes its target slower; the card says it too (distill.publishing.card)."""
    speedup = slower_than_target(info["best"])
    if speedup is not None:
        log.warning(
            f"the draft makes its target slower ({speedup:.2f}x target-only decoding, as measured): the card says "
            "so; train it longer, or publish a better checkpoint"
        )


def _check_empty_dest(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise PublishError(f"{out_dir} exists and is not empty: choose a new --dry-run directory")


@dataclass
class BuildOptions:
    """How the folder is built: re-measure when the eval was not on the uploaded weights, the card's license, the
    target an EAGLE-3 head names for ``vllm serve`` with no flags."""

    remeasure: bool = True
    remeasure_prompts: int = REMEASURE_PROMPTS
    license: str | None = None
    verifier: str | None = None  # an EAGLE-3 head's speculators verifier (default: the target's Hub id)
    # run the Python a model ships (auto_map): the command line's choice, never the recipe's or the folder's
    trust_remote_code: bool = False
    gguf: tuple[str, ...] = ()  # --gguf: draft-<type>.gguf for llama.cpp written into the folder
    llama_cpp: str | None = None  # --llama-cpp: where llama.cpp and its converter are
    gguf_plan: Any = None  # decode.llamacpp.export.Plan, made by check_gguf before anything is written


def loaded_models(src: PublishSource) -> list[tuple[str, str, str | None]]:
    """(what, name, revision) of every model that publishing ``src`` loads through transformers: the target, and a
    plain or PARD draft with the bases it derives from (a head or a DFlash draft is copied as saved, never loaded)."""
    recipe = src.recipe
    target = recipe_get(recipe, "target.model") or src.eval.get("target")
    found = [("the target", str(target), recipe_get(recipe, "target.revision"))] if target else []
    if copied_as_saved(src.model_dir):
        return found
    found.append(("the draft", str(src.model_dir), None))
    adapter = src.model_dir / "adapter_config.json"
    base = read_json(adapter).get("base_model_name_or_path") if adapter.is_file() else None
    for name in dict.fromkeys(n for n in (base, recipe_get(recipe, "draft.model")) if n):
        found.append(("the draft's base", str(name), None))
    return found


def check_remote_code(src: PublishSource, trusted: bool) -> None:
    """A model publishing would load ships Python code (auto_map) and the command line did not pass
    --trust-remote-code: one PublishError line, before anything is written. A recipe saying trust_remote_code
    never runs code alone: the folder being published may come from anyone."""
    from decode.sources import check_remote_code as check_one

    for what, name, revision in loaded_models(src):
        try:
            check_one(name, what, trusted, revision)
        except ValueError as e:
            raise PublishError(str(e)) from None


def check_gguf(src: PublishSource, options: BuildOptions) -> None:
    """--gguf: every check of the export (the draft's kind served by llama.cpp, the target's HF folder, llama.cpp,
    its converter and ``--spec-type``) before anything is written; the plan kept in ``options.gguf_plan``."""
    if not options.gguf:
        return
    from decode.llamacpp import export

    target = recipe_get(src.recipe, "target.model") or src.eval.get("target")
    try:
        options.gguf_plan = export.plan(
            served_kind(src.model_dir),
            target,
            options.gguf,
            options.llama_cpp,
            recipe_get(src.recipe, "target.revision"),
        )
    except ValueError as e:
        raise PublishError(f"--gguf: {e}") from None


def _write_gguf(dest: Path, options: BuildOptions, info: dict) -> None:
    """The folder's draft as draft-<type>.gguf beside it (--gguf), and what the card says of them."""
    if options.gguf_plan is None:
        return
    from distill.publishing import gguf

    try:
        gguf.write(dest, options.gguf_plan)
    except ValueError as e:
        raise PublishError(f"--gguf: {e}") from None
    info["llamacpp"] = gguf.card_info(options.gguf_plan)


def build_publish_folder(
    source: str | Path, out_dir: str | Path, repo_id: str, options: BuildOptions | None = None
) -> Path:
    """Write everything that would be uploaded for `repo_id` into `out_dir` (atomically); return out_dir.

    `source` is a run directory (best/ + report.json) or a checkpoint directory (with eval.json).
    `out_dir` must not exist or be empty; it appears only when complete.
    """
    check_repo_id(repo_id, names=False)
    src = resolve_source(source)
    _check_names(src, repo_id)
    options = options or BuildOptions()
    check_remote_code(src, options.trust_remote_code)
    check_gguf(src, options)
    return _build_atomic(src, Path(out_dir), repo_id, options)


def _check_names(src: PublishSource, repo_id: str, dry_run_dir: str | Path | None = None) -> None:
    """vLLM picks the method by name only for a plain draft (method draft_model); a draft built from the target
    (a head, a DFlash or DSpark draft) is served with its own method named."""
    if copied_as_saved(src.model_dir):
        return
    check_name_words(repo_id, "repo id")
    if dry_run_dir is not None:
        check_name_words(str(Path(dry_run_dir).resolve()), "dry-run path")


def _build_atomic(src: PublishSource, out_dir: Path, repo_id: str, options: BuildOptions) -> Path:
    _check_empty_dest(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out_dir.name}-", dir=out_dir.parent))
    try:
        _build_into(src, tmp, repo_id, options)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _target_vocab(target: str, revision: str | None, trust: bool, notes: list[str]) -> int | None:
    """The target's vocab_size from its config only (never its weights); None (with a note) when unreadable."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(target, revision=revision, trust_remote_code=trust)
        return config.get_text_config().vocab_size
    except Exception as e:  # noqa: BLE001 - offline / gated / unknown architecture: keep the draft's vocab
        notes.append(
            f"the target's config ({public_name(target)}) could not be loaded, so vocab_size is the draft's, "
            "unchecked (vLLM needs it equal to the target's)"
        )
        log.warning(f"{notes[-1]} ({first_line(e)})")
        return None


def _build_into(src: PublishSource, dest: Path, repo_id: str, options: BuildOptions) -> None:
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    notes: list[str] = []
    recipe = src.recipe
    if src.recipe_path is None:
        notes.append("no resolved_recipe.yaml found beside the checkpoint; target and draft taken from eval.json")
        log.warning(notes[-1])
    target = recipe_get(recipe, "target.model") or src.eval.get("target")
    if not target:
        raise PublishError("the target model is unknown: no recipe and no 'target' in the eval figures")
    t_rev = recipe_get(recipe, "target.revision")
    trust = options.trust_remote_code
    if copied_as_saved(src.model_dir):
        return _build_served_into(src, dest, repo_id, options, target, trust, notes)

    reason = eval_not_on_upload(src)
    prompts = remeasure_prompts(src, reason, options.remeasure_prompts) if reason and options.remeasure else None
    model, base_id = load_merged_draft(src, trust)
    check_plain_draft_config(model.config.to_dict())
    if recipe_get(recipe, "draft.init") == "truncate":  # cut from the target: the target is what it derives from
        base_id = target
    dtype, why = publish_dtype(src.eval, declared_dtype(base_id, trust))
    if model.dtype == torch.float32 and dtype is not None:
        # A fully fine-tuned draft trains in fp32 master weights; publish it in the dtype it was measured in, or
        # the one it came in (half the size).
        model.to(getattr(torch, dtype))
        notes.append(f"weights cast from float32 to {dtype}, {why}")
    lora = (src.model_dir / "adapter_config.json").is_file() or bool(recipe_get(recipe, "draft.lora.enabled"))

    target_vocab = _target_vocab(target, t_rev, trust, notes)
    old_vocab = model.get_input_embeddings().weight.shape[0]
    if target_vocab is not None and target_vocab != old_vocab:
        match_vocab(model, target_vocab)
        what = "padded" if target_vocab > old_vocab else "truncated"
        notes.append(f"draft vocabulary {what} from {old_vocab} to the target's {target_vocab} rows")
        log.warning(notes[-1])
    vocab = model.get_input_embeddings().weight.shape[0]
    config_vocab = model.config.get_text_config().vocab_size
    if target_vocab is not None and config_vocab != target_vocab:  # vLLM refuses a draft of another vocab_size
        raise PublishError(f"the draft's config says vocab_size {config_vocab}, the target's {target_vocab}")

    try:
        target_gen = GenerationConfig.from_pretrained(target, revision=t_rev)
    except Exception:  # noqa: BLE001 - many repos have no generation_config.json; the draft's tokens are kept
        target_gen = None
    gamma = best_gamma(src.eval)
    assistant, assistant_why = assistant_settings(src.eval, gamma)
    model.generation_config = generation_config_for(model, target_gen, assistant)
    model.save_pretrained(dest)
    del model
    kind = served_kind(dest)  # as saved: a PARD draft's config keeps its mask token and block
    facts = kinds.publishing(kind).facts(dest, None, gamma, notes)
    draft_vocab_file = (src.model_dir / DRAFT_VOCAB).is_file()
    if draft_vocab_file:  # draftsmith's decoder reads it; HF, vLLM and SGLang ignore it
        shutil.copy2(src.model_dir / DRAFT_VOCAB, dest / DRAFT_VOCAB)
    tokenizer_from = copy_tokenizer(target, src, dest, trust, notes)
    n_tokens = len(AutoTokenizer.from_pretrained(dest, trust_remote_code=trust))
    if n_tokens > vocab:
        raise PublishError(f"the tokenizer has {n_tokens} tokens but the draft only {vocab} embedding rows")

    best, training_eval = src.eval, None
    if reason and prompts:
        training_eval = src.eval
        best = remeasure(dest, src, repo_id, reason, prompts, trust)
        notes.append(
            f"figures re-measured at publish time on the uploaded merged weights ({best['n_prompts']} eval "
            f"prompts): the training-time eval {reason} (kept in draftsmith_eval.json as training_eval)"
        )
    elif reason:
        notes.append(f"the figures below {reason}, not on the uploaded merged weights (not re-measured)")
        log.warning(notes[-1])

    hardware = best.get("hardware")
    if not hardware:
        hardware = f"{local_hardware()} (recorded at publish time; the eval did not record its hardware)"
    if not is_hub_id(target):
        notes.append(f"the target is a local model ({public_name(target)}): put its Hub id in the commands below")
    base_name = public_name(base_id) or "unknown"
    license_ = options.license or _license(base_id)
    if not license_:
        log.warning("no license found for the base draft: the card states none (pass --license)")
    info = {
        "repo_id": repo_id,
        "draft_kind": kind,
        "block_size": facts["block_size"],  # a block draft: the tokens it drafts in one forward (parallel_drafting)
        "target": public_name(target),
        "base_model": base_name,
        "base_model_hub_id": base_id if is_hub_id(base_id) else None,
        "checkpoint": src.label,
        "best_step": src.step,
        "method": _describe_method(recipe, lora),
        # trained over its draft vocabulary: what its saved head puts outside it (draft_vocab.with_masked_head)
        "masked_head": load_saved_head(src.model_dir)
        if recipe_get(recipe, "distill.loss_vocab") == "subset"
        else None,
        "draft_vocab_file": draft_vocab_file,  # draft_vocab.json is uploaded beside the weights
        "num_assistant_tokens": gamma,
        "vllm_draft_sample_method": recipe_get(recipe, "eval.vllm_draft_sample_method"),
        "generation_config": {"assistant": assistant, "why": assistant_why},
        "hardware": hardware,
        "prompts": _prompts_name(src),
        "license": license_,
        "datasets": _datasets(recipe),
        "vocab_size": {"draft": old_vocab, "target": target_vocab, "published": vocab},
        "tokenizer_from": tokenizer_from,
        "measured_on_uploaded_weights": reason is None or training_eval is not None,
        # what the training-time evals (base, checkpoints, training_eval) ran on, when not the uploaded weights
        "training_measured_on": training_measured_on(src),
        "notes": notes,
        "best": best,
        "engines": {k: v for k, v in src.engines.items() if k != engine_of(best)},
        "base": (src.report or {}).get("base"),
        "checkpoints": (src.report or {}).get("checkpoints", []),
    }
    if training_eval is not None:
        info["training_eval"] = training_eval
    if not is_hub_id(base_id):
        log.warning(f"draft base {base_name!r} is not a Hub id: the card omits base_model")
    _write_gguf(dest, options, info)
    _write_card_files(src, dest, repo_id, info)


def _write_card_files(src: PublishSource, dest: Path, repo_id: str, info: dict) -> None:
    """The scrubbed figures (draftsmith_eval.json), the resolved recipe as it reruns elsewhere
    (:func:`distill.publishing.publish_source.reproducible_recipe`) and the model card (README.md)."""
    import yaml

    warn_if_slower(info)
    recipe_text = None
    if src.recipe_path:
        recipe, info["reproduce_inputs"] = reproducible_recipe(src.recipe)
        recipe_text = scrub_text(yaml.safe_dump(recipe, sort_keys=False))
    info = scrub(info)
    if recipe_text:
        (dest / "resolved_recipe.yaml").write_text(recipe_text)
    (dest / "draftsmith_eval.json").write_text(json.dumps(info, indent=2) + "\n")
    (dest / "README.md").write_text(render_model_card(info, repo_id, recipe_text))


def _copy_draft_files(
    src: PublishSource, dest: Path, files: tuple[str, ...], target: str, trust: bool, notes: list[str]
) -> str:
    """A draft over the target's hidden states as its engines load it: ``files`` (its config.json and weights) as
    saved (no merge, no vocabulary change) and the target's tokenizer files. Returns where the tokenizer came from."""
    for name in files:
        shutil.copy2(src.model_dir / name, dest / name)
    tokenizer_from = copy_tokenizer(target, src, dest, trust, notes)
    if not is_hub_id(target):
        notes.append(f"the target is a local model ({public_name(target)}): put its Hub id in the commands below")
    return tokenizer_from


def _hidden_state_info(
    src: PublishSource,
    repo_id: str,
    options: BuildOptions,
    target: str,
    tokenizer_from: str,
    notes: list[str],
    **kind: object,
) -> dict:
    """The card's facts for a draft built from the target (a head, a DFlash or DSpark draft); ``kind``: draft_kind,
    block_size, verifier, method, num_assistant_tokens."""  # fmt: skip
    return {
        "repo_id": repo_id,
        "target": public_name(target),
        "vllm_draft_sample_method": recipe_get(src.recipe, "eval.vllm_draft_sample_method"),
        "base_model": public_name(target),  # built from the target: its embedding (and output rows) shared or copied
        "base_model_hub_id": target if is_hub_id(target) else None,
        "checkpoint": src.label,
        "best_step": src.step,
        **kind,
        "generation_config": None,
        "hardware": src.eval.get("hardware") or f"{local_hardware()} (recorded at publish time)",
        "prompts": _prompts_name(src),
        "license": options.license or _license(target),
        "datasets": _datasets(src.recipe),
        "tokenizer_from": tokenizer_from,
        "measured_on_uploaded_weights": True,
        "notes": notes,
        "best": src.eval,
        "engines": {k: v for k, v in src.engines.items() if k != engine_of(src.eval)},
        "base": None,
        "checkpoints": (src.report or {}).get("checkpoints", []),
    }


def _build_served_into(
    src: PublishSource, dest: Path, repo_id: str, options: BuildOptions, target: str, trust: bool, notes: list[str]
) -> None:
    """A draft built from the target as its engines load it: the files its kind serves as saved (no merge, no
    vocabulary change; ``decode.kinds.<kind>.publishing``), the target's tokenizer files, the card and recipe. The
    kind rewrites what its config.json names for its engines (a head's speculators verifier: ``options.verifier``,
    else the target's Hub id)."""
    kind = served_kind(src.model_dir)
    publishing = kinds.publishing(kind)
    gamma = best_gamma(src.eval)
    verifier = options.verifier or (target if is_hub_id(target) else None)
    tokenizer_from = _copy_draft_files(src, dest, publishing.SERVED_FILES, target, trust, notes)
    facts = publishing.facts(dest, verifier, gamma, notes)
    info = _hidden_state_info(
        src, repo_id, options, target, tokenizer_from, notes,
        draft_kind=kind,
        **facts,  # block_size (the tokens it drafts in one forward), verifier (what config.json names), method
        num_assistant_tokens=gamma,  # the gamma the figures were measured with (vLLM / SGLang num steps)
    )  # fmt: skip
    _write_gguf(dest, options, info)
    _write_card_files(src, dest, repo_id, info)


def push_folder(
    folder: str | Path,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
) -> str:
    """Upload a built folder to `repo_id` (created if needed; `revision` is a branch, created if needed).

    Checks offline mode and the login (`whoami`) first; every Hub failure becomes a one-line PublishError.
    Returns the repo URL.
    """
    check_repo_id(repo_id)
    check_hub_access()
    return upload_folder(Path(folder), repo_id, private, revision, commit_message)


def publish(
    source: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    dry_run_dir: str | Path | None = None,
    commit_message: str | None = None,
    remeasure: bool = True,
    license: str | None = None,
    verifier: str | None = None,
    trust_remote_code: bool = False,
    gguf: tuple[str, ...] = (),
    llama_cpp: str | None = None,
) -> str:
    """Build the publish folder from a run or checkpoint dir and upload it; or, with `dry_run_dir`, only write it.

    `remeasure=False` publishes a QLoRA checkpoint's training-time figures (with a note) instead of re-measuring
    the merged draft. `license` is the card's license id (default: the base draft's, when its card is readable).
    `verifier`: the target an EAGLE-3 head's config.json names for vLLM (default: the target's Hub id).
    `trust_remote_code`: run the Python a model ships (auto_map in its config.json); without it such a model is
    refused (:func:`check_remote_code`), whatever the run's recipe says. `gguf`: llama.cpp GGUF types written into
    the folder as draft-<type>.gguf (:func:`check_gguf`), with llama.cpp from `llama_cpp`. Returns the repo URL, or
    the dry-run folder's path. A bad source, a model that ships code unasked, an offline Hub or a missing login fail
    before the (slow) build and before anything is uploaded.
    """
    check_repo_id(repo_id, names=False)
    options = BuildOptions(
        remeasure, license=license, verifier=verifier, trust_remote_code=trust_remote_code, gguf=tuple(gguf),
        llama_cpp=llama_cpp,
    )  # fmt: skip
    src = resolve_source(source)
    _check_names(src, repo_id, dry_run_dir)
    check_remote_code(src, trust_remote_code)
    check_gguf(src, options)
    if dry_run_dir is not None:
        return str(_build_atomic(src, Path(dry_run_dir), repo_id, options))
    check_hub_access()
    with tempfile.TemporaryDirectory(prefix="draftsmith-publish-") as tmp:
        folder = _build_atomic(src, Path(tmp) / repo_id.split("/")[-1], repo_id, options)
        return upload_folder(folder, repo_id, private, revision, commit_message)
