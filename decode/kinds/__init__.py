"""Draft kinds: one folder each, its traits declared once.

    decode/kinds/<kind>/__init__.py   TRAITS: what the kind is (:class:`decode.kinds.traits.KindTraits`), torch-free
    decode/kinds/<kind>/decoding.py   the model and its drafter in draftsmith's decoder (``decode.kinds.dispatch``)
    decode/kinds/<kind>/training.py   how train/distill.py builds, trains and saves it (``distill.kinds.interface``)
    decode/kinds/<kind>/publishing.py what its published folder and model card say (``distill.publishing``)
    decode/kinds/<kind>/recipe.py     what it refuses of a recipe beyond the shared checks (``distill.config``)
    decode/kinds/<kind>/gguf.py       the folder llama.cpp's converter reads (``decode.llamacpp.export``); only
                                      the kinds llama.cpp serves (``llamacpp_spec_type``) have one

This file is the registry: one import and one entry per kind, in the order kinds are listed. It stays torch-free
(the recipe checks draft.kind against it); :func:`decoding` and :func:`training` import a kind's modules when
asked. docs/draft-kinds.md has the table of what each kind does and what adding one touches.

    standalone   a small causal LM with the target's tokenizer
    eagle3       a one-layer head over three of the target's hidden layers
    peagle       an EAGLE-3 head that drafts a whole block in one forward
    pard         a standalone draft LM that drafts a whole block in one forward from mask tokens
    dflash       a few layers filling a whole block from the target's hidden states in one pass
    dspark       a DFlash block plus a Markov bias chained through it, a confidence cut
"""

from __future__ import annotations

import importlib
from types import ModuleType

from decode.kinds import dflash, dspark, eagle3, pard, peagle, standalone
from decode.kinds.traits import KindTraits

# the registry: draft.kind -> its traits (a new kind: its folder, and one line here)
KINDS: dict[str, KindTraits] = {
    standalone.TRAITS.name: standalone.TRAITS,
    eagle3.TRAITS.name: eagle3.TRAITS,
    peagle.TRAITS.name: peagle.TRAITS,
    pard.TRAITS.name: pard.TRAITS,
    dflash.TRAITS.name: dflash.TRAITS,
    dspark.TRAITS.name: dspark.TRAITS,
}

# the kind of a draft folder that records no kind: a plain causal LM
PLAIN_LM = standalone.TRAITS.name

__all__ = [
    "KINDS", "PLAIN_LM", "KindTraits", "decoding", "gguf", "names", "publishing", "recipe", "training", "traits",
]  # fmt: skip


def names() -> tuple[str, ...]:
    """Every kind's name, in the registry's order."""
    return tuple(KINDS)


def traits(name: str) -> KindTraits:
    """The traits of draft kind ``name``.

    Raises:
        ValueError: no such kind, naming the kinds there are.
    """
    if name not in KINDS:
        raise ValueError(f"draft.kind={name!r} is not a draft kind: use one of {', '.join(KINDS)}")
    return KINDS[name]


def decoding(name: str) -> ModuleType:
    """The decoding module of kind ``name`` (``decode.kinds.<name>.decoding``; imports torch)."""
    return importlib.import_module(f"{__name__}.{traits(name).name}.decoding")


def training(name: str) -> ModuleType:
    """The training module of kind ``name`` (``decode.kinds.<name>.training``; imports torch and distill)."""
    return importlib.import_module(f"{__name__}.{traits(name).name}.training")


def publishing(name: str) -> ModuleType:
    """The publishing module of kind ``name`` (``decode.kinds.<name>.publishing``: its published folder's facts and
    its model card's sections; torch-free at import)."""
    return importlib.import_module(f"{__name__}.{traits(name).name}.publishing")


def recipe(name: str) -> ModuleType:
    """The recipe module of kind ``name`` (``decode.kinds.<name>.recipe``: ``problems(recipe)``, what the kind
    refuses of a recipe beyond the shared checks; torch-free)."""
    return importlib.import_module(f"{__name__}.{traits(name).name}.recipe")


def gguf(name: str) -> ModuleType:
    """The GGUF module of kind ``name`` (``decode.kinds.<name>.gguf``: ``check(folder, target_dir)`` and
    ``gguf_folder(folder, staging, target_dir)``, the folder llama.cpp's converter reads; torch-free at import).

    Raises:
        ValueError: one line: llama.cpp serves no draft of this kind (no ``llamacpp_spec_type``), naming the vLLM
            method that serves it.
    """
    t = traits(name)
    if t.llamacpp_spec_type is None:
        parallel = " with parallel_drafting" if t.vllm_parallel_drafting else ""
        raise ValueError(
            f"{t.description} (draft.kind={t.name}) cannot be served by llama.cpp, which has no --spec-type for it: "
            f"serve it with vLLM (speculative method {t.vllm_method}{parallel}) or draftsmith's decoder"
        )
    return importlib.import_module(f"{__name__}.{t.name}.gguf")
