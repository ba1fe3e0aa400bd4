"""The EAGLE-3 draft kind in draftsmith's decoder: its training unroll is its decoding path, greedy output equals
target-only for every architecture and batch shape, sampling follows the target's distribution, and the served
checkpoint round-trips."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from decode.kinds.dispatch import kind_of
from decode.kinds.eagle3 import decoding as eagle3
from decode.speculative import speculative_generate, target_generate
from tests.decode_helpers import SAMPLED_ALPHA, SAMPLED_VOCAB, left_pad, sampled_p_value
from tests.tiny import CHAR_VOCAB, tiny_config

EAGLE_ARCHS = ("llama", "qwen2", "mistral", "gemma2")


def tiny_target(arch: str = "llama", vocab: int = CHAR_VOCAB, layers: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    config = tiny_config(arch, vocab, layers=layers, special_id=None)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def features_of(target, ids: torch.Tensor, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(target logits [B, S, V], aux features [B, S, 3H]) of one plain forward."""
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    return out.logits, torch.cat([out.hidden_states[i] for i in layers], -1)


def fit_head(target, draft_ids, steps: int = 60, seed: int = 0) -> eagle3.Eagle3Head:
    """A head fitted for a few steps to the target's greedy continuations (so it accepts some, not all, tokens)."""
    head = eagle3.build(target, draft_ids)
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, target.config.vocab_size, (8, 6), generator=gen)
    ids = torch.cat([prompts, torch.tensor(target_generate(target, prompts, max_new_tokens=26).new_tokens)], 1)
    logits, features = features_of(target, ids, head.aux_layers)
    # Teacher over the draft vocabulary, at position i + k + 1 for step k.
    teacher = logits[..., head.draft_ids].softmax(-1)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    valid = torch.ones_like(ids, dtype=torch.bool)
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        out = head.unrolled(ids, features, positions, valid, steps=2)
        loss = 0.0
        for k, step_logits in enumerate(out):
            mask = eagle3.step_mask(valid, k)
            target_p = torch.cat([teacher[:, k + 1 :], torch.zeros_like(teacher[:, : k + 1])], 1)
            loss = loss - (target_p * step_logits.log_softmax(-1)).sum(-1)[mask].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


@pytest.fixture(scope="module")
def llama_pair():
    target = tiny_target("llama")
    return target, fit_head(target, range(0, CHAR_VOCAB - 7))


