"""generate:magpie / generate:stdlib: prompts the target writes itself, cached, deduplicated, held out cleanly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from distill.config import DataConfig, RecipeError, load_recipe
from distill.data import prompt_gen
from tests.tiny import make_pair

TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SYSTEM_TEMPLATE = "{{ '<|im_start|>system\\nBe brief.<|im_end|>\\n' }}" + TEMPLATE


def _load_chat_pair(target_dir: str):
    tok = AutoTokenizer.from_pretrained(target_dir)
    tok.chat_template = TEMPLATE
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval(), tok


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    target_dir, _ = make_pair(tmp_path_factory.mktemp("pair"))
    return _load_chat_pair(target_dir)


def test_user_turn_prefix_and_suffix(chat_pair):
    _, tok = chat_pair
    assert prompt_gen.user_turn_prefix(tok) == "<|im_start|>user\n"
    assert prompt_gen.user_turn_suffix(tok) == "<|im_end|>"
    tok2 = AutoTokenizer.from_pretrained(tok.name_or_path)
    tok2.chat_template = SYSTEM_TEMPLATE
    assert prompt_gen.user_turn_prefix(tok2) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"


def test_clean_request():
    assert (
        prompt_gen.clean_request("  How do I sort a list?<|im_end|>\nmore", ["<|im_end|>"]) == "How do I sort a list?"
    )
    assert prompt_gen.clean_request("Hi<|im_end|>", ["<|im_end|>"]) is None


def test_function_instructions_from_source():
    source = (
        'def area(width, height=1, *rest):\n    """Return the area of a rectangle of the given size.\n\n    More."""\n'
        'def _hidden(x):\n    """A private helper that is never an instruction."""\n'
        "def bare(x):\n    return x\n"
        'class A:\n    def method(self):\n        """A method, not a top-level function."""\n'
    )
    assert prompt_gen.function_instructions(source) == [
        "Write a Python function area(width, height, *rest). Return the area of a rectangle of the given size."
    ]
    assert prompt_gen.function_instructions("def broken(:\n") == []


def test_stdlib_prompts_are_distinct_and_seeded():
    a = prompt_gen.stdlib_prompts(20, seed=0)
    assert len(a) == 20 == len(set(a)) and all(p.startswith("Write a Python function ") for p in a)
    assert prompt_gen.stdlib_prompts(20, seed=0) == a and prompt_gen.stdlib_prompts(20, seed=1) != a


def test_magpie_samples_distinct_user_turns(chat_pair):
    target, tok = chat_pair
    kw = dict(max_new_tokens=16, temperature=1.0, seed=3, batch_size=8)
    got = prompt_gen.magpie_prompts(target, tok, 12, **kw)
    assert 0 < len(got) <= 12 and len(set(got)) == len(got)
    assert all(len(p) >= 12 and "<|im_end|>" not in p and p == p.strip() for p in got)
    assert prompt_gen.magpie_prompts(target, tok, 12, **kw) == got  # seeded


# The two-process check's prompts: more than one shard of 64 attempts, so both processes sample.
SHARDED = DataConfig(train_prompts="generate:magpie", generate_num_prompts=40, generate_max_tokens=16, eval_split=0.2)


def _sharded_worker(target_dir: str, out: str) -> None:
    """One of two accelerate processes: sample Magpie prompts together, through the whole cache path."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    target, tok = _load_chat_pair(target_dir)
    train, evals = prompt_gen.load_train_eval(
        SHARDED, target, tok, target_name="tiny", cache_dir=Path(out) / "cache", seed=5, accelerator=accelerator
    )
    result = {"train": train, "evals": evals}
    (Path(out) / f"rank{accelerator.process_index}.json").write_text(json.dumps(result))


def test_magpie_shards_are_seeded_alone(chat_pair):
    target, tok = chat_pair
    kw = dict(max_new_tokens=16, temperature=1.0, seed=3)
    # The shards are the same whatever follows them: a larger n extends the smaller one's list.
    small = prompt_gen.magpie_prompts(target, tok, 8, batch_size=4, **kw)
    assert prompt_gen.magpie_prompts(target, tok, 16, batch_size=4, **kw)[: len(small)] == small


