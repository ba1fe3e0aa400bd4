"""How a DFlash draft is published (``distill.publishing``): its config.json and weights as saved (vLLM's DFlash
layout), served by vLLM (``method: dflash``) next to the target. The names are those of every kind's
``publishing`` module (``decode.kinds.standalone.publishing``). Torch-free at import."""

from __future__ import annotations

import json
from pathlib import Path

SERVED_FILES = ("config.json", "model.safetensors")  # as saved: its embedding and output layer are the target's


def facts(folder: Path, verifier: str | None, gamma: int, notes: list[str]) -> dict:
    """The card's facts of the draft published in ``folder``: its block, its layers and what they read."""
    from decode.kinds.dflash.decoding import folder_block

    config = json.loads((folder / "config.json").read_text())
    dflash = config.get("dflash_config") or {}
    return {
        "block_size": folder_block(folder),  # the tokens it drafts in one forward (config block_size - 1)
        "verifier": None,
        "method": f"{config.get('num_hidden_layers')} layer(s), target layers {dflash.get('target_layer_ids')}, "
        f"mask token {dflash.get('mask_token_id')}",
    }


def made(info: dict) -> str:
    """What the card's first sentence says the draft is."""
    return (
        f"a DFlash draft (a block of {info['block_size']} tokens per forward) trained with draftsmith on the "
        f"target's own hidden states ({info['method']})"
    )


def assistant_line(info: dict) -> str:
    """What the published folder sets for HF assisted generation: nothing, it cannot run the draft."""
    return "none: HF assisted generation cannot run a DFlash draft"


def vocab_line(info: dict, size: int) -> str:
    """The draft drafts from the target's whole vocabulary, through the output layer it shares with the target."""
    return (
        f"- the draft drafts from the target's whole vocabulary ({size} tokens) through the target's own output "
        "layer, which it shares (no draft vocabulary of its own); vLLM and draftsmith's decoder draft alike"
    )


def usage(info: dict, repo_id: str) -> list[str]:
    """The card's usage section: what it is, then :func:`decode.kinds.dflash.decoding.usage` (vLLM's
    ``method: dflash`` and draftsmith; no HF assisted generation, no SGLang line)."""
    from decode.kinds.dflash import decoding

    block = info["block_size"]
    about = (
        f"A DFlash draft fills a block of up to {block} tokens in one forward from the target's hidden states; it "
        "shares the target's token embedding and output layer, so it runs inside an engine that serves it next to "
        "the target. HF assisted generation cannot run it (it takes a standalone causal LM), nor can "
        "`AutoModelForCausalLM.from_pretrained` load it alone."
    )
    lines = decoding.usage(info["target"], repo_id, info["num_assistant_tokens"], block)
    return ["## Usage", "", about, "", *lines]
