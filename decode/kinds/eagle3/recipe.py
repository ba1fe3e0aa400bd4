"""What this kind refuses of a recipe beyond the checks every kind shares (``distill.config``); torch-free."""

from __future__ import annotations

from typing import Any


def problems(recipe: Any) -> list[tuple[str, str]]:
    """(key, why) for each recipe setting this kind cannot train with: none beyond the shared checks."""
    return []
