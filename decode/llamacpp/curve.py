"""The verify-cost curve and the draft length, for ``python -m decode bench --engine llamacpp``: pure functions.

The curve is llama.cpp's own: ``llama-bench -p 1,2,...,17 -n 0 -d DEPTH`` times a (K + 1)-token batch at the
prompts' depth, and v(K + 1) is its median time over the 1-token one's. The draft's cost per round is what a round of
the speculative run took beyond its verify (:data:`DRAFT_COST_HOW`). A draft length K pays when the tokens a round
is expected to give, tau(K) (from the per-position acceptance), outweigh what the round costs in target-only tokens:
tau(K) / (v(K + 1) + draft cost(K)) > 1; ``--num-draft-tokens auto`` takes the K where that bound is highest.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from decode.llamacpp.server import last_lines

MAX_K = 16  # the longest draft the curve and auto consider (decode.metrics.CURVE_MAX)
ROUNDS = "spec_decode_num_drafts_total"  # llama-server's /metrics names, the llamacpp: prefix dropped
COUNTERS = (ROUNDS, "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total")
PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"  # {position="i"}: rounds whose token i was accepted
DRAFT_COST_HOW = (
    "per round of the speculative run: predicted_ms / rounds, less the verify of K + 1 tokens "
    "(v(K + 1) x target-only predicted_ms per token); in target-only tokens. Holds the draft's forwards and "
    "re-feeding the accepted tokens to it, and the round's bookkeeping"
)


def bench_command(
    exe: Path, model: Path, depth: int, threads: int, n_batch: int, max_k: int = MAX_K, repetitions: int = 3
) -> list[str]:
    """llama-bench timing a batch of 1..max_k + 1 tokens at ``depth`` tokens of context, JSON out."""
    sizes = ",".join(str(n) for n in range(1, max_k + 2))
    return [
        str(exe), "-m", str(model), "-p", sizes, "-n", "0", "-d", str(depth), "-r", str(repetitions),
        "-t", str(threads), "-b", str(n_batch), "-ub", str(n_batch), "-o", "json",
    ]  # fmt: skip


def parse_llama_bench(text: str, max_k: int = MAX_K) -> dict[int, float]:
    """llama-bench's JSON (``-n 0``, prompts of 1..max_k + 1 tokens) -> the verify-cost curve {K: v(K + 1)}, v(K + 1)
    = median time of a (K + 1)-token batch / median time of a 1-token batch (medians: a shared machine spikes).

    Raises:
        ValueError: not llama-bench's JSON, or the 1-token test is missing.
    """
    try:
        rows = json.loads(text)
    except ValueError:
        raise ValueError(f"llama-bench did not print JSON: {last_lines(text)}") from None
    if not isinstance(rows, list):
        raise ValueError("llama-bench's JSON is not a list of tests")
    times = {}
    for row in rows:
        if row.get("n_gen", 0) == 0 and row.get("n_prompt", 0) > 0:
            samples = row.get("samples_ns") or [row["avg_ns"]]
            times[int(row["n_prompt"])] = statistics.median(samples)
    if 1 not in times:
        raise ValueError("llama-bench's JSON has no 1-token test (-p 1)")
    return {n - 1: times[n] / times[1] for n in sorted(times) if 2 <= n <= max_k + 1}


def interpolate(curve: dict[int, float], k: float) -> float:
    """v at a mean draft length ``k`` (curve keys are whole K; v(0 + 1) = 1)."""
    points = {0: 1.0, **curve}
    lo = max(x for x in points if x <= k)
    hi = min((x for x in points if x >= k), default=lo)
    if hi == lo:
        return points[lo]
    return points[lo] + (points[hi] - points[lo]) * (k - lo) / (hi - lo)


# ---------------------------------------------------------------------------------------------------------------
# Figures (pure)
# ---------------------------------------------------------------------------------------------------------------
def counter_delta(before: dict, after: dict) -> dict:
    """The speculative counters accumulated between two ``/metrics`` snapshots (``server.parse_metrics`` dicts); a
    counter the server does not export is None (the per-position one is missing from some builds)."""
    out: dict = {name: after[name] - before.get(name, 0.0) if name in after else None for name in COUNTERS}
    if PER_POS in after:
        b, a = before.get(PER_POS, []), after[PER_POS]
        out[PER_POS] = [a[i] - (b[i] if i < len(b) else 0.0) for i in range(len(a))]
    else:
        out[PER_POS] = None
    return out


def per_position(counters: dict) -> list[float] | None:
    """P(accept draft token i | tokens < i accepted) from llama-server's counters: it counts per position i the
    rounds whose token i was accepted, and a token is judged only once all before it were, so the rate is
    accepted_i / accepted_(i-1) (accepted_(-1) = rounds). None when the server reports no per-position counts."""
    rounds, accepted = counters.get(ROUNDS), counters.get(PER_POS)
    if rounds is None or accepted is None:
        return None
    judged = [rounds, *accepted[:-1]]
    return [a / j if j else 0.0 for a, j in zip(accepted, judged)]


def draft_cost_per_round(spec_ms: float, rounds: float | None, drafted: float, target_ms_per_token: float,
                         curve: dict[int, float] | None) -> dict | None:  # fmt: skip
    """The draft's cost per round, from the speculative run (see :data:`DRAFT_COST_HOW`): {"ms", "target_tokens",
    "mean_k", "round_ms", "verify_target_tokens", "how"}; None without rounds or a curve."""
    if not rounds or curve is None or target_ms_per_token <= 0:
        return None
    mean_k = drafted / rounds
    verify = interpolate(curve, mean_k)
    per_round = spec_ms / rounds
    draft_ms = max(per_round - verify * target_ms_per_token, 0.0)
    return {
        "ms": draft_ms,
        "target_tokens": draft_ms / target_ms_per_token,
        "mean_k": mean_k,
        "round_ms": per_round,
        "verify_target_tokens": verify,
        "how": DRAFT_COST_HOW,
    }


def draft_cost_at(k: int, cost: dict, block: bool) -> float:
    """The draft's cost of a round drafting ``k`` tokens, in target-only tokens: a block draft's one forward costs
    the same at any k; a chain's grows with k (its measured cost per drafted token)."""
    if block:
        return cost["target_tokens"]
    return cost["target_tokens"] / max(cost["mean_k"], 1e-9) * k


