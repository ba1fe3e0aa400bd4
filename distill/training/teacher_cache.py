"""The target's top-k log-probabilities of repeated training sequences, kept in memory (`distill.cache_teacher`).

A target-generated continuation is cached and comes back every epoch (`distill.source: target`), and dataset
completions are fixed (`source: fixed`): the same token sequence, so the same teacher distributions. Keeping
the teacher's top-k ids and its log-probabilities over them plus the tail bucket (`distill.top_k`, the same
coarsening the loss uses without a cache, see distill.training.losses) lets the steps of later epochs skip the target's
forward pass: they cost only the draft's forward and backward.

Entries are keyed by the exact token ids of the sequence (prompt and completion) and hold one row per loss
position, in order. Each process keeps the sequences of its own share of the prompts (distill.training.helpers.
batch_indices gives a process the same share every epoch, so from the second epoch on every lookup hits);
on-policy sequences (`source: draft`) are new every time and are not kept. Memory: per loss position, k int32 ids
and k + 1 float16 log-probabilities (k = 64: 386 bytes; the reference pair's 3927 prompts on 2 processes: 0.11 GB
per process); `nbytes` says how much is held.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from distill.training import losses


def sequence_key(prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> bytes:
    """The cache key of one training sequence: a digest of its token ids (prompt, separator, completion)."""
    text = ",".join(map(str, prompt_ids)) + "|" + ",".join(map(str, completion_ids))
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


class TeacherCache:
    """Top-k teacher rows per training sequence: `get` / `put` by :func:`sequence_key`."""

    def __init__(self, top_k: int, temperature: float, max_gb: float = float("inf")) -> None:
        if top_k <= 0:
            raise ValueError(f"the teacher cache needs top_k > 0, got {top_k}")
        self.top_k = top_k
        self.temperature = temperature
        self.max_bytes = max_gb * 1e9  # rows past it are not kept (distill.cache_teacher_gb)
        self._entries: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(ids [n, k] int64, log p_T [n, k + 1] float32) of a kept sequence, or None."""
        found = self._entries.get(key)
        if found is None:
            self.misses += 1
            return None
        self.hits += 1
        ids, logp = found
        return ids.long(), logp.float()

    def put(self, key: bytes, ids: torch.Tensor, logp: torch.Tensor) -> None:
        # int32 ids and float16 log-probabilities (3 significant digits, far below the loss's noise) on the CPU:
        # 6 bytes per id instead of 12
        ids, logp = ids.to("cpu", torch.int32), logp.to("cpu", torch.float16)
        old = self._entries.get(key)
        size = ids.numel() * ids.element_size() + logp.numel() * logp.element_size()
        if old is None and self.nbytes + size > self.max_bytes:
            return
        if old is not None:
            self.nbytes -= sum(t.numel() * t.element_size() for t in old)
        self._entries[key] = (ids, logp)
        self.nbytes += size


def teacher_rows(
    cache: TeacherCache,
    keys: Sequence[bytes],
    batch: dict[str, torch.Tensor],
    target: torch.nn.Module,
    *,
    keep: bool,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The teacher's top-k rows of a training batch, from the cache where it has them; the target's forward
    runs on the other sequences only (right-padded rows: their logits do not depend on the batch).

    Args:
        keys: one :func:`sequence_key` per row of `batch` (distill.data.prompts.collate_training's tensors).
        keep: store the computed rows (False for on-policy sequences, which never come back).

    Returns:
        (ids [tokens, k], log p_T [tokens, k + 1], rows the target computed), the tokens of `batch["loss_mask"]`
        in row-major order, as :func:`distill.training.losses.distill_loss_top_k` takes them.
    """
    found = [cache.get(k) for k in keys]
    missing = [i for i, entry in enumerate(found) if entry is None]
    if missing:
        width = int(batch["attention_mask"][missing].sum(-1).max())  # the missing rows' own padded width
        with torch.no_grad():
            logits = target(
                input_ids=batch["input_ids"][missing, :width], attention_mask=batch["attention_mask"][missing, :width]
            ).logits
        for j, i in enumerate(missing):
            rows = logits[j][batch["loss_mask"][i, :width] != 0]
            if vocab_size is not None:
                rows = rows[:, :vocab_size]
            ids, logp = losses.teacher_top_k(rows, cache.top_k, cache.temperature)
            found[i] = (ids, logp)
            if keep:
                cache.put(keys[i], ids, logp)
    device = batch["input_ids"].device
    ids = torch.cat([entry[0].to(device) for entry in found])
    logp = torch.cat([entry[1].to(device) for entry in found])
    return ids, logp, len(missing)


@torch.no_grad()
def top1_agreement_top_k(
    student_logits: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor, vocab_size: int | None = None
) -> torch.Tensor:
    """Fraction of loss positions where the draft's argmax (over the shared ids) is the teacher's first top-k id."""
    keep = mask.to(device=student_logits.device) != 0
    width = student_logits.shape[-1] if vocab_size is None else vocab_size
    s_top = student_logits[..., :width].max(-1).indices[keep]
    return (s_top == ids[:, 0].to(s_top.device)).float().mean()
