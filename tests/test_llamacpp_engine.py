"""llama.cpp as a run's further engine (``eval.extra_engines: [llamacpp]``): best/ measured in llama-server at the
end, its served per-position acceptance compared with draftsmith's on the same prompts and settings.

Needs llama.cpp's binaries and converter (skipped without them: tests/llamacpp_helpers.py says where it looked).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from distill.config import RecipeError, load_recipe
from tests import llamacpp_helpers as h
from tests.llamacpp_helpers import PROMPTS

llama_cpp, tiny_target, drafts = h.llama_cpp, h.tiny_target, h.drafts  # the session's shared fixtures
REPO = Path(__file__).resolve().parent.parent


def test_a_kind_llama_cpp_does_not_serve_is_refused_as_a_further_engine():
    with pytest.raises(RecipeError, match=r"eval.extra_engines: .*cannot be served by llama.cpp.*drop llamacpp"):
        load_recipe(None, ["draft.kind=pard", "eval.extra_engines=[llamacpp]"])
    assert load_recipe(None, ["eval.extra_engines=[llamacpp]"]).eval.extra_engines == ["llamacpp"]


def test_llama_cpp_measures_best_and_its_acceptance_is_compared_with_draftsmiths(tmp_path, tiny_target, drafts):
    """A fitted head as best/: draftsmith's bench writes eval.json, llama.cpp's eval_llamacpp.json; both on the same
    prompts, greedy, float32: llama.cpp's output equals its target-only and the acceptance agrees."""
    from distill.training.engines import _bench_draftsmith, measure_extra_engines

    run = tmp_path / "run"
    best = run / "best"
    shutil.copytree(drafts.folder("eagle3"), best)
    overrides = [f"target.model={tiny_target.hf_dir}", "draft.kind=eagle3", "eval.extra_engines=[llamacpp]",
                 "eval.repeats=1", "eval.max_new_tokens=24", "eval.num_draft_tokens=3", "eval.hf_assisted=false",
                 "target.dtype=float32"]  # fmt: skip
    recipe = load_recipe(None, overrides)
    prompts = [{"prompt": p} for p in PROMPTS]
    ours = _bench_draftsmith(best, recipe, prompts, "float32")
    (best / "eval.json").write_text(json.dumps(ours))
    (run / "report.json").write_text(json.dumps({"best": "best"}))

    assert measure_extra_engines(best, recipe, prompts) == [best / "eval_llamacpp.json"]
    served = json.loads((best / "eval_llamacpp.json").read_text())
    assert served["engine"] == "llamacpp" and served["outputs_match_target"] is True
    assert served["draft"] == str(best) and served["n_prompts"] == len(PROMPTS)
    assert served["acceptance"]["accepted"] > 0 and len(served["per_position_acceptance"]) == 3
    report = json.loads((run / "report.json").read_text())
    assert report["served_acceptance"]["llamacpp"]["measured_by"] == "draftsmith"
    assert report["served_acceptance"]["llamacpp"]["differs"] is False, report["served_acceptance"]


def _prompt_file(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


@pytest.mark.slow
def test_a_run_with_llama_cpp_as_further_engine_measures_and_exports_best(tmp_path, tiny_target):
    """train/distill.py end to end, as a user runs it: a head trained two steps on the tiny target, evaluated once
    at the end, best/ measured in llama-server (eval_llamacpp.json, report.json's served_acceptance) and exported
    to best/draft-f32.gguf (report.json's gguf), the export said last."""
    run = tmp_path / "run"
    train = _prompt_file(tmp_path / "train.jsonl", ["def add(a, b):", "The sky is", "import os\n", "Once upon a"])
    evals = _prompt_file(tmp_path / "eval.jsonl", PROMPTS)
    overrides = [
        f"target.model={tiny_target.hf_dir}", "target.dtype=float32", "draft.kind=eagle3",
        f"data.train_prompts={train}", f"data.eval_prompts={evals}", "data.max_prompt_tokens=16",
        "distill.source=target", "distill.max_new_tokens=16",
        "train.max_steps=2", "train.batch_size=2", "train.warmup_steps=1",
        "eval.at_start=false", "eval.every=1000", f"eval.num_prompts={len(PROMPTS)}", "eval.max_new_tokens=16",
        "eval.num_draft_tokens=3", "eval.repeats=1", "eval.hf_assisted=false", "eval.extra_engines=[llamacpp]",
        "export.gguf=f32", "log.report_to=none", f"output_dir={run}",
    ]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(REPO / "train" / "distill.py"), *overrides],
        capture_output=True, text=True, env=env, timeout=1100, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]

    best = run / "best"
    served = json.loads((best / "eval_llamacpp.json").read_text())
    assert served["engine"] == "llamacpp" and served["outputs_match_target"] is True, served
    report = json.loads((run / "report.json").read_text())
    assert report["served_acceptance"]["llamacpp"]["measured_by"] == "draftsmith"
    gguf = best / "draft-f32.gguf"
    assert report["gguf"]["files"] == [str(gguf)] and gguf.is_file()
    assert proc.stdout.rstrip().splitlines()[-1] == f"llama.cpp: wrote {gguf}", proc.stdout[-2000:]


def test_a_cached_build_made_for_another_cpu_is_passed_over_with_the_fix(tmp_path, monkeypatch):
    """A native build records the instruction set it was made for; on a CPU with another one draftsmith does not
    run it (it could die on an instruction this CPU lacks) and says to rebuild."""
    from decode.llamacpp import binaries

    bin_dir = binaries.cache_dir().relative_to(binaries.cache_dir().parents[1])
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    monkeypatch.delenv(binaries.ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    build = tmp_path / bin_dir / "build"
    (build / "bin").mkdir(parents=True)
    server = build / "bin" / "llama-server"
    server.write_text("#!/bin/sh\n")
    server.chmod(0o755)
    (build / binaries.CPU_MARK).write_text(binaries.cpu_isa() + "\n")
    assert binaries.find(need="llama-server").bin_dir == build / "bin"
    (build / binaries.CPU_MARK).write_text(f"{binaries.cpu_isa()} amx_tile_of_another_cpu\n")
    with pytest.raises(binaries.LlamaCppMissing, match="amx_tile_of_another_cpu.*rerun bash bench/build_llama_cpp.sh"):
        binaries.find(need="llama-server")


def test_a_run_measuring_in_llama_cpp_without_llama_cpp_is_refused_before_it_writes(tmp_path):
    """The run's preflight looks for llama.cpp (and its --spec-type) when eval.extra_engines names it: a folder
    without it is one line saying where it looked and how to get it, and nothing is written."""
    from decode.llamacpp.binaries import LlamaCppMissing
    from distill.training.preflight import check_llamacpp

    empty = tmp_path / "no-llama-cpp"
    empty.mkdir()
    recipe = load_recipe(None, ["eval.extra_engines=[llamacpp]", f"export.llama_cpp={empty}"])
    with pytest.raises(
        LlamaCppMissing, match=r"llama-server was not found \(looked in: .*no-llama-cpp.*bench/build_llama_cpp"
    ):
        check_llamacpp(recipe, None)
    assert list(tmp_path.iterdir()) == [empty] and not list(empty.iterdir())
    check_llamacpp(load_recipe(None, [f"export.llama_cpp={empty}"]), None)  # not asked for: not looked for
