"""EAGLE-3 heads others trained (decode/kinds/eagle3/formats.py): the speculators format (with every variant vLLM
serves: ``norm_before_fc``, ``fc_norm``, ``norm_before_residual``, ``norm_output``), SafeAILab's original layout and
SpecForge's export, each written here from its documented layout (tensor names, config keys), read into the native
head.

The reference each converted head is checked against is the original layout's own computation (speculators' and
vLLM's first decoder layer: fused-feature norms, fc, split, norms, the residual it names, Llama attention and MLP,
final norm, lm_head, the output fed back), written from the same tensors. Where the speculators package imports
(its dependencies pin another torch, so it lives in its own environment: ``SPECULATORS_PYTHON``, else this
interpreter), heads are also written by its own ``Eagle3DraftModel`` and checked against its own forward
(tests/speculators_head.py); elsewhere those tests skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from decode.kinds.eagle3 import decoding as eagle3
from decode.kinds.eagle3 import formats as eagle3_formats
from tests.test_distill_e2e import error_line, launch, run_script, write_recipe
from tests.test_eagle3_train import head_recipe
from tests.tiny import make_pair, make_prompts

REPO = Path(__file__).resolve().parent.parent
LLAMA_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "rms_norm_eps", "rope_theta", "bos_token_id", "eos_token_id",
)  # fmt: skip


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("formats")
    target_dir, _ = make_pair(root)
    return {
        "root": root,
        "target": target_dir,
        "model": AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval(),
        "train": make_prompts(root / "train.jsonl", 40, seed=1),
        "eval": make_prompts(root / "eval.jsonl", 6, seed=2),
    }


def trained_tensors(target, norm_before_fc: bool = False, aux=None, fc_norm: bool = False) -> tuple[dict, dict]:
    """(native config dict, tensors) of a head with varied weights (as a trained one has), over every 2nd token."""
    torch.manual_seed(3)
    head = eagle3.build(target, list(range(0, target.config.vocab_size, 2)), aux_layers=aux)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    tensors = {k: v.detach().clone() for k, v in head.state_dict().items() if not k.startswith("embed_tokens.")}
    ids = head.draft_ids
    tensors["d2t"] = ids - torch.arange(len(ids))
    tensors["t2d"] = torch.zeros(head.vocab, dtype=torch.bool).index_fill_(0, ids, True)
    if norm_before_fc:
        tensors["input_norm.weight"] = 1 + 0.3 * torch.randn(3 * head.config.target_hidden_size)
    for i in range(3 if fc_norm else 0):
        tensors[f"fc_norm.{i}.weight"] = 1 + 0.3 * torch.randn(head.config.target_hidden_size)
    return eagle3.served_config(head), tensors


def flat_llama(native: dict) -> dict:
    """The flat Llama keys SafeAILab's and SpecForge's configs carry."""
    return {k: native[k] for k in LLAMA_KEYS} | {"model_type": "llama", "num_hidden_layers": 1, "hidden_act": "silu",
                                                 "tie_word_embeddings": False, "torch_dtype": "float32"}  # fmt: skip


def write_speculators(out: Path, native: dict, tensors: dict, embed: torch.Tensor, **variant) -> Path:
    """The speculators layout: nested transformer_layer_config, layers.0.*, the target's embedding included."""
    out.mkdir(parents=True)
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "transformer_layer_config": {**flat_llama(native), "architectures": ["LlamaForCausalLM"]},
        "draft_vocab_size": native["draft_vocab_size"],
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": native["eagle_aux_hidden_state_layer_ids"],
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                               "verifier": {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]}},
        **variant,
    }  # fmt: skip
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    save_file({**renamed, "embed_tokens.weight": embed.contiguous()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


def write_eagle(out: Path, native: dict, tensors: dict, embed: torch.Tensor) -> Path:
    """SafeAILab's original EAGLE-3 release: flat config, no layer ids, pytorch_model.bin with the embedding."""
    out.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLMEagle3"], **flat_llama(native),
              "draft_vocab_size": native["draft_vocab_size"]}  # fmt: skip
    torch.save({**tensors, "embed_tokens.weight": embed}, out / "pytorch_model.bin")
    (out / "config.json").write_text(json.dumps(config))
    return out


def write_specforge(out: Path, native: dict, tensors: dict) -> Path:
    """SpecForge's SGLang export: flat config, SGLang's layer ids in eagle_config, model.safetensors, no embedding."""
    out.mkdir(parents=True)
    sglang_ids = [a - 1 for a in native["eagle_aux_hidden_state_layer_ids"]]
    config = {"architectures": ["LlamaForCausalLMEagle3"], **flat_llama(native),
              "draft_vocab_size": native["draft_vocab_size"], "target_hidden_size": native["target_hidden_size"],
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_ids, "use_aux_hidden_state": True},
              "norm_output": False}  # fmt: skip
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_layer(
    t: dict,
    native: dict,
    embeds: torch.Tensor,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    nbr: bool,
    past: tuple | None = None,
):
    """The original layout's decoder layer (speculators' Eagle3FirstLayerMixin, vLLM's llama_eagle3), from raw
    tensors: (pre-norm output [S, H], keys, values). ``embeds``, ``hidden`` [S, H]; ``past``: keys and values
    [1, heads, P, d] of earlier positions, every one visible (None: causal over these S alone)."""
    eps, heads, kv = native["rms_norm_eps"], native["num_attention_heads"], native["num_key_value_heads"]
    d = native["head_dim"]
    normed = rms(hidden, t["midlayer.hidden_norm.weight"], eps)
    residual = normed if nbr else hidden
    inp = torch.cat([rms(embeds, t["midlayer.input_layernorm.weight"], eps), normed], -1)
    s = inp.shape[0]
    q = (inp @ t["midlayer.self_attn.q_proj.weight"].T).view(1, s, heads, d).transpose(1, 2)
    k = (inp @ t["midlayer.self_attn.k_proj.weight"].T).view(1, s, kv, d).transpose(1, 2)
    v = (inp @ t["midlayer.self_attn.v_proj.weight"].T).view(1, s, kv, d).transpose(1, 2)
    rotary = LlamaRotaryEmbedding(LlamaConfig(**{k: native[k] for k in LLAMA_KEYS}))
    q, k = apply_rotary_pos_emb(q, k, *rotary(inp, positions[None]))
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
    attn = F.scaled_dot_product_attention(q, keys, values, is_causal=past is None)
    h = residual + attn.transpose(1, 2).reshape(s, heads * d) @ t["midlayer.self_attn.o_proj.weight"].T
    m = rms(h, t["midlayer.post_attention_layernorm.weight"], eps)
    mlp = (F.silu(m @ t["midlayer.mlp.gate_proj.weight"].T) * (m @ t["midlayer.mlp.up_proj.weight"].T)) @ t[
        "midlayer.mlp.down_proj.weight"
    ].T
    return h + mlp, keys, values


