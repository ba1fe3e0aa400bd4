"""The P-EAGLE kind (decode/kinds/peagle/): a head that drafts its whole block in one forward.

Its training unroll is its decoding path (block position k of anchor i, trained, equals the k-th output of one
block forward from i); greedy output equals target-only for every block size and batch; sampled output follows
the target's distribution; its folder round-trips in vLLM's layout; a block above the trained one is refused.
"""

from __future__ import annotations

import json

import pytest
import torch

from decode.kinds.dispatch import kind_of
from decode.kinds.eagle3 import decoding as eagle3
from decode.kinds.peagle import decoding as peagle
from decode.speculative import speculative_generate, target_generate
from tests.decode_helpers import SAMPLED_ALPHA, SAMPLED_VOCAB, left_pad, sampled_p_value
from tests.test_eagle3 import features_of, sharp_target, tiny_target
from tests.tiny import CHAR_VOCAB

BLOCK = 4


def fit_block_head(target, draft_ids, steps: int = 60, block: int = BLOCK, seed: int = 0) -> eagle3.Eagle3Head:
    """A P-EAGLE head fitted for a few steps to the target's greedy continuations (it accepts some tokens)."""
    head = peagle.build(target, draft_ids, block_size=block, mask_token_id=1)
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, target.config.vocab_size, (8, 6), generator=gen)
    ids = torch.cat([prompts, torch.tensor(target_generate(target, prompts, max_new_tokens=26).new_tokens)], 1)
    logits, features = features_of(target, ids, head.aux_layers)
    teacher = logits[..., head.draft_ids].softmax(-1)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    valid = torch.ones_like(ids, dtype=torch.bool)
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        loss = 0.0
        for k, step_logits in enumerate(head.unrolled(ids, features, positions, valid, steps=block)):
            mask = eagle3.step_mask(valid, k)
            target_p = torch.cat([teacher[:, k + 1 :], torch.zeros_like(teacher[:, : k + 1])], 1)
            loss = loss - (target_p * step_logits.log_softmax(-1)).sum(-1)[mask].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("llama")
    return target, fit_block_head(target, range(0, CHAR_VOCAB - 7))


def test_the_block_unroll_is_the_decoding_path():
    """Block position k at anchor p in training gives the logits of the k-th output of one block forward that reads
    the real pairs up to p and k mask positions after them; the chain unroll (own outputs fed back) does not."""
    target = tiny_target("llama")
    head = peagle.build(target, range(0, CHAR_VOCAB, 2), block_size=BLOCK, mask_token_id=3)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    ids = torch.randint(0, CHAR_VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    _, features = features_of(target, ids, head.aux_layers)
    positions = torch.arange(12).expand(2, 12)
    valid = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        unrolled = head.unrolled(ids, features, positions, valid, steps=BLOCK)
        p = 6
        cache = eagle3.Eagle3Cache(2, torch.device("cpu"))
        mask_ids, mask_features = head.mask_inputs(2, BLOCK - 1)
        block_ids = torch.cat([eagle3.shift_left(ids, 1)[:, : p + 1], mask_ids], 1)
        block_features = torch.cat([features[:, : p + 1], mask_features], 1)
        real = torch.ones(block_ids.shape, dtype=torch.bool)
        logits, _ = head(block_ids, block_features, cache.positions(real), cache, real, fused=True)
        for k in range(BLOCK):
            torch.testing.assert_close(logits[:, p + k], unrolled[k][:, p], atol=1e-5, rtol=1e-5)
        del head.mask_hidden  # the same weights as a chain head: its later steps differ
        chain = head.unrolled(ids, features, positions, valid, steps=BLOCK)
    assert not torch.allclose(chain[2][:, p], unrolled[2][:, p], atol=1e-3)


def test_one_forward_per_round_and_greedy_equals_target_only(pair):
    target, head = pair
    assert kind_of(head) == "peagle" and head.block_size == BLOCK
    prompt = torch.randint(0, CHAR_VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    want = target_generate(target, prompt, max_new_tokens=40, eos_token_id=[]).new_tokens
    accepted = 0
    for gamma in (1, 2, BLOCK, "auto"):
        out = speculative_generate(target, head, prompt, max_new_tokens=40, num_draft_tokens=gamma, eos_token_id=[])
        assert out.new_tokens == want, gamma
        accepted += out.stats.accepted
        if gamma == BLOCK:  # a whole block per draft forward
            assert out.stats.drafted > out.stats.draft_forwards * (BLOCK - 1)
    assert accepted > 0


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_greedy_equals_target_only_other_architectures(arch):
    target = tiny_target(arch)
    head = fit_block_head(target, range(CHAR_VOCAB), steps=40)
    prompt = torch.randint(0, CHAR_VOCAB, (1, 7), generator=torch.Generator().manual_seed(4))
    want = target_generate(target, prompt, max_new_tokens=30, eos_token_id=[]).new_tokens
    out = speculative_generate(target, head, prompt, max_new_tokens=30, num_draft_tokens=BLOCK, eos_token_id=[])
    assert out.new_tokens == want


@pytest.mark.parametrize("gamma", [3, "auto"])
def test_greedy_batch_with_left_padding_equals_each_row_alone(pair, gamma):
    target, head = pair
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, CHAR_VOCAB, (n,), generator=gen) for n in (3, 9, 6, 1)]
    ids, mask = left_pad(prompts)
    out = speculative_generate(target, head, ids, mask, max_new_tokens=30, num_draft_tokens=gamma, eos_token_id=[])
    for row, prompt in enumerate(prompts):
        alone = target_generate(target, prompt[None], max_new_tokens=30, eos_token_id=[]).new_tokens[0]
        assert out.new_tokens[row] == alone
    assert 0 < out.stats.accepted < out.stats.drafted


