"""Bad pairs and prompt sets are refused before anything is written or any weights are read.

`train/distill.py` and `python -m decode bench` given a draft with another vocabulary, chat prompts for a target
without a chat template, or a GGUF file of an architecture transformers cannot load: exit status 2, one `error:`
line naming the models (or the architecture and what is supported) and the fix, no output_dir (an existing one
left as it was), no bench JSON. So too train/distill.py given a draft folder saved as another kind, a DFlash
folder of another target, block or mask token, a mask token outside the vocabulary, prompt rows with no tokens,
or training prompts all held out as eval prompts: a finished run in output_dir keeps every file under
--overwrite. The model directories here hold a config and a tokenizer but no weights: the checks must get by on
those alone. Valid setups (quickstart, draft.init=truncate, LoRA draft, 4-bit target,
padded embeddings, a GGUF target) pass.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from distill.config import load_recipe
from distill.training.preflight import check_inputs
from tests.procs import load_script
from tests.tiny import BPE_VOCAB, CHAR_VOCAB, bpe_tokenizer, char_tokenizer, swap_ids, tiny_config

gguf = pytest.importorskip("gguf", reason="the gguf package is needed to write test GGUF files (pip install gguf)")

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
CHAT_ROW = {"messages": [{"role": "user", "content": "Write a function that adds two numbers."}]}


def weightless(directory: Path, tokenizer, **config) -> str:
    """A model directory with config.json and a tokenizer but no weights file."""
    tiny_config("llama", **config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def made_up_gguf(path: Path, arch: str = "madeup") -> str:
    """A GGUF file of architecture `arch` (by default one no library knows) with one tensor."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


NO_HIDDEN_STATES = """from transformers import LlamaForCausalLM


class NoHiddenStatesForCausalLM(LlamaForCausalLM):
    def forward(self, *args, output_hidden_states=None, **kwargs):
        out = super().forward(*args, **kwargs)
        out.hidden_states = None  # whatever output_hidden_states says
        return out
"""


def no_hidden_states(directory: Path, tokenizer) -> str:
    """A weightless 4-layer target whose model class (its own code, trust_remote_code) returns no hidden states."""
    path = weightless(directory, tokenizer, num_hidden_layers=4)
    config = json.loads((directory / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_nohidden.NoHiddenStatesForCausalLM"}
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "modeling_nohidden.py").write_text(NO_HIDDEN_STATES)
    return path


def eagle3_head(directory: Path, vocab: int = CHAR_VOCAB, aux: list[int] | None = None, **config) -> str:
    """An EAGLE-3 head folder (config.json + model.safetensors, as train/distill.py's best/) for a random 4-layer
    target of `vocab` tokens and `config`."""
    import torch
    from transformers import AutoModelForCausalLM

    from decode.kinds.eagle3 import decoding as eagle3

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(tiny_config("llama", vocab, **{"num_hidden_layers": 4, **config}))
    eagle3.save(eagle3.build(target, list(range(16)), aux), directory)
    return str(directory)


def _random_target(vocab: int = CHAR_VOCAB):
    """A random 4-layer target of `vocab` tokens (the `deep` model's config), to build a draft folder from."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama", vocab, num_hidden_layers=4))


def dflash_folder(directory: Path, vocab: int = CHAR_VOCAB, block: int = 4) -> str:
    """A DFlash draft folder (as train/distill.py's best/ of a dflash run) of `block` for a `vocab`-token target."""
    from decode.kinds.dflash import decoding as dflash

    dflash.save(dflash.build(_random_target(vocab), None, num_layers=1, block_size=block, mask_token_id=1), directory)
    return str(directory)


def peagle_folder(directory: Path) -> str:
    """A P-EAGLE head folder of block 4 (as a peagle run's best/) for the `deep` target."""
    from decode.kinds.eagle3 import decoding as eagle3
    from decode.kinds.peagle import decoding as peagle

    head = eagle3.build(_random_target(), list(range(16)), None)
    eagle3.save(peagle.with_mask(head, block_size=4, mask_token_id=1), directory)
    return str(directory)


def pard_folder(directory: Path) -> str:
    """A weightless PARD draft folder of block 4 (its config.json marked with pard_token, as a pard run's best/)."""
    weightless(directory, char_tokenizer())
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "pard_token": 1, "block_size": 4}))
    return str(directory)


def jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("preflight")
    return {
        "target": weightless(root / "target", char_tokenizer()),
        "draft": weightless(root / "draft", char_tokenizer()),
        "chat_target": weightless(root / "chat_target", char_tokenizer(chat_template=TEMPLATE)),
        "chat_draft": weightless(root / "chat_draft", char_tokenizer(chat_template=TEMPLATE)),
        "swapped": weightless(root / "swapped", swap_ids(char_tokenizer(), 5, 6)),  # same size, other tokens
        "narrow": weightless(root / "narrow", char_tokenizer(), vocab_size=CHAR_VOCAB - 10),
        "padded": weightless(root / "padded", char_tokenizer(), vocab_size=CHAR_VOCAB + 32),
        "bpe": weightless(root / "bpe", bpe := bpe_tokenizer(), vocab_size=len(bpe)),  # wider than the char ones
        "deep": weightless(root / "deep", char_tokenizer(), num_hidden_layers=4),  # deep enough for a head
        "nohidden": no_hidden_states(root / "nohidden", char_tokenizer()),
        "head": eagle3_head(root / "head"),
        "head_bpe": eagle3_head(root / "head_bpe", vocab=len(bpe)),
        "head_wide": eagle3_head(root / "head_wide", hidden_size=96),
        "head_deep": eagle3_head(root / "head_deep", aux=[2, 4, 6], num_hidden_layers=8),
        "dflash_dir": dflash_folder(root / "dflash_dir"),
        "dflash_bpe": dflash_folder(root / "dflash_bpe", vocab=len(bpe)),
        "peagle_dir": peagle_folder(root / "peagle_dir"),
        "pard_dir": pard_folder(root / "pard_dir"),
        "odd": made_up_gguf(root / "odd.gguf"),
        "raw": jsonl(root / "raw.jsonl", [{"prompt": "def f(x):"}, {"prompt": "import os"}]),
        "raw_eval": jsonl(root / "raw_eval.jsonl", [{"prompt": "class A:"}, {"prompt": "x = 1"}]),
        "blank": jsonl(root / "blank.jsonl", [{"prompt": ""}, {"prompt": ""}]),  # rows that tokenise to nothing
        "eval_blank": jsonl(root / "eval_blank.jsonl", [{"prompt": "x = 1"}, {"prompt": ""}]),
        "chat16": jsonl(root / "chat16.jsonl", [_conversation(i) for i in range(16)]),
        "text_rows": jsonl(root / "text.jsonl", [{"text": "def f(x):"}, {"text": "import os"}]),
        "text_eval": jsonl(root / "text_eval.jsonl", [{"text": "class A:"}]),
        "chat": jsonl(root / "chat.jsonl", [{"prompt": "def f(x):"}, CHAT_ROW]),
        "missing": str(root / "missing.jsonl"),  # never written
        "no_prompt": jsonl(root / "no_prompt.jsonl", [{"prompt": "def f(x):"}, {"text": "import os"}]),
        "not_json": _text(root / "not_json.jsonl", '{"prompt": "def f(x):"}\n{"prompt": "import os"\n'),
    }


def _conversation(i: int) -> dict:
    return {
        "messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
    }


def _text(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def recipe_dict(inputs: dict, out: Path, **sections) -> dict:
    recipe = {
        "target": {"model": inputs["target"], "dtype": "float32"},
        "draft": {"model": inputs["draft"], "dtype": "float32"},
        "data": {"train_prompts": inputs["raw"], "eval_prompts": inputs["raw_eval"]},
        "train": {"max_steps": 2, "batch_size": 2},
        "log": {"report_to": "wandb"},
        "output_dir": str(out),
    }
    for section, values in sections.items():
        recipe[section] = {**recipe.get(section, {}), **values} if isinstance(values, dict) else values
    return recipe


def recipe(inputs: dict, tmp_path: Path, **sections):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(inputs, tmp_path / "run", **sections)))
    return load_recipe(path)


