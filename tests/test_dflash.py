"""The DFlash kind (decode/kinds/dflash/): a few layers that fill a whole block from the target's hidden states.

Its training forward is its decoding path (block position k of anchor i, trained, equals position k of one block
forward after the context up to i); greedy output equals target-only for fixed K and auto, batches included;
sampled output follows the target's distribution; its folder is vLLM's layout and loads back; a block above the
trained one and layer ids outside the target are refused.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from decode.kinds.dflash import decoding as dflash
from decode.kinds.dispatch import kind_of
from decode.speculative import speculative_generate, target_generate
from tests.decode_helpers import SAMPLED_ALPHA, SAMPLED_VOCAB, left_pad, sampled_p_value
from tests.test_eagle3 import features_of, sharp_target, tiny_target
from tests.tiny import CHAR_VOCAB

BLOCK = 4


def fit_dflash(target, steps: int = 80, block: int = BLOCK, layers: int = 1, seed: int = 0) -> dflash.DFlashDraft:
    """A draft fitted for a few steps to the target's greedy continuations (it accepts some tokens): block
    position k of anchor i against the target's distribution at i + k."""
    draft = dflash.build(target, None, num_layers=layers, block_size=block, mask_token_id=1)
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, target.config.vocab_size, (8, 6), generator=gen)
    ids = torch.cat([prompts, torch.tensor(target_generate(target, prompts, max_new_tokens=26).new_tokens)], 1)
    logits, features = features_of(target, ids, draft.aux_layers)
    teacher = logits.softmax(-1)
    valid = torch.ones_like(ids, dtype=torch.bool)
    opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        out = draft.block_logits(ids, features, valid)
        loss = 0.0
        for k in range(1, block + 1):
            mask = dflash.block_mask(valid, k)
            target_p = torch.cat([teacher[:, k:], torch.zeros_like(teacher[:, :k])], 1)
            loss = loss - (target_p * out[:, :, k].log_softmax(-1)).sum(-1)[mask].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval()


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("llama")
    return target, fit_dflash(target)


def _random_draft(target, block: int = BLOCK, layers: int = 2, mask: int = 3) -> dflash.DFlashDraft:
    draft = dflash.build(target, None, num_layers=layers, block_size=block, mask_token_id=mask)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.3)
    return draft


