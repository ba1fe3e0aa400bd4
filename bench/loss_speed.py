"""Forward-KL loss + backward time: draftsmith's fused, chunked loss against the plain log-softmax formula.

    OMP_NUM_THREADS=1 python bench/loss_speed.py --tokens 3200 --vocab 49152 [--dtype bfloat16] [--repeats 5]

Random student and teacher logits of [tokens, vocab] (the student's in --dtype, as bf16 autocast gives them;
the teacher's bf16), the loss and its backward timed for each method, interleaved repeat by repeat; the median
counts. Both compute the same value (printed) and the same gradient.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from distill.training import losses  # noqa: E402


def unfused(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The textbook path: both log-softmaxes over the full vocabulary, then sum p_T (log p_T - log p_S)."""
    log_ps, log_pt = losses.log_probs(student, teacher, mask)
    return losses.forward_kl_per_token(log_ps, log_pt).mean()


def time_once(fn, student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    leaf = student.detach().clone().requires_grad_(True)
    t0 = time.perf_counter()
    value = fn(leaf, teacher, mask)
    value.backward()
    return time.perf_counter() - t0, float(value.detach())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=3200, help="positions in the loss (batch x sequence)")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="student logits dtype")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    shape = (1, args.tokens, args.vocab)
    student = (torch.randn(shape, generator=g) * 3).to(getattr(torch, args.dtype))
    teacher = (torch.randn(shape, generator=g) * 3).to(torch.bfloat16)
    mask = torch.ones(shape[:2])
    methods = {"fused": losses.fused_forward_kl, "unfused": unfused}
    times: dict[str, list[float]] = {name: [] for name in methods}
    values = {}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, fn in methods.items():
            seconds, values[name] = time_once(fn, student, teacher, mask)
            times[name].append(seconds)
    med = {name: statistics.median(ts[1:]) for name, ts in times.items()}
    print(f"{args.tokens} tokens x {args.vocab} vocabulary, student {args.dtype}, {torch.get_num_threads()} thread(s)")
    for name in methods:
        print(f"  {name:8s} loss + backward {med[name]:.3f} s (median of {args.repeats}), value {values[name]:.6f}")
    print(f"  fused is {med['unfused'] / med['fused']:.2f}x faster")


if __name__ == "__main__":
    main()
