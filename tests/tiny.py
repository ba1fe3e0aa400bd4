"""Every tiny real tokenizer and model the tests use, built in memory from configs; nothing is downloaded.

Tokenizers: a byte-level BPE (`bpe_tokenizer`, saved by `make_tokenizer`), a character-level one
(`char_tokenizer`) and word-level ones (`word_tokenizer`); `swap_ids` gives "the same size but a different
tokenizer". Models: `tiny_config` (2 layers, 64 dims, 4 heads, of any seed-pair architecture), `tiny_llama`,
`tiny_pair` (a target and a noisy copy as its draft), `make_pair` / `save_tiny_pair` / `save_padded_pair`
(embeddings padded past the tokenizer), which save a pair, and `learnable_pair`, a saved target a draft learns in a
few dozen steps.

Where tests differ (vocabulary, layers, seed, tied embeddings, special ids, chat template, bos) it is a parameter,
so each test says what it relies on.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerFast

EOT = "<|endoftext|>"  # id 0 and bos = eos = pad, like the reference pair
BPE_VOCAB = 320
CHARS = "\n" + "".join(chr(i) for i in range(32, 127))
CHAR_VOCAB = len(CHARS) + 1  # 96 characters + <|endoftext|> = 97
SNIPPETS = ["def f(x):\n    return x + 1\n", "hello world, the quick brown fox jumps", "import os\nprint(os.sep)\n"]


# ---------------------------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------------------------
def corpus_texts(n_files: int = 20) -> list[str]:
    """A few standard-library files: real text that every machine has."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:n_files]
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def bpe_tokenizer(
    vocab_size: int = BPE_VOCAB,
    texts: Sequence[str] | None = None,
    *,
    specials: Sequence[str] = (),
    bos_token: str | None = EOT,
    pad_token: str | None = EOT,
    add_bos: bool = False,
    chat_template: str | None = None,
) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `texts` (default: `corpus_texts()`); id 0 = <|endoftext|> = eos.

    `specials` take ids 1, 2, ...; those other than `bos_token` become additional special tokens. `add_bos`
    prepends the bos to every encoding (as Llama tokenizers do).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT, *specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(corpus_texts() if texts is None else texts, trainer)
    if add_bos:
        bos = [(bos_token, tk.token_to_id(bos_token))]
        tk.post_processor = processors.TemplateProcessing(single=f"{bos_token} $A", special_tokens=bos)
    named = {"eos_token": EOT, "bos_token": bos_token, "pad_token": pad_token}
    named["additional_special_tokens"] = [s for s in specials if s != bos_token]
    # Unset ones are left out rather than saved as null / [] in tokenizer_config.json.
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, **{k: v for k, v in named.items() if v})
    tok.chat_template = chat_template
    return tok


def make_tokenizer(out: Path, vocab_size: int = BPE_VOCAB) -> PreTrainedTokenizerFast:
    """`bpe_tokenizer(vocab_size)` saved to `out`."""
    tok = bpe_tokenizer(vocab_size)
    tok.save_pretrained(out)
    return tok


