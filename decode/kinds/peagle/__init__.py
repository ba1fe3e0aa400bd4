"""A P-EAGLE head: an EAGLE-3 head that drafts a whole block in one forward from a learned mask feature.

Its folder: ``decoding`` (the model and its drafter in draftsmith's decoder), ``training`` (the training-side
kind, :class:`distill.kinds.interface.Kind`).
This file is torch-free: the recipe reads it.
"""

from decode.kinds.traits import KindTraits

TRAITS = KindTraits(
    name="peagle",
    title="P-EAGLE head",
    description="a P-EAGLE head",
    block=True,
    reads_hidden_states=True,
    layer_output_context=False,
    trains_anchors=False,
    loads_draft_model=False,
    hf_assisted=False,
    generates_rollouts=False,
    folder_kinds=("eagle3", "peagle"),  # an EAGLE-3 head gains a block, a P-EAGLE head is continued
    vllm_method="eagle3",
    vllm_parallel_drafting=True,
    draft_tree=False,
    llamacpp_spec_type=None,
    recipe_keys=("aux_layers", "block_size", "mask_token_id"),
)
