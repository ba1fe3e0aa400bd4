"""What a PARD draft refuses of a recipe beyond the checks every kind shares (``distill.config``); torch-free."""

from __future__ import annotations

from typing import Any

from decode.kinds.pard import TRAITS


def problems(recipe: Any) -> list[tuple[str, str]]:
    """(key, why) for each recipe setting this kind cannot train with: its step scores each block position over the
    whole vocabulary against a fresh target forward, so the options for a reduced or cached teacher are refused."""
    refused = {
        "distill.cache_teacher": recipe.distill.cache_teacher,
        "distill.top_k": recipe.distill.top_k > 0,
        "distill.loss_vocab": recipe.distill.loss_vocab == "subset",
        "draft.vocab_subset": recipe.draft.vocab_subset > 0,
    }
    why = f"does not apply to draft.kind={TRAITS.name} (its step scores the whole vocabulary): unset it"
    return [(key, why) for key, on in refused.items() if on]
