"""How many tokens the draft proposes per round: fixed gamma, or ``auto``.

``auto`` decides after every draft token whether to draft more, by expected tokens per second:

* gain: the chance that the draft so far survives verification (the product of calibrated acceptance
  probabilities of its tokens: the draft's confidence in each, mapped through an online calibration against
  what the target actually accepted), times the mean acceptance for each further token (acceptance of a
  token barely depends on its predecessor's, so the running mean is the honest forecast);
* cost: the further draft forwards plus the growth of the verify pass, from a table of the loop's own
  measured verify times per draft length (medians). The table, not a line: on CPUs, matmul speed depends on
  the row count (with MKL a 4-token target forward is cheaper than a 3-token one), so "one more token"
  can cost less than nothing.

Rate maximisation (a renewal-reward argument) says: draft on iff some longer draft has expected extra tokens
> current tokens-per-second x its extra seconds. The decoder stays lossless whatever this decides.

A block draft (``block=True``: P-EAGLE, PARD) has drafted its whole block in one forward before the first token is
judged, so a longer draft costs no draft time, only the growth of the verify pass: the block is cut where the
measured verify-time table says a further token costs more than its expected gain.
"""

from __future__ import annotations

import bisect
import collections
import re
import statistics
from dataclasses import dataclass

import torch


class FixedDraftLength:
    """Always propose ``gamma`` tokens (fewer only where the token budget is nearly spent)."""

    needs_confidence = False

    def __init__(self, gamma: int):
        if gamma < 1:
            raise ValueError(f"num_draft_tokens must be >= 1 or 'auto', got {gamma}")
        self.max_gamma = gamma

    def start_round(self, batch_size: int, gamma_cap: int) -> None:
        pass

    def keep_drafting(self, confidence: torch.Tensor | None) -> bool:
        return True

    def end_round(
        self, gamma: int, accepted: torch.Tensor, draft_time: float | None, verify_time: float | None
    ) -> None:
        pass


class AutoDraftLength:
    """Adaptive draft length; see the module docstring.

    One instance may be reused across calls (e.g. over a bench's prompts) so calibration and timings carry over.

    Args:
        max_gamma: hard cap on tokens per draft.
        draft_cost_ratio: c, draft forward / target forward, used until the loop has timed its own forwards.
        prior_strength: pseudo-counts per confidence bucket of the calibration prior.
        block: the draft proposes its whole block in one forward (speculative_generate sets it from the draft's
            kind): a further token then costs only its share of the verify pass.
    """

    needs_confidence = True

    # Confidence buckets, finer at low confidence, where most draft tokens of a weak draft fall.
    EDGES = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8)
    # Before any timing, costs in units of one target forward: a verify of g drafts costs 1 + 0.1 g.
    PRIOR_VERIFY_SLOPE = 0.1
    PRIOR_RATE = 1.3  # tokens per unit

    def __init__(
        self,
        max_gamma: int = 12,
        draft_cost_ratio: float | None = None,
        prior_strength: float = 3.0,
        block: bool = False,
    ):
        if max_gamma < 1:
            raise ValueError(f"max_gamma must be >= 1, got {max_gamma}")
        self.max_gamma = max_gamma
        self.block = block
        self.c = draft_cost_ratio if draft_cost_ratio is not None else 0.15
        # Plain Python floats: this runs once per draft token, and a handful of rows is faster without tensors.
        centers = [(lo + hi) / 2 for lo, hi in zip(self.EDGES, [*self.EDGES[1:], 1.0])]
        # Prior: acceptance rises with confidence, but a draft's argmax is often right even when it is unsure
        # (two models trained on the same data agree on the mode of a flat distribution).
        self.hits = [(1 + c) / 2 * prior_strength for c in centers]  # accepted pseudo-counts per bucket
        self.tries = [prior_strength] * len(centers)
        # The loop's own timings (seconds); medians, because a shared machine has spikes.
        self._draft_times: collections.deque[float] = collections.deque(maxlen=256)  # per draft forward
        self._verify_times: dict[int, collections.deque[float]] = {}  # per draft length
        self._rounds_log: collections.deque[tuple[float, float]] = collections.deque(maxlen=64)  # (tokens, s)
        self._rounds = 0
        self._verify, self._draft, self._rate = self._prior_costs()
        self._mean_accept = 0.5
        self._survival: list[float] = []
        self._round_buckets: list[list[int]] = []
        self._cap = max_gamma

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
    def _prior_costs(self) -> tuple[list[float], float, float]:
        verify = [1.0 + self.PRIOR_VERIFY_SLOPE * g for g in range(self.max_gamma + 1)]
        return verify, self.c, self.PRIOR_RATE

    def _update_costs(self) -> None:
        known = {g: statistics.median(ts) for g, ts in self._verify_times.items() if len(ts) >= 3}
        if not known or not self._draft_times or len(self._rounds_log) < 4:
            return
        gs = sorted(known)
        verify = []
        for g in range(self.max_gamma + 1):
            if g in known:
                verify.append(known[g])
                continue
            lo = max((k for k in gs if k < g), default=None)
            hi = min((k for k in gs if k > g), default=None)
            if lo is not None and hi is not None:  # interpolate between measured lengths
                verify.append(known[lo] + (known[hi] - known[lo]) * (g - lo) / (hi - lo))
            else:  # extrapolate with the prior's relative slope from the nearest measured length
                ref = lo if lo is not None else hi
                verify.append(known[ref] * (1 + self.PRIOR_VERIFY_SLOPE * g) / (1 + self.PRIOR_VERIFY_SLOPE * ref))
        tokens = sum(t for t, _ in self._rounds_log)
        seconds = sum(s for _, s in self._rounds_log)
        self._verify, self._draft, self._rate = verify, statistics.median(self._draft_times), tokens / seconds

    # -- the decoder's hooks ---------------------------------------------------------------------------------------
    def start_round(self, batch_size: int, gamma_cap: int) -> None:
        if self._rounds % 8 == 0:  # medians are cheap, but not free at every round
            self._update_costs()
        self._rounds += 1
        self._survival = [1.0] * batch_size
        self._round_buckets = [[] for _ in range(batch_size)]
        self._cap = min(gamma_cap, self.max_gamma)

    def keep_drafting(self, confidence: torch.Tensor | None) -> bool:
        """Called after each drafted token with the draft's confidence in it, ``[B]``; True = draft another."""
        assert confidence is not None
        for row, conf in enumerate(confidence.tolist()):
            bucket = self._bucket(conf)
            self._round_buckets[row].append(bucket)
            self._survival[row] *= self.hits[bucket] / self.tries[bucket]
        k = len(self._round_buckets[0])
        survival = sum(self._survival) / len(self._survival)
        gain = 0.0
        per_token = 0.0 if self.block else self._draft  # a block's further tokens are drafted already
        for longer in range(k + 1, self._cap + 1):
            gain += survival * self._mean_accept ** (longer - k)
            cost = (longer - k) * per_token + self._verify[longer] - self._verify[k]
            if gain > self._rate * cost:
                return True
        return False

    def end_round(
        self, gamma: int, accepted: torch.Tensor, draft_time: float | None, verify_time: float | None
    ) -> None:
        """Update calibration and timings. ``accepted``: ``[B]`` accepted draft tokens per row; times in seconds
        (None for a prefill round, whose cost says nothing about per-token costs)."""
        acc = accepted.tolist()
        for buckets, n in zip(self._round_buckets, acc):
            for i, bucket in enumerate(buckets[: n + 1]):  # positions the target judged: accepted ones + 1
                self.hits[bucket] += i < n
                self.tries[bucket] += 1
        self._mean_accept = sum(self.hits) / sum(self.tries)
        if draft_time is not None and verify_time is not None:
            if gamma > 0:
                self._draft_times.append(draft_time / gamma)
            self._verify_times.setdefault(gamma, collections.deque(maxlen=64)).append(verify_time)
            self._rounds_log.append((sum(acc) / max(len(acc), 1) + 1.0, draft_time + verify_time))


