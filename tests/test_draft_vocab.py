"""A draft that proposes from part of the vocabulary (decode.draft_vocab): still lossless, and what it reads."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from decode.__main__ import draft_vocab_ids
from decode.draft_vocab import (
    FILE,
    MARGIN,
    SubsetHead,
    frequent_ids,
    load_ids,
    save_ids,
    with_masked_head,
    with_subset_head,
)
from decode.sampling import process_logits
from decode.speculative import speculative_generate, target_generate
from tests.decode_helpers import bigram_lm, bigram_sequence_probs, chi_square_p_value
from tests.test_decode_sampling import ALPHA, FIRST, NEW, ROWS, V, _tables
from tests.tiny import tiny_llama


def test_frequent_ids_counts_ties_always_and_fills():
    lists = [[5, 5, 5, 7, 7, 9], [7, 3, 3]]  # 7: 3, 5: 3, 3: 2, 9: 1
    assert frequent_ids(lists, 2, vocab=12) == [5, 7]  # the tie 5/7 by count, both kept
    assert frequent_ids(lists, 3, vocab=12) == [3, 5, 7]
    assert frequent_ids(lists, 3, always=[11], vocab=12) == [5, 7, 11]  # always first, then the most frequent
    assert frequent_ids(lists, 6, vocab=12) == [0, 1, 3, 5, 7, 9]  # unseen ids fill in id order
    assert frequent_ids(lists, 50, vocab=12) == list(range(12))
    with pytest.raises(ValueError, match="at least one token"):
        frequent_ids(lists, 0, vocab=12)


def test_ids_file_round_trip_and_errors(tmp_path):
    assert load_ids(tmp_path) is None  # a checkpoint without one: the whole vocabulary
    save_ids(tmp_path, [1, 4, 9], vocab=16, source="test")
    assert load_ids(tmp_path) == [1, 4, 9] == load_ids(tmp_path / FILE)
    assert json.loads((tmp_path / FILE).read_text())["size"] == 3
    assert [p.name for p in tmp_path.iterdir()] == [FILE]  # no temp file left
    (tmp_path / FILE).write_text('{"ids": []}')
    with pytest.raises(ValueError, match="non-empty list"):
        load_ids(tmp_path)
    (tmp_path / FILE).write_text("not json")
    with pytest.raises(ValueError, match="not a draft vocabulary file"):
        load_ids(tmp_path)


def test_cli_value(tmp_path):
    assert draft_vocab_ids("full", str(tmp_path)) is None
    assert draft_vocab_ids("auto", str(tmp_path)) is None
    save_ids(tmp_path, [2, 3], vocab=8, source="test")
    assert draft_vocab_ids("auto", str(tmp_path)) == [2, 3]
    assert draft_vocab_ids("full", str(tmp_path)) is None
    assert draft_vocab_ids(str(tmp_path / FILE), "some/hub-id") == [2, 3]
    with pytest.raises(ValueError, match="no such file"):
        draft_vocab_ids(str(tmp_path / "missing.json"), str(tmp_path))


def test_subset_head_scores_only_its_rows_and_leaves_the_model_alone():
    model = tiny_llama(64, tie=True)
    ids = [0, 3, 10, 11, 40]
    view = with_subset_head(model, ids)
    x = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        full, part = model(x).logits, view(x).logits
    # the same rows of the same weight; a 5-row matmul may round differently from the 64-row one (AVX2 MKL)
    torch.testing.assert_close(part[..., ids], full[..., ids], rtol=1e-5, atol=1e-6)
    outside = torch.ones(64, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(part[..., outside]).all()
    assert isinstance(view.get_output_embeddings(), SubsetHead)
    assert not isinstance(model.get_output_embeddings(), SubsetHead)  # the original keeps its full head
    assert view.model is model.model  # the same layers, not a copy
    assert with_subset_head(model, None) is model
    with pytest.raises(ValueError, match="outside the draft's 64-token head"):
        with_subset_head(model, [3, 64])


def test_greedy_with_a_subset_draft_equals_target_greedy():
    target = tiny_llama(64, seed=0)
    draft = with_subset_head(tiny_llama(64, seed=1), list(range(0, 64, 2)))
    prompt = torch.tensor([[1, 7, 3, 9]])
    want = target_generate(target, prompt, max_new_tokens=24, eos_token_id=[]).new_tokens
    got = speculative_generate(target, draft, prompt, max_new_tokens=24, num_draft_tokens=3, eos_token_id=[])
    assert got.new_tokens == want
    assert any(t % 2 for t in want[0])  # the target wrote tokens the draft cannot propose


def test_sampling_with_a_subset_draft_follows_the_target():
    # What SubsetHead gives a sampler: the draft's logits are -inf outside its ids, so q is 0 there.
    target_table, draft_table = _tables()
    draft_table = draft_table.clone()
    draft_table[:, [0, 2]] = float("-inf")
    out = speculative_generate(
        bigram_lm(target_table), bigram_lm(draft_table), torch.full((ROWS, 1), FIRST), max_new_tokens=NEW,
        num_draft_tokens=2, temperature=1.0, eos_token_id=[], generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    expected = bigram_sequence_probs(target_table, FIRST, NEW, lambda x: process_logits(x, 1.0))
    assert chi_square_p_value(out.new_tokens, expected, V) > ALPHA
    assert any(t in (0, 2) for seq in out.new_tokens for t in seq)  # tokens the draft never proposes still occur


def test_draft_vocabulary_counts_continuations_else_prompts():
    from distill.data.prompts import Example, draft_vocabulary

    examples = [Example(0, [1, 1, 1, 2]), Example(1, [1, 3])]
    ids, where = draft_vocabulary(2, examples, [], vocab=10, always=[9])
    assert ids == [1, 9] and where == "2 training prompts"
    ids, where = draft_vocabulary(3, examples, [[4, 4, 5], [5, 5]], vocab=10, always=[9])
    assert ids == [4, 5, 9] and where == "2 training continuations"


@pytest.mark.slow
def test_a_run_drafts_from_its_vocabulary_and_saves_it(tmp_path):
    """draft.vocab_subset: every evaluation drafts from the ids, every checkpoint (best/ too) carries them, and the
    bench reads them from best/ by default."""
    from tests.procs import run_distill, tiny_recipe, tiny_run_paths

    out = tmp_path / "run"
    paths = tiny_run_paths(tmp_path)
    recipe = tiny_recipe(
        paths, out, {"source": "target", "max_new_tokens": 8}, {"max_steps": 2, "batch_size": 4},
        draft={"vocab_subset": 40},
    )  # fmt: skip
    proc = run_distill(recipe, tmp_path, OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "draft vocabulary: the 40 of" in proc.stdout and "8 training continuations" in proc.stdout
    ids = load_ids(out / "best")
    assert len(ids) == 40 and ids == load_ids(out / "checkpoints" / "step-2")
    for step in (0, 2):
        result = json.loads((out / "checkpoints" / f"step-{step}" / "eval.json").read_text())
        assert result["draft_vocab_size"] == 40
    # the checkpoint itself keeps its full head
    config = json.loads((out / "best" / "config.json").read_text())
    assert config["vocab_size"] > 40


def test_masked_head_saves_an_untied_head_scoring_only_the_subset(tmp_path, capsys):
    """A subset-trained draft as other engines load it: the subset's logits as trained, every other token one
    fitted row (equal logits), the input embeddings whole, the model it was made from unchanged (still tied), and
    the held-out measurement returned; an untrained draft's states do not hold the margin, which it warns of."""
    from transformers import AutoModelForCausalLM

    model = tiny_llama(32, tie=True)
    ids = [0, 3, 4, 9, 17, 31]
    text = torch.randint(0, 32, (40, 24), generator=torch.Generator().manual_seed(0)).tolist()
    view, report = with_masked_head(model, ids, text)
    view.save_pretrained(tmp_path)
    assert model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not loaded.config.tie_word_embeddings
    assert torch.equal(loaded.get_input_embeddings().weight, model.get_input_embeddings().weight)
    x = torch.tensor(text[1:5])  # fitted on (every fifth sequence is held out): the margin holds here
    with torch.no_grad():
        want, got = model(x).logits, loaded(x).logits
    others = [i for i in range(32) if i not in ids]
    torch.testing.assert_close(got[..., ids], want[..., ids])
    assert torch.equal(got[..., others], got[..., others[:1]].expand_as(got[..., others]))
    assert torch.equal(got.argmax(-1), with_subset_head(model, ids)(x).logits.argmax(-1))  # greedy unchanged
    assert report["heldout_positions"] == 8 * 24 and report["fit_positions"] == 32 * 24
    assert 0 < report["argmax_outside"] < 0.05 and report["outside_mass_max"] > 1e-3  # 768 random states, 64 dims
    assert "warning: the saved head puts up to 1 of its probability outside" in capsys.readouterr().err
    with pytest.raises(ValueError, match="linear layer"):
        with_masked_head(torch.nn.Module(), ids, text)
    with pytest.raises(ValueError, match="no text"):
        with_masked_head(model, ids, [])