def distill_cli(argv: list[str], capsys) -> str:
    """train/distill.py's main() in this process; the one `error:` line it printed (exit status 2 asserted)."""
    module = load_script("train/distill.py")
    with pytest.raises(SystemExit) as exit_:
        module.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err[-2000:]
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err[-2000:]
    return lines[0]


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# Each bad setup: recipe sections, then what the error line must say.
EAGLE3 = {"kind": "eagle3", "vocab_subset": 16}
BAD = {
    "draft tokenizer differs": (
        {"draft": {"model": "swapped"}},
        ["target.model", "draft.model", "swapped", "vocabulary mismatch", "use a draft trained with the target's"],
    ),
    "draft narrower than the tokenizer": (
        {"draft": {"model": "narrow"}},
        ["target.model", "draft.model", "narrow", f"only {CHAR_VOCAB - 10} logits", "resize_token_embeddings"],
    ),
    "draft of another, narrower tokenizer": (
        {"target": {"model": "bpe"}},  # resizing the draft's embeddings would not help: the tokens differ
        ["target.model", "draft.model", "bpe", "differ first at id", "use a draft trained with the target's"],
    ),
    "chat rows, no chat template": (
        {"data": {"train_prompts": "chat"}},
        ["data.train_prompts", "chat.jsonl", "'messages'", "target.model", "no chat template", "'prompt' string"],
    ),
    "generate:magpie, no chat template": (
        {"data": {"train_prompts": "generate:magpie", "eval_prompts": ""}},
        ["generate:magpie", "no chat template", "instruction-tuned target", "generate:stdlib"],
    ),
    "empty target.model": ({"target": {"model": ""}}, ["target.model is empty", "hub id"]),
    "EAGLE-3 head as a standalone draft": (
        {"target": {"model": "deep"}, "draft": {"model": "head"}},
        ["draft.model", "head", "is an EAGLE-3 head folder", "set draft.kind=eagle3"],
    ),
    "target returning no hidden states, for a head": (
        {"target": {"model": "nohidden", "trust_remote_code": True}, "draft": {"model": "", **EAGLE3}},
        ["target.model", "nohidden", "NoHiddenStatesForCausalLM", "returns no hidden states", "draft.kind=standalone"],
    ),
    "head for a target of another vocabulary": (
        {"target": {"model": "deep"}, "draft": {"model": "head_bpe", **EAGLE3}},
        ["draft.model and target.model", "head_bpe", f"vocabulary {BPE_VOCAB}", "pass the target it was trained on"],
    ),
    "head for a target of another hidden size": (
        {"target": {"model": "deep"}, "draft": {"model": "head_wide", **EAGLE3}},
        ["draft.model and target.model", "head_wide", "hidden size 96", "(97, 64)", "pass the target"],
    ),
    "head for a deeper target": (
        {"target": {"model": "deep"}, "draft": {"model": "head_deep", **EAGLE3}},
        ["draft.model and target.model", "head_deep", "reads target layers [2, 4, 6]", "(4 layers)"],
    ),
    "DFlash draft reading a layer the target does not have": (
        {"target": {"model": "deep"}, "draft": {"model": "", "kind": "dflash", "aux_layers": [0, 3]}},
        ["draft.aux_layers", "[0, 3]", "layer outputs 0..2", "output of layer j"],
    ),
    "DFlash evaluation drafting more than its block": (
        {
            "target": {"model": "deep"},
            "draft": {"model": "", "kind": "dflash", "block_size": 3},
            "eval": {"num_draft_tokens": 4},
        },
        ["eval.num_draft_tokens", "above draft.block_size=3", "DFlash draft"],
    ),
    # A bad prompt file is refused whatever the pair (here one with a chat template, which needs no chat-row
    # check) and before a quickstart pair is built.
    "missing prompt file": (
        {"target": {"model": "chat_target"}, "draft": {"model": "chat_draft"}, "data": {"train_prompts": "missing"}},
        ["data.train_prompts", "missing.jsonl' not found", "fix the path"],
    ),
    "prompt row without prompt or messages": (
        {"target": {"model": "chat_target"}, "draft": {"model": "chat_draft"}, "data": {"eval_prompts": "no_prompt"}},
        ["data.eval_prompts", "no_prompt.jsonl:2", '"prompt" (a string), "messages"', "keys found: text"],
    ),
    "prompt file not JSON": (
        {
            "build_pair": "quickstart",
            "target": {"model": ""},
            "draft": {"model": ""},
            "data": {"train_prompts": "not_json"},
        },
        ["data.train_prompts", "not_json.jsonl:2: not valid JSON"],
    ),  # fmt: skip
    "unknown GGUF architecture as target": (
        {"target": {"model": "odd"}},
        ["target.model", "odd.gguf", "'madeup'", "supported: ", "llama"],
    ),
    "unknown GGUF architecture as draft": (
        {"draft": {"model": "odd"}},
        ["draft.model", "odd.gguf", "'madeup'", "supported: ", "llama"],
    ),
    "unknown GGUF architecture as the target of draft.init=truncate": (
        {"target": {"model": "odd"}, "draft": {"model": "", "init": "truncate"}},
        ["target.model", "odd.gguf", "'madeup'", "supported: "],
    ),
}


