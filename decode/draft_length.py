"""How many tokens the draft proposes per round: fixed gamma, or ``auto``.

``auto`` stops each draft when the next draft token is no longer worth its cost. Acceptance is bursty (a
draft is right for a whole identifier, then wrong at the next decision), so a per-token signal beats any
single gamma: the draft's own confidence, calibrated online against what the target actually accepted.

Drafting one more token costs one draft forward plus the extra verify cost of a longer target pass, in units
of one target forward: ``c + b``. It gains the probability that every draft token so far *and* the new one
are accepted. Rate maximisation (tokens per unit cost, a renewal-reward argument) says: draft one more token
iff that expected gain exceeds ``rate * (c + b)``, where ``rate`` is the decoder's current tokens per unit
cost. ``c`` and ``b`` are measured from the loop's own forward timings (or ``c`` is given).
"""

from __future__ import annotations

import bisect

import torch


class FixedDraftLength:
    """Always propose ``gamma`` tokens (fewer only where the token budget is nearly spent)."""

    needs_confidence = False

    def __init__(self, gamma: int):
        if gamma < 1:
            raise ValueError(f"num_draft_tokens must be >= 1 or 'auto', got {gamma}")
        self.max_gamma = gamma

    def start_round(self, batch_size: int) -> None:
        pass

    def keep_drafting(self, confidence: torch.Tensor | None) -> bool:
        return True

    def end_round(
        self, gamma: int, accepted: torch.Tensor, draft_time: float | None, verify_time: float | None
    ) -> None:
        pass


class AutoDraftLength:
    """Adaptive draft length: continue while the expected gain of one more draft token exceeds its cost.

    One instance may be reused across calls (e.g. over a bench's prompts) so the calibration carries over;
    the decoder stays lossless whatever this object decides — it only changes speed.

    Args:
        max_gamma: hard cap on tokens per draft.
        draft_cost_ratio: c, draft forward / target forward; measured from the loop's timings when None.
        prior_strength: pseudo-counts per confidence bucket of the prior.
    """

    needs_confidence = True

    # Confidence buckets, finer at low confidence, where most draft tokens of a weak draft fall.
    EDGES = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8)

    def __init__(self, max_gamma: int = 12, draft_cost_ratio: float | None = None, prior_strength: float = 3.0):
        if max_gamma < 1:
            raise ValueError(f"max_gamma must be >= 1, got {max_gamma}")
        self.max_gamma = max_gamma
        self.fixed_c = draft_cost_ratio
        # Plain Python floats: this runs once per draft token, and a handful of rows is faster without tensors.
        centers = [(lo + hi) / 2 for lo, hi in zip(self.EDGES, [*self.EDGES[1:], 1.0])]
        # Prior: acceptance rises with confidence, but a draft's argmax is often right even when it is unsure
        # (two models trained on the same data agree on the mode of a flat distribution).
        self.hits = [(1 + c) / 2 * prior_strength for c in centers]  # accepted pseudo-counts per bucket
        self.tries = [prior_strength] * len(centers)
        # Cost model in seconds: draft forward time, and verify time = t0 + slope * gamma (least squares).
        self._draft_t: float | None = None
        self._vstats = [0.0] * 5  # sums of 1, g, g^2, t, g*t (exponentially decayed)
        self._tokens = 0.0  # decayed tokens emitted per row ...
        self._cost = 0.0  # ... and decayed cost (target-forward units) per row, for the running rate
        self._threshold = 0.0
        self._survival: list[float] = []
        self._round_buckets: list[list[int]] = []

    # -- calibration -------------------------------------------------------------------------------------------
    def _bucket(self, confidence: float) -> int:
        return max(bisect.bisect_right(self.EDGES, confidence) - 1, 0)

    def accept_prob(self, confidence: float | torch.Tensor) -> float | list[float]:
        """Calibrated P(target accepts a draft token | the draft's confidence in it); float or ``[B]`` -> list."""
        if isinstance(confidence, torch.Tensor):
            return [self.accept_prob(float(c)) for c in confidence.reshape(-1).tolist()]
        b = self._bucket(confidence)
        return self.hits[b] / self.tries[b]

    # -- costs ----------------------------------------------------------------------------------------------------
    def costs(self) -> tuple[float, float]:
        """(c, b): draft forward and marginal verify cost per draft token, in target-forward units."""
        n, sg, sgg, st, sgt = self._vstats
        if n < 2 or self._draft_t is None:
            return (self.fixed_c if self.fixed_c is not None else 0.15), 0.1
        var = sgg / n - (sg / n) ** 2
        slope = (sgt / n - sg / n * st / n) / var if var > 1e-9 else 0.0
        t0 = max(st / n - slope * sg / n, 1e-9)
        b = min(max(slope / t0, 0.0), 1.0)
        c = self.fixed_c if self.fixed_c is not None else min(max(self._draft_t / t0, 1e-3), 1.0)
        return c, b

    def rate(self) -> float:
        """Running tokens per target-forward unit of cost (per row); 1.0 before any round."""
        return self._tokens / self._cost if self._cost > 0 else 1.0

    # -- the decoder's hooks ---------------------------------------------------------------------------------------
    def start_round(self, batch_size: int) -> None:
        c, b = self.costs()
        self._threshold = self.rate() * (c + b)
        self._survival = [1.0] * batch_size
        self._round_buckets = [[] for _ in range(batch_size)]

    def keep_drafting(self, confidence: torch.Tensor | None) -> bool:
        """Called after each drafted token with the draft's confidence in it, ``[B]``; True = draft another."""
        assert confidence is not None
        gain = 0.0
        for row, conf in enumerate(confidence.tolist()):
            bucket = self._bucket(conf)
            self._round_buckets[row].append(bucket)
            a = self.hits[bucket] / self.tries[bucket]
            self._survival[row] *= a
            # The next token's acceptance is unknown before drafting it; confidence persists, so use this one's.
            gain += self._survival[row] * a
        return gain / len(self._survival) > self._threshold

    def end_round(
        self, gamma: int, accepted: torch.Tensor, draft_time: float | None, verify_time: float | None
    ) -> None:
        """Update calibration and costs. ``accepted``: ``[B]`` accepted draft tokens per row; times in seconds
        (None for a prefill round, whose cost says nothing about per-token costs)."""
        acc = accepted.tolist()
        for buckets, n in zip(self._round_buckets, acc):
            for i, bucket in enumerate(buckets[: n + 1]):  # positions the target judged: accepted ones + 1
                self.hits[bucket] += i < n
                self.tries[bucket] += 1
        decay = 0.98
        if draft_time is not None and gamma > 0:
            per = draft_time / gamma
            self._draft_t = per if self._draft_t is None else 0.9 * self._draft_t + 0.1 * per
        if verify_time is not None:
            g = float(gamma)
            new = (1.0, g, g * g, verify_time, g * verify_time)
            self._vstats = [decay * old + x for old, x in zip(self._vstats, new)]
        c, b = self.costs()
        self._tokens = self._tokens * decay + sum(acc) / max(len(acc), 1) + 1.0
        self._cost = self._cost * decay + 1.0 + gamma * (c + b)
