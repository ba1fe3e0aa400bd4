"""How a standalone draft becomes the GGUF llama.cpp serves (``--spec-type draft-simple``): a plain causal LM that
llama.cpp's converter reads as the architecture it is, with the tokenizer files it reads beside it.

A run's best/ holds the weights and config alone; a published folder has the target's tokenizer too. The draft is
trained with the target's tokenizer, and llama.cpp refuses a draft whose vocabulary differs from its target's, so a
folder without tokenizer files gets the target's. The weights are linked, not copied. Torch-free.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from decode.kinds.standalone import TRAITS

# what the converter reads of a tokenizer (its own vocabulary, merges, special tokens and chat template)
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
)  # fmt: skip
WEIGHTS = ("*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")


def check(folder: Path, target_dir: Path) -> None:
    """ValueError (one line) for a folder the converter cannot read as a draft LM: no config.json, no weights, or
    LoRA adapters alone (the converter needs the merged model)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        if (folder / "adapter_config.json").is_file():
            raise ValueError(
                f"{folder} holds LoRA adapters, not a merged {TRAITS.title}: export the run's best/ (merged) or a "
                "folder written by train/publish.py"
            )
        raise ValueError(f"{folder} has no config.json: point it at a saved draft (a run's best/ or a publish folder)")
    if not any(next(folder.glob(pattern), None) for pattern in WEIGHTS):
        raise ValueError(f"{folder} has config.json but no weights (model.safetensors): save the draft whole")


def tokenizer_source(folder: Path, target_dir: Path) -> Path:
    """Where the staged tokenizer comes from: the folder's own files, else the target's."""
    own = any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model"))
    return folder if own else target_dir


def gguf_folder(folder: Path, staging: Path, target_dir: Path) -> Path:
    """``staging`` made the folder llama.cpp's converter reads: config.json, the weights (linked) and the tokenizer
    files (:func:`tokenizer_source`). Returns ``staging``."""
    folder, staging = Path(folder), Path(staging)
    check(folder, target_dir)
    staging.mkdir(parents=True, exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for pattern in WEIGHTS:
        for path in folder.glob(pattern):
            (staging / path.name).symlink_to(path.resolve())
    source = tokenizer_source(folder, Path(target_dir))
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, staging / name)
    return staging