def test_the_block_forward_is_the_training_forward():
    """Block position k at anchor p in the training pass gives the logits of position k of one decoding block
    forward that read the context of positions <= p and holds [x_{p+1}, masks]; a context one position longer
    (the off-by-one a training pass could make) does not."""
    target = tiny_target("llama")
    draft = _random_draft(target)
    ids = torch.randint(0, CHAR_VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    _, features = features_of(target, ids, draft.aux_layers)
    valid = torch.ones_like(ids, dtype=torch.bool)
    p = 6
    with torch.no_grad():
        trained = draft.block_logits(ids, features, valid)
        for ctx_len, same in ((p + 1, True), (p + 2, False)):
            cache = dflash.ContextCache(2, torch.device("cpu"))
            dflash._read_context(draft, cache, features[:, :ctx_len], valid[:, :ctx_len])
            if not same:  # the same block positions, after one more context entry
                cache.length -= 1
            block = dflash._block(draft, cache, ids[:, p + 1])
            close = torch.allclose(block, trained[:, p], atol=1e-5, rtol=1e-5)
            assert close == same, ctx_len


def test_blocks_at_drawn_anchors_are_the_blocks_of_the_every_anchor_pass():
    """block_logits at a few anchors gives the same logits as the every-anchor pass at those anchors (a block
    reads only the context its anchor sees, whatever else runs beside it)."""
    target = tiny_target("llama")
    draft = _random_draft(target)
    ids = torch.randint(0, CHAR_VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    _, features = features_of(target, ids, draft.aux_layers)
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, 9:] = False
    anchors = torch.tensor([[7, 0, 3], [2, 8, 5]])
    with torch.no_grad():
        every = draft.block_logits(ids, features, valid)
        some = draft.block_logits(ids, features, valid, anchors)
    assert some.shape == (2, 3, BLOCK + 1, every.shape[-1])
    torch.testing.assert_close(some, every[torch.arange(2)[:, None], anchors], atol=1e-5, rtol=1e-5)


def test_anchors_are_drawn_among_trainable_positions_without_repeats_and_by_the_seed():
    from distill.training.anchors import pick_anchors

    trainable = torch.zeros(3, 10, dtype=torch.bool)
    trainable[0, :8] = True
    trainable[1, 2:4] = True  # fewer trainable positions than anchors: the rest are marked unchosen
    anchors, chosen = pick_anchors(trainable, 4, seed=5)
    assert anchors.shape == chosen.shape == (3, 4)
    for row in range(3):
        picked = anchors[row][chosen[row]].tolist()
        assert len(set(picked)) == len(picked) == min(4, int(trainable[row].sum()))
        assert all(trainable[row, i] for i in picked)
    again, _ = pick_anchors(trainable, 4, seed=5)
    assert torch.equal(anchors, again)
    other = [pick_anchors(trainable, 4, seed=s)[0][0].tolist() for s in range(6, 12)]
    assert any(o != anchors[0].tolist() for o in other)


def test_anchors_are_refused_for_kinds_that_train_every_position():
    from distill.config import DistillConfig, DraftConfig, Recipe

    Recipe(draft=DraftConfig(kind="dflash"), distill=DistillConfig(anchors=8))
    Recipe(draft=DraftConfig(kind="pard", model="x"), distill=DistillConfig(anchors=8))  # trains_anchors
    with pytest.raises(ValueError, match=r"distill.anchors.*draft.kind=standalone.*set distill.anchors=0"):
        Recipe(draft=DraftConfig(kind="standalone", model="x"), distill=DistillConfig(anchors=8))
    with pytest.raises(ValueError, match=r"distill.anchors.*must be >= 0"):
        DistillConfig(anchors=-1)


def test_the_drafter_proposes_the_trained_block_positions(pair):
    """One round of the decoder's drafter proposes, at draft position k, the argmax of the training pass's block
    position k at the last context position: the block the draft was trained on, not one position off."""
    from decode.draft_length import FixedDraftLength

    target, draft = pair
    prompt = torch.randint(0, CHAR_VOCAB, (1, 8), generator=torch.Generator().manual_seed(7))
    nxt = torch.tensor(target_generate(target, prompt, max_new_tokens=1, eos_token_id=[]).new_tokens)
    seq = torch.cat([prompt, nxt], 1)
    _, features = features_of(target, seq, draft.aux_layers)
    n = prompt.shape[1]
    drafter = dflash.Drafter(draft, 1, CHAR_VOCAB)
    drafter.pending = (seq[:, 1:], features[:, :n], torch.ones(1, n, dtype=torch.bool))
    with torch.no_grad():
        tokens, _ = drafter.propose(FixedDraftLength(BLOCK), BLOCK, None, True, None)
        trained = draft.block_logits(seq, features, torch.ones_like(seq, dtype=torch.bool))
    want = [int(trained[0, n - 1, k].argmax()) for k in range(1, BLOCK + 1)]
    assert tokens[0].tolist() == want and drafter.forwards == 1
    assert drafter.cache.slots == n  # only the context is cached: the block is not


def test_one_forward_per_round_and_greedy_equals_target_only(pair):
    target, draft = pair
    assert kind_of(draft) == "dflash" and draft.block_size == BLOCK
    prompt = torch.randint(0, CHAR_VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    want = target_generate(target, prompt, max_new_tokens=40, eos_token_id=[]).new_tokens
    accepted = 0
    for gamma in (1, 2, BLOCK, "auto"):
        out = speculative_generate(target, draft, prompt, max_new_tokens=40, num_draft_tokens=gamma, eos_token_id=[])
        assert out.new_tokens == want, gamma
        accepted += out.stats.accepted
        if gamma == BLOCK:  # a whole block per draft forward
            assert out.stats.drafted > out.stats.draft_forwards * (BLOCK - 1)
    assert accepted > 0


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_greedy_equals_target_only_other_architectures(arch):
    target = tiny_target(arch)
    draft = fit_dflash(target, steps=40)
    prompt = torch.randint(0, CHAR_VOCAB, (1, 7), generator=torch.Generator().manual_seed(4))
    want = target_generate(target, prompt, max_new_tokens=30, eos_token_id=[]).new_tokens
    for gamma in (BLOCK, "auto"):
        out = speculative_generate(target, draft, prompt, max_new_tokens=30, num_draft_tokens=gamma, eos_token_id=[])
        assert out.new_tokens == want, gamma


@pytest.mark.parametrize("gamma", [3, "auto"])
def test_greedy_batch_with_left_padding_equals_each_row_alone(pair, gamma):
    target, draft = pair
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, CHAR_VOCAB, (n,), generator=gen) for n in (3, 9, 6, 1)]
    ids, mask = left_pad(prompts)
    out = speculative_generate(target, draft, ids, mask, max_new_tokens=30, num_draft_tokens=gamma, eos_token_id=[])
    for row, prompt in enumerate(prompts):
        alone = target_generate(target, prompt[None], max_new_tokens=30, eos_token_id=[]).new_tokens[0]
        assert out.new_tokens[row] == alone
    assert 0 < out.stats.accepted < out.stats.drafted