def test_docs_describe_the_saved_head_as_with_masked_head_writes_it():
    """The pages, the recipe and distill.loss_vocab's help that describe a subset-trained draft's saved head say what
    with_masked_head does (the test above): its other rows are one fitted row MARGIN below the top trained logit, not
    zeroed or untrained rows."""
    from pathlib import Path

    from distill.config import DistillConfig

    root = Path(__file__).resolve().parent.parent
    pages = ("docs/engines.md", "docs/smollm2.md", "recipes/smollm2-135m-instruct_trunc2_fkl.yaml")
    texts = {name: (root / name).read_text() for name in pages}
    texts["distill.loss_vocab help"] = DistillConfig.__dataclass_fields__["loss_vocab"].metadata["help"]
    for name, raw in texts.items():
        text = " ".join(line.lstrip("# ") for line in raw.splitlines())
        text = " ".join(text.split())
        for false in ("rows zeroed", "rows are zero", "rows are zero,", "other rows zeroed", "rows stay untrained"):
            assert false not in text, (name, false)
        assert f"{MARGIN:g} below the top trained logit" in text, name


@pytest.mark.shared
def test_masked_head_proposes_from_the_draft_vocabulary_when_hf_samples(tmp_path):
    """The reference draft saved with a masked head for its 512 most frequent tokens, as HF assisted generation
    samples from it (temperature 1, no top-k): every token the assistant proposes is in the draft vocabulary, and
    its greedy token is the subset head's wherever the held-out text goes."""
    from transformers import AutoModelForCausalLM

    from decode.draft_vocab import final_states
    from tests.conftest import DEV_PROMPTS, PAIR, TRAIN_PROMPTS

    tok = AutoTokenizer.from_pretrained(PAIR / "draft")
    load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # noqa: E731
    draft, target = load(PAIR / "draft"), load(PAIR / "target")
    rows = lambda path, n: [json.loads(line)["prompt"] for line in path.read_text().splitlines()[:n]]  # noqa: E731
    text = [tok(p)["input_ids"][:128] for p in rows(TRAIN_PROMPTS, 300)]
    ids = frequent_ids(text, 512, always=[tok.eos_token_id], vocab=draft.config.vocab_size)
    view, report = with_masked_head(draft, ids, text)
    assert report["outside_mass_max"] < 1e-3 and report["argmax_outside"] == 0
    view.save_pretrained(tmp_path)
    assistant = load(tmp_path)
    proposed: list[int] = []
    generate = assistant.generate

    def recording(*args, **kwargs):
        out = generate(*args, **kwargs)
        proposed.extend(out.sequences[0, kwargs["input_ids"].shape[1] :].tolist())
        return out

    assistant.generate = recording
    torch.manual_seed(0)
    for prompt in rows(DEV_PROMPTS, 4):
        x = tok(prompt, return_tensors="pt")["input_ids"][:, -96:]
        target.generate(x, assistant_model=assistant, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=32)
    assert len(proposed) >= 50 and set(proposed) <= set(ids), sorted(set(proposed) - set(ids))[:10]
    held_out = [tok(p)["input_ids"][:128] for p in rows(DEV_PROMPTS, 20)]
    states = final_states(assistant, held_out, 4096)
    with torch.no_grad():
        saved, subset = assistant.lm_head(states), with_subset_head(draft, ids).lm_head(states)
    assert torch.equal(saved.argmax(-1), subset.argmax(-1))