def choose_k(rates: Sequence[float], curve: dict[int, float], cost: dict, block: bool, max_k: int) -> dict:
    """The draft length with the highest bound tau(K) / (v(K + 1) + draft cost(K)): tau(K), the tokens a round of K
    is expected to give, from the per-position acceptance ``rates`` (``decode.metrics.block_tokens``); v and the
    draft's cost in target-only tokens; K = 1..max_k where the curve has it.

    Returns:
        {"k", "expected_speedup": {K: bound}, "tokens": {K: tau}, "verify": {K: v}, "draft": {K: cost},
        "cost": {K: v + cost}, "pays": the best bound >= 1}.
    """
    from decode.metrics import block_tokens

    ks = [k for k in range(1, max_k + 1) if k in curve]
    if not ks:
        raise ValueError(f"the verify-cost curve has no K in 1..{max_k}")
    tokens = {k: block_tokens(list(rates), k) for k in ks}
    draft = {k: draft_cost_at(k, cost, block) for k in ks}
    costs = {k: curve[k] + draft[k] for k in ks}
    expected = {k: tokens[k] / costs[k] for k in ks}
    best = max(expected, key=expected.get)
    return {
        "k": best, "expected_speedup": expected, "tokens": tokens, "verify": {k: curve[k] for k in ks},
        "draft": draft, "cost": costs, "pays": expected[best] >= 1.0,
    }  # fmt: skip


def cannot_pay(choice: dict) -> str:
    """The plain line printed when no draft length is expected to beat target-only, with its numbers."""
    k, ks = choice["k"], sorted(choice["expected_speedup"])
    return (
        f"no draft length can pay in llama.cpp here: the bound tau / (v(K+1) + draft cost) is below 1 for every K in "
        f"{ks[0]}..{ks[-1]}; the best, K={k}: tau {choice['tokens'][k]:.2f} / (v {choice['verify'][k]:.2f} + draft "
        f"{choice['draft'][k]:.2f}) = {choice['expected_speedup'][k]:.2f} (costs in target-only tokens; measuring "
        f"K={k} anyway)"
    )
