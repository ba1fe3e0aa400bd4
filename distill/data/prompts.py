"""Training prompt sets and batches: JSONL / datasets rows -> examples -> padded tensors.

    train_rows, eval_rows = load_train_eval(recipe.data)                     # dicts, docs/data.md prompt format
    context = models.context_length(target, draft)
    examples = encode_examples(train_rows, tok, recipe.data, context, recipe.distill.max_new_tokens)
    prompts = collate_prompts([e.prompt_ids for e in examples[:8]], tok.pad_token_id)   # left-padded, generation
    batch = collate_training(pairs, tok.pad_token_id)                        # right-padded, training

Rows are `{"prompt": "..."}` (raw text) or `{"messages": [{"role", "content"}, ...]}` (chat); reading, validating,
rendering and tokenising a prompt is `decode.prompts`, the same pipeline the bench uses. A final assistant message
is the row's reference completion (source `fixed`), never part of the prompt.

Lengths: prompts are cut from the **left** (the end of a prompt is what the continuation depends on) to
`data.max_prompt_tokens`, and further to `context - max_new_tokens` when prompt + continuation would not fit the
models' context, so generation never runs past a model's positions. A leading BOS token is kept. Rows left
with no tokens are dropped with a warning.

Masks are built from lengths, never from token ids: pad == eos in many tokenizers (the reference pair's id 0 is
bos, eos and pad), and an EOS the model generated inside a completion is a real token that stays in the loss.

Where the shift happens: `logits[:, t]` predicts `input_ids[:, t + 1]`. `collate_training` returns
`loss_mask` aligned with the *logits*: `loss_mask[b, t] = 1` iff `input_ids[b, t + 1]` is a completion token,
i.e. t in [len(prompt) - 1, len(prompt) + len(completion) - 2]. Feed `model(...).logits` and `loss_mask`
straight into `distill.training.losses` — no slicing at the call site.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from decode.draft_vocab import frequent_ids
from decode.prompts import check_row, encode_prompt, left_pad, read_jsonl, render_prompt
from distill.config import DataConfig

logger = logging.getLogger(__name__)


@dataclass
class Example:
    """One tokenised prompt (and, for source `fixed`, its reference completion)."""

    index: int  # position in the prompt set: the stable key for rollout caches
    prompt_ids: list[int]
    completion_ids: list[int] | None = None
    row: dict[str, Any] = field(default_factory=dict, repr=False)  # the original row, every key kept


# ---------------------------------------------------------------- reading rows


def _is_saved_dataset(path: Path) -> bool:
    return any((path / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json"))


def load_rows(
    source: str, *, key: str = "data.train_prompts", split: str = "train", prompt_field: str = "prompt"
) -> list[dict]:
    """Prompt rows from a JSONL file, a local `datasets` dataset (save_to_disk dir, data dir or file), or a hub id.

    Args:
        source: the recipe value.
        key: the recipe key, for error messages.
        split: split to use when the dataset has several (`data.dataset_split`).
        prompt_field: the raw-text field (`data.prompt_field`); rows may use 'messages' instead.
    """
    path = Path(source).expanduser()
    if source and path.is_file() and path.suffix == ".jsonl":
        return read_jsonl(path, prompt_field)
    check_prompt_source(source, key=key, prompt_field=prompt_field)  # empty, or a path that does not exist

    import datasets

    try:
        if path.is_dir() and _is_saved_dataset(path):
            ds = datasets.load_from_disk(str(path))
        elif path.is_file():
            kind = {".json": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}.get(path.suffix)
            if kind is None:
                raise ValueError(f"{key} {source!r}: unsupported file type; use .jsonl, .json, .csv or .parquet")
            ds = datasets.load_dataset(kind, data_files=str(path))
        elif path.is_dir():
            ds = datasets.load_dataset(str(path))
        else:
            from distill.publishing.hub import hub_offline

            if source.startswith((".", "/", "~")) or source.count("/") > 1 or hub_offline():
                why = " (HF_HUB_OFFLINE=1, so hub datasets cannot be fetched)" if hub_offline() else ""
                raise ValueError(f"{key} {source!r} not found: no such file or directory{why}; fix the path")
            ds = datasets.load_dataset(source, split=split)
    except ValueError:
        raise
    except Exception as e:  # datasets raises many types; one line for the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{key} {source!r} could not be loaded as a dataset: {first}") from e
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds and len(ds) == 1 and path.is_file():
            split = next(iter(ds))  # a single data file has one split, whatever it is called
        if split not in ds:
            raise ValueError(
                f"{key} {source!r} has no split {split!r} (splits: {', '.join(ds)}); set data.dataset_split"
            )
        ds = ds[split]
    rows = [check_row(row, f"{key} {source!r} row {i}", prompt_field) for i, row in enumerate(ds)]
    if not rows:
        raise ValueError(f"{key} {source!r}: the dataset split {split!r} has no rows")
    return rows


def check_prompt_source(source: str, *, key: str, prompt_field: str = "prompt") -> None:
    """Refuse a prompt source that cannot be read, before anything is loaded: an empty value, a path that does
    not exist (anything but a hub id, and every name with HF_HUB_OFFLINE=1), and a JSONL file with a row that is
    not valid JSON, not a {"prompt"} or {"messages"} object, or no rows at all (every row is read). Datasets and
    hub ids are checked when they are loaded.

    Raises:
        ValueError: one line naming `key`, the source and the fix.
    """
    if not source:
        raise ValueError(f"{key} is empty: set it to a JSONL prompt file, a datasets directory or a hub dataset id")
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".jsonl":
        try:
            read_jsonl(path, prompt_field)
        except ValueError as err:
            raise ValueError(f"{key}: {err}") from None
    elif not path.exists():
        from distill.publishing.hub import hub_offline

        offline = hub_offline()
        if offline or path.suffix == ".jsonl" or source.startswith((".", "/", "~")) or source.count("/") > 1:
            why = " (HF_HUB_OFFLINE=1, so hub datasets cannot be fetched)" if offline else ""
            raise ValueError(f"{key} {source!r} not found: no such file or directory{why}; fix the path")


def _row_key(row: dict, prompt_field: str) -> bytes:
    content = row["messages"] if row.get("messages") else row.get(prompt_field)
    return hashlib.sha1(json.dumps(content, sort_keys=True, ensure_ascii=False).encode()).digest()


def split_rows(
    rows: Sequence[dict], eval_fraction: float, prompt_field: str = "prompt"
) -> tuple[list[dict], list[dict]]:
    """Deterministic train/eval split: the ceil(n * fraction) rows with the smallest content hash go to eval.

    Independent of row order and of any seed, so every run on the same file evaluates on the same prompts; the
    rest keep their original order.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval fraction must be in [0, 1), got {eval_fraction}")
    n_eval = min(math.ceil(len(rows) * eval_fraction), len(rows) - 1)
    if n_eval <= 0:
        return list(rows), []
    order = sorted(range(len(rows)), key=lambda i: (_row_key(rows[i], prompt_field), i))
    held = set(order[:n_eval])
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in sorted(held)]


