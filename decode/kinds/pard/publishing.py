"""How a PARD draft is published (``distill.publishing``): a causal LM whose config.json keeps ``pard_token`` and
``block_size``, which vLLM's draft_model proposer drafts in parallel. The names are those of every kind's
``publishing`` module (``decode.kinds.standalone.publishing``). Torch-free."""

from __future__ import annotations

import json
from pathlib import Path

from decode.kinds.standalone import publishing as plain
from decode.kinds.standalone.publishing import SERVED_FILES, sample_key, vllm_serve, vocab_line

__all__ = ["SERVED_FILES", "assistant_line", "facts", "made", "usage", "vocab_line"]


def facts(folder: Path, verifier: str | None, gamma: int, notes: list[str]) -> dict:
    """The card's facts of the draft published in ``folder``: the tokens it drafts in one forward (vLLM
    parallel_drafting)."""
    config = json.loads((folder / "config.json").read_text())
    return {"block_size": int(config["block_size"]) if config.get("pard_token") is not None else None}


def made(info: dict) -> str:
    """What the card's first sentence says the draft is."""
    return f"a PARD draft (a block of {info['block_size']} tokens per forward) {plain.made(info)}"


def assistant_line(info: dict) -> str:
    """What the published generation_config sets for HF assisted generation: nothing that runs the block."""
    return "not for this draft: HF assisted generation would run a PARD draft as a chain, not its block"


def usage(info: dict, repo_id: str) -> list[str]:
    """The card's usage section: vLLM's draft_model with parallel drafting (at most its block); no HF assisted
    generation or SGLang line (both would run it as a chain, never reading its mask tokens)."""
    target, block = info["target"], info["block_size"]
    k = min(info["num_assistant_tokens"], block)
    spec = json.dumps({"method": "draft_model", "model": repo_id, "num_speculative_tokens": k,
                       "parallel_drafting": True, **sample_key(info.get("vllm_draft_sample_method"))})  # fmt: skip
    return [
        "## Usage",
        "",
        f"A PARD draft drafts up to {block} tokens in one forward: after the text it reads {block - 1} mask tokens "
        "(its config's `pard_token`) and proposes the next token and the ones after it at once. vLLM runs it with "
        "parallel drafting; `num_speculative_tokens` must not exceed the block.",
        "",
        *vllm_serve(target, spec),
        "",
        "```python",
        "from vllm import LLM, SamplingParams",
        "",
        f'llm = LLM(model="{target}", speculative_config={spec.replace("true", "True")})',
        "params = SamplingParams(temperature=0, max_tokens=128)",
        'print(llm.generate(["The key idea of speculative decoding is"], params)[0].outputs[0].text)',
        "```",
        "",
        "HF assisted generation (`generate(assistant_model=...)`) and SGLang have no parallel drafting: they would "
        "run it as a chain, one forward per token, never reading the mask tokens it was trained on.",
        "",
        "draftsmith's own decoder (a checkout of draftsmith):",
        "",
        "```bash",
        f"python -m decode bench --target {target} --draft {repo_id} --prompts PROMPTS.jsonl --num-draft-tokens {k} "
        "--baselines target",
        "```",
        "",
    ]
