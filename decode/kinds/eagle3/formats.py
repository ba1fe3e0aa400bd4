"""EAGLE-3 heads as other trainers save them, read into draftsmith's native layout; the speculators keys written.

Four layouts hold the same one-layer head (``fc``, one Llama decoder layer over [embedding; features], ``norm``,
``lm_head`` over a draft vocabulary, ``d2t`` / ``t2d`` maps):

    native       draftsmith's: a flat Llama config (``LlamaForCausalLMEagle3``) with ``target_hidden_size``,
                 ``eagle_aux_hidden_state_layer_ids`` (vLLM's ids) and a ``draftsmith`` key; ``midlayer.*`` tensors
    speculators  vllm-project/speculators: ``speculators_model_type: eagle3``, the layer's config nested in
                 ``transformer_layer_config``, the head's own keys at the top, ``speculators_config`` (verifier and
                 proposal settings); ``layers.0.*`` tensors, often the target's ``embed_tokens`` too
    eagle        SafeAILab/EAGLE's original release: a flat Llama config with ``draft_vocab_size`` and no layer ids
                 (it reads the inputs of target layers 2, L//2 and L-3); ``midlayer.*`` tensors, often in
                 ``pytorch_model.bin`` and with the target's ``embed_tokens``
    specforge    sgl-project/SpecForge's SGLang export: the flat layout again, its layer ids (if any) in
                 ``eagle_config`` counted as SGLang does (the output of layer j = vLLM's id j + 1)

:func:`read` turns any of them into (config dict for ``LlamaConfig``, native state dict) or raises ValueError with
one line naming what does not fit (a missing or malformed key: the key, the format and the file). The native head
computes every variant vLLM's EAGLE-3 reader serves, in any combination (:data:`VARIANTS`; weights ``input_norm``,
``fc_norm.{0,1,2}``). A key left out means what vLLM reads it as: all False, except a speculators ``eagle3`` head's
``norm_before_residual`` (True, as vLLM's speculators reader defaults it). Refused, each by name: ``norm_output`` in
a flat SafeAILab / SpecForge config (SpecForge uses the same key for "norm before lm_head", so it is ambiguous
there), several decoder layers, biases, a non-Llama layer (Qwen3's q/k norms).

:func:`speculators_fields` are the keys written beside the native ones so that ``vllm serve HEAD`` (no speculative
flags) serves the head with its verifier: vLLM reads ``speculators_config`` for the target and the number of
speculative tokens, and since the config keeps ``model_type: llama`` it loads the head as it loads the native one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

FORMATS = ("native", "speculators", "eagle", "specforge")
# Config keys that say how a file was made, not what the head computes (dropped before LlamaConfig).
PROVENANCE = (
    "architectures", "torch_dtype", "dtype", "transformers_version", "draftsmith", "eagle_config",
    "speculators_model_type", "speculators_config", "speculators_version", "transformer_layer_config", "auto_map",
    "_name_or_path",
)  # fmt: skip
# The head's variants (config key -> what it computes), as vLLM's llama_eagle3 and speculators' Eagle3 read them.
VARIANTS = {
    "norm_before_fc": "one RMSNorm (input_norm) over the 3 fused target features before fc",
    "fc_norm": "one RMSNorm per fused target layer (fc_norm.0/1/2) before fc",
    "norm_before_residual": "the layer's residual stream starts from hidden_norm of its input",
    "norm_output": "the post-norm output, not the pre-norm one, fed back to draft the next token",
}
# A flat config's norm_output: SpecForge's key for the norm before lm_head, not the feedback vLLM means by it.
AMBIGUOUS = {"norm_output": "SpecForge's flat config uses the same key for the norm before lm_head"}
# Keys of the decoder layer's config without which LlamaConfig would take a default and mis-shape the head.
LAYER_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads")
# Tensors of the target or of training only: never part of the served head.
NOT_HEAD = ("embed_tokens.", "verifier_lm_head.", "verifier_norm.")
SPECULATORS_TYPES = ("eagle3", "peagle")  # the speculators_model_type values of the heads draftsmith reads


def block_of(config: dict) -> int | None:
    """The block a head's config.json says it drafts in one forward (a P-EAGLE head: ``mask_token_id`` and
    ``block_size``), or None for a head that drafts a chain (EAGLE-3)."""
    if config.get("mask_token_id") is None or not config.get("parallel_drafting", config.get("block_size")):
        return None
    return int(config.get("block_size") or 0) or None


def speculators_fields(
    config: dict, verifier: str, speculative_tokens: int, verifier_architectures: list[str], kind: str = "eagle3"
) -> dict:
    """The speculators keys of a native head's config.json (``config``, whose Llama keys are repeated as the
    ``transformer_layer_config`` vLLM requires): vLLM's ``LLM(model=HEAD)`` then loads ``verifier`` as the target
    and drafts ``speculative_tokens`` per step (greedy proposals: the only kind speculators names). ``kind``:
    ``eagle3``, or ``peagle`` for a P-EAGLE head (vLLM reads it as eagle3 with parallel drafting and takes the
    ``mask_token_id`` at the top level of ``config``)."""
    from transformers import LlamaConfig

    llama = set(LlamaConfig().to_dict()) - {"architectures", "transformers_version", "torch_dtype", "dtype"}
    layer = {k: v for k, v in config.items() if k in llama}
    greedy = {"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens), "verifier_accept_k": 1}
    return {
        "speculators_model_type": kind,
        "transformer_layer_config": {**layer, "model_type": "llama", "architectures": ["LlamaForCausalLM"]},
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{**greedy, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(verifier), "architectures": list(verifier_architectures)},
        },
    }


def verifier_name(model: str) -> str:
    """The verifier a saved head names: a local folder as its absolute path (``vllm serve`` resolves a relative one
    against its own working directory), anything else (a Hub id) as given."""
    return str(Path(model).resolve()) if Path(model).exists() else model


def verifier_architectures(verifier: str) -> list[str]:
    """The ``architectures`` of a local verifier's config.json ([] when it is not a readable local folder)."""
    try:
        return list(json.loads((Path(verifier) / "config.json").read_text()).get("architectures") or [])
    except (OSError, ValueError):
        return []


