"""Helpers for the decode tests: hand-built models whose logits are a fixed function of the input, left-padded
batches and ``generate``'s greedy reference. Tiny real models and tokenizers are in tests/tiny.py.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import nn
from transformers import PretrainedConfig

from tests.tiny import CHAR_VOCAB

VOCAB = CHAR_VOCAB  # the char tokenizer's, so fixed-logit and tiny real models share one vocabulary


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


def model_sequence_probs(model: nn.Module, prompt: torch.Tensor, n: int, temperature: float) -> torch.Tensor:
    """Exact probability of every length-n continuation of ``prompt`` [1, P] under an LM over a tiny vocabulary.

    Returns ``[V] * n`` probabilities (flattened index = sequence in base V, V = the model's vocabulary).
    """
    vocab = model.config.vocab_size
    seqs = torch.cartesian_prod(*[torch.arange(vocab)] * n).reshape(-1, n)  # [V ** n, n]
    ids = torch.cat([prompt.expand(len(seqs), -1), seqs], 1)
    with torch.no_grad():
        logp = (model(ids).logits[:, prompt.shape[1] - 1 : -1].float() / temperature).log_softmax(-1)
    return logp.gather(-1, seqs[..., None]).squeeze(-1).sum(-1).exp()


def chi_square_p_value(sequences: list[list[int]], expected: torch.Tensor, vocab: int) -> float:
    """Pearson chi-square goodness of fit of sampled sequences (all of one length n) to ``expected`` [vocab ** n].

    Outcomes of probability 0 (cut by top-k / top-p) must never occur (p-value 0 if one does).
    """
    n = len(sequences[0])
    index = torch.tensor([sum(t * vocab ** (n - 1 - i) for i, t in enumerate(seq)) for seq in sequences])
    observed = torch.bincount(index, minlength=vocab**n).double()
    support = expected > 0
    if observed[~support].sum() > 0:
        return 0.0
    exp = expected.double()[support] * len(sequences)
    stat = ((observed[support] - exp) ** 2 / exp).sum()
    dof = support.sum().double() - 1
    # Chi-square survival function: 1 - P(dof/2, stat/2), P the regularized lower incomplete gamma.
    return float(torch.special.gammaincc(dof / 2, stat / 2))


# ---------------------------------------------------------------------------------------------------------------
# Batches and references
# ---------------------------------------------------------------------------------------------------------------
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


def accept_always(draft_tokens: torch.Tensor, q, p: torch.Tensor, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A wrong ``decode.acceptance.accept_sampled`` for negative controls: take every draft token, then a bonus
    token from the target."""
    batch, g = draft_tokens.shape
    accepted = torch.full((batch,), g)
    return accepted, torch.multinomial(p[torch.arange(batch), accepted], 1, generator=generator).squeeze(-1)


# The sampled-output check every kind's tests run: a sharp target over SAMPLED_VOCAB tokens, SAMPLED_ROWS rows of
# SAMPLED_NEW new tokens after one prompt, their sequences against the target's own distribution (chi-square).
SAMPLED_VOCAB, SAMPLED_NEW, SAMPLED_ROWS = 4, 4, 8000
SAMPLED_ALPHA = 1e-4  # a p-value below it: the sampled output does not follow the target


def sampled_p_value(target: nn.Module, draft: nn.Module, temperature: float, num_draft_tokens: int):
    """(chi-square p-value of the speculative decoder's sampled sequences against the target's, the run's stats)."""
    from decode.speculative import speculative_generate

    prompt = torch.tensor([[1, 3, 0]])
    out = speculative_generate(
        target, draft, prompt.expand(SAMPLED_ROWS, -1), max_new_tokens=SAMPLED_NEW,
        num_draft_tokens=num_draft_tokens, temperature=temperature, eos_token_id=[],
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    expected = model_sequence_probs(target, prompt, SAMPLED_NEW, temperature)
    return chi_square_p_value(out.new_tokens, expected, SAMPLED_VOCAB), out.stats
