"""Tiny real models for end-to-end tests: a byte-level BPE tokenizer and a target/draft pair built from configs.

Nothing is downloaded. The draft is made to agree with the target more than chance by copying the target's
embedding and first layer, so acceptance figures are neither 0 nor 1.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import torch

VOCAB = 320


def corpus_texts(n_files: int = 20) -> list[str]:
    """A few standard-library files: real text that every machine has."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:n_files]
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def make_tokenizer(out: Path, vocab_size: int = VOCAB):
    """Train a byte-level BPE (id 0 = <|endoftext|> = bos/eos/pad, like the reference pair) and save it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.save_pretrained(out)
    return fast


def make_pair(root: Path, seed: int = 0, vocab_size: int = VOCAB) -> tuple[Path, Path]:
    """Save a tiny Llama target (4 layers, 64 dims) and draft (2 layers) sharing one tokenizer under `root`."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    root = Path(root)
    paths = []
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=True,
        initializer_range=0.2,  # at the default 0.02 both models just repeat the last token (acceptance 1.0)
    )
    target = LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, **common)).eval()
    draft = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **common)).eval()
    # Share the embedding and the first layer so that the draft is a weak but not useless guesser.
    draft.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
    draft.model.layers[0].load_state_dict(target.model.layers[0].state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    for name, model in (("target", target), ("draft", draft)):
        path = root / name
        model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model.save_pretrained(path)
        make_tokenizer(path, vocab_size)
        paths.append(path)
    return paths[0], paths[1]


def make_prompts(path: Path, n: int, seed: int = 0, chars: int = 120) -> Path:
    """A prompt file (docs/data.md format) of source snippets."""
    text = "\n".join(corpus_texts(30))
    g = torch.Generator().manual_seed(seed)
    with Path(path).open("w") as f:
        for i in range(n):
            start = int(torch.randint(0, len(text) - chars, (1,), generator=g))
            f.write(json.dumps({"id": f"p{i}", "prompt": text[start : start + chars]}) + "\n")
    return Path(path)