# ---------------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------------
def load_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder: model.safetensors, sharded safetensors (its index), or pytorch_model.bin."""
    if (directory / "model.safetensors").is_file():
        return load_file(str(directory / "model.safetensors"))
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for shard in shards for k, v in load_file(str(directory / shard)).items()}
    if (directory / "pytorch_model.bin").is_file():
        return torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ValueError(
        f"EAGLE-3 head {str(directory)!r} has no weights (model.safetensors, model.safetensors.index.json or "
        "pytorch_model.bin)"
    )


def tensor_names(directory: Path) -> list[str]:
    """The tensor names of the folder's weights, read without loading a safetensors file's data."""
    from safetensors import safe_open

    if (directory / "model.safetensors").is_file():
        with safe_open(str(directory / "model.safetensors"), "pt") as f:
            return list(f.keys())
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    return list(load_tensors(directory))


def check(directory: str | Path) -> str:
    """The format of the head in ``directory`` after the checks :func:`read` makes on its config (one-line
    ValueError otherwise), reading no tensor data: what a run checks before it writes anything."""
    return native_config(directory)[1]


def native_config(directory: str | Path) -> tuple[dict, str]:
    """(the head's config in the native layout, its format) after :func:`check`'s checks, reading no tensor data;
    left out of the file, ``eagle_aux_hidden_state_layer_ids`` stays absent (:func:`read` fills it in)."""
    directory = Path(directory)
    config = read_config(directory)
    fmt = detect(config, dict.fromkeys(tensor_names(directory)))
    return _native_config(config, fmt, directory / "config.json"), fmt


def read_config(directory: Path) -> dict:
    """The head's config.json as a dict, or ValueError (one line) naming the file."""
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"EAGLE-3 head {str(path)!r} is not valid JSON ({err}): re-export the head") from None
    if not isinstance(config, dict):
        raise ValueError(f"EAGLE-3 head {str(path)!r} holds a {type(config).__name__}, not a JSON object of keys")
    return config


def detect(config: dict, tensors: dict) -> str:
    """Which of :data:`FORMATS` ``config`` and ``tensors`` are, or ValueError naming the fields found."""
    flat = all(k in config for k in ("hidden_size", "num_attention_heads", "vocab_size"))
    if flat and any(k.startswith("midlayer.") for k in tensors):
        if "draftsmith" in config or "eagle_aux_hidden_state_layer_ids" in config:
            return "native"
        return "specforge" if "eagle_config" in config else "eagle"
    if config.get("speculators_model_type") is not None and isinstance(config.get("transformer_layer_config"), dict):
        return "speculators"
    prefixes = sorted({k.split(".")[0] for k in tensors})
    raise ValueError(
        f"not an EAGLE-3 head draftsmith reads (native, speculators, SafeAILab EAGLE-3 or SpecForge): config keys "
        f"{sorted(config)[:12]}, tensor prefixes {prefixes[:12]}"
    )


