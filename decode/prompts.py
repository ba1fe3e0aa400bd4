"""Prompts, one pipeline for the bench and for training: JSONL rows -> rendered text -> token ids -> batches.

    rows = read_jsonl("prompts.jsonl")                       # validated dicts; errors name file:line
    ids = encode_prompts(tokenizer, rows)                     # one list of token ids per row
    batches = make_batches(ids, batch_size=4, pad_id=0)       # [(input_ids [B, L], attention_mask [B, L])]

A row is ``{"prompt": str}`` (raw text), ``{"messages": [{"role", "content"}, ...]}`` (chat, OpenAI style: the
tokenizer's chat template is applied with ``add_generation_prompt=True``) or ``{"conversations": [{"from", "value"},
...]}`` (ShareGPT style, read as ``messages``: human -> user, gpt -> assistant); other keys (``id``, ``source``) are
kept. A final assistant message is the row's reference completion, never part of the prompt; a conversation with
several assistant turns is one prompt per turn (:func:`expand_turns`). Text the chat template rendered
already holds its special tokens, so none are added to it when tokenising; raw text gets the tokenizer's usual
ones (a leading BOS, say).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

# ---------------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------------
# ShareGPT speakers ("from") and the chat roles they are read as; OpenAI-style role names are accepted there too
SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
    "bing": "assistant", "bard": "assistant", "system": "system", "tool": "tool",
}  # fmt: skip
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _unknown_roles(roles: Sequence[str], known: Sequence[str], where: str, field: str) -> None:
    unknown = sorted({r for r in roles if r not in known})
    if unknown:
        found = ", ".join(repr(r) for r in unknown)
        raise ValueError(f"{where}: unknown {field} {found} (known: {', '.join(known)}); rename them in the data")


def from_sharegpt(row: dict, where: str) -> dict:
    """A ShareGPT row (``conversations``: ``[{"from", "value"}]``) as a ``messages`` row; its other keys kept."""
    turns = row["conversations"]
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: 'conversations' must be a non-empty list of {{'from', 'value'}} objects")
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or not isinstance(t.get("from"), str) or not isinstance(t.get("value"), str):
            raise ValueError(f"{where}: conversations[{i}] must be an object with string 'from' and 'value'")
    _unknown_roles([t["from"] for t in turns], list(SHAREGPT_ROLES), where, "speaker(s) ('from')")
    messages = [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns]
    return {**{k: v for k, v in row.items() if k != "conversations"}, "messages": messages}


def check_row(row: Any, where: str, prompt_field: str = "prompt") -> dict:
    """Validate one row of the prompt format (a ShareGPT row comes back as a ``messages`` row); ``where``
    ('file:line', 'dataset row i') starts the error line."""
    if not isinstance(row, dict):
        raise ValueError(f'{where}: expected a JSON object like {{"{prompt_field}": ...}}, got {type(row).__name__}')
    if row.get("messages") is None and row.get("conversations") is not None:
        row = from_sharegpt(row, where)
    messages = row.get("messages")
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: messages[{i}] must be an object with string 'role' and 'content'")
        _unknown_roles([m["role"] for m in messages], CHAT_ROLES, where, "role(s)")
        return row
    if not isinstance(row.get(prompt_field), str):
        keys = ", ".join(sorted(map(str, row))) or "none"
        raise ValueError(
            f'{where}: needs "{prompt_field}" (a string), "messages" (a list of role/content objects) or '
            f'"conversations" (a list of from/value objects); keys found: {keys}'
        )
    return row


def expand_turns(rows: Sequence[dict]) -> list[dict]:
    """One prompt per assistant turn: a chat row with several assistant messages becomes one row per assistant
    message (the conversation up to and including it: that turn is the reference completion, the target answers
    in its place when it generates), plus the whole conversation when it ends with another role. Earlier
    assistant turns stay in the context as written. Other rows come back unchanged; each new row keeps the row's
    keys, its ``id`` suffixed ``-turnN`` (N from 1)."""
    out: list[dict] = []
    for row in rows:
        messages = row.get("messages") or []
        ends = [i + 1 for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0]
        if messages and messages[-1]["role"] != "assistant":
            ends.append(len(messages))
        if len(ends) <= 1:
            out.append(row)
            continue
        for n, end in enumerate(ends, 1):
            turn = {**row, "messages": messages[:end]}
            if "id" in row:
                turn["id"] = f"{row['id']}-turn{n}"
            out.append(turn)
    return out


def jsonl_text(rows: Sequence[dict]) -> str:
    """Rows as JSONL text, one object a line (UTF-8 kept as is)."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def write_jsonl(rows: Sequence[dict], path: str | Path) -> Path:
    """Write ``rows`` as a JSONL file atomically (a temporary file renamed into place): never a torn file."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    tmp.write_text(jsonl_text(rows), encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_jsonl(path: str | Path, prompt_field: str = "prompt") -> list[dict]:
    """Rows of a JSONL prompt file, validated; blank lines skipped; every error is one line naming file:line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt file not found: {path}")
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            rows.append(check_row(row, f"{path}:{lineno}", prompt_field))
    if not rows:
        raise ValueError(f"prompt file is empty: {path} has no prompts; expected one JSON object per line")
    return rows


