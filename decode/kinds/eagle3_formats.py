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
one line naming what does not fit. Variants the native head runs: ``norm_before_fc`` (``input_norm``) and
``norm_before_residual``. Refused, each by name: ``fc_norm`` (one norm per fused layer), ``norm_output``
(speculators and vLLM: feed the post-norm output back; SpecForge uses the same key for "norm before lm_head", so
a flat config that sets it is ambiguous), several decoder layers, biases, a non-Llama layer (Qwen3's q/k norms).

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
# Variants the native head does not run: key -> what it means (read in speculators' and SpecForge's eagle3 code).
REFUSED = {
    "fc_norm": "one RMSNorm per fused target layer before fc",
    "norm_output": "the post-norm output fed back to the next step (speculators / vLLM; SpecForge's flat config "
    "uses the same key for the norm before lm_head)",
}
# Tensors of the target or of training only: never part of the served head.
NOT_HEAD = ("embed_tokens.", "verifier_lm_head.", "verifier_norm.")


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
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    fmt = detect(config, dict.fromkeys(tensor_names(directory)))
    converted = _from_speculators(config, {})[0] if fmt == "speculators" else _from_flat(config, fmt)
    _check_variants(converted, fmt)
    return fmt


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
    config = json.loads((directory / "config.json").read_text())
    tensors = load_tensors(directory)
    fmt = detect(config, tensors)
    if fmt == "speculators":
        config, tensors = _from_speculators(config, tensors)
    else:
        config = _from_flat(config, fmt)
    if fmt != "native":  # no ids: the layers vLLM, speculators and SafeAILab's code read by default
        config.setdefault("eagle_aux_hidden_state_layer_ids", default_aux_layers(num_target_layers))
    unused = NOT_HEAD if config.get("norm_before_fc") else (*NOT_HEAD, "input_norm.")  # vLLM skips it likewise
    tensors = {k: v for k, v in tensors.items() if not k.startswith(unused)}
    for key in PROVENANCE:
        config.pop(key, None)
    _check_variants(config, fmt)
    return config, tensors, fmt


def _from_flat(config: dict, fmt: str) -> dict:
    """The native config of a flat-layout head (native, SafeAILab or SpecForge)."""
    config = dict(config)
    config.setdefault("target_hidden_size", config["hidden_size"])
    if config.get("draft_vocab_size") is None:
        config["draft_vocab_size"] = config["vocab_size"]
    if fmt != "native":
        sglang_ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if sglang_ids and "eagle_aux_hidden_state_layer_ids" not in config:
            config["eagle_aux_hidden_state_layer_ids"] = [int(i) + 1 for i in sglang_ids]
        config.setdefault("norm_before_residual", False)  # the layer SGLang and SafeAILab's code run
    return config


def _from_speculators(config: dict, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """The native config and tensors of a speculators-format head (``layers.0.*`` -> ``midlayer.*``)."""
    kind = config.get("speculators_model_type")
    if kind not in ("eagle3", "peagle"):
        raise ValueError(
            f"speculators_model_type {kind!r}: draftsmith reads speculators heads of type 'eagle3' and 'peagle' only"
        )
    layer = dict(config["transformer_layer_config"])
    if layer.get("model_type", "llama") != "llama":
        raise ValueError(
            f"transformer_layer_config.model_type {layer.get('model_type')!r}: draftsmith's EAGLE-3 head is a Llama "
            "layer (a Qwen3 layer adds q/k norms it does not have)"
        )
    out = {k: v for k, v in layer.items() if k not in ("architectures", "model_type")}
    out["draft_vocab_size"] = config.get("draft_vocab_size") or layer["vocab_size"]
    out["target_hidden_size"] = config.get("target_hidden_size") or layer["hidden_size"]
    out["eagle_aux_hidden_state_layer_ids"] = config.get("eagle_aux_hidden_state_layer_ids")
    # Missing means what vLLM serves: its speculators reader defaults norm_before_residual to True.
    out["norm_before_residual"] = bool(config.get("norm_before_residual", True))
    for key in ("norm_before_fc", *REFUSED):
        out[key] = bool(config.get(key, False))
    if kind == "peagle":  # vLLM's reader defaults norm_before_residual to False for this type
        out["norm_before_residual"] = bool(config.get("norm_before_residual", False))
        out["mask_token_id"] = int(config["mask_token_id"])
        block = config.get("block_size") or config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
        out["block_size"] = int(block)
    if out["eagle_aux_hidden_state_layer_ids"] is None:
        out.pop("eagle_aux_hidden_state_layer_ids")
    prefix = "layers.0."
    renamed = {("midlayer." + k[len(prefix) :] if k.startswith(prefix) else k): v for k, v in tensors.items()}
    return out, renamed


def _check_variants(config: dict, fmt: str) -> None:
    """ValueError (one line, naming the field) for what the native head does not compute."""
    for key, meaning in REFUSED.items():
        if config.get(key):
            raise ValueError(
                f"{fmt} EAGLE-3 head sets {key}: true ({meaning}); draftsmith's head does not compute that variant"
            )
        config.pop(key, None)
    if int(config.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"num_hidden_layers: {config['num_hidden_layers']}: draftsmith's EAGLE-3 head has one layer")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ValueError(f"{key}: true: draftsmith's EAGLE-3 head has no biases")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r}: draftsmith's EAGLE-3 head runs a SiLU MLP")
    if not config.get("norm_before_fc"):
        config.pop("norm_before_fc", None)
