"""Peak tensor memory of a block of torch code, counted op by op (CPU or GPU, no allocator statistics needed).

    with TensorPeak() as peak:
        loss = f(x)
        loss.backward()
    peak.bytes            # most bytes of storage alive at once that ops inside the block allocated

Every aten op run inside the block (autograd's backward included) is seen through a ``TorchDispatchMode``: each
output storage that is new (not one of the op's inputs' storages) is counted until torch frees it (a storage weak
reference), so tensors made before the block (weights, inputs) and views of them never count. Buffers a kernel
allocates and frees within one op (a flash attention kernel's blocks) are not seen.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class TensorPeak(TorchDispatchMode):
    """Peak bytes (``bytes``) of the storages ops inside the block allocated and had alive at one time."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}  # storage cdata -> (weak reference, bytes)
        self.now = 0
        self.bytes = 0

    def _sweep(self) -> None:
        for key, (ref, size) in list(self._live.items()):
            if ref.expired():
                del self._live[key]
                self.now -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._live or storage.nbytes() == 0:
                continue  # a view, an in-place result or an empty tensor: nothing new
            self._live[key] = (StorageWeakRef(storage), storage.nbytes())
            self.now += storage.nbytes()
        self.bytes = max(self.bytes, self.now)
        return out
