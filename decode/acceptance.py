"""The acceptance rules of speculative decoding, as pure functions of draft tokens and distributions.

Greedy: accept while the draft token is the target's argmax. Sampling (Leviathan et al. 2023): accept d_i with
probability min(1, p_i(d_i) / q_i(d_i)) until the first rejection, there sample from norm(max(0, p - q)); if all
are accepted, sample a bonus token from p_{g+1}. The output then follows p exactly.
"""

from __future__ import annotations

import torch

from decode.sampling import sample


def accept_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature 0: accept while the draft token is the target's argmax; the next token is the target's argmax.

    Exactly ``accept_sampled`` with one-hot p and q, without building them.

    Args:
        draft_tokens: ``[B, g]``; target_logits: ``[B, g + 1, V]``.

    Returns:
        (accepted ``[B]`` in 0..g, next token ``[B]``).
    """
    best = target_logits.argmax(-1)  # [B, g + 1]
    g = draft_tokens.shape[1]
    accepted = (draft_tokens == best[:, :g]).int().cumprod(1).sum(1)
    return accepted, best.gather(1, accepted[:, None]).squeeze(1)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) up to normalisation, ``[B, V]``; falls back to p where p == q (rejection had prob 0)."""
    residual = (p - q).clamp_min(0)
    return torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)


def accept_sampled(
    draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling: accept d_i w.p. min(1, p_i(d_i)/q_i(d_i)); resample the first rejection.

    Args:
        draft_tokens: ``[B, g]`` drawn from q; q: ``[B, g, V]``; p: ``[B, g + 1, V]`` (processed probabilities).

    Returns:
        (accepted ``[B]`` in 0..g, next token ``[B]``: the resampled or the bonus token).
    """
    batch, g = draft_tokens.shape
    idx = draft_tokens[..., None]
    p_d = p[:, :g].gather(-1, idx).squeeze(-1)  # [B, g]
    q_d = q.gather(-1, idx).squeeze(-1)  # [B, g], > 0 since d ~ q
    u = torch.rand(batch, g, generator=generator, device=p.device) if g else p_d
    accepted = (u * q_d < p_d).int().cumprod(1).sum(1)  # u < p/q without dividing
    rows = torch.arange(batch, device=p.device)
    p_n = p[rows, accepted]  # [B, V]
    # Past the last draft token q is 0, so the bonus token is drawn from p itself.
    q_n = torch.cat([q, torch.zeros_like(p[:, :1])], 1)[rows, accepted]
    return accepted, sample(residual_distribution(p_n, q_n), generator)
