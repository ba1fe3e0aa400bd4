"""Measured acceptance and speedup against training minutes, one line per run (one PNG).

Reads each run directory's report.json (`checkpoints`: every evaluated checkpoint, with `train_minutes`, the
train.max_minutes clock at that step) and plots acceptance rate and speedup vs target-only against it. The label
of a run is its directory name, or NAME=DIR.

    python bench/plot_curves.py runs/stdlib-greedy baseline=runs/ablation/old --out curves.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_curve(run_dir: Path) -> list[dict]:
    """(minutes, acceptance, speedup) rows of one run, in step order; one clear error when they cannot be read."""
    report = run_dir / "report.json"
    if not report.is_file():
        raise SystemExit(f"error: {report} not found: give run directories of finished train/distill.py runs")
    rows = json.loads(report.read_text())["checkpoints"]
    missing = [r["step"] for r in rows if r.get("train_minutes") is None]
    if missing:
        raise SystemExit(f"error: {report}: checkpoints {missing[:5]} have no train_minutes: rerun it to record them")
    return [
        {"minutes": r["train_minutes"], "acceptance": r["acceptance_rate"], "speedup": r["speedup"]}
        for r in sorted(rows, key=lambda r: r["step"])
    ]


def parse_run(arg: str) -> tuple[str, Path]:
    name, sep, path = arg.rpartition("=")  # the last "=": labels such as "T=0.8" may hold one
    return (name, Path(path)) if sep else (Path(arg).name, Path(arg))


def plot(curves: dict[str, list[dict]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, spd) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, rows in curves.items():
        xs = [r["minutes"] for r in rows]
        acc.plot(xs, [r["acceptance"] for r in rows], marker="o", label=name)
        spd.plot(xs, [r["speedup"] for r in rows], marker="o", label=name)
    acc.set_ylabel("acceptance rate")
    spd.set_ylabel("speedup vs target-only")
    for ax in (acc, spd):
        ax.set_xlabel("training minutes")
        ax.grid(alpha=0.3)
    acc.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run directories, or NAME=DIR to label one")
    p.add_argument("--out", default="curves.png", help="PNG to write (default: curves.png)")
    args = p.parse_args(argv)
    curves = {name: read_curve(path) for name, path in map(parse_run, args.runs)}
    print(plot(curves, Path(args.out)))


if __name__ == "__main__":
    sys.exit(main())