def _resolve(inputs: dict, sections: dict) -> dict:
    """Section values that name an input (a fixture key) replaced by its path."""
    return {
        s: {k: inputs.get(v, v) if isinstance(v, str) else v for k, v in d.items()} if isinstance(d, dict) else d
        for s, d in sections.items()
    }


@pytest.mark.parametrize("case", list(BAD))
def test_distill_refuses_before_writing_anything(inputs, tmp_path, capsys, monkeypatch, case):
    sections, needles = BAD[case]
    (tmp_path / "cache").write_text("a file: building the quickstart pair here fails at once")
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(inputs, tmp_path / "run", **_resolve(inputs, sections))))
    line = distill_cli(["--recipe", str(path)], capsys)
    assert all(n in line for n in needles), line
    assert not (tmp_path / "run").exists()


def test_distill_leaves_an_existing_output_dir_as_it_was(inputs, tmp_path, capsys):
    out = tmp_path / "run"
    (out / "notes").mkdir(parents=True)
    (out / "notes" / "keep.txt").write_text("mine")
    before = tree(out)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(inputs, out, draft={"model": inputs["swapped"]})))
    assert "vocabulary mismatch" in distill_cli(["--recipe", str(path), "--overwrite"], capsys)
    assert tree(out) == before and sorted(p.name for p in out.iterdir()) == ["notes"]


def test_overwrite_keeps_a_run_whose_files_are_its_inputs(inputs, tmp_path, capsys):
    """A finished run rerun with `draft.model=RUN/best --overwrite` (or its prompts or recipe inside RUN): one
    error line, and best/ and checkpoints/ are still there."""
    import shutil

    from distill.training.run_state import RUN_MARKER

    out = tmp_path / "run"
    shutil.copytree(inputs["draft"], out / "best")
    shutil.copytree(inputs["draft"], out / "checkpoints" / "step-4")
    (out / RUN_MARKER).write_text("{}")
    (out / "metrics.jsonl").write_text("")
    shutil.copy(inputs["raw"], out / "prompts.jsonl")
    before = tree(out)
    cases = {
        "draft.model": {"draft": {"model": str(out / "best")}},
        "data.train_prompts": {"data": {"train_prompts": str(out / "prompts.jsonl")}},
    }
    for key, sections in cases.items():
        path = tmp_path / "r.yaml"
        path.write_text(yaml.safe_dump(recipe_dict(inputs, out, **sections)))
        line = distill_cli(["--recipe", str(path), "--overwrite"], capsys)
        assert line.startswith(f"error: --overwrite: {key} ") and "lies in output_dir" in line, line
        assert tree(out) == before
    path = out / "r.yaml"  # the recipe itself
    path.write_text(yaml.safe_dump(recipe_dict(inputs, out)))
    line = distill_cli(["--recipe", str(path), "--overwrite"], capsys)
    assert line.startswith(f"error: --overwrite: --recipe {str(path)!r} lies in output_dir"), line


