"""decode.kernels.CpuLinears: same outputs as nn.Linear, originals restored, copies follow weight updates and are
freed; autocast, autograd, nesting, threads and a failed swap leave results and models as nn.Linear would."""

from __future__ import annotations

import pytest
import torch

from decode import kernels
from decode.kernels import CpuLinears
from tests.decode_helpers import VOCAB
from tests.tiny import tiny_pair


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


@pytest.mark.parametrize("then", ["merge_adapter", "unmerge_adapter", "merge_and_unload"])
def test_copies_follow_a_peft_merge(then):
    """PEFT merges through ``weight.data``, which leaves the weight's version counter as it was."""
    from peft import LoraConfig, get_peft_model

    _, model = tiny_pair("llama")
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)  # B starts at zero, and merging zero changes nothing
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    with CpuLinears(model):
        _logits(model, ids)  # copies of the unmerged base layers
    model.merge_adapter()
    if then == "unmerge_adapter":
        with CpuLinears(model):
            _logits(model, ids)  # copies of the merged ones
        model.unmerge_adapter()
    if then == "merge_and_unload":
        model = model.merge_and_unload()  # the same base layers, merged, now without their wrapper
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


def test_cpu_autocast_bf16_runs_as_nn_linear():
    # accelerate turns CPU autocast on for mixed_precision bf16: float32 weights meet bf16 activations.
    _, model = tiny_pair("llama")
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = _logits(model, ids)
        with CpuLinears(model):
            fast = _logits(model, ids)
    assert fast.dtype == plain.dtype == torch.bfloat16
    torch.testing.assert_close(fast, plain, rtol=0, atol=0)


def test_decoder_runs_under_cpu_autocast():
    # What a training run's evaluation meets with train.mixed_precision bf16 (accelerate's autocast on forward).
    from decode.speculative import speculative_generate

    target, draft = tiny_pair("llama")
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = speculative_generate(target, draft, ids, max_new_tokens=8, num_draft_tokens=3)
    assert len(out.new_tokens[0]) == 8


def test_gradients_reach_the_weights_of_swapped_layers():
    _, model = tiny_pair("llama")
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    model(input_ids=ids).logits.logsumexp(-1).sum().backward()
    plain = [m.weight.grad.clone() for m in _linears(model)]
    model.zero_grad(set_to_none=True)
    with CpuLinears(model):
        model(input_ids=ids).logits.logsumexp(-1).sum().backward()
    for grad, linear in zip(plain, _linears(model)):
        assert linear.weight.grad is not None
        torch.testing.assert_close(linear.weight.grad, grad)


def test_error_while_swapping_leaves_the_model_as_it_was(monkeypatch):
    _, model = tiny_pair("llama")
    before = [(name, m) for name, m in model.named_modules()]
    built = []

    class Failing(kernels._CpuLinear):
        def __init__(self, linear, owner):
            if len(built) == 3:
                raise MemoryError("no room for the copies")
            built.append(linear)
            super().__init__(linear, owner)

    monkeypatch.setattr(kernels, "_CpuLinear", Failing)
    with pytest.raises(MemoryError):
        with CpuLinears(model):
            pass
    assert len(built) == 3 and [(name, m) for name, m in model.named_modules()] == before


def test_overlapping_contexts_keep_the_swap_until_the_last_exits():
    _, model = tiny_pair("llama")
    before = _linears(model)
    outer, inner = CpuLinears(model), CpuLinears(model)
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)  # not nested: the first one out is not the last
    assert not _linears(model), "a context still holds the swap"
    inner.__exit__(None, None, None)
    assert _linears(model) == before
    with CpuLinears(model, model):  # the same model twice
        assert not _linears(model)
    assert _linears(model) == before


def test_concurrent_contexts_on_one_model():
    import threading

    _, model = tiny_pair("llama")
    before = _linears(model)
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(5))
    plain = _logits(model, ids)
    start, errors = threading.Barrier(4), []

    def work():
        start.wait()
        try:
            for _ in range(20):
                with CpuLinears(model):
                    torch.testing.assert_close(_logits(model, ids), plain, rtol=1e-5, atol=1e-5)
        except BaseException as e:  # reported below: an assert in a thread would not fail the test
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert _linears(model) == before


def test_release_frees_the_copies():
    _, model = tiny_pair("llama")
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(6))
    plain = _logits(model, ids)
    with CpuLinears(model):
        _logits(model, ids)
    assert all("packed" in kernels._COPIES[m] for m in _linears(model))
    kernels.release(model)
    assert not any(m in kernels._COPIES for m in _linears(model))
    with CpuLinears(model):
        _logits(model, ids)
        kernels.release(model)  # also while in use: the next forward rebuilds them
        torch.testing.assert_close(_logits(model, ids), plain, rtol=1e-5, atol=1e-5)
    kernels.release(model)
    assert not any(m in kernels._COPIES for m in _linears(model))


def test_release_racing_forwards_never_fails():
    """A release() from another thread may land between any check of a layer's copies and its use."""
    import threading

    _, model = tiny_pair("llama")
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(6))
    plain = _logits(model, ids)

    class ReleasedAfterAHit(dict):
        """A layer's copies that another thread's release() empties right after a check that found one."""

        def __init__(self, layer, copies):
            super().__init__(copies)
            self.layer, self.raced = layer, False

        def _race(self):
            self.raced = True
            kernels._COPIES[self.layer] = self  # registered, so that release() empties it
            other = threading.Thread(target=kernels.release, args=(model,))
            other.start()
            other.join(timeout=0.1)  # runs now, or as soon as a lock it waits for is let go

        def __contains__(self, name):
            found = super().__contains__(name)
            if found and not self.raced:
                self._race()
            return found

        def get(self, name, default=None):
            value = super().get(name, default)
            if name in self.keys() and not self.raced:
                self._race()
            return value

    with CpuLinears(model):
        for stand_in in [m for m in model.modules() if isinstance(m, kernels._CpuLinear)]:
            stand_in.copies = ReleasedAfterAHit(stand_in.original, stand_in.copies)
        for _ in range(2):  # the first builds every copy, the second reads them back
            torch.testing.assert_close(_logits(model, ids), plain, rtol=1e-5, atol=1e-5)


def test_copies_go_with_the_model():
    import gc

    _, model = tiny_pair("llama")
    with CpuLinears(model):
        _logits(model, torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(7)))
    layers = len(_linears(model))
    before = len(kernels._COPIES)
    del model
    gc.collect()
    assert len(kernels._COPIES) == before - layers
