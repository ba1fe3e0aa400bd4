"""train/publish.py and distill.publishing (publish, with publish_source, card, hub and draft_folder) on a tiny
real run.

Offline, CPU, a few seconds.

The run directory is what train/distill.py writes (docs/run-directory.md): resolved_recipe.yaml, report.json, best/ (a
merged HF model + eval.json + tokenizer) and checkpoints/step-N/ (here a peft LoRA adapter + eval.json). The
target's vocabulary (64) is larger than the draft's (48), so publishing must pad the draft.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from distill.config import load_recipe, save_recipe
from distill.publishing import draft_folder, publish_source
from distill.publishing import publish as pub
from tests.tiny import tiny_llama, word_tokenizer

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "train" / "publish.py"
REPO_ID = "someone/tiny-draft"
WORDS = "the a of to and in is it for on with as def return import class self if else print x y".split()
DRAFT_VOCAB, TARGET_VOCAB = 48, 64

BEST = {
    "target": "TARGET",
    "draft": "best",
    "n_prompts": 12,
    "new_tokens": 32,
    "temperature": 0.0,
    "batch_size": 1,
    "num_draft_tokens": 4,
    "acceptance_rate": 0.65432,
    "mean_accepted_length": 2.8765,
    "per_position_acceptance": [0.81, 0.7, 0.6, 0.5],
    "mean_num_draft_tokens": 4.0,
    "draft_cost_ratio": 0.1543,
    "verify_cost_ratio": 1.31,
    "leviathan_bound": 2.01,
    "theoretical_speedup": 2.2222,
    "tokens_per_s": {"speculative": 123.456, "target": 67.89, "hf_assisted": 101.2},
    "speedup": {"vs_target": 1.8349, "vs_hf_assisted": 1.2199},
    "outputs_match_target": True,
    "prompts": "dev-prompts.jsonl",
    "hardware": "Test CPU (2 cores)",
}
BASE = {
    **BEST,
    "acceptance_rate": 0.4111,
    "mean_accepted_length": 1.9,
    "speedup": {"vs_target": 1.1, "vs_hf_assisted": None},
}


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level over a few words + 4 specials, padded with unused words to DRAFT_VOCAB entries."""
    words = WORDS + [f"w{i}" for i in range(DRAFT_VOCAB - 4 - len(WORDS))]
    specials = dict(pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return word_tokenizer([*specials.values(), *words], split="whitespace", **specials)


def llama(vocab: int, seed: int, tie: bool = False) -> torch.nn.Module:
    """A tiny Llama with the tokenizer's special ids and grouped-query attention (2 key/value heads)."""
    return tiny_llama(vocab, seed, tie=tie, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """target/, draft/ (base draft), run/ with best/, checkpoints/step-20/ (LoRA), report.json, recipe."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("publish")
    tok = tiny_tokenizer()
    target = llama(TARGET_VOCAB, seed=0)
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    draft = llama(DRAFT_VOCAB, seed=1, tie=True)
    draft.save_pretrained(root / "draft")
    tok.save_pretrained(root / "draft")

    run = root / "run"
    recipe = load_recipe(None, [f"target.model={root / 'target'}", f"draft.model={root / 'draft'}"])
    recipe.output_dir = str(run)
    recipe.data.eval_prompts = "dev-prompts.jsonl"
    recipe.draft.lora.enabled = True
    save_recipe(recipe, run)

    best = llama(DRAFT_VOCAB, seed=2, tie=True)  # stands in for the distilled, merged draft
    best.save_pretrained(run / "best")
    tok.save_pretrained(run / "best")
    (run / "best" / "eval.json").write_text(json.dumps(BEST))

    lora = get_peft_model(
        llama(DRAFT_VOCAB, seed=1, tie=True),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    lora.peft_config["default"].base_model_name_or_path = str(root / "draft")
    step = run / "checkpoints" / "step-20"
    lora.save_pretrained(step)
    auto = {k: v for k, v in BEST.items() if k not in ("prompts", "hardware")}
    (step / "eval.json").write_text(json.dumps({**auto, "num_draft_tokens": "auto", "mean_num_draft_tokens": 3.4}))

    report = {
        "base": BASE,
        "best": BEST,
        "best_step": 40,
        "checkpoints": [
            {"step": 20, "speedup": 1.5, "acceptance_rate": 0.55, "loss": 0.91},
            {"step": 40, "speedup": 1.8349, "acceptance_rate": 0.65432, "loss": 0.7},
        ],
    }
    (run / "report.json").write_text(json.dumps(report))
    return run


@pytest.fixture(scope="module")
def published(run_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dry") / "tiny-draft"
    assert pub.publish(run_dir, REPO_ID, dry_run_dir=out) == str(out)
    return out


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=full_env, cwd=REPO, timeout=120
    )


# ---------------------------------------------------------------- the dry-run folder


def test_dry_run_folder_contents(published, run_dir):
    names = {p.name for p in published.iterdir()}
    expected = {"config.json", "generation_config.json", "model.safetensors", "README.md", "draftsmith_eval.json"}
    assert expected | {"tokenizer.json", "tokenizer_config.json", "resolved_recipe.yaml"} <= names
    assert not [p for p in published.parent.iterdir() if p.name.startswith(".tmp-")]  # atomic: no leftovers

    config = json.loads((published / "config.json").read_text())
    assert config["vocab_size"] == TARGET_VOCAB  # padded from the draft's 48
    target_dir = Path(load_recipe(run_dir / "resolved_recipe.yaml").target.model)
    assert (published / "tokenizer.json").read_bytes() == (target_dir / "tokenizer.json").read_bytes()
    gen = json.loads((published / "generation_config.json").read_text())
    assert gen["num_assistant_tokens"] == 4 and gen["num_assistant_tokens_schedule"] == "constant"
    assert gen["assistant_confidence_threshold"] == 0.0  # HF drafts exactly gamma tokens, as measured
    assert (gen["eos_token_id"], gen["pad_token_id"], gen["bos_token_id"]) == (2, 0, 1)
    uploaded_recipe = yaml.safe_load((published / "resolved_recipe.yaml").read_text())
    # no local path, and no bare base name that would fail as a relative path: a placeholder names the input
    assert uploaded_recipe["target"]["model"] == "<your copy of target>" and uploaded_recipe["output_dir"] == "run"


def test_card_figures_equal_report(published, run_dir):
    report = json.loads((run_dir / "report.json").read_text())
    info = json.loads((published / "draftsmith_eval.json").read_text())
    assert info["best"] == report["best"] and info["base"] == report["base"]
    assert info["best_step"] == 40 and info["checkpoints"] == report["checkpoints"]
    assert info["num_assistant_tokens"] == 4 and info["vocab_size"] == {"draft": 48, "target": 64, "published": 64}

    card = (published / "README.md").read_text()
    meta = front_matter(card)
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert {"speculative-decoding", "draft-model"} <= set(meta["tags"])
    assert meta["target_model"] == info["target"]
    assert "base_model" not in meta  # the base draft is a local path here, not a Hub id
    # figures from report.json, formatted (acceptance 3 decimals, tau 2, speedups 2 + 'x')
    for text in ("| 0.411 | 0.654 |", "| 1.90 | 2.88 |", "| 1.10x | 1.83x |", "| n/a | 1.22x |", "| 123.5 |"):
        assert text in card, text
    assert "this draft (step 40)" in card and "0.810, 0.700, 0.600, 0.500" in card
    assert "hardware: Test CPU (2 cores)" in card and "prompts file: dev-prompts.jsonl" in card
    assert "temperature: 0.0; new tokens per prompt: 32; prompts: 12" in card
    assert "| 20 | 1.50x | 0.550 | 0.9100 |" in card  # evaluations during training
    recipe_block = card.split("```yaml\n")[1].split("```")[0]
    assert yaml.safe_load(recipe_block) == yaml.safe_load((published / "resolved_recipe.yaml").read_text())
    # usage snippets with the repo id, the target and gamma filled in
    target = info["target"]
    assert f'AutoModelForCausalLM.from_pretrained("{REPO_ID}"' in card and "assistant_model=draft" in card
    spec = f'{{"method": "draft_model", "model": "{REPO_ID}", "num_speculative_tokens": 4, ' \
        '"draft_sample_method": "probabilistic"}'  # fmt: skip
    assert f"vllm serve {target} --speculative-config '{spec}'" in card
    assert f'LLM(model="{target}", speculative_config={spec})' in card
    assert f"--model-path {target}" in card and "--prompts dev-prompts.jsonl --num-draft-tokens 4" in card
    assert f"--speculative-algorithm STANDALONE --speculative-draft-model-path {REPO_ID}" in card


def test_published_draft_assists_target_losslessly(published, run_dir):
    recipe = load_recipe(run_dir / "resolved_recipe.yaml")
    target = AutoModelForCausalLM.from_pretrained(recipe.target.model).eval()
    draft = AutoModelForCausalLM.from_pretrained(published).eval()
    original = AutoModelForCausalLM.from_pretrained(run_dir / "best").eval()
    assert draft.config.vocab_size == target.config.vocab_size == TARGET_VOCAB
    assert draft.generation_config.num_assistant_tokens == 4

    ids = torch.tensor([[1, 5, 9, 14, 7, 22]])
    with torch.no_grad():
        logits, before = draft(ids).logits, original(ids).logits
    torch.testing.assert_close(logits[..., :DRAFT_VOCAB], before)  # padding changes no real token's logit
    assert int(logits.argmax(-1).max()) < DRAFT_VOCAB  # padded rows (the mean row) never win

    plain = target.generate(ids, do_sample=False, max_new_tokens=16, min_new_tokens=16)
    assisted = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=16, min_new_tokens=16)
    assert torch.equal(plain, assisted)


def test_lora_checkpoint_is_merged(run_dir, tmp_path, caplog):
    from peft import PeftModel

    out = tmp_path / "from-lora"
    with caplog.at_level("WARNING", logger="draftsmith.publish"):
        pub.publish(run_dir / "checkpoints" / "step-20", REPO_ID, dry_run_dir=out)
    assert "padded from 48 to the target's 64" in caplog.text
    assert not (out / "adapter_config.json").exists()
    info = json.loads((out / "draftsmith_eval.json").read_text())
    assert info["best_step"] == 20 and info["checkpoint"] == "checkpoints/step-20"
    assert info["num_assistant_tokens"] == 3  # 'auto': round(mean_num_draft_tokens = 3.4)
    assert info["base"] == json.loads((run_dir / "report.json").read_text())["base"]
    assert "recorded at publish time" in info["hardware"]  # the eval did not record its hardware
    assert "LoRA r=16, merged" in info["method"]

    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    base_dir = Path(load_recipe(run_dir / "resolved_recipe.yaml").draft.model)
    with_adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir), run_dir / "checkpoints" / "step-20"
    )
    plain_base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    ids = torch.tensor([[1, 6, 8, 10, 12]])
    with torch.no_grad():
        got, want, unadapted = merged(ids).logits, with_adapter.eval()(ids).logits, plain_base(ids).logits
    torch.testing.assert_close(got[..., :DRAFT_VOCAB], want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(want, unadapted, atol=1e-3)  # the adapter is not a no-op, so merging was tested
    # the eval drafted with 'auto' and did not time HF: HF's adaptive length (transformers' defaults) is published
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["num_assistant_tokens"] == 20 and gen["assistant_confidence_threshold"] == 0.4
    assert "adaptive length ('auto')" in (out / "README.md").read_text()


def test_checkpoint_without_recipe_uses_eval_json(run_dir, tmp_path):
    """A bare checkpoint dir (no run dir around it): the target comes from eval.json, with a note in the card."""
    import shutil

    lone = tmp_path / "lone"
    shutil.copytree(run_dir / "best", lone)
    recipe = load_recipe(run_dir / "resolved_recipe.yaml")
    (lone / "eval.json").write_text(json.dumps({**BEST, "target": recipe.target.model}))
    out = pub.publish(lone, REPO_ID, dry_run_dir=tmp_path / "out")
    info = json.loads((Path(out) / "draftsmith_eval.json").read_text())
    assert info["target"] == Path(recipe.target.model).name and info["best_step"] is None  # no local path
    assert any("no resolved_recipe.yaml" in n for n in info["notes"])
    assert "The recipe was not found" in (Path(out) / "README.md").read_text()


def test_fp32_draft_is_published_in_its_base_dtype(run_dir, tmp_path):
    """A fully fine-tuned draft (fp32 master weights) goes out in the dtype its base draft declares."""
    import shutil

    base = tmp_path / "bf16-base"
    config = llama(DRAFT_VOCAB, seed=0, tie=True).config
    config.dtype = torch.bfloat16
    config.save_pretrained(base)  # the config is all publish reads of the base
    ckpt = tmp_path / "run" / "checkpoints" / "step-7"
    shutil.copytree(run_dir / "best", ckpt)
    recipe = load_recipe(run_dir / "resolved_recipe.yaml", [f"draft.model={base}", "draft.lora.enabled=false"])
    save_recipe(recipe, tmp_path / "run")
    out = Path(pub.publish(ckpt, REPO_ID, dry_run_dir=tmp_path / "out"))
    published = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert published.dtype == torch.bfloat16
    info = json.loads((out / "draftsmith_eval.json").read_text())
    assert info["best_step"] == 7 and "full fine-tune" in info["method"]
    assert any("cast from float32 to bfloat16" in n for n in info["notes"])


def test_unreachable_target_falls_back_to_the_draft(run_dir, tmp_path, caplog):
    """Offline with a Hub-id target: the draft's vocab and tokenizer are kept, each with one warning and a note."""
    import shutil

    ckpt = tmp_path / "run" / "best"
    shutil.copytree(run_dir / "best", ckpt)
    save_recipe(load_recipe(run_dir / "resolved_recipe.yaml", ["target.model=google/gemma-2-9b-it"]), ckpt.parent)
    with caplog.at_level("WARNING", logger="draftsmith.publish"):
        out = Path(pub.publish(ckpt, REPO_ID, dry_run_dir=tmp_path / "out"))
    info = json.loads((out / "draftsmith_eval.json").read_text())
    assert info["vocab_size"] == {"draft": DRAFT_VOCAB, "target": None, "published": DRAFT_VOCAB}
    assert info["tokenizer_from"] == "draft" and len(info["notes"]) == 2
    assert (out / "tokenizer.json").read_bytes() == (run_dir / "best" / "tokenizer.json").read_bytes()
    assert "could not be loaded" in caplog.text
    card = (out / "README.md").read_text()
    assert front_matter(card)["target_model"] == "google/gemma-2-9b-it" and "vllm serve google/gemma-2-9b-it" in card


def test_failed_build_leaves_nothing(run_dir, tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("card failed")

    monkeypatch.setattr(pub, "render_model_card", boom)
    with pytest.raises(RuntimeError, match="card failed"):
        pub.publish(run_dir, REPO_ID, dry_run_dir=tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- pieces


def test_card_front_matter_with_hub_ids():
    info = {
        "target": "google/gemma-2-9b-it",
        "base_model": "google/gemma-2-2b-it",
        "checkpoint": "best",
        "best_step": 300,
        "method": "fkl distillation on target sequences, LoRA r=16, merged",
        "num_assistant_tokens": 5,
        "hardware": "1 x NVIDIA H100 80GB HBM3",
        "prompts": "HuggingFaceH4/ultrachat_200k",
        "best": {**BEST, "num_draft_tokens": 5},
        "base": None,
    }
    card = pub.render_model_card(info, "me/gemma-2-2b-it-draft")
    meta = front_matter(card)
    assert meta["base_model"] == "google/gemma-2-2b-it" and meta["base_model_relation"] == "finetune"
    assert meta["target_model"] == "google/gemma-2-9b-it"
    assert meta["tags"] == ["speculative-decoding", "draft-model", "draftsmith"]
    assert "vllm serve google/gemma-2-9b-it" in card and '"num_speculative_tokens": 5' in card
    assert "--speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6" in card
    assert "base draft |" not in card and "| this draft (step 300) |" in card  # no base figures: one column
    assert "| 0.654 |" in card
    assert "draft_vocab.json" not in card
    info["best"] = {**info["best"], "draft_vocab_size": 8192}
    card = pub.render_model_card(info, "me/gemma-2-2b-it-draft")
    assert "drafted from the 8192 tokens of a draft vocabulary" in card and "draft_vocab.json" not in card
    info["draft_vocab_file"] = True  # the card cites the file only where it is uploaded
    card = pub.render_model_card(info, "me/gemma-2-2b-it-draft")
    assert "drafted from the 8192 tokens of `draft_vocab.json` (in this repo)" in card
    assert "trained over those tokens alone" not in card
    head = {"margin": 30.0, "heldout_positions": 4096, "outside_mass_mean": 7e-13, "outside_mass_max": 1e-9,
            "argmax_outside": 0.0, "fit_positions": 16384}  # fmt: skip
    card = pub.render_model_card({**info, "masked_head": head}, "me/gemma-2-2b-it-draft")
    assert "puts 7.0e-13 of the draft's probability outside those tokens at temperature 1" in card
    assert "(at most 1.0e-09 at one position)" in card and "draft from the same tokens, sampled or greedy" in card
    card = pub.render_model_card({**info, "masked_head": {**head, "outside_mass_max": 0.2}}, "me/gemma-2-2b-it-draft")
    assert "so those engines can draft other tokens" in card


def test_qlora_card_columns_say_what_each_measured():
    """A re-measured QLoRA draft: the base's figures are training-time ones (4-bit base, eval.num_prompts prompts),
    the upload's are merged weights on fewer prompts. The card sets the training-time figures of both side by side
    and labels every column with what it measured, never base-at-4-bit beside best-merged unlabelled."""
    trained = {**BEST, "acceptance_rate": 0.5}
    uploaded = {**BEST, "n_prompts": 8, "acceptance_rate": 0.6}
    info = {
        "target": "t/t", "base_model": "b/b", "checkpoint": "best", "best_step": 30, "method": "QLoRA r=16, merged",
        "num_assistant_tokens": 4, "hardware": "cpu", "prompts": "p.jsonl", "best": uploaded, "base": BASE,
        "training_eval": trained, "training_measured_on": "the 4-bit base with unmerged LoRA adapters (QLoRA)",
    }  # fmt: skip
    card = pub.render_model_card(info, "me/x")
    during = "training-time eval on the 4-bit base with unmerged LoRA adapters (QLoRA), 12 prompts"
    header = (
        f"| | base draft ({during}) | this draft (step 30; {during}) "
        "| this draft (as uploaded: merged, re-measured at publish time, 8 prompts) |"
    )
    assert header in card
    assert "| acceptance rate (accepted / drafted tokens) | 0.411 | 0.500 | 0.600 |" in card
    # measured alike (no QLoRA): the plain two columns
    plain = {k: v for k, v in info.items() if k not in ("training_eval", "training_measured_on")}
    assert "| | base draft | this draft (step 30) |" in pub.render_model_card({**plain, "best": trained}, "me/x")


@pytest.mark.parametrize(
    "repo_id",
    [
        *("me/gemma-eagle-draft", "me/EAGLE3-x", "me/qwen-dflash", "me/DSpark", "me/llama-medusa"),
        *("me/x-mlp_speculator", "me/deepseek-mtp-draft", "noslash", "a/b/c", "me/x--y", ""),
    ],
)
def test_bad_repo_ids(repo_id):
    with pytest.raises(pub.PublishError):
        publish_source.check_repo_id(repo_id)


def test_good_repo_id():
    publish_source.check_repo_id("me/gemma-2-2b-it-draft_v1.0")


@pytest.mark.parametrize(
    "ev, gamma", [({"num_draft_tokens": 6}, 6), ({"num_draft_tokens": "auto", "mean_num_draft_tokens": 2.6}, 3)]
)
def test_best_gamma(ev, gamma):
    assert pub.best_gamma(ev) == gamma


def test_assistant_settings_without_hf_timing_follow_the_eval_draft_length():
    """No HF figures in the eval: an adaptive eval publishes HF's adaptive (confidence-threshold) defaults, a fixed
    gamma publishes that gamma; with HF figures the faster measured setting wins whatever the eval's gamma."""
    from decode.bench import HF_ASSISTED_DEFAULTS

    settings, why = draft_folder.assistant_settings({"num_draft_tokens": "auto", "mean_num_draft_tokens": 2.1}, 2)
    assert settings == HF_ASSISTED_DEFAULTS and "adaptive" in why
    settings, why = draft_folder.assistant_settings({"num_draft_tokens": 3}, 3)
    assert settings["num_assistant_tokens"] == 3 and settings["assistant_confidence_threshold"] == 0.0
    timed = {"num_draft_tokens": "auto", "tokens_per_s": {"hf_assisted": 10.0, "hf_assisted_published": 12.0}}
    settings, why = draft_folder.assistant_settings(timed, 2)
    assert settings["num_assistant_tokens"] == 2 and "12.0 tokens/s" in why


def test_match_vocab_pads_with_mean_rows_and_truncates():
    model = llama(DRAFT_VOCAB, seed=3)  # untied lm_head
    head = model.lm_head.weight.detach().clone()
    pub.match_vocab(model, 56)
    assert model.config.vocab_size == 56 and model.lm_head.weight.shape[0] == 56
    torch.testing.assert_close(model.lm_head.weight[:DRAFT_VOCAB], head)
    torch.testing.assert_close(model.lm_head.weight[DRAFT_VOCAB:], head.mean(0).expand(8, -1))
    pub.match_vocab(model, 40)
    assert model.get_input_embeddings().weight.shape[0] == 40 and model.config.vocab_size == 40


# ---------------------------------------------------------------- errors (CLI: one line, exit 2) and the push path


def test_cli_errors(run_dir, tmp_path):
    bare = tmp_path / "bare-run"
    (bare / "best").mkdir(parents=True)
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    cases = [
        ([str(tmp_path / "missing"), "--repo-id", REPO_ID, "--dry-run", str(tmp_path / "o1")], "not a directory"),
        ([str(bare), "--repo-id", REPO_ID, "--dry-run", str(tmp_path / "o2")], "no report.json"),
        ([str(tmp_path), "--repo-id", REPO_ID, "--dry-run", str(tmp_path / "o3")], "no eval.json or report.json"),
        ([str(run_dir), "--repo-id", "me/llama-eagle3", "--dry-run", str(tmp_path / "o4")], "'eagle"),
        ([str(run_dir), "--repo-id", "no-namespace", "--dry-run", str(tmp_path / "o5")], "malformed"),
        ([str(run_dir), "--repo-id", REPO_ID, "--dry-run", str(full)], "not empty"),
        ([str(run_dir), "--repo-id", REPO_ID], "offline"),
    ]
    for args, expected in cases:
        proc = run_cli(*args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (args, proc.stderr)
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], (args, proc.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare-run", "full"]  # nothing written


@pytest.mark.parametrize("ships", ["draft", "target"])
def test_cli_runs_shipped_code_only_with_trust_remote_code(run_dir, tmp_path, ships):
    """A checkpoint (or the target its recipe names) whose config.json has auto_map, with a recipe saying
    trust_remote_code: true: publish refuses it without --trust-remote-code (its code never imported, nothing
    written); with the flag it publishes, running that code."""
    from tests.tiny import ship_code

    recipe_path = run_dir / "resolved_recipe.yaml"
    ckpt = Path(shutil.copytree(run_dir / "best", tmp_path / "run" / "best"))
    overrides = ["draft.trust_remote_code=true", "target.trust_remote_code=true"]
    if ships == "target":
        target = shutil.copytree(load_recipe(recipe_path).target.model, tmp_path / "target")
        overrides.append(f"target.model={ship_code(target)}")
    else:
        ship_code(ckpt)
    save_recipe(load_recipe(recipe_path, overrides), ckpt.parent)
    marker, out = tmp_path / "IMPORTED", tmp_path / "out"
    env = {"SHIPPED_CODE_MARKER": str(marker)}
    proc = run_cli(str(ckpt), "--repo-id", REPO_ID, "--dry-run", str(out), env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: the {ships} "), proc.stderr
    assert "auto_map in its config.json" in lines[0] and "--trust-remote-code" in lines[0]
    assert not marker.exists() and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["run", *(["target"] if ships == "target" else [])])
    if ships == "target":
        return
    proc = run_cli(str(ckpt), "--repo-id", REPO_ID, "--dry-run", str(out), "--trust-remote-code", env=env)
    assert proc.returncode == 0, proc.stderr
    assert marker.read_text() == "imported" and (out / "model.safetensors").is_file()


def test_cli_not_logged_in(run_dir, tmp_path):
    """Online but without a token: stops at whoami, before building or uploading (no network is touched)."""
    env = {"HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": ""}
    proc = run_cli(str(run_dir), "--repo-id", REPO_ID, env=env)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: not logged in to the Hugging Face Hub: set HF_TOKEN or run `hf auth login`"
    ]


@pytest.fixture
def online(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")


def test_unauthorised_token_is_one_error(online, run_dir, monkeypatch):
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    def refuse(self, *a, **k):
        response = httpx2.Response(401, request=httpx2.Request("GET", "https://huggingface.co/api/whoami-v2"))
        raise HfHubHTTPError("401 Client Error: Unauthorized", response=response)

    monkeypatch.setattr(HfApi, "whoami", refuse)
    with pytest.raises(pub.PublishError, match="refused the token \\(HTTP 401\\)"):
        pub.publish(run_dir, REPO_ID)


def test_push_uploads_the_folder(online, run_dir, monkeypatch):
    from huggingface_hub import HfApi, RepoUrl

    calls = {}
    monkeypatch.setattr(HfApi, "whoami", lambda self, *a, **k: {"name": "someone"})
    monkeypatch.setattr(
        HfApi,
        "create_repo",
        lambda self, repo_id, **k: calls.update(repo=(repo_id, k)) or RepoUrl(f"https://huggingface.co/{repo_id}"),
    )
    monkeypatch.setattr(HfApi, "create_branch", lambda self, repo_id, **k: calls.update(branch=k["branch"]))

    def upload_folder(self, **k):
        calls["upload"] = k
        calls["files"] = sorted(p.name for p in Path(k["folder_path"]).iterdir())

    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    url = pub.publish(run_dir, REPO_ID, private=True, revision="v1", commit_message="first draft")
    assert url == f"https://huggingface.co/{REPO_ID}/tree/v1"
    assert calls["repo"] == (REPO_ID, {"private": True, "exist_ok": True, "repo_type": "model"})
    assert calls["branch"] == "v1" and calls["upload"]["revision"] == "v1"
    assert calls["upload"]["repo_id"] == REPO_ID and calls["upload"]["commit_message"] == "first draft"
    assert {"README.md", "model.safetensors", "draftsmith_eval.json", "generation_config.json"} <= set(calls["files"])
    assert not Path(calls["upload"]["folder_path"]).exists()  # the staging folder is cleaned up


# ---------------------------------------------------------------- the card as the Hub reads it, no local paths


def uploaded_texts(folder: Path) -> dict[str, str]:
    """Every uploaded file but the weights, as text."""
    return {p.name: p.read_text() for p in folder.iterdir() if p.suffix != ".safetensors"}


def test_card_parses_back_with_figures_in_model_index(published):
    from huggingface_hub import ModelCard

    data = ModelCard.load(published / "README.md").data
    assert data.library_name == "transformers" and data.pipeline_tag == "text-generation"
    assert data.model_name == "tiny-draft" and data.to_dict()["target_model"] == "target"
    figures = {(r.metric_config, r.metric_name): r.metric_value for r in data.eval_results}
    assert figures[("draftsmith", "speedup vs target-only (draftsmith)")] == 1.8349
    assert figures[("draftsmith", "acceptance rate (draftsmith)")] == 0.6543
    assert figures[("draftsmith", "tokens/s HF assisted generation (transformers defaults)")] == 101.2
    assert all(r.task_type == "text-generation" and r.dataset_name == "dev-prompts.jsonl" for r in data.eval_results)
    assert {r.dataset_type for r in data.eval_results} == {"local"}  # a local prompt file, not a Hub dataset
    model_index = front_matter((published / "README.md").read_text())["model-index"]
    assert model_index[0]["name"] == "tiny-draft" and len(model_index[0]["results"][0]["metrics"]) == 6


def test_no_local_path_is_uploaded(published, run_dir):
    """The target, base draft, output_dir and prompt paths of this machine appear only as base names."""
    root = str(run_dir.parent)
    texts = uploaded_texts(published)
    assert {"README.md", "draftsmith_eval.json", "resolved_recipe.yaml", "config.json"} <= set(texts)
    for name, text in texts.items():
        assert root not in text and "/tmp/" not in text and "pytest-of" not in text, name
    info = json.loads(texts["draftsmith_eval.json"])
    assert (info["target"], info["base_model"], info["base_model_hub_id"]) == ("target", "draft", None)


@pytest.mark.parametrize(
    "text, want",
    [
        ("model: /home/me/models/target", "model: target"),
        ("the target's (/data/x/run/best/) could not", "the target's (best) could not"),
        ("prompts: ~/data/dev.jsonl", "prompts: dev.jsonl"),
        (
            "google/gemma-2-9b-it and https://huggingface.co/a/b stay",
            "google/gemma-2-9b-it and https://huggingface.co/a/b stay",
        ),
        ("runs/x/best and 1/2 stay", "runs/x/best and 1/2 stay"),
        ("model: /home/Jane Doe/models/t", "model: t"),
        ("target: '/Users/Jane van Doe/My Models/t' loaded", "target: 't' loaded"),
        ("/home/jane/t could not be loaded", "t could not be loaded"),
        ("model: C:\\Users\\Jane Doe\\models\\t", "model: t"),
        ("model: C:/Users/Jane Doe/models/t", "model: t"),
        ("share: \\\\server\\Jane Doe\\t, done", "share: t, done"),
    ],
)
def test_scrub_text(text, want):
    assert publish_source.scrub_text(text) == want


@pytest.mark.parametrize("path", ["/home/Jane Doe/models/t", "C:\\Users\\Jane Doe\\models\\t", "~/t/"])
def test_public_name_of_a_local_path_is_its_base_name(path):
    assert publish_source.public_name(path) == "t"


def test_license_and_hub_datasets_in_metadata(run_dir, tmp_path):
    from huggingface_hub import ModelCard

    ckpt = tmp_path / "run" / "best"
    shutil.copytree(run_dir / "best", ckpt)
    recipe = load_recipe(run_dir / "resolved_recipe.yaml", ["data.train_prompts=HuggingFaceH4/ultrachat_200k"])
    recipe.data.eval_prompts = ""
    save_recipe(recipe, ckpt.parent)
    out = Path(pub.publish(ckpt, REPO_ID, dry_run_dir=tmp_path / "out", license="apache-2.0"))
    data = ModelCard.load(out / "README.md").data
    assert data.license == "apache-2.0" and data.datasets == ["HuggingFaceH4/ultrachat_200k"]


# ---------------------------------------------------------------- every engine's figures


def test_card_states_every_engine(run_dir, tmp_path):
    """eval.json (draftsmith, with HF assisted as defaults and as published) and eval_vllm.json both reach the card,
    with the vLLM functions its bench replaced."""
    from huggingface_hub import ModelCard

    ckpt = tmp_path / "run" / "best"
    shutil.copytree(run_dir / "best", ckpt)
    shutil.copy(run_dir / "resolved_recipe.yaml", ckpt.parent)
    settings = {
        "defaults": {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant"},
        "published": {"num_assistant_tokens": 4, "assistant_confidence_threshold": 0.0},
    }
    ev = {
        **BEST,
        "engine": "draftsmith",
        "engine_version": "0.1.0",
        "tokens_per_s": {**BEST["tokens_per_s"], "hf_assisted_published": 111.1},
        "speedup": {**BEST["speedup"], "vs_target_ci95": [1.7, 1.95], "vs_hf_assisted_published": 1.1112},
        "hf_assisted_settings": settings,
    }
    (ckpt / "eval.json").write_text(json.dumps(ev))
    vllm = {**BEST, "engine": "vllm", "engine_version": "0.11.0", "acceptance_rate": 0.61, "hardware": "1 x H200",
            "engine_patches": ["vllm.v1.sample.rejection_sampler.expand_batch_to_tokens"]}  # fmt: skip
    vllm["speedup"] = {"vs_target": 2.41, "vs_hf_assisted": None}
    (ckpt / "eval_vllm.json").write_text(json.dumps(vllm))
    out = Path(pub.publish(ckpt, REPO_ID, dry_run_dir=tmp_path / "out"))
    card = (out / "README.md").read_text()
    assert "| speedup vs target-only decoding | 1.83x (95% CI 1.70-1.95x) |" in card
    assert "| tokens/s: HF assisted generation (the measured γ, constant) | 111.1 |" in card
    assert "| speedup vs HF assisted generation (the measured γ, constant) | 1.11x |" in card
    # the measured gamma timed faster than transformers' defaults (111.1 vs 101.2 tokens/s): it is published
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["num_assistant_tokens"], gen["assistant_confidence_threshold"]) == (4, 0.0)
    assert "the faster HF setting in the eval: 111.1 tokens/s with γ 4 constant against 101.2" in card
    assert f"HF assisted generation settings (published): `{json.dumps(settings['published'])}`" in card
    assert (
        "### vLLM" in card
        and "measured by vllm 0.11.0" in card
        and "| speedup vs target-only decoding | 2.41x |" in card
    )
    assert "- vllm 0.11.0 computes `vllm.v1.sample.rejection_sampler.expand_batch_to_tokens` wrong" in card
    figures = {
        (r.metric_config, r.metric_name): r.metric_value for r in ModelCard.load(out / "README.md").data.eval_results
    }
    assert figures[("vllm", "speedup vs target-only (vllm)")] == 2.41
    assert figures[("draftsmith", "tokens/s HF assisted generation (the measured γ, constant)")] == 111.1
    assert json.loads((out / "draftsmith_eval.json").read_text())["engines"]["vllm"]["acceptance_rate"] == 0.61


# ---------------------------------------------------------------- configs vLLM would not load as a draft model


@pytest.mark.parametrize(
    "config",
    [
        {"architectures": ["EagleLlamaForCausalLM"], "model_type": "llama"},
        {"architectures": ["Eagle3LlamaForCausalLM"]},
        {"architectures": ["MedusaModel"]},
        {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator"},
        {"architectures": ["DeepSeekMTPModel"], "model_type": "deepseek_mtp"},
        {"model_type": "eagle"},
    ],
)
def test_speculator_configs_are_refused(config):
    with pytest.raises(pub.PublishError, match="speculator kind"):
        publish_source.check_plain_draft_config(config)


def test_plain_configs_pass():
    for config in ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, {"model_type": "qwen3"}):
        publish_source.check_plain_draft_config(config)


def test_speculator_checkpoint_is_refused_before_anything_is_written(run_dir, tmp_path):
    ckpt = tmp_path / "run" / "best"
    shutil.copytree(run_dir / "best", ckpt)
    shutil.copy(run_dir / "resolved_recipe.yaml", ckpt.parent)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "architectures": ["EagleLlamaForCausalLM"]}))
    proc = run_cli(str(ckpt), "--repo-id", REPO_ID, "--dry-run", str(tmp_path / "out"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "EagleLlamaForCausalLM" in proc.stderr and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- QLoRA: the figures must describe the upload

QLORA_EVAL = {**BEST, "acceptance_rate": 0.123456, "hardware": "4-bit eval"}  # stands in for the 4-bit eval


@pytest.fixture(scope="module")
def qlora_run(run_dir, tmp_path_factory) -> Path:
    """A real QLoRA draft (bitsandbytes 4-bit base + non-zero LoRA) saved as train/distill.py saves best/."""
    from distill import models

    root = tmp_path_factory.mktemp("qlora")
    prompts = root / "dev-prompts.jsonl"
    lines = ["def return import class self", "the a of to and in", "if x else y print x", "for x in y return x"]
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in lines))
    overrides = [
        "draft.quantization.load_in_4bit=true",
        "draft.quantization.bnb_4bit_compute_dtype=float32",
        f"data.eval_prompts={prompts}",
        "eval.max_new_tokens=8",
        "eval.repeats=1",
        "eval.num_draft_tokens=3",
    ]
    recipe = load_recipe(run_dir / "resolved_recipe.yaml", overrides)
    recipe.output_dir = str(root / "run")
    draft = models.load_draft(recipe.draft, device="cpu")
    torch.manual_seed(5)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)  # a trained adapter: merging it changes the weights
    run = root / "run"
    save_recipe(recipe, run)
    models.save_draft(draft, run / "best", tiny_tokenizer())
    (run / "best" / "eval.json").write_text(json.dumps(QLORA_EVAL))
    (run / "report.json").write_text(json.dumps({"base": BASE, "best": QLORA_EVAL, "best_step": 10}))
    return run


def test_qlora_draft_is_remeasured_on_the_merged_upload(qlora_run, tmp_path, caplog):
    from decode.bench import run_bench
    from distill import models

    with caplog.at_level("WARNING", logger="draftsmith.publish"):
        out = Path(pub.publish(qlora_run, REPO_ID, dry_run_dir=tmp_path / "out"))
    assert "re-measuring the merged draft on 4 eval prompts" in caplog.text
    info = json.loads((out / "draftsmith_eval.json").read_text())
    assert info["training_eval"] == QLORA_EVAL and info["measured_on_uploaded_weights"] is True
    best = info["best"]
    assert best["engine"] == "draftsmith" and best["n_prompts"] == 4 and best["new_tokens"] == 8
    assert best["num_draft_tokens"] == 4 == info["num_assistant_tokens"]  # the checkpoint's gamma, not the recipe's 3
    assert best["outputs_match_target"] is True and best["acceptance_rate"] != QLORA_EVAL["acceptance_rate"]
    assert "QLoRA r=16, merged" in info["method"]
    # The acceptance is the uploaded folder's own: greedy acceptance is deterministic, so a fresh bench agrees.
    recipe = load_recipe(qlora_run / "resolved_recipe.yaml")
    target = models.load_target(recipe.target, device="cpu")
    uploaded = AutoModelForCausalLM.from_pretrained(out).eval()
    prompts = [json.loads(line) for line in Path(recipe.data.eval_prompts).read_text().splitlines()]
    again = run_bench(
        target, uploaded, models.load_tokenizer(recipe.target.model), prompts, target_name="t", draft_name="d",
        max_new_tokens=8, num_draft_tokens=4, repeats=1, baselines=("target",), progress=False,
    )  # fmt: skip
    assert again["acceptance_rate"] == best["acceptance_rate"]
    card = (out / "README.md").read_text()
    assert "re-measured at publish time on the uploaded merged weights (4 eval prompts)" in card
    # base and this draft side by side as training measured both; the upload's own figure in its own column
    assert f"| acceptance rate (accepted / drafted tokens) | 0.411 | 0.123 | {best['acceptance_rate']:.3f} |" in card
    assert "| this draft (as uploaded: merged, re-measured at publish time, 4 prompts) |" in card
    for name, text in uploaded_texts(out).items():  # the re-measured figures name no local path either
        assert str(qlora_run.parent) not in text and "/tmp/" not in text, name


def test_qlora_no_remeasure_says_so(qlora_run, tmp_path):
    proc = run_cli(str(qlora_run), "--repo-id", REPO_ID, "--dry-run", str(tmp_path / "out"), "--no-remeasure")
    assert proc.returncode == 0, proc.stderr
    info = json.loads((tmp_path / "out" / "draftsmith_eval.json").read_text())
    assert info["best"] == QLORA_EVAL and info["measured_on_uploaded_weights"] is False
    card = (tmp_path / "out" / "README.md").read_text()
    assert "was measured on the 4-bit base with unmerged LoRA adapters (QLoRA), not on the uploaded" in card
    # both columns are the training-time evals, and say so
    during = "training-time eval on the 4-bit base with unmerged LoRA adapters (QLoRA), 12 prompts"
    assert f"| | base draft ({during}) | this draft (step 10; {during}) |" in card


def test_qlora_without_eval_prompts_is_refused(qlora_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(qlora_run, run)
    recipe = load_recipe(run / "resolved_recipe.yaml", [f"data.eval_prompts={tmp_path / 'gone.jsonl'}"])
    save_recipe(recipe, run)
    with pytest.raises(pub.PublishError) as err:
        pub.publish(run, REPO_ID, dry_run_dir=tmp_path / "out")
    message = str(err.value)
    assert "\n" not in message and "gone.jsonl" in message and "--no-remeasure" in message
    assert "re-measures the merged draft" in message and str(tmp_path) not in message.split("(")[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing half-written


def test_a_weak_draft_publishes_the_faster_hf_defaults(run_dir, tmp_path):
    """When the eval timed transformers' default assistant settings faster than the measured gamma (a draft that
    accepts little), generation_config.json carries the defaults and the card says why."""
    ckpt = tmp_path / "run" / "best"
    shutil.copytree(run_dir / "best", ckpt)
    shutil.copy(run_dir / "resolved_recipe.yaml", ckpt.parent)
    ev = {
        **BEST,
        "tokens_per_s": {**BEST["tokens_per_s"], "hf_assisted": 20.5, "hf_assisted_published": 17.1},
        "hf_assisted_settings": {
            "defaults": {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant",
                         "assistant_confidence_threshold": 0.4},
            "published": {"num_assistant_tokens": 4, "num_assistant_tokens_schedule": "constant",
                          "assistant_confidence_threshold": 0.0},
        },
    }  # fmt: skip
    (ckpt / "eval.json").write_text(json.dumps(ev))
    out = Path(pub.publish(ckpt, REPO_ID, dry_run_dir=tmp_path / "out"))
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["num_assistant_tokens"], gen["num_assistant_tokens_schedule"]) == (20, "constant")
    assert gen["assistant_confidence_threshold"] == 0.4
    info = json.loads((out / "draftsmith_eval.json").read_text())
    assert info["num_assistant_tokens"] == 4  # the gamma vLLM / SGLang commands in the card use
    assert info["generation_config"]["assistant"] == ev["hf_assisted_settings"]["defaults"]
    card = (out / "README.md").read_text()
    assert (
        "transformers' defaults (20 tokens, confidence threshold 0.4), the faster HF setting in the eval: "
        "20.5 with transformers' defaults against 17.1 tokens/s with γ 4 constant" in card
    )


# ---------------------------------------------------------------------------------------------------------------
# An EAGLE-3 head: published in the served format
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eagle3_run(run_dir, tmp_path_factory) -> Path:
    """A run whose best/ is an EAGLE-3 head (eagle3.save) for run_dir's target, with its eval and recipe."""
    from decode.kinds.eagle3 import decoding as eagle3

    root = tmp_path_factory.mktemp("eagle3-publish")
    # run_dir's target with 4 layers: a head fuses 3 distinct layers below the last
    target_dir = root / "target"
    shutil.copytree(run_dir.parent / "target", target_dir)
    target = tiny_llama(
        TARGET_VOCAB, 0, layers=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0
    )
    target.save_pretrained(target_dir)
    run = root / "run"
    recipe = load_recipe(None, [f"target.model={target_dir}", f"draft.model={run_dir.parent / 'draft'}"])
    recipe.output_dir = str(run)
    save_recipe(recipe, run)
    head = eagle3.build(target, list(range(0, TARGET_VOCAB, 2)), aux_layers=[1, 2, 3])
    eagle3.save(head, run / "best", target_name=str(target_dir))
    best = {**BEST, "draft_kind": "eagle3", "draft_vocab_size": TARGET_VOCAB // 2}  # as the bench records a head
    (run / "best" / "eval.json").write_text(json.dumps(best))
    (run / "report.json").write_text(json.dumps({"best": best, "best_step": 40, "checkpoints": []}))
    return run


def test_eagle3_head_is_published_as_served(eagle3_run, tmp_path):
    """The head's own config.json and model.safetensors (no merge, no vocabulary change), the target's tokenizer,
    the recipe and a card with the vLLM and SGLang eagle3 launch lines; a repo name may say eagle3 (vLLM is told
    the method), and the card says HF assisted generation cannot run it."""
    out = tmp_path / "pub"
    repo = "someone/tiny-eagle3"
    assert pub.publish(eagle3_run, repo, dry_run_dir=out) == str(out)
    names = sorted(p.name for p in out.iterdir())
    assert {"config.json", "model.safetensors", "README.md", "draftsmith_eval.json", "resolved_recipe.yaml"} <= set(
        names
    )
    assert "tokenizer.json" in names and "generation_config.json" not in names
    for name in ("config.json", "model.safetensors"):
        assert (out / name).read_bytes() == (eagle3_run / "best" / name).read_bytes()
    card = (out / "README.md").read_text()
    gamma = BEST["num_draft_tokens"]
    spec = json.dumps({"method": "eagle3", "model": repo, "num_speculative_tokens": gamma,
                       "draft_sample_method": "probabilistic"})  # fmt: skip
    assert f"--speculative-config '{spec}'" in card
    assert "--speculative-algorithm EAGLE3" in card and f"--speculative-draft-model-path {repo}" in card
    assert f"--speculative-num-steps {gamma} " in card and f"--speculative-num-draft-tokens {gamma + 1}" in card
    assert "HF assisted generation (`generate(assistant_model=...)`) cannot run this kind" in card
    assert "assistant_model=draft" not in card and "draft_model" not in card
    info = json.loads((out / "draftsmith_eval.json").read_text())
    assert info["draft_kind"] == "eagle3" and info["best"]["acceptance_rate"] == BEST["acceptance_rate"]
    assert f"{BEST['acceptance_rate']:.3f}" in card


def test_an_eagle3_card_measured_with_a_tree_gives_the_tree_launch_lines():
    """SGLang and draftsmith draft the measured tree (SGLang counts the root among its draft tokens); vLLM drafts a
    chain as deep as the tree."""
    from decode.kinds.eagle3.publishing import head_usage as eagle3_usage

    text = "\n".join(eagle3_usage("org/target", "me/head", 4, "tree:3,4,8"))
    assert "--speculative-num-steps 4 \\" in text
    assert "--speculative-eagle-topk 3 --speculative-num-draft-tokens 9" in text
    assert '"num_speculative_tokens": 4' in text and "--num-draft-tokens tree:3,4,8" in text


def test_an_eagle3_card_says_what_the_head_drafts_from_and_how_to_load_it(eagle3_run, tmp_path):
    """The head has no full output layer and no draft_vocab.json: its lm_head is the draft vocabulary (d2t/t2d),
    which every engine drafts from. The card and the folder's config.json say it is not an AutoModelForCausalLM
    (which indeed cannot load it), and how vLLM, SGLang and draftsmith load it."""
    from decode.kinds.eagle3 import decoding as eagle3

    out = Path(pub.publish(eagle3_run, "someone/tiny-eagle3", dry_run_dir=tmp_path / "pub"))
    card = (out / "README.md").read_text()
    assert "draft_vocab.json" not in card and not (out / "draft_vocab.json").exists()
    assert "full output layer" not in card
    assert f"{TARGET_VOCAB // 2} of the target's tokens" in card and "`d2t` and `t2d`" in card
    assert "Nor can `AutoModelForCausalLM.from_pretrained` load it" in card
    assert 'head = eagle3.load("someone/tiny-eagle3", target)' in card
    assert json.loads((out / "config.json").read_text())["draftsmith"]["about"] == eagle3.ABOUT
    with pytest.raises(Exception):  # noqa: B017 - what the card says: transformers cannot load the folder
        AutoModelForCausalLM.from_pretrained(out)


def slower_checkpoint(run_dir: Path, tmp_path: Path, speedup: float) -> Path:
    """run_dir's best/ as the best/ of another run whose eval measured `speedup` vs target-only decoding."""
    ckpt = tmp_path / "slow-run" / "best"
    shutil.copytree(run_dir / "best", ckpt)
    save_recipe(load_recipe(run_dir / "resolved_recipe.yaml"), ckpt.parent)
    ev = {**BEST, "speedup": {"vs_target": speedup, "vs_target_ci95": [0.8, 0.95], "vs_hf_assisted": 0.7}}
    (ckpt / "eval.json").write_text(json.dumps(ev))
    return ckpt


def test_a_draft_slower_than_its_target_is_published_with_a_warning_and_said_so(run_dir, tmp_path, caplog):
    with caplog.at_level("WARNING", logger="draftsmith.publish"):
        out = Path(pub.publish(slower_checkpoint(run_dir, tmp_path, 0.87), REPO_ID, dry_run_dir=tmp_path / "out"))
    assert "makes its target slower (0.87x target-only decoding" in caplog.text
    card = (out / "README.md").read_text()
    assert "only makes it come out faster" not in card
    assert "**This draft makes the target slower**: 0.87x target-only decoding" in card
    caplog.clear()
    with caplog.at_level("WARNING", logger="draftsmith.publish"):
        out = Path(pub.publish(slower_checkpoint(run_dir, tmp_path / "b", 1.3), REPO_ID, dry_run_dir=tmp_path / "o2"))
    assert "slower" not in caplog.text and "only makes it come out faster" in (out / "README.md").read_text()


@pytest.fixture(scope="module")
def cut_run(run_dir, tmp_path_factory) -> Path:
    """A run of a cut draft (draft.init=truncate) for a Hub target, trained in float32 and measured in bf16 next to
    the bf16 target: best/ (a float32 model), eval.json, report.json, the resolved recipe with draft.model filled
    in by the run (RUN/draft_init, an absolute path)."""
    root = tmp_path_factory.mktemp("cut")
    run = root / "run"
    shutil.copytree(run_dir / "best", run / "best")
    overrides = [
        "target.model=HuggingFaceTB/SmolLM2-135M-Instruct", "draft.init=truncate", "draft.init_layers=2",
        f"draft.model={run / 'draft_init'}", "draft.lora.enabled=false", f"data.train_prompts={root / 'train.jsonl'}",
        f"output_dir={run}",
    ]  # fmt: skip
    save_recipe(load_recipe(None, overrides), run)
    best = {**BEST, "dtype": "bfloat16", "draft_dtype": "bfloat16"}
    (run / "best" / "eval.json").write_text(json.dumps(best))
    (run / "report.json").write_text(json.dumps({"best": best, "best_step": 40, "checkpoints": []}))
    return run


def test_a_cut_draft_is_published_in_the_dtype_it_was_measured_with_its_target_as_base(cut_run, tmp_path):
    assert AutoModelForCausalLM.from_pretrained(cut_run / "best", dtype="auto").dtype == torch.float32
    out = Path(pub.publish(cut_run, REPO_ID, dry_run_dir=tmp_path / "out"))
    assert AutoModelForCausalLM.from_pretrained(out, dtype="auto").dtype == torch.bfloat16
    info = json.loads((out / "draftsmith_eval.json").read_text())
    assert any("cast from float32 to bfloat16, the dtype its figures were measured in" in n for n in info["notes"])
    assert "the target cut to its first 2 layers" in info["method"]
    meta = front_matter((out / "README.md").read_text())
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and meta["base_model_relation"] == "finetune"


def test_a_cut_drafts_reproduce_recipe_runs_as_written(cut_run, tmp_path):
    """The card's recipe (= the uploaded resolved_recipe.yaml) loads, leaves draft.model empty for draft.init=
    truncate to build again (distill.draft_init refuses a draft.model there), and names each local input by a
    placeholder, never by a bare base name."""
    out = Path(pub.publish(cut_run, REPO_ID, dry_run_dir=tmp_path / "out"))
    card = (out / "README.md").read_text()
    block = card.split("```yaml\n")[1].split("```")[0]
    assert yaml.safe_load(block) == yaml.safe_load((out / "resolved_recipe.yaml").read_text())
    recipe = load_recipe(out / "resolved_recipe.yaml")
    assert recipe.draft.init == "truncate" and recipe.draft.model == ""
    assert recipe.target.model == "HuggingFaceTB/SmolLM2-135M-Instruct" and recipe.output_dir == "run"
    assert recipe.data.train_prompts == "<your copy of train.jsonl>" and "draft_init" not in block
    assert "replace each `<your copy of NAME>`" in card and "`data.train_prompts`" in card


def test_published_eagle3_head_names_its_verifier_for_vllm(eagle3_run, tmp_path):
    """config.json's speculators keys name the target vLLM serves the head with: --verifier as given (with the
    measured gamma), none for a local target without it (with a note); the card's vLLM lines follow, sampled
    drafting unless the recipe asks for greedy."""
    from distill.publishing.publish import BuildOptions, build_publish_folder

    repo = "someone/tiny-eagle3"
    gamma = BEST["num_draft_tokens"]
    named = build_publish_folder(eagle3_run, tmp_path / "named", repo, BuildOptions(verifier="org/tiny-target"))
    config = json.loads((named / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["model_type"] == "llama"
    spec = config["speculators_config"]
    assert spec["verifier"]["name_or_path"] == "org/tiny-target"
    assert spec["proposal_methods"][0]["speculative_tokens"] == gamma
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and "midlayer" not in json.dumps(config)
    card = (named / "README.md").read_text()
    assert f'vllm serve {repo} --speculative-config \'{{"draft_sample_method": "probabilistic"}}\'' in card

    local = build_publish_folder(eagle3_run, tmp_path / "local", repo)
    config = json.loads((local / "config.json").read_text())
    assert not {"speculators_config", "speculators_model_type", "transformer_layer_config"} & set(config)
    info = json.loads((local / "draftsmith_eval.json").read_text())
    assert info["verifier"] is None and any("--verifier HUB_ID" in n for n in info["notes"])
    assert f"vllm serve {repo}" not in (local / "README.md").read_text()


def test_card_vllm_lines_follow_the_recipes_draft_sample_method():
    from decode.kinds.eagle3.publishing import head_usage as eagle3_usage
    from decode.kinds.standalone.publishing import vllm_spec

    assert json.loads(vllm_spec("me/d", 3))["draft_sample_method"] == "probabilistic"
    assert "draft_sample_method" not in json.loads(vllm_spec("me/d", 3, "greedy"))
    greedy = "\n".join(eagle3_usage("org/target", "me/head", 3, sample_method="greedy", verifier="org/target"))
    assert "draft_sample_method" not in greedy and "vllm serve me/head\n" in greedy


# ---------------------------------------------------------------------------------------------------------------
# A P-EAGLE head: published as an EAGLE-3 head that vLLM drafts in parallel
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def peagle_run(eagle3_run, tmp_path_factory) -> Path:
    """eagle3_run with best/ replaced by a P-EAGLE head of block 3 for the same target."""
    from decode.kinds.eagle3 import decoding as eagle3
    from decode.kinds.peagle import decoding as peagle

    run = tmp_path_factory.mktemp("peagle-publish") / "run"
    shutil.copytree(eagle3_run, run)
    shutil.rmtree(run / "best")
    target_dir = Path(load_recipe(run / "resolved_recipe.yaml", []).target.model)
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    head = peagle.build(target, list(range(0, TARGET_VOCAB, 2)), [1, 2, 3], block_size=3, mask_token_id=0)
    eagle3.save(head, run / "best", target_name=str(target_dir))
    best = {**BEST, "draft_kind": "peagle", "draft_vocab_size": TARGET_VOCAB // 2, "num_draft_tokens": 3}
    (run / "best" / "eval.json").write_text(json.dumps(best))
    (run / "report.json").write_text(json.dumps({"best": best, "best_step": 40, "checkpoints": []}))
    return run


def test_a_peagle_head_is_published_with_parallel_drafting_launch_lines(peagle_run, tmp_path):
    """The card and the folder's README name P-EAGLE and its block; vLLM's line asks for parallel drafting with at
    most the block's tokens; SGLang gets no line (it has no parallel drafting); config.json's speculators keys say
    peagle with --verifier; draftsmith_eval.json records the kind and the block."""
    from distill.publishing.publish import BuildOptions, build_publish_folder

    repo = "someone/tiny-peagle"
    out = build_publish_folder(peagle_run, tmp_path / "pub", repo, BuildOptions(verifier="org/tiny-target"))
    card = (out / "README.md").read_text()
    assert "a P-EAGLE head (a block of 3 tokens per forward)" in card
    spec = json.dumps({"method": "eagle3", "model": repo, "num_speculative_tokens": 3,
                       "draft_sample_method": "probabilistic", "parallel_drafting": True})  # fmt: skip
    assert f"--speculative-config '{spec}'" in card
    assert "--speculative-algorithm EAGLE3" not in card and "SGLang: no parallel drafting" in card
    assert "HF assisted generation cannot run an EAGLE-3 or P-EAGLE head" in card
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["mask_token_id"] == 0
    assert config["block_size"] == 3 and config["parallel_drafting"] is True
    info = json.loads((out / "draftsmith_eval.json").read_text())
    assert info["draft_kind"] == "peagle" and info["block_size"] == 3

    from decode.kinds.eagle3 import decoding as eagle3

    readme = eagle3.readme(config, "org/tiny-target")
    assert readme.startswith("# P-EAGLE draft head") and '"parallel_drafting": true' in readme


# ---------------------------------------------------------------------------------------------------------------
# A DFlash draft: published as vLLM's DFlash layout, served with method dflash
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dflash_run(eagle3_run, tmp_path_factory) -> Path:
    """eagle3_run with best/ replaced by a DFlash draft of block 3 for the same target."""
    from decode.kinds.dflash import decoding as dflash

    run = tmp_path_factory.mktemp("dflash-publish") / "run"
    shutil.copytree(eagle3_run, run)
    shutil.rmtree(run / "best")
    target_dir = Path(load_recipe(run / "resolved_recipe.yaml", []).target.model)
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    draft = dflash.build(target, [0, 1, 2], num_layers=1, block_size=3, mask_token_id=0)
    dflash.save(draft, run / "best", target_name=str(target_dir))
    best = {**BEST, "draft_kind": "dflash", "num_draft_tokens": 3}
    (run / "best" / "eval.json").write_text(json.dumps(best))
    (run / "report.json").write_text(json.dumps({"best": best, "best_step": 40, "checkpoints": []}))
    return run


def test_a_dflash_draft_is_published_with_vllms_dflash_launch_line(dflash_run, tmp_path):
    """The folder is the draft's config.json and weights as saved (vLLM's layout) and the target's tokenizer; the
    card names DFlash and its block, gives vLLM's method dflash line with at most the block's tokens, and no
    SGLang or HF assisted line; draftsmith_eval.json records the kind and the block."""
    from distill.publishing.publish import BuildOptions, build_publish_folder

    repo = "someone/tiny-dflash"
    out = build_publish_folder(dflash_run, tmp_path / "pub", repo, BuildOptions())
    card = (out / "README.md").read_text()
    assert "a DFlash draft (a block of 3 tokens per forward)" in card
    spec = json.dumps({"method": "dflash", "model": repo, "num_speculative_tokens": 3})
    assert f"--speculative-config '{spec}'" in card
    assert "sglang" not in card.lower() and "HF assisted generation cannot run a DFlash draft" in card
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    assert config["dflash_config"] == {"mask_token_id": 0, "target_layer_ids": [0, 1, 2]}
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()
    info = json.loads((out / "draftsmith_eval.json").read_text())
    assert info["draft_kind"] == "dflash" and info["block_size"] == 3


# ---------------------------------------------------------------------------------------------------------------
# A PARD draft: published as a draft model that vLLM drafts in parallel
# ---------------------------------------------------------------------------------------------------------------
def test_a_pard_draft_is_published_with_parallel_drafting_launch_lines(run_dir, tmp_path):
    """best/ a PARD draft (block 3): config.json keeps pard_token and block_size (what vLLM's draft_model proposer
    reads); the card names the kind and its block, gives vLLM's draft_model line with parallel_drafting and at most
    the block's tokens, and no HF assisted or SGLang line."""
    from decode.kinds.pard import decoding as pard
    from distill.publishing.publish import build_publish_folder

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    shutil.rmtree(run / "checkpoints")
    draft = AutoModelForCausalLM.from_pretrained(run / "best")
    pard.mark(draft, block_size=3, pard_token=3)
    draft.save_pretrained(run / "best")
    ev = {**BEST, "draft_kind": "pard", "num_draft_tokens": 3, "speedup": {"vs_target": 1.5, "vs_hf_assisted": None}}
    ev["tokens_per_s"] = {"speculative": 100.0, "target": 66.7}
    (run / "best" / "eval.json").write_text(json.dumps(ev))
    (run / "report.json").write_text(json.dumps({"best": ev, "best_step": 40, "checkpoints": []}))
    out = build_publish_folder(run, tmp_path / "pub", "someone/tiny-pard")
    config = json.loads((out / "config.json").read_text())
    assert config["pard_token"] == 3 and config["block_size"] == 3
    card = (out / "README.md").read_text()
    assert "a PARD draft (a block of 3 tokens per forward)" in card
    spec = json.dumps({"method": "draft_model", "model": "someone/tiny-pard", "num_speculative_tokens": 3,
                       "parallel_drafting": True, "draft_sample_method": "probabilistic"})  # fmt: skip
    assert f"--speculative-config '{spec}'" in card
    assert "assistant_model=draft" not in card and "--speculative-algorithm STANDALONE" not in card
    info = json.loads((out / "draftsmith_eval.json").read_text())
    assert info["draft_kind"] == "pard" and info["block_size"] == 3


# ---------------------------------------------------------------------------------------------------------------
# A DSpark draft: trained by train/distill.py, published as speculators' dspark layout, served with method dspark
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dspark_run(tmp_path_factory) -> Path:
    """Two steps of train/distill.py on a tiny local target: a run whose best/ is a DSpark draft of block 3."""
    from tests.procs import load_script
    from tests.test_eagle3_train import head_recipe
    from tests.tiny import make_pair, make_prompts

    root = tmp_path_factory.mktemp("dspark-publish")
    target, _ = make_pair(root / "assets")
    assets = {
        "target": target,
        "train": make_prompts(root / "train.jsonl", 8, seed=1),
        "eval": make_prompts(root / "eval.jsonl", 2, seed=2),
    }
    draft = {"kind": "dspark", "vocab_subset": 0, "block_size": 3, "markov_rank": 4, "confidence_min": 0.1}
    recipe = head_recipe(
        assets, root / "run", draft=draft, distill={"anchors": 4}, train={"max_steps": 2},
        eval={"every": 2, "num_prompts": 2}, log={"report_to": "none"},
    )  # fmt: skip
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    load_script("train/distill.py").main(["--recipe", str(path)])
    return root / "run"


@pytest.mark.slow
def test_a_trained_dspark_draft_is_published_with_vllms_dspark_launch_line(dspark_run, tmp_path):
    """train/publish.py --dry-run on a DSpark run: the draft's config.json and weights as saved (speculators' dspark
    layout, its verifier no path of this machine) and the target's tokenizer; a card with the run's measured
    figures, vLLM's method dspark line with the trained block and no SGLang or HF assisted line;
    draftsmith_eval.json records the kind, the block and the figures."""
    repo = "someone/tiny-spark"
    out = tmp_path / "pub"
    proc = run_cli(str(dspark_run), "--repo-id", repo, "--dry-run", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    best = dspark_run / "best"
    assert (out / "model.safetensors").read_bytes() == (best / "model.safetensors").read_bytes()
    assert (out / "tokenizer.json").is_file() and not (out / "generation_config.json").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["architectures"] == ["DSparkSpeculator"]
    assert config["block_size"] == 4 and config["markov_rank"] == 4
    assert config["speculators_config"]["verifier"] == {"name_or_path": None, "architectures": []}
    assert str(tmp_path.parent) not in (out / "config.json").read_text()
    card = (out / "README.md").read_text()
    assert "a DSpark draft (a block of 3 tokens per forward)" in card and "Markov bias of rank 4" in card
    spec = json.dumps({"method": "dspark", "model": repo, "num_speculative_tokens": 3})
    assert f"vllm serve {Path(dspark_run).parent.name}" not in card  # the target's public name, not a path
    assert f"--speculative-config '{spec}'" in card
    assert "sglang" not in card.lower() and "HF assisted generation cannot run a DSpark draft" in card
    measured = json.loads((best / "eval.json").read_text())
    assert f"{measured['acceptance_rate']:.3f}" in card and f"{measured['speedup']['vs_target']:.2f}x" in card
    info = json.loads((out / "draftsmith_eval.json").read_text())
    assert info["draft_kind"] == "dspark" and info["block_size"] == 3
    assert info["best"]["acceptance_rate"] == measured["acceptance_rate"]
