"""An EAGLE-3 head: one layer over three of the target's hidden layers, drafting a chain.

Its folder: ``decoding`` (the model and its drafter in draftsmith's decoder), ``training`` (the training-side
kind, :class:`distill.kinds.interface.Kind`), ``formats`` (the head layouts others save) and ``train_step`` (the
unrolled head's step and the target's side it reads, which the other kinds over the target's states share).
This file is torch-free: the recipe reads it.
"""

from decode.kinds.traits import KindTraits

TRAITS = KindTraits(
    name="eagle3",
    title="EAGLE-3 head",
    description="an EAGLE-3 head",
    block=False,
    reads_hidden_states=True,
    layer_output_context=False,
    trains_anchors=False,
    loads_draft_model=False,
    hf_assisted=False,
    generates_rollouts=False,
    # an EAGLE-3 head to continue (a P-EAGLE head's block would be dropped: draft.kind=peagle)
    folder_kinds=("eagle3",),
    vllm_method="eagle3",
    vllm_parallel_drafting=False,
    draft_tree=True,
    llamacpp_spec_type="draft-eagle3",
    recipe_keys=("aux_layers",),
    gguf_architecture="eagle3",
)
