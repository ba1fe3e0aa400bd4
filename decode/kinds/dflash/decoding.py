"""The DFlash draft kind: a few-layer draft that fills a whole block from the target's hidden states in one forward.

DFlash (block diffusion drafting, arXiv 2602.06036) conditions a small stack of decoder layers on the target's
hidden states at several layers (``target_layer_ids``), concatenated and projected by ``fc`` to the hidden width,
then normed by ``hidden_norm``: the *context*. Every layer reads the context through its own key and value
projections (the context is never put through the layers), so the draft keeps, per layer, the context's keys and
values of every committed position as its cache.

One draft forward reads a *block* of K + 1 positions: the first holds the last verified token (the round's
correction or bonus token, whose target features do not exist yet), the other K hold ``mask_token_id``. Attention
inside the block is bidirectional and the block attends to the context of every committed position; block
position k (1..K) proposes the token at its own position, d_k. Nothing drafted is read back or cached, so a round
costs one forward whatever K is. The block reads the target's token embedding and its logits come out of the
target's output layer: both are the target's, shared and never saved.

Ids: ``target_layer_ids`` j is the output of target layer j (``hidden_states[j + 1]`` of an HF forward), vLLM's
DFlash convention; ``aux_layers`` are the ``hidden_states`` indices, j + 1. Ids run over 0..L-2: HF's last hidden
state is after the final norm, vLLM's before it.

The layout is the one vLLM loads (``speculative_config: {"method": "dflash"}``, ``DFlashDraftModel``, served by
``vllm/model_executor/models/qwen3_dflash.py``): a Qwen3 config with ``dflash_config`` (``mask_token_id``,
``target_layer_ids``), ``target_hidden_size`` and ``block_size`` (K + 1: the block counts its first, verified
position, as DFlash's checkpoints do), and tensors ``fc``, ``hidden_norm``, ``layers.*`` (Qwen3 layers with
per-head ``q_norm``/``k_norm``), ``norm``, and no ``embed_tokens`` or ``lm_head``: vLLM then shares the target's.

    draft = build(target, layer_ids=[0, 1, 2], num_layers=1, block_size=4, mask_token_id=0)
    logits = draft.block_logits(ids, features, valid)    # training: every block position of every anchor, one pass
    save(draft, folder); draft = load(folder, target)    # the served format
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from decode.compat import model_name, text_config
from decode.kinds.dflash import TRAITS
from decode.kinds.eagle3 import decoding as eagle3
from decode.kinds.eagle3.formats import default_aux_layers
from decode.kinds.standalone.decoding import draft_tokens, stack

NAME = TRAITS.name
ARCHITECTURE = "DFlashDraftModel"
WEIGHTS = "model.safetensors"
MAX_BLOCK = 16  # the most tokens a draft is built to propose in one forward (draft.block_size's range)


# ---------------------------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------------------------
def check_block_size(block_size: int) -> int:
    """``block_size`` (tokens proposed per forward) as an int in 2..MAX_BLOCK, else ValueError naming the range."""
    if not 2 <= int(block_size) <= MAX_BLOCK:
        raise ValueError(f"block size {block_size} is not in 2..{MAX_BLOCK}: a DFlash draft drafts 2..16 tokens")
    return int(block_size)


def default_layer_ids(num_layers: int) -> list[int]:
    """Low, middle and high layer outputs (the EAGLE-3 defaults' layers, in DFlash's convention: one less)."""
    ids = sorted({a - 1 for a in default_aux_layers(num_layers) if 1 <= a <= num_layers - 1})
    return ids or [0]


def check_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """``layer_ids`` as a list, or ValueError naming the rule: distinct rising ids in 0..L-2 (j = layer j's
    output; L-1 is left out because HF's last hidden state is after the final norm and vLLM's before it)."""
    ids = [int(i) for i in layer_ids]
    if not ids or any(b <= a for a, b in zip(ids, ids[1:])) or not 0 <= ids[0] <= ids[-1] <= num_layers - 2:
        raise ValueError(
            f"target layer ids {ids} are not distinct rising ids among the target's layer outputs 0..{num_layers - 2} "
            f"(id j = the output of layer j): set draft.aux_layers to such ids, e.g. {default_layer_ids(num_layers)}"
        )
    return ids


def check_draft_length(draft: nn.Module, gamma: int) -> None:
    """ValueError when a fixed ``gamma`` is above the block the draft was trained for."""
    block = block_of(draft)
    if gamma > block:
        raise ValueError(
            f"num_draft_tokens={gamma} is above the block of {block} tokens this {draft.title} was trained for: use "
            f"num_draft_tokens <= {block} or 'auto', or train a draft with a larger draft.block_size"
        )


def block_of(draft: nn.Module) -> int:
    """The tokens the draft proposes in one forward (K; its served ``block_size`` is K + 1)."""
    return int(draft.block_size)


# ---------------------------------------------------------------------------------------------------------------
# The draft
# ---------------------------------------------------------------------------------------------------------------
class DFlashAttention(nn.Module):
    """Qwen3 attention (per-head RMSNorm on queries and keys) over [context; block], bidirectional in the block."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        hidden, self.head_dim = config.hidden_size, config.head_dim
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, S, H] -> keys and values [B, kv_heads, S, d], the keys normed and rotated."""
        b, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, s, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        return _rotate(k, cos, sin), v

    def q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[B, S, H] -> queries [B, heads, S, d], normed and rotated."""
        b, s, _ = x.shape
        return _rotate(self.q_norm(self.q_proj(x).view(b, s, self.heads, self.head_dim)).transpose(1, 2), cos, sin)

    def expand(self, kv: torch.Tensor) -> torch.Tensor:
        """Grouped-query attention: repeat each kv head for the query heads that share it."""
        return kv.repeat_interleave(self.heads // self.kv_heads, dim=1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (the neox layout vLLM's DFlash uses) of [B, h, S, d]."""
    return apply_rotary_pos_emb(x, x, cos, sin)[0]


class DFlashLayer(nn.Module):
    """One decoder layer (the served checkpoint's ``layers.<i>.*``)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)


def block_attention(
    q: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    ctx_mask: torch.Tensor,
    blk_k: torch.Tensor,
    blk_v: torch.Tensor,
) -> torch.Tensor:
    """Attention of N blocks of Q positions: each attends to the context keys its mask allows and to every
    position of its own block (bidirectional); one softmax over both.

    Args:
        q: [B, h, N, Q, d]; ctx_k, ctx_v: [B, h, C, d]; ctx_mask: [B, N, C] bool; blk_k, blk_v: [B, h, N, Q, d].

    Returns:
        [B, h, N, Q, d]. Memory is N Q (C + Q) scores per head: a block never scores another block's keys.
    """
    scale = q.shape[-1] ** -0.5
    ctx = torch.einsum("bhnqd,bhcd->bhnqc", q, ctx_k) * scale
    ctx = ctx.masked_fill(~ctx_mask[:, None, :, None, :], float("-inf"))
    own = torch.einsum("bhnqd,bhnkd->bhnqk", q, blk_k) * scale
    weights = torch.cat([ctx, own], -1).float().softmax(-1).to(q.dtype)
    c = ctx_k.shape[2]
    return torch.einsum("bhnqc,bhcd->bhnqd", weights[..., :c], ctx_v) + torch.einsum(
        "bhnqk,bhnkd->bhnqd", weights[..., c:], blk_v
    )


class DFlashDraft(nn.Module):
    """fc -> hidden_norm (the context) and embedding -> layers -> norm -> the target's output layer.

    ``embed_tokens`` and ``lm_head`` are the target's (not submodules: never saved, trained, moved or cast with
    the draft). ``block_size`` is K, the tokens one forward proposes.
    """

    kind = NAME
    title = "DFlash draft"  # what messages call it

    def __init__(self, config: LlamaConfig, embed_tokens: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.config = config
        object.__setattr__(self, "embed_tokens", embed_tokens)
        object.__setattr__(self, "lm_head", lm_head)
        width = len(config.dflash_config["target_layer_ids"]) * config.target_hidden_size
        self.fc = nn.Linear(width, config.hidden_size, bias=False)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(config)

    # ---- shapes and maps
    @property
    def block_size(self) -> int:
        return int(self.config.block_size) - 1  # the served block counts its first, verified position

    @property
    def mask_token_id(self) -> int:
        return int(self.config.dflash_config["mask_token_id"])

    @property
    def layer_ids(self) -> list[int]:
        return list(self.config.dflash_config["target_layer_ids"])

    @property
    def aux_layers(self) -> list[int]:
        """The ``hidden_states`` indices the draft reads (layer j's output is index j + 1)."""
        return [j + 1 for j in self.layer_ids]

    @property
    def vocab(self) -> int:
        return int(self.config.vocab_size)

    @property
    def draft_ids(self) -> torch.Tensor:
        """Every target id: the draft scores the whole vocabulary through the target's output layer."""
        return torch.arange(self.vocab, device=self.fc.weight.device)

    # ---- the forward
    def context(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the context's keys and values [B, kv_heads, C, d] of target features [B, C, n * H_target]
        at ``positions`` [B, C]."""
        ctx = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        cos, sin = self.rotary(ctx, positions)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def blocks(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        ctx_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        ctx_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [B, N, Q, V] of N blocks of Q positions each: :meth:`block_states` through the output layer."""
        return self.head_logits(self.block_states(ids, positions, ctx_kv, ctx_mask))

    def head_logits(self, states: torch.Tensor) -> torch.Tensor:
        """Float32 logits of final-normed states [..., H] through the target's output layer."""
        return self.lm_head(states.to(self.lm_head.weight.dtype)).float()

    def block_states(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        ctx_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        ctx_mask: torch.Tensor,
    ) -> torch.Tensor:
        """The final-normed states [B, N, Q, H] of N blocks of Q positions each (heads on top read them).

        Args:
            ids, positions: [B, N, Q] the blocks' tokens (the verified one, then mask tokens) and position ids.
            ctx_kv: :meth:`context` of C positions; ctx_mask: [B, N, C] bool, the context each block sees.
        """
        b, n, width = ids.shape
        x = self.embed_tokens(ids.flatten(1)).to(self.fc.weight.dtype)  # [B, N * Q, H]
        cos, sin = self.rotary(x, positions.flatten(1))
        for layer, (ctx_k, ctx_v) in zip(self.layers, ctx_kv):
            attn_mod = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn_mod.q(h, cos, sin)
            k, v = attn_mod.kv(h, cos, sin)
            split = lambda t: t.unflatten(2, (n, width))  # noqa: E731  [B, h, N * Q, d] -> [B, h, N, Q, d]
            out = block_attention(
                split(q), attn_mod.expand(ctx_k), attn_mod.expand(ctx_v), ctx_mask,
                split(attn_mod.expand(k)), split(attn_mod.expand(v)),
            )  # fmt: skip
            x = x + attn_mod.o_proj(out.flatten(2, 3).transpose(1, 2).flatten(2))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x).unflatten(1, (n, width))

    def block_logits(
        self, ids: torch.Tensor, features: torch.Tensor, valid: torch.Tensor, anchors: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Training: the logits [B, N, K + 1, V] of the block at each anchor i of a sequence, in one pass.

        The block at anchor i holds x_{i+1} then K mask tokens at positions i + 1 .. i + K + 1 and sees the
        context of the real positions <= i: exactly what one decoding round sees after committing x_0..x_{i+1}.
        Block position k (1..K) predicts x_{i+k+1}, which the target's logits at i + k predict; position 0 and
        anchors whose x_{i+1} lies past the sequence are garbage (:func:`block_mask`).

        Args:
            ids: [B, S]; features: [B, S, n * H_target] the target's hidden states at ``aux_layers``; valid: [B, S]
                bool, padding on the right; anchors: [B, N] the anchor positions, default every position (N = S).
        """
        return self.head_logits(self.anchor_states(ids, features, valid, anchors))

    def anchor_states(
        self, ids: torch.Tensor, features: torch.Tensor, valid: torch.Tensor, anchors: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The final-normed states [B, N, K + 1, H] of :meth:`block_logits`'s blocks."""
        batch, width = ids.shape
        block = self.block_size + 1
        arange = torch.arange(width, device=ids.device)
        if anchors is None:
            anchors = arange.expand(batch, width)
        ctx_kv = self.context(features, arange.expand(batch, width))
        first = eagle3.shift_left(ids, 1).gather(1, anchors)  # x_{i+1} at anchor i
        masks = torch.full((*anchors.shape, block - 1), self.mask_token_id, dtype=ids.dtype, device=ids.device)
        block_ids = torch.cat([first[..., None], masks], -1)
        positions = anchors[..., None] + 1 + torch.arange(block, device=ids.device)
        ctx_mask = (arange <= anchors[..., None]) & valid.bool()[:, None, :]
        return self.block_states(block_ids, positions, ctx_kv, ctx_mask)


def block_mask(valid: torch.Tensor, k: int) -> torch.Tensor:
    """[B, S] bool: anchors i where block position k (>= 1) is trained: i and i + k both real positions (the
    target's distribution at i + k predicts the token block position k proposes)."""
    return valid.bool() & eagle3.shift_left(valid.long(), k).bool()


# ---------------------------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------------------------
class ContextCache:
    """Per layer, the context's keys and values of a batch whose rows keep different numbers of entries
    (``valid`` [B, slots] marks real ones; ``length[b]`` is row b's next position)."""

    def __init__(self, batch: int, device: torch.device):
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.length = torch.zeros(batch, dtype=torch.long, device=device)

    @property
    def slots(self) -> int:
        return self.valid.shape[1]

    def positions(self, valid: torch.Tensor) -> torch.Tensor:
        """Position ids of q new entries (holes take none): row b's real entries continue from length[b]."""
        return (self.length[:, None] + valid.long().cumsum(1) - 1).clamp_min(0)

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]], valid: torch.Tensor) -> None:
        """Add q entries (per layer [B, kv_heads, q, d]) with ``valid`` [B, q]."""
        if self.kv is None:
            self.kv = kv
        else:
            self.kv = [(torch.cat([k0, k], 2), torch.cat([v0, v], 2)) for (k0, v0), (k, v) in zip(self.kv, kv)]
        self.valid = torch.cat([self.valid, valid], 1)
        self.length += valid.sum(1)

    def crop(self, n: int) -> None:
        """Drop the last n entries."""
        if n <= 0:
            return
        self.kv = [(k[:, :, :-n], v[:, :, :-n]) for k, v in self.kv]
        self.length -= self.valid[:, -n:].sum(1)
        self.valid = self.valid[:, :-n]

    def select(self, rows: torch.Tensor) -> None:
        rows = rows.to(self.valid.device)
        self.valid, self.length = self.valid[rows], self.length[rows]
        if self.kv is not None:
            self.kv = [(k[rows], v[rows]) for k, v in self.kv]