def load_train_eval(cfg: DataConfig) -> tuple[list[dict], list[dict]]:
    """(train rows, eval rows) for a recipe's `data` section.

    Eval rows come from `data.eval_prompts` when set, else from a deterministic `data.eval_split` of the training
    prompts (:func:`split_rows`). `data.max_train_prompts` then caps the training rows (first N).
    """
    train = load_rows(
        cfg.train_prompts, key="data.train_prompts", split=cfg.dataset_split, prompt_field=cfg.prompt_field
    )
    if cfg.eval_prompts:
        evals = load_rows(
            cfg.eval_prompts, key="data.eval_prompts", split=cfg.dataset_split, prompt_field=cfg.prompt_field
        )
    else:
        train, evals = split_rows(train, cfg.eval_split, cfg.prompt_field)
        if not evals:
            raise ValueError(
                "data.eval_prompts is empty and data.eval_split is 0: set one of them so that drafts can be evaluated"
            )
    if cfg.max_train_prompts:
        train = train[: cfg.max_train_prompts]
    return train, evals


# ---------------------------------------------------------------- rendering and tokenisation


def _use_template(tokenizer: Any, apply_chat_template: bool) -> bool:
    return apply_chat_template and bool(getattr(tokenizer, "chat_template", None))


def render_completion(
    row: dict,
    tokenizer: Any,
    *,
    completion_field: str = "completion",
    prompt_field: str = "prompt",
    apply_chat_template: bool = True,
) -> str | None:
    """The reference completion text: `row[completion_field]`, else the final assistant message, else None.

    With a chat template, the completion of a 'messages' row is the template's rendering of the final turn
    (end-of-turn token included, so the draft learns where turns end).
    """
    if isinstance(row.get(completion_field), str):
        return row[completion_field]
    messages = row.get("messages")
    if not messages or messages[-1]["role"] != "assistant":
        return None
    if _use_template(tokenizer, apply_chat_template):
        prompt, _ = render_prompt(row, tokenizer, prompt_field=prompt_field, apply_chat_template=True)
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        if full.startswith(prompt):
            return full[len(prompt) :]
    return messages[-1]["content"]


