"""One model's KV cache over a batch whose rows keep different numbers of tokens (holes), and the form every
decoding loop runs its models in (:func:`decoding`).

Each model keeps ONE physical KV cache for the batch plus a per-row mask of which slots hold real tokens: when a
row rejects drafts another row kept, its slots become holes, masked in attention and skipped by position ids, so
every row attends to exactly its own tokens at their own positions, as if decoded alone. Columns no row kept are
cropped. For sliding-window models (the window is measured in cache slots) the cache is compacted before holes
could enter a window.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from transformers import DynamicCache

from decode.compat import model_name, sliding_window, text_config
from decode.kernels import CpuLinears


def _innermost(model: nn.Module) -> nn.Module:
    """The module whose ``forward`` really takes the inputs: PEFT and accelerate wrappers forward ``**kwargs``."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = getattr(model, "get_base_model", None)
        if callable(inner):
            model = inner()
        elif hasattr(model, "module") and isinstance(model.module, nn.Module):  # DDP / accelerate wrappers
            model = model.module
    return model


@functools.cache
def _cache_keyword_of(forward_cls: type) -> str:
    params = inspect.signature(forward_cls.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    # A forward that names neither (``**kwargs`` only): ask an HF model of this release what it takes.
    from transformers import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def cache_keyword(model: nn.Module) -> str:
    """The forward keyword that takes a KV cache: ``cache`` (recent releases) or ``past_key_values``.

    Passing the wrong one is silently swallowed by ``**kwargs`` and the model runs without a cache, so every
    forward of draftsmith's loops goes through this name (and :meth:`KVStream.feed` checks the cache grew).
    """
    return _cache_keyword_of(type(_innermost(model)))


class KVStream:
    """A model, its KV cache, and per row which cache slots hold real tokens.

    ``valid`` is ``[batch, slots]`` bool, or None while every slot of every row is real (batch 1 never leaves
    that fast path: no mask is built and SDPA runs its plain causal kernel). ``length[b]`` is row b's number of
    real tokens, i.e. the position id of its next token.
    """

    def __init__(self, model: nn.Module, batch_size: int, vocab: int):
        self.model = model
        self.cache = DynamicCache()
        self.valid: torch.Tensor | None = None
        self.slots = 0
        self.device = next(model.parameters()).device
        self.length = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.vocab = vocab
        self.window = sliding_window(model)
        self.forwards = 0
        self.cache_kw = cache_keyword(model)

    def feed(self, ids: torch.Tensor, valid: torch.Tensor | None, keep: int) -> torch.Tensor:
        """Append ``ids`` ``[B, q]`` (``valid`` ``[B, q]`` bool or None = all real) to the cache.

        Returns the logits of the last ``keep`` inputs, ``[B, keep, vocab]``, cut to the shared vocabulary.
        """
        return self._forward(ids, valid, keep, None)[0]

    def feed_with_features(
        self, ids: torch.Tensor, valid: torch.Tensor | None, keep: int, layers: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``feed``, plus the hidden states at ``layers`` (indices of HF ``hidden_states``: 0 = embeddings) of every
        input, side by side: ``[B, q, len(layers) * hidden]`` (what an EAGLE-3 head reads)."""
        return self._forward(ids, valid, keep, layers)

    def _forward(
        self, ids: torch.Tensor, valid: torch.Tensor | None, keep: int, layers: Sequence[int] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = ids.to(self.device)
        batch, q = ids.shape
        if valid is not None and bool(valid.all()):
            valid = None
        if valid is None and self.valid is None:
            position_ids = torch.arange(self.slots, self.slots + q, device=self.device).expand(batch, q)
            mask = None
            self.length += q
        else:
            valid = torch.ones_like(ids, dtype=torch.bool) if valid is None else valid.to(self.device)
            if self.valid is None:
                self.valid = torch.ones(batch, self.slots, dtype=torch.bool, device=self.device)
            if self.window is not None and self.slots + q > self.window:
                self._compact()
            # Holes take no position: row b's real tokens get consecutive positions from length[b].
            position_ids = (self.length[:, None] + valid.cumsum(1) - 1).clamp_min(0)
            self.valid = torch.cat([self.valid, valid], 1)
            mask = self.valid.long()
            self.length += valid.sum(1)
        return self._run(ids, mask, position_ids, keep, layers)

    def _run(
        self, ids: torch.Tensor, mask, position_ids: torch.Tensor, keep: int, layers: Sequence[int] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward appending ``ids`` [B, q] to the cache: the logits of the last ``keep`` inputs, and the hidden
        states at ``layers`` side by side (None without layers)."""
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=keep,
            **({"output_hidden_states": True} if layers is not None else {}),
            **{self.cache_kw: self.cache},
        )
        self.slots += ids.shape[1]
        if self.forwards == 0 and self.cache.get_seq_length() == 0:
            raise RuntimeError(
                f"{model_name(self.model)} ignored the KV cache passed as {self.cache_kw}= (its forward takes the "
                "cache under another keyword): report it with the output of `pip show transformers`"
            )
        self.forwards += 1
        features = None if layers is None else torch.cat([out.hidden_states[i] for i in layers], -1)
        return out.logits[:, -keep:, : self.vocab], features

    def feed_tree(
        self, ids: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor, layers: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch 1: append the n nodes of a token tree, ``ids`` [1, n], each attending to every cached token and
        to the nodes ``ancestors`` [n, n] allows, at position ``length + depths`` [n]. Returns the logits of all n
        and the hidden states at ``layers`` side by side (as ``feed_with_features``); :meth:`keep` commits a path.
        """
        assert ids.shape[0] == 1 and self.valid is None, "a token tree is fed one row at a time"
        n = ids.shape[1]
        ids = ids.to(self.device)
        allowed = torch.cat([torch.ones(n, self.slots, dtype=torch.bool), ancestors.cpu()], 1).to(self.device)
        positions = self.length[:, None] + depths.to(self.device)[None]  # [1, n]
        mask = _additive(allowed, self.model)
        if self.window is not None:
            # Batch 1 has no holes: a cached slot's index is its position.
            keys = torch.cat([torch.arange(self.slots, device=self.device), positions[0]])
            windowed = _additive(allowed & (positions[0][:, None] - keys[None] < self.window), self.model)
            types = getattr(text_config(self.model), "layer_types", None) or []
            # Models mixing full and sliding layers take one mask per layer type; the others one mask.
            mask = {"full_attention": mask, "sliding_attention": windowed} if "full_attention" in types else windowed
        return self._run(ids, mask, positions, n, layers)

    def keep(self, num_new: int, kept: list[int]) -> None:
        """Batch 1: of the last ``num_new`` slots keep only those at indices ``kept`` (ascending), in order."""
        base = self.slots - num_new
        index = torch.tensor(kept, dtype=torch.long, device=self.device) + base
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                states = getattr(layer, name)  # [1, heads, slots, dim]
                setattr(layer, name, torch.cat([states[:, :, :base], states.index_select(2, index)], 2))
        self.slots = base + len(kept)
        self.length += len(kept)

    def rollback(self, num_new: int, keep: torch.Tensor, keep_list: list[int]) -> None:
        """Of the last ``num_new`` slots (all real), keep the first ``keep[b]`` for row b.

        Slots no row keeps are cropped; a row keeping fewer than the longest is left with holes.
        """
        most = max(keep_list)
        drop = num_new - most
        if drop > 0:
            self.cache.crop(-drop)
            self.slots -= drop
            if self.valid is not None:
                self.valid = self.valid[:, : self.slots]
        self.length -= num_new - keep.to(self.device)
        if most > 0 and min(keep_list) < most:
            if self.valid is None:
                self.valid = torch.ones(len(keep_list), self.slots, dtype=torch.bool, device=self.device)
            hole = torch.arange(most, device=self.device)[None, :] >= keep.to(self.device)[:, None]  # [B, most]
            self.valid[:, self.slots - most :] &= ~hole

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (1-D long)."""
        rows = rows.to(self.device)
        if self.slots:
            self.cache.batch_select_indices(rows)
        self.length = self.length[rows]
        if self.valid is not None:
            self.valid = self.valid[rows]
            if bool(self.valid.all()):
                self.valid = None

    def _compact(self) -> None:
        """Move every row's real slots to the right end (holes become left padding): sliding windows count slots."""
        assert self.valid is not None
        # Holes only matter inside a row's tokens; left padding alone is what HF itself does with windows.
        inner = self.valid.int().cummax(1).values.bool() & ~self.valid
        if not bool(inner.any()):
            return
        width = int(self.valid.sum(1).max())
        idx = torch.sort(self.valid.int(), dim=1, stable=True).indices[:, -width:]  # [B, width] real slots, in order
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            for name in ("keys", "values"):
                states = getattr(layer, name)  # [B, heads, slots, dim]
                index = idx[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[-1])
                setattr(layer, name, states.gather(2, index))
        self.valid = self.valid.gather(1, idx)
        self.slots = width


def _additive(allowed: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """[q, k] bool -> [1, 1, q, k] additive mask in the model's dtype: SDPA and eager attention read it alike."""
    dtype = next(model.parameters()).dtype
    dtype = dtype if dtype.is_floating_point else torch.float32
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


@contextlib.contextmanager
def inference(*models: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) and inference mode for the block; each model's previous mode restored after."""
    modes = [m.training for m in models]
    try:
        for m in models:
            m.eval()
        with torch.inference_mode():
            yield
    finally:
        for m, mode in zip(models, modes):
            m.train(mode)


@contextlib.contextmanager
def decoding(*models: nn.Module) -> Iterator[None]:
    """The form every decoding loop and every cost measurement runs the models in: inference mode, eval mode,
    draftsmith's CPU kernels (one place, so the timed forwards are always the forwards the loops run)."""
    with inference(*models), CpuLinears(*models):
        yield
