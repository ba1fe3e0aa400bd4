"""bench/plot_curves.py: acceptance and speedup against training minutes from report.json files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.procs import load_script

REPO = Path(__file__).resolve().parent.parent


def _report(run: Path, rows: list[dict]) -> Path:
    run.mkdir(parents=True)
    (run / "report.json").write_text(json.dumps({"checkpoints": rows}))
    return run


def test_curves_are_read_in_step_order_and_plotted(tmp_path):
    pc = load_script("bench/plot_curves.py")
    rows = [
        {"step": 200, "train_minutes": 9.5, "acceptance_rate": 0.5, "speedup": 1.3},
        {"step": 0, "train_minutes": 0.0, "acceptance_rate": 0.36, "speedup": 1.1},
    ]
    run = _report(tmp_path / "greedy", rows)
    assert pc.read_curve(run) == [
        {"minutes": 0.0, "acceptance": 0.36, "speedup": 1.1},
        {"minutes": 9.5, "acceptance": 0.5, "speedup": 1.3},
    ]
    assert pc.parse_run(f"new={run}") == ("new", run)
    assert pc.parse_run(f"T=0.8={run}") == ("T=0.8", run)
    assert pc.parse_run(str(run)) == ("greedy", run)
    out = tmp_path / "curves.png"
    pc.main([str(run), f"other={run}", "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_without_minutes_or_report_is_one_error_line(tmp_path):
    pc = load_script("bench/plot_curves.py")
    old = _report(tmp_path / "old", [{"step": 0, "acceptance_rate": 0.3, "speedup": 1.0}])
    with pytest.raises(SystemExit, match=r"checkpoints \[0\] have no train_minutes"):
        pc.read_curve(old)
    with pytest.raises(SystemExit, match="report.json not found"):
        pc.read_curve(tmp_path / "missing")