def _read_context(draft: DFlashDraft, cache: ContextCache, features: torch.Tensor, valid: torch.Tensor) -> None:
    """Append the context of target features [B, q, F] (``valid`` [B, q]) to ``cache``."""
    cache.append(draft.context(features, cache.positions(valid)), valid)


def _block(draft: DFlashDraft, cache: ContextCache, last: torch.Tensor) -> torch.Tensor:
    """One block forward after the cached context: logits [B, K + 1, V] of [last, mask * K] at the next
    positions."""
    return draft.head_logits(block_states(draft, cache, last))


def block_states(draft: DFlashDraft, cache: ContextCache, last: torch.Tensor) -> torch.Tensor:
    """:func:`_block`'s final-normed states [B, K + 1, H]."""
    batch, block = last.shape[0], draft.block_size + 1
    masks = torch.full((batch, block - 1), draft.mask_token_id, dtype=last.dtype, device=last.device)
    ids = torch.cat([last[:, None], masks], 1)[:, None]
    positions = (cache.length[:, None] + torch.arange(block, device=last.device))[:, None]
    return draft.block_states(ids, positions, cache.kv, cache.valid[:, None])[:, 0]


class Drafter(eagle3.Drafter):
    """A DFlash draft's state in one decoding call: its context cache and the (feature, next token) pairs the
    target owes it (kept as the EAGLE-3 drafter keeps them: ``update`` and ``select`` are its own).

    A round reads the pending features into the cache, then one block forward of [the round's last token, K mask
    tokens] proposes d_1..d_K from block positions 1..K. The block is always the trained width, K + 1, whatever
    the round drafts (a shorter draft takes the first positions): bidirectional positions see the whole block.
    """

    def __init__(self, draft: DFlashDraft, batch: int, vocab: int):
        self.head = draft
        self.vocab = vocab
        self.device = draft.fc.weight.device
        self.cache = ContextCache(batch, self.device)
        self.pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # ids, features, valid
        self.forwards = 0

    def propose(self, controller, gamma_cap: int, proc, greedy: bool, generator):
        batch = self.cache.length.shape[0]
        block = min(gamma_cap, self.head.block_size)
        controller.start_round(batch, block)
        tokens, qs = [], []
        if block > 0 and self.pending is not None:
            ids, features, valid = self.pending
            self.pending = None
            _read_context(self.head, self.cache, features, valid)
            self.forwards += 1
            tokens, qs = self.chain(ids[:, -1], controller, block, proc, greedy, generator)  # the round's last token
        return stack(tokens, qs, batch, self.vocab, self.device, greedy)

    def chain(self, last: torch.Tensor, controller, block: int, proc, greedy: bool, generator):
        """The round's draft from one block forward after ``last`` [B]: (tokens, q's) as ``draft_tokens`` gives."""
        logits = _block(self.head, self.cache, last)[..., : self.vocab]
        later = iter(range(2, block + 1))

        def step(token: torch.Tensor) -> torch.Tensor:  # already computed: no forward
            return logits[:, next(later)]

        return draft_tokens(logits[:, 1], step, controller, block, proc, greedy, generator)


