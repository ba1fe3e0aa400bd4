"""Target/draft loading (dtype, bitsandbytes 4/8-bit on CPU, LoRA, QLoRA), errors, vocab check, export."""

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from decode.compat import cpu_has_native_bf16
from distill.config import LoraConfig, ModelConfig, QuantConfig, load_recipe
from distill.models import (
    bnb_config,
    check_compatible,
    context_length,
    export_draft,
    load_draft,
    load_target,
    load_tokenizer,
    resolve_mixed_precision,
    resolve_model_path,
    save_draft,
    slow_bf16_warning,
)
from tests.tiny import SNIPPETS, bpe_tokenizer, swap_ids, tiny_llama


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """300-token BPE of a few snippets; id 0 = <|endoftext|> = eos, no bos and no pad (like the reference pair)."""
    return bpe_tokenizer(300, SNIPPETS, bos_token=None, pad_token=None)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target whose embedding is padded 64 rows past the tokenizer, and a tiny draft; both saved."""
    root = tmp_path_factory.mktemp("pair")
    tok = tiny_tokenizer()
    n = len(tok)
    for name, vocab, seed in (("target", n + 64, 1), ("draft", n, 2)):
        tiny_llama(vocab, seed).save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root


def _ids(n=10, vocab=200):
    return torch.randint(1, vocab, (2, n), generator=torch.Generator().manual_seed(0))


def test_load_target_is_frozen_in_the_cpus_fast_dtype(pair):
    target = load_target(ModelConfig(model=str(pair / "target")), device="cpu")
    assert not target.training
    assert all(not p.requires_grad for p in target.parameters())
    assert target.dtype == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)  # auto on CPU
    fp32 = load_target(ModelConfig(model=str(pair / "target"), dtype="float32"), device="cpu")
    assert fp32.dtype == torch.float32
    bf16 = load_target(ModelConfig(model=str(pair / "target"), dtype="bfloat16"), device="cpu")
    assert bf16.dtype == torch.bfloat16
    assert context_length(target) == 128
    assert context_length(target, tiny_llama(8, max_position_embeddings=64)) == 64


def test_mixed_precision_auto_follows_the_hardware_and_explicit_bf16_on_emulating_cpus_warns():
    native = torch.cuda.is_bf16_supported() if torch.cuda.is_available() else cpu_has_native_bf16()
    assert resolve_mixed_precision("auto") == ("bf16" if native else "no")
    for explicit in ("no", "bf16", "fp16", None):
        assert resolve_mixed_precision(explicit) == explicit
    assert slow_bf16_warning(resolve_mixed_precision("auto")) is None  # auto never picks the slow path
    assert slow_bf16_warning("no") is None
    warning = slow_bf16_warning("bf16")
    if native or torch.cuda.is_available():
        assert warning is None
    else:
        assert "train.mixed_precision=auto" in warning and "\n" not in warning
    # the recipe key takes auto
    assert load_recipe(None, ["train.mixed_precision=auto"]).train.mixed_precision == "auto"


def test_seed_quantization_maps_one_to_one():
    seed = QuantConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype="bfloat16")
    bnb = bnb_config(seed)
    assert bnb.load_in_4bit and not bnb.load_in_8bit
    assert bnb.bnb_4bit_quant_type == "nf4"
    assert bnb.bnb_4bit_compute_dtype == torch.bfloat16
    assert bnb.bnb_4bit_use_double_quant is False
    fp4 = bnb_config(QuantConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True))
    assert fp4.bnb_4bit_quant_type == "fp4" and fp4.bnb_4bit_use_double_quant
    assert bnb_config(QuantConfig(load_in_8bit=True)).load_in_8bit
    assert bnb_config(QuantConfig()) is None


@pytest.mark.parametrize(
    "quant",
    [
        QuantConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype="bfloat16"),  # seed setting
        QuantConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="fp4",
            bnb_4bit_compute_dtype="float32",
            bnb_4bit_use_double_quant=True,
        ),  # fmt: skip
        QuantConfig(load_in_8bit=True),
    ],
    ids=["nf4-bf16", "fp4-double", "int8"],
)
def test_quantized_target_runs_on_cpu(pair, quant):
    import bitsandbytes as bnb

    full = load_target(ModelConfig(model=str(pair / "target")), device="cpu")
    target = load_target(ModelConfig(model=str(pair / "target"), quantization=quant), device="cpu")
    layer_type = bnb.nn.Linear4bit if quant.load_in_4bit else bnb.nn.Linear8bitLt
    assert isinstance(target.model.layers[0].self_attn.q_proj, layer_type)
    assert all(not p.requires_grad for p in target.parameters()) and not target.training
    x = _ids()
    with torch.no_grad():
        want, got = full(x).logits, target(x).logits.float()
    assert torch.isfinite(got).all()
    # quantization noise, not a different model: the logits stay close and mostly agree on the argmax
    assert (got - want).abs().max() < 0.5 * want.abs().max()


def test_full_draft_trains_everything_in_fp32(pair):
    draft = load_draft(ModelConfig(model=str(pair / "draft"), dtype="auto"), device="cpu")
    assert draft.training and draft.dtype == torch.float32
    assert all(p.requires_grad for p in draft.parameters())


def test_lora_draft_trains_adapters_only_and_generates(pair):
    from peft import PeftModel

    cfg = ModelConfig(model=str(pair / "draft"), lora=LoraConfig(enabled=True, r=4, alpha=8))
    draft = load_draft(cfg, device="cpu")
    assert isinstance(draft, PeftModel) and draft.training
    trainable = {n for n, p in draft.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    adapted = {n.split(".")[-4] for n in trainable}  # ...q_proj.lora_A.default.weight
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # all-linear
    only_q = load_draft(
        ModelConfig(model=str(pair / "draft"), lora=LoraConfig(enabled=True, target_modules=["q_proj"])), device="cpu"
    )
    assert {n.split(".")[-4] for n, p in only_q.named_parameters() if p.requires_grad} == {"q_proj"}
    out = draft(_ids(), labels=_ids())
    out.loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in draft.named_parameters() if "lora_B" in n)
    gen = draft.generate(_ids(4), attention_mask=torch.ones(2, 4, dtype=torch.long), max_new_tokens=3, do_sample=False)
    assert gen.shape == (2, 7)


def test_qlora_draft(pair):
    import bitsandbytes as bnb

    quant = QuantConfig(load_in_4bit=True, bnb_4bit_compute_dtype="float32")
    cfg = ModelConfig(model=str(pair / "draft"), quantization=quant, lora=LoraConfig(enabled=True, r=4, alpha=8))
    draft = load_draft(cfg, device="cpu", gradient_checkpointing=True)
    base = draft.get_base_model()
    assert isinstance(base.model.layers[0].mlp.down_proj.base_layer, bnb.nn.Linear4bit)
    assert all("lora_" in n for n, p in draft.named_parameters() if p.requires_grad)
    out = draft(_ids(), labels=_ids(), use_cache=False)
    out.loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in draft.named_parameters() if "lora_B" in n)


def test_qlora_gradients_survive_an_eval_forward(pair):
    """bitsandbytes repacks 4-bit weights at an eval forward on AVX512-BF16 CPUs; the draft must not let it."""
    quant = QuantConfig(load_in_4bit=True, bnb_4bit_compute_dtype="float32")
    cfg = ModelConfig(model=str(pair / "draft"), quantization=quant, lora=LoraConfig(enabled=True, dropout=0.0))
    x = _ids()

    def grads(eval_first: bool) -> dict:
        torch.manual_seed(0)  # peft's lora_A init
        draft = load_draft(cfg, device="cpu")
        _perturb_adapters(draft)
        if eval_first:
            draft.eval()
            with torch.no_grad():
                draft(x)
            draft.train()
        draft(x, labels=x).loss.backward()
        return {n: p.grad for n, p in draft.named_parameters() if p.grad is not None}

    fresh, after_eval = grads(False), grads(True)
    assert fresh.keys() == after_eval.keys()
    for name in fresh:
        torch.testing.assert_close(after_eval[name], fresh[name], msg=name)


def test_dense_weight_of_a_repacked_4bit_layer(pair):
    """The frozen target keeps bitsandbytes' CPU kernel; dequantizing one of its repacked layers still works."""
    from distill.models import _dense_weight

    quant = QuantConfig(load_in_4bit=True, bnb_4bit_compute_dtype="float32")
    target = load_target(ModelConfig(model=str(pair / "target"), quantization=quant), device="cpu")
    layer = target.model.layers[0].mlp.up_proj
    before = _dense_weight(layer)
    with torch.no_grad():
        target(_ids())
    if not getattr(layer.weight.quant_state, "packing_format_for_cpu", False):
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes does not repack")
    after = _dense_weight(layer)
    torch.testing.assert_close(after, before, rtol=1e-2, atol=1e-3)  # absmax is now bf16-rounded, nothing more


