"""A draft as the GGUF llama.cpp serves: every kind llama.cpp serves is exported by draftsmith, loaded by llama.cpp's
own llama-speculative-simple next to a tiny target, and decodes the target's greedy text token for token with drafts
accepted; a kind llama.cpp does not serve, a GGUF target and a draft of another target are refused in one line,
before anything is written. Skips without llama.cpp (``decode.llamacpp.binaries.find``) or SmolLM2's GGUF."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from decode import kinds
from tests import llamacpp_helpers as h

pytestmark = pytest.mark.slow
llama_cpp, tiny_target, drafts = h.llama_cpp, h.tiny_target, h.drafts  # the session's shared fixtures
SERVED = [name for name in kinds.names() if kinds.traits(name).llamacpp_spec_type]


def test_the_served_kinds_are_those_the_helpers_build():
    assert sorted(SERVED) == sorted(h.SPEC_TYPES)
    assert all(kinds.traits(k).llamacpp_spec_type == h.SPEC_TYPES[k] for k in SERVED)


@pytest.fixture(scope="session")
def target_text(llama_cpp, tiny_target) -> str:
    """llama.cpp's target-only greedy text of the first prompt."""
    return h.run_target(llama_cpp, tiny_target.gguf, h.PROMPTS[0])


@pytest.mark.parametrize("kind", sorted(h.SPEC_TYPES))
def test_an_f32_draft_gguf_decodes_the_targets_text_with_drafts_accepted(
    kind, llama_cpp, tiny_target, drafts, target_text
):
    run = h.run_speculative(
        llama_cpp, tiny_target.gguf, drafts.gguf(kind, "f32"), h.SPEC_TYPES[kind], h.PROMPTS[0], h.BLOCK
    )
    assert run.text, run.log[-2000:]
    assert target_text.startswith(run.text), f"{kind}: {run.text!r} is not the target's {target_text!r}"
    assert run.n_drafted > 0 and run.n_accept > 0, f"{kind}: drafted {run.n_drafted}, accepted {run.n_accept}"


def test_an_f16_draft_gguf_loads_and_decodes_the_targets_text(llama_cpp, tiny_target, drafts, target_text):
    draft = drafts.gguf("standalone", "f16")
    run = h.run_speculative(llama_cpp, tiny_target.gguf, draft, "draft-simple", h.PROMPTS[0], h.BLOCK)
    assert target_text.startswith(run.text) and run.n_accept > 0, (run.text, target_text, run.n_accept)


# ---------------------------------------------------------------------------------------------------------------
# Refused, before anything is written
# ---------------------------------------------------------------------------------------------------------------
def _save_unserved(kind: str, target, out: Path) -> Path:
    """A draft of a kind llama.cpp does not serve, saved by draftsmith's own code for the tiny target."""
    import torch

    torch.manual_seed(0)
    model = target.model()
    if kind == "pard":
        from decode.kinds.pard import decoding as pard

        copy = type(model)(model.config)
        copy.load_state_dict(model.state_dict())
        pard.mark(copy, block_size=h.BLOCK, pard_token=3).save_pretrained(out)
    else:
        from decode.kinds.eagle3 import decoding as eagle3
        from decode.kinds.peagle import decoding as peagle

        head = peagle.with_mask(eagle3.build(model, list(range(0, 512))), block_size=h.BLOCK, mask_token_id=3)
        eagle3.save(head, out, target_name=str(target.hf_dir))
    return out


@pytest.mark.parametrize("kind", [k for k in kinds.names() if not kinds.traits(k).llamacpp_spec_type])
def test_a_kind_llama_cpp_does_not_serve_is_one_line_naming_what_serves_it(kind, tmp_path, llama_cpp, tiny_target):
    from decode.llamacpp.export import export_draft, plan

    t = kinds.traits(kind)
    with pytest.raises(ValueError) as err:
        plan(kind, str(tiny_target.hf_dir), ("f16",))
    message = str(err.value)
    assert "\n" not in message and f"draft.kind={kind}" in message and "cannot be served by llama.cpp" in message
    assert f"vLLM (speculative method {t.vllm_method}" in message
    folder = _save_unserved(kind, tiny_target, tmp_path / kind)
    out = tmp_path / "out" / "draft-f16.gguf"
    with pytest.raises(ValueError, match=rf"draft.kind={kind}\) cannot be served by llama.cpp"):
        export_draft(folder, tiny_target.hf_dir, out, "f16", llama_cpp)
    assert not out.parent.exists()