# Inputs a run used to find bad only once it had written output_dir (or, for a folder of another kind, never):
# each is refused before output_dir is touched, a finished run there left as it was by --overwrite.
PEAGLE = {**EAGLE3, "kind": "peagle"}
BEFORE_OUTPUT_DIR = {
    "DFlash folder as a PARD draft": (
        {"target": {"model": "deep"}, "draft": {"model": "dflash_dir", "kind": "pard", "block_size": 4}},
        ["draft.model", "dflash_dir'", "is a DFlash draft folder", "draft.kind=pard trains", "set draft.kind=dflash"],
    ),
    "DFlash folder as a standalone draft": (
        {"target": {"model": "deep"}, "draft": {"model": "dflash_dir"}},
        ["draft.model", "is a DFlash draft folder", "draft.kind=standalone trains", "set draft.kind=dflash"],
    ),
    "P-EAGLE folder as an EAGLE-3 head": (
        {"target": {"model": "deep"}, "draft": {"model": "peagle_dir", **EAGLE3}},
        ["draft.model", "is a P-EAGLE head folder", "draft.kind=eagle3 trains", "set draft.kind=peagle"],
    ),
    "PARD folder as a standalone draft": (
        {"draft": {"model": "pard_dir"}},
        ["draft.model", "is a PARD draft LM folder", "draft.kind=standalone trains", "set draft.kind=pard"],
    ),
    "DFlash folder for another target": (
        {"target": {"model": "deep"}, "draft": {"model": "dflash_bpe", "kind": "dflash", "block_size": 4}},
        ["draft.model and target.model", "dflash_bpe", f"vocabulary {BPE_VOCAB}", "pass the target it was trained on"],
    ),
    "DFlash folder of another block": (
        {
            "target": {"model": "deep"},
            "draft": {"model": "dflash_dir", "kind": "dflash", "block_size": 6},
            "eval": {"num_draft_tokens": 6},
        },
        ["draft.block_size=6", "DFlash draft of block 4", "set draft.block_size=4", "leave draft.model empty"],
    ),
    "DFlash folder of another mask token": (
        {
            "target": {"model": "deep"},
            "draft": {"model": "dflash_dir", "kind": "dflash", "block_size": 4, "mask_token_id": 5},
        },
        ["draft.mask_token_id=5", "DFlash draft with mask token 1", "set draft.mask_token_id=1 (or null)"],
    ),
    "P-EAGLE mask token outside the target's vocabulary": (
        {"target": {"model": "deep"}, "draft": {"model": "", **PEAGLE, "mask_token_id": CHAR_VOCAB}},
        [f"draft.mask_token_id={CHAR_VOCAB}", f"the target's vocabulary of {CHAR_VOCAB}", f"0..{CHAR_VOCAB - 1}"],
    ),
    "PARD mask token outside the draft's vocabulary": (
        {"draft": {"kind": "pard", "mask_token_id": 500}},
        ["draft.mask_token_id=500", f"the draft's vocabulary of {CHAR_VOCAB}", f"0..{CHAR_VOCAB - 1}"],
    ),
    "DFlash mask token outside the target's vocabulary": (
        {"target": {"model": "deep"}, "draft": {"model": "", "kind": "dflash", "mask_token_id": CHAR_VOCAB}},
        [f"draft.mask_token_id={CHAR_VOCAB}", f"the target's vocabulary of {CHAR_VOCAB}"],
    ),
    "training prompts that tokenise to nothing": (
        {"data": {"train_prompts": "blank"}},
        ["none of the 2 training rows", "data.train_prompts", "blank.jsonl", "any tokens after tokenisation"],
    ),
    "an eval prompt that tokenises to nothing": (
        {"data": {"eval_prompts": "eval_blank"}},
        ["eval prompt 2 of data.eval_prompts", "eval_blank.jsonl", "no tokens", "eval.num_prompts"],
    ),
    "the same file for training and eval prompts": (
        {"data": {"train_prompts": "chat16", "eval_prompts": "chat16", "apply_chat_template": False}},
        [
            "every data.train_prompts",
            "chat16.jsonl",
            "is also in data.eval_prompts",
            "held out from training",
            "give a different data.eval_prompts",
            "leave it empty to hold out data.eval_split",
        ],
    ),  # fmt: skip
}


def finished_run(out: Path, inputs: dict) -> dict[str, bytes]:
    """A finished run's directory at `out` (marker, recipe, best/, a checkpoint, report, metrics); its files."""
    import shutil

    from distill.training.run_state import RUN_MARKER

    shutil.copytree(inputs["draft"], out / "best")
    shutil.copytree(inputs["draft"], out / "checkpoints" / "step-2")
    (out / RUN_MARKER).write_text(json.dumps({"tool": "draftsmith", "kind": "distill run", "run_id": "0123abcd"}))
    (out / "resolved_recipe.yaml").write_text("output_dir: run\n")
    (out / "report.json").write_text('{"checkpoints": []}\n')
    (out / "metrics.jsonl").write_text('{"step": 1, "train/loss": 1.0}\n')
    return tree(out)


