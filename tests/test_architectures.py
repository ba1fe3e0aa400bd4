"""Every architecture in recipes/ end to end on tiny random models: decode, distil (LoRA), publish, HF assisted.

Per architecture a 2-layer, 64-dim target and draft share the tiny byte-level BPE tokenizer of tests/tiny.py
(320 tokens, id 0 = bos = eos = pad). For each:

1. draftsmith's speculative decoder, greedy, gives exactly `target.generate`'s tokens (batch 2, left padding);
2. `python train/distill.py` runs 2 LoRA steps (all-linear) and writes best/ and report.json;
3. `python train/publish.py --dry-run` writes a folder that loads with AutoModelForCausalLM, with the target's
   vocab_size;
4. HF assisted generation with the published draft gives exactly the target's own greedy tokens.

Plus the 4-bit NF4 target on CPU (bitsandbytes): distillation runs, and the speculative decoder reproduces the
quantized target's own greedy output.

The drafts are their targets plus weight noise (a Mixtral target's experts are near-copies of one MLP, so a
dense Mistral draft can follow it): acceptance is partial, so accept, reject and cache rollback all run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

from tests.tiny import BPE_VOCAB as VOCAB
from tests.tiny import make_prompts, make_tokenizer, tiny_config

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

EOS = 0  # = bos = pad in the tiny tokenizer

# test id: (target model_type, draft model_type, target vocab_size, draft vocab_size). Qwen2 and Pythia pad their
# embeddings past the tokenizer, differently for target and draft (Qwen2.5-7B: 152064 rows, 0.5B: 151936, tokenizer
# 151665; Pythia-12B: 50688, 70M: 50304): training compares the shared rows, publish pads the draft to the target's.
ARCHS = {
    "gemma2": ("gemma2", "gemma2", VOCAB, VOCAB),
    "gemma": ("gemma", "gemma", VOCAB, VOCAB),
    "mixtral-mistral": ("mixtral", "mistral", VOCAB, VOCAB),
    "gpt_neox": ("gpt_neox", "gpt_neox", VOCAB + 64, VOCAB + 16),
    "llama": ("llama", "llama", VOCAB, VOCAB),
    "qwen2": ("qwen2", "qwen2", VOCAB + 64, VOCAB + 32),
}
NOISE = 0.05  # draft = target + NOISE * std(weight) * N(0, 1): partial acceptance at initializer_range 0.2


def arch_config(model_type: str, vocab_size: int):
    """tests/tiny.py's 2-layer, 64-dim config of the arch, with ids 0 and 256 positions.

    Sliding windows of 16 (< prompt + new tokens) so decoding crosses them; initializer range 0.2, because at 0.02
    random models just repeat the last token and equality would be trivial.
    """
    return tiny_config(model_type, vocab_size, special_id=EOS, window=16, initializer_range=0.2)


def _draft_from_target(target, draft, gen: torch.Generator) -> None:
    """Copy the target's weights into the draft (+ noise), row-sliced where vocabularies differ. In place.

    A dense Mistral draft of a Mixtral target takes expert 0 as its MLP; the target's other experts are made
    near-copies of expert 0 first, so the mixture stays close to that MLP while routing still matters.
    """
    t_state = target.state_dict()
    if target.config.model_type == "mixtral":
        for key, value in t_state.items():
            if ".mlp.experts." in key:
                value[1:] = value[:1] + 0.2 * value[1:]
        for key in [k for k in t_state if k.endswith("mlp.experts.gate_up_proj")]:
            prefix = key.removesuffix("experts.gate_up_proj")
            gate, up = t_state[key][0].chunk(2, dim=0)  # [2 * intermediate, hidden]: gate rows first
            t_state[prefix + "gate_proj.weight"] = gate
            t_state[prefix + "up_proj.weight"] = up
            t_state[prefix + "down_proj.weight"] = t_state[prefix + "experts.down_proj"][0]
    for key, dst in draft.state_dict().items():
        src = t_state.get(key)
        if src is None or src.dim() != dst.dim():
            continue
        src = src[tuple(slice(0, n) for n in dst.shape)]
        if src.shape == dst.shape:
            dst.copy_(src + torch.randn(dst.shape, generator=gen) * NOISE * src.float().std().clamp_min(1e-3))


def build_pair(arch: str, root: Path, tokenizer) -> dict:
    """Save the arch's tiny target and draft (with the tokenizer) under root/arch; return their paths."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    t_type, d_type, t_vocab, d_vocab = ARCHS[arch]
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(arch_config(t_type, t_vocab), dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_config(arch_config(d_type, d_vocab), dtype=torch.float32).eval()
    with torch.no_grad():
        _draft_from_target(target, draft, torch.Generator().manual_seed(1))
        for model in (target, draft):
            # Rows past the tokenizer are padding: zero output rows, never the argmax (as in trained checkpoints).
            model.get_output_embeddings().weight[len(tokenizer) :] = 0
    paths = {}
    for name, model in (("target", target), ("draft", draft)):
        model.generation_config = GenerationConfig(bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS)
        paths[name] = root / arch / name
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    return {"arch": arch, "target": paths["target"], "draft": paths["draft"], "vocab": (t_vocab, d_vocab)}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("archs")
    tokenizer = make_tokenizer(root / "tokenizer")
    return {
        "root": root,
        "tokenizer": tokenizer,
        "train": make_prompts(root / "train.jsonl", 4, seed=1),
        "eval": make_prompts(root / "eval.jsonl", 2, seed=2),
        "pairs": {},
        "runs": {},
    }


@pytest.fixture(scope="module")
def pair(assets):
    """pair(arch) -> the arch's saved tiny target and draft, built once per module."""

    def get(arch: str) -> dict:
        if arch not in assets["pairs"]:
            assets["pairs"][arch] = build_pair(arch, assets["root"], assets["tokenizer"])
        return assets["pairs"][arch]

    return get


def load(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompt_batch(assets: dict, lengths: tuple[int, ...] = (37, 24)) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded eval prompts cut to `lengths` tokens: longer than gemma2's / mistral's sliding window (16)."""
    tok = assets["tokenizer"]
    rows = [json.loads(line)["prompt"] for line in Path(assets["eval"]).read_text().splitlines()]
    ids = [tok(text).input_ids[-n:] for text, n in zip(rows, lengths)]
    assert [len(i) for i in ids] == list(lengths)
    width = max(lengths)
    input_ids = torch.full((len(ids), width), EOS, dtype=torch.long)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for b, row in enumerate(ids):
        input_ids[b, width - len(row) :] = torch.tensor(row)
        mask[b, width - len(row) :] = 1
    return input_ids, mask


def until_eos(tokens: list[int]) -> list[int]:
    """New tokens up to and including the first EOS (generate pads after it; the decoder stops)."""
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


def hf_new_tokens(model, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, **kwargs) -> list[list[int]]:
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens, **kwargs)
    return [until_eos(row[ids.shape[1] :].tolist()) for row in out]


def assert_greedy_equal(target, draft, ids: torch.Tensor, mask: torch.Tensor) -> None:
    from decode.compat import check_vocab_compatible
    from decode.speculative import speculative_generate

    shared = check_vocab_compatible(target, draft)  # the draft may be narrower than a padded target
    out = speculative_generate(target, draft, ids, mask, max_new_tokens=16, num_draft_tokens=3, vocab=shared)
    batch = hf_new_tokens(target, ids, mask, 16)
    assert out.new_tokens == batch
    assert len({t for row in batch for t in row}) > 4, batch  # not a model that repeats one token
    # Each row alone, unpadded: left padding changed nothing.
    for b in range(ids.shape[0]):
        row = ids[b : b + 1, mask[b].bool()]
        assert hf_new_tokens(target, row, torch.ones_like(row), 16) == [out.new_tokens[b]]
    # The draft agrees sometimes and not always: accept, reject and rollback (with holes) all ran.
    assert 0 < out.stats.accepted < out.stats.drafted, (out.stats.accepted, out.stats.drafted)


# ---------------------------------------------------------------------------------------------------------------
# 1. decode: greedy speculative == target.generate
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(ARCHS))
def test_decode_greedy_equals_generate(arch, assets, pair):
    p = pair(arch)
    target, draft = load(p["target"]), load(p["draft"])
    assert [target.config.vocab_size, draft.config.vocab_size] == list(p["vocab"])
    assert_greedy_equal(target, draft, *prompt_batch(assets))


# ---------------------------------------------------------------------------------------------------------------
# 2-4. distil with LoRA -> publish --dry-run -> AutoModelForCausalLM -> HF assisted generation
# ---------------------------------------------------------------------------------------------------------------
def env() -> dict:
    e = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    e.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # see conftest's _one_thread; two jobs run at once
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("WANDB_DIR", None)
    return e


NF4 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "float32"}


def distill_recipe(assets: dict, p: dict, out: Path, target_extra: dict | None = None) -> dict:
    lora = {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["all-linear"]}
    return {
        "target": {"model": str(p["target"]), "dtype": "float32", **(target_extra or {})},
        "draft": {"model": str(p["draft"]), "dtype": "float32", "lora": lora},
        "data": {"train_prompts": str(assets["train"]), "eval_prompts": str(assets["eval"]), "max_prompt_tokens": 32},
        # mix: target rollouts through the speculative decoder and on-policy batches through the LoRA draft
        "distill": {"loss": "jsd", "source": "mix", "max_new_tokens": 8},
        "train": {"lr": 1e-3, "max_steps": 2, "batch_size": 2, "warmup_steps": 0, "seed": 0},
        # batch 2: the eval decodes both prompts at once (left padding) through each architecture
        "eval": {"every": 2, "num_prompts": 2, "max_new_tokens": 8, "num_draft_tokens": 3, "batch_size": 2},
        "log": {"report_to": "none"},
        "output_dir": str(out),
    }


class Jobs:
    """The distill (+ publish) subprocesses of the selected tests, two at a time in the background.

    Each interpreter spends most of its time importing torch / transformers / peft on one core, so two run side
    by side (one thread each) while this process runs the in-process tests; a test waits for its own job only.
    """

    def __init__(self, assets: dict, pair, keys: list[str], root: Path):
        self.procs: list[subprocess.Popen] = []
        self.pool = ThreadPoolExecutor(max_workers=2)
        self.futures = {key: self.pool.submit(self._job, assets, pair(key.removeprefix("nf4-")), key, root / key)
                        for key in keys}  # fmt: skip

    def _run(self, *cmd: str) -> subprocess.CompletedProcess:
        proc = subprocess.Popen(
            [sys.executable, *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO
        )
        self.procs.append(proc)
        try:
            out, err = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def _job(self, assets: dict, p: dict, key: str, root: Path) -> dict:
        root.mkdir(parents=True)
        out, published = root / "run", root / "published"
        recipe = root / "recipe.yaml"
        extra = {"quantization": NF4} if key.startswith("nf4-") else None
        recipe.write_text(yaml.safe_dump(distill_recipe(assets, p, out, target_extra=extra)))
        job = {"out": out, "published": published, "distill": self._run("train/distill.py", "--recipe", str(recipe))}
        if job["distill"].returncode == 0 and not extra:
            repo_id = f"someone/tiny-{key}-draft"
            job["publish"] = self._run("train/publish.py", str(out), "--repo-id", repo_id, "--dry-run", str(published))
        return job

    def result(self, key: str) -> dict:
        return self.futures[key].result()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _selected_jobs(session) -> list[str]:
    """Job keys of this module's selected distill tests, in test order (`-k qwen2` starts only qwen2's)."""
    keys = []
    for item in session.items:
        if Path(str(item.path)) != Path(__file__):
            continue
        if item.originalname == "test_distill_lora_publish_and_hf_assisted":
            keys.append(item.callspec.params["arch"])
        elif item.originalname == "test_nf4_target_distill_and_decode":
            keys.append(f"nf4-{NF4_ARCH}")
    return keys


@pytest.fixture(scope="module", autouse=True)
def jobs(request, assets, pair, tmp_path_factory):
    """Started as the module starts, so the decode tests overlap with the subprocesses."""
    started = Jobs(assets, pair, _selected_jobs(request.session), tmp_path_factory.mktemp("jobs"))
    yield started
    started.close()


def check_distill_run(job: dict) -> Path:
    proc, out = job["distill"], job["out"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "best" / "config.json").is_file()
    assert (out / "best" / "adapter" / "adapter_config.json").is_file()  # a LoRA run
    report = json.loads((out / "report.json").read_text())
    assert [c["step"] for c in report["checkpoints"]] == [0, 2]
    assert report["best"]["outputs_match_target"] is True  # the eval's own greedy check, batch 2
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
def test_distill_lora_publish_and_hf_assisted(arch, assets, pair, jobs):
    from transformers import AutoConfig, AutoTokenizer

    p = pair(arch)
    job = jobs.result(arch)
    check_distill_run(job)
    proc, published = job["publish"], job["published"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("model.safetensors", "config.json", "generation_config.json", "README.md", "draftsmith_eval.json"):
        assert (published / name).is_file(), name
    t_vocab = AutoConfig.from_pretrained(p["target"]).vocab_size
    draft = load(published)
    assert draft.config.vocab_size == t_vocab == draft.get_input_embeddings().weight.shape[0]
    assert draft.get_output_embeddings().weight.shape[0] == t_vocab
    info = json.loads((published / "draftsmith_eval.json").read_text())
    assert info["vocab_size"] == {"draft": ARCHS[arch][3], "target": t_vocab, "published": t_vocab}
    assert draft.config.model_type == ARCHS[arch][1]
    assert len(AutoTokenizer.from_pretrained(published)) == len(assets["tokenizer"])

    # HF assisted generation (batch 1) with the published draft: exactly the target's greedy tokens.
    target = load(p["target"])
    ids, mask = prompt_batch(assets, (30,))
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    assert len(set(plain[0, 30:].tolist())) > 3, plain
    calls = []
    draft.register_forward_hook(lambda *_: calls.append(1))
    assisted = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, assistant_model=draft)
    assert calls, "HF did not call the assistant"
    assert assisted.tolist() == plain.tolist()


# ---------------------------------------------------------------------------------------------------------------
# 5. 4-bit NF4 target on CPU (bitsandbytes)
# ---------------------------------------------------------------------------------------------------------------
NF4_ARCH = "llama"


def test_nf4_target_distill_and_decode(assets, pair, jobs):
    pytest.importorskip("bitsandbytes")
    from distill.config import ModelConfig, QuantConfig
    from distill.models import load_target

    p = pair(NF4_ARCH)
    out = check_distill_run(jobs.result(f"nf4-{NF4_ARCH}"))
    assert yaml.safe_load((out / "resolved_recipe.yaml").read_text())["target"]["quantization"]["load_in_4bit"]
    cfg = ModelConfig(model=str(p["target"]), dtype="float32", quantization=QuantConfig(**NF4))
    target = load_target(cfg, device="cpu")
    assert getattr(target, "is_loaded_in_4bit", False)
    # The reference is the quantized target's own greedy output, not the float one's.
    assert_greedy_equal(target, load(out / "best"), *prompt_batch(assets))