def drafter(draft: DFlashDraft, batch: int, vocab: int, input_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """The kind's drafter for one decoding call (``decode.kinds.drafter_for``)."""
    return Drafter(draft, batch, vocab)


class CostStream:
    """The draft's forwards as ``decode.metrics.ForwardCostMeter`` times them (its ``KVStream`` interface): q
    positions of (zero) context read into the cache, then one block forward: what a round's draft costs."""

    def __init__(self, draft: DFlashDraft, batch: int):
        self.model = draft
        self.device = draft.fc.weight.device
        self.vocab = draft.vocab
        self.cache = ContextCache(batch, self.device)

    @property
    def length(self) -> torch.Tensor:
        return self.cache.length

    def feed(self, ids: torch.Tensor, valid: torch.Tensor | None, keep: int) -> torch.Tensor:
        ids = ids.to(self.device)
        real = torch.ones(ids.shape, dtype=torch.bool, device=self.device) if valid is None else valid.to(self.device)
        width = self.model.fc.in_features
        features = torch.zeros(*ids.shape, width, dtype=self.model.fc.weight.dtype, device=self.device)
        _read_context(self.model, self.cache, features, real)
        return _block(self.model, self.cache, ids[:, -1])[:, -keep:]

    def rollback(self, num_new: int, keep: torch.Tensor, keep_list: list[int]) -> None:
        self.cache.crop(num_new)


def cost_stream(draft: DFlashDraft, batch: int) -> CostStream:
    """The draft's forwards as ``decode.metrics.ForwardCostMeter`` times them."""
    return CostStream(draft, batch)


# ---------------------------------------------------------------------------------------------------------------
# Build, save, load
# ---------------------------------------------------------------------------------------------------------------
def draft_config(
    target: nn.Module, layer_ids: Sequence[int] | None, num_layers: int, block_size: int, mask_token_id: int
) -> LlamaConfig:
    """The draft's config from the target's: its widths, heads and rotary settings, ``num_layers`` layers, and
    ``dflash_config``.

    Raises:
        ValueError: one line: layer ids outside the target, a block outside 2..16, a mask token outside the
            vocabulary, no layers.
    """
    tc = text_config(target)
    layers = int(tc.num_hidden_layers)
    ids = check_layer_ids(default_layer_ids(layers) if layer_ids is None else layer_ids, layers)
    vocab = int(tc.vocab_size)
    if not 0 <= int(mask_token_id) < vocab:
        raise ValueError(
            f"mask token id {mask_token_id} is outside the target's vocabulary of {vocab} tokens: set "
            "draft.mask_token_id to an id in it"
        )
    if int(num_layers) < 1:
        raise ValueError(f"a DFlash draft needs at least one layer, got {num_layers}: set draft.num_layers >= 1")
    heads = int(tc.num_attention_heads)
    rope = getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": tc.rope_theta}
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=int(tc.hidden_size),
        intermediate_size=int(tc.intermediate_size),
        num_hidden_layers=int(num_layers),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(tc, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(tc, "head_dim", None) or tc.hidden_size // heads),
        hidden_act="silu",
        max_position_embeddings=int(getattr(tc, "max_position_embeddings", 4096)),
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
        rope_parameters=dict(rope),
        tie_word_embeddings=False,
        bos_token_id=getattr(tc, "bos_token_id", None),
        eos_token_id=getattr(tc, "eos_token_id", None),
    )
    config.target_hidden_size = int(tc.hidden_size)
    config.block_size = check_block_size(block_size) + 1
    config.dflash_config = {"mask_token_id": int(mask_token_id), "target_layer_ids": ids}
    return config


def _shared(target: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The target's token embedding and output layer, which the draft reads and never trains."""
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        raise ValueError(f"target {model_name(target)!r} has no output layer a DFlash draft could share")
    return embed, head


def build(
    target: nn.Module,
    layer_ids: Sequence[int] | None = None,
    num_layers: int = 1,
    block_size: int = 6,
    mask_token_id: int = 0,
    make: Callable[[LlamaConfig, nn.Module, nn.Module], DFlashDraft] | None = None,
) -> DFlashDraft:
    """A fresh draft for ``target`` in float32 on its device: the target's embedding and output layer (shared,
    frozen), ``fc`` and the layers at Llama's initialisation. ``make(config, embed, head)`` builds the module (a
    draft class with heads of its own; default :class:`DFlashDraft`)."""
    eagle3.check_hidden_states(target)
    config = draft_config(target, layer_ids, num_layers, block_size, mask_token_id)
    embed, head = _shared(target)
    draft = (make or DFlashDraft)(config, embed, head)
    std = getattr(text_config(target), "initializer_range", 0.02)
    for module in draft.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
    draft.to(device=next(target.parameters()).device, dtype=torch.float32)
    embed.requires_grad_(False)
    head.requires_grad_(False)
    return draft


ABOUT = (
    "A DFlash draft for speculative decoding, not a standalone language model: a few decoder layers that fill a "
    "block of tokens in one forward from its target's hidden states, sharing the target's token embedding and "
    "output layer. transformers' AutoModelForCausalLM cannot load it and HF assisted generation cannot run it; vLLM "
    "serves it (speculative method dflash), and draftsmith loads it with "
    "decode.kinds.dflash.decoding.load(folder, target)."
)  # config.json's draftsmith.about, and the start of the folder's README.md


def served_config(draft: DFlashDraft) -> dict:
    """config.json as vLLM reads it: a Qwen3 config (Qwen3 layers), ``architectures: [DFlashDraftModel]``,
    ``dflash_config``, ``target_hidden_size`` and ``block_size`` (K + 1)."""
    config = draft.config.to_dict()
    for key in ("transformers_version", "architectures", "model_type", "mlp_bias", "pretraining_tp", "dtype"):
        config.pop(key, None)
    config.update(
        architectures=[ARCHITECTURE],
        model_type="qwen3",
        attention_bias=False,
        rope_theta=float(draft.config.rope_parameters.get("rope_theta", 10000.0)),
        torch_dtype=str(draft.fc.weight.dtype).replace("torch.", ""),
        draftsmith={"draft_kind": NAME, "about": ABOUT},
    )
    return config


def usage(target: str, model: str, gamma: int, block: int) -> list[str]:
    """Markdown launch lines for the draft in ``model`` with ``target``: vLLM's ``method: dflash`` with the
    trained block (vLLM feeds 1 + ``num_speculative_tokens`` positions, and the draft was trained on 1 + block),
    draftsmith's bench with ``gamma`` (capped at the block) and its Python loader. No HF assisted or SGLang line:
    neither runs it."""
    gamma = min(int(gamma), int(block))
    spec = json.dumps({"method": "dflash", "model": model, "num_speculative_tokens": int(block)})
    return [
        "vLLM:",
        "",
        "```bash",
        f"vllm serve {target} --speculative-config '{spec}'",
        "```",
        "",
        f"`num_speculative_tokens` {block}, the block it was trained for: vLLM reads a block of 1 + that many "
        "positions, and a shorter one would show the draft's bidirectional block a width it was not trained on.",
        "",
        "draftsmith's own decoder (a checkout of draftsmith), from the command line or in Python:",
        "",
        "```bash",
        f"python -m decode bench --target {target} --draft {model} --prompts PROMPTS.jsonl --num-draft-tokens {gamma}",
        "```",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "from decode.kinds.dflash import decoding as dflash",
        "",
        f'target = AutoModelForCausalLM.from_pretrained("{target}", dtype="auto")',
        f'draft = dflash.load("{model}", target)  # shares the target\'s embedding and output layer',
        "```",
        "",
    ]


def readme(config: dict, target_name: str | None, gamma: int | None = None) -> str:
    """README.md of a draft folder (a checkpoint, best/): what it is and how to serve or load it."""
    target = target_name or "TARGET"
    block = int(config["block_size"]) - 1
    ids, mask = config["dflash_config"]["target_layer_ids"], config["dflash_config"]["mask_token_id"]
    lines = [
        "# DFlash draft",
        "",
        ABOUT,
        "",
        f"Trained with draftsmith for the target `{target}`: it reads the outputs of the target's layers {ids} "
        f"(`dflash_config.target_layer_ids`), has {config['num_hidden_layers']} layer(s) and proposes up to {block} "
        f"tokens per forward from a block of the last verified token and {block} mask tokens (id {mask}).",
        "",
        *usage(target, "PATH/TO/THIS/FOLDER", gamma or block, block),
        f"Files: `config.json` (a Qwen3 config, architectures `[{ARCHITECTURE}]`, with `dflash_config`, "
        f"`target_hidden_size` and `block_size` = {block + 1}, the block with its verified first position) and "
        f"`{WEIGHTS}` (`fc`, `hidden_norm`, `layers.*`, `norm`; no embedding or output layer: the target's).",
        "",
    ]
    return "\n".join(lines)


def save(
    draft: DFlashDraft,
    directory: str | Path,
    dtype: torch.dtype | None = None,
    target_name: str | None = None,
    gamma: int | None = None,
) -> Path:
    """Write the served checkpoint (config.json + model.safetensors, no embedding or output layer) and a
    README.md (:func:`readme`) into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = dtype or draft.fc.weight.dtype
    tensors = {name: p.detach().to("cpu", dtype).contiguous() for name, p in draft.named_parameters()}
    config = served_config(draft)
    config["torch_dtype"] = str(dtype).replace("torch.", "")
    save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "README.md").write_text(readme(config, target_name, gamma))
    return directory


def folder_config_dict(path: str | Path) -> dict | None:
    """config.json of ``path`` when it is a DFlash draft folder, else None."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("dflash_config"), dict):
        return None
    return raw if any("DFlash" in a for a in raw.get("architectures") or []) else None


def is_dflash_folder(path: str | Path) -> bool:
    """True for a local folder holding a DFlash draft's config (``DFlashDraftModel`` with ``dflash_config``)."""
    return folder_config_dict(path) is not None


def folder_block(path: str | Path) -> int | None:
    """The tokens a DFlash folder proposes per forward (its ``block_size`` - 1), or None for another folder."""
    raw = folder_config_dict(path)
    if raw is None:
        return None
    return int(raw.get("block_size") or MAX_BLOCK + 1) - 1


def fitted_config(
    raw: dict, directory: str | Path, target_config, target_name: str, what: str = "DFlash draft"
) -> LlamaConfig:
    """The draft's config (config.json as saved), checked against the target's config.

    Raises:
        ValueError: one line: the draft was made for another target (vocabulary, hidden size, layer ids).
    """
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    keep = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "draftsmith", "torch_dtype")}
    config = LlamaConfig(**keep)
    config.target_hidden_size = int(getattr(config, "target_hidden_size", None) or config.hidden_size)
    fit = (int(config.vocab_size), int(config.target_hidden_size), int(config.hidden_size))
    if fit != (int(tc.vocab_size), int(tc.hidden_size), int(tc.hidden_size)):
        raise ValueError(
            f"{what} {str(directory)!r} was trained for a target with vocabulary {config.vocab_size} and "
            f"hidden size {config.target_hidden_size}, not {target_name!r} ({tc.vocab_size}, {tc.hidden_size}): "
            "pass the target it was trained on"
        )
    try:
        check_layer_ids(config.dflash_config.get("target_layer_ids") or [], int(tc.num_hidden_layers))
    except ValueError as err:
        raise ValueError(f"{what} {str(directory)!r} and target {target_name!r}: {err}") from None
    check_block_size(int(config.block_size) - 1)
    return config


