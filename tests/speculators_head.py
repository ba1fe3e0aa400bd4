"""Writes an EAGLE-3 head with vllm-project/speculators' own classes, and what its forward computes.

Run by tests/test_eagle3_formats.py in a subprocess, under an interpreter where ``speculators`` imports (its
dependencies pin another torch than draftsmith's, so it lives in a separate environment, named by
``SPECULATORS_PYTHON``):

    python tests/speculators_head.py TARGET HEADS_JSON

builds, for each OUT: FLAGS of HEADS_JSON, an ``Eagle3DraftModel`` (a one-layer Llama head over aux layers 1, 2, 3
and every 2nd token of TARGET's vocabulary, with the variant flags FLAGS names) with random weights, saves it with
``save_pretrained`` into the folder OUT, and writes OUT/reference.pt: the inputs (``input_ids`` [1, S],
``hidden_states`` [1, S, 3H], ``position_ids``) and the draft logits of each of the 3 training-time-test steps of
its forward over them.
"""

from __future__ import annotations

import json
import sys

import torch
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import AutoConfig

STEPS = 3
LENGTH = 12


def build(target: str, flags: dict) -> Eagle3DraftModel:
    layer = AutoConfig.from_pretrained(target)
    layer.num_hidden_layers = 1
    layer._attn_implementation = "eager"  # flex attention needs a GPU
    proposal = GreedyTokenProposalConfig(speculative_tokens=STEPS)
    spec = SpeculatorsConfig(
        algorithm="eagle3",
        proposal_methods=[proposal],
        default_proposal_method="greedy",
        verifier=VerifierConfig.from_config(AutoConfig.from_pretrained(target), name_or_path=target),
    )
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=layer.vocab_size // 2,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=spec,
        **flags,
    )
    torch.manual_seed(0)
    model = Eagle3DraftModel(config).float().eval()
    from safetensors.torch import load_file

    embed = load_file(f"{target}/model.safetensors")["model.embed_tokens.weight"]
    with torch.no_grad():  # varied weights, as a trained head has (norm weights around 1)
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + 1.0 if p.dim() == 1 else torch.randn_like(p) * 0.2)
        model.embed_tokens.weight.copy_(embed)
        ids = torch.arange(0, layer.vocab_size, 2)
        model.d2t.copy_(ids - torch.arange(len(ids)))
        model.t2d.zero_()
        model.t2d[ids] = True
    return model


def reference(model: Eagle3DraftModel) -> dict:
    """Inputs and the draft logits [S, Vd] of each unrolled step of the model's own forward."""
    torch.manual_seed(1)
    width = 3 * model.config.transformer_layer_config.hidden_size
    inputs = {
        "input_ids": torch.randint(0, model.config.transformer_layer_config.vocab_size, (1, LENGTH)),
        "hidden_states": torch.randn(1, LENGTH, width) * 2,
        "position_ids": torch.arange(LENGTH)[None],
    }
    logits = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: logits.append(out[0].detach().clone()))
    with torch.no_grad():
        model(**inputs, document_ids=torch.zeros(1, LENGTH, dtype=torch.long), ttt_steps=STEPS)
    hook.remove()
    return {**inputs, "logits": logits}


def main() -> None:
    target, heads = sys.argv[1], json.loads(sys.argv[2])
    for out, flags in heads.items():  # one process: importing speculators takes most of the time
        model = build(target, flags)
        model.save_pretrained(out)
        torch.save(reference(model), f"{out}/reference.pt")


if __name__ == "__main__":
    main()