# A draft tree instead of a chain (decode.tree): its shape takes the place of gamma.
TREE_SPEC = re.compile(r"tree:(\d+),(\d+),(\d+)")
EXAMPLE = "tree:4,5,16"


@dataclass(frozen=True)
class TreeShape:
    """TOPK children per expanded node and nodes expanded per depth, DEPTH head forwards per round, and the
    NODES draft tokens the target verifies per round (SGLang: --speculative-eagle-topk, --speculative-num-steps,
    --speculative-num-draft-tokens, the last counting the root)."""

    topk: int
    depth: int
    nodes: int

    @property
    def max_gamma(self) -> int:
        """The most draft tokens one round can accept: the tree's depth."""
        return self.depth

    def __str__(self) -> str:
        return f"tree:{self.topk},{self.depth},{self.nodes}"


def is_tree_spec(spec: object) -> bool:
    return isinstance(spec, TreeShape) or (isinstance(spec, str) and spec.startswith("tree"))


def parse_tree(spec: str | TreeShape) -> TreeShape:
    """``"tree:TOPK,DEPTH,NODES"`` -> TreeShape; one ValueError naming the fix for anything else."""
    if isinstance(spec, TreeShape):
        shape = spec
    else:
        match = TREE_SPEC.fullmatch(spec.replace(" ", ""))
        if match is None:
            raise ValueError(f"num_draft_tokens {spec!r}: a draft tree is tree:TOPK,DEPTH,NODES, e.g. {EXAMPLE}")
        shape = TreeShape(*(int(g) for g in match.groups()))
    most = shape.topk + (shape.depth - 1) * shape.topk * shape.topk  # every node the head proposes
    if min(shape.topk, shape.depth, shape.nodes) < 1 or shape.nodes > most:
        raise ValueError(
            f"num_draft_tokens {shape}: TOPK, DEPTH and NODES must be >= 1 and NODES at most TOPK + (DEPTH - 1) * "
            f"TOPK^2 = {most} (what the head proposes), e.g. {EXAMPLE}"
        )
    return shape
