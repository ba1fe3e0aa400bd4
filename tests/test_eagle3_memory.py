"""The EAGLE-3 head's training memory: the unroll's attention builds no [S, S] scores yet equals the dense attention
(values and gradients), its memory grows linearly in S, and the target's training forward keeps only the hidden
states the head reads."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from decode.kinds.eagle3 import decoding as eagle3
from decode.kinds.eagle3 import train_step
from tests.memory import TensorPeak
from tests.tiny import tiny_config


def dense_unrolled(
    head: eagle3.Eagle3Head,
    ids: torch.Tensor,
    features: torch.Tensor,
    position_ids: torch.Tensor,
    key_valid: torch.Tensor,
    steps: int,
) -> list[torch.Tensor]:
    """The training-time test written out with dense [B, h, S, S + k] scores and one softmax over them: the
    reference :meth:`Eagle3Head.unrolled` must equal (step k at i: step 0's keys <= i, valid, and its own position's
    keys of steps 1..k)."""
    attn_mod = head.midlayer.self_attn
    s = ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
    allowed0 = causal[None, None] & key_valid[:, None, None, :]  # [B, 1, S, S]
    hidden, fused = features, True
    diag_k: list[torch.Tensor] = []
    diag_v: list[torch.Tensor] = []
    out = []
    for k in range(steps):
        x, residual = head._layer_in(eagle3.shift_left(ids, k + 1), hidden, fused)
        cos, sin = head.rotary(x, position_ids + k)
        q, key, value = attn_mod.qkv(x, cos, sin)
        if k == 0:
            k0, v0 = attn_mod.expand(key), attn_mod.expand(value)
        else:
            diag_k.append(attn_mod.expand(key))
            diag_v.append(attn_mod.expand(value))
        scale = q.shape[-1] ** -0.5
        scores = ((q @ k0.transpose(-1, -2)) * scale).masked_fill(~allowed0, float("-inf"))
        diag = [(q * dk).sum(-1, keepdim=True) * scale for dk in diag_k]  # each [B, h, S, 1]
        probs = torch.cat([scores, *diag], -1).float().softmax(-1).to(q.dtype)
        attn = probs[..., :s] @ v0
        for m, dv in enumerate(diag_v):
            attn = attn + probs[..., s + m : s + m + 1] * dv
        logits, hidden = head._layer_out(attn, residual)
        fused = False
        out.append(logits)
    return out


class DenseUnrolled(train_step.Unrolled):
    """:class:`Unrolled` with the dense reference unroll, for comparing whole training steps."""

    def forward(self, ids, features, position_ids, key_valid, steps, recompute=False):
        return dense_unrolled(self.head, ids, features, position_ids, key_valid, steps)


def tiny_head(arch: str, seed: int = 0, **overrides) -> tuple[torch.nn.Module, eagle3.Eagle3Head]:
    """A tiny target of ``arch`` and a head on it whose weights are large enough for peaked attention."""
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(tiny_config(arch, 97, layers=4, **overrides)).eval()
    head = eagle3.build(target, list(range(0, 97, 2)))
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.normal_(0, 0.3)
    return target, head


def right_padded(lengths: list[int], width: int) -> torch.Tensor:
    return torch.arange(width)[None] < torch.tensor(lengths)[:, None]


SHAPES = [  # (architecture, config overrides, row lengths, width, unrolled steps)
    ("llama", {}, [7], 7, 1),
    ("llama", {}, [33, 20, 5], 33, 3),
    ("qwen2", {}, [40, 40], 40, 4),
    ("qwen2", {"num_key_value_heads": 4}, [18, 3], 18, 2),
    ("gemma2", {}, [26, 11, 26], 26, 3),
    ("llama", {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 40}, [50, 1], 50, 3),
]


@pytest.mark.parametrize("arch, overrides, lengths, width, steps", SHAPES)
@pytest.mark.parametrize("recompute", [False, True])
def test_unrolled_attention_equals_the_dense_one_values_and_gradients(
    arch, overrides, lengths, width, steps, recompute
):
    target, head = tiny_head(arch, **overrides)
    g = torch.Generator().manual_seed(len(lengths) * width + steps)
    valid = right_padded(lengths, width)
    ids = torch.randint(0, 97, valid.shape, generator=g)
    features = torch.randn(*valid.shape, 3 * target.config.hidden_size, generator=g).requires_grad_(True)
    positions = torch.arange(width).expand_as(ids)
    weights = [torch.randn(*valid.shape, len(head.draft_ids), generator=g) for _ in range(steps)]
    params = [p for p in head.parameters() if p.requires_grad]
    results = []
    unrolls = (
        lambda *a, steps: head.unrolled(*a, steps=steps, recompute=recompute),
        lambda *a, steps: dense_unrolled(head, *a, steps),
    )
    for unroll in unrolls:
        out = unroll(ids, features, positions, valid, steps=steps)
        # every real position's output counts (padding positions are never trained)
        loss = sum((o * w)[valid].sum() for o, w in zip(out, weights))
        results.append(([o[valid].detach() for o in out], torch.autograd.grad(loss, [features, *params])))
    (new, new_grads), (old, old_grads) = results
    assert len(new) == steps
    for a, b in zip(new, old):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(new_grads, old_grads):
        torch.testing.assert_close(a, b, atol=1e-5 * float(b.abs().max()), rtol=1e-4)


def test_left_padding_is_refused():
    target, head = tiny_head("llama")
    valid = torch.tensor([[False, True, True], [True, True, True]])
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="right-padded"):
        head.unrolled(ids, torch.zeros(2, 3, 3 * 64), torch.arange(3).expand(2, 3), valid, steps=2)


def _unroll_peak(head: eagle3.Eagle3Head, seq: int, steps: int = 3, recompute: bool = False) -> int:
    """Peak tensor bytes of one unroll's forward and backward over a [2, seq] batch."""
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, 97, (2, seq), generator=g)
    features = torch.randn(2, seq, 3 * 64, generator=g)
    valid = torch.ones(2, seq, dtype=torch.bool)
    with TensorPeak() as peak:
        out = head.unrolled(ids, features, torch.arange(seq).expand(2, seq), valid, steps=steps, recompute=recompute)
        sum(o.float().square().mean() for o in out).backward()
    return peak.bytes


