"""The DSpark kind (decode/kinds/dspark/): a DFlash block draft plus a low-rank Markov
bias chained through the block and a confidence head that ends a drafted block early.

Its drafted token k is the argmax of the training pass's block position k when the true previous tokens are the
drafted ones (the Markov bias chains through the block); greedy output equals target-only for fixed K and auto,
batches and the confidence cut included; sampled output follows the target's distribution; the cut drafts fewer
tokens at the same output; its folder is speculators' dspark layout and loads back, and is refused for another
target in one line; its recipe keys are checked; train/distill.py trains and saves one.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from decode.kinds.dispatch import kind_of
from decode.kinds.dspark import decoding as dspark
from decode.speculative import speculative_generate, target_generate
from tests.decode_helpers import SAMPLED_ALPHA, SAMPLED_VOCAB, left_pad, sampled_p_value
from tests.test_eagle3 import features_of, sharp_target, tiny_target
from tests.tiny import CHAR_VOCAB

BLOCK = 4
RANK = 8


def fit_dspark(target, steps: int = 80, confidence_min: float | None = 0.0, seed: int = 0) -> dspark.DSparkDraft:
    """A draft fitted for a few steps to the target's greedy continuations through the kind's own training loss
    (the block loss over Markov-biased logits and the confidence head's BCE), so that it accepts some tokens."""
    from decode.kinds.dspark import training
    from decode.kinds.eagle3.train_step import TargetSide, teacher_log_probs
    from distill.config import DistillConfig

    draft = dspark.build(target, None, num_layers=1, block_size=BLOCK, mask_token_id=1, markov_rank=RANK,
                         confidence_min=confidence_min)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, target.config.vocab_size, (8, 6), generator=gen)
    ids = torch.cat([prompts, torch.tensor(target_generate(target, prompts, max_new_tokens=26).new_tokens)], 1)
    logits, features = features_of(target, ids, draft.aux_layers)
    log_p = teacher_log_probs(logits.flatten(0, 1), torch.arange(CHAR_VOCAB)).unflatten(0, ids.shape)
    side = TargetSide(features, log_p, logits.argmax(-1), ids.shape[0])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    model = training.Blocks(draft)
    opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        loss, _ = training.block_loss(model, side, batch, DistillConfig(step_weight=1.0))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval()


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("llama")
    return target, fit_dspark(target)


def _random_draft(target, block: int = BLOCK, mask: int = 3, confidence_min: float | None = 0.0):
    draft = dspark.build(target, None, num_layers=1, block_size=block, mask_token_id=mask, markov_rank=RANK,
                         confidence_min=confidence_min)  # fmt: skip
    with torch.no_grad():
        for p in draft.parameters():
            if p.requires_grad:
                p.normal_(0, 0.3)
        draft.markov_head.markov_w2.weight.mul_(10.0)  # a bias that moves the argmax
    return draft


def test_the_drafter_chains_the_markov_bias_of_each_drafted_token():
    """One round's draft token k is the argmax of the training pass's block position k at the last context
    position when the sequence goes on with the drafted tokens (the bias reads the token drafted at k - 1), and
    the Markov bias changes what is drafted (the test would pass for a draft without one otherwise)."""
    from decode.draft_length import FixedDraftLength
    from decode.kinds.dflash import decoding as dflash

    target = tiny_target("llama")
    draft = _random_draft(target).eval()
    prompt = torch.randint(0, CHAR_VOCAB, (1, 8), generator=torch.Generator().manual_seed(7))
    nxt = torch.tensor(target_generate(target, prompt, max_new_tokens=1, eos_token_id=[]).new_tokens)
    seq = torch.cat([prompt, nxt], 1)
    _, features = features_of(target, seq, draft.aux_layers)
    n = prompt.shape[1]

    def one_round(d):
        drafter = dspark.drafter(d, 1, CHAR_VOCAB, seq, None)
        drafter.pending = (seq[:, 1:], features[:, :n], torch.ones(1, n, dtype=torch.bool))
        with torch.no_grad():
            return drafter.propose(FixedDraftLength(BLOCK), BLOCK, None, True, None)[0][0].tolist(), drafter

    tokens, drafter = one_round(draft)
    assert len(tokens) == BLOCK and drafter.forwards == 1
    full = torch.cat([seq, torch.tensor([tokens])], 1)
    _, full_features = features_of(target, full, draft.aux_layers)
    with torch.no_grad():
        trained = draft.block_logits(full, full_features, torch.ones_like(full, dtype=torch.bool))
    assert tokens == [int(trained[0, n - 1, k].argmax()) for k in range(1, BLOCK + 1)]
    backbone = dflash.Drafter(draft, 1, CHAR_VOCAB)  # the same block forward without the Markov bias
    backbone.pending = (seq[:, 1:], features[:, :n], torch.ones(1, n, dtype=torch.bool))
    with torch.no_grad():
        plain = backbone.propose(FixedDraftLength(BLOCK), BLOCK, None, True, None)[0][0].tolist()
    assert plain != tokens


