"""Rollout sources on real tiny models: fixed, target (speculative, cached), draft (on-policy, LoRA), mix."""

import json

import pytest
import torch

from decode import kernels
from distill.config import DataConfig, DistillConfig, LoraConfig, ModelConfig, QuantConfig
from distill.data import rollouts
from distill.data.prompts import Example, collate_training, encode_examples
from distill.data.rollouts import (
    RolloutCache,
    RolloutSource,
    choose_source,
    make_rollouts,
    pregenerate_target_rollouts,
    target_cache_settings,
)
from distill.models import load_draft, load_target, load_tokenizer
from tests.tiny import SNIPPETS, bpe_tokenizer, tiny_llama

PROMPTS = ["def f(x):", "hello world, the", "import os\nprint(", "the quick brown fox jumps over", "x"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Target padded 64 rows past the tokenizer (like Qwen2.5), draft at the tokenizer's size; id 0 = eos = pad."""
    root = tmp_path_factory.mktemp("pair")
    tok = bpe_tokenizer(300, SNIPPETS, bos_token=None, pad_token=None)
    for name, vocab, seed in (("target", len(tok) + 64, 1), ("draft", len(tok), 2)):
        model = tiny_llama(vocab, seed)
        with torch.no_grad():
            model.lm_head.weight[0] -= 1.0  # rarely EOS, so greedy continuations have some length
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root


@pytest.fixture(scope="module")
def models(pair):
    tok = load_tokenizer(str(pair / "target"))
    target = load_target(ModelConfig(model=str(pair / "target")), device="cpu")
    lora = LoraConfig(enabled=True, r=4, alpha=8, dropout=0.0)
    draft = load_draft(ModelConfig(model=str(pair / "draft"), lora=lora), device="cpu")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in draft.named_parameters():
            if "lora_B" in n:  # a LoRA that changes the draft's outputs: generation must go through it
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    examples = encode_examples([{"prompt": p} for p in PROMPTS], tok, DataConfig(), 128, 8)
    return tok, target, draft, examples


def _greedy(model, prompt_ids, max_new_tokens, vocab):
    """Reference: HF generate on one unpadded prompt, cut after the first EOS.

    Ids past the tokenizer (the target's padded embedding rows) are suppressed: the decoder works on the shared
    vocabulary. (A trained model never predicts them; these random ones do.)
    """
    width = model.get_output_embeddings().weight.shape[0]
    suppress = list(range(vocab, width)) or None
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            top_k=None,
            top_p=None,
            pad_token_id=0,
            eos_token_id=0,
            suppress_tokens=suppress,
        )[0, len(prompt_ids) :].tolist()
    return out[: out.index(0) + 1] if 0 in out else out


def _cfg(**kw) -> DistillConfig:
    return DistillConfig(**{"max_new_tokens": 8, "gen_temperature": 0.0, **kw})


def test_choose_source_mix_is_seeded():
    assert choose_source("target", 0.5) == "target" and choose_source("fixed", 1.0) == "fixed"
    assert {choose_source("mix", 0.0, torch.Generator().manual_seed(i)) for i in range(20)} == {"target"}
    assert {choose_source("mix", 1.0, torch.Generator().manual_seed(i)) for i in range(20)} == {"draft"}
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    draws = [choose_source("mix", 0.3, g1) for _ in range(400)]
    assert draws == [choose_source("mix", 0.3, g2) for _ in range(400)]
    assert 0.22 < draws.count("draft") / 400 < 0.38
    with pytest.raises(ValueError, match="not one of"):
        choose_source("teacher", 0.5)


def test_fixed_source():
    examples = [Example(0, [1, 2], [3, 0]), Example(1, [4], [5])]
    pairs = make_rollouts(examples, "fixed", None, None, _cfg(), eos_token_id=0, pad_token_id=0)
    assert pairs == [([1, 2], [3, 0]), ([4], [5])]
    with pytest.raises(ValueError, match="needs reference completions"):
        make_rollouts([Example(0, [1])], "fixed", None, None, _cfg(), eos_token_id=0, pad_token_id=0)


def test_draft_on_policy_goes_through_lora_and_restores_train_mode(models):
    tok, target, draft, examples = models
    draft.train()
    pairs = make_rollouts(examples, "draft", target, draft, _cfg(), eos_token_id=0, pad_token_id=0)
    assert draft.training  # back in train mode for the optimizer step
    for (prompt, completion), example in zip(pairs, examples):
        assert prompt == example.prompt_ids
        assert completion == _greedy(draft, example.prompt_ids, 8, len(tok))  # batched + KV cache == one by one
    with draft.disable_adapter():
        base = [_greedy(draft, e.prompt_ids, 8, len(tok)) for e in examples]
    assert base != [c for _, c in pairs]  # the adapter changed what the draft generates


