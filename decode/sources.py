"""Where models and tokenizers come from: a saved Hugging Face directory, a Hub id, or a single `.gguf` file.

    model = load_model("SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.bfloat16)   # dequantized to plain weights
    tok = load_tokenizer("SmolLM2-135M-Instruct.Q4_1.gguf")                       # vocab + chat template from it

A GGUF file (llama.cpp's format) holds the weights, the config and the tokenizer together; transformers reads it
with `gguf_file=` and dequantizes every tensor, so what comes back is an ordinary `PreTrainedModel` that trains,
decodes and `save_pretrained`s like any other. Only the architectures transformers knows how to map from GGUF
load; anything else is one `ValueError` line. The `gguf` package is needed only for GGUF files.
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path
from typing import Any, BinaryIO

GGUF_SUFFIX = ".gguf"
GGUF_INSTALL = "pip install gguf"


def is_gguf(name: str | Path) -> bool:
    """True when `name` names a GGUF file (by its suffix; it need not exist)."""
    return str(name).lower().endswith(GGUF_SUFFIX)


def _require_gguf_package(name: str, key: str) -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ValueError(f"{key} {name!r} is a GGUF file, which needs the gguf package: {GGUF_INSTALL}") from None


# llama.cpp's spellings that transformers renames to one of its GGUF architectures when it loads the file.
GGUF_ALIASES = {
    "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2",
    "t5encoder": "t5",
}  # fmt: skip
_NOT_ARCHITECTURES = {"general", "tokenizer"}  # sections of transformers' GGUF mapping, not model types


def supported_gguf_architectures() -> list[str]:
    """The `general.architecture` values transformers can turn into a model (llama.cpp's aliases included)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    known = set(GGUF_SUPPORTED_ARCHITECTURES) - _NOT_ARCHITECTURES
    return sorted(known | {alias for alias, name in GGUF_ALIASES.items() if name in known})


# GGUF key-value types: fixed sizes in bytes; 8 is a string, 9 an array (element type, count, elements).
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_architecture(path: str | Path) -> str:
    """The `general.architecture` string stored in a GGUF file's header (e.g. "llama"); "" if it has none.

    The header is read only up to that key (written first, as a rule), not through the token list after it:
    milliseconds instead of the seconds a full parse of a 49k-token vocabulary takes.

    Raises:
        ValueError: not a GGUF file (bad magic), or the header ends early.
    """
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError("bad magic: not a GGUF file")
        try:
            version, _, n_keys = struct.unpack("<IQQ", f.read(20))  # version, tensor count, key-value count
            if version not in (2, 3):  # big-endian or obsolete: gguf's full reader knows those
                return _parsed_architecture(path)
            for _ in range(n_keys):
                key = _gguf_string(f)
                kind = _gguf_u32(f)
                if key == "general.architecture" and kind == _GGUF_STRING:
                    return _gguf_string(f)
                _skip_gguf_value(f, kind)
        except struct.error:
            raise ValueError("the GGUF header ends early: the file is truncated") from None
    return ""


def _parsed_architecture(path: str | Path) -> str:
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("general.architecture")
    return "" if field is None else bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")


def _gguf_u32(f: BinaryIO) -> int:
    return struct.unpack("<I", f.read(4))[0]


def _gguf_string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", errors="replace")


def _skip_gguf_value(f: BinaryIO, kind: int) -> None:
    if kind == _GGUF_STRING:
        f.seek(struct.unpack("<Q", f.read(8))[0], 1)
    elif kind == _GGUF_ARRAY:
        element, count = struct.unpack("<IQ", f.read(12))
        if element in _GGUF_SIZES:
            f.seek(_GGUF_SIZES[element] * count, 1)
        else:
            for _ in range(count):
                _skip_gguf_value(f, element)
    elif kind in _GGUF_SIZES:
        f.seek(_GGUF_SIZES[kind], 1)
    else:
        raise ValueError(f"unknown GGUF value type {kind}")


def check_gguf(name: str | Path, key: str = "model") -> Path:
    """The GGUF file `name`, checked: it exists, `gguf` is installed, transformers maps its architecture.

    Raises:
        ValueError: one line naming `key`, the problem and the fix.
    """
    path = Path(name).expanduser()
    if not path.is_file():
        raise ValueError(f"{key} {str(name)!r}: no such GGUF file; fix the path")
    _require_gguf_package(str(name), key)
    try:
        arch = gguf_architecture(path)
    except (ValueError, OSError) as e:  # not a GGUF file at all (bad magic), or unreadable
        raise ValueError(
            f"{key} {str(name)!r} is not a readable GGUF file ({_first_line(e)}); re-download or convert it"
        ) from None
    supported = supported_gguf_architectures()
    if arch not in supported:
        raise ValueError(
            f"{key} {str(name)!r}: GGUF architecture {arch or '(none)'!r} cannot be loaded by transformers "
            f"(supported: {', '.join(supported)}); use a Hugging Face checkpoint of this model instead"
        )
    return path


def _split(path: Path) -> tuple[str, str]:
    """transformers takes a GGUF as (directory, file name)."""
    return str(path.parent), path.name


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _plain(model: Any) -> Any:
    """Forget that the weights came from a quantized file: dequantized, they are ordinary trainable parameters and
    `save_pretrained` writes plain safetensors (transformers refuses to serialize a GGUF-quantized model)."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    return model


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # org/name or a bare name


def resolve_model_path(name: str, key: str, revision: str | None = None) -> str:
    """A local model directory or a hub id that can be loaded now; else a one-line ValueError naming `key`.

    Args:
        name: the recipe value (`target.model`, `draft.model`, ...) or a command-line one (`--draft`).
        key: the recipe key or flag, used in the message.
        revision: hub revision, for the offline-cache check.
    """
    if not name:
        raise ValueError(f"{key} is empty: set it to a local model directory or a Hugging Face hub id")
    if is_gguf(name):
        return str(check_gguf(name, key))
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() and not (path / "tokenizer_config.json").is_file():
            raise ValueError(
                f"{key} {name!r} is a directory without config.json: point it at a saved Hugging Face model "
                "(the folder written by save_pretrained)"
            )
        return str(path)
    if path.exists():
        raise ValueError(f"{key} {name!r} is a file: point it at a model directory (with config.json) or a hub id")
    if not _HUB_ID.match(name) or name.startswith((".", "~")):
        raise ValueError(
            f"{key} {name!r} not found: no such directory (relative to {os.getcwd()}); fix the path or use a hub id"
        )
    from distill.publishing.hub import hub_offline

    if hub_offline():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json", revision=revision)
        if not isinstance(cached, str):
            cached = try_to_load_from_cache(name, "tokenizer_config.json", revision=revision)
        if not isinstance(cached, str):
            raise ValueError(
                f"{key} {name!r} not found: not a local directory, and as a hub id it is not in the local cache "
                f"while HF_HUB_OFFLINE=1; download it first (hf download {name}) or point {key} at a local copy"
            )
    return name


CODE_FILES = ("config.json", "tokenizer_config.json")  # where `auto_map` makes transformers import a model's .py


def shipped_code(name: str | Path, revision: str | None = None) -> str | None:
    """The file whose `auto_map` makes loading the model `name` import Python the model ships ("config.json" or
    "tokenizer_config.json"), or None. Read from a local folder, or from a Hub id's copy in the local cache (no
    download: an uncached id is loaded with `trust_remote_code=False`, which refuses its code anyway)."""
    import json

    if is_gguf(name):
        return None
    for file in CODE_FILES:
        path: Any = Path(name).expanduser() / file
        if not path.is_file() and _HUB_ID.match(str(name)):
            from huggingface_hub import try_to_load_from_cache

            path = try_to_load_from_cache(str(name), file, revision=revision)
        if not isinstance(path, str | Path) or not Path(path).is_file():
            continue
        try:
            config = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # unreadable: the loader says so in its own words
        if isinstance(config, dict) and config.get("auto_map"):
            return file
    return None


def check_remote_code(name: str | Path, key: str, trusted: bool, revision: str | None = None) -> None:
    """A model that ships code is loaded only when the command line trusts it (``--trust-remote-code``): never
    because the model's own files (or a recipe beside them) ask for it.

    Raises:
        ValueError: one line naming `key`, the file with `auto_map`, and the flag that runs the code.
    """
    file = None if trusted else shipped_code(name, revision)
    if file:
        raise ValueError(
            f"{key} {str(name)!r} ships Python code (auto_map in its {file}) that loading it would run: pass "
            "--trust-remote-code to run it (read the code first), or use a copy without auto_map"
        )


def load_config(name: str, *, key: str = "model", **kwargs: Any) -> Any:
    """`AutoConfig.from_pretrained(name, **kwargs)`, also for a `.gguf` file (from its header: no tensor is read)."""
    from transformers import AutoConfig

    if is_gguf(name):
        directory, file = _split(check_gguf(name, key))
        kwargs = {k: v for k, v in kwargs.items() if k != "revision"}  # a local file has no revisions
        try:
            return AutoConfig.from_pretrained(directory, gguf_file=file, **kwargs)
        except (OSError, ValueError, KeyError, NotImplementedError) as e:
            raise ValueError(f"{key} {name!r}: no config could be read from the GGUF file: {_first_line(e)}") from e
    try:
        return AutoConfig.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as e:
        raise ValueError(f"{key} {name!r}: no model config could be loaded: {_first_line(e)}") from e


class ConfigOnly:
    """A model known by its config alone, no weights: all that decode.compat's vocabulary check reads of it
    (the output width from `config.vocab_size`, the name for messages)."""

    def __init__(self, config: Any, name: str) -> None:
        self.config = config
        self.name_or_path = name


def config_only(name: str, *, key: str = "model", **kwargs: Any) -> ConfigOnly | None:
    """The model `name` by its config (:func:`load_config`), or None when the config does not give the output
    width (`vocab_size`): then only the loaded model can tell."""
    config = load_config(name, key=key, **kwargs)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ConfigOnly(config, name) if isinstance(getattr(text, "vocab_size", None), int) else None


def load_model(name: str, *, key: str = "model", **kwargs: Any) -> Any:
    """`AutoModelForCausalLM.from_pretrained(name, **kwargs)`, also for a `.gguf` file (dequantized).

    Args:
        name: a model directory, a Hub id or a `.gguf` file.
        key: how the error messages name the value (a recipe key or a flag).
        kwargs: passed to `from_pretrained` (`dtype`, `revision`, `quantization_config`, ...).
    """
    from transformers import AutoModelForCausalLM

    if is_gguf(name):
        from transformers import GgufConfig

        directory, file = _split(check_gguf(name, key))
        kwargs.setdefault("quantization_config", GgufConfig(dequantize=True))
        try:
            model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=file, **kwargs)
        except (OSError, ValueError, NotImplementedError) as e:
            raise ValueError(f"{key} {name!r}: the GGUF file could not be loaded: {_first_line(e)}") from e
        return _plain(model)
    try:
        return AutoModelForCausalLM.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as e:
        raise ValueError(f"{key} {name!r} could not be loaded: {_first_line(e)}") from e


def load_tokenizer(name: str, *, key: str = "tokenizer", **kwargs: Any) -> Any:
    """`AutoTokenizer.from_pretrained(name, **kwargs)`, also for a `.gguf` file (its vocabulary and template)."""
    from transformers import AutoTokenizer

    if is_gguf(name):
        directory, file = _split(check_gguf(name, key))
        kwargs = {k: v for k, v in kwargs.items() if k != "revision"}  # a local file has no revisions
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=file, **kwargs)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{key} {name!r}: no tokenizer could be read from the GGUF file: {_first_line(e)}") from e
        tokenizer.name_or_path = str(name)  # messages name it by its file, not by the folder it was read from
        return tokenizer
    try:
        return AutoTokenizer.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as e:
        raise ValueError(f"{key} {name!r}: no tokenizer could be loaded: {_first_line(e)}") from e