def test_greedy_equals_target_only_with_and_without_the_cut(pair):
    target, draft = pair
    assert kind_of(draft) == "dspark" and draft.block_size == BLOCK and draft.confidence_head is not None
    prompt = torch.randint(0, CHAR_VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    want = target_generate(target, prompt, max_new_tokens=40, eos_token_id=[]).new_tokens
    accepted = 0
    for cut in (0.0, 0.5):
        draft.confidence_min = cut
        for gamma in (1, BLOCK, "auto"):
            out = speculative_generate(target, draft, prompt, max_new_tokens=40, num_draft_tokens=gamma,
                                       eos_token_id=[])  # fmt: skip
            assert out.new_tokens == want, (cut, gamma)
            accepted += out.stats.accepted
    draft.confidence_min = 0.0
    assert accepted > 0


def test_the_confidence_head_learns_which_positions_are_accepted(pair):
    """After fitting, the head's mean confidence is higher where the draft's argmax is the target's token than
    where it is not (block positions whose earlier ones all matched, on the continuations it was fitted to)."""
    target, draft = pair
    prompts = torch.randint(0, CHAR_VOCAB, (8, 6), generator=torch.Generator().manual_seed(0))  # fit_dspark's
    ids = torch.cat([prompts, torch.tensor(target_generate(target, prompts, max_new_tokens=26).new_tokens)], 1)
    logits, features = features_of(target, ids, draft.aux_layers)
    with torch.no_grad():
        out, confidence = draft.block_outputs(ids, features, torch.ones_like(ids, dtype=torch.bool))
    width, right, wrong = ids.shape[1], [], []
    for b in range(ids.shape[0]):
        for i in range(width - BLOCK):
            for k in range(1, BLOCK + 1):
                same = bool(out[b, i, k].argmax(-1) == logits[b, i + k].argmax(-1))
                (right if same else wrong).append(float(confidence[b, i, k].sigmoid()))
                if not same:
                    break
    assert right and wrong
    assert sum(right) / len(right) > sum(wrong) / len(wrong) + 0.05, (len(right), len(wrong))


@pytest.mark.parametrize("gamma", [3, "auto"])
def test_greedy_batch_with_left_padding_equals_each_row_alone(pair, gamma):
    target, draft = pair
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, CHAR_VOCAB, (n,), generator=gen) for n in (3, 9)]
    ids, mask = left_pad(prompts)
    out = speculative_generate(target, draft, ids, mask, max_new_tokens=30, num_draft_tokens=gamma, eos_token_id=[])
    for row, prompt in enumerate(prompts):
        alone = target_generate(target, prompt[None], max_new_tokens=30, eos_token_id=[]).new_tokens[0]
        assert out.new_tokens[row] == alone
    assert 0 < out.stats.accepted < out.stats.drafted


