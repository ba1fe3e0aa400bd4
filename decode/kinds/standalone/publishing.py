"""How a standalone draft is published (``distill.publishing``): a plain causal LM that HF assisted generation,
vLLM (``method: draft_model``) and SGLang (``STANDALONE``) take unchanged.

Every kind's ``publishing`` module gives the same names (``tests/test_kinds.py``): ``SERVED_FILES`` (the files
published as saved; none: the draft goes through transformers, merged and matched to the target's vocabulary),
``facts`` (what the card records of the published folder), ``made`` (what the card says the draft is),
``assistant_line`` (what its generation_config sets for HF assisted generation), ``vocab_line`` (what it drafts
from, None: its ``draft_vocab.json``) and ``usage`` (the card's launch lines). Torch-free.
"""

from __future__ import annotations

import json
from pathlib import Path

SERVED_FILES: tuple[str, ...] = ()  # published through transformers: merged, its vocabulary the target's


def sample_key(sample_method: str | None) -> dict:
    """The ``draft_sample_method`` a card's vLLM lines set: probabilistic (vLLM >= 0.32 drafts from q, which
    accepts more at T > 0) unless the recipe's eval.vllm_draft_sample_method is greedy (then vLLM's default)."""
    return {} if sample_method == "greedy" else {"draft_sample_method": "probabilistic"}


def vllm_spec(repo_id: str, gamma: int, sample_method: str | None = None) -> str:
    """vLLM's `--speculative-config` for a plain draft model (method draft_model, gamma tokens per round)."""
    spec = {"method": "draft_model", "model": repo_id, "num_speculative_tokens": gamma, **sample_key(sample_method)}
    return json.dumps(spec)


def vllm_serve(target: str, spec: str) -> list[str]:
    """A card's ``vllm serve`` lines with the speculative config ``spec``."""
    return ["vLLM:", "", "```bash", f"vllm serve {target} --speculative-config '{spec}'", "```"]


def facts(folder: Path, verifier: str | None, gamma: int, notes: list[str]) -> dict:
    """The card's facts of the draft published in ``folder``: a chain, no block."""
    return {"block_size": None}


def made(info: dict) -> str:
    """What the card's first sentence says the draft is."""
    return f"trained from **{info['base_model']}** with draftsmith ({info['method']})"


def assistant_line(info: dict) -> str:
    """What the published generation_config sets for HF assisted generation, and why."""
    chosen = info.get("generation_config") or {}
    if isinstance(chosen.get("assistant"), dict):
        return f"`{json.dumps(chosen['assistant'])}`: {chosen.get('why', '')}"
    return f"`num_assistant_tokens: {info['num_assistant_tokens']}` (the measured γ), constant, no early stop"


def vocab_line(info: dict, size: int) -> str | None:
    """None: draftsmith's decoder drafts from the run's ``draft_vocab.json``, the model keeps its full head."""
    return None


def usage(info: dict, repo_id: str) -> list[str]:
    """The card's usage section: HF assisted generation, vLLM's draft_model and SGLang's STANDALONE."""
    target, gamma = info["target"], info["num_assistant_tokens"]
    spec = vllm_spec(repo_id, gamma, info.get("vllm_draft_sample_method"))
    return [
        "## Usage",
        "",
        "Transformers (assisted generation; the draft's `generation_config.json` carries the measured γ):",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("{target}")',
        f'target = AutoModelForCausalLM.from_pretrained("{target}", dtype="auto", device_map="auto")',
        f'draft = AutoModelForCausalLM.from_pretrained("{repo_id}", dtype="auto", device_map="auto")',
        'inputs = tokenizer("The key idea of speculative decoding is", return_tensors="pt").to(target.device)',
        "out = target.generate(**inputs, assistant_model=draft, max_new_tokens=128, do_sample=False)",
        "print(tokenizer.decode(out[0], skip_special_tokens=True))",
        "```",
        "",
        *vllm_serve(target, spec),
        "",
        "```python",
        "from vllm import LLM, SamplingParams",
        "",
        f'llm = LLM(model="{target}", speculative_config={spec})',
        "params = SamplingParams(temperature=0, max_tokens=128)",
        'print(llm.generate(["The key idea of speculative decoding is"], params)[0].outputs[0].text)',
        "```",
        "",
        "SGLang:",
        "",
        "```bash",
        f"python -m sglang.launch_server --model-path {target} \\",
        f"    --speculative-algorithm STANDALONE --speculative-draft-model-path {repo_id} \\",
        f"    --speculative-num-steps {gamma} --speculative-eagle-topk 1 --speculative-num-draft-tokens {gamma + 1}",
        "```",
        "",
    ]
