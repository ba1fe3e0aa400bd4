"""A DSpark draft: a DFlash block plus a low-rank Markov bias chained through it, and a confidence cut.

Its folder: ``decoding`` (the model and its drafter in draftsmith's decoder), ``training`` (the training-side
kind, :class:`distill.kinds.interface.Kind`).
This file is torch-free: the recipe reads it.
"""

from decode.kinds.traits import KindTraits

TRAITS = KindTraits(
    name="dspark",
    title="DSpark draft",
    description="a DSpark draft",
    block=True,
    reads_hidden_states=True,
    layer_output_context=True,
    trains_anchors=True,
    loads_draft_model=False,
    hf_assisted=False,
    generates_rollouts=False,
    folder_kinds=("dspark",),  # a DSpark draft to continue
    vllm_method="dspark",
    vllm_parallel_drafting=False,
    draft_tree=False,
    llamacpp_spec_type="draft-dspark",
    recipe_keys=("aux_layers", "block_size", "mask_token_id", "num_layers", "markov_rank", "confidence_min"),
    gguf_architecture="dflash",
    gguf_tensors=("markov_w1.weight",),  # its Markov head: a DFlash GGUF has none
)