def test_the_confidence_cut_drafts_fewer_tokens_at_the_same_output():
    """With no cut every round drafts the whole block; a cut at 0.5 ends some blocks early and not others, a cut
    at 1 drafts nothing, and the output stays the target's."""
    target = tiny_target("llama")
    draft = _random_draft(target).eval()
    prompt = torch.randint(0, CHAR_VOCAB, (1, 9), generator=torch.Generator().manual_seed(11))
    want = target_generate(target, prompt, max_new_tokens=30, eos_token_id=[]).new_tokens
    runs = {}
    for cut in (0.0, 0.5, 1.0):
        draft.confidence_min = cut
        out = speculative_generate(target, draft, prompt, max_new_tokens=30, num_draft_tokens=BLOCK, eos_token_id=[])
        assert out.new_tokens == want, cut
        runs[cut] = out.stats
    assert set(runs[0.0].gamma_used[1:-4]) == {BLOCK}  # the last rounds: capped by the tokens left
    assert 0 < runs[0.5].drafted < runs[0.0].drafted and set(runs[0.5].gamma_used) > {BLOCK}
    assert runs[1.0].drafted == 0  # no position is predicted certain: nothing drafted, target-only decoding


SV, ALPHA = SAMPLED_VOCAB, SAMPLED_ALPHA


def _sampled_p_value(temperature: float) -> tuple[float, object]:
    target = sharp_target()
    draft = _random_draft(target, block=3, mask=2)
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


def test_served_layout_is_speculators_dspark_and_loads_back(tmp_path, pair):
    """config.json and the tensors as speculators 0.9's DSparkSpeculatorConfig and vLLM's Qwen3DSparkModel read
    them, and draftsmith's loader gives the same draft back (its cut included)."""
    target, draft = pair
    draft.confidence_min = 0.25
    dspark.save(draft, tmp_path, target_name="t")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["architectures"] == ["DSparkSpeculator"]
    spec = config["speculators_config"]
    assert spec["algorithm"] == "dspark" and spec["proposal_methods"][0]["speculative_tokens"] == BLOCK
    assert config["block_size"] == BLOCK + 1 and config["sample_from_anchor"] is False
    assert config["aux_hidden_state_layer_ids"] == [j + 1 for j in draft.layer_ids]
    assert config["mask_token_id"] == 1 and config["draft_vocab_size"] == target.config.vocab_size
    assert config["markov_rank"] == RANK and config["markov_head_type"] == "vanilla"
    assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is True
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 1
    assert layer["hidden_size"] == config["target_hidden_size"] == target.config.hidden_size
    tensors = load_file(str(tmp_path / "model.safetensors"))
    hidden = target.config.hidden_size
    assert tensors["markov_head.markov_w1.weight"].shape == (CHAR_VOCAB, RANK)
    assert tensors["markov_head.markov_w2.weight"].shape == (CHAR_VOCAB, RANK)
    assert tensors["confidence_head.proj.weight"].shape == (1, hidden + RANK)
    assert tensors["confidence_head.proj.bias"].shape == (1,)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight"} <= set(tensors)
    assert not any(n.startswith(("embed_tokens", "lm_head", "verifier")) for n in tensors)
    assert dspark.is_dspark_folder(tmp_path)
    loaded = dspark.load(tmp_path, target)
    assert kind_of(loaded) == "dspark" and loaded.block_size == BLOCK and loaded.confidence_min == 0.25
    prompt = torch.tensor([[5, 6, 7]])
    a = speculative_generate(target, draft, prompt, max_new_tokens=16, num_draft_tokens=BLOCK, eos_token_id=[])
    b = speculative_generate(target, loaded, prompt, max_new_tokens=16, num_draft_tokens=BLOCK, eos_token_id=[])
    assert a.new_tokens == b.new_tokens and a.stats.drafted == b.stats.drafted
    draft.confidence_min = 0.0


def test_a_dspark_folder_for_another_target_is_refused_in_one_line(tmp_path, pair):
    target, draft = pair
    dspark.save(draft, tmp_path, target_name="t")
    for other in (tiny_target("llama", layers=2), tiny_target("llama", vocab=CHAR_VOCAB + 4)):
        with pytest.raises(ValueError) as err:
            dspark.load(tmp_path, other)
        message = str(err.value)
        assert "\n" not in message and message.startswith(f"DSpark draft {str(tmp_path)!r}")
        assert "pass the target it was trained on" in message or "layer outputs" in message


