"""A PARD draft: a standalone draft LM that drafts a whole block in one forward from mask tokens.

Its folder: ``decoding`` (the model and its drafter in draftsmith's decoder), ``training`` (the training-side
kind, :class:`distill.kinds.interface.Kind`).
This file is torch-free: the recipe reads it.
"""

from decode.kinds.traits import KindTraits

TRAITS = KindTraits(
    name="pard",
    title="PARD draft",
    description="a PARD draft LM",
    block=True,
    reads_hidden_states=False,
    layer_output_context=False,
    trains_anchors=True,
    loads_draft_model=True,
    hf_assisted=False,  # HF assisted generation would run it as a chain: its mask positions unused
    generates_rollouts=True,
    folder_kinds=("pard",),  # a PARD draft to continue; a plain causal LM is read as any draft LM
    vllm_method="draft_model",
    vllm_parallel_drafting=True,
    draft_tree=False,
    llamacpp_spec_type=None,
    recipe_keys=("block_size", "mask_token_id"),
)