SV, ALPHA = SAMPLED_VOCAB, SAMPLED_ALPHA


def _sampled_p_value(temperature: float) -> tuple[float, object]:
    target = sharp_target()
    draft = _random_draft(target, block=3, layers=1, mask=2)
    return sampled_p_value(target, draft, temperature, 3)


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
    with pytest.raises(ValueError, match=f"above the block of {BLOCK} tokens this DFlash draft"):
        speculative_generate(target, draft, torch.tensor([[1, 2]]), max_new_tokens=4, num_draft_tokens=BLOCK + 1)


def test_layer_ids_outside_the_target_are_refused():
    target = tiny_target("llama", layers=4)
    with pytest.raises(ValueError, match=r"outputs 0\.\.2"):
        dflash.build(target, [0, 3], block_size=BLOCK)
    with pytest.raises(ValueError, match="not in 2..16"):
        dflash.build(target, [0, 1], block_size=17)
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        dflash.build(target, [0, 1], block_size=BLOCK, mask_token_id=CHAR_VOCAB)


def test_served_layout_is_vllms_and_loads_back(tmp_path, pair):
    """config.json and the tensors as vLLM's qwen3_dflash.py reads them (no embedding or output layer: vLLM
    shares the target's), and draftsmith's loader gives the same draft back."""
    target, draft = pair
    dflash.save(draft, tmp_path, target_name="t")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": 1, "target_layer_ids": draft.layer_ids}
    assert config["block_size"] == BLOCK + 1 and config["target_hidden_size"] == target.config.hidden_size
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight"} <= names
    assert {"layers.0.self_attn.k_proj.weight", "layers.0.mlp.gate_proj.weight"} <= names
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in names)
    assert dflash.is_dflash_folder(tmp_path) and dflash.folder_block(tmp_path) == BLOCK
    loaded = dflash.load(tmp_path, target)
    assert kind_of(loaded) == "dflash" and loaded.block_size == BLOCK
    prompt = torch.tensor([[5, 6, 7]])
    a = speculative_generate(target, draft, prompt, max_new_tokens=12, num_draft_tokens=BLOCK, eos_token_id=[])
    b = speculative_generate(target, loaded, prompt, max_new_tokens=12, num_draft_tokens=BLOCK, eos_token_id=[])
    assert a.new_tokens == b.new_tokens and a.stats.accepted == b.stats.accepted
    other = tiny_target("llama", layers=2)
    with pytest.raises(ValueError, match="pass the target it was trained on|layer outputs"):
        dflash.load(tmp_path, other)


