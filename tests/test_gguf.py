"""GGUF files as model sources: a tiny Llama written to GGUF with the `gguf` package loads back to the same logits,
with its tokenizer and chat template; missing package and unsupported architecture are one clear line each."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.tiny import make_tokenizer

gguf = pytest.importorskip("gguf", reason="the gguf package is needed to write test GGUF files (pip install gguf)")

# A minimal ChatML template, as SmolLM2-Instruct's: a system turn, then user/assistant turns.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_llama(vocab_size: int, layers: int = 3, seed: int = 0):
    """A tiny Llama with GQA (4 heads, 2 KV heads) so the q/k permutation of GGUF is exercised."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True,
        initializer_range=0.2,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k row order (the inverse of what transformers undoes on load)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer_fields(tok) -> tuple[list[str], list[int], list[str]]:
    data = json.loads(tok.backend_tokenizer.to_str())
    vocab = {**data["model"]["vocab"], **{t["content"]: t["id"] for t in data["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [3 if t in SPECIALS else 1 for t in tokens]  # 3 = control token
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, types, merges


def write_tiny_gguf(directory: Path, *, layers: int = 3, chat_template: str | None = CHAT_TEMPLATE, arch="llama"):
    """Write `directory/tiny.gguf` (float32 tensors, gpt2-style BPE tokenizer) and return (path, model, tokenizer)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(directory / "tok", vocab_size=320)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    tokens, types, merges = _tokenizer_fields(tok)
    model = tiny_llama(len(tokens), layers)
    cfg = model.config
    path = directory / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tok.convert_tokens_to_ids("<|im_start|>"))
    writer.add_eos_token_id(tok.convert_tokens_to_ids("<|im_end|>"))
    if chat_template:
        writer.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to token_embd
        base, suffix = name.rsplit(".", 1)
        w = tensor.float()
        if base.endswith("q_proj"):
            w = _permute(w, cfg.num_attention_heads)
        elif base.endswith("k_proj"):
            w = _permute(w, cfg.num_key_value_heads)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", w.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, model, tok


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf"))


def test_gguf_loads_to_the_same_model_and_tokenizer(tiny_gguf, tmp_path):
    from decode import sources

    path, original, tok = tiny_gguf
    model = sources.load_model(str(path), dtype=torch.float32)
    loaded_tok = sources.load_tokenizer(str(path))
    text = "def f(x):\n    return x + 1"
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert loaded_tok(text, add_special_tokens=False)["input_ids"] == ids[0].tolist()
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, original(ids).logits, atol=1e-4)
    assert "<|im_start|>" in loaded_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    # Dequantized, it is a plain model: save_pretrained writes safetensors that load without the gguf file.
    model.save_pretrained(tmp_path / "plain")
    assert (tmp_path / "plain" / "model.safetensors").is_file()
    assert "quantization_config" not in json.loads((tmp_path / "plain" / "config.json").read_text())


def test_recipe_loaders_take_a_gguf_target(tiny_gguf):
    from distill.config import ModelConfig
    from distill.models import load_target, load_tokenizer

    path, original, _ = tiny_gguf
    target = load_target(ModelConfig(model=str(path), dtype="float32"), device="cpu")
    tok = load_tokenizer(str(path), key="target.model")
    assert target.config.num_hidden_layers == original.config.num_hidden_layers
    assert not any(p.requires_grad for p in target.parameters()) and tok.padding_side == "left"


def test_bench_cli_takes_gguf_target(tiny_gguf, tmp_path, capsys):
    from decode.__main__ import main

    path, original, tok = tiny_gguf
    draft_dir = tmp_path / "draft"
    original.save_pretrained(draft_dir)
    tok.save_pretrained(draft_dir)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):", "import os\n"]) + "\n")
    out = tmp_path / "r.json"
    argv = ["bench", "--target", str(path), "--draft", str(draft_dir), "--prompts", str(prompts), "--dtype",
            "float32", "--max-new-tokens", "6", "--repeats", "1", "--baselines", "target", "--json", str(out),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    # The draft is the target itself: every drafted token is accepted, and the output is the target's.
    assert result["outputs_match_target"] is True and result["acceptance_rate"] == pytest.approx(1.0)


def test_unsupported_gguf_architecture_is_one_line(tmp_path):
    from decode import sources

    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "rwkv6")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"^target.model .*odd.gguf.*architecture 'rwkv6' cannot be loaded") as e:
        sources.load_model(str(path), key="target.model")
    assert "\n" not in str(e.value)


def test_missing_gguf_package_names_the_install(tiny_gguf, monkeypatch):
    from decode import sources

    monkeypatch.setitem(sys.modules, "gguf", None)  # what `import gguf` sees where the package is absent
    with pytest.raises(ValueError, match=r"needs the gguf package: pip install gguf$"):
        sources.load_tokenizer(str(tiny_gguf[0]), key="draft.model")


def test_missing_and_not_gguf_files(tmp_path):
    from decode import sources

    with pytest.raises(ValueError, match="no such GGUF file"):
        sources.load_model(str(tmp_path / "nope.gguf"), key="--target")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        sources.load_model(str(bad), key="--target")


def test_pretrain_tokenizer_from_a_gguf_keeps_the_full_vocabulary(tiny_gguf):
    from distill.config import ArchConfig, TokenizerConfig
    from distill.data.corpus import Corpus
    from distill.training.pretraining import build_tokenizer, resolve_vocab_size

    path, original, tok = tiny_gguf
    loaded = build_tokenizer(TokenizerConfig(path=str(path)), Corpus(source="none", kind="folder"))
    assert len(loaded) == original.config.vocab_size and loaded.get_vocab() == tok.get_vocab()
    assert loaded.pad_token_id is not None
    fixed = ArchConfig(extra={"vocab_size": original.config.vocab_size})
    assert resolve_vocab_size(fixed, loaded) == original.config.vocab_size


def test_extra_engine_bench_takes_a_gguf_target_and_the_draft_vocabulary(tiny_gguf, tmp_path):
    """best/eval_draftsmith.json loads the target as training does (a .gguf file here) and drafts from the
    draft vocabulary saved in best/."""
    from decode.draft_vocab import save_ids
    from distill.config import load_recipe
    from distill.training.engines import measure_extra_engines

    path, original, tok = tiny_gguf
    best = tmp_path / "best"
    original.save_pretrained(best)
    tok.save_pretrained(best)
    ids = list(range(200))
    save_ids(best, ids, vocab=original.config.vocab_size, source="test")
    (best / "eval.json").write_text(json.dumps({"engine": "vllm", "dtype": "float32"}))
    overrides = [f"target.model={path}", "eval.engine=vllm", "eval.extra_engines=[draftsmith]", "eval.repeats=1",
                 "eval.max_new_tokens=6", "eval.num_draft_tokens=2", "eval.hf_assisted=false"]  # fmt: skip
    prompts = [{"prompt": p} for p in ["def f(x):", "import os\n"]]
    assert measure_extra_engines(best, load_recipe(None, overrides), prompts) == [best / "eval_draftsmith.json"]
    result = json.loads((best / "eval_draftsmith.json").read_text())
    assert result["outputs_match_target"] is True and result["draft_vocab_size"] == len(ids)
