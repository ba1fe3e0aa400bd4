"""How a DSpark draft becomes the GGUF llama.cpp serves (``--spec-type draft-dspark``).

llama.cpp's converter (``conversion/qwen.py``, ``DSparkModel`` for ``DSparkSpeculator``) reads speculators'
dspark layout and the target's tokenizer (``--target-model-dir``); it writes DFlash's keys (see
``decode.kinds.dflash.gguf``) and two of its own:

    dflash.sample_from_anchor    false: the block's first position is the verified token and proposes nothing, its
                                 Markov bias chained from it (draftsmith's layout). The converter defaults a
                                 speculators config without the key to false and any other to true, so it is stated
    dflash.has_confidence_head   whether confidence_head.proj is there (llama.cpp cuts a block with it at
                                 --spec-draft-p-min, draftsmith's confidence_min)

and the tensors ``markov_head.markov_w1`` [V, r], ``markov_head.markov_w2`` [V, r], ``confidence_head.proj``
[1, H + r] (+ bias): llama.cpp biases block position k's logits by ``markov_w2 @ markov_w1[token k - 1]``, the
vanilla Markov head (only that one), and its confidence head reads [final-normed state; ``markov_w1[prev]``] as
draftsmith's does. ``dflash_config`` (mask token, target layer ids = aux_hidden_state_layer_ids - 1, block,
bidirectional attention) is stated rather than left to the converter's normalisation. Weights linked.
"""

from __future__ import annotations

from pathlib import Path


def _config(folder: Path) -> dict:
    """The folder's config.json, checked to be a layout llama.cpp runs as draftsmith does (one-line ValueError)."""
    from decode.kinds.dspark.decoding import dense_config, folder_config_dict

    raw = folder_config_dict(folder)
    if raw is None:
        raise ValueError(f"{folder} is not a DSpark draft folder (config.json with speculators_model_type dspark)")
    try:
        dense_config(raw)  # a vanilla Markov head, the anchor proposing nothing, a confidence head over [h; w1]
    except ValueError as err:
        raise ValueError(f"{folder}: {err}") from None
    return raw


def check(folder: Path, target_dir: Path) -> None:
    """ValueError (one line) for a folder that is not a DSpark draft of a layout llama.cpp runs as draftsmith."""
    _config(Path(folder))


def staged_config(raw: dict) -> dict:
    """config.json as the converter reads it, with every key it would otherwise default stated."""
    config = {k: v for k, v in raw.items() if k != "draftsmith"}
    config.update(
        sample_from_anchor=False,
        markov_head_type="vanilla",
        draft_vocab_size=int(raw.get("draft_vocab_size") or raw["transformer_layer_config"]["vocab_size"]),
        dflash_config={
            "mask_token_id": int(raw["mask_token_id"]),
            "target_layer_ids": [int(a) - 1 for a in raw["aux_hidden_state_layer_ids"]],
            "block_size": int(raw["block_size"]),
            "causal": False,
        },
    )
    return config


def gguf_folder(folder: Path, staging: Path, target_dir: Path) -> Path:
    """``staging`` made the folder llama.cpp's converter reads: :func:`staged_config` and the weights (linked).
    Returns ``staging``."""
    from decode.kinds.dflash.gguf import stage
    from decode.kinds.dspark.decoding import WEIGHTS

    return stage(Path(folder), Path(staging), staged_config(_config(Path(folder))), WEIGHTS)
