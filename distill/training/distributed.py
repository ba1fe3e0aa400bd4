"""The distributed engine of train/distill.py: refuse what cannot work, say what really runs, and give rank 0 a
plain full draft to evaluate and save.

Evaluation and saving run on rank 0 alone. With DDP or DeepSpeed ZeRO-2 every rank holds the whole draft, so
rank 0 can use its own copy. With FSDP the parameters are sharded: a forward of the sharded module all-gathers
shards with collectives the waiting ranks never join, and rank 0 would hang. So every rank first joins one
gather of the full state dict (:func:`full_draft`), rank 0 builds a plain unsharded copy from it, and the other
ranks wait on a barrier whose timeout is `train.dist_timeout_minutes` (long enough for a slow evaluation).

accelerate does not always run what the launch config asks for: under `ACCELERATE_USE_CPU=1` an FSDP config
becomes plain data parallelism. :func:`engine_info` reports what it really gave, and :func:`engine_warning`
warns when that is not what was asked for.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from decode import kinds

_SOURCES_SAMPLING_THE_DRAFT = ("draft", "mix", "schedule")


def place(accelerator: Any) -> tuple[int, int, bool]:
    """(this process's rank, the number of processes, whether it is the main one); (0, 1, True) without one."""
    if accelerator is None:
        return 0, 1, True
    return accelerator.process_index, accelerator.num_processes, accelerator.is_main_process


def requested_engine(env: Mapping[str, str] = os.environ) -> str | None:
    """The engine `accelerate launch` was asked for by its config ("fsdp", "deepspeed"), read from the
    environment it sets for the script; None for anything else (single process, DDP)."""
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return "deepspeed"
    if env.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return "fsdp"
    return None


def deepspeed_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def check_engine(
    requested: str | None,
    *,
    source: str,
    quantized: bool,
    lora: bool,
    cuda: bool,
    has_deepspeed: bool,
    zero_stage: int | None = None,
    ram_efficient_loading: bool = False,
    subset_head: bool = False,
    built_draft: str | None = None,
) -> None:
    """Refuse, before any model is loaded, a launch that cannot work here (one line naming the fix).

    Raises:
        ValueError: DeepSpeed without the package or without CUDA, ZeRO-3, FSDP with a draft that rank 0
            could not run alone (on-policy rollouts, quantized or LoRA drafts), FSDP's RAM-efficient loading, or
            either with `subset_head` (distill.loss_vocab=subset swaps the draft's output layer), FSDP with a
            draft built from the target (`built_draft`, ``draft.kind=K``: rank 0 rebuilds a sharded draft as an HF
            causal LM, which a head, a DFlash or DSpark draft is not).
    """
    if requested == "fsdp" and built_draft:
        raise ValueError(
            f"{built_draft} trains a draft built from the target, which rank 0 cannot rebuild from FSDP's shards "
            "(it rebuilds a causal LM), so every process holds it whole: launch with "
            "recipes/accelerate/multi_gpu.yaml (data parallel) instead of FSDP"
        )
    if requested in ("deepspeed", "fsdp") and subset_head:
        raise ValueError(
            f"distill.loss_vocab=subset swaps the draft's output layer for each forward, which {requested}'s wrapped "
            "parameters do not allow: set distill.loss_vocab=full, or launch with recipes/accelerate/multi_gpu.yaml"
        )
    if requested == "deepspeed":
        if not has_deepspeed:
            raise ValueError(
                "the launch config asks for DeepSpeed but the deepspeed package is not installed: "
                "`pip install deepspeed`, or launch with recipes/accelerate/multi_gpu.yaml"
            )
        if not cuda:
            raise ValueError(
                "the launch config asks for DeepSpeed, which needs CUDA GPUs, and none is visible: launch with "
                "recipes/accelerate/cpu.yaml (or ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu ...)"
            )
        if zero_stage == 3:
            raise ValueError(
                "DeepSpeed ZeRO-3 shards the draft's parameters, which rank-0 evaluation cannot run: use "
                "recipes/accelerate/deepspeed_zero2.yaml or recipes/accelerate/fsdp.yaml"
            )
    if requested == "fsdp":
        if ram_efficient_loading:
            # transformers then loads every model without weights on all processes but the first, expecting FSDP
            # to broadcast them; only the draft is FSDP-wrapped, so the frozen target would stay uninitialised.
            raise ValueError(
                "fsdp_cpu_ram_efficient_loading: true leaves the frozen target without weights on every process "
                "but the first: set it to false in the accelerate config (recipes/accelerate/fsdp.yaml does)"
            )
        if source in _SOURCES_SAMPLING_THE_DRAFT:
            raise ValueError(
                f"distill.source={source} samples rollouts from the draft on each rank, which FSDP's sharded "
                "draft cannot do alone: set distill.source=target (or fixed), or launch with "
                "recipes/accelerate/multi_gpu.yaml"
            )
        if quantized or lora:
            raise ValueError(
                "FSDP shards full fine-tuning of the draft only; a LoRA/QLoRA draft trains few parameters: set "
                "draft.lora.enabled=false, or launch with recipes/accelerate/multi_gpu.yaml"
            )


def check_launch(recipe: Any, env: Mapping[str, str] = os.environ) -> str | None:
    """:func:`check_engine` for this launch and recipe; returns the requested engine. Call before anything is
    written or loaded."""
    requested = requested_engine(env)
    stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "")
    traits = kinds.traits(recipe.draft.kind)
    check_engine(
        requested,
        source=recipe.distill.source,
        quantized=recipe.draft.quantization.enabled,
        lora=recipe.draft.lora.enabled,
        cuda=torch.cuda.is_available(),
        has_deepspeed=requested != "deepspeed" or deepspeed_installed(),
        zero_stage=int(stage) if stage.isdigit() else None,
        ram_efficient_loading=env.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() in ("true", "1"),
        subset_head=recipe.distill.loss_vocab == "subset",
        # plain_copy rebuilds a causal LM from the gathered shards: a kind that builds its draft from the target
        # (a head, a DFlash or DSpark draft) is no causal LM
        built_draft=None if traits.loads_draft_model else f"draft.kind={traits.name}",
    )
    return requested