def test_the_bench_costs_a_block_at_one_draft_forward_per_round(pair):
    """The bench's zero-overhead figure for a DFlash draft is tau / (c + v): one draft forward (the round's
    context read and the block) drafts the whole block; its cost stream times exactly that."""
    from decode.bench import run_bench
    from tests.tiny import char_tokenizer

    target, draft = pair
    prompts = [{"id": str(i), "prompt": text} for i, text in enumerate(["def f(x):", "import os", "class A:"])]
    result = run_bench(
        target, draft, char_tokenizer(), prompts, target_name="t", draft_name="d", max_new_tokens=12,
        num_draft_tokens=BLOCK, repeats=1, baselines=("target",), progress=False,
    )  # fmt: skip
    tau, c, v = result["mean_accepted_length"], result["draft_cost_ratio"], result["verify_cost_ratio"]
    assert result["mean_num_draft_tokens"] > 1 and result["outputs_match_target"] is True
    assert result["theoretical_speedup"] == pytest.approx(tau / (c + v), rel=1e-3)
    assert 1 <= result["block_choice"]["k"] <= BLOCK


# ---------------------------------------------------------------- training: the target rows of each block position

DVOCAB = 97


@pytest.fixture(scope="module")
def small_target() -> torch.nn.Module:
    from tests.tiny import tiny_llama

    return tiny_llama(DVOCAB, 0, layers=4, initializer_range=0.2).requires_grad_(False)


class Prescribed(torch.nn.Module):
    """A training model whose block logits are given (what the loss must compare them with is the question)."""

    def __init__(self, draft, logits: torch.Tensor):
        super().__init__()
        self.draft, self.logits = draft, logits

    def forward(self, ids, features, valid, anchors=None):
        if anchors is None:
            return self.logits
        return self.logits[torch.arange(len(anchors))[:, None], anchors]  # the rows at the anchors drawn


def _by_hand(target, seq: list[int], a: int) -> torch.Tensor:
    """[V] the target's logits over token a of ``seq``, from the prefix alone."""
    with torch.no_grad():
        return target(input_ids=torch.tensor([seq[:a]])).logits[0, -1].float()


def _block_outputs(target, pairs, block: int, shift: int = 0) -> torch.Tensor:
    """[B, S, K + 1, V] block logits: at anchor i, position k holds the target's logits over token i + k + 1 by
    hand (``shift`` tokens off), random elsewhere."""
    width = max(len(p) + len(c) for p, c in pairs)
    out = torch.randn(len(pairs), width, block + 1, DVOCAB, generator=torch.Generator().manual_seed(0)) * 3
    for b, (p, c) in enumerate(pairs):
        seq = [*p, *c]
        for i in range(len(seq)):
            for k in range(1, block + 1):
                a = i + k + 1 + shift
                if 1 <= a <= len(seq):
                    out[b, i, k] = _by_hand(target, seq, a)
    return out


