"""Load the frozen target and the trainable draft (full, LoRA, QLoRA), check they share a vocabulary, export.

    target = load_target(recipe.target, device)           # eval, no grad; bf16/fp32/fp16 or 4/8-bit
    draft = load_draft(recipe.draft, device)              # train mode; full weights or a peft LoRA model
    tok = load_tokenizer(recipe.target.model)             # pad = eos if missing, left padding
    vocab = check_compatible(target, draft, tok, load_tokenizer(recipe.draft.model))
    plain = export_draft(draft)                           # merged copy; save_pretrained -> AutoModelForCausalLM

Every user-facing failure (missing path, hub id while offline, quantized draft without LoRA) is a ValueError
with a one-line message that names the recipe key and the fix.

dtype "auto": the target loads in bfloat16 on CUDA (float16 where the GPU lacks bf16) and on a CPU with native
bf16 matmuls (AVX512-BF16/AMX: there a multi-token verify forward is ~1.5x cheaper than in float32), else in
float32; a LoRA draft's frozen base loads in float32 on CPU, bfloat16 on CUDA. A *fully* trained draft loads
in float32 everywhere: these are AdamW's master weights; `train.mixed_precision=auto` computes in bf16 where
the hardware runs it natively (bf16 elsewhere is emulated, ~50x slower on an AVX2-only CPU).
An explicit dtype is always obeyed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import BitsAndBytesConfig, PreTrainedModel

from decode import sources
from decode.compat import check_vocab_compatible, cpu_has_native_bf16
from decode.sources import resolve_model_path
from distill.config import ModelConfig, QuantConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------- resolution: paths, hub ids, devices, dtypes


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """`device`, or CUDA when available, else CPU; a bare "cuda" gets the current device's index (device_map)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(dtype: str, device: torch.device, frozen: bool = False) -> torch.dtype:
    """Recipe dtype name -> torch dtype; "auto": bfloat16 on CUDA (float16 without bf16); on CPU float32, or
    bfloat16 for a ``frozen`` model (the target) where the CPU has native bf16 matmuls (cheap verification)."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(_DTYPES)}")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.bfloat16 if frozen and cpu_has_native_bf16() else torch.float32
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def resolve_mixed_precision(mixed_precision: str | None) -> str | None:
    """'auto' -> 'bf16' where bf16 matmuls are fast (CUDA with bf16, or a CPU with AVX512-BF16 / AMX), else 'no'.

    Elsewhere bf16 is emulated: on a CPU with AVX2 only, a bf16 matmul measured ~50x slower than float32."""
    if mixed_precision != "auto":
        return mixed_precision
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    return "bf16" if cpu_has_native_bf16() else "no"


def slow_bf16_warning(mixed_precision: str | None) -> str | None:
    """One line for a run asked for bf16 on a CPU that only emulates it (and no GPU); None where bf16 is fine."""
    if mixed_precision != "bf16" or torch.cuda.is_available() or cpu_has_native_bf16():
        return None
    return (
        "warning: mixed precision bf16 on a CPU without AVX512-BF16/AMX is emulated (~50x slower matmuls than "
        "float32): set train.mixed_precision=auto (or no)"
    )


def bnb_config(quant: QuantConfig) -> BitsAndBytesConfig | None:
    """The recipe's `quantization` section as transformers' BitsAndBytesConfig (same names), None if off."""
    if quant.load_in_4bit:
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quant.bnb_4bit_quant_type,
            bnb_4bit_compute_dtype=_DTYPES[quant.bnb_4bit_compute_dtype],
            bnb_4bit_use_double_quant=quant.bnb_4bit_use_double_quant,
        )
    if quant.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def _load_causal_lm(cfg: ModelConfig, key: str, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    name = resolve_model_path(cfg.model, key, cfg.revision)
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": cfg.trust_remote_code}
    if cfg.revision is not None:
        kwargs["revision"] = cfg.revision
    if cfg.attn_implementation is not None:
        kwargs["attn_implementation"] = cfg.attn_implementation
    quant = bnb_config(cfg.quantization)
    if quant is not None:
        # bitsandbytes places the weights while quantizing them: the whole model on this process's device
        kwargs["quantization_config"] = quant
        kwargs["device_map"] = {"": device}
    model = sources.load_model(name, key=key, **kwargs)  # a .gguf file is dequantized on load
    if quant is None:
        model.to(device)
    return model


def context_length(*models: nn.Module) -> int | None:
    """The positions every model accepts (the smallest max_position_embeddings or equivalent); None if unknown."""
    from decode.compat import context_length as model_context  # one definition for training and decoding

    known = [n for n in (model_context(m) for m in models) if n is not None]
    return min(known) if known else None


# ---------------------------------------------------------------- loading


def _checkpointing(model: PreTrainedModel, enable: bool) -> None:
    """Turn activation (gradient) checkpointing on (non-reentrant) or off, by transformers 5's name if it has it."""
    if enable:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def load_target(cfg: ModelConfig, device: str | torch.device | None = None) -> PreTrainedModel:
    """The frozen target: eval mode, every parameter `requires_grad=False`.

    Args:
        cfg: `recipe.target`: path or hub id, dtype, optional bitsandbytes quantization (4-bit NF4/FP4 with a
            compute dtype and optional double quantization, or 8-bit).
        device: where to put it (default: CUDA if available, else CPU); with accelerate, `accelerator.device`.
    """
    if cfg.lora.enabled:
        raise ValueError("target.lora.enabled: the target is frozen; LoRA adapters apply to the draft only")
    device = resolve_device(device)
    model = _load_causal_lm(cfg, "target.model", device, resolve_dtype(cfg.dtype, device, frozen=True))
    model.eval()
    model.requires_grad_(False)
    return model


