"""How a DSpark draft is published (``distill.publishing``): its config.json (speculators' ``dspark`` layout) and
weights as saved, served by vLLM (``method: dspark``) next to the target; config.json's verifier names the
target's Hub id or nothing (never a path of this machine). The names are those of every kind's ``publishing``
module (``decode.kinds.standalone.publishing``). Torch-free at import."""

from __future__ import annotations

import json
from pathlib import Path

from decode.kinds.dspark import TRAITS

SERVED_FILES = ("config.json", "model.safetensors")  # as saved: its embedding and output layer are the target's


def facts(folder: Path, verifier: str | None, gamma: int, notes: list[str]) -> dict:
    """The card's facts of the draft published in ``folder``: its block, its layers, what they read, its Markov
    rank and confidence cut. config.json's speculators verifier is rewritten to name ``verifier`` (None: none)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    spec = config.get("speculators_config") or {}
    old = spec.get("verifier") or {}
    archs = (old.get("architectures") or []) if verifier else []
    spec["verifier"] = {"name_or_path": verifier, "architectures": list(archs)}
    config["speculators_config"] = spec
    path.write_text(json.dumps(config, indent=2) + "\n")
    layers = [int(a) - 1 for a in config.get("aux_hidden_state_layer_ids") or []]  # the target's layer outputs
    cut = (config.get("draftsmith") or {}).get("confidence_min")
    method = (
        f"{(config.get('transformer_layer_config') or {}).get('num_hidden_layers')} layer(s), target layers "
        f"{layers}, mask token {config.get('mask_token_id')}, Markov bias of rank {config.get('markov_rank')}"
    )
    if config.get("enable_confidence_head"):
        method += f", confidence head (cut {cut})"
    return {"block_size": int(config["block_size"]) - 1, "verifier": verifier, "method": method}


def made(info: dict) -> str:
    """What the card's first sentence says the draft is."""
    return (
        f"a DSpark draft (a block of {info['block_size']} tokens per forward) trained with draftsmith on the "
        f"target's own hidden states ({info['method']})"
    )


def assistant_line(info: dict) -> str:
    """What the published folder sets for HF assisted generation: nothing, it cannot run the draft."""
    return "none: HF assisted generation cannot run a DSpark draft"


def vocab_line(info: dict, size: int) -> str:
    """The draft drafts from the target's whole vocabulary, through the output layer it shares with the target."""
    return (
        f"- the draft drafts from the target's whole vocabulary ({size} tokens) through the target's own output "
        "layer, which it shares (no draft vocabulary of its own); vLLM and draftsmith's decoder draft alike"
    )


def usage(info: dict, repo_id: str) -> list[str]:
    """The card's usage section: what it is, vLLM's ``method: dspark`` with the trained block, draftsmith's bench
    and its Python loader; no HF assisted generation or SGLang line (neither runs it)."""
    target, block = info["target"], info["block_size"]
    gamma = min(int(info["num_assistant_tokens"]), int(block))
    spec = json.dumps({"method": TRAITS.vllm_method, "model": repo_id, "num_speculative_tokens": int(block)})
    return [
        "## Usage",
        "",
        f"A DSpark draft fills a block of up to {block} tokens in one forward from the target's hidden states, "
        "each position biased by a low-rank Markov term of the token before it; it shares the target's token "
        "embedding and output layer, so it runs inside an engine that serves it next to the target. HF assisted "
        "generation cannot run it (it takes a standalone causal LM), nor can `AutoModelForCausalLM.from_pretrained` "
        "load it alone.",
        "",
        "vLLM:",
        "",
        "```bash",
        f"vllm serve {target} --speculative-config '{spec}'",
        "```",
        "",
        f"`num_speculative_tokens` {block}, the block it was trained for: vLLM reads a block of 1 + that many "
        "positions, and a shorter one would show the draft's bidirectional block a width it was not trained on.",
        "",
        "draftsmith's own decoder (a checkout of draftsmith), from the command line or in Python:",
        "",
        "```bash",
        f"python -m decode bench --target {target} --draft {repo_id} --prompts PROMPTS.jsonl "
        f"--num-draft-tokens {gamma}",
        "```",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "from decode.kinds.dspark import decoding as dspark",
        "",
        f'target = AutoModelForCausalLM.from_pretrained("{target}", dtype="auto")',
        f'draft = dspark.load("{repo_id}", target)  # shares the target\'s embedding and output layer',
        "```",
        "",
    ]
