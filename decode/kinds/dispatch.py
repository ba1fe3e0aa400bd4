"""What the decoder asks of a loaded draft, by its kind: its drafter, its forwards' cost, its block.

A kind's decoding module (``decode.kinds.<kind>.decoding``) gives the decoder (``decode.speculative``) a *drafter*,
the draft's state during one decoding call:

    drafter.aux_layers                  target layers whose hidden states the drafter needs (None: none)
    drafter.propose(controller, cap, proc, greedy, generator) -> (tokens [B, g], q [B, g, V] or None)
    drafter.update(verified)            after the target's verify pass: what was fed, accepted and its features
    drafter.select(rows)                keep only these batch rows
    drafter.forwards                    draft forwards run

A decoding module gives ``drafter(draft, batch, vocab, input_ids, prompt_mask)``, ``cost_stream(model, batch)``,
``block_of(draft)`` (None for a chain), ``check_draft_length(draft, gamma)`` and ``is_model(draft)`` (a loaded draft
LM is of this kind; a draft built from the target names its kind itself); whether it drafts a whole block per
forward is its trait (``decode.kinds.traits``). The accept/reject rule, the bench and best/ selection stay the same
for every kind.

Of a saved folder (its config.json, before any weights load), every decoding module gives:

    is_folder(path) -> bool             the folder holds a draft saved as this kind (a plain causal LM: no kind's)
    folder_block(path) -> int | None    the tokens it drafts per forward as saved (None: a chain)
    check_folder(path, target_config, target_name)   ValueError (one line) unless it was made for that target
    vllm_problem(version, methods) -> str | None     why a vLLM build (its speculative methods) cannot serve it

and a kind that builds its draft from the target (``TRAITS.loads_draft_model`` false) ``load(path, target)``; one
that drafts trees (``TRAITS.draft_tree``) ``tree_drafter(draft, vocab)`` (``decode.tree``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from decode import kinds
from decode.kinds.drafting import Verified

# each kind's decoding module, in the registry's order (decode.kinds: a new kind is one line there)
MODULES = {name: kinds.decoding(name) for name in kinds.names()}
BLOCK_KINDS = tuple(name for name, t in kinds.KINDS.items() if t.block)  # a whole block per draft forward

__all__ = [
    "BLOCK_KINDS",
    "MODULES",
    "Verified",
    "capped_draft_length",
    "check_draft_length",
    "cost_stream",
    "drafter_for",
    "folder_block",
    "folder_kind",
    "forwards_per_round",
    "kind_of",
    "module_of_folder",
    "read_as",
]


def kind_of(draft: nn.Module) -> str:
    """The kind of a loaded draft: its ``kind`` attribute (a draft built from the target has one), else the kind
    whose decoding module claims the draft LM (``is_model``), else :data:`decode.kinds.PLAIN_LM`."""
    claimed = (name for name, module in MODULES.items() if module.is_model(draft))
    return getattr(draft, "kind", None) or next(claimed, kinds.PLAIN_LM)


def folder_kind(path: str | Path) -> str | None:
    """The kind of draft a local folder holds: the ``draftsmith.draft_kind`` its config.json records (draftsmith
    writes it with every draft it builds from the target), else the kind whose layout it has (each decoding
    module's ``is_folder``). None for a plain causal LM (:data:`decode.kinds.PLAIN_LM` reads it, and any kind that
    loads a draft LM can start from it) and for what is not a local folder (a hub id, a GGUF file)."""
    where = Path(path).expanduser()
    try:
        raw = json.loads((where / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    recorded = raw.get("draftsmith")
    recorded = recorded.get("draft_kind") if isinstance(recorded, dict) else None
    found = recorded if recorded in kinds.KINDS else next((n for n, m in MODULES.items() if m.is_folder(where)), None)
    return None if found == kinds.PLAIN_LM else found


def read_as(path: str | Path) -> str:
    """The kind a draft (a folder, hub id or GGUF file) is read and served as: :func:`folder_kind`'s, else
    :data:`decode.kinds.PLAIN_LM`."""
    return folder_kind(path) or kinds.PLAIN_LM


def module_of_folder(path: str | Path):
    """The decoding module of the kind a draft is read as (:func:`read_as`)."""
    return MODULES[read_as(path)]


def folder_block(path: str | Path) -> int | None:
    """The tokens a saved draft drafts in one forward (its kind's ``folder_block``; None: a chain)."""
    return module_of_folder(path).folder_block(path)


def drafter_for(draft: nn.Module, batch: int, vocab: int, input_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """The drafter of ``draft``'s kind for one decoding call over ``input_ids`` [B, P] (``prompt_mask`` [B, P])."""
    return MODULES[kind_of(draft)].drafter(draft, batch, vocab, input_ids, prompt_mask)


def cost_stream(model: nn.Module, batch: int):
    """What ``decode.metrics.ForwardCostMeter`` times a model's KV-cached forwards through, by kind."""
    return MODULES[kind_of(model)].cost_stream(model, batch)


def forwards_per_round(draft: nn.Module, gamma: float) -> float:
    """Draft forwards a round of ``gamma`` drafted tokens costs: one for a block draft, gamma for a chain."""
    return 1.0 if kind_of(draft) in BLOCK_KINDS else gamma


def check_draft_length(draft: nn.Module, gamma: int) -> None:
    """ValueError when a fixed ``gamma`` is above the block a block draft was trained for (a chain: no limit)."""
    MODULES[kind_of(draft)].check_draft_length(draft, gamma)


def capped_draft_length(draft: nn.Module, gamma: int | str) -> int | str:
    """``gamma`` capped at a block draft's trained block (for loops whose draft length is a speed setting only,
    as the target's rollouts); ``auto`` and chains as they are."""
    block = MODULES[kind_of(draft)].block_of(draft)
    if not isinstance(gamma, int) or block is None:
        return gamma
    return min(gamma, int(block))
