"""The PARD kind (decode/kinds/pard/): a draft LM that drafts its whole block in one
forward from mask tokens.

Its training forward is its decoding path (block position k of anchor i, trained, equals the k-th output of one
block forward after x_i); greedy output equals target-only for every block size and batch; sampled output follows
the target's distribution (with a negative control); a block above the trained one is refused; the training step
trains block position k against the target's distribution k tokens on (an off-by-one fails the fitting test).
"""

from __future__ import annotations

import pytest
import torch

from decode.kinds.dispatch import kind_of
from decode.kinds.pard import decoding as pard
from decode.speculative import speculative_generate, target_generate
from tests.decode_helpers import chi_square_p_value, left_pad, model_sequence_probs
from tests.tiny import CHAR_VOCAB, tiny_llama

BLOCK = 4
MASK = 3


def tiny_pair(vocab: int = CHAR_VOCAB, seed: int = 0):
    """A 4-layer target and a 1-layer draft that starts as the target's embedding, first layer and output layer
    (a weak but not useless guesser, as a sibling is), marked a PARD draft of BLOCK."""
    target = tiny_llama(vocab, seed, layers=4, special_id=None)
    draft = tiny_llama(vocab, None, layers=1, special_id=None)
    draft.load_state_dict(target.state_dict(), strict=False)
    return target, pard.mark(draft, block_size=BLOCK, pard_token=MASK)


PROMPTS = torch.randint(0, CHAR_VOCAB, (8, 6), generator=torch.Generator().manual_seed(0))


def continuations(target, prompts: torch.Tensor = PROMPTS, new: int = 26) -> torch.Tensor:
    """PROMPTS and the target's greedy continuations of them (the fitted drafts' training text)."""
    return torch.cat([prompts, torch.tensor(target_generate(target, prompts, max_new_tokens=new).new_tokens)], 1)


def fit_pard(target, draft, steps: int = 80, shift: int = 0):
    """``draft`` fitted for a few steps with the kind's own step loss (decode.kinds.pard.training.block_loss) to the
    target's greedy continuations; ``shift`` moves every block position's teacher (a deliberately wrong step)."""
    from decode.kinds.pard.training import block_loss

    ids = continuations(target)
    valid = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        teacher = target(ids).logits
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    draft.train()
    for _ in range(steps):
        loss, _ = block_loss(draft, teacher, ids, valid, valid, "fkl", 0.5, 1.0, 0.8, shift=shift)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval()


@pytest.fixture(scope="module")
def pair():
    target, draft = tiny_pair()
    return target, fit_pard(target, draft)


