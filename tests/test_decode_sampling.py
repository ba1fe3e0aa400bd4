"""The one logits-processing path, and a statistical test that speculative sampling follows the target's
distribution exactly (and that plausible wrong rules fail the same test)."""

from __future__ import annotations

import pytest
import torch

import decode.acceptance as acceptance
from decode.acceptance import accept_greedy, accept_sampled
from decode.sampling import process_logits
from decode.speculative import speculative_generate, target_generate
from tests.decode_helpers import accept_always, bigram_lm, bigram_sequence_probs, chi_square_p_value


# ---------------------------------------------------------------------------------------------------------------
# process_logits
# ---------------------------------------------------------------------------------------------------------------
def test_temperature_zero_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    assert process_logits(logits, 0.0).tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


def test_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    torch.testing.assert_close(process_logits(logits, 1.0), torch.tensor([0.5, 0.25, 0.15, 0.1]))
    torch.testing.assert_close(process_logits(logits, 0.5), (logits / 0.5).softmax(-1))
    torch.testing.assert_close(process_logits(logits, 1.0, top_k=2), torch.tensor([2 / 3, 1 / 3, 0, 0]))
    # top-p keeps the smallest head whose mass reaches p: 0.5 + 0.25 >= 0.7.
    torch.testing.assert_close(process_logits(logits, 1.0, top_p=0.7), torch.tensor([2 / 3, 1 / 3, 0, 0]))
    torch.testing.assert_close(process_logits(logits, 1.0, top_p=0.1), torch.tensor([1.0, 0, 0, 0]))
    batch = process_logits(torch.randn(3, 5, 50), 0.8, top_k=10, top_p=0.9)
    torch.testing.assert_close(batch.sum(-1), torch.ones(3, 5))
    assert ((batch > 0).sum(-1) <= 10).all()


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1.0}, {"temperature": 1.0, "top_k": -1}, {"temperature": 1, "top_p": 0}]
)
def test_invalid_sampling_parameters(kwargs):
    with pytest.raises(ValueError):
        process_logits(torch.zeros(4), **kwargs)


def test_greedy_rule_is_sampled_rule_with_one_hot_distributions():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        target_logits = torch.randn(6, 4, 7, generator=gen)
        draft_logits = torch.randn(6, 3, 7, generator=gen)
        draft_tokens = draft_logits.argmax(-1)
        # Make some drafts right so that acceptance lengths vary.
        right = torch.rand(6, 3, generator=gen) < 0.6
        draft_tokens = torch.where(right, target_logits[:, :3].argmax(-1), draft_tokens)
        q = torch.nn.functional.one_hot(draft_tokens, 7).float()
        g_acc, g_next = accept_greedy(draft_tokens, target_logits)
        s_acc, s_next = accept_sampled(draft_tokens, q, process_logits(target_logits, 0.0), gen)
        assert g_acc.tolist() == s_acc.tolist() and g_next.tolist() == s_next.tolist()


# ---------------------------------------------------------------------------------------------------------------
# Statistical test: the sampled sequence distribution is the target's
# ---------------------------------------------------------------------------------------------------------------
V, NEW, ROWS = 4, 3, 12_000
FIRST = 1
# Significance of the chi-square test: a correct sampler fails with probability 1e-4 (and the seed is fixed, so
# the test is deterministic); the wrong rules below fail it by orders of magnitude.
ALPHA = 1e-4


def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(V, V, generator=gen) * 1.5
    draft = torch.randn(V, V, generator=gen) * 1.5  # unrelated to the target: p and q differ a lot
    return target, draft


def _sample_speculative(temperature: float, top_k: int, top_p: float, gamma: int, seed: int = 0) -> float:
    """p-value of ROWS speculative samples of NEW tokens against the exact target distribution."""
    target_table, draft_table = _tables()
    prompt = torch.full((ROWS, 1), FIRST)  # ROWS independent samples, decoded as one batch
    out = speculative_generate(
        bigram_lm(target_table),
        bigram_lm(draft_table),
        prompt,
        max_new_tokens=NEW,
        num_draft_tokens=gamma,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_token_id=[],
        generator=torch.Generator().manual_seed(seed),
    )
    expected = bigram_sequence_probs(target_table, FIRST, NEW, lambda x: process_logits(x, temperature, top_k, top_p))
    return chi_square_p_value(out.new_tokens, expected, V)


@pytest.mark.parametrize(
    "temperature,top_k,top_p,gamma", [(1.0, 0, 1.0, 2), (1.0, 0, 1.0, 5), (0.7, 3, 1.0, 2), (1.3, 0, 0.8, 3)]
)
def test_speculative_sampling_follows_target_distribution(temperature, top_k, top_p, gamma):
    assert _sample_speculative(temperature, top_k, top_p, gamma) > ALPHA


def test_target_only_sampling_follows_target_distribution():
    target_table, _ = _tables()
    out = target_generate(
        bigram_lm(target_table),
        torch.full((ROWS, 1), FIRST),
        max_new_tokens=NEW,
        temperature=1.0,
        eos_token_id=[],
        generator=torch.Generator().manual_seed(0),
    )
    expected = bigram_sequence_probs(target_table, FIRST, NEW, lambda x: process_logits(x, 1.0))
    assert chi_square_p_value(out.new_tokens, expected, V) > ALPHA


@pytest.mark.parametrize(
    "attr,wrong",
    [
        ("residual_distribution", lambda p, q: p),  # resample from p instead of norm(max(0, p - q))
        ("residual_distribution", lambda p, q: q.clamp_min(0) + (q.sum(-1, keepdim=True) == 0) * p),  # from q
        ("accept_sampled", accept_always),
    ],
    ids=["resample-from-p", "resample-from-q", "accept-always"],
)
def test_wrong_rules_fail_the_same_bound(monkeypatch, attr, wrong):
    monkeypatch.setattr(acceptance, attr, wrong)
    assert _sample_speculative(1.0, 0, 1.0, 2) < ALPHA
