"""Greedy correctness of the speculative decoder: hand-built fixed-logit models, tiny real models of every
architecture, batches with left padding, cache rollback, stopping, vocabulary and context errors."""

from __future__ import annotations

import pytest
import torch

from decode.compat import check_vocab_compatible
from decode.kv_stream import KVStream
from decode.speculative import speculative_generate, target_generate
from tests.decode_helpers import VOCAB, FixedLogitLM, accept_k_draft, counter_lm, hf_greedy, left_pad, one_hot_logits
from tests.tiny import ARCHS, tiny_llama, tiny_pair, word_tokenizer


def counter_continuation(last: int, n: int, vocab: int = VOCAB) -> list[int]:
    return [(last + i) % vocab for i in range(1, n + 1)]


PROMPT = torch.tensor([[5, 6, 7, 8]])


# ---------------------------------------------------------------------------------------------------------------
# Hand-built models: never / always / accept-k
# ---------------------------------------------------------------------------------------------------------------
def test_never_accept():
    target, draft = counter_lm(), counter_lm(step=2)
    out = speculative_generate(target, draft, PROMPT, max_new_tokens=12, num_draft_tokens=4, eos_token_id=[])
    assert out.new_tokens == [counter_continuation(8, 12)]
    s = out.stats
    assert s.accepted == 0 and s.rounds == 12 and s.target_forwards == 12
    assert s.per_position_acceptance[0] == 0.0
    assert s.mean_accepted_length == 1.0