def _peft_lora_config(cfg: ModelConfig) -> Any:
    from peft import LoraConfig as PeftLoraConfig

    modules = cfg.lora.target_modules
    return PeftLoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules="all-linear" if modules == ["all-linear"] else list(modules),
        task_type="CAUSAL_LM",
    )


def _keep_cpu_4bit_layout(model: nn.Module) -> None:
    """Stop bitsandbytes from repacking a *trained* model's 4-bit weights for its CPU inference kernel.

    On CPUs with AVX512-BF16, bitsandbytes (0.48+) repacks a Linear4bit's weight in place at its first eval-mode
    forward (absmax rounded to bf16) and from then on runs that layer through an inference-only kernel, in train
    mode too: the gradient no longer flows through the frozen 4-bit layers, so every LoRA adapter below the last
    layer gets a wrong gradient after the first evaluation. The frozen target may keep the fast kernel.
    """
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def load_draft(
    cfg: ModelConfig, device: str | torch.device | None = None, *, gradient_checkpointing: bool = False
) -> nn.Module:
    """The trainable draft, in train mode.

    * `lora.enabled: false`: every weight trains (a `PreTrainedModel`; dtype "auto" = float32, see module doc).
    * `lora.enabled: true`: a peft `PeftModelForCausalLM`, only the adapters train (r, alpha, dropout,
      target_modules; `['all-linear']` = every linear layer but the output head).
    * `lora` + `quantization.load_in_4bit` (or 8-bit): QLoRA, the base quantized by bitsandbytes and prepared with
      `prepare_model_for_kbit_training` (norms and embeddings in float32, input grads for checkpointing).

    Args:
        cfg: `recipe.draft`.
        device: as for :func:`load_target`.
        gradient_checkpointing: recompute activations in backward (`train.gradient_checkpointing`).
    """
    device = resolve_device(device)
    quantized = cfg.quantization.enabled
    if quantized and not cfg.lora.enabled:
        raise ValueError(
            "draft.quantization: quantized weights cannot be trained directly; set draft.lora.enabled=true (QLoRA) "
            "or turn draft.quantization off"
        )
    dtype = resolve_dtype(cfg.dtype, device)
    if cfg.dtype == "auto" and not cfg.lora.enabled:
        dtype = torch.float32  # AdamW master weights
    model = _load_causal_lm(cfg, "draft.model", device, dtype)
    if cfg.lora.enabled:
        from peft import get_peft_model, prepare_model_for_kbit_training

        if quantized:
            _keep_cpu_4bit_layout(model)
            model = prepare_model_for_kbit_training(
                model,
                use_gradient_checkpointing=gradient_checkpointing,
                gradient_checkpointing_kwargs={"use_reentrant": False},
            )
        elif gradient_checkpointing:
            _checkpointing(model, True)
        model = get_peft_model(model, _peft_lora_config(cfg))
    elif gradient_checkpointing:
        _checkpointing(model, True)
    model.train()
    return model


