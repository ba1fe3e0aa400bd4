"""How a P-EAGLE head is published (``distill.publishing``): as an EAGLE-3 head (its card sections,
``decode.kinds.eagle3.publishing``) whose config.json's speculators keys say P-EAGLE and whose block vLLM drafts
in parallel. The names are those of every kind's ``publishing`` module. Torch-free at import."""

from __future__ import annotations

from pathlib import Path

from decode.kinds.eagle3.publishing import SERVED_FILES, assistant_line, head_facts, made, usage, vocab_line
from decode.kinds.peagle import TRAITS

__all__ = ["SERVED_FILES", "assistant_line", "facts", "made", "usage", "vocab_line"]


def facts(folder: Path, verifier: str | None, gamma: int, notes: list[str]) -> dict:
    """The card's facts of the head published in ``folder``, its speculators keys naming this kind."""
    return head_facts(folder, verifier, gamma, notes, TRAITS.name)