def encode_examples(
    rows: Sequence[dict],
    tokenizer: Any,
    cfg: DataConfig,
    context_length: int | None = None,
    max_new_tokens: int = 0,
    *,
    completion_field: str | None = None,
) -> list[Example]:
    """Tokenise rows into :class:`Example`s (index = position in `rows`), dropping rows left empty.

    Args:
        rows: prompt rows (:func:`load_train_eval`).
        tokenizer: the shared tokenizer.
        cfg: `recipe.data` (`max_prompt_tokens`, `prompt_field`, `apply_chat_template`).
        context_length: the models' context (:func:`distill.models.context_length`); None: unlimited.
        max_new_tokens: continuation budget; prompts are left-cut to `context_length - max_new_tokens`, and
            reference completions are cut to it (their end).
        completion_field: set for source `fixed` (`distill.completion_field`): every row must then have a
            completion (that field or a final assistant message); None: prompts only.
    """
    budget = cfg.max_prompt_tokens
    if context_length is not None:
        room = context_length - max_new_tokens
        if room < 1:
            raise ValueError(
                f"distill.max_new_tokens={max_new_tokens} leaves no room for a prompt in the models' context of "
                f"{context_length} tokens; lower it"
            )
        if room < budget:
            logger.warning(
                "prompts are cut to %d tokens (context %d - max_new_tokens %d) instead of data.max_prompt_tokens=%d",
                room,
                context_length,
                max_new_tokens,
                budget,
            )
            budget = room
    bos = getattr(tokenizer, "bos_token_id", None)
    examples, dropped = [], []
    for i, row in enumerate(rows):
        ids = encode_prompt(row, tokenizer, prompt_field=cfg.prompt_field, apply_chat_template=cfg.apply_chat_template)
        if len(ids) > budget:
            # keep a leading BOS: models are trained with it at position 0
            ids = (
                [ids[0], *ids[len(ids) - budget + 1 :]]
                if bos is not None and ids[0] == bos and budget > 1
                else ids[-budget:]
            )
        completion = None
        if completion_field is not None:
            text = render_completion(
                row,
                tokenizer,
                completion_field=completion_field,
                prompt_field=cfg.prompt_field,
                apply_chat_template=cfg.apply_chat_template,
            )
            if text is None:
                raise ValueError(
                    f"prompt row {i} has no {completion_field!r} field and no final assistant message: source "
                    "'fixed' needs a reference completion in every row (distill.completion_field)"
                )
            completion = tokenizer(text, add_special_tokens=False)["input_ids"]
            if max_new_tokens:
                completion = completion[:max_new_tokens]
        if not ids or (completion is not None and not completion):
            dropped.append(i)
            continue
        examples.append(Example(index=i, prompt_ids=list(ids), completion_ids=completion, row=row))
    if dropped:
        logger.warning("dropped %d prompt rows with no tokens left (rows %s)", len(dropped), dropped[:10])
    if not examples:
        raise ValueError(f"none of the {len(rows)} prompt rows has any tokens after tokenisation")
    return examples