@pytest.mark.parametrize("anchors", [0, 3], ids=["every-anchor", "3-drawn-anchors"])
def test_block_position_k_at_i_is_compared_with_the_targets_distribution_over_token_i_plus_k_plus_1(
    small_target, anchors
):
    """The training step's rows (decode.kinds.dflash.training.block_loss after the target's side): block position k of
    anchor i against the target's distribution over token i + k + 1, computed by hand from the prefix, whether
    every anchor is trained or a few drawn ones (distill.anchors); block outputs one token off either way are not
    what it trains towards."""
    from decode.kinds.dflash.training import block_loss
    from decode.kinds.eagle3 import train_step
    from distill.config import DistillConfig
    from distill.data.prompts import collate_training
    from tests.test_alignment import pairs_of

    pairs, block = pairs_of(), 3
    cfg = DistillConfig(loss="fkl", loss_positions="all", anchors=anchors)
    batch = collate_training(pairs, 0, loss_positions=cfg.loss_positions)
    draft = dflash.build(small_target, [0, 1, 2], block_size=block, mask_token_id=0)
    side = train_step.target_side(small_target, batch, draft, cfg.temperature)
    for shift, right in ((0, True), (1, False), (-1, False)):
        model = Prescribed(draft, _block_outputs(small_target, pairs, block, shift))
        loss, stats = block_loss(model, side, batch, cfg)
        assert all((stats[f"train/loss_{k}"] < 1e-4) == right for k in range(block)), (shift, stats)


@pytest.fixture(scope="module")
def learnable(tmp_path_factory) -> dict:
    from tests.tiny import learnable_pair, make_prompts

    root = tmp_path_factory.mktemp("learnable-dflash")
    target, draft = learnable_pair(root)
    return {
        "target": target,
        "draft": draft,
        "train": make_prompts(root / "train.jsonl", 64, seed=1),
        "eval": make_prompts(root / "eval.jsonl", 8, seed=2),
    }


def _one_token_off(side):
    """The target's side with each row's distribution taken from the next position: targets one token off."""
    from dataclasses import replace

    shifted = torch.cat([side.log_p[:, 1:], side.log_p[:, -1:]], 1)
    top = torch.cat([side.top[:, 1:], side.top[:, -1:]], 1)
    return replace(side, log_p=shifted, top=top)


def trained_acceptance(paths: dict, out, steps: int, lr: float) -> tuple[float, float]:
    """train/distill.py (its main, in this process) training a fresh 2-layer DFlash draft (a block of 3) on the
    learnable pair's target continuations; (acceptance before, after) as its evaluations measured them:
    draftsmith's decoder, greedy, 3 draft tokens, on 8 held-out prompts."""
    import yaml

    from tests.procs import load_script, tiny_recipe

    recipe = tiny_recipe(
        paths, out, distill={"source": "target", "max_new_tokens": 24},
        train={"max_steps": steps, "batch_size": 8, "lr": lr, "seed": 0},
        eval={"every": steps, "num_prompts": 8, "max_new_tokens": 32, "num_draft_tokens": 3},
    )  # fmt: skip
    recipe["draft"] = {"kind": "dflash", "block_size": 3, "num_layers": 2}
    path = out.parent / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    load_script("train/distill.py").main(["--recipe", str(path)])
    checkpoints = json.loads((out / "report.json").read_text())["checkpoints"]
    assert [c["step"] for c in checkpoints] == [0, steps]
    return checkpoints[0]["acceptance_rate"], checkpoints[-1]["acceptance_rate"]


@pytest.mark.slow
@pytest.mark.parametrize("off_by_one", [False, True], ids=["aligned", "one-token-off"])
def test_a_dflash_draft_trained_through_train_distill_is_accepted(learnable, tmp_path, monkeypatch, off_by_one):
    """A fresh DFlash draft trained for 100 steps through train/distill.py: acceptance about 0 -> 0.033; trained
    against targets one token off, about 0.001. (Low for this pair: its target's embedding is scaled 10x, and a
    DFlash draft's residual stream starts from that embedding, the mask token's at every drafted position, so the
    layers' updates must outgrow it; tests above hold each block position to its own target row.)"""
    from decode.kinds.dflash import training
    from decode.kinds.eagle3 import train_step

    if off_by_one:
        real = train_step.target_side
        monkeypatch.setattr(training.train_step, "target_side", lambda *a, **k: _one_token_off(real(*a, **k)))
    before, after = trained_acceptance(learnable, tmp_path / "run", steps=100, lr=1e-2)
    assert before < 0.02, before
    assert (after > 0.015) != off_by_one, (before, after)


