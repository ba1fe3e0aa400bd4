"""Draft-quality and speed metrics: acceptance, tau, per-position acceptance, c, v, Leviathan's bound.

Notation (Leviathan et al. 2023): a = per-token acceptance probability, g = gamma = draft tokens per round,
c = draft forward time / target forward time, v = target (g+1)-token forward time / target 1-token forward time,
tau = tokens emitted per target forward.
"""

from __future__ import annotations

import collections
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from decode.kinds.dispatch import cost_stream
from decode.kv_stream import decoding
from decode.output import SpecStats


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
        "per_position_judged": list(stats.per_position_drafted),  # how many drafts reached each position
        "mean_num_draft_tokens": stats.mean_num_draft_tokens,
    }


def sync(device: torch.device) -> None:
    """Wait for `device`'s queued work, so a clock read after it times the work (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ForwardCostMeter:
    """Standalone KV-cached forward times of both models, through the decoder's own forward path.

    ``sample()`` is called between the bench's timed runs, so the timings see the same machine state as the
    runs (on a shared or throttling machine, a block of timings at one moment can be off by 30%); medians over
    all samples give c and v.

    Args:
        input_ids, attention_mask: ``[B, L]``: both caches are filled with this prompt first (timed once).
    """

    def __init__(self, target: nn.Module, draft: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        self.gen = torch.Generator().manual_seed(0)
        self.samples: dict[str, list[float]] = {"target": [], "draft": []}
        self.verify: dict[int, list[float]] = {}
        self.prefill_ms: dict[str, float] = {}
        self.prefill_tokens = int(input_ids.shape[1])
        self.streams: dict = {}  # name -> KVStream (or a draft kind's stream with its interface)
        with decoding(target, draft):
            for name, model in (("target", target), ("draft", draft)):
                stream = cost_stream(model, input_ids.shape[0])
                seconds = _timed(stream.device, lambda s=stream: s.feed(input_ids, attention_mask.bool(), keep=1))
                self.prefill_ms[name] = seconds * 1e3
                self.streams[name] = stream

    def _forward(self, name: str, q: int) -> float:
        """Seconds of one q-token forward, which is then cropped away again."""
        stream = self.streams[name]
        batch = stream.length.shape[0]
        ids = torch.randint(0, stream.vocab, (batch, q), generator=self.gen)
        seconds = _timed(stream.device, lambda: stream.feed(ids, None, keep=q))
        stream.rollback(q, torch.zeros(batch, dtype=torch.long), [0] * batch)
        return seconds

    @property
    def samples_taken(self) -> int:
        return len(self.samples["target"])

    def sample(self, verify_sizes: list[int]) -> None:
        """One timed forward of each kind: target 1 token, draft 1 token, target q tokens for q in verify_sizes."""
        with decoding(self.streams["target"].model, self.streams["draft"].model):
            self.samples["target"].append(self._forward("target", 1))
            self.samples["draft"].append(self._forward("draft", 1))
            for q in verify_sizes:
                self.verify.setdefault(q, []).append(self._forward("target", q))

    def summary(self, gammas: list[int], verified: list[int] | None = None) -> dict:
        """c, v and the medians (ms), given the draft length of every decoding round.

        v is the mean over rounds of (verify time of that round's g + 1 tokens) / (1-token time): verify time is
        not linear in the token count on every machine (with MKL on CPU, 4 rows are cheaper than 3), so a
        varying draft length (``auto``) is costed round by round. Sizes that were not sampled are interpolated.
        ``verified``: draft tokens each round verified where that differs from its draft length (a tree).
        """
        t1 = statistics.median(self.samples["target"])
        medians = {1: t1, **{q: statistics.median(ts) for q, ts in self.verify.items()}}
        counts = collections.Counter(gammas if verified is None else verified)
        total = sum(counts.values()) or 1
        v = sum(n * _interpolate(medians, g + 1) for g, n in counts.items()) / total / t1
        verify_ms = {q: t * 1e3 for q, t in sorted(medians.items()) if q > 1}
        return {
            "target_ms": t1 * 1e3,
            "draft_ms": statistics.median(self.samples["draft"]) * 1e3,
            "verify_ms": verify_ms,
            "c": statistics.median(self.samples["draft"]) / t1,
            "v": v,
            "samples": self.samples_taken,
            "prefill_ms": self.prefill_ms,
            "prefill_tokens": self.prefill_tokens,
        }


CURVE_MAX = 16  # the verify-cost curve covers K = 1..16 drafted tokens (a block draft's largest block)


def verify_cost_curve(meter: ForwardCostMeter, samples: int = 3, max_k: int = CURVE_MAX) -> dict[int, float]:
    """The target's verify-cost curve on this machine: for K = 1..max_k drafted tokens, the median time of one
    (K + 1)-token forward over the median 1-token forward (the meter's own samples, plus ``samples`` more of each
    size, taken now)."""
    for _ in range(samples):
        meter.sample(list(range(2, max_k + 2)))
    t1 = statistics.median(meter.samples["target"])
    return {k: statistics.median(meter.verify[k + 1]) / t1 for k in range(1, max_k + 1)}


def block_tokens(per_position: list[float], k: int) -> float:
    """Expected tokens a round of K drafted tokens gives (the target's own included): 1 + sum over j <= K of the
    chance that the first j are accepted, from the per-position (conditional) acceptance; positions past the
    measured ones are taken at the last measured rate."""
    if not per_position:
        return 1.0
    total, alive = 1.0, 1.0
    for j in range(k):
        alive *= per_position[min(j, len(per_position) - 1)]
        total += alive
    return total


def best_block(per_position: list[float], curve: dict[int, float], c: float, max_k: int) -> dict:
    """The block size K (1..max_k) a block draft runs fastest at, from the measured per-position acceptance and
    the verify-cost curve: one draft forward (``c``) and one (K + 1)-token verify per round, so the expected
    speedup over target-only is tokens(K) / (c + v(K + 1)). Returns {"k", "expected_speedup": {K: x}}."""
    expected = {k: block_tokens(per_position, k) / (c + curve[k]) for k in range(1, max_k + 1) if k in curve}
    return {"k": max(expected, key=expected.get), "expected_speedup": expected}


def _interpolate(points: dict[int, float], x: float) -> float:
    """Piecewise-linear through ``points`` {x: y}; linear extrapolation from the two nearest ends."""
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    if x in points:
        return points[x]
    lo = max((p for p in xs if p < x), default=None)
    hi = min((p for p in xs if p > x), default=None)
    if lo is None:
        lo, hi = xs[0], xs[1]
    elif hi is None:
        lo, hi = xs[-2], xs[-1]
    return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)


def _timed(device: torch.device, fn) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def speedup_ci95(
    fast: Sequence[tuple[float, float]], base: Sequence[tuple[float, float]], *, resamples: int = 2000, seed: int = 0
) -> list[float] | None:
    """95% bootstrap interval on the speedup (sum of tokens / sum of seconds, fast over base) from paired units.

    ``fast[i]`` and ``base[i]`` are ``(tokens, seconds)`` of the same unit (a prompt batch, or one repeat of it)
    for the two methods. Whole pairs are resampled, so what both methods share (a long prompt, a slow moment of
    the machine) cancels in each resample, as it does in the point estimate. Percentile interval, fixed seed:
    the same timings always give the same interval. None with fewer than two units.
    """
    if len(fast) != len(base):
        raise ValueError(f"paired timings differ in length: {len(fast)} vs {len(base)}")

    def estimate(picks: list[int]) -> float | None:
        fast_s, base_s = sum(fast[i][1] for i in picks), sum(base[i][1] for i in picks)
        base_n = sum(base[i][0] for i in picks)
        if fast_s > 0 and base_n > 0:
            return sum(fast[i][0] for i in picks) / fast_s * base_s / base_n
        return None

    return _bootstrap_ci95(len(fast), estimate, resamples, seed)


def mean_ci95(values: Sequence[float], *, resamples: int = 2000, seed: int = 0) -> list[float] | None:
    """95% bootstrap interval on the mean of ``values`` (percentile, fixed seed); None with fewer than two."""
    return _bootstrap_ci95(len(values), lambda picks: sum(values[i] for i in picks) / len(picks), resamples, seed)


def _bootstrap_ci95(
    n: int, estimate: Callable[[list[int]], float | None], resamples: int, seed: int
) -> list[float] | None:
    """Percentile bootstrap over ``n`` units: ``estimate`` of each resample of unit indices (None: skipped)."""
    if n < 2:
        return None
    rng = random.Random(seed)
    estimates = []
    for _ in range(resamples):
        value = estimate([rng.randrange(n) for _ in range(n)])
        if value is not None:
            estimates.append(value)
    if not estimates:
        return None
    estimates.sort()
    lo = estimates[int(0.025 * (len(estimates) - 1))]
    hi = estimates[math.ceil(0.975 * (len(estimates) - 1))]
    return [lo, hi]


def best_gamma(ev: dict) -> int:
    """The gamma a bench JSON (an eval.json) measured: num_draft_tokens, or the mean gamma used when it was 'auto'."""
    g = ev.get("num_draft_tokens")
    if isinstance(g, int) and not isinstance(g, bool) and g > 0:
        return g
    return max(1, round(float(ev.get("mean_num_draft_tokens") or 1)))
