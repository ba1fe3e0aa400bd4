"""Draft-quality and speed metrics: acceptance, tau, per-position acceptance, c, v, Leviathan's bound.

Notation (Leviathan et al. 2023): a = per-token acceptance probability, g = gamma = draft tokens per round,
c = draft forward time / target forward time, v = target (g+1)-token forward time / target 1-token forward time,
tau = tokens emitted per target forward.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from decode.speculative import KVStream, SpecStats, _logits_width


def expected_tokens_per_round(a: float, gamma: float) -> float:
    """(1 - a^(g+1)) / (1 - a): expected tokens per round when each draft token is accepted w.p. a."""
    if a >= 1.0:
        return gamma + 1.0
    return (1.0 - a ** (gamma + 1.0)) / (1.0 - a)


def solve_acceptance(tau: float, gamma: float) -> float:
    """The a for which ``expected_tokens_per_round(a, gamma) == tau`` (bisection; tau is clipped to [1, g+1])."""
    if gamma <= 0 or tau <= 1.0:
        return 0.0
    if tau >= gamma + 1.0:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):  # monotone in a
        mid = (lo + hi) / 2
        if expected_tokens_per_round(mid, gamma) < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def leviathan_bound(a: float, gamma: float, c: float) -> float:
    """Expected walltime improvement (1 - a^(g+1)) / ((1 - a)(g c + 1)): verify assumed as cheap as one forward."""
    return expected_tokens_per_round(a, gamma) / (gamma * c + 1.0)


def theoretical_speedup(tau: float, gamma: float, c: float, v: float) -> float:
    """Zero-overhead speedup tau / (g c + v): what the loop reaches if only the forwards cost time."""
    return tau / (gamma * c + v)


def speedup_with_prefill(speedup: float, decode_ms: float, target_prefill_ms: float, draft_prefill_ms: float) -> float:
    """A decode-only speedup diluted by the prompt forwards every method pays (the draft's only for speculative).

    Args:
        decode_ms: target-only decoding time of the new tokens (no prompt); *_prefill_ms: the prompt forwards.
    """
    return (target_prefill_ms + decode_ms) / (target_prefill_ms + draft_prefill_ms + decode_ms / speedup)


def acceptance_metrics(stats: SpecStats) -> dict:
    """The bench JSON's acceptance keys from merged decoding counters."""
    return {
        "acceptance_rate": stats.acceptance_rate,
        "mean_accepted_length": stats.mean_accepted_length,
        "per_position_acceptance": stats.per_position_acceptance,
        "mean_num_draft_tokens": stats.mean_num_draft_tokens,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_forward(stream: KVStream, q: int, reps: int, gen: torch.Generator) -> float:
    """Median seconds of a KV-cached q-token forward (each one cropped away again), after one warm-up."""
    batch = stream.length.shape[0]
    times = []
    for i in range(reps + 1):
        ids = torch.randint(0, stream.vocab, (batch, q), generator=gen)
        _sync(stream.device)
        t0 = time.perf_counter()
        stream.feed(ids, None, keep=q)
        _sync(stream.device)
        if i:
            times.append(time.perf_counter() - t0)
        stream.rollback(q, torch.zeros(batch, dtype=torch.long), [0] * batch)
    return statistics.median(times)


def measure_forward_costs(
    target: nn.Module,
    draft: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    verify_tokens: list[int],
    reps: int = 5,
) -> dict:
    """Standalone KV-cached forward times, the decoder's own forward path, on one (batch of) prompt(s).

    Args:
        input_ids, attention_mask: ``[B, L]``: the cache is filled with this prompt first.
        verify_tokens: the (g+1)-token verify sizes to time.

    Returns:
        {"target_ms", "draft_ms", "verify_ms": {q: ms}, "c", "v": {q: ratio}} with medians over ``reps``, and
        "prefill_ms": {"target", "draft"}: one forward over the prompt (not part of c and v; it is reported so the
        gap between measured and theoretical speedup can be told apart from loop overhead).
    """
    gen = torch.Generator().manual_seed(0)
    mask = None if attention_mask is None else attention_mask.bool()
    prefill = {}
    with torch.inference_mode():
        streams = {}
        for name, model in (("target", target), ("draft", draft)):
            was_training = model.training
            model.eval()
            stream = KVStream(model, input_ids.shape[0], _logits_width(model))
            _sync(stream.device)
            t0 = time.perf_counter()
            stream.feed(input_ids, mask, keep=1)
            _sync(stream.device)
            prefill[name] = (time.perf_counter() - t0) * 1e3
            streams[name] = (stream, was_training)
        t_target = _time_forward(streams["target"][0], 1, reps, gen)
        t_draft = _time_forward(streams["draft"][0], 1, reps, gen)
        verify = {q: _time_forward(streams["target"][0], q, reps, gen) for q in sorted(set(verify_tokens))}
        for stream, was_training in streams.values():
            stream.model.train(was_training)
    return {
        "target_ms": t_target * 1e3,
        "draft_ms": t_draft * 1e3,
        "verify_ms": {q: t * 1e3 for q, t in verify.items()},
        "c": t_draft / t_target,
        "v": {q: t / t_target for q, t in verify.items()},
        "prefill_ms": prefill,
        "prefill_tokens": int(input_ids.shape[1]),
    }


def interpolate_v(v: dict[int, float], gamma: float) -> float:
    """v at a fractional gamma (auto draft length) from the measured (g+1)-token sizes."""
    q = gamma + 1.0
    sizes = sorted(v)
    if q <= sizes[0]:
        return v[sizes[0]]
    if q >= sizes[-1]:
        return v[sizes[-1]]
    hi = next(s for s in sizes if s >= q)
    lo = max(s for s in sizes if s <= q)
    if hi == lo:
        return v[lo]
    return v[lo] + (v[hi] - v[lo]) * (q - lo) / (hi - lo)
