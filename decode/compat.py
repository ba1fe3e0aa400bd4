"""Can these models decode together, and this prompt in their context: vocabulary widths, tokenizers, positions.

Every check raises ValueError with one line that names the models (or tokenizers) involved and the fix.
"""

from __future__ import annotations

import torch
from torch import nn


def logits_width(model: nn.Module) -> int:
    emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if emb is not None and getattr(emb, "weight", None) is not None:
        return int(emb.weight.shape[0])
    return int(text_config(model).vocab_size)


def text_config(model: nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_name(obj) -> str:
    return getattr(obj, "name_or_path", None) or getattr(getattr(obj, "config", None), "_name_or_path", None) or "?"


def check_vocab_compatible(target: nn.Module, draft: nn.Module, target_tokenizer=None, draft_tokenizer=None) -> int:
    """Return the shared vocabulary size both models' logits are cut to; raise ValueError on a real mismatch.

    Embeddings padded past the tokenizer (Qwen2.5-0.5B: 151936 rows, 7B: 152064) are fine: the ids below the
    smaller logits width are compared. With both tokenizers given, every id both tokenizers define must be the
    same token string, else one line names both tokenizers and the first differing id.
    """
    shared = min(logits_width(target), logits_width(draft))
    if target_tokenizer is not None and draft_tokenizer is not None and target_tokenizer is not draft_tokenizer:
        n = min(len(target_tokenizer), len(draft_tokenizer), shared)
        t_tokens = target_tokenizer.convert_ids_to_tokens(list(range(n)))
        d_tokens = draft_tokenizer.convert_ids_to_tokens(list(range(n)))
        if t_tokens != d_tokens:
            i = next(i for i, (a, b) in enumerate(zip(t_tokens, d_tokens)) if a != b)
            raise ValueError(
                f"vocabulary mismatch: target tokenizer {model_name(target_tokenizer)!r} and draft tokenizer "
                f"{model_name(draft_tokenizer)!r} differ first at id {i}: {t_tokens[i]!r} vs {d_tokens[i]!r}"
            )
    return shared


def context_length(model: nn.Module) -> int | None:
    """The model's maximum number of positions, or None when the config does not say."""
    config = text_config(model)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def cpu_has_native_bf16() -> bool:
    """True on a CPU whose oneDNN runs bf16 matmuls natively (AVX512-BF16 or AMX).

    There a frozen model is best run in bf16: a 5-token verify forward costs ~1.1x a 1-token one against ~1.6x in
    float32 (measured on the reference pair), which is the difference between speculative decoding paying or not.
    Without native support bf16 is emulated and slower than float32.
    """
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def check_context(models: dict[str, nn.Module], prompt_len: int, max_new_tokens: int) -> None:
    """Raise ValueError if prompt + max_new_tokens does not fit every model's context."""
    for role, model in models.items():
        limit = context_length(model)
        if limit is not None and prompt_len + max_new_tokens > limit:
            raise ValueError(
                f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} exceeds the {role} model's context "
                f"of {limit} tokens (max_position_embeddings of {model_name(model)})"
            )


def sliding_window(model: nn.Module) -> int | None:
    window = getattr(text_config(model), "sliding_window", None)
    return window if isinstance(window, int) and window > 0 else None
