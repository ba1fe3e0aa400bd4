"""The test builders keep the promises other tests rely on: one thread, special ids, swaps, seeds, tied weights."""

import pytest
import torch

from tests.tiny import (
    CHAR_VOCAB,
    EOT,
    bpe_tokenizer,
    char_tokenizer,
    swap_ids,
    tiny_config,
    tiny_llama,
    word_tokenizer,
)


def test_every_test_runs_on_one_thread():
    assert torch.get_num_threads() == 1


def test_bpe_ids_bos_and_chat_template():
    plain = bpe_tokenizer(300, ["def f(x):\n    return x\n"], specials=["<s>"], bos_token=None, pad_token=None)
    assert plain.convert_tokens_to_ids([EOT, "<s>"]) == [0, 1] and plain.eos_token_id == 0
    assert plain.bos_token is None and plain.pad_token is None and plain.chat_template is None
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    bos = bpe_tokenizer(
        300, ["def f(x):\n    return x\n"], specials=["<s>"], bos_token="<s>", add_bos=True, chat_template=template
    )
    assert bos("def")["input_ids"][0] == 1 and plain("def")["input_ids"][0] != 1
    assert bos("def")["input_ids"][1:] == plain("def")["input_ids"]
    assert bos.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "<s>x"


def test_char_tokenizer_is_one_token_per_character():
    tok = char_tokenizer()
    assert len(tok) == CHAR_VOCAB and tok.eos_token_id == tok.pad_token_id == 0
    ids = tok("ab c\n", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5 and tok.decode(ids) == "ab c\n"


def test_swap_ids_keeps_the_size_and_changes_the_ids():
    tok = char_tokenizer()
    swapped = swap_ids(tok, 5, 6)
    assert len(swapped) == len(tok)
    a, b = tok.convert_ids_to_tokens([5, 6])
    assert swapped.convert_tokens_to_ids([a, b]) == [6, 5]
    assert tok.get_vocab() != swapped.get_vocab()


def test_word_tokenizer_refuses_an_unknown_split():
    with pytest.raises(ValueError, match="split='words': use None, 'whitespace' or 'chars'"):
        word_tokenizer(["a", "b"], split="words")


def test_tiny_llama_seeds_ties_and_special_ids():
    same = [tiny_llama(40, seed=3).lm_head.weight for _ in range(2)]
    assert torch.equal(*same)
    torch.manual_seed(3)
    first, second = tiny_llama(40, seed=None), tiny_llama(40, seed=None)  # a pair drawn in sequence
    assert torch.equal(first.lm_head.weight, same[0]) and not torch.equal(second.lm_head.weight, same[0])
    tied = tiny_llama(40, tie=True, layers=1)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight and len(tied.model.layers) == 1
    assert tied.config.pad_token_id == 0 and tiny_llama(40, special_id=None).config.eos_token_id is None


def test_tiny_config_overrides_and_windows():
    config = tiny_config("mistral", 50, window=16, initializer_range=0.2)
    assert (config.vocab_size, config.sliding_window, config.initializer_range) == (50, 16, 0.2)
    assert config.num_key_value_heads == 2 and not config.tie_word_embeddings