def reference_step(t: dict, native: dict, embeds: torch.Tensor, features: torch.Tensor, flags: dict, nxt=None):
    """The original layout's first step over a sequence, from raw tensors: (draft logits [S, Vd], the output it
    feeds back [S, H]); with ``nxt`` ([1, H], the next token's embedding) also the logits [Vd] of one chain step
    at the last position (it reads the fed-back output and attends to every position before it and itself).

    The variants, as vLLM's llama_eagle3 computes them: ``norm_before_fc`` (input_norm over the fused features),
    then ``fc_norm`` (one norm per target layer), fc; ``norm_before_residual``; ``norm_output`` (post-norm fed
    back)."""
    eps = native["rms_norm_eps"]
    x = rms(features, t["input_norm.weight"], eps) if flags.get("norm_before_fc") else features
    if flags.get("fc_norm"):
        x = torch.cat([rms(part, t[f"fc_norm.{i}.weight"], eps) for i, part in enumerate(x.chunk(3, -1))], -1)
    nbr = bool(flags.get("norm_before_residual"))
    s = features.shape[0]
    prenorm, keys, values = reference_layer(t, native, embeds, x @ t["fc.weight"].T, torch.arange(s), nbr)
    normed = rms(prenorm, t["norm.weight"], eps)
    fed = normed if flags.get("norm_output") else prenorm
    logits = normed @ t["lm_head.weight"].T
    if nxt is None:
        return logits, fed
    chain, _, _ = reference_layer(t, native, nxt, fed[-1:], torch.tensor([s]), nbr, (keys, values))
    return logits, fed, (rms(chain, t["norm.weight"], eps) @ t["lm_head.weight"].T)[0]