@pytest.mark.parametrize("case", list(BEFORE_OUTPUT_DIR))
def test_refused_before_output_dir_is_touched(inputs, tmp_path, capsys, case):
    """Exit status 2 and one error line; a fresh output_dir is not created (no marker or resolved recipe that
    would refuse the corrected rerun), and a finished run's directory given with --overwrite keeps every file."""
    sections, needles = BEFORE_OUTPUT_DIR[case]
    fresh, finished = tmp_path / "fresh", tmp_path / "finished"
    before = finished_run(finished, inputs)
    for out, flags in ((fresh, []), (finished, ["--overwrite"])):
        path = tmp_path / "r.yaml"
        path.write_text(yaml.safe_dump(recipe_dict(inputs, out, **_resolve(inputs, sections))))
        line = distill_cli(["--recipe", str(path), *flags], capsys)
        assert all(n in line for n in needles), line
    assert not fresh.exists()
    assert tree(finished) == before


def test_missing_gguf_package_stays_one_line_and_writes_nothing(inputs, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # what `import gguf` sees where the package is absent
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(inputs, tmp_path / "run", draft={"model": inputs["odd"]})))
    line = distill_cli(["--recipe", str(path)], capsys)
    assert line.endswith("needs the gguf package: pip install gguf") and "draft.model" in line
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- valid setups are not refused


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tests.test_gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("gguf"))


def test_valid_setups_pass(inputs, tmp_path, tiny_gguf):
    gguf_path, _, gguf_tok = tiny_gguf
    gguf_draft = weightless(tmp_path / "gguf_draft", gguf_tok, vocab_size=len(gguf_tok))
    quickstart = {"target": {"model": ""}, "draft": {"model": ""}, "data": {"train_prompts": "", "eval_prompts": ""}}
    setups = {
        "same tokenizer": {},
        "chat rows with a chat template": {
            "target": {"model": inputs["chat_target"]}, "draft": {"model": inputs["chat_draft"]},
            "data": {"train_prompts": inputs["chat"]},
        },
        "chat rows joined as text (apply_chat_template=false)": {
            "data": {"train_prompts": inputs["chat"], "apply_chat_template": False}
        },
        "generate:stdlib joined as text": {
            "data": {"train_prompts": "generate:stdlib", "eval_prompts": "", "apply_chat_template": False}
        },
        "padded target embedding": {"target": {"model": inputs["padded"]}},
        "quickstart: models and prompts built later": {"build_pair": "quickstart", **quickstart},
        "draft.init=truncate": {"draft": {"model": "", "init": "truncate"}},
        "LoRA draft, 4-bit target": {
            "target": {"quantization": {"load_in_4bit": True}}, "draft": {"lora": {"enabled": True}},
        },
        "GGUF target": {"target": {"model": str(gguf_path)}, "draft": {"model": gguf_draft}},
        "EAGLE-3 head built from the target": {"target": {"model": inputs["deep"]}, "draft": {"model": "", **EAGLE3}},
        "EAGLE-3 head folder made for the target": {
            "target": {"model": inputs["deep"]}, "draft": {"model": inputs["head"], **EAGLE3},
        },
        "P-EAGLE head from an EAGLE-3 head folder": {
            "target": {"model": inputs["deep"]}, "draft": {"model": inputs["head"], **PEAGLE},
        },
        "P-EAGLE head folder continued, for another block": {
            "target": {"model": inputs["deep"]}, "draft": {"model": inputs["peagle_dir"], **PEAGLE, "block_size": 6},
        },
        "DFlash folder continued at its block": {
            "target": {"model": inputs["deep"]},
            "draft": {"model": inputs["dflash_dir"], "kind": "dflash", "block_size": 4, "mask_token_id": 1},
        },
        "PARD folder continued": {
            "draft": {"model": inputs["pard_dir"], "kind": "pard", "mask_token_id": CHAR_VOCAB - 1},
        },
        "PARD draft from a causal LM": {"draft": {"kind": "pard"}},
        "eval rows held out of the training file (data.eval_split)": {"data": {"eval_prompts": ""}},
        "rows by data.prompt_field": {
            "data": {"train_prompts": inputs["text_rows"], "eval_prompts": inputs["text_eval"], "prompt_field": "text"}
        },
    }  # fmt: skip
    for name, sections in setups.items():
        try:
            check_inputs(recipe(inputs, tmp_path, **sections))
        except ValueError as err:
            pytest.fail(f"{name}: refused: {err}")
    assert not (tmp_path / "run").exists()


