"""`data.engine: vllm` without vLLM (distill/data/vllm_rollouts.py): the recipe key, the preflight refusal, the
helpers, and the check that captured hidden states reproduce the target's logits. vLLM itself: tests/test_vllm.py."""

from __future__ import annotations

import functools
import importlib.util
import json
import os

import pytest
import torch

from decode.kinds.eagle3.train_step import target_forward
from decode.vllm_engine import INSTALL
from distill.config import RecipeError, load_recipe
from distill.data import vllm_rollouts
from distill.data.prompts import collate_training
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
    from decode.kinds.eagle3.train_step import GenerationRecorder, TargetCache
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


# ---------------------------------------------------------------- the arguments a run hands vLLM's LLM(...)

# A stand-in for vLLM's package, seen by the worker process only: its LLM(...) writes the keyword arguments it is
# given to $RECORD_ENV and refuses to load, so the arguments that reach vLLM through the real path (the run's or the
# bench's call, the worker process, its LLM(...) call) are read without vLLM installed.
RECORD_ENV = "DRAFTSMITH_TEST_LLM_ARGS"
STAND_IN = {
    "__init__.py": f"""
import json, os

__version__ = "0-stand-in"


class LLM:
    def __init__(self, **kwargs):
        with open(os.environ["{RECORD_ENV}"], "w") as f:
            json.dump(kwargs, f)
        raise RuntimeError("stand-in vLLM: arguments recorded")


class SamplingParams:
    pass
""",
    "inputs.py": "class TokensPrompt(dict):\n    pass\n",
}


def _llm_arguments(tmp_path, monkeypatch, call) -> dict:
    """The keyword arguments `call()` makes the vLLM worker pass to LLM(...), with the stand-in package as vLLM."""
    package = tmp_path / "stand-in" / "vllm"
    package.mkdir(parents=True)
    for name, text in STAND_IN.items():
        (package / name).write_text(text)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(package.parent), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv(RECORD_ENV, str(tmp_path / "llm-args.json"))
    monkeypatch.delenv(vllm_rollouts.ENGINE_ARGS_ENV, raising=False)
    with pytest.raises(ValueError, match="stand-in vLLM: arguments recorded"):
        call()
    return json.loads((tmp_path / "llm-args.json").read_text())


@pytest.mark.parametrize("caller", ["run", "bench-generation-only"])
def test_sampled_prompts_reach_vllm_prefilled_whole(tmp_path, monkeypatch, caller):
    """At T > 0 the LLM(...) a run's continuations (pregenerate_with_vllm) and the bench's generation-only pass
    start has chunked prefill off and a step budget that holds the longest sequence whole: vLLM on CPU stops when it
    rewinds the seeded generator of a prompt whose prefill it split (vllm_rollouts.scheduling_args). Prompts past
    vLLM's default budget of 4096 tokens, so a fixed budget would split them."""
    from distill.data.prompts import Example
    from distill.data.rollouts import RolloutSource
    from tests.procs import load_script
    from tests.tiny import char_tokenizer

    new_tokens, longest = 64, 6000
    recipe = load_recipe(
        None, [f"target.model={tmp_path}", "distill.source=target", "distill.gen_temperature=0.8",
               f"distill.max_new_tokens={new_tokens}", "data.engine=vllm"],
    )  # fmt: skip
    model = tiny_llama(96, seed=0, max_position_embeddings=8192)
    source = RolloutSource(recipe.distill, model, char_tokenizer(), cache_dir=tmp_path / "cache", vocab=96)
    examples = [Example(i, [5 + i] * n) for i, n in enumerate((30, longest, 900))]
    if caller == "run":
        call = functools.partial(vllm_rollouts.pregenerate_with_vllm, recipe, source, examples, progress=False)
    else:
        bench = load_script("bench/rollout_engines.py")
        call = functools.partial(bench.vllm_generation_only, recipe, source, examples, repeats=1)
    args = _llm_arguments(tmp_path, monkeypatch, call)
    assert args["max_model_len"] >= longest + new_tokens, args
    assert args.get("enable_chunked_prefill") is False, args
    assert args.get("max_num_batched_tokens", 0) >= args["max_model_len"], args