def load_tokenizer(path: str, cfg: ModelConfig | None = None, *, key: str = "tokenizer") -> Any:
    """The tokenizer at `path` (a model dir, hub id or `.gguf` file), ready for batched generation.

    `cfg` (the model's recipe section) supplies `revision` and `trust_remote_code`. A missing pad token is set
    to the EOS token (pad == eos is harmless here: masks are never built from token ids, see distill.data.prompts), and
    padding is on the left, as decoder-only generation needs.
    """
    revision = cfg.revision if cfg is not None else None
    trust_remote_code = cfg.trust_remote_code if cfg is not None else False
    name = resolve_model_path(path, key, revision)
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if revision is not None:
        kwargs["revision"] = revision
    tok = sources.load_tokenizer(name, key=key, **kwargs)
    if tok.pad_token_id is None:
        if tok.eos_token is None:
            raise ValueError(f"{key} {path!r}: the tokenizer has neither a pad nor an eos token; add one")
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def check_compatible(target: nn.Module, draft: nn.Module, target_tokenizer: Any, draft_tokenizer: Any) -> int:
    """The vocabulary size the two models share, via the decoder's check (one rule for training and decoding).

    A target whose embedding is padded beyond its tokenizer (Qwen2.5-7B: 152064 rows, Qwen2.5-0.5B: 151936) is
    compatible on the shared id range; a real mismatch raises a ValueError naming both tokenizers and the first
    differing token. Pass the returned size as `vocab_size` to the losses.
    """
    return int(check_vocab_compatible(target, draft, target_tokenizer, draft_tokenizer))


# ---------------------------------------------------------------- export


def _dense_weight(layer: nn.Module) -> torch.Tensor:
    """A linear layer's weight as a float32 [out, in] tensor, dequantized if bitsandbytes quantized it."""
    weight = layer.weight
    cls_name = type(weight).__name__
    if cls_name == "Params4bit":
        import bitsandbytes.functional as bnbf

        data, state = weight.data, weight.quant_state
        if getattr(state, "packing_format_for_cpu", False):
            # bitsandbytes repacked this layer for its AVX512-BF16 CPU kernel at an eval-mode forward (see
            # _keep_cpu_4bit_layout). Its inverse restores the nibble order but leaves absmax in the packed
            # [K / blocksize, N] bf16 layout, so rebuild a plain state; shallow copies leave the layer untouched.
            data, _ = bnbf._convert_weight_packed_for_cpu_inverse(data, copy.copy(state))
            state = copy.copy(state)
            state.absmax = weight.quant_state.absmax.T.reshape(-1).float()
            state.nested, state.packing_format_for_cpu = False, False
            state.dtype = getattr(state, "original_dtype", torch.float32)
        return bnbf.dequantize_4bit(data, state).float()
    if weight.dtype == torch.int8:
        from peft.utils.integrations import dequantize_bnb_weight

        return dequantize_bnb_weight(weight, state=getattr(layer, "state", None)).float()
    return weight.detach().float()


def _dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out_features, in_features = weight.shape
    dense = nn.Linear(in_features, out_features, bias=bias is not None, device=weight.device)
    dense.weight.data.copy_(weight)
    if bias is not None:
        dense.bias.data.copy_(bias.detach().float())
    return dense


def _densify(model: nn.Module) -> None:
    """Replace every peft LoRA layer by a float32 nn.Linear holding dequantized base + delta, then every other
    bitsandbytes layer by its dequantized nn.Linear. In place.

    peft's own merge into a 4-bit layer re-quantizes the sum, which rounds most of a LoRA delta away (the delta
    is usually smaller than an NF4 quantization step); merging in float avoids that.
    """
    import bitsandbytes as bnb
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            weight = _dense_weight(base)
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    weight = weight + module.get_delta_weight(adapter).float()
            model.set_submodule(name, _dense_linear(weight, base.bias))
    for name, module in list(model.named_modules()):
        if isinstance(module, bnb.nn.Linear4bit | bnb.nn.Linear8bitLt):
            model.set_submodule(name, _dense_linear(_dense_weight(module), module.bias))