def test_the_training_forward_is_the_decoding_path():
    """Block position k at anchor p in the one-pass training forward gives the logits of the k-th output of one
    decoding forward that reads x_0..x_p and k mask tokens after them."""
    _, draft = tiny_pair()
    ids = torch.randint(0, CHAR_VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    valid = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        blocks = pard.block_logits(draft, ids, valid, BLOCK)
        for p in (0, 5, 11):
            seq = torch.cat([ids[:, : p + 1], torch.full((2, BLOCK - 1), MASK)], 1)
            logits = draft(seq).logits
            for k in range(BLOCK):
                torch.testing.assert_close(blocks[k][:, p], logits[:, p + k], atol=1e-5, rtol=1e-5)


def test_one_forward_per_round_and_greedy_equals_target_only(pair):
    target, draft = pair
    assert kind_of(draft) == "pard"
    prompt = PROMPTS[:1]  # the draft was fitted to the target's continuation of it: it accepts
    want = target_generate(target, prompt, max_new_tokens=40, eos_token_id=[]).new_tokens
    accepted = 0
    for gamma in (1, 2, BLOCK, "auto"):
        out = speculative_generate(target, draft, prompt, max_new_tokens=40, num_draft_tokens=gamma, eos_token_id=[])
        assert out.new_tokens == want, gamma
        accepted += out.stats.accepted
        if gamma == BLOCK:  # a whole block per draft forward
            drafting = sum(1 for g in out.stats.gamma_used if g > 0)
            assert out.stats.draft_forwards == drafting and out.stats.drafted > drafting * (BLOCK - 1)
    assert accepted > 0


def test_auto_drafts_most_of_the_block_where_verifying_it_costs_little(pair):
    """``auto`` is told a PARD draft is a block (speculative_generate sets it from the draft's kind): a further
    token costs no draft forward, only verify time, which a tiny target hardly spends; so it verifies (nearly) the
    whole block each round even with a draft forward priced at 0.6 of the target's, where a chain would stop."""
    from decode.draft_length import AutoDraftLength

    target, draft = pair
    controller = AutoDraftLength(max_gamma=BLOCK, draft_cost_ratio=0.6)
    out = speculative_generate(target, draft, PROMPTS[:2], max_new_tokens=40, num_draft_tokens=controller,
                               eos_token_id=[])  # fmt: skip
    assert controller.block
    drafted = out.stats.gamma_used[1:-1]
    assert sum(drafted) / len(drafted) >= BLOCK - 1


@pytest.mark.parametrize("gamma", [3, "auto"])
def test_greedy_batch_with_left_padding_equals_each_row_alone(pair, gamma):
    target, draft = pair
    gen = torch.Generator().manual_seed(5)
    prompts = [PROMPTS[1], PROMPTS[2, :4], torch.randint(0, CHAR_VOCAB, (9,), generator=gen), PROMPTS[3, :1]]
    ids, mask = left_pad(prompts)
    out = speculative_generate(target, draft, ids, mask, max_new_tokens=30, num_draft_tokens=gamma, eos_token_id=[])
    for row, prompt in enumerate(prompts):
        alone = target_generate(target, prompt[None], max_new_tokens=30, eos_token_id=[]).new_tokens[0]
        assert out.new_tokens[row] == alone
    assert 0 < out.stats.accepted < out.stats.drafted


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_greedy_equals_target_only_other_architectures(arch):
    from tests.test_eagle3 import tiny_target

    target = tiny_target(arch)
    torch.manual_seed(1)
    from transformers import AutoModelForCausalLM

    from tests.tiny import tiny_config

    draft = AutoModelForCausalLM.from_config(tiny_config(arch, CHAR_VOCAB, layers=1, special_id=None)).eval()
    draft = fit_pard(target, pard.mark(draft, block_size=BLOCK, pard_token=MASK), steps=30)
    prompt = torch.randint(0, CHAR_VOCAB, (1, 7), generator=torch.Generator().manual_seed(4))
    want = target_generate(target, prompt, max_new_tokens=30, eos_token_id=[]).new_tokens
    out = speculative_generate(target, draft, prompt, max_new_tokens=30, num_draft_tokens=BLOCK, eos_token_id=[])
    assert out.new_tokens == want


SV, NEW, ROWS = 4, 4, 8000
ALPHA = 1e-4


def _sampled_p_value(temperature: float) -> tuple[float, object]:
    target = tiny_llama(SV, 1, layers=4, special_id=None)
    with torch.no_grad():  # sharper target: the draft's q differs from p, and rejections happen
        target.lm_head.weight.mul_(8.0)
    draft = pard.mark(tiny_llama(SV, 2, layers=1, special_id=None), block_size=3, pard_token=2)
    prompt = torch.tensor([[1, 3, 0]])
    out = speculative_generate(
        target, draft, prompt.expand(ROWS, -1), max_new_tokens=NEW, num_draft_tokens=3, temperature=temperature,
        eos_token_id=[], generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    expected = model_sequence_probs(target, prompt, NEW, temperature)
    return chi_square_p_value(out.new_tokens, expected, SV), out.stats


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
    target, draft = pair
    with pytest.raises(ValueError, match=f"above the block of {BLOCK} tokens this PARD draft"):
        speculative_generate(target, draft, torch.tensor([[1, 2]]), max_new_tokens=4, num_draft_tokens=BLOCK + 1)
    with pytest.raises(ValueError, match="outside the draft's vocabulary"):
        pard.mark(tiny_llama(CHAR_VOCAB, 0, layers=1), block_size=3, pard_token=CHAR_VOCAB)
    with pytest.raises(ValueError, match="not in 2..16"):
        pard.mark(tiny_llama(CHAR_VOCAB, 0, layers=1), block_size=17, pard_token=0)


def test_the_drafter_proposes_the_trained_block_positions(pair):
    """One round of the decoder's drafter proposes, at block position k, the argmax of the training forward's
    block position k at the last real token, and drops the mask positions from its cache."""
    from decode.draft_length import FixedDraftLength

    _, draft = pair
    prompt = torch.randint(0, CHAR_VOCAB, (1, 8), generator=torch.Generator().manual_seed(7))
    drafter = pard.Drafter(draft, 1, CHAR_VOCAB, prompt, torch.ones_like(prompt, dtype=torch.bool))
    with torch.no_grad():
        tokens, _ = drafter.propose(FixedDraftLength(BLOCK), BLOCK, None, True, None)
        blocks = pard.block_logits(draft, prompt, torch.ones_like(prompt, dtype=torch.bool), BLOCK)
    assert tokens[0].tolist() == [int(blocks[k][0, -1].argmax()) for k in range(BLOCK)]
    assert drafter.forwards == 1 and drafter.stream.slots == prompt.shape[1]


def test_the_step_trains_each_block_position_against_the_right_target_position():
    """A draft fitted with the kind's step accepts far more than one fitted with the teacher of every block
    position after the first one token off, either way (the off-by-one a wrong shift in the step would make)."""
    target, _ = tiny_pair()
    rates = {}
    for shift in (0, 1, -1):
        _, draft = tiny_pair()
        draft = fit_pard(target, draft, steps=200, shift=shift)
        out = speculative_generate(target, draft, PROMPTS, max_new_tokens=26, num_draft_tokens=BLOCK, eos_token_id=[])
        rates[shift] = out.stats.acceptance_rate
    assert rates[0] > 0.6 and rates[0] > max(rates[1], rates[-1]) + 0.15, rates


@pytest.mark.parametrize(
    "override,key",
    [
        ("distill.cache_teacher=true", "distill.cache_teacher"),
        ("distill.top_k=16", "distill.top_k"),
        ("draft.vocab_subset=64", "draft.vocab_subset"),
        ("eval.num_draft_tokens=5", "eval.num_draft_tokens"),
    ],
)
def test_a_pard_recipe_refuses_what_its_step_does_not_run_in_one_line(override, key):
    from distill.config import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=key) as info:
        load_recipe(None, ["draft.kind=pard", "draft.block_size=4", override])
    assert "\n" not in str(info.value)
    assert load_recipe(None, ["draft.kind=pard", "draft.block_size=4", "eval.num_draft_tokens=auto"])


def test_hf_assisted_on_a_pard_folder_is_one_error_line(tmp_path):
    """``decode bench --baselines target,hf`` on a PARD draft folder: one line naming the fix, before any weights
    load; the default baselines leave HF assisted generation out."""
    from decode.__main__ import default_baselines, hf_cannot_run
    from decode.kinds.dispatch import read_as

    _, draft = tiny_pair()
    draft.save_pretrained(tmp_path / "draft")
    assert pard.is_pard_folder(tmp_path / "draft") and not pard.is_pard_folder(tmp_path)
    assert read_as(tmp_path / "draft") == "pard"
    assert default_baselines(None, "pard") == ("target",) and default_baselines(None, "standalone") == ("target", "hf")
    with pytest.raises(ValueError, match="use --baselines target") as info:
        default_baselines(("target", "hf"), "pard")
    assert str(info.value) == hf_cannot_run("pard") and '"parallel_drafting": true' in str(info.value)


def test_a_pard_draft_trained_elsewhere_has_no_block_limit_but_16(tmp_path):
    """A config with pard_token and no block_size (a PARD draft from elsewhere): decoded and served as a block
    draft, up to 16 tokens."""
    from decode.vllm_engine import draft_block, draft_kind

    target, draft = tiny_pair()
    del draft.config.block_size
    assert kind_of(draft) == "pard" and pard.block_of(draft) == pard.MAX_BLOCK
    draft.save_pretrained(tmp_path)
    assert draft_block(tmp_path) == pard.MAX_BLOCK and draft_kind(tmp_path) == "pard"
    prompt = PROMPTS[:1]
    want = target_generate(target, prompt, max_new_tokens=12, eos_token_id=[]).new_tokens
    assert (
        speculative_generate(target, draft, prompt, max_new_tokens=12, num_draft_tokens=6, eos_token_id=[]).new_tokens
        == want
    )


def test_bench_refuses_a_block_above_the_folders_before_loading(tmp_path):
    """``python -m decode bench --num-draft-tokens 5`` on a PARD folder of block 4: one error line, exit 2, no
    JSON written."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    _, draft = tiny_pair()
    draft.save_pretrained(tmp_path / "draft")
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
    repo = Path(__file__).resolve().parent.parent
    args = ["--target", str(tmp_path / "draft"), "--draft", str(tmp_path / "draft"), "--prompts",
            str(tmp_path / "p.jsonl"), "--num-draft-tokens", "5", "--json", str(tmp_path / "o.json")]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "decode", "bench", *args], capture_output=True, text=True, cwd=repo,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and lines[-1].startswith("error: --num-draft-tokens 5 is above the block of 4"), lines
    assert not (tmp_path / "o.json").exists()


# ---------------------------------------------------------------- anchored steps (distill.anchors)


def anchored_batch():
    """Two right-padded rows (the second 3 tokens shorter) whose first 3 positions are prompt (untrained)."""
    ids = torch.randint(0, CHAR_VOCAB, (2, 11), generator=torch.Generator().manual_seed(2))
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, 8:] = False
    loss_mask = valid.clone()
    loss_mask[:, :3] = False
    return ids, valid, loss_mask


def test_anchored_logits_are_the_full_forwards_at_every_anchor():
    """With as many anchors as trainable positions (every one drawn), block position k at each anchor and the
    next-token logits at every real position equal the every-position forward's (decode.kinds.pard.decoding)."""
    from decode.kinds.pard.training import trainable_anchors
    from distill.training.anchors import pick_anchors

    _, draft = tiny_pair()
    ids, valid, loss_mask = anchored_batch()
    trainable = trainable_anchors(valid, loss_mask)
    assert trainable[0].tolist() == [False, False, True, True, True, True, True, True, True, True, False]
    anchors, chosen = pick_anchors(trainable, ids.shape[1], seed=3)
    assert all(set(anchors[b][chosen[b]].tolist()) == set(trainable[b].nonzero().flatten().tolist()) for b in (0, 1))
    with torch.no_grad():
        full = pard.block_logits(draft, ids, valid, BLOCK)
        some = pard.anchor_logits(draft, ids, valid, BLOCK, anchors)
    width, n = ids.shape[1], anchors.shape[1]
    assert [tuple(t.shape[:2]) for t in some] == [(2, width)] + [(2, n)] * (BLOCK - 1)
    torch.testing.assert_close(some[0][valid], full[0][valid], atol=1e-5, rtol=1e-5)
    rows = torch.arange(2)[:, None].expand_as(anchors)
    for k in range(1, BLOCK):
        torch.testing.assert_close(some[k][chosen], full[k][rows[chosen], anchors[chosen]], atol=1e-5, rtol=1e-5)


def test_the_anchored_loss_with_every_position_an_anchor_is_the_full_loss():
    """decode.kinds.pard.training: the anchored loss at every position equals the every-position loss (each block
    position's loss and agreement too); distill.anchors above the trainable positions draws them all."""
    from decode.kinds.pard.training import anchored_loss, block_loss

    target, draft = tiny_pair()
    ids, valid, loss_mask = anchored_batch()
    with torch.no_grad():
        teacher = target(ids).logits
    args = ("fkl", 0.5, 1.0, 0.8)
    every = torch.arange(ids.shape[1]).expand_as(ids)
    full, full_stats = block_loss(draft, teacher, ids, valid, loss_mask, *args)
    some, some_stats = anchored_loss(draft, teacher, ids, valid, loss_mask, every, torch.ones_like(valid), *args)
    torch.testing.assert_close(some, full, atol=1e-6, rtol=1e-6)
    assert some_stats == pytest.approx(full_stats, rel=1e-5, abs=1e-6) and len(full_stats) == 2 * BLOCK
    # loss at every real position (distill.loss_positions: all): the drawn trainable anchors are every anchor
    drawn, _ = block_loss(draft, teacher, ids, valid, valid, *args, anchors=64, seed=1)
    torch.testing.assert_close(drawn, block_loss(draft, teacher, ids, valid, valid, *args)[0], atol=1e-6, rtol=1e-6)


def test_a_mask_segment_sees_only_its_anchors_past_and_its_own_block():
    """Mask segment k at anchor j is blind to the real tokens after anchors[j] and to the other anchors' mask
    segments, and sees its own block's earlier segments (the changes it must see do move it)."""
    _, draft = tiny_pair()
    ids = torch.randint(0, CHAR_VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    valid = torch.ones_like(ids, dtype=torch.bool)
    anchors = torch.tensor([[2, 5, 8]])
    width, n = ids.shape[1], anchors.shape[1]

    def logits(x: torch.Tensor) -> torch.Tensor:  # [K - 1, N, V]: the mask segments' logits
        _, positions, mask = pard.anchor_inputs(ids, valid, BLOCK, MASK, anchors)
        with torch.no_grad():
            out = draft(input_ids=x, attention_mask=mask, position_ids=positions, use_cache=False).logits
        return out[0, width:].unflatten(0, (BLOCK - 1, n))

    x, _, _ = pard.anchor_inputs(ids, valid, BLOCK, MASK, anchors)
    before = logits(x)
    later = x.clone()
    later[0, 6] = (later[0, 6] + 1) % CHAR_VOCAB  # a token after anchors 2 and 5, before anchor 8
    after = logits(later)
    torch.testing.assert_close(after[:, :2], before[:, :2], atol=0, rtol=0)
    assert not torch.allclose(after[:, 2], before[:, 2])
    other = x.clone()
    other[0, width + n + 1] = 7  # segment 2 of anchor 5 (j = 1) reads another token
    after = logits(other)
    torch.testing.assert_close(after[:, [0, 2]], before[:, [0, 2]], atol=0, rtol=0)
    torch.testing.assert_close(after[0, 1], before[0, 1], atol=0, rtol=0)  # segment 1 comes before segment 2
    assert not torch.allclose(after[2, 1], before[2, 1])  # segment 3 of the same anchor reads it


def test_a_run_with_anchors_feeds_the_draft_fewer_positions(tmp_path, monkeypatch):
    """train/distill.py (its main, in this process), a PARD recipe for 2 steps with distill.anchors and without:
    each training forward of the draft (a hook counts its length) is S + (K - 1) * N positions instead of K * S."""
    import yaml

    from decode.kinds.pard import training
    from tests.procs import load_script, tiny_recipe, tiny_run_paths

    block, n = 3, 4
    paths = tiny_run_paths(tmp_path, train_prompts=4)
    load = training.load_draft
    seen: dict[int, list[int]] = {}

    def counted_load(recipe, device):
        draft, tokenizer = load(recipe, device)

        def count(module, args, kwargs):
            if torch.is_grad_enabled() and module.training:  # a training step's forward, not an evaluation's
                seen[recipe.distill.anchors].append(kwargs["input_ids"].shape[1])

        draft.register_forward_pre_hook(count, with_kwargs=True)
        return draft, tokenizer

    monkeypatch.setattr(training, "load_draft", counted_load)
    for anchors in (0, n):
        seen[anchors] = []
        recipe = tiny_recipe(
            paths, tmp_path / f"run{anchors}", {"source": "target", "max_new_tokens": 12, "anchors": anchors},
            {"max_steps": 2, "batch_size": 2, "seed": 0}, eval={"num_draft_tokens": block},
        )  # fmt: skip
        recipe["draft"].update({"kind": "pard", "block_size": block})
        recipe_path = tmp_path / f"recipe{anchors}.yaml"
        recipe_path.write_text(yaml.safe_dump(recipe))
        load_script("train/distill.py", "distill_script_for_pard_anchors").main(["--recipe", str(recipe_path)])
    full, anchored = seen[0], seen[n]  # the same sequences (target continuations, the same seed)
    assert len(full) == len(anchored) == 2 and all(length % block == 0 for length in full), seen
    widths = [length // block for length in full]
    assert anchored == [w + (block - 1) * n for w in widths] and all(w > n for w in widths), seen
