"""Training alignment: the row of the target a training step compares each draft output with.

For a standalone draft, the logits at position t predict token t + 1 and must be compared with the target's
distribution over token t + 1; for an EAGLE-3 head, unrolled step k at position i predicts token i + k + 2 and
must be compared with the target's distribution over that token. The expected rows are computed by hand here, by
running the target on each token's prefix alone (no batch, no padding), and checked through the step loss each
kind trains with: a draft output equal to those rows at the trained positions (and garbage everywhere else) has a
loss of 0, and every trained position, and no other, gets a gradient. An output one position off does not.
"""

from __future__ import annotations

import pytest
import torch

from decode.kinds.eagle3 import decoding as eagle3
from decode.kinds.eagle3 import train_step
from distill.config import DistillConfig, load_recipe
from distill.data.prompts import collate_training
from distill.training import teacher_cache
from tests.procs import load_script
from tests.tiny import tiny_llama

VOCAB = 97


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(VOCAB, 0, layers=4, initializer_range=0.2).requires_grad_(False)


def pairs_of(seed: int = 3) -> list[tuple[list[int], list[int]]]:
    """Three (prompt, completion) pairs of different lengths: the batch is right-padded."""
    g = torch.Generator().manual_seed(seed)
    lengths = [(4, 9), (7, 5), (2, 11)]
    return [
        (torch.randint(1, VOCAB, (p,), generator=g).tolist(), torch.randint(1, VOCAB, (c,), generator=g).tolist())
        for p, c in lengths
    ]


def predicted(pairs, loss_positions: str) -> list[tuple[int, int]]:
    """(row, index) of every token a training step is asked to predict: the completion's tokens, or (`all`) every
    token after the first."""
    return [
        (b, a)
        for b, (p, c) in enumerate(pairs)
        for a in range(len(p) if loss_positions == "completion" else 1, len(p) + len(c))
    ]


def by_hand(target, pairs, b: int, a: int) -> torch.Tensor:
    """[V] the target's logits over token a of row b, from the prefix alone."""
    ids = torch.tensor([[*pairs[b][0], *pairs[b][1]][:a]])
    with torch.no_grad():
        return target(input_ids=ids).logits[0, -1].float()


# ---------------------------------------------------------------- standalone: the kind's step loss


def standalone_step_loss():
    """The standalone kind's step loss (decode.kinds.standalone.training: what train/distill.py's loop runs for it)."""
    from decode.kinds.standalone.training import step_loss

    return step_loss


def standalone_loss(target, pairs, student, overrides, teachers=None) -> torch.Tensor:
    recipe = load_recipe(None, overrides)
    batch = collate_training(pairs, 0, loss_positions=recipe.distill.loss_positions)
    loss, _, _ = standalone_step_loss()(student, batch, pairs, target, recipe, None, teachers, False)
    return loss