def load(directory: str | Path, target: nn.Module) -> DFlashDraft:
    """The draft saved in ``directory``, on the target's device in its saved dtype, sharing the target's
    embedding and output layer.

    Raises:
        ValueError: not a DFlash folder, or the draft does not fit the target.
    """
    directory = Path(directory)
    raw = folder_config_dict(directory)
    if raw is None:
        raise ValueError(f"{str(directory)!r} is not a DFlash draft folder (config.json with dflash_config)")
    config = fitted_config(raw, directory, target.config, model_name(target))
    tensors = load_file(str(directory / WEIGHTS))
    for shared in ("embed_tokens.weight", "lm_head.weight"):  # some exporters include the target's
        tensors.pop(shared, None)
    embed, head = _shared(target)
    draft = DFlashDraft(config, embed, head)
    missing, unexpected = draft.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"{directory}: not a DFlash draft (missing {missing}, unexpected {unexpected})")
    draft.to(device=next(target.parameters()).device, dtype=tensors["fc.weight"].dtype)
    draft.name_or_path = str(directory)
    return draft


# ---------------------------------------------------------------------------------------------------------------
# Its saved folder and vLLM (decode.kinds.dispatch asks every kind's decoding module alike)
# ---------------------------------------------------------------------------------------------------------------
def is_folder(path: str | Path) -> bool:
    """A folder holding a DFlash draft (:func:`is_dflash_folder`)."""
    return is_dflash_folder(path)


def check_folder(path: str | Path, target_config, target_name: str) -> None:
    """ValueError (one line) unless the draft in ``path`` was made for this target (:func:`fitted_config`)."""
    fitted_config(folder_config_dict(path), path, target_config, target_name)


def vllm_problem(version: str, methods: set[str]) -> str | None:
    """None where the build has vLLM's ``dflash`` speculative method (or does not list its methods), else one line
    naming the fix."""
    if not methods or TRAITS.vllm_method in methods:
        return None
    return (
        f"vLLM {version} has no speculative method {TRAITS.vllm_method!r}, which serves DFlash drafts: install a "
        "vLLM that has it"
    )


def is_model(draft: nn.Module) -> bool:
    """A loaded draft of this kind (it names its kind)."""
    return getattr(draft, "kind", None) == NAME