def test_quantized_draft_without_lora_is_an_error(pair):
    cfg = ModelConfig(model=str(pair / "draft"), quantization=QuantConfig(load_in_4bit=True))
    with pytest.raises(ValueError, match="lora.enabled=true"):
        load_draft(cfg, device="cpu")
    with pytest.raises(ValueError, match="draft only"):
        load_target(ModelConfig(model=str(pair / "target"), lora=LoraConfig(enabled=True)), device="cpu")


def _perturb_adapters(draft):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in draft.named_parameters():
            if "lora_B" in n:  # B starts at zero: make the adapter do something
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


@pytest.mark.parametrize("quantized", [False, True], ids=["lora", "qlora"])
def test_export_draft_merges_into_a_plain_model(pair, tmp_path, quantized):
    quant = QuantConfig(load_in_4bit=quantized, bnb_4bit_compute_dtype="float32")
    lora = LoraConfig(enabled=True, r=4, alpha=8, dropout=0.0)
    draft = load_draft(ModelConfig(model=str(pair / "draft"), quantization=quant, lora=lora), device="cpu")
    _perturb_adapters(draft)
    x = _ids()
    with torch.no_grad():
        # train mode (no dropout anywhere): the 4-bit layers dequantize and matmul in float32
        want = draft(x).logits.float()
        with draft.disable_adapter():
            without_adapter = draft(x).logits.float()
        draft.eval()
        draft(x)  # an eval forward must not change the 4-bit weights (test_qlora_gradients_survive_eval)
    plain = export_draft(draft)
    assert type(plain).__name__ == "LlamaForCausalLM"
    assert any("lora_A" in n for n, _ in draft.named_parameters())  # the training draft keeps its adapters
    plain.save_pretrained(tmp_path / "export")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    assert getattr(reloaded.config, "quantization_config", None) is None
    assert not any("lora" in n for n, _ in reloaded.named_parameters())
    with torch.no_grad():
        got = reloaded(x).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got - without_adapter).abs().max() > 1e-2  # the adapter is in the export, not rounded away