def test_always_accept():
    target, draft = counter_lm(), counter_lm()
    out = speculative_generate(target, draft, PROMPT, max_new_tokens=20, num_draft_tokens=4, eos_token_id=[])
    assert out.new_tokens == [counter_continuation(8, 20)]
    s = out.stats
    assert s.rounds == 4 and s.acceptance_rate == 1.0 and s.mean_accepted_length == 5.0
    assert s.per_position_acceptance == [1.0] * 4
    # Bonus rounds feed the draft [d_g, bonus] in one forward: exactly gamma draft forwards per round.
    assert s.draft_forwards == sum(s.gamma_used) == 16
    assert [c["q"] for c in draft.calls[4:5]] == [2]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_accept_k(k):
    target, draft = counter_lm(), accept_k_draft(k, prompt_len=PROMPT.shape[1])
    out = speculative_generate(target, draft, PROMPT, max_new_tokens=24, num_draft_tokens=5, eos_token_id=[])
    assert out.new_tokens == [counter_continuation(8, 24)]
    s = out.stats
    assert s.accepted == k * s.rounds
    assert s.rounds == -(-24 // (k + 1))
    assert s.per_position_acceptance[:k] == [1.0] * k and s.per_position_acceptance[k] == 0.0


def test_draft_never_rereads_cached_tokens():
    """Every draft forward starts exactly where the draft's cache ends (no re-reads, no skips)."""
    target, draft = counter_lm(), accept_k_draft(2, prompt_len=PROMPT.shape[1])
    speculative_generate(target, draft, PROMPT, max_new_tokens=30, num_draft_tokens=4, eos_token_id=[])
    for model in (draft, target):
        for call in model.calls:
            positions = call["positions"][0].tolist()
            assert positions == list(range(call["cache_len"], call["cache_len"] + call["q"]))
    # The draft reads each kept token once: prompt + new tokens (but the last) + rejected drafts.
    fed = sum(c["q"] for c in draft.calls)
    assert fed <= PROMPT.shape[1] + 30 + 2 * len(target.calls)


def test_cache_rollback_keeps_accepted_prefix():
    model = counter_lm()
    stream = KVStream(model, batch_size=1, vocab=VOCAB)
    stream.feed(torch.tensor([[1, 2, 3]]), None, keep=1)
    stream.feed(torch.tensor([[4, 5, 6, 7]]), None, keep=4)
    stream.rollback(4, torch.tensor([1]), [1])  # keep 4 of [4, 5, 6, 7]
    assert stream.cache.get_seq_length() == 4 and stream.slots == 4 and stream.valid is None
    stream.feed(torch.tensor([[9]]), None, keep=1)
    assert model.calls[-1]["positions"].tolist() == [[4]]


def test_cache_rollback_batch_leaves_holes():
    model = counter_lm()
    stream = KVStream(model, batch_size=3, vocab=VOCAB)
    stream.feed(torch.ones(3, 2, dtype=torch.long), None, keep=1)
    stream.feed(torch.ones(3, 4, dtype=torch.long), None, keep=4)
    stream.rollback(4, torch.tensor([0, 3, 1]), [0, 3, 1])
    # The column nobody kept is cropped; rows that kept fewer have holes, masked and skipped by positions.
    assert stream.cache.get_seq_length() == 5 and stream.slots == 5
    assert stream.valid.tolist() == [
        [True, True, False, False, False],
        [True, True, True, True, True],
        [True, True, True, False, False],
    ]
    assert stream.length.tolist() == [2, 5, 3]
    stream.feed(torch.ones(3, 1, dtype=torch.long), None, keep=1)
    assert model.calls[-1]["positions"].tolist() == [[2], [5], [3]]


def test_eos_as_first_token():
    target = counter_lm()
    out = speculative_generate(target, counter_lm(), PROMPT, max_new_tokens=10, num_draft_tokens=3, eos_token_id=9)
    assert out.new_tokens == [[9]]
    assert out.sequences.tolist() == [[5, 6, 7, 8, 9]]
    assert target_generate(target, PROMPT, max_new_tokens=10, eos_token_id=9).new_tokens == [[9]]


def test_eos_mid_round_truncates_and_batch_rows_stop_separately():
    ids, mask = left_pad([torch.tensor([1, 2]), torch.tensor([30, 31, 32])])
    out = speculative_generate(
        counter_lm(), counter_lm(), ids, mask, max_new_tokens=12, num_draft_tokens=5, eos_token_id=5
    )
    assert out.new_tokens == [[3, 4, 5], counter_continuation(32, 12)]
    assert out.sequences.shape == (2, 3 + 12)


@pytest.mark.parametrize("max_new", [1, 2, 3, 7])
def test_gamma_larger_than_remaining_budget(max_new):
    target, draft = counter_lm(), counter_lm()
    out = speculative_generate(target, draft, PROMPT, max_new_tokens=max_new, num_draft_tokens=10, eos_token_id=[])
    assert out.new_tokens == [counter_continuation(8, max_new)]
    # No draft token is wasted past the budget: a round drafts at most (remaining - 1).
    assert sum(out.stats.gamma_used) + out.stats.rounds == max_new


def test_prompt_longer_than_context_is_a_clear_error():
    short = FixedLogitLM(VOCAB, lambda ids, pos: one_hot_logits(ids + 1, VOCAB), context=16)
    with pytest.raises(
        ValueError, match=r"prompt of 14 tokens \+ max_new_tokens 4 exceeds the target model's context of 16"
    ):
        speculative_generate(short, counter_lm(), torch.ones(1, 14, dtype=torch.long), max_new_tokens=4)
    with pytest.raises(ValueError, match="draft model's context"):
        speculative_generate(counter_lm(), short, torch.ones(1, 14, dtype=torch.long), max_new_tokens=4)
    with pytest.raises(ValueError, match="context"):
        target_generate(short, torch.ones(1, 20, dtype=torch.long), max_new_tokens=1)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_draft_tokens"):
        speculative_generate(counter_lm(), counter_lm(), PROMPT, num_draft_tokens="many")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        speculative_generate(counter_lm(), counter_lm(), PROMPT, num_draft_tokens=0)
    with pytest.raises(ValueError, match="stop_strings needs a tokenizer"):
        speculative_generate(counter_lm(), counter_lm(), PROMPT, stop_strings=["x"])


def test_stop_strings():
    tok = _word_tokenizer(list("abcdefghijklmnopqrstuvwxyz"), "letters")
    prompt = torch.tensor([[0, 1]])  # "ab" -> counter continues c, d, e, ...
    target, draft = counter_lm(26), accept_k_draft(2, prompt_len=2, vocab=26)
    out = speculative_generate(
        target,
        draft,
        prompt,
        max_new_tokens=20,
        num_draft_tokens=4,
        eos_token_id=[],
        stop_strings=["fg"],
        tokenizer=tok,
    )
    assert out.new_tokens == [[2, 3, 4, 5, 6]]  # c d e f g: stops right after the token completing "fg"


# ---------------------------------------------------------------------------------------------------------------
# Batches: rows accept different lengths (holes), left padding, position-dependent logits
# ---------------------------------------------------------------------------------------------------------------
def _position_target() -> FixedLogitLM:
    # The next token depends on the position: a wrong position id anywhere changes the output.
    return FixedLogitLM(VOCAB, lambda ids, pos: one_hot_logits(ids + 1 + (pos % 3 == 0).long() * pos, VOCAB))


def _row_dependent_draft() -> FixedLogitLM:
    def fn(ids, pos):
        right = ids + 1 + (pos % 3 == 0).long() * pos
        wrong = (pos * 7 + ids) % 5 == 0  # different rows (tokens) go wrong at different rounds
        return one_hot_logits(right + wrong.long(), VOCAB)

    return FixedLogitLM(VOCAB, fn)


@pytest.mark.parametrize("gamma", [1, 3, 6, "auto"])
def test_batch_rows_equal_rows_alone_fixed_logits(gamma):
    prompts = [torch.tensor(p) for p in ([3, 4, 5], [10], [20, 21, 22, 23, 24, 25], [40, 41])]
    ids, mask = left_pad(prompts)
    target, draft = _position_target(), _row_dependent_draft()
    out = speculative_generate(target, draft, ids, mask, max_new_tokens=25, num_draft_tokens=gamma, eos_token_id=[])
    alone = [
        target_generate(_position_target(), p[None], max_new_tokens=25, eos_token_id=[]).new_tokens[0] for p in prompts
    ]
    assert out.new_tokens == alone
    assert 0 < out.stats.acceptance_rate < 1


# ---------------------------------------------------------------------------------------------------------------
# Tiny random models of every seed-pair architecture vs model.generate
# ---------------------------------------------------------------------------------------------------------------
NOISE = {"gemma": 0.2, "gemma2": 0.05}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_generate(arch):
    target, draft = tiny_pair(arch, noise=NOISE.get(arch, 0.1))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (6, 11, 2)]
    new = 20  # with prompts this crosses the sliding window (8) of gemma2 / mistral
    refs = [hf_greedy(target, p[None], new) for p in prompts]
    accepted = 0
    for gamma in (2, 5, "auto"):
        out = speculative_generate(
            target, draft, prompts[0][None], max_new_tokens=new, num_draft_tokens=gamma, eos_token_id=[]
        )
        assert out.new_tokens == [refs[0]], gamma
        ids, mask = left_pad(prompts)
        out = speculative_generate(
            target, draft, ids, mask, max_new_tokens=new, num_draft_tokens=gamma, eos_token_id=[]
        )
        assert out.new_tokens == refs, gamma
        accepted += out.stats.accepted
    assert accepted > 0  # the draft agrees sometimes, so rollback and holes were exercised
    own = target_generate(target, ids, mask, max_new_tokens=new, eos_token_id=[])
    assert own.new_tokens == refs


