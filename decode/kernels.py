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
are made on first use and cached per layer (in a weak mapping: they go with the layer, and are rebuilt if its
weight changes), because building them is slow next to a decoding call (the reference 30M target: about a
second, the time of some 30 decoded tokens). A weight counts as changed when it is updated in place, replaced,
or merged into or out of by the PEFT adapter around it (PEFT writes through ``weight.data``, which leaves the
version counter as it was); after any other write through ``.data``, call ``release(model)``. The cost is
memory, up to two extra copies of each linear weight of a float32 model, one of a bf16 model:
``release(model)`` frees them (distillation calls it after every evaluation and after generating the target's
rollouts, for a target that stays loaded all run).
``DRAFTSMITH_CPU_KERNELS=0`` turns this off.

Contexts on the same layers may nest or run in several threads at once: a swapped layer stays swapped until
the last context holding it exits. Under autocast, with autograd recording, or for an input of another dtype
than the weight, a swapped layer runs PyTorch's own ``F.linear``, so the result is what ``nn.Linear`` gives.

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
import threading
import weakref

import torch
import torch.nn.functional as F
from torch import nn

_DTYPES = (torch.float32, torch.bfloat16)
# Per nn.Linear: {"key": (weight version, data pointer, adapter state), "packed": ..., "transposed": ...}, built
# lazily.
_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Guards swapping, the hold counts and building copies: contexts on one model may run in several threads.
_LOCK = threading.RLock()
_MISSING = object()  # a copy not built yet (a built "packed" copy may be None: no oneDNN op in this build)


def enabled() -> bool:
    """oneDNN is built in and ``DRAFTSMITH_CPU_KERNELS`` is not 0."""
    return os.environ.get("DRAFTSMITH_CPU_KERNELS", "1") != "0" and torch.backends.mkldnn.is_available()


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter (and cannot change outside inference mode)
        return None


def _merge_state(owner: nn.Module) -> tuple:
    """The PEFT adapter wrapping a layer and what it has merged: a merge writes through ``weight.data``, which
    leaves the version counter as it was; ``merge_and_unload`` also takes the wrapper away."""
    merged = getattr(owner, "merged_adapters", None)
    return () if merged is None else (id(owner), tuple(merged))


def _copies(linear: nn.Linear, owner: nn.Module) -> dict:
    key = (_version(linear.weight), linear.weight.data_ptr(), _merge_state(owner))
    copies = _COPIES.get(linear)
    if copies is None or copies["key"] != key:
        if copies is not None:
            _clear(copies)  # a stand-in of an earlier context may still point at the stale dict
        copies = {"key": key}
        _COPIES[linear] = copies
    return copies


def _clear(copies: dict) -> None:
    for name in ("packed", "transposed"):
        copies.pop(name, None)


def release(*models: nn.Module) -> None:
    """Free the weight copies made for the linear layers of ``models`` (rebuilt on next use if needed)."""
    with _LOCK:
        for model in models:
            for module in model.modules():
                layer = module.original if isinstance(module, _CpuLinear) else module
                copies = _COPIES.pop(layer, None)
                if copies is not None:
                    _clear(copies)  # also drops them from a stand-in that is in use right now


def _plain(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this forward must be ``nn.Linear``'s own: the copies are detached, in the weight's dtype only."""
    return (
        x.dtype != weight.dtype
        or torch.is_autocast_enabled(x.device.type)  # autocast casts F.linear's inputs, oneDNN would get mixed ones
        or (torch.is_grad_enabled() and weight.requires_grad)  # the copies carry no gradient to the weight
    )


class _CpuLinear(nn.Module):
    """Stands in for an ``nn.Linear`` during a call; ``weight`` and ``bias`` stay the original parameters."""

    def __init__(self, linear: nn.Linear, owner: nn.Module):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.float32 = linear.weight.dtype == torch.float32
        object.__setattr__(self, "original", linear)  # not a submodule: the model's module tree stays as it was
        self.holders = 0  # contexts that hold this swap; the last one out puts the original back
        # Looked up once per swap, not per forward: the weight cannot change while the decoding call runs.
        self.copies = _copies(linear, owner)

    def _copy(self, name: str):
        # One read, never a check then an index: another thread's release() may empty the dict in between.
        copy = self.copies.get(name, _MISSING)
        if copy is _MISSING:
            with _LOCK:
                copy = self.copies.get(name, _MISSING)
                if copy is _MISSING:
                    copy = self.copies[name] = _build(name, self.weight.detach())
        return copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _plain(x, self.weight):
            return F.linear(x, self.weight, self.bias)
        if self.float32 and x.numel() == self.in_features:  # one row
            out = x @ self._copy("transposed")
            return out if self.bias is None else out + self.bias
        packed = self._copy("packed")
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")


def _build(name: str, weight: torch.Tensor) -> torch.Tensor | None:
    if name == "transposed":
        return weight.t().contiguous()
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    except (RuntimeError, AttributeError):  # an op missing from this build: PyTorch's own kernel
        return None


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

    The originals are put back when the last context holding them exits, also after an error; an error while
    swapping leaves the models as they were.
    """

    def __init__(self, *models: nn.Module):
        self.models = models
        self.held: list[tuple[nn.Module, str, _CpuLinear]] = []

    def __enter__(self):
        if not enabled():
            return self
        with _LOCK:
            try:
                for parent, name, child in _slots(self.models):
                    if isinstance(child, _CpuLinear):  # swapped by a context still active: hold it too
                        child.copies = _copies(child.original, parent)  # the weight may have changed since
                        stand_in = child
                    elif _eligible(child):
                        stand_in = _CpuLinear(child, parent)
                        setattr(parent, name, stand_in)
                    else:
                        continue
                    stand_in.holders += 1
                    self.held.append((parent, name, stand_in))
            except BaseException:
                self._let_go()
                raise
        return self

    def __exit__(self, *exc):
        with _LOCK:
            self._let_go()

    def _let_go(self) -> None:
        for parent, name, stand_in in reversed(self.held):
            stand_in.holders -= 1
            if stand_in.holders == 0 and getattr(parent, name) is stand_in:
                setattr(parent, name, stand_in.original)
        self.held = []


def _slots(models) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute name, child) of every module of ``models``, each once (models may share layers)."""
    seen, slots = set(), []
    for model in models:
        for parent in model.modules():
            for name, child in parent.named_children():
                if (id(parent), name) not in seen:
                    seen.add((id(parent), name))
                    slots.append((parent, name, child))
    return slots
