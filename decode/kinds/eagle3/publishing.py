"""How an EAGLE-3 head is published (``distill.publishing``): its config.json and weights as saved, served by vLLM
(``method: eagle3``) and SGLang (EAGLE3) next to the target; config.json's speculators keys name the verifier.
The names are those of every kind's ``publishing`` module (``decode.kinds.standalone.publishing``); the P-EAGLE
kind publishes its heads through :func:`head_facts` and the same card sections. Torch-free at import."""

from __future__ import annotations

import json
from pathlib import Path

from decode.kinds.eagle3 import TRAITS
from decode.kinds.standalone.publishing import sample_key

SERVED_FILES = ("config.json", "model.safetensors")  # as saved: no merge, no vocabulary change


def name_verifier(config_json: Path, verifier: str | None, gamma: int, notes: list[str], kind: str) -> None:
    """Rewrite the speculators keys of a head's config.json to name ``verifier`` (a Hub id, or a path as given)
    with ``gamma`` speculative tokens, as speculators' ``kind``; with no verifier (a local target, no --verifier)
    drop them, with a note: a path of this machine would not resolve where the head is served."""
    from decode.kinds.eagle3.formats import speculators_fields

    config = json.loads(config_json.read_text())
    old = config.pop("speculators_config", None) or {}
    config.pop("speculators_model_type", None)
    config.pop("transformer_layer_config", None)
    if verifier:
        archs = (old.get("verifier") or {}).get("architectures") or []
        config.update(speculators_fields(config, verifier, gamma, archs, kind=kind))
    else:
        notes.append(
            "config.json names no verifier (speculators_config), so `vllm serve` of this repo needs the target's "
            "flags: the target is a local model; publish with --verifier HUB_ID to name it"
        )
    config_json.write_text(json.dumps(config, indent=2) + "\n")


def head_facts(folder: Path, verifier: str | None, gamma: int, notes: list[str], kind: str) -> dict:
    """The card's facts of a head published in ``folder`` as speculators' ``kind``, its config.json naming
    ``verifier``: its block (a P-EAGLE head's, vLLM parallel_drafting), verifier and method."""
    from decode.kinds.eagle3.formats import block_of

    name_verifier(folder / "config.json", verifier, gamma, notes, kind)
    config = json.loads((folder / "config.json").read_text())
    return {
        "block_size": block_of(config),
        "verifier": verifier,  # what config.json's speculators_config names (None: nothing)
        "method": f"draft vocabulary {config.get('draft_vocab_size')}, target layers "
        f"{config.get('eagle_aux_hidden_state_layer_ids')}",
    }


def facts(folder: Path, verifier: str | None, gamma: int, notes: list[str]) -> dict:
    """The card's facts of the head published in ``folder`` (:func:`head_facts`)."""
    return head_facts(folder, verifier, gamma, notes, TRAITS.name)


def made(info: dict) -> str:
    """What the card's first sentence says the draft is (a P-EAGLE head: with its block)."""
    block = info.get("block_size")
    head = f"a P-EAGLE head (a block of {block} tokens per forward)" if block else "an EAGLE-3 head"
    return f"{head} trained with draftsmith on the target's own hidden states ({info['method']})"


def assistant_line(info: dict) -> str:
    """What the published folder sets for HF assisted generation: nothing, it cannot run a head."""
    return "none: HF assisted generation cannot run an EAGLE-3 or P-EAGLE head"


def vocab_line(info: dict, size: int) -> str:
    """The head drafts from its own vocabulary, the rows of its output layer."""
    return (
        f"- the head drafts from its own draft vocabulary: {size} of the target's tokens (the most frequent in "
        "its training continuations), the rows of its output layer `lm_head`; `d2t` and `t2d` in "
        "`model.safetensors` map them to the target's ids. vLLM, SGLang and draftsmith's decoder all draft from "
        "those tokens; lossless: the target verifies over its whole vocabulary"
    )


def head_usage(
    target: str,
    repo_id: str,
    gamma: int,
    tree: str | None = None,
    sample_method: str | None = None,
    verifier: str | None = None,
    block: int | None = None,
) -> list[str]:
    """The card's usage section for a head: what it is, then :func:`decode.kinds.eagle3.decoding.usage`
    (vLLM's ``method: eagle3`` with the recipe's draft_sample_method, SGLang's EAGLE3, draftsmith; no HF assisted
    generation). ``verifier``: the target the head's config.json names (speculators_config), which lets
    ``vllm serve REPO`` run with no speculative flags; ``block``: a P-EAGLE head's block (parallel drafting)."""
    from decode.kinds.eagle3 import decoding

    extra = sample_key(sample_method)
    lines = decoding.usage(target, repo_id, gamma, tree, spec_extra=extra, verifier=verifier, block=block)
    about = decoding.WHAT_IT_IS
    if block:
        about = (
            f"A P-EAGLE head drafts up to {block} tokens in one forward (its positions after the first read a mask "
            f"token and a learned mask feature); otherwise it is an EAGLE-3 head. {about}"
        )
    return ["## Usage", "", about, "", *lines]


def usage(info: dict, repo_id: str) -> list[str]:
    """The card's usage section (:func:`head_usage`), with the tree the figures were measured with, if any."""
    from decode.draft_length import is_tree_spec

    spec = info["best"].get("num_draft_tokens")
    tree = spec if is_tree_spec(spec) else None
    return head_usage(
        info["target"], repo_id, info["num_assistant_tokens"], tree, info.get("vllm_draft_sample_method"),
        info.get("verifier"), info.get("block_size"),
    )  # fmt: skip