def load_prompts(path: str | Path, tokenizer: Any = None) -> list[dict]:
    """The bench's prompt file: :func:`read_jsonl`, one prompt per assistant turn (:func:`expand_turns`), each row
    with an ``id`` (``<file stem>-<n>`` when it has none).

    With ``tokenizer``, chat rows also get ``"prompt"``: their rendering by its chat template (required), for
    display and samples.
    """
    path = Path(path)
    rows = expand_turns(read_jsonl(path))
    for n, row in enumerate(rows):
        row.setdefault("id", f"{path.stem}-{n}")
        if tokenizer is not None and row.get("messages"):
            row["prompt"], _ = render_prompt(row, tokenizer, require_template=True)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Rendering and tokenising
# ---------------------------------------------------------------------------------------------------------------
def render_prompt(
    row: dict,
    tokenizer: Any,
    *,
    prompt_field: str = "prompt",
    apply_chat_template: bool = True,
    require_template: bool = False,
) -> tuple[str, bool]:
    """The prompt text of a row, and whether the chat template rendered it (its special tokens included).

    Args:
        row: a row of the prompt format (:func:`check_row`).
        prompt_field: the raw-text field.
        apply_chat_template: render 'messages' with the tokenizer's chat template; False (or a tokenizer without
            one) joins the message contents with blank lines.
        require_template: raise instead of joining when the tokenizer has no chat template.
    """
    if not row.get("messages"):  # absent, or None in a datasets table mixing both kinds of rows
        return row[prompt_field], False
    messages = row["messages"]
    if messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not messages:
        raise ValueError("a 'messages' row holds only an assistant message: there is no prompt to condition on")
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if require_template and not has_template:
        name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
        raise ValueError(
            f"chat prompts need a chat template, and tokenizer {name!r} has none: give the rows a "
            '"prompt" string instead, or use a tokenizer that has one'
        )
    if apply_chat_template and has_template:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), True
    return "\n\n".join(m["content"] for m in messages) + "\n\n", False


def encode_prompt(
    row: dict,
    tokenizer: Any,
    *,
    prompt_field: str = "prompt",
    apply_chat_template: bool = True,
    require_template: bool = False,
) -> list[int]:
    """Token ids of one row's prompt (:func:`render_prompt`; special tokens added only to text not rendered by
    the chat template)."""
    text, templated = render_prompt(
        row,
        tokenizer,
        prompt_field=prompt_field,
        apply_chat_template=apply_chat_template,
        require_template=require_template,
    )
    return list(tokenizer(text, add_special_tokens=not templated)["input_ids"])


def encode_prompts(tokenizer: Any, rows: Sequence[dict], *, prompt_field: str = "prompt") -> list[list[int]]:
    """Token ids of each row's prompt; chat rows need the tokenizer's chat template (the bench's rule)."""
    return [encode_prompt(row, tokenizer, prompt_field=prompt_field, require_template=True) for row in rows]


# ---------------------------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------------------------
def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts left-padded for generation: (input_ids ``[B, L]``, attention_mask ``[B, L]``, 0 on padding).

    The mask comes from the lengths, never from the ids: pad is often EOS, and may be a prompt's real token.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("left-padding needs at least one prompt and every prompt needs a token")
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):
        input_ids[b, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        attention_mask[b, width - len(p) :] = 1
    return input_ids, attention_mask


def make_batches(
    encoded: Sequence[Sequence[int]], batch_size: int, pad_id: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive prompts, ``batch_size`` at a time, left-padded: ``[(ids [B, L], mask [B, L])]``."""
    return [left_pad(encoded[start : start + batch_size], pad_id) for start in range(0, len(encoded), batch_size)]