def word_tokenizer(
    tokens: Sequence[str],
    *,
    split: str | None = None,
    fuse: bool = False,
    name: str | None = None,
    **special_tokens: str,
) -> PreTrainedTokenizerFast:
    """Word-level: token i is `tokens[i]`; unknown words map to the unk_token if given, else to `tokens[0]`.

    `split`: None (the whole text is one word), "whitespace" or "chars" (every character a token). `fuse` decodes
    without spaces between tokens. `special_tokens` are passed on (eos_token=..., pad_token=...).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    unk = special_tokens.get("unk_token", tokens[0])
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=unk))
    if split == "whitespace":
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
    elif split == "chars":
        backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    elif split is not None:
        raise ValueError(f"split={split!r}: use None, 'whitespace' or 'chars'")
    if fuse:
        backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **special_tokens)
    if name is not None:
        tok.name_or_path = name
    return tok


def char_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """One token per printable ASCII character and newline (`CHAR_VOCAB` in all); id 0 = <|endoftext|>."""
    tok = word_tokenizer([EOT, *CHARS], split="chars", fuse=True, eos_token=EOT, pad_token=EOT, bos_token=EOT)
    tok.chat_template = chat_template
    return tok


def swap_ids(tok: PreTrainedTokenizerFast, a: int, b: int) -> PreTrainedTokenizerFast:
    """The same tokenizer (eos only) with ids `a` and `b` exchanged: same size, different token ids."""
    from tokenizers import Tokenizer

    data = json.loads(tok.backend_tokenizer.to_str())
    vocab = data["model"]["vocab"]
    token_a, token_b = (next(t for t, i in vocab.items() if i == n) for n in (a, b))
    vocab[token_a], vocab[token_b] = b, a
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)), eos_token=tok.eos_token)


# ---------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------
ARCHS = ["llama", "gemma", "gemma2", "gpt_neox", "mistral", "mixtral", "qwen2"]
_CONFIG_CLASS = {
    "llama": "LlamaConfig",
    "gemma": "GemmaConfig",
    "gemma2": "Gemma2Config",
    "gpt_neox": "GPTNeoXConfig",
    "mistral": "MistralConfig",
    "mixtral": "MixtralConfig",
    "qwen2": "Qwen2Config",
}


def _arch_features(arch: str, window: int) -> dict:
    """What makes each architecture itself: grouped-query heads, sliding windows, soft-capping, experts."""
    return {
        "llama": dict(num_key_value_heads=2),
        "gemma": dict(num_key_value_heads=1, head_dim=16),
        # Alternating sliding and global layers, attention and final-logit soft-capping.
        "gemma2": dict(
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=window,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        ),
        "gpt_neox": dict(rotary_pct=0.25),  # Pythia: partial rotary, parallel residual
        "mistral": dict(num_key_value_heads=2, sliding_window=window),
        "mixtral": dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
        "qwen2": dict(num_key_value_heads=2),
    }[arch]


def tiny_config(
    arch: str = "llama",
    vocab_size: int = CHAR_VOCAB,
    *,
    layers: int = 2,
    tie: bool = False,
    special_id: int | None = 0,
    window: int = 8,
    **overrides,
) -> PretrainedConfig:
    """A 64-dim, 4-head (of 16), 256-position config of `arch`; `overrides` replace any field.

    `special_id` is bos = eos = pad (None: no special ids, so nothing stops generation); `window` is the sliding
    window of gemma2 and mistral, small so that tests cross it. Untied by default: tied random embeddings make
    tiny models echo their input token.
    """
    import transformers

    fields = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=256,
        bos_token_id=special_id,
        eos_token_id=special_id,
        pad_token_id=special_id,
        tie_word_embeddings=tie,
        **_arch_features(arch, window),
    )
    return getattr(transformers, _CONFIG_CLASS[arch])(**{**fields, **overrides})


def tiny_llama(
    vocab_size: int,
    seed: int | None = 0,
    *,
    layers: int = 2,
    tie: bool = False,
    special_id: int | None = 0,
    **overrides,
) -> nn.Module:
    """A random `tiny_config("llama", ...)` model with 4 key/value heads and 128 positions, in eval mode.

    `seed=None` keeps torch's global generator where it is (the next model of a pair).
    """
    from transformers import LlamaForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    fields = {"num_key_value_heads": 4, "max_position_embeddings": 128, **overrides}
    config = tiny_config("llama", vocab_size, layers=layers, tie=tie, special_id=special_id, **fields)
    return LlamaForCausalLM(config).eval()


def tiny_pair(arch: str, seed: int = 0, noise: float = 0.6, vocab: int = CHAR_VOCAB) -> tuple[nn.Module, nn.Module]:
    """A random target of `arch` (no special ids) and a draft = target + weight noise (partial acceptance); eval."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, vocab, special_id=None)
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    draft.load_state_dict(target.state_dict())
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std().clamp_min(1e-3))
    return target, draft


def save_tiny_pair(root: Path, arch: str = "llama") -> tuple[str, str]:
    """Save `tiny_pair(arch, noise=0.1)` with the char tokenizer (eos = pad = 0) under `root`; return the paths."""
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


