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