def test_the_recipe_keys_of_a_dspark_draft_are_checked():
    from distill.config import DraftConfig, RecipeError

    DraftConfig(kind="dspark", markov_rank=16, confidence_min=0.0)
    DraftConfig(kind="dspark", confidence_min=1.0)
    with pytest.raises(RecipeError, match=r"^draft.confidence_min: must be in \[0, 1\].*got 1.5$"):
        DraftConfig(kind="dspark", confidence_min=1.5)
    with pytest.raises(RecipeError, match=r"^draft.markov_rank: must be >= 1"):
        DraftConfig(kind="dspark", markov_rank=0)
    for key, value in (("markov_rank", 16), ("confidence_min", 0.3)):
        with pytest.raises(RecipeError, match=rf"^draft.{key}: belongs to draft.kind=dspark, not draft.kind=dflash"):
            DraftConfig(kind="dflash", **{key: value})


def test_a_bad_dspark_key_is_one_error_line_from_train_distill(tmp_path):
    from tests.procs import run_distill

    recipe = {"target": {"model": str(tmp_path / "absent")}, "draft": {"kind": "eagle3", "confidence_min": 0.3},
              "output_dir": str(tmp_path / "run")}  # fmt: skip
    proc = run_distill(recipe, tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: draft.confidence_min: belongs to draft.kind=dspark")
    assert not (tmp_path / "run").exists()


def test_train_distill_trains_and_saves_a_dspark_draft(tmp_path):
    """Two steps of train/distill.py (in this process) on a tiny target with drawn anchors: its checkpoint is a
    DSpark folder that loads back with the recipe's rank and cut."""
    import yaml

    from tests.procs import load_script
    from tests.test_eagle3_train import head_recipe
    from tests.tiny import make_pair, make_prompts

    target, _ = make_pair(tmp_path / "assets")
    assets = {
        "target": target,
        "train": make_prompts(tmp_path / "train.jsonl", 8, seed=1),
        "eval": make_prompts(tmp_path / "eval.jsonl", 2, seed=2),
    }
    out = tmp_path / "run"
    draft = {"kind": "dspark", "vocab_subset": 0, "block_size": 3, "markov_rank": 4, "confidence_min": 0.1}
    recipe = head_recipe(
        assets, out, draft=draft, distill={"anchors": 4}, train={"max_steps": 2},
        eval={"every": 2, "num_prompts": 2}, log={"report_to": "none"},
    )  # fmt: skip
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    load_script("train/distill.py").main(["--recipe", str(path)])
    report = json.loads((out / "report.json").read_text())
    assert [c["step"] for c in report["checkpoints"]] == [0, 2]
    folder = out / "best"
    assert dspark.is_dspark_folder(folder), sorted(p.name for p in out.iterdir())
    loaded = dspark.load(folder, _target(target))
    assert loaded.markov_rank == 4 and loaded.confidence_min == pytest.approx(0.1)


def _target(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def test_bench_cli_measures_a_saved_dspark_folder_and_refuses_hf(tmp_path, pair):
    """``python -m decode bench --draft DSPARK_FOLDER``: the folder is read as a DSpark draft (its kind, its block,
    the target it was made for), greedy output equals target-only, HF assisted generation is refused in one line."""
    from decode.__main__ import main
    from tests.tiny import char_tokenizer, make_prompts

    target, draft = pair
    target.save_pretrained(tmp_path / "target")
    char_tokenizer().save_pretrained(tmp_path / "target")
    dspark.save(draft, tmp_path / "draft", target_name="t")
    prompts = make_prompts(tmp_path / "p.jsonl", 2, chars=12)
    argv = ["bench", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--prompts",
            str(prompts), "--repeats", "1", "--dtype", "float32", "--no-progress",
            "--max-new-tokens", "12"]  # fmt: skip
    out = tmp_path / "bench.json"
    assert main([*argv, "--num-draft-tokens", str(BLOCK), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["draft_kind"] == "dspark" and result["outputs_match_target"] is True
    assert result["tokens_per_s"]["hf_assisted"] is None and len(result["per_position_acceptance"]) == BLOCK
    assert result["mean_num_draft_tokens"] > 0 and result["draft_cost_ratio"] > 0
    assert main([*argv, "--baselines", "target,hf"]) == 2
    assert main([*argv, "--num-draft-tokens", str(BLOCK + 1)]) == 2  # above its block: refused before loading