def test_distill_message_names_a_gguf_target_by_its_file(inputs, tmp_path, tiny_gguf):
    from decode import sources

    gguf_path = str(tiny_gguf[0])
    assert sources.load_tokenizer(gguf_path).name_or_path == gguf_path  # the bench's messages too
    with pytest.raises(ValueError, match="vocabulary mismatch") as e:
        check_inputs(recipe(inputs, tmp_path, target={"model": gguf_path}))
    assert gguf_path in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- python -m decode bench


BENCH_BAD = {
    "draft tokenizer differs": ("target", "swapped", "raw", ["error: vocabulary mismatch", "differ first at id 5"]),
    "draft of another, narrower tokenizer": ("bpe", "draft", "raw", ["error: vocabulary mismatch", "differ first"]),
    "chat rows, no chat template": ("target", "draft", "chat", ["error: chat prompts need a chat template"]),
    "unknown GGUF architecture as target": ("odd", "draft", "raw", ["error: --target", "'madeup'", "supported: "]),
    "unknown GGUF architecture as draft": ("target", "odd", "raw", ["error: --draft", "'madeup'", "supported: "]),
    "draft path with a typo, hub-id shaped": (
        "target",
        "typo/path",
        "raw",
        ["error: --draft 'typo/path' not found", "not in the local cache"],
    ),
    "draft path with a typo": ("target", "./typo/path", "raw", ["error: --draft './typo/path' not found", "fix the"]),
    "EAGLE-3 head for another target": (
        "deep",
        "head_bpe",
        "raw",
        ["error: EAGLE-3 head", "head_bpe", f"vocabulary {BPE_VOCAB}", "pass the target"],
    ),
}


@pytest.mark.parametrize("case", list(BENCH_BAD))
def test_bench_refuses_before_loading_weights(inputs, tmp_path, capsys, case):
    from decode.__main__ import main

    target, draft, prompts, needles = BENCH_BAD[case]
    out = tmp_path / "r.json"
    argv = ["bench", "--target", inputs[target], "--draft", inputs.get(draft, draft), "--prompts", inputs[prompts],
            "--json", str(out), "--samples-out", str(tmp_path / "s.jsonl"), "--plot", str(tmp_path / "p.png"),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len([line for line in lines if line.startswith("error:")]) == 1, lines
    assert all(n in lines[-1] for n in needles), lines[-1]
    assert not captured.out and sorted(p.name for p in tmp_path.iterdir()) == []


# ---------------------------------------------------------------- the GGUF header read


def test_gguf_architecture_reads_the_header_as_gguf_does(inputs, tiny_gguf, tmp_path):
    from gguf import GGUFReader

    from decode import sources

    for path in (str(tiny_gguf[0]), inputs["odd"]):
        field = GGUFReader(path).fields["general.architecture"]
        assert sources.gguf_architecture(path) == bytes(field.parts[field.data[0]]).decode()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(Path(tiny_gguf[0]).read_bytes()[:30])
    with pytest.raises(ValueError, match=r"cut.gguf' is not a readable GGUF file \(the GGUF header ends early"):
        sources.check_gguf(cut, key="target.model")


@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe", "gpt-oss", "minimax-m2"])
def test_llama_cpp_spellings_transformers_renames_are_accepted(tmp_path, arch):
    from decode import sources

    path = made_up_gguf(tmp_path / f"{arch}.gguf", arch)
    assert sources.check_gguf(path, key="target.model") == Path(path)


def test_mapping_sections_are_not_offered_as_architectures(tmp_path):
    from decode import sources

    with pytest.raises(ValueError, match="architecture 'general' cannot be loaded") as e:
        sources.check_gguf(made_up_gguf(tmp_path / "g.gguf", "general"), key="--draft")
    assert "tokenizer" not in str(e.value) and "llama" in str(e.value) and "qwen3moe" in str(e.value)
