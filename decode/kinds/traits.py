"""What a draft kind is, declared once in its folder (``decode/kinds/<kind>/__init__.py``): the facts the recipe,
the decoder, the engines and the model card read about it. Plain values only, so the recipe reads them without
importing torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KindTraits:
    """One draft kind's facts."""

    name: str  # draft.kind, and the draftsmith.draft_kind a saved folder records
    title: str  # its human name in messages: "EAGLE-3 head", "DFlash draft"
    description: str  # what it is, with its article, for messages: "an EAGLE-3 head"
    block: bool  # a whole block per draft forward (else one forward per drafted token)
    reads_hidden_states: bool  # it drafts from the target's hidden states (built from the target, served next to it)
    # its context is the target's layer outputs at draft.aux_layers (1 or more: target_layer_ids, as DFlash names
    # them)
    layer_output_context: bool
    # a step can train the blocks at N anchors drawn per sequence (distill.anchors; distill.training.anchors)
    # instead of one at every position
    trains_anchors: bool
    loads_draft_model: bool  # draft.model is a model to load (else the draft is built from the target)
    hf_assisted: bool  # HF assisted generation can run it
    generates_rollouts: bool  # it can speed up the target's rollouts as a speculative draft
    folder_kinds: tuple[str, ...]  # the kinds of saved draft folder draft.model may hold (distill.kinds.folder_kind)
    vllm_method: str  # vLLM's speculative_config method that serves it
    vllm_parallel_drafting: bool  # vLLM serves it with parallel_drafting (its block in one forward)
    draft_tree: bool  # drafts a greedy tree (tree:TOPK,DEPTH,NODES; decode.tree): its decoding gives tree_drafter
    llamacpp_spec_type: str | None  # llama.cpp's speculative type that serves it; None: llama.cpp cannot
    recipe_keys: tuple[str, ...]  # the draft.* keys only the kinds that list them read (a key one kind lists: its own)
    # how llama.cpp's GGUF of it reads (decode.llamacpp tells a draft GGUF's kind by them): its general.architecture
    # (None: the architecture of a plain LM, any), and tensors only its GGUF has among that architecture's
    gguf_architecture: str | None = None
    gguf_tensors: tuple[str, ...] = ()