@pytest.mark.slow
def test_a_dflash_run_killed_and_resumed_ends_where_the_uninterrupted_one_does(tmp_path):
    """train/distill.py with a DFlash draft and drawn anchors (distill.anchors), SIGKILLed once checkpoint 3 is
    complete and run again with --resume, ends with the parameters and losses of the same run left alone: the
    anchors a step draws depend on its batch only."""
    from tests.test_distill_e2e import kill_at_checkpoint, launch, write_recipe
    from tests.test_eagle3_train import head_recipe
    from tests.tiny import make_pair, make_prompts

    target, _ = make_pair(tmp_path / "assets")
    assets = {
        "target": target,
        "train": make_prompts(tmp_path / "train.jsonl", 24, seed=1),
        "eval": make_prompts(tmp_path / "eval.jsonl", 3, seed=2),
    }
    draft = {"kind": "dflash", "vocab_subset": 0, "block_size": 3, "num_layers": 1}
    runs = {}
    for name in ("whole", "killed"):
        out = tmp_path / name
        recipe = write_recipe(tmp_path, head_recipe(assets, out, draft=draft, distill={"anchors": 4}), f"{name}.yaml")
        if name == "killed":
            kill_at_checkpoint(recipe, out, step=3)
            proc = launch(recipe, "--resume")
            assert "resumed from" in proc.stdout, proc.stdout[-2000:]
        else:
            proc = launch(recipe)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = json.loads((out / "report.json").read_text())
    whole, killed = runs["whole"], runs["killed"]
    assert [c["step"] for c in killed["checkpoints"]] == [0, 3, 6]
    assert killed["param_checksums"] == pytest.approx(whole["param_checksums"], rel=1e-9)
    assert [c["loss"] for c in killed["checkpoints"]] == pytest.approx([c["loss"] for c in whole["checkpoints"]])


# ---------------------------------------------------------------- the anchors a run draws (distill.anchors)


def anchors_a_run_trains(
    tmp_path, monkeypatch, prompts: int, steps: int, batch_size: int, anchors: int
) -> dict[tuple, list]:
    """train/distill.py's main (in this process) training a DFlash draft with distill.anchors on `prompts` prompts
    for `steps` steps: for each training sequence, the anchors its blocks were trained at in each step that met it
    and its trainable positions, as the draft's training forward received them (the draw observed, not altered)."""
    import yaml

    from decode.kinds.dflash import training
    from tests.procs import load_script, tiny_recipe, tiny_run_paths

    drawn: list = []  # pick_anchors' draws, in order: (trainable, anchors, chosen)
    draw = training.pick_anchors

    def observed_draw(trainable, n, seed):
        out = draw(trainable, n, seed)
        drawn.append((trainable.clone(), *out))
        return out

    seen: dict[tuple, list] = {}
    forward = dflash.DFlashDraft.block_logits

    def observed_forward(self, ids, features, valid, anchors=None):
        if anchors is not None and torch.is_grad_enabled():  # a training step's blocks
            trainable, picked, chosen = drawn[-1]
            assert torch.equal(anchors, picked)  # the draw is what the step trains
            for b in range(len(ids)):
                key = tuple(ids[b][valid[b].bool()].tolist())
                positions = set(trainable[b].nonzero().flatten().tolist())
                seen.setdefault(key, []).append((positions, picked[b][chosen[b]].tolist()))
        return forward(self, ids, features, valid, anchors)

    monkeypatch.setattr(training, "pick_anchors", observed_draw)
    monkeypatch.setattr(dflash.DFlashDraft, "block_logits", observed_forward)
    paths = tiny_run_paths(tmp_path, train_prompts=prompts)
    recipe = tiny_recipe(
        paths, tmp_path / "run", {"source": "target", "max_new_tokens": 12, "anchors": anchors},
        {"max_steps": steps, "batch_size": batch_size, "seed": 0}, eval={"num_draft_tokens": 3},
    )  # fmt: skip
    recipe["draft"] = {"kind": "dflash", "block_size": 3, "num_layers": 1}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    load_script("train/distill.py", "distill_script_for_anchors").main(["--recipe", str(tmp_path / "recipe.yaml")])
    return seen