def test_unroll_memory_is_linear_in_the_sequence_length():
    """Twice the tokens, at most 2.2 times the memory (dense [B, h, S, S] scores would give ~3.3 here)."""
    _, head = tiny_head("llama")
    short, long = _unroll_peak(head, 192), _unroll_peak(head, 384)
    assert long <= 2.2 * short, (short, long)


def test_recompute_keeps_less_for_the_backward():
    _, head = tiny_head("llama")
    kept, recomputed = _unroll_peak(head, 256), _unroll_peak(head, 256, recompute=True)
    assert recomputed < 0.8 * kept, (kept, recomputed)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_target_forward_gives_every_hidden_state_forward_and_keeps_only_those(arch):
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(tiny_config(arch, 97, layers=12)).eval()
    batch = {"input_ids": torch.randint(1, 97, (2, 64)), "attention_mask": right_padded([64, 40], 64).long()}
    aux = [2, 6, 9]
    with torch.no_grad():
        full = target(**batch, output_hidden_states=True)
    features, logits, last = train_step.target_forward(target, batch, aux)
    assert torch.equal(features, torch.cat([full.hidden_states[i] for i in aux], -1))
    assert torch.equal(logits, full.logits) and torch.equal(last, full.hidden_states[-1])
    if not train_step.keeps_selected_hidden_states():
        return  # this transformers keeps every state whatever it is asked: the same numbers, no saving to measure
    # What the forward holds: the 4 states read, not the 13 it computes
    with TensorPeak() as kept:
        train_step.target_forward(target, batch, aux)
    with TensorPeak() as every, torch.no_grad():
        target(**batch, output_hidden_states=True)
    state = 2 * 64 * target.config.hidden_size * 4
    assert every.bytes - kept.bytes > 6 * state, (every.bytes, kept.bytes)