def head_step(head: eagle3.Eagle3Head, ids: torch.Tensor, features: torch.Tensor):
    cache = eagle3.Eagle3Cache(1, features.device)
    valid = torch.ones(ids.shape, dtype=torch.bool)
    with torch.no_grad():
        logits, prenorm = head(ids, features, cache.positions(valid), cache, valid, fused=True)
    return logits[0], prenorm[0]


FORMATS = {
    "speculators": {},
    "speculators norm_before_residual": {"norm_before_residual": True},
    "speculators norm_before_fc": {"norm_before_fc": True},
    "speculators both (the speculators trainer's defaults)": {"norm_before_residual": True, "norm_before_fc": True},
    "eagle": None,
    "specforge": None,
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_head_in_each_format_computes_what_its_layout_does(assets, tmp_path, name):
    """Each format read into the native head: the same aux layers, draft vocabulary, and logits / fed-back output
    equal to the original layout's computation from the same tensors."""
    target = assets["model"]
    variant = FORMATS[name] or {}
    nbr, nbf = bool(variant.get("norm_before_residual")), bool(variant.get("norm_before_fc"))
    aux = None if name == "eagle" else [1, 2, 3]  # SafeAILab names none: the default layers
    native, tensors = trained_tensors(target, nbf, aux)
    embed = target.get_input_embeddings().weight.detach()
    folder = tmp_path / "head"
    if name.startswith("speculators"):
        write_speculators(folder, native, tensors, embed, **variant)
    elif name == "eagle":
        write_eagle(folder, native, tensors, embed)
    else:
        write_specforge(folder, native, tensors)
    assert eagle3.is_eagle3(folder)
    _, _, fmt = eagle3_formats.read(folder, 4)
    assert fmt == name.split()[0]
    head = eagle3.load(folder, target).eval()
    assert head.aux_layers == native["eagle_aux_hidden_state_layer_ids"]
    assert head.draft_ids.tolist() == list(range(0, target.config.vocab_size, 2))
    torch.manual_seed(5)
    ids = torch.randint(0, target.config.vocab_size, (1, 9))
    features = torch.randn(1, 9, 3 * native["target_hidden_size"]) * 2
    want_logits, want_prenorm = reference_step(tensors, native, embed[ids[0]], features[0], variant)
    got_logits, got_prenorm = head_step(head, ids, features)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_prenorm, want_prenorm, rtol=1e-4, atol=1e-4)
    # Saved again it is the native layout, with the variant kept (vLLM reads both keys from the flat config).
    again = eagle3.save(head, tmp_path / "native")
    config = json.loads((again / "config.json").read_text())
    assert config["norm_before_residual"] is nbr and config.get("norm_before_fc", False) is nbf
    assert "speculators_config" not in config and "transformer_layer_config" not in config
    torch.testing.assert_close(head_step(eagle3.load(again, target), ids, features)[0], want_logits)


# Every variant switch vLLM's speculators reader serves, alone, none, all, and the speculators trainer's defaults.
FLAGS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")
COMBINATIONS = {
    "none": {},
    **{key: {key: True} for key in FLAGS},
    "all": dict.fromkeys(FLAGS, True),
    "speculators trainer defaults": {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True},
}


