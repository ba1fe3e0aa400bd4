"""llama.cpp as a run's further engine (``eval.extra_engines: [llamacpp]``): best/ measured in llama-server at the
end, its served per-position acceptance compared with draftsmith's on the same prompts and settings.

Needs llama.cpp's binaries and converter (skipped without them: tests/llamacpp_helpers.py says where it looked).
"""

from __future__ import annotations

import json
import shutil

import pytest

from distill.config import RecipeError, load_recipe
from tests import llamacpp_helpers as h
from tests.llamacpp_helpers import PROMPTS

llama_cpp, tiny_target, drafts = h.llama_cpp, h.tiny_target, h.drafts  # the session's shared fixtures


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
