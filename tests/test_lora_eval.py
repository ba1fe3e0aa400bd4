"""Evaluating a LoRA draft measures the merged draft and never touches the frozen base it trains against."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from decode import kernels
from distill.config import LoraConfig, ModelConfig, Recipe
from distill.models import load_draft, load_target, load_tokenizer
from distill.training.helpers import _served_draft, evaluate
from tests.tiny import make_pair, make_prompts


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pair")
    target, draft = make_pair(root)
    rows = [json.loads(line) for line in make_prompts(root / "eval.jsonl", 2).read_text().splitlines()]
    return {"target": target, "draft": draft, "prompts": rows}


def lora_draft(pair: dict, dtype: str) -> torch.nn.Module:
    lora = LoraConfig(enabled=True, r=4, alpha=8, dropout=0.0)
    draft = load_draft(ModelConfig(model=str(pair["draft"]), dtype=dtype, lora=lora), device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "lora_B" in name:  # B starts at zero, and merging zero changes nothing: make the adapter count
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return draft


def recipe(pair: dict) -> Recipe:
    r = Recipe()
    r.target.model, r.draft.model = str(pair["target"]), str(pair["draft"])
    r.eval.max_new_tokens, r.eval.num_draft_tokens, r.eval.repeats, r.eval.hf_assisted = 8, 3, 1, False
    return r


def test_bf16_evaluations_leave_the_base_bitwise_unchanged(pair):
    target = load_target(ModelConfig(model=str(pair["target"]), dtype="bfloat16"), device="cpu")
    tokenizer = load_tokenizer(str(pair["target"]))
    draft = lora_draft(pair, "bfloat16")
    draft.train()
    before = {n: p.detach().clone() for n, p in draft.named_parameters()}
    assert any(p.dtype == torch.bfloat16 for n, p in before.items() if "lora_" not in n)
    for _ in range(5):
        result = evaluate(target, draft, tokenizer, pair["prompts"], recipe(pair))
    assert 0.0 <= result["acceptance_rate"] <= 1.0
    changed = [n for n, p in draft.named_parameters() if not torch.equal(p, before[n])]
    assert changed == []
    assert draft.training  # the training draft gets its mode back
    assert any("lora_A" in n for n, _ in draft.named_parameters())  # and keeps its adapters


def test_an_evaluation_frees_the_targets_kernel_copies(pair):
    """The target stays loaded for the whole run: its packed weight copies must not stay with it."""
    target = load_target(ModelConfig(model=str(pair["target"])), device="cpu")
    evaluate(target, lora_draft(pair, "float32"), load_tokenizer(str(pair["target"])), pair["prompts"], recipe(pair))
    linears = [m for m in target.modules() if type(m) is torch.nn.Linear]
    assert linears and not any(m in kernels._COPIES for m in linears)


def test_evaluated_draft_is_the_merged_draft(pair):
    target = load_target(ModelConfig(model=str(pair["target"]), dtype="bfloat16"), device="cpu")
    draft = lora_draft(pair, "bfloat16")
    x = torch.tensor([[0, 5, 17, 42, 99, 3, 250, 7]])
    served = _served_draft(draft, target)
    assert not hasattr(served, "peft_config") and type(served).__name__ == "LlamaForCausalLM"
    merged = copy.deepcopy(draft).merge_and_unload().eval()
    with torch.no_grad():
        got, want = served(x).logits, merged(x).logits
        unmerged = draft.eval()(x).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # bf16 rounds merged and unmerged weights differently (an element can move by ~0.15 on an AVX2 CPU); without
    # the adapters the same logits differ by ~1.4 on average and ~9 at most
    diff = (got.float() - unmerged.float()).abs()
    assert diff.mean() < 0.05 and diff.max() < 0.5, (diff.mean(), diff.max())


def test_float32_lora_draft_is_served_merged_in_the_targets_dtype(pair):
    target = load_target(ModelConfig(model=str(pair["target"]), dtype="bfloat16"), device="cpu")
    draft = lora_draft(pair, "float32")
    x = torch.tensor([[0, 5, 17, 42, 99, 3, 250, 7]])
    served = _served_draft(draft, target)
    assert next(served.parameters()).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in draft.parameters())  # the training draft is not cast
    # merged in float32, then cast: the adapters' small delta is not rounded into bf16 weights before it is added
    reference = copy.deepcopy(draft).merge_and_unload().to(torch.bfloat16).eval()
    with torch.no_grad():
        got = served(x).logits
        want = reference(x).logits
        with draft.disable_adapter():
            without_adapters = draft.eval()(x).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (got.float() - without_adapters).abs().max() > 0.1  # the adapters are in the measured draft


def test_a_mixed_precision_draft_is_measured_without_its_training_autocast(pair):
    """accelerate's bf16 mixed precision wraps the draft's forward in autocast; evaluations measure the draft as
    it is served (no autocast, draftsmith's CPU kernels), and training forwards keep the wrapper."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    target = load_target(ModelConfig(model=str(pair["target"]), dtype="bfloat16"), device="cpu")
    tokenizer = load_tokenizer(str(pair["target"]))
    draft = load_draft(ModelConfig(model=str(pair["draft"]), dtype="float32"), device="cpu")
    # a run earlier in this process (train/distill.py's main, called in-process) leaves its accelerate state
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        accelerator = Accelerator(cpu=True, mixed_precision="bf16")
        inner = accelerator.unwrap_model(accelerator.prepare(draft))
        assert "_original_forward" in inner.__dict__  # the wrapper is there to be taken away
        autocast_seen: list[bool] = []
        inner.model.register_forward_pre_hook(lambda m, a: autocast_seen.append(torch.is_autocast_enabled("cpu")))
        result = evaluate(target, inner, tokenizer, pair["prompts"], recipe(pair))
        assert result["acceptance_rate"] >= 0.0 and autocast_seen and not any(autocast_seen)
        autocast_seen.clear()
        inner(input_ids=torch.tensor([[1, 2, 3]]))
        assert autocast_seen == [True]  # the training forward is wrapped again
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