def test_unrolled_training_is_the_decoding_path():
    """Step k of the training unroll at position p gives the logits of the k-th chained draft forward from p."""
    target = tiny_target("llama")
    head = eagle3.build(target, range(0, CHAR_VOCAB, 2))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    ids = torch.randint(0, CHAR_VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    _, features = features_of(target, ids, head.aux_layers)
    positions = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        unrolled = head.unrolled(ids, features, positions, torch.ones_like(ids, dtype=torch.bool), steps=3)
        cache = eagle3.Eagle3Cache(2, torch.device("cpu"))
        p = 6
        real = torch.ones(2, p + 1, dtype=torch.bool)
        logits, prenorm = head(
            eagle3.shift_left(ids, 1)[:, : p + 1], features[:, : p + 1], cache.positions(real), cache, fused=True
        )
        torch.testing.assert_close(logits, unrolled[0][:, : p + 1], atol=1e-5, rtol=1e-5)
        hidden = prenorm[:, -1:]
        for k in (1, 2):
            one = torch.ones(2, 1, dtype=torch.bool)
            logits, hidden = head(ids[:, p + k + 1 : p + k + 2], hidden, cache.positions(one), cache, fused=False)
            torch.testing.assert_close(logits[:, -1], unrolled[k][:, p], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", EAGLE_ARCHS)
def test_greedy_equals_target_only_every_architecture(arch):
    target = tiny_target(arch)
    head = fit_head(target, range(CHAR_VOCAB), steps=80)
    assert kind_of(head) == "eagle3"
    prompt = torch.randint(0, CHAR_VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    want = target_generate(target, prompt, max_new_tokens=40, eos_token_id=[]).new_tokens
    accepted = 0
    for gamma in (1, 3, "auto"):
        out = speculative_generate(target, head, prompt, max_new_tokens=40, num_draft_tokens=gamma, eos_token_id=[])
        assert out.new_tokens == want, (arch, gamma)
        accepted += out.stats.accepted
    assert accepted > 0  # the fitted head does propose accepted tokens: the accept paths are exercised


def test_greedy_batch_with_left_padding_equals_each_row_alone(llama_pair):
    target, head = llama_pair
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, CHAR_VOCAB, (n,), generator=gen) for n in (3, 9, 6, 1)]
    ids, mask = left_pad(prompts)
    out = speculative_generate(target, head, ids, mask, max_new_tokens=30, num_draft_tokens=4, eos_token_id=[])
    for row, prompt in enumerate(prompts):
        alone = target_generate(target, prompt[None], max_new_tokens=30, eos_token_id=[]).new_tokens[0]
        assert out.new_tokens[row] == alone
    s = out.stats
    assert 0 < s.accepted < s.drafted  # rows accept different numbers of tokens: holes in both caches


def test_rows_finishing_early_and_eos(llama_pair):
    target, head = llama_pair
    ids, mask = left_pad([torch.tensor([4, 5, 6]), torch.tensor([7, 8, 9, 10, 11])])
    eos = target_generate(target, ids[:1, -3:], max_new_tokens=5, eos_token_id=[]).new_tokens[0][3]
    out = speculative_generate(target, head, ids, mask, max_new_tokens=24, num_draft_tokens=3, eos_token_id=eos)
    ref = target_generate(target, ids, mask, max_new_tokens=24, eos_token_id=eos)
    assert out.new_tokens == ref.new_tokens
    assert out.new_tokens[0][-1] == eos and len(out.new_tokens[0]) <= 4


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_draft_vocabulary_is_all_it_proposes(monkeypatch, temperature):
    """Greedy or sampling, the decoder never proposes a token outside the head's draft vocabulary: every token
    the drafter hands the target (recorded as it returns them) is in it, for a head over every other id whose
    layers were scaled up so that it would propose all kinds of tokens (its logits span about -6..6)."""
    target = tiny_target("llama")
    head = eagle3.build(target, range(0, CHAR_VOCAB, 2))
    with torch.no_grad():  # a fresh head at std 0.02 proposes one token everywhere
        for name, p in head.named_parameters():
            if not name.startswith("lm_head."):
                p.mul_(10.0)
    proposed: list[torch.Tensor] = []
    propose = eagle3.Drafter.propose

    def recording(self, *args, **kwargs):
        tokens, q = propose(self, *args, **kwargs)
        proposed.append(tokens.flatten())
        return tokens, q

    monkeypatch.setattr(eagle3.Drafter, "propose", recording)
    prompt = torch.randint(0, CHAR_VOCAB, (16, 5), generator=torch.Generator().manual_seed(9))
    speculative_generate(target, head, prompt, max_new_tokens=12, num_draft_tokens=3, temperature=temperature,
                         eos_token_id=[], generator=torch.Generator().manual_seed(0))  # fmt: skip
    tokens = torch.cat(proposed)
    assert len(tokens) >= 200 and len(set(tokens.tolist())) >= 10  # many proposals, of many tokens
    assert set(tokens.tolist()) <= set(head.draft_ids.tolist()), sorted(set(tokens.tolist()) - set(range(0, 97, 2)))


# ---------------------------------------------------------------------------------------------------------------
# Sampling follows the target's distribution (chi-square, with a negative control)
# ---------------------------------------------------------------------------------------------------------------
SV, ALPHA = SAMPLED_VOCAB, SAMPLED_ALPHA


def sharp_target() -> torch.nn.Module:
    """tiny_target over SV tokens with a sharper head: the draft's q differs from p, and rejections happen."""
    target = tiny_target("llama", vocab=SV, layers=4, seed=1)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    return target


def _sampled_p_value(temperature: float) -> tuple[float, object]:
    target = sharp_target()
    head = eagle3.build(target, [0, 1, 3])  # a draft vocabulary without token 2
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.5)
    return sampled_p_value(target, head, temperature, 2)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_follows_target_distribution(temperature):
    p_value, stats = _sampled_p_value(temperature)
    assert 0 < stats.accepted < stats.drafted  # both accept and reject paths ran
    assert p_value > ALPHA


def test_sampling_negative_control_fails(monkeypatch):
    from decode import acceptance
    from tests.decode_helpers import accept_always

    monkeypatch.setattr(acceptance, "accept_sampled", accept_always)
    assert _sampled_p_value(1.0)[0] < ALPHA


