"""train/pretrain.py and distill/training/pretraining.py: a tiny pretraining run end to end, bad input, the
quickstart pair."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distill.config import ArchConfig, PretrainRecipe, RecipeError, dump_recipe, load_recipe
from distill.data.corpus import stdlib_files, train_tokenizer
from distill.training.pretraining import (
    MIN_LR_RATIO,
    lr_at,
    quickstart_cache_dir,
    quickstart_recipes,
    resolve_vocab_size,
)
from tests.procs import load_script

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "train" / "pretrain.py"
TINY = [
    "model.hidden_size=64",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=2",
    "model.intermediate_size=128",
    "model.max_position_embeddings=128",
    "tokenizer.vocab_size=512",
    "train.batch_size=4",
    "train.seq_len=64",
    "train.warmup_steps=2",
    "train.eval_windows=4",
    "log.report_to=none",
    "log.every=2",
]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """A small folder corpus: 16 short stdlib files."""
    root = tmp_path_factory.mktemp("corpus")
    small = [p for _, p in stdlib_files() if 2000 < p.stat().st_size < 6000][:16]
    for i, path in enumerate(small):
        (root / f"f{i:02d}.py").write_text(path.read_text(encoding="utf-8"))
    return root


@pytest.fixture
def fresh_accelerate():
    """In-process runs create accelerate's process-wide state; leave none behind for other tests."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def run_cli(*args, env=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300)


def leftovers(out: Path) -> list[Path]:
    return [p for p in out.parent.iterdir() if p.name.startswith(out.name)]


@pytest.mark.slow
def test_cli_smoke_run_saves_a_loadable_checkpoint(tmp_path, corpus_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(f"corpus:\n  source: {corpus_dir}\ntrain:\n  max_steps: 6\n")
    out = tmp_path / "out"
    proc = run_cli("--recipe", str(recipe), *TINY, f"output_dir={out}", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "held-out loss: " in proc.stdout
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "metrics.jsonl"):
        assert (out / name).is_file(), name
    assert leftovers(out) == [out]  # no temporary dir left
    info = json.loads((out / "TRAINING.json").read_text())
    assert info["steps"] == 6 and info["tokens_seen"] == 6 * 4 * 64 and info["reload_max_abs_logit_diff"] < 1e-4
    assert info["heldout_loss"] > 0 and "train/pretrain.py" in info["command"]
    assert load_recipe(out / "resolved_recipe.yaml", cls=PretrainRecipe).train.max_steps == 6
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == 512 and model.config.eos_token_id == tok.eos_token_id == 0
    assert model.generation_config.pad_token_id == 0
    ids = tok("def f(x):\n    return", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=5, do_sample=False).shape[1] == ids.shape[1] + 5
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["step"] == 2 and {"train/loss", "train/lr", "train/tokens_per_s"} <= set(metrics[0])
    assert metrics[-1]["eval/heldout_loss"] == pytest.approx(info["heldout_loss"])


def test_reloaded_checkpoint_gives_the_in_memory_logits(tmp_path, corpus_dir, monkeypatch, fresh_accelerate):
    """The library run in-process, under a time budget: the saved checkpoint reproduces the trained model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import distill.training.pretraining as pt

    captured = {}
    real_save = pt.save_checkpoint

    def capture(model, tokenizer, directory):
        captured["model"], captured["tokenizer"] = model, tokenizer
        real_save(model, tokenizer, directory)

    monkeypatch.setattr(pt, "save_checkpoint", capture)
    overrides = [*TINY, f"corpus.source={corpus_dir}", "train.max_steps=100000", "train.max_minutes=0.04"]
    out = pt.pretrain(load_recipe(None, [*overrides, f"output_dir={tmp_path / 'out'}"], cls=PretrainRecipe), False)
    info = json.loads((out / "TRAINING.json").read_text())
    assert 1 < info["steps"] < 100000 and 0.04 <= info["minutes"] < 0.5  # the time budget ended the run

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok(stdlib_files()[3][1].read_text(encoding="utf-8")[:400], return_tensors="pt").input_ids[:, :64]
    model = captured["model"].eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)
    assert tok.get_vocab() == captured["tokenizer"].get_vocab()


def test_bad_input_exits_2_with_one_line_and_leaves_nothing(tmp_path, corpus_dir, capsys, fresh_accelerate):
    cli = load_script("train/pretrain.py")
    (tmp_path / "empty").mkdir()
    typo = tmp_path / "typo.yaml"
    typo.write_text("trian:\n  lr: 1e-3\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    tok_dir = tmp_path / "tok"
    train_tokenizer(["x = 1\n" * 50, "def f():\n    pass\n" * 20], 300).save_pretrained(tok_dir)
    base = [*TINY, f"corpus.source={corpus_dir}", "train.max_steps=2"]
    cases = {
        "empty corpus": ([*base, f"corpus.source={tmp_path / 'empty'}"], "corpus.source"),
        "missing corpus": ([*base, f"corpus.source={tmp_path / 'nowhere'}"], "does not exist"),
        "recipe typo": (["--recipe", str(typo)], "Did you mean 'train'?"),
        "wrong type": ([*base, "train.lr=fast"], "train.lr: expected a number"),
        "unwritable output": ([*base, f"output_dir={blocker / 'out'}"], "output_dir: cannot write"),
        "tokenizer misfit": ([*base, f"tokenizer.path={tok_dir}", "model.extra={vocab_size: 256}"], "vocab_size"),
        "bad config class": ([*base, "model.config_class=LlamaConfg"], "did you mean 'LlamaConfig'?"),
    }
    for name, (args, expect) in cases.items():
        out = tmp_path / f"out-{name.replace(' ', '-')}"
        if not any(a.startswith("output_dir=") for a in args):
            args = [*args, f"output_dir={out}"]
        assert cli.main([*args, "--no-progress"]) == 2, name
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith("error: ") and expect in err[0], (name, err)
        assert not out.exists() and not leftovers(out), name
    assert [p.name for p in blocker.parent.iterdir() if p.name.startswith("a-file")] == ["a-file"]


@pytest.mark.slow
def test_cli_bad_input_exit_status(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = run_cli(f"corpus.source={tmp_path / 'empty'}", f"output_dir={tmp_path / 'out'}", "log.report_to=none")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.startswith("error: corpus.source")
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["empty"]


def test_existing_dir_that_is_not_a_checkpoint_is_refused(tmp_path, fresh_accelerate):
    from distill.training.pretraining import pretrain

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(RecipeError, match="not a draftsmith pretrain checkpoint"):
        pretrain(load_recipe(None, [*TINY, f"output_dir={tmp_path / 'mine'}"], cls=PretrainRecipe), False)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_lr_schedule():
    assert lr_at(0, 0.0, 1.0, 10) == pytest.approx(0.1)
    assert lr_at(9, 0.0, 1.0, 10) == pytest.approx(1.0)
    assert lr_at(50, 0.5, 1.0, 10) == pytest.approx(MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5)
    assert lr_at(100, 1.0, 1.0, 10) == pytest.approx(MIN_LR_RATIO)


def test_vocab_size_follows_the_tokenizer():
    tok = train_tokenizer(["x = 1\n" * 50, "def f():\n    return 2\n" * 20], 300)
    assert resolve_vocab_size(ArchConfig(), tok) == -(-len(tok) // 64) * 64
    assert resolve_vocab_size(ArchConfig(extra={"vocab_size": 1000}), tok) == 1000
    with pytest.raises(RecipeError, match=f"smaller than the tokenizer \\({len(tok)} tokens\\)"):
        resolve_vocab_size(ArchConfig(extra={"vocab_size": 100}), tok)


def test_quickstart_recipes_are_a_pair():
    """The draft reads the target's tokenizer and has ~10x fewer parameters."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    for name in ("target", "draft"):
        text = (REPO / "recipes" / "pretrain" / f"quickstart-{name}.yaml").read_text()
        assert text.startswith("# ") and "Command:" in text.split("\n\n")[0]
    target = load_recipe(REPO / "recipes/pretrain/quickstart-target.yaml", cls=PretrainRecipe)
    draft = load_recipe(REPO / "recipes/pretrain/quickstart-draft.yaml", cls=PretrainRecipe)
    assert draft.tokenizer.path == target.output_dir and target.tokenizer.path is None
    assert draft.corpus == target.corpus and draft.log.report_to == target.log.report_to == "none"

    def params(arch):
        cfg = LlamaConfig(
            vocab_size=target.tokenizer.vocab_size,
            hidden_size=arch.hidden_size,
            num_hidden_layers=arch.num_hidden_layers,
            num_attention_heads=arch.num_attention_heads,
            intermediate_size=arch.intermediate_size,
            tie_word_embeddings=arch.tie_word_embeddings,
        )
        with torch.device("meta"):
            return sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())

    assert 6 <= params(target.model) / params(draft.model) <= 14