def expected_student(target, pairs, loss_positions: str, shift: int = 0) -> torch.Tensor:
    """[B, S, V] draft logits: the target's rows by hand where a token is predicted (at index a - 1 for token a,
    or ``shift`` positions off), random elsewhere."""
    width = max(len(p) + len(c) for p, c in pairs)
    student = torch.randn(len(pairs), width, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    for b, a in predicted(pairs, loss_positions):
        if 0 <= a - 1 + shift < width:
            student[b, a - 1 + shift] = by_hand(target, pairs, b, a)
    return student


STANDALONE_SETTINGS = [
    ["distill.loss=fkl"],
    ["distill.loss=jsd", "distill.temperature=0.7"],
    ["distill.loss=tvd", "distill.loss_positions=all"],
    ["distill.loss=rkl", "distill.top_k=16"],
]


@pytest.mark.parametrize("overrides", STANDALONE_SETTINGS, ids=lambda o: ",".join(o))
def test_standalone_logits_at_t_are_compared_with_the_targets_distribution_over_token_t_plus_1(target, overrides):
    pairs = pairs_of()
    positions = "all" if "distill.loss_positions=all" in overrides else "completion"
    right = standalone_loss(target, pairs, expected_student(target, pairs, positions), overrides)
    assert float(right) < 1e-4
    for shift in (-1, 1):
        off = standalone_loss(target, pairs, expected_student(target, pairs, positions, shift), overrides)
        assert float(off) > 100 * max(float(right), 1e-5), shift


@pytest.mark.parametrize("positions", ["completion", "all"])
def test_standalone_loss_reaches_exactly_the_positions_that_predict_a_trained_token(target, positions):
    pairs = pairs_of()
    student = torch.randn(*expected_student(target, pairs, positions).shape).requires_grad_(True)
    loss = standalone_loss(target, pairs, student, [f"distill.loss_positions={positions}"])
    (grad,) = torch.autograd.grad(loss, student)
    reached = {tuple(ix) for ix in (grad.abs().sum(-1) > 0).nonzero().tolist()}
    assert reached == {(b, a - 1) for b, a in predicted(pairs, positions)}


def test_standalone_rows_kept_in_the_teacher_cache_are_the_same_rows(target):
    """distill.cache_teacher: the first step computes and keeps the target's top-k rows, the second reads them
    back; both compare each position with the right row."""
    pairs = pairs_of()
    overrides = ["distill.loss=fkl", "distill.top_k=16", "distill.cache_teacher=true"]
    cache = teacher_cache.TeacherCache(16, 1.0)
    for _ in range(2):
        right = standalone_loss(target, pairs, expected_student(target, pairs, "completion"), overrides, cache)
        assert float(right) < 1e-4
        off = standalone_loss(target, pairs, expected_student(target, pairs, "completion", 1), overrides, cache)
        assert float(off) > 0.1
    assert len(cache) == len(pairs) and cache.hits >= 2 * len(pairs)


# ------------------------------------------------------- EAGLE-3: decode/kinds/eagle3/train_step.py's step loss


class Prescribed(train_step.Unrolled):
    """The head as step_loss sees it, whose unrolled outputs are given (and whose inputs are recorded)."""

    def __init__(self, head: eagle3.Eagle3Head, outputs: list[torch.Tensor]) -> None:
        super().__init__(head)
        self.outputs = outputs
        self.seen: dict[str, torch.Tensor] = {}

    def forward(self, ids, features, position_ids, key_valid, steps, recompute=False):
        self.seen = {"ids": ids, "features": features, "positions": position_ids}
        assert steps == len(self.outputs)
        return self.outputs


DRAFT_IDS = list(range(0, VOCAB, 3))  # a draft vocabulary of a third of the tokens: the tail bucket is in play


def head_targets(pairs, loss_positions: str, steps: int) -> list[tuple[int, int, int, int]]:
    """(row, step k, position i, token a = i + k + 2) of every head output a step is trained on."""
    return [(b, k, a - k - 2, a) for b, a in predicted(pairs, loss_positions) for k in range(steps) if a - k - 2 >= 0]


def head_outputs(target, pairs, loss_positions: str, steps: int, shift: int = 0) -> list[torch.Tensor]:
    """``steps`` tensors [B, S, Vd]: step k at i holds the target's logits over token i + k + 2 + ``shift`` (by
    hand, draft vocabulary columns), random where nothing is trained."""
    width = max(len(p) + len(c) for p, c in pairs)
    g = torch.Generator().manual_seed(0)
    outputs = [torch.randn(len(pairs), width, len(DRAFT_IDS), generator=g) * 3 for _ in range(steps)]
    for b, k, i, a in head_targets(pairs, loss_positions, steps):
        if 1 <= a + shift <= len(pairs[b][0]) + len(pairs[b][1]):  # token a + shift, or the one past the end
            outputs[k][b, i] = by_hand(target, pairs, b, a + shift)[DRAFT_IDS]
    return outputs


def head_step(target, pairs, outputs, cfg: DistillConfig, cache=None) -> tuple[torch.Tensor, dict, Prescribed]:
    batch = collate_training(pairs, 0, loss_positions=cfg.loss_positions)
    model = Prescribed(eagle3.build(target, DRAFT_IDS, aux_layers=[1, 2, 3]), outputs)
    keys = None if cache is None else [teacher_cache.sequence_key(*p) for p in pairs]
    loss, stats = train_step.step_loss(model, target, batch, cfg, cache=cache, keys=keys)
    return loss, stats, model


HEAD_SETTINGS = [
    DistillConfig(loss="fkl"),
    DistillConfig(loss="jsd", temperature=0.7, ttt_steps=2),
    DistillConfig(loss="tvd", loss_positions="all"),
    DistillConfig(loss="rkl", ttt_steps=4),
]


@pytest.mark.parametrize("cfg", HEAD_SETTINGS, ids=lambda c: f"{c.loss},{c.loss_positions},steps={c.ttt_steps}")
def test_head_step_k_at_i_is_compared_with_the_targets_distribution_over_token_i_plus_k_plus_2(target, cfg):
    pairs = pairs_of()
    loss, stats, _ = head_step(target, pairs, head_outputs(target, pairs, cfg.loss_positions, cfg.ttt_steps), cfg)
    assert float(loss) < 1e-4
    assert all(stats[f"train/loss_{k}"] < 1e-4 for k in range(cfg.ttt_steps)), stats
    for shift in (-1, 1):
        outputs = head_outputs(target, pairs, cfg.loss_positions, cfg.ttt_steps, shift)
        off, stats, _ = head_step(target, pairs, outputs, cfg)
        assert all(stats[f"train/loss_{k}"] > 1e-2 for k in range(cfg.ttt_steps)), (shift, stats)


def test_a_block_heads_position_k_at_i_is_compared_with_the_targets_distribution_over_token_i_plus_k_plus_2(target):
    """A P-EAGLE head trains every position of its block (draft.block_size, not distill.ttt_steps) on the same
    rows as the chain's steps."""
    from decode.kinds.peagle import decoding as peagle

    pairs, cfg, block = pairs_of(), DistillConfig(loss="fkl"), 5
    batch = collate_training(pairs, 0, loss_positions=cfg.loss_positions)
    head = peagle.build(target, DRAFT_IDS, aux_layers=[1, 2, 3], block_size=block, mask_token_id=0)
    for shift, right in ((0, True), (1, False), (-1, False)):
        model = Prescribed(head, head_outputs(target, pairs, cfg.loss_positions, block, shift))
        loss, stats = train_step.step_loss(model, target, batch, cfg)
        assert all((stats[f"train/loss_{k}"] < 1e-4) == right for k in range(block)), (shift, stats)


@pytest.mark.parametrize("positions", ["completion", "all"])
def test_head_loss_reaches_exactly_the_trained_steps_and_positions(target, positions):
    pairs = pairs_of()
    cfg = DistillConfig(loss_positions=positions)
    outputs = [o.clone().requires_grad_(True) for o in head_outputs(target, pairs, positions, cfg.ttt_steps)]
    loss, _, _ = head_step(target, pairs, [o * 1.0 for o in outputs], cfg)
    grads = torch.autograd.grad(loss, outputs)
    reached = {(b, k, i) for k, g in enumerate(grads) for b, i in (g.abs().sum(-1) > 0).nonzero().tolist()}
    assert reached == {(b, k, i) for b, k, i, _ in head_targets(pairs, positions, cfg.ttt_steps)}


@pytest.mark.parametrize("kept", [False, True], ids=["target forward", "kept in the TargetCache"])
def test_head_reads_the_targets_aux_layers_at_its_own_position(target, kept):
    """The features at position i are the target's hidden states at the aux layers (id j: the input of layer j),
    computed from the prefix up to i, whether from the step's target forward or the TargetCache."""
    pairs = pairs_of()
    cfg = DistillConfig()
    cache = train_step.TargetCache(target, cfg.temperature, max_gb=1.0) if kept else None
    outputs = head_outputs(target, pairs, cfg.loss_positions, cfg.ttt_steps)
    for _ in range(2 if kept else 1):  # kept: the second step reads the cache
        loss, stats, model = head_step(target, pairs, outputs, cfg, cache)
        assert float(loss) < 1e-4
    assert stats["train/teacher_forwards"] == (0.0 if kept else 3.0)
    features = model.seen["features"]
    for b, (p, c) in enumerate(pairs):
        ids = torch.tensor([[*p, *c]])
        assert torch.equal(model.seen["ids"][b, : ids.shape[1]], ids[0])
        for i in range(ids.shape[1]):
            with torch.no_grad():
                states = target(input_ids=ids[:, : i + 1], output_hidden_states=True).hidden_states
            want = torch.cat([states[j][0, -1] for j in (1, 2, 3)])
            torch.testing.assert_close(features[b, i].float(), want, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- PARD: decode/kinds/pard/training.py's step


class PrescribedLM(torch.nn.Module):
    """A PARD draft as the kind's step sees it: its one-pass block forward returns the given outputs (block
    position k's [B, S, V] one after the other, as decode.kinds.pard.decoding.block_logits splits them)."""

    def __init__(self, outputs: list[torch.Tensor], mask_token: int = 0) -> None:
        super().__init__()
        from types import SimpleNamespace

        self.outputs = outputs
        self.config = SimpleNamespace(pard_token=mask_token, block_size=len(outputs), vocab_size=VOCAB)
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask, position_ids, use_cache):
        from types import SimpleNamespace

        assert input_ids.shape[1] == len(self.outputs) * self.outputs[0].shape[1]
        return SimpleNamespace(logits=torch.cat(self.outputs, 1) + 0 * self.weight)


def pard_outputs(target, pairs, loss_positions: str, block: int, shift: int = 0) -> list[torch.Tensor]:
    """``block`` tensors [B, S, V]: block position k at anchor i holds the target's logits over token
    i + k + 1 + ``shift`` (by hand), random where nothing is trained."""
    width = max(len(p) + len(c) for p, c in pairs)
    g = torch.Generator().manual_seed(0)
    outputs = [torch.randn(len(pairs), width, VOCAB, generator=g) * 3 for _ in range(block)]
    for b, a in predicted(pairs, loss_positions):
        for k in range(block):
            i = a - k - 1
            if i >= 0 and 1 <= a + shift <= len(pairs[b][0]) + len(pairs[b][1]):
                outputs[k][b, i] = by_hand(target, pairs, b, a + shift)
    return outputs


@pytest.mark.parametrize("overrides", [["distill.loss=fkl"], ["distill.loss=jsd", "distill.loss_positions=all"]])
def test_a_pard_drafts_position_k_at_i_is_compared_with_the_targets_distribution_over_token_i_plus_k_plus_1(
    target, overrides
):
    """Through the kind's own step (decode.kinds.pard.training.loss_step): every block position trains on the
    target's row of the token it drafts; one token off either way, no position does."""
    from types import SimpleNamespace

    from decode.kinds.pard import training as pard

    block = 4
    recipe = load_recipe(None, ["draft.kind=pard", f"draft.block_size={block}", *overrides])
    pairs = pairs_of()
    batch = collate_training(pairs, 0, loss_positions=recipe.distill.loss_positions)
    accelerator = SimpleNamespace(unwrap_model=lambda m: m)
    for shift, right in ((0, True), (1, False), (-1, False)):
        draft = PrescribedLM(pard_outputs(target, pairs, recipe.distill.loss_positions, block, shift))
        out = pard.loss_step(accelerator, draft, target, recipe, VOCAB, None, None)(batch, pairs, False)
        assert all((out.stats[f"train/loss_{k}"] < 1e-4) == right for k in range(block)), (shift, out.stats)
        assert out.teacher_forwards == len(pairs)


# ---------------------------------------------------------------- short real training runs


@pytest.fixture(scope="module")
def learnable(tmp_path_factory) -> dict:
    from tests.tiny import learnable_pair, make_prompts

    root = tmp_path_factory.mktemp("learnable")
    target, draft = learnable_pair(root)
    return {
        "target": target,
        "draft": draft,
        "train": make_prompts(root / "train.jsonl", 64, seed=1),
        "eval": make_prompts(root / "eval.jsonl", 8, seed=2),
    }


def trained_acceptance(paths: dict, out, steps: int, lr: float, draft: dict | None = None) -> tuple[float, float]:
    """train/distill.py (its main, in this process) on the learnable pair for `steps` steps on the target's own
    sampled continuations; (acceptance before, after) as its evaluations measured them: draftsmith's decoder,
    greedy, 3 draft tokens, on 8 held-out prompts."""
    import json

    import yaml

    from tests.procs import tiny_recipe

    recipe = tiny_recipe(
        paths, out, distill={"source": "target", "max_new_tokens": 16},
        train={"max_steps": steps, "batch_size": 4, "lr": lr, "seed": 0},
        eval={"every": steps, "num_prompts": 8, "max_new_tokens": 32, "num_draft_tokens": 3},
    )  # fmt: skip
    if draft is not None:
        recipe["draft"] = draft
    path = out.parent / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    load_script("train/distill.py").main(["--recipe", str(path)])
    checkpoints = json.loads((out / "report.json").read_text())["checkpoints"]
    assert [c["step"] for c in checkpoints] == [0, steps]
    return checkpoints[0]["acceptance_rate"], checkpoints[-1]["acceptance_rate"]


@pytest.mark.slow
def test_a_draft_trained_for_60_steps_is_accepted(learnable, tmp_path):
    """A fresh 2-layer draft distilled for 60 steps: acceptance about 0 -> 0.75 (a draft trained one position off
    the target's rows stays at about 0)."""
    before, after = trained_acceptance(learnable, tmp_path / "run", steps=60, lr=3e-3)
    assert before < 0.05 and after > 0.5, (before, after)


@pytest.mark.slow
def test_a_head_trained_for_150_steps_is_accepted(learnable, tmp_path):
    """A fresh EAGLE-3 head trained for 150 steps: acceptance about 0 -> 0.49 (a head trained one position off
    stays at about 0)."""
    before, after = trained_acceptance(learnable, tmp_path / "run", steps=150, lr=1e-2, draft={"kind": "eagle3"})
    assert before < 0.05 and after > 0.35, (before, after)


@pytest.mark.slow
def test_a_block_head_trained_for_150_steps_is_accepted(learnable, tmp_path):
    """A fresh P-EAGLE head (a block of 3 per forward) trained for 150 steps: acceptance about 0 -> 0.28 (its positions
    after the first never see the tokens drafted before them, so fewer are accepted than of a chain head)."""
    draft = {"kind": "peagle", "block_size": 3}
    before, after = trained_acceptance(learnable, tmp_path / "run", steps=150, lr=1e-2, draft=draft)
    assert before < 0.05 and after > 0.2, (before, after)


@pytest.mark.slow
def test_a_pard_draft_trained_for_150_steps_is_accepted(learnable, tmp_path):
    """The learnable pair's fresh draft made a PARD draft (a block of 3 per forward) and distilled for 150 steps
    through train/distill.py: acceptance 0 -> 0.28, nearly all at the block's first position (the mask positions
    learn slowly on the target's sampled text at this size; tests/test_pard.py's fitting test holds each block
    position to its own target row)."""
    draft = {"kind": "pard", "block_size": 3, "model": str(learnable["draft"])}
    before, after = trained_acceptance(learnable, tmp_path / "run", steps=150, lr=3e-3, draft=draft)
    assert before < 0.05 and after > 0.2, (before, after)