def test_draft_sampling_is_seeded(models):
    tok, target, draft, examples = models
    cfg = _cfg(gen_temperature=1.0)

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return make_rollouts(examples, "draft", target, draft, cfg, eos_token_id=0, pad_token_id=0, generator=g)

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_target_rollouts_are_the_targets_and_cached(models, tmp_path, monkeypatch):
    tok, target, draft, examples = models
    cfg = _cfg()
    cache = RolloutCache(tmp_path, target_cache_settings(target, cfg, seed=0))
    kw = {"eos_token_id": 0, "pad_token_id": 0, "vocab": len(tok)}  # the width target and draft share
    pairs = make_rollouts(examples, "target", target, draft, cfg, cache=cache, **kw)
    for (_, completion), example in zip(pairs, examples):
        assert completion == _greedy(target, example.prompt_ids, 8, len(tok))  # speculative decoding is lossless
    assert len(cache) == len(examples)

    # a new cache object on the same directory (next epoch, resumed run) serves them without generating
    def boom(*a, **k):
        raise AssertionError("generated although cached")

    monkeypatch.setattr(rollouts, "generate_target_rollouts", boom)
    again = RolloutCache(tmp_path, target_cache_settings(target, cfg, seed=0))
    assert make_rollouts(examples, "target", target, draft, cfg, cache=again, **kw) == pairs
    monkeypatch.undo()

    # other settings or another tokenisation of the same prompt index: not reused
    other = RolloutCache(tmp_path, target_cache_settings(target, _cfg(max_new_tokens=4), seed=0))
    assert len(other) == 0 and other.key != cache.key
    changed = Example(examples[0].index, examples[0].prompt_ids[1:])
    assert again.get(changed) is None and again.get(examples[0]) == pairs[0][1]

    # partly cached: the cached ones are served, the rest generated, the batch order kept
    part = RolloutCache(tmp_path / "part", target_cache_settings(target, cfg, seed=0))
    part.put([examples[2]], [[7, 0]])
    mixed = make_rollouts(examples, "target", target, draft, cfg, cache=part, **kw)
    assert [c for _, c in mixed] == [c if i != 2 else [7, 0] for i, (_, c) in enumerate(pairs)]
    assert len(part) == len(examples)


def test_target_rollouts_with_gamma_0_use_the_target_alone(models, monkeypatch):
    """distill.num_draft_tokens=0: the target's own continuations, without a single draft forward."""
    tok, target, draft, examples = models

    def no_draft(*a, **k):
        raise AssertionError("the draft ran although num_draft_tokens=0")

    monkeypatch.setattr(draft, "forward", no_draft)
    pairs = make_rollouts(
        examples, "target", target, draft, _cfg(), eos_token_id=0, pad_token_id=0, num_draft_tokens=0, vocab=len(tok)
    )
    for (_, completion), example in zip(pairs, examples):
        assert completion == _greedy(target, example.prompt_ids, 8, len(tok))


def test_cache_survives_a_torn_line(tmp_path):
    cache = RolloutCache(tmp_path, {"a": 1})
    cache.put([Example(0, [1, 2]), Example(1, [3])], [[4, 0], [5]])
    with cache.path.open("a") as f:
        f.write('{"index": 2, "prompt": "ab')  # killed mid-write
    reread = RolloutCache(tmp_path, {"a": 1})
    assert len(reread) == 2 and reread.get(Example(1, [3])) == [5]
    assert json.loads((tmp_path / f"target-{cache.key}.settings.json").read_text()) == {"a": 1}


def test_mix_uses_both_sources(models, tmp_path):
    tok, target, draft, examples = models
    source = RolloutSource(_cfg(source="mix", mix_lambda=0.5), target, tok, cache_dir=tmp_path, vocab=len(tok))
    g = torch.Generator().manual_seed(0)
    seen = {}
    for _ in range(8):
        pairs = source.sample(examples[:2], draft, g)
        seen[source.last_source] = pairs
    assert set(seen) == {"draft", "target"}
    assert seen["target"] == [(e.prompt_ids, _greedy(target, e.prompt_ids, 8, len(tok))) for e in examples[:2]]
    assert seen["draft"] == [(e.prompt_ids, _greedy(draft, e.prompt_ids, 8, len(tok))) for e in examples[:2]]


class FakeAccelerator:
    def __init__(self, rank, world):
        self.process_index, self.num_processes, self.is_main_process = rank, world, rank == 0

    def wait_for_everyone(self):
        pass


def test_pregenerate_shards_across_processes(models, tmp_path):
    tok, target, draft, examples = models
    cfg = _cfg(gen_temperature=1.0)
    settings = target_cache_settings(target, cfg, seed=0)
    caches = [RolloutCache(tmp_path, settings, process_index=r) for r in (0, 1)]
    common = {"eos_token_id": 0, "pad_token_id": 0, "batch_size": 2, "progress": False, "vocab": len(tok)}
    n1 = pregenerate_target_rollouts(
        examples, target, draft, cfg, caches[1], accelerator=FakeAccelerator(1, 2), **common
    )
    n0 = pregenerate_target_rollouts(
        examples, target, draft, cfg, caches[0], accelerator=FakeAccelerator(0, 2), **common
    )
    assert (n0, n1) == (3, 2)  # 5 prompts, interleaved
    assert not any(m in kernels._COPIES for m in target.modules())  # no packed target weights kept after it
    assert sorted(p.name for p in tmp_path.glob("*.jsonl")) == [f"target-{caches[0].key}-p{r}.jsonl" for r in (0, 1)]
    caches[1].reload()
    for cache in caches:
        assert all(cache.get(e) for e in examples)
    assert pregenerate_target_rollouts(examples, target, draft, cfg, caches[0], **common) == 0  # nothing left


