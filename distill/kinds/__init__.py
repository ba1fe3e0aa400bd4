"""Draft kinds on the training side: how train/distill.py builds, trains, evaluates and saves each kind of draft.

A kind is one folder, ``decode/kinds/<kind>/``: its traits in ``__init__.py`` (registered in ``decode.kinds``), its
decoding side in ``decoding.py``, its training side in ``training.py`` (a module with the functions of
:class:`Kind`). train/distill.py names no kind: it calls the functions of :class:`Kind` on the module
``get(recipe.draft.kind)`` returns, in this order:

    kind.check_inputs(recipe, target, ...)       preflight: refuse a recipe the kind cannot train, one line
    kind.load_draft(recipe, device)              models: (draft, its tokenizer), or (None, None) for a draft
                                                 built from the target (build_draft, below)
    kind.cache_teacher(recipe, target)           data: distill.cache_teacher's store of the target's side
    kind.generation_recorder(teachers, ...)      what the store keeps while the target generates (or None)
    kind.build_draft(recipe, target, ...)        data: a draft built from the target and its continuations
    kind.decoding_vocab(recipe, source, ...)     the draft vocabulary draftsmith's decoder drafts from
    kind.loss_step(draft, target, ...)           the loop: a function of one micro-batch -> :class:`StepLoss`
    kind.served(model)                           eval and save: the model as its engines serve it
    kind.save_checkpoint(draft, folder, ...)     a checkpoint's draft files, in the format its engines read

and reads its facts from ``kind.TRAITS`` (:class:`decode.kinds.traits.KindTraits`): ``loads_draft_model``
(draft.model is a model to load), ``hf_assisted`` (HF assisted generation can run it), ``generates_rollouts`` (it
can speed up the target's rollouts as a speculative draft), ``folder_kinds`` (the kinds of saved draft folder
draft.model may hold: :func:`folder_kind`), ``description`` (what it is, for messages).
The accept/reject rule, the bench, best/ selection, W&B, resume and publish are the same for every kind.
docs/draft-kinds.md has the table of what each kind does.
"""

from __future__ import annotations

from decode import kinds as registry
from decode.kinds.dispatch import folder_kind  # the kind a saved draft folder holds (None: a plain causal LM)
from distill.config import Recipe
from distill.kinds.interface import Kind, StepLoss

__all__ = ["KINDS", "Kind", "StepLoss", "engine_limits", "folder_kind", "get"]

# draft.kind -> its training module, in the registry's order (decode.kinds: a new kind is one line there); built on
# first use, because a kind's training module imports this package (its interface) while it is itself imported
KINDS: dict[str, Kind]


def __getattr__(name: str):
    if name == "KINDS":
        return _kinds()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _kinds() -> dict[str, Kind]:
    if "KINDS" not in globals():
        globals()["KINDS"] = {name: registry.training(name) for name in registry.names()}
    return globals()["KINDS"]


def get(name: str) -> Kind:
    """The training module of draft kind ``name`` (``recipe.draft.kind``; ``decode.kinds.dispatch.kind_of`` of a
    loaded draft).

    Raises:
        ValueError: no such kind, naming the kinds there are.
    """
    found = _kinds()
    if name not in found:
        raise ValueError(f"draft.kind={name!r} is not a draft kind: use one of {', '.join(found)}")
    return found[name]


def engine_limits(recipe: Recipe, kind: Kind) -> str | None:
    """Turn off what the recipe asks of an engine that cannot run ``kind`` (eval.hf_assisted); the note to print,
    or None."""
    if kind.TRAITS.hf_assisted or not recipe.eval.hf_assisted:
        return None
    recipe.eval.hf_assisted = False
    return f"note: eval.hf_assisted=false: HF assisted generation cannot run {kind.TRAITS.description}"