def test_ensure_quickstart_pair_builds_missing_reuses_built(tmp_path, monkeypatch):
    import distill.training.pretraining as pt

    built = []

    def fake_build(yaml_path, recipe, progress):
        out = Path(recipe.output_dir)
        out.mkdir(parents=True)
        (out / "model.safetensors").write_text("")
        (out / "resolved_recipe.yaml").write_text(dump_recipe(recipe))
        (out / pt.MARKER).write_text("{}")
        built.append(out.name)

    def fake_rebuild(yaml_path, recipe, progress):
        out = Path(recipe.output_dir)
        if out.exists():
            import shutil

            shutil.rmtree(out)
        fake_build(yaml_path, recipe, progress)

    monkeypatch.setattr(pt, "_build_in_child", fake_rebuild)
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    assert quickstart_cache_dir() == tmp_path / "cache" / "quickstart"
    target, draft = pt.ensure_quickstart_pair(progress=False)
    assert (target, draft) == (tmp_path / "cache/quickstart/target", tmp_path / "cache/quickstart/draft")
    assert built == ["target", "draft"]
    assert quickstart_recipes()["draft"][1].tokenizer.path == str(target)

    pt.ensure_quickstart_pair(progress=False)
    assert built == ["target", "draft"]  # reused
    (target.parent / "draft.tmp-x1").mkdir()  # left by a killed build
    (draft / pt.MARKER).unlink()  # an incomplete draft
    pt.ensure_quickstart_pair(progress=False)
    assert built[2:] == ["draft"] and not (target.parent / "draft.tmp-x1").exists()
    (target / "resolved_recipe.yaml").write_text("changed")  # the target recipe changed: both rebuilt
    pt.ensure_quickstart_pair(progress=False)
    assert built[3:] == ["target", "draft"]
    pt.ensure_quickstart_pair(rebuild=True, progress=False)
    assert built[5:] == ["target", "draft"]
    other = pt.ensure_quickstart_pair(cache_dir=tmp_path / "elsewhere", progress=False)
    assert other == (tmp_path / "elsewhere/target", tmp_path / "elsewhere/draft") and built[7:] == ["target", "draft"]