# ---------------------------------------------------------------------------------------------------------------
# The served checkpoint
# ---------------------------------------------------------------------------------------------------------------
def test_save_load_round_trip_in_the_served_layout(tmp_path, llama_pair):
    target, head = llama_pair
    eagle3.save(head, tmp_path)
    assert eagle3.is_eagle3(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == len(head.draft_ids)
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # 4 layers: (2, L//2, L-3) would repeat 2
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert not any(k.startswith("embed_tokens") for k in tensors)
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight"} <= set(tensors)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * config["hidden_size"]
    assert torch.equal(torch.arange(len(head.draft_ids)) + tensors["d2t"], head.draft_ids)
    assert int(tensors["t2d"].sum()) == len(head.draft_ids)
    loaded = eagle3.load(tmp_path, target)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    a = speculative_generate(target, head, prompt, max_new_tokens=16, num_draft_tokens=3, eos_token_id=[])
    b = speculative_generate(target, loaded, prompt, max_new_tokens=16, num_draft_tokens=3, eos_token_id=[])
    assert a.stats.per_position_accepted == b.stats.per_position_accepted and a.new_tokens == b.new_tokens


def test_a_head_folder_says_what_it_is_and_how_to_load_it(tmp_path, llama_pair):
    """A head folder (a checkpoint, best/) holds a README.md and config.json's draftsmith.about: an EAGLE-3 head,
    not a model AutoModelForCausalLM loads (it cannot), served by vLLM / SGLang, loaded by eagle3.load."""
    target, head = llama_pair
    eagle3.save(head, tmp_path, target_name="org/target")
    readme = (tmp_path / "README.md").read_text()
    assert readme.startswith("# EAGLE-3 draft head\n\n" + eagle3.ABOUT)
    assert "Trained with draftsmith for the target `org/target`" in readme and "[1, 2, 3]" in readme
    assert "Nor can `AutoModelForCausalLM.from_pretrained` load it" in readme
    assert "vllm serve org/target --speculative-config" in readme and '"method": "eagle3"' in readme
    assert "--speculative-algorithm EAGLE3" in readme
    assert 'head = eagle3.load("PATH/TO/THIS/FOLDER", target)' in readme
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["draftsmith"] == {"draft_kind": "eagle3", "about": eagle3.ABOUT}
    with pytest.raises(Exception):  # noqa: B017 - what the README says: transformers cannot load the folder
        AutoModelForCausalLM.from_pretrained(tmp_path)
    assert eagle3.load(tmp_path, target).aux_layers == head.aux_layers


def test_a_head_over_the_whole_vocabulary_is_saved_without_d2t(tmp_path, llama_pair):
    """vLLM makes no d2t parameter for a head whose draft vocabulary is the target's and refuses the tensor."""
    from safetensors.torch import load_file, save_file

    target, _ = llama_pair
    torch.manual_seed(0)
    head = eagle3.build(target, range(97))
    eagle3.save(head, tmp_path / "full")
    assert not {"d2t", "t2d"} & set(load_file(str(tmp_path / "full" / "model.safetensors")))
    loaded = eagle3.load(tmp_path / "full", target)
    assert torch.equal(loaded.draft_ids, torch.arange(97))
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    a = speculative_generate(target, head, prompt, max_new_tokens=12, num_draft_tokens=3, eos_token_id=[])
    b = speculative_generate(target, loaded, prompt, max_new_tokens=12, num_draft_tokens=3, eos_token_id=[])
    assert a.new_tokens == b.new_tokens and a.stats.per_position_accepted == b.stats.per_position_accepted
    eagle3.save(eagle3.build(target, range(0, 97, 2)), tmp_path / "subset")
    tensors = load_file(str(tmp_path / "subset" / "model.safetensors"))
    tensors.pop("d2t")
    save_file(tensors, str(tmp_path / "subset" / "model.safetensors"))
    with pytest.raises(ValueError, match="draft vocabulary of 49 of 97 tokens but no d2t"):
        eagle3.load(tmp_path / "subset", target)


def test_bad_heads_and_layer_ids(tmp_path, llama_pair):
    target, head = llama_pair
    for bad in ([1, 2, 9], [1, 2], [2, 2, 3], [3, 2, 1], [1, 2, 4]):
        with pytest.raises(ValueError, match=r"not 3 distinct rising ids among the target's layers 0\.\.3"):
            eagle3.build(target, range(10), aux_layers=bad)
    assert eagle3.default_aux_layers(30) == [2, 15, 27] and eagle3.default_aux_layers(3) == [0, 1, 2]
    with pytest.raises(ValueError, match="not in 1..97"):
        eagle3.head_config(target, 98)
    other = tiny_target("llama", vocab=50)
    eagle3.save(head, tmp_path)
    with pytest.raises(ValueError, match="pass the target it was trained on"):
        eagle3.load(tmp_path, other)


def test_a_head_config_without_aux_ids_and_sharded_weights_loads_as_vllm_loads_it(tmp_path):
    """A head exported elsewhere: config.json without eagle_aux_hidden_state_layer_ids (vLLM then reads the target's
    layers (2, L//2, L-3)) and its tensors in two safetensors shards listed by model.safetensors.index.json."""
    from safetensors.torch import load_file, save_file

    target = tiny_target("llama", layers=8)
    torch.manual_seed(0)
    head = eagle3.build(target, range(0, 97, 3))
    eagle3.save(head, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("eagle_aux_hidden_state_layer_ids", "eagle_config"):
        config.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file), metadata={"format": "pt"})
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    loaded = eagle3.load(tmp_path, target)
    assert loaded.aux_layers == eagle3.default_aux_layers(8) == [2, 4, 5]
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in head.state_dict().items())
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    a = speculative_generate(target, head, prompt, max_new_tokens=12, num_draft_tokens=3, eos_token_id=[])
    b = speculative_generate(target, loaded, prompt, max_new_tokens=12, num_draft_tokens=3, eos_token_id=[])
    assert a.new_tokens == b.new_tokens and a.stats.per_position_accepted == b.stats.per_position_accepted