SV, ALPHA = SAMPLED_VOCAB, SAMPLED_ALPHA


def _sampled_p_value(temperature: float) -> tuple[float, object]:
    target = sharp_target()
    head = peagle.build(target, [0, 1, 3], block_size=3, mask_token_id=2)  # a draft vocabulary without token 2
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.5)
    return sampled_p_value(target, head, temperature, 3)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_follows_target_distribution(temperature):
    p_value, stats = _sampled_p_value(temperature)
    assert 0 < stats.accepted < stats.drafted
    assert p_value > ALPHA


def test_sampling_negative_control_fails(monkeypatch):
    from decode import acceptance
    from tests.decode_helpers import accept_always

    monkeypatch.setattr(acceptance, "accept_sampled", accept_always)
    assert _sampled_p_value(1.0)[0] < ALPHA


def test_a_block_above_the_trained_one_is_refused(pair):
    target, head = pair
    with pytest.raises(ValueError, match=f"above the block of {BLOCK} tokens"):
        speculative_generate(target, head, torch.tensor([[1, 2]]), max_new_tokens=4, num_draft_tokens=BLOCK + 1)
    with pytest.raises(ValueError, match="a draft tree needs an EAGLE-3 head: a peagle draft"):
        speculative_generate(target, head, torch.tensor([[1, 2]]), max_new_tokens=4, num_draft_tokens="tree:2,2,4")


def test_served_layout_round_trip_for_vllm(tmp_path, pair):
    from decode.vllm_engine import draft_block, draft_kind

    target, head = pair
    eagle3.save(head, tmp_path, verifier="some/target", speculative_tokens=3)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["mask_token_id"] == 1 and config["block_size"] == BLOCK and config["parallel_drafting"] is True
    assert config["speculators_model_type"] == "peagle" and config["draftsmith"]["draft_kind"] == "peagle"
    assert "mask_hidden" in (tmp_path / "model.safetensors").read_bytes().decode("latin-1")
    assert draft_block(tmp_path) == BLOCK and draft_kind(tmp_path) == "peagle"
    loaded = eagle3.load(tmp_path, target)
    assert kind_of(loaded) == "peagle" and torch.equal(loaded.mask_hidden, head.mask_hidden)
    prompt = torch.tensor([[5, 6, 7]])
    a = speculative_generate(target, head, prompt, max_new_tokens=12, num_draft_tokens=BLOCK, eos_token_id=[])
    b = speculative_generate(target, loaded, prompt, max_new_tokens=12, num_draft_tokens=BLOCK, eos_token_id=[])
    assert a.new_tokens == b.new_tokens and a.stats.accepted == b.stats.accepted


