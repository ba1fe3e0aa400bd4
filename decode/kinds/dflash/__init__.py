"""A DFlash draft: a few layers filling a whole block from the target's hidden states in one pass.

Its folder: ``decoding`` (the model and its drafter in draftsmith's decoder), ``training`` (the training-side
kind, :class:`distill.kinds.interface.Kind`).
This file is torch-free: the recipe reads it.
"""

from decode.kinds.traits import KindTraits

TRAITS = KindTraits(
    name="dflash",
    title="DFlash draft",
    description="a DFlash draft",
    block=True,
    reads_hidden_states=True,
    layer_output_context=True,
    trains_anchors=True,
    loads_draft_model=False,
    hf_assisted=False,
    generates_rollouts=False,
    folder_kinds=("dflash",),  # a DFlash draft to continue
    vllm_method="dflash",
    vllm_parallel_drafting=False,
    draft_tree=False,
    llamacpp_spec_type="draft-dflash",
    recipe_keys=("aux_layers", "block_size", "mask_token_id", "num_layers"),
    gguf_architecture="dflash",
)
