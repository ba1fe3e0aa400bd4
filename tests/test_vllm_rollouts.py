"""`data.engine: vllm` without vLLM (distill/data/vllm_rollouts.py): the recipe key, the preflight refusal, the
helpers, and the check that captured hidden states reproduce the target's logits. vLLM itself: tests/test_vllm.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from decode.vllm_engine import INSTALL
from distill.config import RecipeError, load_recipe
from distill.data import vllm_rollouts
from distill.data.prompts import collate_training
from distill.training.eagle3_train import target_forward
from tests.procs import run_distill, tiny_recipe, tiny_run_paths
from tests.tiny import tiny_llama

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_data_engine_key_is_validated():
    assert load_recipe(None).data.engine == "hf"
    assert load_recipe(None, ["data.engine=vllm"]).data.engine == "vllm"
    with pytest.raises(RecipeError, match="data.engine: must be hf or vllm, got 'vlm'"):
        load_recipe(None, ["data.engine=vlm"])
    with pytest.raises(RecipeError, match="data.engine: vllm generates .* needs distill.source target or mix"):
        load_recipe(None, ["data.engine=vllm", "distill.source=draft"])
    with pytest.raises(RecipeError, match="cache_rollouts=False"):
        load_recipe(None, ["data.engine=vllm", "distill.cache_rollouts=false"])


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here: the refusal is for environments without it")
def test_data_engine_vllm_without_vllm_is_one_error_line_and_writes_nothing(tmp_path):
    paths = tiny_run_paths(tmp_path)
    out = tmp_path / "run"
    recipe = tiny_recipe(paths, out, {"source": "target"}, {"max_steps": 1}, data={"engine": "vllm"})
    proc = run_distill(recipe, tmp_path, OMP_NUM_THREADS="1")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"error: data.engine=vllm needs vLLM, which is not installed: {INSTALL}"]
    assert 'pip install "draftsmith[vllm]"' in lines[0]
    assert not out.exists()


def test_helpers():
    assert vllm_rollouts.cut_after_eos([5, 6, 0, 7, 0], [0, 2]) == [5, 6, 0]
    assert vllm_rollouts.cut_after_eos([5, 6], [0]) == [5, 6]
    assert vllm_rollouts.model_len([[1] * 10, [1] * 300], 64, None) == 512
    assert vllm_rollouts.model_len([[1] * 10], 16, 128) == 128
    seeds = {vllm_rollouts.prompt_seed(0, i) for i in range(1000)}
    assert len(seeds) == 1000 and vllm_rollouts.prompt_seed(1, 5) != vllm_rollouts.prompt_seed(0, 5)
    # vLLM gets at least MIN_CALL_PROMPTS prompts a call (its own batch stays full); a larger HF batch is kept
    assert vllm_rollouts.call_size(64) == vllm_rollouts.MIN_CALL_PROMPTS > 64
    assert vllm_rollouts.call_size(4096) == 4096
    assert vllm_rollouts.engine_args({}) == {}
    assert vllm_rollouts.engine_args({"DRAFTSMITH_VLLM_ENGINE_ARGS": '{"tensor_parallel_size": 2}'}) == {
        "tensor_parallel_size": 2
    }
    with pytest.raises(ValueError, match="must be a JSON object"):
        vllm_rollouts.engine_args({"DRAFTSMITH_VLLM_ENGINE_ARGS": "[2]"})
    cpu = torch.device("cpu")
    assert vllm_rollouts.worker_env(cpu, 2, {}) == {}
    assert vllm_rollouts.worker_env(torch.device("cuda", 1), 2, {}) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert vllm_rollouts.worker_env(torch.device("cuda", 1), 2, {"tensor_parallel_size": 2}) == {}


@pytest.fixture(scope="module")
def target():
    """A 3-layer tiny Llama whose final norm is not the identity (a fresh RMSNorm's weight is all ones, which would
    let a post-norm state pass for a pre-norm one)."""
    model = tiny_llama(96, seed=3, layers=3)
    with torch.no_grad():
        model.model.norm.weight.copy_(
            torch.rand(model.model.norm.weight.shape, generator=torch.Generator().manual_seed(1)) + 0.5
        )
    return model


def _batch():
    pairs = [([5, 9, 11, 4], [7, 8, 0]), ([3, 4], [12, 13, 14, 15, 16]), ([20], [21])]
    return pairs, collate_training(pairs, pad_token_id=0)


def test_captured_features_reproduce_the_logits_and_a_wrong_layer_is_caught(target):
    _, batch = _batch()
    assert vllm_rollouts.check_captured_features(target, batch) < 1e-4

    def one_layer_early(model, b, layers):  # the off-by-one a misread layer id gives
        return vllm_rollouts.capture_states(model, b, [j - 1 for j in layers])

    with pytest.raises(ValueError, match="do not reproduce the target's logits through its final norm and head"):
        vllm_rollouts.check_captured_features(target, batch, capture=one_layer_early)


def test_prefilled_states_are_the_training_steps_own(target):
    """What the prefill keeps for a sequence is what a training step's own target forward computes for it."""
    from distill.training.eagle3_train import GenerationRecorder, TargetCache
    from distill.training.teacher_cache import sequence_key

    pairs, batch = _batch()
    cache = TargetCache(target, temperature=1.0, max_gb=1.0)
    recorder = GenerationRecorder(cache, [0, 1, 2])
    vllm_rollouts.prefill_recorder(target, recorder, pairs, pad_token_id=0)
    assert len(cache) == 3 and cache.usable
    features, _, last = target_forward(target, batch, [0, 1, 2])
    for b, (prompt, completion) in enumerate(pairs):
        n = len(prompt) + len(completion)
        kept = cache._entries[sequence_key(prompt, completion)]
        torch.testing.assert_close(kept[0], features[b, :n])
        torch.testing.assert_close(kept[1], last[b, :n])
