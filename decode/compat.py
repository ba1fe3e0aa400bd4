"""Can these models decode together, and this prompt in their context: vocabulary widths, tokenizers, positions.

Every check raises ValueError with one line that names the models (or tokenizers) involved and the fix.
"""

from __future__ import annotations

import torch
from torch import nn


def logits_width(model: nn.Module) -> int:
    """Rows of the model's output layer: its tokenizer's ids, plus any padding rows (Qwen2.5-7B: 152064 for 151665)."""
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
    """Return the vocabulary size both models' logits share (the losses' ``vocab_size``); raise ValueError if the
    pair cannot work.

    Embeddings padded past the tokenizer (Qwen2.5-0.5B: 151936 rows, 7B: 152064) are fine: the shared width is
    the smaller one. With ``target_tokenizer`` every id it defines must lie below the shared width: else the
    target could emit a token the draft can neither propose nor learn. With ``draft_tokenizer`` too, every id
    both tokenizers define must be the same token string. Each error is one line naming both sides and the fix.
    """
    target_width, draft_width = logits_width(target), logits_width(draft)
    shared = min(target_width, draft_width)
    if target_tokenizer is not None and draft_tokenizer is not None and target_tokenizer is not draft_tokenizer:
        n = min(len(target_tokenizer), len(draft_tokenizer), shared)
        t_tokens = target_tokenizer.convert_ids_to_tokens(list(range(n)))
        d_tokens = draft_tokenizer.convert_ids_to_tokens(list(range(n)))
        if t_tokens != d_tokens:
            i = next(i for i, (a, b) in enumerate(zip(t_tokens, d_tokens)) if a != b)
            raise ValueError(
                f"vocabulary mismatch: target tokenizer {model_name(target_tokenizer)!r} and draft tokenizer "
                f"{model_name(draft_tokenizer)!r} differ first at id {i}: {t_tokens[i]!r} vs {d_tokens[i]!r}; "
                "use a draft trained with the target's tokenizer"
            )
    # After the tokens: a draft of another tokenizer is often narrower too, and resizing it would not help.
    if target_tokenizer is not None and len(target_tokenizer) > shared:
        raise ValueError(_too_narrow(target, draft, target_tokenizer))
    return shared


def _too_narrow(target: nn.Module, draft: nn.Module, target_tokenizer) -> str:
    """The error line for a target tokenizer with ids at or past one model's logits width."""
    n, tok = len(target_tokenizer), model_name(target_tokenizer)
    target_width, draft_width = logits_width(target), logits_width(draft)
    if target_width < n:
        return (
            f"vocabulary mismatch: target tokenizer {tok!r} defines {n} ids but the target {model_name(target)!r} "
            f"has only {target_width} logits (draft {model_name(draft)!r}: {draft_width}): load the tokenizer "
            "saved with the target checkpoint"
        )
    return (
        f"vocabulary mismatch: target tokenizer {tok!r} defines {n} ids but the draft {model_name(draft)!r} has "
        f"only {draft_width} logits (target {model_name(target)!r}: {target_width}), so the target can emit ids "
        f"{draft_width}..{n - 1} that the draft can never propose: resize the draft's embeddings "
        f"(draft.resize_token_embeddings({n})) or use a draft built on the target's tokenizer"
    )


def with_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """`weight` ([V, ...]: an embedding, an output layer or its bias) cut or padded to `rows` rows; padded rows
    are the mean of the existing ones.

    A padded id never comes out of the tokenizer, and an output row equal to the mean row gives the mean logit,
    which is never the greedy choice. Rows past `rows` are dropped (the target's tokenizer never produces them).
    """
    if rows <= weight.shape[0]:
        return weight[:rows].clone()
    pad = weight.mean(0, keepdim=True).expand(rows - weight.shape[0], *weight.shape[1:])
    return torch.cat([weight, pad.to(weight.dtype)])


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


def match_vocab(model, target_vocab: int) -> tuple[int, int]:
    """Resize the draft's embeddings (and untied lm_head) to the target's vocabulary size.

    Padded rows are the mean of the existing rows, as :func:`with_rows` pads them (the padded ids
    never come out of the tokenizer, and the mean row's logit is never the draft's greedy choice). Rows beyond
    the target's vocabulary are dropped (the target's tokenizer never produces them).
    Returns (old, new) vocab sizes.
    """
    old = model.get_input_embeddings().weight.shape[0]
    if old != target_vocab:
        model.resize_token_embeddings(target_vocab, mean_resizing=False)
        if target_vocab > old:
            with torch.no_grad():
                emb = model.get_input_embeddings().weight
                emb.copy_(with_rows(emb[:old], target_vocab))
                head = model.get_output_embeddings()
                if head is not None and head.weight.data_ptr() != emb.data_ptr():
                    head.weight.copy_(with_rows(head.weight[:old], target_vocab))
                if head is not None and getattr(head, "bias", None) is not None:
                    head.bias.copy_(with_rows(head.bias[:old], target_vocab))
    model.config.get_text_config().vocab_size = target_vocab
    return old, target_vocab