def test_pregenerate_reports_each_batch_of_its_share(models, tmp_path):
    # what distill.training.schedule.GenerationWatch projects the generation's minutes from
    tok, target, draft, examples = models
    cfg = _cfg(source="target")
    source = RolloutSource(cfg, target, tok, cache_dir=tmp_path, vocab=len(tok))
    calls: list[tuple[int, int]] = []
    made = source.pregenerate(examples, draft, batch_size=2, progress=False, on_batch=lambda *a: calls.append(a))
    assert made == 5 and calls == [(2, 5), (4, 5), (5, 5)]
    calls.clear()
    assert source.pregenerate(examples, draft, batch_size=2, on_batch=lambda *a: calls.append(a)) == 0
    assert calls == []  # all cached: nothing generated, nothing to report


def test_rollout_source_without_cache(models, tmp_path):
    tok, target, draft, examples = models
    cfg = _cfg(source="target", cache_rollouts=False)
    source = RolloutSource(cfg, target, tok, cache_dir=tmp_path, vocab=len(tok))
    assert source.cache is None and source.pregenerate(examples, draft) == 0
    assert source.eos_token_id == [0] and source.pad_token_id == 0
    pairs = source.sample(examples[:1], draft, None)
    assert pairs[0][1] == _greedy(target, examples[0].prompt_ids, 8, len(tok))
    assert list(tmp_path.iterdir()) == []


def test_generated_eos_stays_in_the_loss(models):
    """pad == eos == 0: a completion that is just an EOS must still give one loss position."""
    tok, target, draft, examples = models
    eos_draft = tiny_llama(len(tok), 7)
    head = torch.nn.Linear(64, len(tok), bias=True)  # a draft that always says EOS first
    with torch.no_grad():
        head.weight.copy_(eos_draft.lm_head.weight)
        head.bias.zero_()
        head.bias[0] = 100.0
    eos_draft.lm_head = head
    pairs = make_rollouts(examples, "draft", target, eos_draft, _cfg(), eos_token_id=0, pad_token_id=0)
    assert all(c == [0] for _, c in pairs)
    batch = collate_training(pairs, pad_token_id=0)
    assert batch["loss_mask"].sum(1).tolist() == [1] * len(pairs)


def test_nf4_target_with_lora_draft(pair, models):
    """The recipe's seed setting: a 4-bit NF4 target (bf16 compute) verifies a LoRA draft's proposals."""
    tok, _, draft, examples = models
    quant = QuantConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype="bfloat16")
    target = load_target(ModelConfig(model=str(pair / "target"), quantization=quant), device="cpu")
    pairs = make_rollouts(
        examples[:3], "target", target, draft, _cfg(), eos_token_id=0, pad_token_id=0, vocab=len(tok)
    )
    for (prompt, completion), example in zip(pairs, examples):
        assert prompt == example.prompt_ids
        assert completion == _greedy(target, prompt, 8, len(tok))


def test_rollouts_never_sample_ids_the_draft_cannot_embed():
    """A target padded past the draft's width whose padding row dominates: target rollouts (speculative or the
    target alone) and the shared width keep every sampled id below the draft's width."""
    from tests.decode_helpers import VOCAB, FixedLogitLM, counter_lm, one_hot_logits

    def fn(ids, pos):
        logits = one_hot_logits(ids + 1, VOCAB + 8)
        logits[..., VOCAB + 3] += 40.0  # a padding row the target "prefers"
        return logits

    target, draft = FixedLogitLM(VOCAB + 8, fn), counter_lm(VOCAB)
    examples = [Example(0, [5, 6, 7]), Example(1, [9, 10])]
    kw = dict(eos_token_id=[], pad_token_id=0, generator=torch.Generator().manual_seed(0))
    cfg = DistillConfig(max_new_tokens=6, gen_temperature=1.0)
    unbounded = make_rollouts(examples, "target", target, None, cfg, **kw)
    assert any(t >= VOCAB for _, c in unbounded for t in c)  # without the shared width: padding ids
    for drafting in (None, draft):
        pairs = make_rollouts(examples, "target", target, drafting, cfg, vocab=VOCAB, **kw)
        assert all(t < VOCAB for _, c in pairs for t in c) and all(len(c) == 6 for _, c in pairs)
    source = RolloutSource(cfg, target, _IdsTokenizer(), vocab=VOCAB)
    assert all(t < VOCAB for _, c in source.sample(examples, draft, kw["generator"]) for t in c)


class _IdsTokenizer:
    pad_token_id = eos_token_id = 0