def test_an_eagle3_head_warm_starts_a_block_head():
    target = tiny_target("llama")
    chain = eagle3.build(target, range(CHAR_VOCAB))
    block = peagle.with_mask(chain, block_size=5, mask_token_id=0)
    assert kind_of(chain) == "eagle3" and kind_of(block) == "peagle" and block.block_size == 5
    for name, tensor in chain.state_dict().items():
        assert torch.equal(block.state_dict()[name], tensor), name
    kept = peagle.with_mask(block, block_size=3, mask_token_id=0)
    assert torch.equal(kept.mask_hidden, block.mask_hidden)
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        peagle.with_mask(chain, block_size=3, mask_token_id=CHAR_VOCAB)
    with pytest.raises(ValueError, match="not in 2..16"):
        peagle.with_mask(chain, block_size=17, mask_token_id=0)


def test_vllm_speculative_config_of_a_block_head():
    from decode.vllm_engine import speculative_config

    spec = speculative_config("peagle", "h", 3, "greedy", True, block=4, has_parallel=True)
    assert spec["parallel_drafting"] is True and spec["num_speculative_tokens"] == 3 and spec["method"] == "eagle3"
    with pytest.raises(ValueError, match="install vLLM >= 0.16.0"):
        speculative_config("peagle", "h", 3, "greedy", True, block=4, has_parallel=False)
    with pytest.raises(ValueError, match="above the block of 4 tokens"):
        speculative_config("peagle", "h", 5, "greedy", True, block=4, has_parallel=True)
    assert "parallel_drafting" not in speculative_config("eagle3", "h", 3, "greedy", True)
    # a kind whose method drafts its block by itself (its vllm_parallel_drafting trait false) needs no such setting
    dflash = speculative_config("dflash", "d", 3, "greedy", True, block=4, has_parallel=False)
    assert dflash["method"] == "dflash" and "parallel_drafting" not in dflash


def test_the_drafter_proposes_the_trained_block_positions(pair):
    """One round of the decoder's drafter proposes, at block position k, the argmax of the unroll's step k at the
    last real position: the block the head was trained on, not one position off."""
    from decode.draft_length import FixedDraftLength

    target, head = pair
    prompt = torch.randint(0, CHAR_VOCAB, (1, 8), generator=torch.Generator().manual_seed(7))
    nxt = torch.tensor(target_generate(target, prompt, max_new_tokens=1, eos_token_id=[]).new_tokens)
    seq = torch.cat([prompt, nxt], 1)
    _, features = features_of(target, seq, head.aux_layers)
    n = prompt.shape[1]
    drafter = peagle.Drafter(head, 1, CHAR_VOCAB)
    drafter.pending = (seq[:, 1:], features[:, :n], torch.ones(1, n, dtype=torch.bool))
    with torch.no_grad():
        tokens, _ = drafter.propose(FixedDraftLength(BLOCK), BLOCK, None, True, None)
        positions = torch.arange(n + 1)[None]
        unrolled = head.unrolled(seq, features, positions, torch.ones_like(seq, dtype=torch.bool), steps=BLOCK)
    want = [int(head.draft_ids[unrolled[k][0, n - 1].argmax()]) for k in range(BLOCK)]
    assert tokens[0].tolist() == want and drafter.forwards == 1
    assert drafter.cache.slots == n  # the mask positions are dropped after the round


def test_the_bench_costs_a_block_at_one_draft_forward_per_round(pair):
    """The bench's zero-overhead figure for a block draft is tau / (c + v): one head forward drafts the block
    (a chain of gamma tokens costs gamma c)."""
    from decode.bench import run_bench
    from tests.tiny import char_tokenizer

    target, head = pair
    prompts = [{"id": str(i), "prompt": text} for i, text in enumerate(["def f(x):", "import os", "class A:"])]
    result = run_bench(
        target, head, char_tokenizer(), prompts, target_name="t", draft_name="h", max_new_tokens=12,
        num_draft_tokens=BLOCK, repeats=1, baselines=("target",), progress=False,
    )  # fmt: skip
    tau, c, v = result["mean_accepted_length"], result["draft_cost_ratio"], result["verify_cost_ratio"]
    assert result["mean_num_draft_tokens"] > 1
    assert result["theoretical_speedup"] == pytest.approx(tau / (c + v), rel=1e-3)
    curve = result["verify_cost_curve"]  # v(K + 1) for K = 1..16, in 1-token forwards, measured on this machine
    assert sorted(curve) == list(range(1, 17)) and all(x > 0 for x in curve.values())
    choice = result["block_choice"]  # the block a server should run, from the acceptance and the curve
    assert 1 <= choice["k"] <= BLOCK and choice["k"] == max(
        choice["expected_speedup"], key=choice["expected_speedup"].get
    )