# ---------------------------------------------------------------------------------------------------------------
# Vocabulary
# ---------------------------------------------------------------------------------------------------------------
def test_padded_target_embedding_works_on_shared_range():
    target = tiny_llama(VOCAB + 31, seed=0, special_id=None)  # padded like Qwen2.5-7B
    with torch.no_grad():
        target.lm_head.weight[VOCAB:] = 0  # padding rows: never the argmax of real logits
    draft = tiny_llama(VOCAB, seed=None, special_id=None)
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight[:VOCAB])
    shared = check_vocab_compatible(target, draft)
    assert shared == VOCAB
    prompt = torch.randint(1, VOCAB, (1, 7))
    out = speculative_generate(
        target, draft, prompt, max_new_tokens=12, num_draft_tokens=3, eos_token_id=[], vocab=shared
    )
    assert out.new_tokens == [hf_greedy(target, prompt, 12)]


def test_both_loops_decode_over_the_same_width():
    """A padded target whose argmax sometimes lands on a padding row: with the shared width passed to both loops,
    target-only and speculative decoding choose among the same tokens, so greedy outputs are identical."""
    width = VOCAB + 8

    def fn(ids, pos):
        logits = one_hot_logits(ids + 1, width)
        logits[..., VOCAB + 3] += 25.0 * (pos % 3 == 0).float()  # a padding row wins every third position
        return logits

    target, draft = FixedLogitLM(width, fn), counter_lm(VOCAB)
    kw = dict(max_new_tokens=9, eos_token_id=[])
    shared = check_vocab_compatible(target, draft)
    spec = speculative_generate(target, draft, PROMPT, num_draft_tokens=3, vocab=shared, **kw)
    assert spec.new_tokens == target_generate(target, PROMPT, vocab=shared, **kw).new_tokens
    assert all(t < VOCAB for t in spec.new_tokens[0])
    assert VOCAB + 3 in target_generate(target, PROMPT, **kw).new_tokens[0]  # the full width would emit padding
    with pytest.raises(ValueError, match="narrowest model's logits width"):
        speculative_generate(target, draft, PROMPT, num_draft_tokens=3, vocab=width, **kw)


def test_narrower_draft_needs_an_explicit_width():
    """vocab=None is the target's full width: a narrower draft is refused, not cut to (dropping target tokens)."""
    width = VOCAB + 8

    def fn(ids, pos):
        logits = one_hot_logits(ids + 1, width)
        logits[..., VOCAB + 3] += 25.0 * (pos % 3 == 0).float()  # a real target token the draft cannot propose
        return logits

    target, kw = FixedLogitLM(width, fn), dict(max_new_tokens=9, eos_token_id=[])
    with pytest.raises(ValueError, match=rf"{VOCAB} logits, fewer than the target's {width}: pass vocab="):
        speculative_generate(target, counter_lm(VOCAB), PROMPT, num_draft_tokens=3, **kw)
    # A draft as wide as the target decodes over the full width, the same tokens as target_generate.
    spec = speculative_generate(target, counter_lm(width), PROMPT, num_draft_tokens=3, **kw)
    assert spec.new_tokens == target_generate(target, PROMPT, **kw).new_tokens
    assert VOCAB + 3 in spec.new_tokens[0]