def default_aux_layers(num_layers: int) -> list[int]:
    """Low, middle and high layers as vLLM and SGLang pick them when a checkpoint names none: (2, L//2, L-3); on a
    target too shallow for three distinct ids there, the inputs of its last three layers."""
    ids = [2, num_layers // 2, num_layers - 3]
    return ids if ids[0] < ids[1] < ids[2] else [num_layers - 3, num_layers - 2, num_layers - 1]


def read(directory: str | Path, num_target_layers: int) -> tuple[dict, dict[str, torch.Tensor], str]:
    """(config dict for ``LlamaConfig``, state dict in the native layout, format name) of the head in
    ``directory``; the config carries ``draft_vocab_size``, ``target_hidden_size`` and vLLM's aux layer ids."""
    directory = Path(directory)
    config = read_config(directory)
    tensors = load_tensors(directory)
    fmt = detect(config, tensors)
    config = _native_config(config, fmt, directory / "config.json")
    if fmt == "speculators":  # layers.0.* -> midlayer.*
        prefix = "layers.0."
        tensors = {("midlayer." + k[len(prefix) :] if k.startswith(prefix) else k): v for k, v in tensors.items()}
    if fmt != "native":  # no ids: the layers vLLM, speculators and SafeAILab's code read by default
        config.setdefault("eagle_aux_hidden_state_layer_ids", default_aux_layers(num_target_layers))
    unused = NOT_HEAD if config.get("norm_before_fc") else (*NOT_HEAD, "input_norm.")  # vLLM skips it likewise
    tensors = {k: v for k, v in tensors.items() if not k.startswith(unused)}
    return config, tensors, fmt


def _native_config(config: dict, fmt: str, path: Path) -> dict:
    """The native config of a head of format ``fmt`` read from ``path`` (its config.json), checked: one-line
    ValueError naming the key, the format and the file for what is missing, malformed or not computed."""
    block = config.get("speculators_model_type") == "peagle" or config.get("mask_token_id") is not None
    where = f"{fmt} {'P-EAGLE' if block else 'EAGLE-3'} head {str(path)!r}"
    converted = _from_speculators(config, where) if fmt == "speculators" else _from_flat(config, fmt, where)
    for key in PROVENANCE:
        converted.pop(key, None)
    for key in ("draft_vocab_size", "target_hidden_size"):
        _int(converted, key, where, "the head's widths", low=1)
    aux = converted.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and (not isinstance(aux, list) or not all(type(a) is int for a in aux)):
        raise _wrong(where, "eagle_aux_hidden_state_layer_ids", aux, "a list of target layer ids")
    _check_variants(converted, fmt, where)
    return converted


def _lacks(where: str, key: str, what: str) -> ValueError:
    return ValueError(f"{where} lacks {key}: {what}; re-export the head with it")


def _wrong(where: str, key: str, value: object, what: str) -> ValueError:
    return ValueError(f"{where}: {key} is {value!r}, not {what}; re-export the head")


def _int(config: dict, key: str, where: str, what: str, low: int = 0, prefix: str = "") -> int:
    """``config[key]`` as an int >= ``low``, or ValueError naming ``prefix + key``."""
    if config.get(key) is None:
        raise _lacks(where, prefix + key, what)
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _wrong(where, prefix + key, value, f"an integer >= {low} ({what})")
    return value


def _flag(config: dict, key: str, default: bool, where: str) -> bool:
    """A variant's switch: true / false (or absent: ``default``), else ValueError naming it."""
    value = config.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _wrong(where, key, value, "true or false")
    return value


def _layer_keys(layer: dict, where: str, prefix: str = "") -> None:
    """The decoder layer's shape keys, each a positive integer (LlamaConfig's defaults would mis-shape the head)."""
    for key in LAYER_KEYS:
        _int(layer, key, where, "the draft layer's shape", low=1, prefix=prefix)


def _block(config: dict, out: dict, where: str, block: object) -> None:
    """A P-EAGLE head's ``mask_token_id`` and ``block_size`` (``block``: where the format keeps it) into ``out``."""
    out["mask_token_id"] = _int(config, "mask_token_id", where, "the token its drafted positions read")
    out["block_size"] = _int({"block_size": block}, "block_size", where, "the tokens it drafts per forward", low=1)


def _from_flat(config: dict, fmt: str, where: str) -> dict:
    """The native config of a flat-layout head (native, SafeAILab or SpecForge)."""
    config = dict(config)
    _layer_keys(config, where)
    config.setdefault("target_hidden_size", config["hidden_size"])
    if config.get("draft_vocab_size") is None:
        config["draft_vocab_size"] = config["vocab_size"]
    eagle_config = config.get("eagle_config") or {}
    if not isinstance(eagle_config, dict):
        raise _wrong(where, "eagle_config", eagle_config, "an object of keys")
    if fmt != "native":
        sglang_ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
        if sglang_ids and "eagle_aux_hidden_state_layer_ids" not in config:
            if not isinstance(sglang_ids, list) or not all(isinstance(i, int) for i in sglang_ids):
                raise _wrong(where, "eagle_config.eagle_aux_hidden_state_layer_ids", sglang_ids, "a list of ids")
            config["eagle_aux_hidden_state_layer_ids"] = [int(i) + 1 for i in sglang_ids]
    if "norm_before_fc" in eagle_config:  # vLLM reads it there first
        config["norm_before_fc"] = _flag(eagle_config, "norm_before_fc", False, where)
    for key in VARIANTS:
        config[key] = _flag(config, key, False, where)
    if config.get("mask_token_id") is not None:
        _block(config, config, where, config.get("block_size"))
    return config


def _from_speculators(config: dict, where: str) -> dict:
    """The native config of a speculators-format head: the layer's keys from ``transformer_layer_config``, the
    head's own and its variants (defaults as vLLM's speculators reader takes them) from the top level."""
    kind = config.get("speculators_model_type")
    if kind not in SPECULATORS_TYPES:
        raise ValueError(
            f"speculators_model_type {kind!r}: draftsmith reads speculators heads of type 'eagle3' and 'peagle' only"
        )
    layer = dict(config["transformer_layer_config"])
    if layer.get("model_type", "llama") != "llama":
        raise ValueError(
            f"transformer_layer_config.model_type {layer.get('model_type')!r}: draftsmith's EAGLE-3 head is a Llama "
            "layer (a Qwen3 layer adds q/k norms it does not have)"
        )
    _layer_keys(layer, where, prefix="transformer_layer_config.")
    out = {k: v for k, v in layer.items() if k not in ("architectures", "model_type")}
    out["draft_vocab_size"] = config.get("draft_vocab_size") or layer["vocab_size"]
    out["target_hidden_size"] = config.get("target_hidden_size") or layer["hidden_size"]
    if config.get("eagle_aux_hidden_state_layer_ids") is not None:
        out["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"]
    # vLLM's reader defaults norm_before_residual to True for eagle3 and to False for peagle; the rest to False.
    for key in VARIANTS:
        out[key] = _flag(config, key, key == "norm_before_residual" and kind == "eagle3", where)
    if kind == "peagle":
        block = config.get("block_size")
        if block is None:  # the speculative tokens its proposal method names
            spec = config.get("speculators_config")
            methods = spec.get("proposal_methods") if isinstance(spec, dict) else None
            if not isinstance(methods, list) or not methods or not isinstance(methods[0], dict):
                raise _lacks(where, "block_size", "no block_size and no speculators_config.proposal_methods[0]")
            block = methods[0].get("speculative_tokens")
            if block is None:
                raise _lacks(where, "block_size", "no block_size and no speculative_tokens in its proposal method")
        _block(config, out, where, block)
    return out


def _check_variants(config: dict, fmt: str, where: str) -> None:
    """ValueError (one line, naming the field) for what the native head does not compute; a variant left off is
    dropped from the config (what vLLM reads as off)."""
    if fmt in ("eagle", "specforge"):
        for key, meaning in AMBIGUOUS.items():
            if config.get(key):
                raise ValueError(
                    f"{where} sets {key}: true ({meaning}); draftsmith cannot tell which computation it means"
                )
    if int(config.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"num_hidden_layers: {config['num_hidden_layers']}: draftsmith's EAGLE-3 head has one layer")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ValueError(f"{key}: true: draftsmith's EAGLE-3 head has no biases")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r}: draftsmith's EAGLE-3 head runs a SiLU MLP")
    for key in VARIANTS:
        if key != "norm_before_residual" and not config.get(key):
            config.pop(key, None)