def write_variant(folder: Path, target, flags: dict) -> tuple[dict, dict]:
    """A speculators head with exactly ``flags`` on (every switch written, as speculators writes them)."""
    native, tensors = trained_tensors(
        target, flags.get("norm_before_fc", False), [1, 2, 3], flags.get("fc_norm", False)
    )
    variant = {key: bool(flags.get(key)) for key in FLAGS}
    write_speculators(folder, native, tensors, target.get_input_embeddings().weight.detach(), **variant)
    return native, tensors


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_every_variant_vllm_serves_computes_what_it_names_and_is_lossless(assets, tmp_path, name):
    """Each combination of the variant switches: the decoder's forward and chain step and the training unroll
    equal the layout's reference computation, greedy decoding equals target-only, and saved again the head keeps
    its switches."""
    from decode.speculative import speculative_generate, target_generate

    target, flags = assets["model"], COMBINATIONS[name]
    native, tensors = write_variant(tmp_path / "head", target, flags)
    head = eagle3.load(tmp_path / "head", target).eval()
    embed = target.get_input_embeddings().weight.detach()
    torch.manual_seed(5)
    s = 9
    ids = torch.randint(0, target.config.vocab_size, (1, s + 1))  # the last one: the chain step's token
    features = torch.randn(1, s + 2, 3 * native["target_hidden_size"]) * 2
    want, want_fed, want_chain = reference_step(tensors, native, embed[ids[0, :s]], features[0, :s], flags,
                                                nxt=embed[ids[0, s:]])  # fmt: skip
    # The decoder: one fused read of the sequence, then a chain step from the output it feeds back.
    cache = eagle3.Eagle3Cache(1, features.device)
    one = torch.ones(1, s, dtype=torch.bool)
    with torch.no_grad():
        logits, fed = head(ids[:, :s], features[:, :s], cache.positions(one), cache, one, fused=True)
        chain, _ = head(ids[:, s:], fed[:, -1:], cache.positions(one[:, :1]), cache, one[:, :1], fused=False)
    torch.testing.assert_close(logits[0], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fed[0], want_fed, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chain[0, 0], want_chain, rtol=1e-4, atol=1e-4)
    # Training: step 0 at position i reads token i + 1 of its sequence; step 1 at s - 1 reads the chain's token.
    seq = torch.cat([ids.new_zeros(1, 1), ids, ids.new_zeros(1, 1)], 1)[:, : s + 2]
    with torch.no_grad():
        steps = head.unrolled(seq, features, torch.arange(s + 2)[None], torch.ones(1, s + 2, dtype=torch.bool), 2)
    torch.testing.assert_close(steps[0][0, :s], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(steps[1][0, s - 1], want_chain, rtol=1e-4, atol=1e-4)
    prompt = torch.randint(0, target.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(3))
    out = speculative_generate(target, head, prompt, max_new_tokens=16, num_draft_tokens=3, eos_token_id=[])
    assert out.new_tokens == target_generate(target, prompt, max_new_tokens=16, eos_token_id=[]).new_tokens
    again = eagle3.save(head, tmp_path / "native")
    config = json.loads((again / "config.json").read_text())
    assert {key: bool(config.get(key)) for key in FLAGS} == {key: bool(flags.get(key)) for key in FLAGS}
    with torch.no_grad():
        reloaded = eagle3.load(again, target)(ids[:, :s], features[:, :s], torch.arange(s)[None],
                                               eagle3.Eagle3Cache(1, features.device), fused=True)  # fmt: skip
    torch.testing.assert_close(reloaded[0][0], want, rtol=1e-4, atol=1e-4)


def speculators_python() -> str | None:
    """An interpreter where ``speculators.models.eagle3`` imports: ``SPECULATORS_PYTHON``, else this one."""
    python = os.environ.get("SPECULATORS_PYTHON", sys.executable)
    probe = subprocess.run([python, "-c", "import speculators.models.eagle3"], capture_output=True, timeout=300)
    return python if probe.returncode == 0 else None


SPECULATORS_COMBINATIONS = {  # speculators refuses norm_before_fc with fc_norm
    name: flags for name, flags in COMBINATIONS.items() if not (flags.get("norm_before_fc") and flags.get("fc_norm"))
}
SPECULATORS_COMBINATIONS["fc_norm, norm_before_residual, norm_output"] = {
    "fc_norm": True, "norm_before_residual": True, "norm_output": True
}  # fmt: skip


@pytest.fixture(scope="module")
def speculators_heads(assets) -> dict[str, Path]:
    """A head folder per :data:`SPECULATORS_COMBINATIONS` entry, written by the speculators package itself."""
    python = speculators_python()
    if python is None:
        pytest.skip("the speculators package does not import (set SPECULATORS_PYTHON to an interpreter that has it)")
    root = assets["root"] / "speculators"
    folders = {name: root / str(i) for i, name in enumerate(SPECULATORS_COMBINATIONS)}
    heads = {str(folders[name]): flags for name, flags in SPECULATORS_COMBINATIONS.items()}
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [python, str(REPO / "tests" / "speculators_head.py"), str(assets["target"]), json.dumps(heads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folders


@pytest.mark.parametrize("name", list(SPECULATORS_COMBINATIONS))
def test_a_head_the_speculators_package_writes_computes_its_forward(assets, speculators_heads, name):
    """speculators' own Eagle3DraftModel, saved with save_pretrained: draftsmith's training unroll gives the
    logits of every training-time-test step of its forward, and greedy decoding with it equals target-only."""
    from decode.speculative import speculative_generate, target_generate

    flags, folder = SPECULATORS_COMBINATIONS[name], speculators_heads[name]
    target = assets["model"]
    head = eagle3.load(folder, target).eval()
    assert {key: bool(getattr(head.config, key, False)) for key in FLAGS} == {k: bool(flags.get(k)) for k in FLAGS}
    ref = torch.load(folder / "reference.pt")
    ids, s = ref["input_ids"], ref["input_ids"].shape[1]
    # speculators' step k at position i reads token i + k; draftsmith's reads token i + k + 1 of its sequence.
    seq = torch.cat([ids.new_zeros(1, 1), ids[:, :-1]], 1)
    with torch.no_grad():
        steps = head.unrolled(seq, ref["hidden_states"], ref["position_ids"], torch.ones(1, s, dtype=torch.bool), 3)
    for k, want in enumerate(ref["logits"]):
        torch.testing.assert_close(steps[k][0, : s - k - 1], want[: s - k - 1], rtol=1e-4, atol=1e-4, msg=f"step {k}")
    prompt = torch.randint(0, target.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(3))
    out = speculative_generate(target, head, prompt, max_new_tokens=16, num_draft_tokens=3, eos_token_id=[])
    assert out.new_tokens == target_generate(target, prompt, max_new_tokens=16, eos_token_id=[]).new_tokens


@pytest.mark.parametrize(
    "variant, needle",
    [
        ({"norm_output": "yes"}, r"speculators EAGLE-3 head '.*config.json': norm_output is 'yes', not true or false"),
        ({"speculators_model_type": "dflash"}, "speculators_model_type 'dflash'"),
        ({"specforge": True, "norm_output": True}, r"specforge EAGLE-3 head '.*config.json' sets norm_output: true"),
    ],
)
def test_a_variant_the_head_does_not_compute_is_one_line_naming_it(assets, tmp_path, variant, needle):
    native, tensors = trained_tensors(assets["model"], aux=[1, 2, 3])
    embed = assets["model"].get_input_embeddings().weight.detach()
    if variant.pop("specforge", False):  # a flat config's norm_output: SpecForge means another norm by it
        folder = write_specforge(tmp_path / "head", native, tensors)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **variant}))
    else:
        folder = write_speculators(tmp_path / "head", native, tensors, embed, **variant)
    with pytest.raises(ValueError, match=needle) as err:
        eagle3.load(folder, assets["model"])
    assert "\n" not in str(err.value)