def process_group_kwargs(timeout_minutes: float) -> list[Any]:
    """accelerate `kwargs_handlers` setting the process-group timeout: how long a rank waits at a collective
    (the barrier while rank 0 evaluates and saves) before failing instead of hanging."""
    from accelerate.utils import InitProcessGroupKwargs

    return [InitProcessGroupKwargs(timeout=datetime.timedelta(minutes=timeout_minutes))]


# ---------------------------------------------------------------- what runs


def is_sharded(model: nn.Module) -> bool:
    """True when the model's parameters are split across ranks (FSDP1 or FSDP2): no rank can run it alone."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):  # FSDP2 (fully_shard)
        return True
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def engine_info(accelerator: Any, model: nn.Module, requested: str | None) -> dict[str, Any]:
    """What accelerate really runs: distributed type, processes, whether the draft's parameters are sharded."""
    info: dict[str, Any] = {
        "distributed_type": str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)),
        "num_processes": accelerator.num_processes,
        "sharded_parameters": is_sharded(model),
        "requested": requested,
    }
    if info["distributed_type"] == "DEEPSPEED":
        info["zero_stage"] = accelerator.state.deepspeed_plugin.zero_stage
    return info


def describe(info: dict[str, Any]) -> str:
    """One line for the run's log, e.g. `distributed: FSDP, 8 processes, draft parameters sharded`."""
    n = info["num_processes"]
    if n == 1 and not info["sharded_parameters"]:
        return f"distributed: {info['distributed_type']}, 1 process"
    sharding = "draft parameters sharded" if info["sharded_parameters"] else "every process holds the whole draft"
    extra = f", ZeRO stage {info['zero_stage']}" if "zero_stage" in info else ""
    return f"distributed: {info['distributed_type']}{extra}, {n} process{'es' if n != 1 else ''}, {sharding}"


def engine_warning(info: dict[str, Any]) -> str | None:
    """A warning when the launch config asked for FSDP and accelerate gave something else."""
    if info["requested"] == "fsdp" and info["distributed_type"] != "FSDP":
        return (
            f"warning: the launch config asks for FSDP but accelerate runs {info['distributed_type']} (plain data "
            "parallelism: nothing is sharded, every process holds the whole draft); accelerate turns FSDP off "
            "under ACCELERATE_USE_CPU=1 or --cpu: run FSDP on GPUs"
        )
    return None


def report_engine(accelerator: Any, model: nn.Module) -> dict[str, Any]:
    """Print (main process) what runs and any mismatch with the launch config; return the info to log."""
    info = engine_info(accelerator, model, requested_engine())
    warning = engine_warning(info)
    if accelerator.is_main_process:
        print(describe(info))
        if warning:
            print(warning, file=sys.stderr)
    return info


# ---------------------------------------------------------------- a full draft on rank 0


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on CPU on rank 0, an empty dict on the others. Collective: every rank
    must call it, at the same point."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def plain_copy(sharded: nn.Module, state: Mapping[str, torch.Tensor], device: torch.device | str = "cpu") -> nn.Module:
    """A plain (unsharded) eval-mode copy of a sharded causal LM, built from its full state dict.

    The skeleton is built on the meta device (no memory, no random init) and takes the gathered tensors as they
    are. Buffers left out of the state dict (rotary `inv_freq`) are not sharded, so they come from the rank's
    own module.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        copy = AutoModelForCausalLM.from_config(sharded.config)
    copy.load_state_dict(dict(state), strict=True, assign=True)
    own = dict(sharded.named_buffers())
    for name, buffer in list(copy.named_buffers()):
        if buffer.is_meta:
            owner, _, leaf = name.rpartition(".")
            copy.get_submodule(owner)._buffers[leaf] = own[name].detach().to("cpu", copy=True)
    copy.tie_weights()  # the state dict holds tied weights twice; share them again
    left = [n for n, t in [*copy.named_parameters(), *copy.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"plain_copy: tensors missing from the gathered state dict: {left[:5]}")
    copy.generation_config = sharded.generation_config
    return copy.to(device).requires_grad_(False).eval()


def full_draft(
    wrapped: nn.Module, unwrapped: nn.Module, is_main: bool, device: torch.device | str = "cpu"
) -> nn.Module | None:
    """A draft rank 0 can evaluate and save on its own; None on the other ranks.

    Collective when the draft is sharded: every rank must call it. Unsharded (single process, DDP, ZeRO-2),
    rank 0's own draft is returned, nothing is copied.

    Args:
        wrapped: the draft as `accelerator.prepare` returned it.
        unwrapped: `accelerator.unwrap_model(wrapped)`.
        device: where rank 0's copy goes (the accelerator's device).
    """
    if not is_sharded(unwrapped):
        return unwrapped if is_main else None
    state = gather_full_state_dict(wrapped)
    return plain_copy(unwrapped, state, device) if is_main else None


def rollout_draft(unwrapped: nn.Module) -> nn.Module | None:
    """The draft that speculative target rollouts may use on one rank: None when it is sharded (the target then
    generates alone; rollouts are lossless either way, only slower)."""
    return None if is_sharded(unwrapped) else unwrapped