def export_draft(draft: nn.Module, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """A plain `PreTrainedModel` for `save_pretrained`: loads with AutoModelForCausalLM, works as `assistant_model`.

    * full draft: returned as is (the same object, nothing copied), or a cast copy when `dtype` differs.
    * LoRA draft: a merged copy (`merge_and_unload` on a deep copy; the training draft keeps its adapters).
    * QLoRA draft: a copy with the base dequantized and the adapters merged in float, no quantization config.

    Args:
        draft: what :func:`load_draft` returned (unwrap accelerate's wrapper first: `accelerator.unwrap_model`).
        dtype: cast the export to this dtype (None: LoRA keeps the base dtype; QLoRA gets the 4-bit compute dtype).
    """
    from peft import PeftModel

    if not isinstance(draft, PeftModel):
        if getattr(draft, "is_quantized", False):
            raise ValueError(
                "export_draft: a quantized draft without LoRA cannot have been trained; nothing to export"
            )
        if dtype is None or dtype == draft.dtype:
            return draft
        return copy.deepcopy(draft).to(dtype).eval()  # never cast the model being trained

    model = copy.deepcopy(draft)
    base = model.get_base_model()
    quantizer = getattr(base, "hf_quantizer", None)
    if quantizer is None:
        plain = model.merge_and_unload()
    else:
        compute = getattr(quantizer.quantization_config, "bnb_4bit_compute_dtype", None)
        dtype = dtype or (compute if isinstance(compute, torch.dtype) else torch.float16)
        plain = model.base_model.model
        _densify(plain)
        quantizer.remove_quantization_config(plain)
    if plain.supports_gradient_checkpointing:
        _checkpointing(plain, False)
    if hasattr(plain, "disable_input_require_grads"):
        try:
            plain.disable_input_require_grads()
        except AttributeError:  # no hook was registered
            pass
    if dtype is not None:
        plain.to(dtype)
    plain.requires_grad_(False)
    plain.eval()
    return plain


def save_draft(draft: nn.Module, directory: str | Path, tokenizer: Any = None) -> Path:
    """Write a checkpoint of the draft: a plain HF model dir (merged if LoRA, loadable with AutoModelForCausalLM),
    the tokenizer, and for a LoRA draft the adapter alone under `adapter/` (peft format, small).

    Args:
        draft: what :func:`load_draft` returned, unwrapped (`accelerator.unwrap_model`).
        directory: created if needed; files in it are overwritten (write into a temporary dir and rename for
            atomicity, e.g. distill.training.checkpoints.atomic_dir).
    """
    from peft import PeftModel

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    export_draft(draft).save_pretrained(directory)
    if isinstance(draft, PeftModel):
        draft.save_pretrained(directory / "adapter")
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory


def check_hidden_states(target_config: Any, cfg: ModelConfig, why: str) -> None:
    """The target's forward returns its per-layer hidden states, for a draft kind that reads them (`why`).

    Probed on one token of a weightless copy of the target (its class built from its config on the meta device):
    no weights are read. A forward that cannot run on the meta device is left to the loaded model's checks.

    Raises:
        ValueError: the forward gives no `hidden_states`, or not one per layer plus the embeddings.
    """
    import torch
    from transformers import AutoModelForCausalLM

    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    layers = text.num_hidden_layers
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(target_config, trust_remote_code=cfg.trust_remote_code)
            out = model(input_ids=torch.zeros(1, 1, dtype=torch.long), output_hidden_states=True)
    except Exception:  # noqa: BLE001 - an op with no meta kernel says nothing about the outputs: unknown, not bad
        return
    states = getattr(out, "hidden_states", None)
    if not isinstance(states, tuple | list) or len(states) != layers + 1:
        got = f"{len(states)}" if isinstance(states, tuple | list) else "no"
        raise ValueError(
            f"target.model {cfg.model!r} ({type(model).__name__}): its forward returns {got} hidden states with "
            f"output_hidden_states=True, not the {layers + 1} (the embeddings and each of its {layers} layers) "
            f"that {why} reads: use a target class that returns them, or draft.kind=standalone"
        )