def test_other_layers_and_unknown_layouts_are_refused(assets, tmp_path):
    native, tensors = trained_tensors(assets["model"], aux=[1, 2, 3])
    embed = assets["model"].get_input_embeddings().weight.detach()
    qwen = write_speculators(tmp_path / "qwen", native, tensors, embed)
    config = json.loads((qwen / "config.json").read_text())
    config["transformer_layer_config"]["model_type"] = "qwen3"
    (qwen / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="transformer_layer_config.model_type 'qwen3'"):
        eagle3.load(qwen, assets["model"])
    two = write_specforge(tmp_path / "two", native, tensors)
    (two / "config.json").write_text(json.dumps({**json.loads((two / "config.json").read_text()),
                                                 "num_hidden_layers": 2}))  # fmt: skip
    with pytest.raises(ValueError, match="num_hidden_layers: 2: draftsmith's EAGLE-3 head has one layer"):
        eagle3.load(two, assets["model"])
    odd = tmp_path / "odd"
    odd.mkdir()
    save_file({"model.layers.0.weight": torch.zeros(2)}, str(odd / "model.safetensors"))
    (odd / "config.json").write_text(json.dumps({"architectures": ["MyEagle3Draft"], "depth": 1}))
    with pytest.raises(ValueError, match=r"not an EAGLE-3 head draftsmith reads .* config keys \['architectures', "
                       r"'depth'\], tensor prefixes \['model'\]"):  # fmt: skip
        eagle3.load(odd, assets["model"])