@pytest.mark.slow
def test_two_processes_sample_what_one_does(tmp_path):
    """Two real processes (gloo) split the Magpie shards and end with the rows one process makes alone, and one
    cache file; rank 1 reads nothing half-written."""
    import subprocess

    from tests.test_distributed import REPO, env

    target_dir, _ = make_pair(tmp_path / "pair")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [__file__, "sharded-worker", str(target_dir), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0 == rank1 and rank0["train"] and rank0["evals"]
    target, tok = _load_chat_pair(target_dir)
    alone = prompt_gen.load_train_eval(SHARDED, target, tok, target_name="tiny", cache_dir=tmp_path / "alone", seed=5)
    assert [rank0["train"], rank0["evals"]] == [list(alone[0]), list(alone[1])]
    assert len(list((tmp_path / "cache").glob("prompts-*.jsonl"))) == 2  # the rows and the held-out file
    assert not list((tmp_path / "cache").glob(".tmp-*"))


def test_generated_rows_cached_split_and_disjoint(chat_pair, tmp_path):
    target, tok = chat_pair
    cfg = DataConfig(train_prompts="generate:magpie+stdlib", generate_num_prompts=10, generate_max_tokens=16,
                     eval_split=0.2)  # fmt: skip
    kw = dict(target_name="tiny", cache_dir=tmp_path, seed=0)
    train, evals = prompt_gen.load_train_eval(cfg, target, tok, **kw)
    assert evals and train and {r["source"] for r in train + evals} <= {"magpie", "stdlib"}
    texts = [r["messages"][0]["content"] for r in train + evals]
    assert len(texts) == len(set(texts))  # deduplicated, and no eval prompt is a training prompt
    (cached,) = [p for p in tmp_path.glob("prompts-*.jsonl") if not p.name.endswith(".eval.jsonl")]
    # The held-out rows are a prompt file the bench reads.
    from decode.prompts import load_prompts

    held = load_prompts(str(cached.with_name(cached.stem + ".eval.jsonl")), tokenizer=tok)
    assert len(held) == len(evals)
    # A second run reads the cache: with no target at all it still gets the same rows.
    assert prompt_gen.load_train_eval(cfg, None, tok, **kw) == (train, evals)
    other = DataConfig(**{**cfg.__dict__, "generate_temperature": 0.7})
    assert prompt_gen.cache_key("tiny", other, 0) != cached.stem.removeprefix("prompts-")
    assert prompt_gen.cache_key("other-target", cfg, 0) != cached.stem.removeprefix("prompts-")


def test_eval_file_rows_never_train(chat_pair, tmp_path):
    target, tok = chat_pair
    first = prompt_gen.stdlib_prompts(3, seed=0)
    evals = tmp_path / "eval.jsonl"
    evals.write_text("".join(json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n" for t in first))
    cfg = DataConfig(train_prompts="generate:stdlib", eval_prompts=str(evals), generate_num_prompts=10)
    train, held = prompt_gen.load_train_eval(cfg, target, tok, target_name="tiny", cache_dir=tmp_path, seed=0)
    assert len(held) == 3 and len(train) == 7
    assert not {r["messages"][0]["content"] for r in train} & set(first)


def test_no_chat_template_is_one_line_and_writes_nothing(chat_pair, tmp_path):
    target, tok = chat_pair
    plain = AutoTokenizer.from_pretrained(tok.name_or_path)
    assert not plain.chat_template
    cfg = DataConfig(train_prompts="generate:magpie", generate_num_prompts=4)
    with pytest.raises(ValueError, match=r"needs a chat template, and the target's tokenizer has none") as e:
        prompt_gen.load_train_eval(cfg, target, plain, target_name="tiny", cache_dir=tmp_path / "c", seed=0)
    assert "\n" not in str(e.value) and not (tmp_path / "c").exists()
    rows = tmp_path / "chat.jsonl"
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) + "\n" for i in range(5)))
    with pytest.raises(ValueError, match="'messages' prompt rows"):
        prompt_gen.load_train_eval(DataConfig(train_prompts=str(rows), eval_split=0.2), target, plain,
                                   target_name="tiny", cache_dir=tmp_path / "c", seed=0)  # fmt: skip


def test_spec_and_keys_are_checked():
    with pytest.raises(ValueError, match="unknown prompt generator \\['magpy'\\]"):
        prompt_gen.parse_spec("generate:magpy")
    assert prompt_gen.parse_spec("generate:stdlib+magpie") == ["stdlib", "magpie"]
    with pytest.raises(RecipeError, match="data.generate_num_prompts: must be > 0"):
        load_recipe(None, ["data.generate_num_prompts=0"])


if __name__ == "__main__" and sys.argv[1:2] == ["sharded-worker"]:
    _sharded_worker(*sys.argv[2:4])
