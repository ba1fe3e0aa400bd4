"""One logits-processing path for both models.

The target's p and the draft's q must be shaped by exactly the same temperature / top-k / top-p rule,
otherwise the acceptance test min(1, p/q) compares two different distributions and the decoder is no
longer lossless. Everything that turns logits into a distribution lives here.
"""

from __future__ import annotations

import torch


def validate_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Raise ValueError (one line) on out-of-range sampling parameters."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def process_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Turn logits into the sampling distribution: temperature, then top-k, then top-p, then softmax.

    Args:
        logits: ``[..., vocab]`` raw logits (any float dtype).
        temperature: 0 means greedy: the result is one-hot on the argmax (first index on ties, like ``argmax``).
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set of most likely tokens whose mass reaches top_p (1.0 = off); the most likely
            token is always kept.

    Returns:
        ``[..., vocab]`` float32 **probabilities** (rows sum to 1; filtered tokens are exactly 0).
    """
    validate_sampling(temperature, top_k, top_p)
    logits = logits.float()
    if temperature == 0:
        # Greedy as a distribution: accept iff draft == argmax p, residual max(0, p - q) is one-hot on argmax p.
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    logits = logits / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass *before* it already reaches top_p; the first token is never dropped.
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row from (possibly unnormalised, non-negative) weights, by inverting the CDF.

    Same distribution as ``torch.multinomial(probs, 1)``, ~8x faster on CPU (one row of 8192 tokens, one thread:
    21 vs 180 us per draw; the decoder samples every draft token). The CDF is accumulated in float64;
    zero-weight tokens are never drawn.

    Args:
        probs: ``[batch, vocab]`` non-negative weights; rows need not sum to 1.

    Returns:
        ``[batch]`` int64 token ids.
    """
    cdf = probs.double().cumsum(-1)  # [batch, vocab]
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=torch.float64) * cdf[:, -1:]
    # First token whose cumulative weight exceeds u: u < total, so it exists, and it has positive weight.
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
