"""How an EAGLE-3 head becomes the GGUF llama.cpp serves (``--spec-type draft-eagle3``).

llama.cpp's converter (``conversion/llama.py``) takes a head for ``LlamaForCausalLMEagle3`` when its flat config
has ``draft_vocab_size`` and one layer, and reads the target's config and tokenizer (``--target-model-dir``). It
writes what llama.cpp's ``src/models/eagle3.cpp`` loads:

    eagle3.target_layers          eagle_aux_hidden_state_layer_ids: the *inputs* of those target layers, vLLM's ids
                                  (llama.cpp extracts llama_get_embeddings_layer_inp), draftsmith's too
    eagle3.target_hidden_size     target_hidden_size
    eagle3.norm_before_residual   the converter reads a missing key as false, vLLM's speculators reader as true, so
                                  the staged config states what draftsmith computes (``formats.read``)
    eagle3.norm_before_fc         input_norm over the fused features before fc
    d2t                           int64 draft-to-target offsets (target id - draft id): the converter adds the
                                  index and checks every id is in the target's vocabulary once; no d2t: the head
                                  drafts over the whole vocabulary

llama.cpp feeds the draft's pre-norm output back and has no per-layer norms of the fused features, so a head with
``norm_output`` or ``fc_norm`` is refused; the embedding is the target's (llama.cpp shares it). The staged folder
is a flat native config and the head's tensors in draftsmith's layout (``midlayer.*``), whatever layout it was
saved in (``decode.kinds.eagle3.formats``).
"""

from __future__ import annotations

import json
from pathlib import Path

# what llama.cpp's EAGLE-3 graph does not compute: the config key and why
UNSERVED = {
    "norm_output": "llama.cpp feeds the head's pre-norm output back to draft the next token, not the post-norm one",
    "fc_norm": "llama.cpp has no per-layer norms of the fused target features (fc_norm.0/1/2)",
    "mask_token_id": "llama.cpp drafts a chain, not a P-EAGLE block",
}


def _target_layers(target_dir: Path) -> int:
    config = json.loads((Path(target_dir) / "config.json").read_text())
    config = {**config, **(config.get("text_config") or {})}
    return int(config["num_hidden_layers"])


def check(folder: Path, target_dir: Path) -> None:
    """ValueError (one line) for a head llama.cpp would run otherwise than draftsmith (:data:`UNSERVED`)."""
    from decode.kinds.eagle3.formats import native_config

    config, _ = native_config(folder)
    for key, why in UNSERVED.items():
        if config.get(key) is not None and config.get(key) is not False:
            raise ValueError(f"EAGLE-3 head {folder} sets {key}: {why}; serve it with vLLM or draftsmith's decoder")


def staged_config(config: dict) -> dict:
    """The flat config the converter reads, every key it defaults stated (module docstring)."""
    from decode.kinds.eagle3.decoding import ARCHITECTURE
    from decode.kinds.eagle3.formats import PROVENANCE

    flat = {k: v for k, v in config.items() if k not in (*PROVENANCE, "eagle_config", "model_type")}
    rope = flat.get("rope_parameters") or {}
    flat.update(
        architectures=[ARCHITECTURE],
        model_type="llama",
        num_hidden_layers=1,
        draft_vocab_size=int(config["draft_vocab_size"]),
        target_hidden_size=int(config["target_hidden_size"]),
        eagle_aux_hidden_state_layer_ids=[int(a) for a in config["eagle_aux_hidden_state_layer_ids"]],
        norm_before_residual=bool(config.get("norm_before_residual", False)),
        norm_before_fc=bool(config.get("norm_before_fc", False)),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
    )
    return flat


def gguf_folder(folder: Path, staging: Path, target_dir: Path) -> Path:
    """``staging`` made the folder llama.cpp's converter reads: the flat config (:func:`staged_config`) and
    model.safetensors with ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t`` (offsets, int64) and, with
    ``norm_before_fc``, ``input_norm``. Returns ``staging``."""
    import torch
    from safetensors.torch import save_file

    from decode.kinds.eagle3.formats import read

    check(folder, target_dir)
    config, tensors, _ = read(folder, _target_layers(target_dir))
    tensors = {k: v for k, v in tensors.items() if k != "t2d"}  # the converter skips t2d; llama.cpp needs none
    rows = int(tensors["lm_head.weight"].shape[0])
    if rows != int(config["draft_vocab_size"]):
        raise ValueError(
            f"EAGLE-3 head {folder}: lm_head has {rows} rows, its config.json says draft_vocab_size "
            f"{config['draft_vocab_size']}; re-export the head"
        )
    if "d2t" in tensors:
        tensors["d2t"] = tensors["d2t"].to(torch.int64)
    staging = Path(staging)
    staging.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(staging / "model.safetensors"))
    (staging / "config.json").write_text(json.dumps(staged_config(config), indent=2) + "\n")
    return staging