def _bench(target: str, draft: Path, prompts: Path, out: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "decode", "bench", "--target", target, "--draft", str(draft), "--prompts",
           str(prompts), "--max-new-tokens", "8", "--num-draft-tokens", "3", "--repeats", "1", "--baselines", "target",
           "--dtype", "float32", "--no-progress", "--json", str(out)]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600, env=env)


def test_decode_bench_measures_a_speculators_head_and_refuses_another_targets(assets, tmp_path):
    """``python -m decode bench --draft HEAD`` on a speculators-format head: lossless greedy output, acceptance
    measured; a head for a target of another hidden size is one error line, nothing written."""
    native, tensors = trained_tensors(assets["model"], norm_before_fc=True, aux=[1, 2, 3])
    embed = assets["model"].get_input_embeddings().weight.detach()
    head = write_speculators(tmp_path / "head", native, tensors, embed, norm_before_fc=True, norm_before_residual=True)
    proc = _bench(str(assets["target"]), head, assets["eval"], tmp_path / "bench.json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["draft_kind"] == "eagle3" and result["outputs_match_target"] is True
    assert 0 <= result["acceptance_rate"] <= 1 and result["rounds"] > 0
    wide = json.loads((head / "config.json").read_text())
    wide["transformer_layer_config"]["hidden_size"] = 2 * native["hidden_size"]
    (head / "config.json").write_text(json.dumps(wide))
    line = error_line(_bench(str(assets["target"]), head, assets["eval"], tmp_path / "wide.json"))
    assert line.startswith("error: EAGLE-3 head") and "pass the target it was trained on" in line
    assert not (tmp_path / "wide.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["speculators", "eagle"])
def test_distill_continues_training_a_head_others_trained(assets, tmp_path, fmt):
    """draft.model: HEAD in another trainer's layout: the run starts from its weights (step 0 measures that head)
    and writes native checkpoints that name the recipe's target for vLLM."""
    target = assets["model"]
    native, tensors = trained_tensors(target)  # the default layers: SafeAILab's head names none
    embed = target.get_input_embeddings().weight.detach()
    head = tmp_path / "head"
    if fmt == "speculators":
        write_speculators(head, native, tensors, embed)
    else:
        write_eagle(head, native, tensors, embed)
    out = tmp_path / "run"
    recipe = head_recipe(assets, out, draft={"model": str(head), "vocab_subset": native["draft_vocab_size"]},
                         train={"max_steps": 3}, eval={"every": 3})  # fmt: skip
    proc = launch(write_recipe(tmp_path, recipe))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "draft vocabulary of" in proc.stdout and "tokens (the loaded head's own)" in proc.stdout  # every 2nd id
    start = eagle3.load(out / "checkpoints" / "step-0", target)
    for name, value in tensors.items():
        if name in start.state_dict():
            torch.testing.assert_close(start.state_dict()[name], value, msg=name)
    best = json.loads((out / "best" / "config.json").read_text())
    assert best["draftsmith"]["draft_kind"] == "eagle3" and "midlayer" not in json.dumps(best)
    verifier = best["speculators_config"]["verifier"]["name_or_path"]
    assert verifier == str(Path(assets["target"]).resolve())


@pytest.mark.slow
def test_distill_continues_a_head_with_the_speculators_trainer_defaults(assets, tmp_path):
    """draft.model: a speculators head with norm_before_fc, norm_before_residual and norm_output on (what the
    speculators trainer writes by default) trains on and is saved back with its variant intact."""
    target, flags = assets["model"], COMBINATIONS["speculators trainer defaults"]
    native, tensors = write_variant(tmp_path / "head", target, flags)
    out = tmp_path / "run"
    recipe = head_recipe(assets, out, draft={"model": str(tmp_path / "head")}, train={"max_steps": 2},
                         eval={"every": 2})  # fmt: skip
    proc = launch(write_recipe(tmp_path, recipe))
    assert proc.returncode == 0, proc.stderr[-3000:]
    best = json.loads((out / "best" / "config.json").read_text())
    assert {key: bool(best.get(key)) for key in FLAGS} == {key: bool(flags.get(key)) for key in FLAGS}
    head = eagle3.load(out / "best", target)
    assert head.norm_output and hasattr(head, "input_norm") and not hasattr(head, "fc_norm")
    moved = [k for k, v in head.state_dict().items() if k in tensors and not torch.equal(v, tensors[k])]
    assert "fc.weight" in moved  # trained from the loaded weights, not rebuilt


def write_peagle(folder: Path, target, **config) -> Path:
    """A speculators P-EAGLE head (``mask_hidden`` beside the EAGLE-3 tensors); ``config``: keys to set, or to
    drop when None."""
    native, tensors = trained_tensors(target, aux=[1, 2, 3])
    tensors["mask_hidden"] = torch.randn(1, 3 * native["target_hidden_size"])
    embed = target.get_input_embeddings().weight.detach()
    write_speculators(folder, native, tensors, embed, speculators_model_type="peagle", mask_token_id=1)
    raw = {**json.loads((folder / "config.json").read_text()), **config}
    (folder / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    return folder


@pytest.mark.parametrize(
    "config, needle",
    [
        ({"mask_token_id": None}, "lacks mask_token_id"),
        ({"mask_token_id": "<mask>"}, "mask_token_id is '<mask>', not an integer"),
        ({"speculators_config": None}, "lacks block_size"),
        ({"block_size": 0}, "block_size is 0, not an integer >= 1"),
        ({"draft_vocab_size": "half"}, "draft_vocab_size is 'half', not an integer"),
    ],
)
def test_a_peagle_head_with_a_missing_or_wrong_key_is_one_line_naming_it(assets, tmp_path, config, needle):
    target = assets["model"]
    good = eagle3.load(write_peagle(tmp_path / "good", target), target)
    assert good.parallel and good.block_size == 3 and int(good.config.mask_token_id) == 1
    folder = write_peagle(tmp_path / "head", target, **config)
    with pytest.raises(ValueError, match=needle) as err:
        eagle3.load(folder, target)
    assert str(err.value).startswith("speculators P-EAGLE head ") and "\n" not in str(err.value)
    assert str(folder / "config.json") in str(err.value)


def test_a_layer_config_missing_a_shape_key_is_one_line_naming_it(assets, tmp_path):
    native, tensors = trained_tensors(assets["model"], aux=[1, 2, 3])
    embed = assets["model"].get_input_embeddings().weight.detach()
    folder = write_speculators(tmp_path / "head", native, tensors, embed)
    config = json.loads((folder / "config.json").read_text())
    del config["transformer_layer_config"]["intermediate_size"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"speculators EAGLE-3 head .* lacks transformer_layer_config.intermediate"):
        eagle3.load(folder, assets["model"])


def test_a_peagle_head_without_mask_token_id_is_one_error_line_in_bench_and_training(assets, tmp_path):
    """Both entry points: ``python -m decode bench --draft HEAD`` and ``train/distill.py`` with HEAD as
    draft.model print one error line naming the key, the format and the file, exit 2, and write nothing."""
    head = write_peagle(tmp_path / "head", assets["model"], mask_token_id=None)
    want = f"error: speculators P-EAGLE head {str(head / 'config.json')!r} lacks mask_token_id"
    line = error_line(_bench(str(assets["target"]), head, assets["eval"], tmp_path / "bench.json"))
    assert line.startswith(want) and not (tmp_path / "bench.json").exists()
    out = tmp_path / "run"
    recipe = head_recipe(assets, out, draft={"kind": "peagle", "model": str(head)}, train={"max_steps": 1})
    line = error_line(run_script("--recipe", str(write_recipe(tmp_path, recipe))))
    assert line.startswith(want) and not out.exists()
