"""A standalone draft: a small causal LM with the target's tokenizer.

Its folder: ``decoding`` (the model and its drafter in draftsmith's decoder), ``training`` (the training-side
kind, :class:`distill.kinds.interface.Kind`).
This file is torch-free: the recipe reads it.
"""

from decode.kinds.traits import KindTraits

TRAITS = KindTraits(
    name="standalone",
    title="standalone draft LM",
    description="a standalone draft LM",
    block=False,
    reads_hidden_states=False,
    layer_output_context=False,
    trains_anchors=False,
    loads_draft_model=True,
    hf_assisted=True,
    generates_rollouts=True,
    # a plain causal LM: a folder saved as any other kind (a head, a PARD or DFlash draft) is not one to train as a
    # chain
    folder_kinds=(),
    vllm_method="draft_model",
    vllm_parallel_drafting=False,
    draft_tree=False,
    llamacpp_spec_type="draft-simple",
    recipe_keys=(),
)