def save_padded_pair(root: Path, target_rows: int = 384, draft_rows: int = 352) -> tuple[str, str]:
    """A Qwen2-style target (2 layers) and draft (1 layer) over the `BPE_VOCAB`-token BPE tokenizer, each with its
    embedding and lm_head padded past the tokenizer to its own width (as Qwen2.5-7B's 152064 rows and its 0.5B
    sibling's 151936 over 151665 tokens); saved under `root`, paths returned. The padded rows are the mean row
    (`decode.compat.with_rows`), so neither model chooses a padded id greedily."""
    from transformers import AutoModelForCausalLM

    from decode.compat import with_rows

    tok = bpe_tokenizer(BPE_VOCAB)
    paths = []
    for name, rows, layers, seed in (("target", target_rows, 2, 0), ("draft", draft_rows, 1, 1)):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config("qwen2", rows, layers=layers)).eval()
        with torch.no_grad():
            for layer in (model.get_input_embeddings(), model.get_output_embeddings()):
                layer.weight.copy_(with_rows(layer.weight[: len(tok)], rows))
        out = Path(root) / name
        model.save_pretrained(out)
        tok.save_pretrained(out)
        paths.append(str(out))
    return paths[0], paths[1]


def make_pair(root: Path, seed: int = 0, vocab_size: int = BPE_VOCAB) -> tuple[Path, Path]:
    """Save a tied Llama target (4 layers) and draft (2 layers) sharing the BPE tokenizer under `root`.

    The draft copies the target's embedding and first layer, so acceptance figures are neither 0 nor 1.
    """
    from transformers import GenerationConfig

    # At the default initializer range 0.02 both models just repeat the last token (acceptance 1.0).
    shape = dict(tie=True, max_position_embeddings=512, initializer_range=0.2)
    target = tiny_llama(vocab_size, seed, layers=4, **shape)
    draft = tiny_llama(vocab_size, None, layers=2, **shape)
    # Share the embedding and the first layer so that the draft is a weak but not useless guesser.
    draft.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
    draft.model.layers[0].load_state_dict(target.model.layers[0].state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    tok = bpe_tokenizer(vocab_size)
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        path = Path(root) / name
        model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model.save_pretrained(path)
        tok.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]


def learnable_pair(root: Path, vocab_size: int = BPE_VOCAB) -> tuple[Path, Path]:
    """Save a target a draft can learn in a few dozen steps, and a fresh random draft, with the BPE tokenizer.

    The target (4 layers, untied) has its embedding scaled 10x, so that its residual stream is mostly the current
    token, and its output layer 50x, so that it is nearly deterministic: a bigram with a little context, whose
    continuations a 2-layer draft (or a head) trained on them reproduces, and a draft trained one position off
    does not. The draft (2 layers) shares nothing with it: its acceptance before training is about 0.
    """
    from transformers import GenerationConfig, LlamaForCausalLM

    def config(layers: int) -> PretrainedConfig:
        return tiny_config("llama", vocab_size, layers=layers, num_key_value_heads=4, max_position_embeddings=256)

    torch.manual_seed(0)
    target = LlamaForCausalLM(config(4)).eval()
    with torch.no_grad():
        target.model.embed_tokens.weight.mul_(10.0)
        target.lm_head.weight.mul_(50.0)
    draft = LlamaForCausalLM(config(2)).eval()
    tok = bpe_tokenizer(vocab_size)
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model.save_pretrained(Path(root) / name)
        tok.save_pretrained(Path(root) / name)
        paths.append(Path(root) / name)
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


SHIPPED_CODE = """# A model's own modelling code, as a Hub repo ships it: importing it leaves a marker file.
import os
from pathlib import Path

from transformers import LlamaConfig, LlamaForCausalLM

Path(os.environ["SHIPPED_CODE_MARKER"]).write_text("imported")


class ShippedConfig(LlamaConfig):
    model_type = "llama"


class ShippedForCausalLM(LlamaForCausalLM):
    config_class = ShippedConfig
"""


def ship_code(folder: Path) -> Path:
    """Make the saved Llama in `folder` ship its own modelling code (`auto_map` in config.json, as a Hub repo with
    custom code does): importing that code writes the file named by $SHIPPED_CODE_MARKER. Returns `folder`."""
    folder = Path(folder)
    (folder / "modeling_shipped.py").write_text(SHIPPED_CODE)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "modeling_shipped.ShippedConfig",
        "AutoModelForCausalLM": "modeling_shipped.ShippedForCausalLM",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
