"""Helpers for the decode tests: hand-built fixed-logit models and tiny random HF models of each architecture.

Nothing is downloaded; every model is built from a config in memory.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import nn
from transformers import PretrainedConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 97


# ---------------------------------------------------------------------------------------------------------------
# Hand-built models whose logits are a fixed function of (token, position)
# ---------------------------------------------------------------------------------------------------------------
class FixedLogitLM(nn.Module):
    """A causal LM whose next-token logits are ``fn(ids, positions)``; it keeps a dummy KV cache.

    It writes one dummy key per input into the HF cache, so cropping and cache lengths behave as for a real
    model, and records every call so tests can check what the decoder fed it.
    """

    def __init__(self, vocab: int, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], context: int = 512):
        super().__init__()
        self.config = PretrainedConfig(vocab_size=vocab, max_position_embeddings=context)
        self.fn = fn
        self.dummy = nn.Parameter(torch.zeros(1))  # gives the module a device
        self.calls: list[dict] = []

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True, logits_to_keep=0):
        batch, q = input_ids.shape
        before = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(before, before + q).expand(batch, q)
        self.calls.append({"q": q, "cache_len": before, "positions": position_ids.clone(), "ids": input_ids.clone()})
        if cache is not None:
            kv = torch.zeros(batch, 1, q, 1)
            cache.update(kv, kv, 0)
        logits = self.fn(input_ids, position_ids)  # [B, q, V]
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return SimpleNamespace(logits=logits)


def one_hot_logits(tokens: torch.Tensor, vocab: int, scale: float = 20.0) -> torch.Tensor:
    """``[...]`` ids -> ``[..., vocab]`` logits peaked on those ids."""
    return torch.nn.functional.one_hot(tokens % vocab, vocab).float() * scale


def counter_lm(vocab: int = VOCAB, step: int = 1) -> FixedLogitLM:
    """Deterministic: the next token is (token + step) mod vocab."""
    return FixedLogitLM(vocab, lambda ids, pos: one_hot_logits(ids + step, vocab))


def accept_k_draft(k: int, prompt_len: int, vocab: int = VOCAB) -> FixedLogitLM:
    """Agrees with ``counter_lm()`` except at every (k+1)-th new position, where it proposes token + 2.

    Drafting right after a correction, it is right k times and wrong once: every round accepts exactly k.
    """

    def fn(ids, pos):
        new_index = pos + 1 - prompt_len  # index among new tokens of the token being predicted
        wrong = (new_index % (k + 1)) == k
        return one_hot_logits(ids + 1 + wrong.long(), vocab)

    return FixedLogitLM(vocab, fn)


def bigram_lm(table: torch.Tensor) -> FixedLogitLM:
    """Next-token logits depend only on the current token: ``table`` is ``[V, V]`` logits."""
    return FixedLogitLM(table.shape[0], lambda ids, pos: table[ids])


def bigram_sequence_probs(table: torch.Tensor, first: int, n: int, process) -> torch.Tensor:
    """Exact probability of every length-n continuation of ``first`` under a bigram LM.

    Returns ``[V] * n`` probabilities (flattened index = sequence in base V), using ``process(logits) -> probs``.
    """
    vocab = table.shape[0]
    trans = process(table)  # [V, V]: row = current token
    probs = trans[first]  # [V]: prefixes of length 1
    for _ in range(n - 1):
        last = torch.arange(probs.shape[0]) % vocab  # last token of each prefix
        probs = (probs[:, None] * trans[last]).reshape(-1)  # prefix * V + next
    return probs


# ---------------------------------------------------------------------------------------------------------------
# Tiny random HF models of every seed-pair architecture
# ---------------------------------------------------------------------------------------------------------------
def _common(vocab: int) -> dict:
    return dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,  # tied random embeddings make tiny models echo their input token
    )


def arch_config(arch: str, vocab: int = VOCAB) -> PretrainedConfig:
    """A 2-layer, 64-dim config of ``arch`` (sliding windows small enough that tests cross them)."""
    import transformers as tf

    c = _common(vocab)
    if arch == "llama":
        return tf.LlamaConfig(**c, num_key_value_heads=2)
    if arch == "gemma":
        return tf.GemmaConfig(**c, num_key_value_heads=1, head_dim=16)
    if arch == "gemma2":
        # Sliding window + attention and final-logit soft-capping; alternating sliding / full layers.
        return tf.Gemma2Config(
            **c,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        )
    if arch == "gpt_neox":
        c.pop("pad_token_id")
        return tf.GPTNeoXConfig(**c, rotary_pct=0.25)
    if arch == "mistral":
        return tf.MistralConfig(**c, num_key_value_heads=2, sliding_window=8)
    if arch == "mixtral":
        return tf.MixtralConfig(**c, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen2":
        return tf.Qwen2Config(**c, num_key_value_heads=2)
    raise ValueError(arch)


ARCHS = ["llama", "gemma", "gemma2", "gpt_neox", "mistral", "mixtral", "qwen2"]


def tiny_pair(arch: str, seed: int = 0, noise: float = 0.6, vocab: int = VOCAB) -> tuple[nn.Module, nn.Module]:
    """A random tiny target and a draft = target with weight noise (so acceptance is partial), float32, eval."""
    from transformers import AutoModelForCausalLM

    config = arch_config(arch, vocab)
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    draft.load_state_dict(target.state_dict())
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std().clamp_min(1e-3))
    return target, draft


def left_pad(prompts: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D prompts into ``[B, L]`` ids and mask."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = p
        mask[b, width - len(p) :] = 1
    return ids, mask


def hf_greedy(model: nn.Module, ids: torch.Tensor, max_new_tokens: int) -> list[int]:
    """Greedy continuation of one unpadded prompt ``[1, L]`` by ``model.generate``."""
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None
    )
    return out[0, ids.shape[1] :].tolist()


# ---------------------------------------------------------------------------------------------------------------
# A character-level tokenizer (id 0 = <|endoftext|> = eos = pad, like the reference pair) and a saved tiny pair
# ---------------------------------------------------------------------------------------------------------------
CHARS = "\n" + "".join(chr(i) for i in range(32, 127))  # 96 characters + <|endoftext|> = VOCAB


def char_tokenizer(chat_template: str | None = None):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(CHARS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def save_tiny_pair(root, arch: str = "llama") -> tuple[str, str]:
    """Save a tiny target/draft pair (with the char tokenizer, eos = pad = 0) under ``root``; return the paths."""
    from pathlib import Path

    target, draft = tiny_pair(arch, noise=0.1)
    tok = char_tokenizer()
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        model.config.eos_token_id = model.config.pad_token_id = model.config.bos_token_id = 0
        model.generation_config.eos_token_id = model.generation_config.pad_token_id = 0
        out = Path(root) / name
        model.save_pretrained(out)
        tok.save_pretrained(out)
        paths.append(str(out))
    return paths[0], paths[1]