def test_a_gguf_target_is_refused_in_one_line(tiny_target):
    from decode.llamacpp.export import plan

    with pytest.raises(ValueError, match="is a GGUF file: llama.cpp's converter needs the target's HF folder") as err:
        plan(SERVED[0], str(tiny_target.gguf), ("f16",))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_a_draft_made_for_another_target_is_refused_before_writing(kind, tmp_path, llama_cpp, tiny_target, drafts):
    from decode.llamacpp.export import export_draft

    other = tmp_path / "other-target"
    other.mkdir()
    config = json.loads((tiny_target.hf_dir / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": 96, "num_hidden_layers": 6}))
    out = tmp_path / "out" / "draft-f32.gguf"
    with pytest.raises(ValueError) as err:
        export_draft(drafts.folder(kind), other, out, "f32", llama_cpp)
    assert "\n" not in str(err.value), err.value
    assert not out.parent.exists()


# ---------------------------------------------------------------------------------------------------------------
# A run's export.gguf
# ---------------------------------------------------------------------------------------------------------------
REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("kind", [k for k in kinds.names() if not kinds.traits(k).llamacpp_spec_type])
def test_a_run_refuses_export_gguf_for_a_kind_llama_cpp_does_not_serve_and_writes_nothing(kind, tmp_path):
    out = tmp_path / "run"
    # models that do not exist: were the recipe accepted, the run would stop at them with another error line
    models = [f"target.model={tmp_path / 'no-target'}", f"draft.model={tmp_path / 'no-draft'}", "build_pair=null"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "train" / "distill.py"), f"output_dir={out}", *models, f"draft.kind={kind}",
         "export.gguf=true"],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: export.gguf: "), lines
    assert f"(draft.kind={kind}) cannot be served by llama.cpp" in lines[0] and "serve it with vLLM" in lines[0]
    assert not out.exists()


def test_a_runs_best_is_exported_and_recorded_in_its_report(tmp_path, llama_cpp, tiny_target, drafts):
    """export_run, as train/distill.py calls it when the run ends: best/draft-f16.gguf, and report.json's gguf with
    the files and the llama-server line at the K the run measured best."""
    from distill.config import load_recipe
    from distill.publishing.gguf import export_run, run_plan

    run = tmp_path / "run"
    shutil.copytree(drafts.folder("standalone"), run / "best")
    (run / "report.json").write_text(json.dumps({"best": {"num_draft_tokens": 3}, "best_step": 2}))
    recipe = load_recipe(None, [f"target.model={tiny_target.hf_dir}", "export.gguf=f16", "build_pair=null"])
    paths = export_run(run / "best", recipe, run_plan(recipe))
    assert paths == [run / "best" / "draft-f16.gguf"] and paths[0].stat().st_size > 0
    assert not list((run / "best").glob("*.partial"))
    report = json.loads((run / "report.json").read_text())
    assert report["best_step"] == 2 and report["gguf"]["files"] == [str(paths[0])]
    assert report["gguf"]["launch"] == (
        "llama-server -m TARGET.gguf -md draft-f16.gguf --spec-type draft-simple --spec-draft-n-max 3"
    )


# ---------------------------------------------------------------------------------------------------------------
# train/publish.py --gguf
# ---------------------------------------------------------------------------------------------------------------
BEST = {
    "target": "TARGET", "draft": "best", "n_prompts": 2, "new_tokens": 24, "temperature": 0.0, "batch_size": 1,
    "num_draft_tokens": 3, "acceptance_rate": 0.5, "mean_accepted_length": 2.0, "mean_num_draft_tokens": 3.0,
    "per_position_acceptance": [0.6, 0.5, 0.4], "draft_cost_ratio": 0.1, "verify_cost_ratio": 1.2,
    "leviathan_bound": 1.9,
    "theoretical_speedup": 1.5, "tokens_per_s": {"speculative": 120.0, "target": 80.0, "hf_assisted": None},
    "speedup": {"vs_target": 1.5, "vs_hf_assisted": None}, "outputs_match_target": True,
    "prompts": "dev-prompts.jsonl", "hardware": "Test CPU",
}  # fmt: skip


def _run_dir(root: Path, best: Path, target: Path, kind: str) -> Path:
    """A run directory as train/distill.py leaves it, with ``best`` as its best/ (a draft of ``kind``)."""
    from distill.config import load_recipe, save_recipe

    run = root / "run"
    recipe = load_recipe(None, [f"target.model={target}", f"draft.model={target}", f"draft.kind={kind}"])
    recipe.output_dir = str(run)
    save_recipe(recipe, run)
    shutil.copytree(best, run / "best")
    ev = {**BEST, "draft_kind": kind}
    (run / "best" / "eval.json").write_text(json.dumps(ev))
    (run / "report.json").write_text(json.dumps({"best": ev, "best_step": 4, "checkpoints": []}))
    return run


def _publish(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "train" / "publish.py"), *map(str, args)],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )  # fmt: skip


def test_publish_gguf_writes_a_draft_llama_cpp_serves_and_the_cards_llama_server_line(
    tmp_path, llama_cpp, tiny_target, drafts, target_text
):
    run = _run_dir(tmp_path, drafts.folder("eagle3"), tiny_target.hf_dir, "eagle3")
    out = tmp_path / "published"
    proc = _publish(run, "--repo-id", "someone/tiny-head", "--dry-run", out, "--gguf", "f32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    gguf = out / "draft-f32.gguf"
    assert gguf.is_file() and not list(out.glob("*.partial"))
    card = (out / "README.md").read_text()
    assert "## llama.cpp" in card and "hf download someone/tiny-head draft-f32.gguf" in card
    assert "llama-server -m TARGET.gguf -md draft-f32.gguf --spec-type draft-eagle3 --spec-draft-n-max 3" in card
    assert json.loads((out / "draftsmith_eval.json").read_text())["llamacpp"]["spec_type"] == "draft-eagle3"
    served = h.run_speculative(llama_cpp, tiny_target.gguf, gguf, "draft-eagle3", h.PROMPTS[0], h.BLOCK)
    assert target_text.startswith(served.text) and served.n_accept > 0


def test_publish_gguf_refuses_a_kind_llama_cpp_does_not_serve_before_writing(tmp_path, tiny_target):
    kind = next(
        k for k in kinds.names() if not kinds.traits(k).llamacpp_spec_type and kinds.traits(k).loads_draft_model
    )
    run = _run_dir(tmp_path, _save_unserved(kind, tiny_target, tmp_path / kind), tiny_target.hf_dir, kind)
    out = tmp_path / "published"
    proc = _publish(run, "--repo-id", "someone/tiny-draft", "--dry-run", out, "--gguf")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --gguf: ") and "cannot be served by llama.cpp" in lines[0]
    assert not out.exists()
    proc = _publish(run, "--repo-id", "someone/tiny-draft", "--dry-run", out, "--gguf", "q4_k")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: --gguf: GGUF type q4_k: choose among f32, f16, bf16, q8_0"
    ), proc.stderr
    assert not out.exists()
