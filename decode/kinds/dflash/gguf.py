"""How a DFlash draft becomes the GGUF llama.cpp serves (``--spec-type draft-dflash``).

llama.cpp's converter (``conversion/qwen.py``, ``DFlashModel`` for ``DFlashDraftModel``) reads the saved layout
as it is and the target's tokenizer (``--target-model-dir``); it writes what ``src/models/dflash.cpp`` and
``common/speculative.cpp`` load:

    dflash.target_layers      dflash_config.target_layer_ids + 1: llama.cpp extracts the *input* of those target
                              layers, the output of draftsmith's ids (layer j's output is layer j + 1's input)
    dflash.block_size         block_size, K + 1 (the block counts its verified first position): llama.cpp drafts at
                              most block_size - 1 tokens and reads a block of 1 + --spec-draft-n-max positions
    tokenizer.ggml.mask_token_id   dflash_config.mask_token_id, the token of the block's drafted positions
    dflash.attention.causal   false: the block attends both ways (the converter writes it when stated)

No ``dflash.sample_from_anchor`` (a DSpark key): the first block position is the verified token and proposes
nothing, as draftsmith trains it. The embedding and output layer are the target's (llama.cpp shares them). The
staged folder is config.json with those keys stated in ``dflash_config`` and the weights, linked.
"""

from __future__ import annotations

import json
from pathlib import Path


def _config(folder: Path) -> dict:
    from decode.kinds.dflash.decoding import folder_config_dict

    raw = folder_config_dict(folder)
    if raw is None:
        raise ValueError(f"{folder} is not a DFlash draft folder (config.json with dflash_config)")
    return raw


def check(folder: Path, target_dir: Path) -> None:
    """ValueError (one line) for a folder that is not a DFlash draft draftsmith saved."""
    _config(Path(folder))


def staged_config(raw: dict) -> dict:
    """config.json as the converter reads it, the block, its layers, mask token and attention stated."""
    from decode.kinds.dflash.decoding import ARCHITECTURE

    config = {k: v for k, v in raw.items() if k != "draftsmith"}
    dflash = dict(raw["dflash_config"])
    dflash.update(
        mask_token_id=int(dflash["mask_token_id"]),
        target_layer_ids=[int(i) for i in dflash["target_layer_ids"]],
        block_size=int(raw["block_size"]),
        causal=False,
    )
    config.update(architectures=[ARCHITECTURE], model_type="qwen3", dflash_config=dflash)
    return config


def gguf_folder(folder: Path, staging: Path, target_dir: Path) -> Path:
    """``staging`` made the folder llama.cpp's converter reads: :func:`staged_config` and the weights (linked).
    Returns ``staging``."""
    from decode.kinds.dflash.decoding import WEIGHTS

    return stage(Path(folder), Path(staging), staged_config(_config(Path(folder))), WEIGHTS)


def stage(folder: Path, staging: Path, config: dict, weights: str) -> Path:
    """``staging`` made: ``config`` as its config.json, ``folder``'s weights file ``weights`` linked. Returns it."""
    staging.mkdir(parents=True, exist_ok=True)
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (staging / weights).symlink_to((folder / weights).resolve())
    return staging
