"""Faster CPU matmuls for the decoder's linear layers (both models), for the length of one decoding call.

A speculative decoder on a CPU spends most of its time in ``nn.Linear`` on 1 to ~13 rows, where PyTorch's
default kernels are far from the machine's best. Measured here (AMD EPYC with AVX512-BF16, one thread, torch
2.13; microseconds, M = rows):

    layer (out x in)      dtype   M  nn.Linear  transposed copy  oneDNN, prepacked
    8192 x 512 (head)     fp32    1     718          459              462
    8192 x 512 (head)     fp32    5    2184         2099              486
    512 x 1408 (down)     fp32    5     179          204               83
    256 x 256             fp32    1       6            5               16
    8192 x 512 (head)     bf16    1     318          594              138
    512 x 1408 (down)     bf16    5      85           93               52

So: float32 with one row multiplies by a contiguous transposed copy of the weight (MKL's one-row product
with ``nn.Linear``'s ``[out, in]`` layout is the slow one), float32 with more rows and bf16 always run
oneDNN on a weight reordered once into its blocked layout (PyTorch's own bf16 path is oneDNN too, but
without the prepacked weight: the bf16 results were bitwise identical in every check, only faster). Copies
are made on first use and kept while the layer lives (rebuilt if its weight changes), so the cost is memory:
up to two extra copies of each linear weight of a float32 model, one of a bf16 model.
``DRAFTSMITH_CPU_KERNELS=0`` turns this off.

Losslessness does not depend on it: the draft's numerics only change what is accepted, and the target's
float32 products differ from ``nn.Linear``'s only in rounding order, exactly as a multi-row verify pass
already does with PyTorch's own kernels (the bench's ``greedy_agreement`` checks outputs against
``model.generate`` every run). Both of draftsmith's loops use it, its target-only baseline included, so the
speedup over target-only decoding is speculation's alone. GPUs, quantized layers, hooked layers (accelerate
offloading) and other dtypes are left as they are; an adapter wrapper (PEFT LoRA) is kept and the plain linears
inside it are swapped.
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F
from torch import nn

_DTYPES = (torch.float32, torch.bfloat16)
# Per nn.Linear: {"key": (weight version, data pointer), "packed": ..., "transposed": ...}, built lazily.
_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def enabled() -> bool:
    """oneDNN is built in and ``DRAFTSMITH_CPU_KERNELS`` is not 0."""
    return os.environ.get("DRAFTSMITH_CPU_KERNELS", "1") != "0" and torch.backends.mkldnn.is_available()


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter (and cannot change outside inference mode)
        return None


def _copies(linear: nn.Linear) -> dict:
    key = (_version(linear.weight), linear.weight.data_ptr())
    copies = _COPIES.get(linear)
    if copies is None or copies["key"] != key:
        copies = {"key": key}
        _COPIES[linear] = copies
    return copies


class _CpuLinear(nn.Module):
    """Stands in for an ``nn.Linear`` during a call; ``weight`` and ``bias`` stay the original parameters."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.float32 = linear.weight.dtype == torch.float32
        # Looked up once per swap, not per forward: the weight cannot change while the decoding call runs.
        self.copies = _copies(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        copies = self.copies
        if self.float32 and x.numel() == self.in_features:  # one row
            if "transposed" not in copies:
                copies["transposed"] = self.weight.detach().t().contiguous()
            out = x @ copies["transposed"]
            return out if self.bias is None else out + self.bias
        if "packed" not in copies:
            try:
                copies["packed"] = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
            except (RuntimeError, AttributeError):  # an op missing from this build: PyTorch's own kernel
                copies["packed"] = None
        if copies["packed"] is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, copies["packed"], self.bias, "none", [], "")


def _eligible(module: nn.Module) -> bool:
    # Hooked layers (accelerate offloading, user hooks) keep their own forward: a swap would bypass the hooks.
    hooked = module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook")
    return (
        type(module) is nn.Linear
        and not hooked
        and module.weight.device.type == "cpu"
        and module.weight.dtype in _DTYPES
    )


def applies(*models: nn.Module) -> bool:
    """Whether ``CpuLinears(*models)`` would swap any layer."""
    return enabled() and any(_eligible(m) for model in models for m in model.modules())


class CpuLinears:
    """Context manager: swap every plain CPU float32/bf16 ``nn.Linear`` of ``models`` for ``_CpuLinear``.

    The originals are put back on exit, also after an error.
    """

    def __init__(self, *models: nn.Module):
        self.models = models
        self.swapped: list[tuple[nn.Module, str, nn.Linear]] = []

    def __enter__(self):
        if not enabled():
            return self
        for model in self.models:
            for parent in list(model.modules()):
                for name, child in list(parent.named_children()):
                    if _eligible(child):
                        self.swapped.append((parent, name, child))
                        setattr(parent, name, _CpuLinear(child))
        return self

    def __exit__(self, *exc):
        for parent, name, child in reversed(self.swapped):
            setattr(parent, name, child)
        self.swapped = []