def test_docs_give_the_aux_ids_check_aux_layers_accepts():
    """docs/eagle3.md's draft.aux_layers row and the recipe key's help name the range check_aux_layers enforces:
    0..L-1, the last layer's output (id L) refused."""
    from pathlib import Path

    from distill.config import DraftConfig

    assert eagle3.check_aux_layers([0, 4, 7], 8) == [0, 4, 7]
    with pytest.raises(ValueError, match=r"0\.\.7"):
        eagle3.check_aux_layers([2, 4, 8], 8)
    docs = (Path(__file__).resolve().parent.parent / "docs" / "eagle3.md").read_text()
    row = next(line for line in docs.splitlines() if line.startswith("| `draft.aux_layers`"))
    assert "0..L-1" in row and "L, the last layer's output, is refused" in row
    help_text = DraftConfig.__dataclass_fields__["aux_layers"].metadata["help"]
    assert "0..L-1" in help_text and "L = the last" not in help_text


# ---------------------------------------------------------------------------------------------------------------
# The bench and its CLI
# ---------------------------------------------------------------------------------------------------------------
def bench_argv(tmp_path, target, head, num_prompts: int, *extra: str) -> list[str]:
    """`decode bench` arguments for the pair saved under tmp_path (the target with a character tokenizer), float32,
    one repeat, over ``num_prompts`` 20-character prompts."""
    from tests.tiny import char_tokenizer, make_prompts

    target.save_pretrained(tmp_path / "target")
    char_tokenizer().save_pretrained(tmp_path / "target")
    eagle3.save(head, tmp_path / "head")
    prompts = make_prompts(tmp_path / "p.jsonl", num_prompts, chars=20)
    return ["bench", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "head"),
            "--prompts", str(prompts), "--repeats", "1", "--dtype", "float32", "--no-progress", *extra]  # fmt: skip


def test_bench_cli_measures_an_eagle3_head_and_refuses_hf(tmp_path, llama_pair):
    from decode.__main__ import main

    target, head = llama_pair
    out = tmp_path / "bench.json"
    argv = bench_argv(tmp_path, target, head, 3, "--max-new-tokens", "16", "--num-draft-tokens", "3")
    assert main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["draft_kind"] == "eagle3" and result["draft_vocab_size"] == len(head.draft_ids)
    assert result["outputs_match_target"] is True and result["tokens_per_s"]["hf_assisted"] is None
    assert 0 < result["acceptance_rate"] < 1 and 0 < result["draft_cost_ratio"] < 1
    assert main([*argv, "--baselines", "target,hf"]) == 2