def checked_draws(seen: dict[tuple, list], n: int) -> None:
    """Each step's anchors of a sequence are distinct trainable positions of it, as many as asked (or all)."""
    for draws in seen.values():
        positions = draws[0][0]
        assert len(positions) >= 2 * n, positions  # room for draws to differ
        for trainable, picked in draws:
            assert trainable == positions  # the same sequence, the same trainable positions
            assert len(set(picked)) == len(picked) == min(n, len(positions)), picked
            assert set(picked) <= positions, (picked, positions)


def uniform_p_value(counts: list[list[int]], draws_per_row: list[float]) -> float:
    """Pearson chi-square p-value of count rows against uniform rows of the given totals (one test over all rows)."""
    stat, dof = 0.0, 0
    for row, total in zip(counts, draws_per_row):
        expected = total / len(row)
        stat += sum((c - expected) ** 2 / expected for c in row)
        dof += len(row) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def test_a_runs_steps_draw_anchors_uniformly_among_trainable_positions(tmp_path, monkeypatch):
    """Over a run's steps (train/distill.py's loop, distill.anchors=3 of about a dozen trainable positions, one
    epoch of 64 sequences), the anchors fall on each offset of the trainable positions at the rate a uniform draw
    gives (chi-square; a fixed run, so the verdict is the same every time), and every offset is trained. A draw
    that repeated itself from step to step would pile its anchors on a few offsets."""
    n, prompts = 3, 64
    seen = anchors_a_run_trains(tmp_path, monkeypatch, prompts=prompts, steps=prompts // 2, batch_size=2, anchors=n)
    assert len(seen) == prompts and all(len(v) == 1 for v in seen.values())
    checked_draws(seen, n)
    by_length: dict[int, list[int]] = {}  # trainable positions -> anchors per offset from the first of them
    for ((positions, picked),) in seen.values():
        row = by_length.setdefault(len(positions), [0] * len(positions))
        for p in picked:
            row[p - min(positions)] += 1
    rows = [row for row in by_length.values() if sum(row) >= 5 * len(row)]  # enough draws for the chi-square
    assert sum(map(sum, rows)) >= n * prompts // 2, by_length
    assert all(min(row) > 0 for row in rows), rows
    assert uniform_p_value(rows, [sum(row) for row in rows]) > 1e-3, rows


def test_over_epochs_every_trainable_position_of_each_sequence_is_trained(tmp_path, monkeypatch):
    """8 sequences in batches of 2 for 20 epochs, distill.anchors=3: each sequence is met 40 times (120 anchors
    over its dozen positions), so a fresh draw each step trains every position of it (a position missed by 40
    uniform draws: about 1e-5)."""
    n, prompts, steps = 3, 8, 160
    seen = anchors_a_run_trains(tmp_path, monkeypatch, prompts=prompts, steps=steps, batch_size=2, anchors=n)
    assert len(seen) == prompts and sum(len(v) for v in seen.values()) == 2 * steps
    checked_draws(seen, n)
    rows = []
    for draws in seen.values():
        counts = dict.fromkeys(sorted(draws[0][0]), 0)
        for _, picked in draws:
            for p in picked:
                counts[p] += 1
        never = [p for p, c in counts.items() if c == 0]
        assert not never, f"positions {never} of {list(counts)} never trained in {len(draws)} steps"
        rows.append(list(counts.values()))
    assert uniform_p_value(rows, [len(d) * n for d in seen.values()]) > 1e-3, rows
