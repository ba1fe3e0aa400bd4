"""A starting draft for a target that has no smaller sibling: the target cut down to its first layers.

    draft = truncate(target, layers=2)       # embeddings, layers 0..1, final norm and head, copied
    path = ensure_truncated_draft(recipe.target, 2, run_dir / "draft_init")   # saved once, reused by --resume

The truncated model is an ordinary checkpoint of the target's class with `num_hidden_layers = k` and the target's
full vocabulary (so it shares the tokenizer by construction). Untrained, its hidden state after k layers is far
from what the final norm and head expect, so it accepts few tokens; distillation then fits those k layers.
The alternative start, a narrow model pretrained from scratch with the target's tokenizer, is built by
train/pretrain.py with `tokenizer.path` set to the target (directory or .gguf file).
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from decode import sources

MARKER = "DRAFT_INIT.json"  # written last: its presence (with matching settings) marks a finished build
# Decoder blocks are `<prefix>.layers.N.` (Llama, Qwen, Mistral, Gemma, GPT-NeoX), `.h.N.` (GPT-2), `.blocks.N.`.
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


def _layer_index(name: str) -> int | None:
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def truncated_config(config: Any, layers: int) -> Any:
    """A copy of `config` with `layers` decoder layers (per-layer lists such as `layer_types` cut to match)."""
    out = copy.deepcopy(config)
    out.num_hidden_layers = layers
    for per_layer in ("layer_types", "sliding_window_pattern_list"):
        value = getattr(out, per_layer, None)
        if isinstance(value, list):
            setattr(out, per_layer, value[:layers])
    return out


def truncate(target: PreTrainedModel, layers: int) -> PreTrainedModel:
    """A new float32 model: the target's embeddings, first `layers` decoder layers, final norm and head.

    Raises:
        ValueError: `layers` is not in [1, target layers).
    """
    total = target.config.num_hidden_layers
    if not 1 <= layers < total:
        raise ValueError(f"draft.init_layers: {layers} must be in [1, {total - 1}] (the target has {total} layers)")
    draft = AutoModelForCausalLM.from_config(truncated_config(target.config, layers), dtype=torch.float32)
    kept = {
        name: tensor.float()
        for name, tensor in target.state_dict().items()
        if (i := _layer_index(name)) is None or i < layers
    }
    missing, unexpected = draft.load_state_dict(kept, strict=False)
    tied = {"lm_head.weight"} if draft.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"draft.init=truncate: the {type(target).__name__} weights do not map onto a {layers}-layer copy "
            f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]}); use draft.model"
        )
    if draft.config.tie_word_embeddings:
        draft.tie_weights()
    return draft.eval()


def _settings(target_model: str, layers: int) -> dict:
    return {"init": "truncate", "target": target_model, "layers": layers}


def ensure_truncated_draft(target_cfg: Any, layers: int, out: str | Path) -> Path:
    """Build (once) and save the truncated draft of `target_cfg.model` in `out`; return `out`.

    A finished build with the same settings is reused (resume, reruns); anything else in `out` is replaced. The
    build goes to a temporary sibling directory that is renamed into place, so a crash leaves nothing half-written.
    """
    out = Path(out)
    settings = _settings(target_cfg.model, layers)
    marker = out / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == settings:
        return out
    kwargs: dict[str, Any] = {"dtype": torch.float32, "trust_remote_code": target_cfg.trust_remote_code}
    if target_cfg.revision is not None and not sources.is_gguf(target_cfg.model):
        kwargs["revision"] = target_cfg.revision
    target = sources.load_model(target_cfg.model, key="target.model", **kwargs)
    draft = truncate(target, layers)
    tokenizer = sources.load_tokenizer(target_cfg.model, key="target.model")
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        draft.generation_config = copy.deepcopy(target.generation_config)
        draft.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps(settings, indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_draft_init(recipe: Any, run_dir: str | Path) -> None:
    """`draft.init: truncate`: build the draft under `<run_dir>/draft_init` and point `draft.model` at it."""
    if recipe.draft.init != "truncate":
        return
    if recipe.draft.model:
        raise ValueError(
            "draft.init=truncate builds the draft from the target: leave draft.model empty "
            "(or set draft.init=pretrained to train the model in draft.model)"
        )
    recipe.draft.model = str(
        ensure_truncated_draft(recipe.target, recipe.draft.init_layers, Path(run_dir) / "draft_init")
    )
