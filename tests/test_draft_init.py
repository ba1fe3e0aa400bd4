"""draft.init=truncate: the target's embeddings, first k layers, final norm and head as an ordinary checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from distill.config import DraftConfig, ModelConfig, Recipe, RecipeError, load_recipe
from distill.draft_init import MARKER, ensure_truncated_draft, resolve_draft_init, truncate
from tests.tiny import make_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))


def test_truncated_draft_is_the_targets_first_layers(pair):
    target = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32).eval()
    draft = truncate(target, 2)
    assert draft.config.num_hidden_layers == 2 and draft.config.vocab_size == target.config.vocab_size
    ids = torch.tensor([[5, 17, 42, 99, 3, 250]])
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states[2]  # after layer 1, before the final norm
        expected = target.lm_head(target.model.norm(hidden))
        assert torch.allclose(draft(ids).logits, expected, atol=1e-5)
        assert not torch.allclose(draft(ids).logits, target(ids).logits, atol=1e-3)  # it is not the target


@pytest.mark.parametrize("layers", [0, 4])
def test_truncate_layer_count_out_of_range(pair, layers):
    target = AutoModelForCausalLM.from_pretrained(pair[0])
    with pytest.raises(ValueError, match=r"draft.init_layers: .* must be in \[1, 3\]"):
        truncate(target, layers)


def test_saved_once_loadable_and_reused(pair, tmp_path):
    cfg = ModelConfig(model=str(pair[0]))
    out = ensure_truncated_draft(cfg, 1, tmp_path / "draft_init")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.config.num_hidden_layers == 1 and (out / "model.safetensors").is_file()
    assert AutoTokenizer.from_pretrained(out).get_vocab() == AutoTokenizer.from_pretrained(pair[0]).get_vocab()
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert ensure_truncated_draft(cfg, 1, out) == out and (out / "model.safetensors").stat().st_mtime_ns == stamp
    ensure_truncated_draft(cfg, 2, out)  # other settings: rebuilt in place
    assert json.loads((out / MARKER).read_text())["layers"] == 2
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 2


def test_bad_layer_count_leaves_nothing_behind(pair, tmp_path):
    with pytest.raises(ValueError, match="draft.init_layers"):
        ensure_truncated_draft(ModelConfig(model=str(pair[0])), 9, tmp_path / "draft_init")
    assert list(tmp_path.iterdir()) == []


def test_truncate_a_gguf_target(tmp_path):
    pytest.importorskip("gguf")
    from tests.test_gguf import write_tiny_gguf

    path, original, _ = write_tiny_gguf(tmp_path / "src")
    out = ensure_truncated_draft(ModelConfig(model=str(path)), 2, tmp_path / "draft_init")
    draft = AutoModelForCausalLM.from_pretrained(out)
    assert draft.config.vocab_size == original.config.vocab_size and draft.config.num_hidden_layers == 2
    assert torch.equal(draft.model.embed_tokens.weight, original.model.embed_tokens.weight)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_recipe_keys(pair, tmp_path):
    recipe = load_recipe(None, [f"target.model={pair[0]}", "draft.init=truncate", "draft.init_layers=1"])
    assert isinstance(recipe.draft, DraftConfig) and recipe.draft.init == "truncate"
    resolve_draft_init(recipe, tmp_path)
    assert recipe.draft.model == str(tmp_path / "draft_init")
    with pytest.raises(RecipeError, match="draft.init: 'trunc' is not one of"):
        load_recipe(None, ["draft.init=trunc"])
    with pytest.raises(RecipeError, match="draft.init_layers: must be > 0"):
        load_recipe(None, ["draft.init_layers=0"])
    both = Recipe()
    both.target.model, both.draft.model, both.draft.init = str(pair[0]), str(pair[1]), "truncate"
    with pytest.raises(ValueError, match="leave draft.model empty"):
        resolve_draft_init(both, tmp_path / "other")
    assert not (tmp_path / "other").exists()


@pytest.mark.slow
def test_distill_run_from_a_gguf_target_with_generated_prompts(tmp_path):
    """train/distill.py end to end: GGUF target, truncated draft, generate:magpie+stdlib prompts, 2 steps."""
    pytest.importorskip("gguf")
    import os
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from tests.test_gguf import write_tiny_gguf

    path, _, _ = write_tiny_gguf(tmp_path / "src", layers=3)
    repo = Path(__file__).resolve().parent.parent
    recipe = {
        "target": {"model": str(path), "dtype": "float32"},
        "draft": {"init": "truncate", "init_layers": 1, "dtype": "float32"},
        "data": {"train_prompts": "generate:magpie+stdlib", "generate_num_prompts": 6, "generate_max_tokens": 12,
                 "eval_split": 0.2, "max_prompt_tokens": 48},
        "distill": {"loss": "fkl", "source": "target", "max_new_tokens": 8},
        "train": {"lr": 1e-3, "max_steps": 2, "batch_size": 2, "warmup_steps": 1},
        "eval": {"every": 2, "num_prompts": 2, "max_new_tokens": 8, "num_draft_tokens": 2, "hf_assisted": False},
        "log": {"report_to": "none"},
        "output_dir": str(tmp_path / "run"),
    }  # fmt: skip
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", PYTHONPATH=str(repo))
    cmd = [sys.executable, str(repo / "train" / "distill.py"), "--recipe", str(tmp_path / "r.yaml")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = tmp_path / "run"
    best = AutoModelForCausalLM.from_pretrained(run / "best")
    assert best.config.num_hidden_layers == 1 and (run / "draft_init" / MARKER).is_file()
    (cache,) = [p for p in (run / "rollout_cache").glob("prompts-*.jsonl") if not p.name.endswith(".eval.jsonl")]
    assert cache.with_suffix(".eval.jsonl").is_file()  # the held-out rows, as a prompt file for the bench
    sources = {json.loads(line)["source"] for line in cache.read_text().splitlines()}
    assert sources == {"magpie", "stdlib"}