def test_export_full_draft_is_the_model_itself(pair):
    draft = load_draft(ModelConfig(model=str(pair / "draft")), device="cpu")
    assert export_draft(draft) is draft


def test_save_draft_writes_a_loadable_model_and_the_adapter(pair, tmp_path):
    from peft import PeftModel

    lora = LoraConfig(enabled=True, r=4, alpha=8, dropout=0.0)
    draft = load_draft(ModelConfig(model=str(pair / "draft"), lora=lora), device="cpu")
    _perturb_adapters(draft)
    draft.eval()
    x = _ids()
    with torch.no_grad():
        want = draft(x).logits
    save_draft(draft, tmp_path / "ckpt", load_tokenizer(str(pair / "draft")))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(pair / "draft", dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, tmp_path / "ckpt" / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(adapted(x).logits, want, rtol=1e-5, atol=1e-5)
    assert load_tokenizer(str(tmp_path / "ckpt")).pad_token_id == 0


def test_tokenizer_pad_and_padding_side(pair):
    tok = load_tokenizer(str(pair / "draft"))
    assert tok.pad_token_id == tok.eos_token_id == 0
    assert tok.padding_side == "left"


def test_missing_path_and_offline_hub_id_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"target.model '/nope/model' not found: no such directory") as e:
        load_target(ModelConfig(model="/nope/model"), device="cpu")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"draft.model 'nobody-x/no-such-model' not found.*HF_HUB_OFFLINE=1") as e:
        load_draft(ModelConfig(model="nobody-x/no-such-model"), device="cpu")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="is empty"):
        resolve_model_path("", "target.model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="without config.json"):
        resolve_model_path(str(tmp_path / "empty"), "draft.model")
    (tmp_path / "w.bin").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        resolve_model_path(str(tmp_path / "w.bin"), "draft.model")
    with pytest.raises(ValueError, match="tokenizer './missing' not found"):
        load_tokenizer("./missing")


requires_decode = pytest.mark.skipif(
    importlib.util.find_spec("decode.compat") is None, reason="decode.compat not written yet"
)


@requires_decode
def test_check_compatible_padded_target(pair):
    tok = load_tokenizer(str(pair / "target"))
    target = load_target(ModelConfig(model=str(pair / "target")), device="cpu")
    draft = load_draft(ModelConfig(model=str(pair / "draft")), device="cpu")
    assert target.get_input_embeddings().weight.shape[0] == len(tok) + 64
    assert check_compatible(target, draft, tok, load_tokenizer(str(pair / "draft"))) == len(tok)


@requires_decode
def test_check_compatible_real_mismatch(pair, tmp_path):
    tok = load_tokenizer(str(pair / "target"))
    # same size, two tokens swapped: a different tokenizer that a size check alone would accept
    swapped = swap_ids(tiny_tokenizer(), 100, 101)
    target = load_target(ModelConfig(model=str(pair / "target")), device="cpu")
    draft = load_draft(ModelConfig(model=str(pair / "draft")), device="cpu")
    with pytest.raises(ValueError) as e:
        check_compatible(target, draft, tok, swapped)
    assert "\n" not in str(e.value).strip()
