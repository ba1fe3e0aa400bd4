"""The draft's files in a publish folder: merged weights, the target's vocabulary size, generation config, tokenizer.

Used by distill.publishing.publish; each function works on a loaded model or a folder and knows nothing of the Hub.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from distill.publishing.hub import PublishError, first_line
from distill.publishing.publish_source import PublishSource, read_json

log = logging.getLogger("draftsmith.publish")

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def recipe_get(recipe: dict, dotted: str, default: Any = None) -> Any:
    """recipe["a"]["b"] for "a.b"; `default` when missing or empty."""
    node: Any = recipe
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return default if node in (None, "") else node


def load_merged_draft(src: PublishSource, trust_remote_code: bool = False):
    """The draft as a plain transformers model: a LoRA adapter is merged into its base (in fp32, then cast back).
    ``trust_remote_code`` (the command line's, never the recipe's) runs the Python the draft or its base ships.

    Returns (model, base_id): base_id is the model the draft was fine-tuned from.
    """
    import torch
    from transformers import AutoModelForCausalLM

    trust = trust_remote_code
    adapter_file = src.model_dir / "adapter_config.json"
    if not adapter_file.is_file():
        model = AutoModelForCausalLM.from_pretrained(src.model_dir, dtype="auto", trust_remote_code=trust)
        return model, recipe_get(src.recipe, "draft.model") or src.eval.get("draft")
    from peft import PeftModel

    adapter = read_json(adapter_file)
    base_id = adapter.get("base_model_name_or_path") or recipe_get(src.recipe, "draft.model")
    if not base_id:
        raise PublishError(f"{adapter_file} names no base model and no recipe was found: cannot merge the LoRA")
    revision = recipe_get(src.recipe, "draft.revision") if base_id == recipe_get(src.recipe, "draft.model") else None
    try:
        base = AutoModelForCausalLM.from_pretrained(base_id, dtype="auto", revision=revision, trust_remote_code=trust)
    except OSError as e:
        raise PublishError(f"cannot load the LoRA's base model {base_id!r}: {first_line(e)}") from None
    dtype = base.dtype
    # Merge in fp32: W + (alpha / r) * B @ A rounded once, not at every bf16 step.
    merged = PeftModel.from_pretrained(base.to(torch.float32), src.model_dir).merge_and_unload()
    return merged.to(dtype), base_id


def declared_dtype(model_id: str | None, trust_remote_code: bool = False) -> str | None:
    """The dtype a model's config.json declares ('bfloat16', ...), or None when its config cannot be read."""
    if not model_id:
        return None
    from transformers import AutoConfig

    try:
        dtype = getattr(AutoConfig.from_pretrained(model_id, trust_remote_code=trust_remote_code), "dtype", None)
    except Exception:  # noqa: BLE001 - offline / gated: keep the weights as they are
        return None
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def generation_config_for(model, target_gen, assistant: dict):
    """The draft's generation config with the target's special tokens and the HF assisted generation settings
    `assistant` (from :func:`assistant_settings`)."""
    gen = model.generation_config
    if target_gen is not None:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(target_gen, key, None) is not None:
                setattr(gen, key, getattr(target_gen, key))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(gen, key, None) is None and getattr(model.config, key, None) is not None:
            setattr(gen, key, getattr(model.config, key))
    # HF assisted generation reads these from the assistant's generation config: set all three, so no default
    # (gamma 20, confidence threshold 0.4) runs unless it is what was measured fastest
    for key in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold"):
        setattr(gen, key, assistant[key])
    gen._from_model_config = False  # edited on purpose: transformers must not regenerate it from config.json
    return gen


def assistant_settings(ev: dict, gamma: int) -> tuple[dict, str]:
    """The HF assisted generation settings the published generation_config carries, and the reason in words.

    The eval times HF assisted generation twice on the same prompts: with the measured gamma (constant, no early
    stop) and with transformers' defaults (20 tokens, confidence threshold 0.4). The faster one is published: the
    measured gamma for a draft that accepts well, the defaults for one that accepts little (their threshold ends a
    draft the draft is unsure of). Without HF figures: the defaults where the eval drafted adaptively ('auto', which
    also ends a draft where the draft is unsure; a constant gamma would publish a setting nothing measured), else
    the measured gamma.
    """
    from decode.bench import HF_ASSISTED_DEFAULTS, published_assistant_settings

    recorded = ev.get("hf_assisted_settings") or {}
    measured = {**published_assistant_settings(gamma), **(recorded.get("published") or {})}
    defaults = {**HF_ASSISTED_DEFAULTS, **(recorded.get("defaults") or {})}
    tps = ev.get("tokens_per_s") or {}
    fixed_tps, default_tps = tps.get("hf_assisted_published"), tps.get("hf_assisted")
    named_defaults = (
        f"transformers' defaults ({defaults['num_assistant_tokens']} tokens, confidence threshold "
        f"{defaults['assistant_confidence_threshold']})"
    )
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (fixed_tps, default_tps)):
        if ev.get("num_draft_tokens") == "auto":
            return defaults, (
                f"{named_defaults}: the eval drafted with an adaptive length ('auto') and did not time HF; HF's "
                "confidence threshold is its adaptive length"
            )
        return measured, f"the measured γ ({measured['num_assistant_tokens']}), constant, no early stop"
    fixed = f"{fixed_tps:.1f} tokens/s with γ {measured['num_assistant_tokens']} constant"
    default = f"{default_tps:.1f} with transformers' defaults"
    if default_tps > fixed_tps:
        return defaults, f"{named_defaults}, the faster HF setting in the eval: {default} against {fixed}"
    return measured, (
        f"the measured γ ({measured['num_assistant_tokens']}), constant, no early stop, the faster HF setting in the "
        f"eval: {fixed} against {default}"
    )


def copy_tokenizer(target: str, src: PublishSource, dest: Path, trust: bool, notes: list[str]) -> str:
    """The target's tokenizer files into dest; falls back to the draft's (with a note). Returns "target" or "draft"."""
    if Path(target).is_dir() and any((Path(target) / f).is_file() for f in TOKENIZER_FILES):
        for f in TOKENIZER_FILES:
            if (Path(target) / f).is_file():
                shutil.copy2(Path(target) / f, dest / f)
        return "target"
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(target, trust_remote_code=trust).save_pretrained(dest)
        return "target"
    except Exception as e:  # noqa: BLE001 - offline, gated, missing: all mean "fall back to the draft's"
        reason = first_line(e)
    for d in (src.model_dir, src.model_dir.parent, src.model_dir.parent.parent):
        if any((d / f).is_file() for f in TOKENIZER_FILES[:2]):
            for f in TOKENIZER_FILES:
                if (d / f).is_file():
                    shutil.copy2(d / f, dest / f)
            notes.append(f"tokenizer files copied from the draft: the target's ({target}) could not be loaded")
            log.warning(f"{notes[-1]} ({reason})")
            return "draft"
    raise PublishError(f"no tokenizer: the target's ({target}) could not be loaded ({reason}) and the draft has none")