# ---------------------------------------------------------------- collation


def collate_prompts(
    prompts: Sequence[Sequence[int]], pad_token_id: int, device: str | torch.device | None = None
) -> dict[str, torch.Tensor]:
    """Left-padded prompt batch for generation.

    Returns:
        input_ids [batch, max_len] (pad on the left), attention_mask [batch, max_len] (0 on padding).
    """
    input_ids, attention_mask = left_pad(prompts, pad_token_id)
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}


LOSS_POSITIONS = ("completion", "all")


def collate_training(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    pad_token_id: int,
    device: str | torch.device | None = None,
    loss_positions: str = "completion",
) -> dict[str, torch.Tensor]:
    """Right-padded prompt + completion batch for the distillation forward passes.

    Args:
        pairs: (prompt_ids, completion_ids) per row; both non-empty.
        pad_token_id: fills the padding (its value never matters: masks come from lengths).
        loss_positions: `completion` (the loss covers the completion tokens) or `all` (every token after the
            first: the teacher's distributions on the prompt text too, from the forward passes already run).

    Returns:
        input_ids [batch, L] prompt then completion, right-padded (positions 0.. match an unpadded forward);
        attention_mask [batch, L], 1 on prompt and completion tokens;
        loss_mask [batch, L] aligned with the logits: 1 at t iff input_ids[:, t + 1] is a completion token
        (`all`: any token of the row).
    """
    if loss_positions not in LOSS_POSITIONS:
        raise ValueError(f"loss_positions {loss_positions!r} is not one of {', '.join(LOSS_POSITIONS)}")
    if not pairs:
        raise ValueError("collate_training needs at least one (prompt_ids, completion_ids) pair")
    for b, (p, c) in enumerate(pairs):
        if len(p) == 0 or len(c) == 0:
            raise ValueError(f"pair {b} has an empty {'prompt' if len(p) == 0 else 'completion'}")
    width = max(len(p) + len(c) for p, c in pairs)
    input_ids = torch.full((len(pairs), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(pairs), width), dtype=torch.long)
    loss_mask = torch.zeros((len(pairs), width), dtype=torch.long)
    for b, (p, c) in enumerate(pairs):
        n_p, n = len(p), len(p) + len(c)
        input_ids[b, :n] = torch.as_tensor([*p, *c], dtype=torch.long)
        attention_mask[b, :n] = 1
        first = n_p - 1 if loss_positions == "completion" else 0
        loss_mask[b, first : n - 1] = 1  # the logits that predict tokens first + 1 .. n - 1
    return {
        "input_ids": input_ids.to(device),
        "attention_mask": attention_mask.to(device),
        "loss_mask": loss_mask.to(device),
    }


# ---------------------------------------------------------------- the draft vocabulary's text


def draft_vocabulary(
    size: int, examples: list[Example], continuations: list[list[int]], vocab: int, always: list[int]
) -> tuple[list[int], str]:
    """draft.vocab_subset: the `size` ids most frequent in `vocabulary_text`, and where they came from; EOS ids
    are always in."""
    lists, where = vocabulary_text(examples, continuations)
    return frequent_ids(lists, size, always=always, vocab=vocab), where


def vocabulary_text(examples: list[Example], continuations: list[list[int]]) -> tuple[list[list[int]], str]:
    """The text the draft will draft, as token id lists, and its name: the target's continuations when the run has
    them before its first step (source target/mix with the cache, or a fixed dataset's completions), else the
    training prompts. The draft vocabulary is counted on it and a masked head fitted to it."""
    fixed = [e.completion_ids for e in examples if e.completion_ids]
    if continuations or fixed:
        return continuations + fixed, f"{len(continuations) + len(fixed)} training continuations"
    return [e.prompt_ids for e in examples], f"{len(examples)} training prompts"