def _word_tokenizer(words: list[str], name: str):
    """One token per word, decoded without spaces, named like a hub tokenizer."""
    return word_tokenizer(words, fuse=True, name=name)


def test_vocab_mismatch_names_both_tokenizers_and_first_differing_token():
    words = [f"w{i}" for i in range(VOCAB)]
    other = list(words)
    other[17] = "zzz"
    a, b = _word_tokenizer(words, "org/target-tok"), _word_tokenizer(other, "org/draft-tok")
    assert check_vocab_compatible(counter_lm(), counter_lm(), a, _word_tokenizer(words, "same")) == VOCAB
    with pytest.raises(ValueError, match=r"'org/target-tok'.*'org/draft-tok'.*id 17: 'w17' vs 'zzz'"):
        check_vocab_compatible(counter_lm(), counter_lm(), a, b)


def test_target_tokenizer_past_the_shared_width_is_a_clear_error():
    words = [f"w{i}" for i in range(VOCAB + 5)]
    tok = _word_tokenizer(words, "org/target-tok")
    wide, narrow = counter_lm(VOCAB + 5), counter_lm(VOCAB)
    assert check_vocab_compatible(wide, wide, tok, tok) == VOCAB + 5
    # The same tokenizer for both sides (one tokenizer loaded once) is checked as well, and so is none for the draft.
    for draft_tok in (tok, None, _word_tokenizer(words, "org/draft-tok")):
        with pytest.raises(ValueError, match=r"'org/target-tok' defines 102 ids but the draft .* only 97 logits") as e:
            check_vocab_compatible(wide, narrow, tok, draft_tok)
        assert "resize_token_embeddings(102)" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"defines 102 ids but the target .* only 97 logits.*tokenizer saved with"):
        check_vocab_compatible(narrow, wide, tok)


def test_padded_target_tokenizer_below_the_shared_width_is_fine():
    tok = _word_tokenizer([f"w{i}" for i in range(VOCAB - 10)], "org/tok")  # like Qwen2.5: 151665 ids, 151936 rows
    assert check_vocab_compatible(counter_lm(VOCAB + 31), counter_lm(VOCAB), tok, tok) == VOCAB


# ---------------------------------------------------------------------------------------------------------------
# Auto draft length
# ---------------------------------------------------------------------------------------------------------------
def test_auto_draft_length_adapts():
    from decode.draft_length import AutoDraftLength

    # A draft that is always right (and sure of it): auto drafts long.
    always = AutoDraftLength(max_gamma=8, draft_cost_ratio=0.05)
    out = speculative_generate(
        counter_lm(), counter_lm(), PROMPT, max_new_tokens=60, num_draft_tokens=always, eos_token_id=[]
    )
    assert out.new_tokens == [counter_continuation(8, 60)]
    assert sum(out.stats.gamma_used[1:-1]) / len(out.stats.gamma_used[1:-1]) >= 6
    # A draft that is always wrong however sure it looks: auto learns to draft a single token.
    never = AutoDraftLength(max_gamma=8, draft_cost_ratio=0.05)
    for _ in range(3):  # the calibration carries over between calls
        out = speculative_generate(
            counter_lm(), counter_lm(step=2), PROMPT, max_new_tokens=30, num_draft_tokens=never, eos_token_id=[]
        )
        assert out.new_tokens == [counter_continuation(8, 30)]
    assert out.stats.gamma_used[-10:-1] == [1] * 9  # (the very last round has a budget of one token)
    assert never.accept_prob(0.99) < 0.05


def test_auto_counts_no_draft_time_for_a_further_token_of_a_block():
    """A block draft has drafted its whole block already: a further token costs only verify time, so where a chain
    stops (its next token's draft forward outweighs the expected gain) a block drafts on."""
    from decode.draft_length import AutoDraftLength

    unsure = torch.tensor([0.05])  # the draft's confidence in the token it just drafted
    chain = AutoDraftLength(max_gamma=6, draft_cost_ratio=0.5)
    block = AutoDraftLength(max_gamma=6, draft_cost_ratio=0.5, block=True)
    for controller in (chain, block):
        controller.start_round(1, 6)
    assert not chain.keep_drafting(unsure)
    assert block.keep_drafting(unsure)
