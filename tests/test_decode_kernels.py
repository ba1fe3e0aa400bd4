"""decode.kernels.CpuLinears: same outputs as nn.Linear, originals restored, copies follow weight updates."""

from __future__ import annotations

import pytest
import torch
from decode_helpers import VOCAB, tiny_pair

from decode import kernels
from decode.kernels import CpuLinears


def _logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids).logits


def _linears(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "gemma2"])
def test_same_logits_one_and_many_rows_and_restored(arch, dtype):
    _, model = tiny_pair(arch)
    model = model.to(dtype)
    before = _linears(model)
    gen = torch.Generator().manual_seed(0)
    for shape in [(1, 1), (2, 7)]:  # one row (float32: the transposed copy) and many (oneDNN)
        ids = torch.randint(1, VOCAB, shape, generator=gen)
        plain = _logits(model, ids)
        with CpuLinears(model):
            assert not _linears(model)  # every plain linear was swapped for the call
            fast = _logits(model, ids)
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # rounding order only (gemma2 soft-caps the logits)
        torch.testing.assert_close(fast, plain, rtol=tol, atol=tol)
    assert _linears(model) == before


def test_copies_follow_weight_updates_and_originals_restored_on_error():
    _, model = tiny_pair("llama")
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
    with CpuLinears(model):
        _logits(model, ids)  # builds the copies
    with torch.no_grad():
        for linear in _linears(model):
            linear.weight.mul_(-1.0)  # what an optimizer step does: an in-place update of the same tensor
    plain = _logits(model, ids)
    with pytest.raises(ValueError, match="boom"):
        with CpuLinears(model):
            fast = _logits(model, ids)
            raise ValueError("boom")
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
    assert len(_linears(model)) > 0 and not any(isinstance(m, kernels._CpuLinear) for m in model.modules())


def test_lora_adapters_same_logits():
    from peft import LoraConfig, get_peft_model

    _, model = tiny_pair("llama")
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)  # B starts at zero: make the adapters change the logits
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    plain = _logits(model, ids)
    with CpuLinears(model):
        fast = _logits(model, ids)
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)


def test_switched_off_by_environment(monkeypatch):
    _, model = tiny_pair("llama")
    before = _linears(model)
    monkeypatch.setenv("DRAFTSMITH_CPU_KERNELS", "0")
    with CpuLinears(model):
        assert _linears(model) == before


def test_hooked_layers_are_left_alone():
    _, model = tiny_pair("llama")
    hooked = model.get_output_embeddings()
    calls = []
    hooked.register_forward_hook(lambda *args: calls.append(1))
    with CpuLinears(model):
        assert model.get_output_embeddings() is hooked  # swapping it would bypass the hook
        _logits(model, torch.tensor([[1, 2, 3]]))
    assert calls == [1]
