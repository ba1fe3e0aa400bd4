"""Side-by-side timing: draftsmith's speculative decoder vs target-only decoding vs HF assisted generation.

Protocol (docs/bench.md, "Timing method"): one warm-up pass of every method, then the methods interleaved batch by
batch (their order rotating between repeats, so no method always runs on a warmer cache), ``repeats`` times;
per batch the median time over repeats, summed over batches. The target-only speed is the faster of
draftsmith's own loop and ``model.generate``: speedups are never measured against a slow baseline. c and v are
medians of standalone KV-cached forwards of the same models in the same run.

On CPU both of draftsmith's loops run the models' linear layers through ``decode.kernels``; HF assisted
generation is timed as HF runs it and, where those kernels apply, once more with them
(``hf_assisted_same_kernels``), so the gain over HF splits into kernels and decoding loop.

HF assisted generation runs twice: with transformers' default assistant settings (``hf_assisted``) and as a
published draft's generation_config sets it (``hf_assisted_published``: gamma tokens, constant, no early stop).
Every ``model.generate`` call runs on a generation config built from the bench's own settings alone, never on
the one a model ships (repetition penalties, minimum lengths, suppressed tokens would change the work done and
the output compared).

``speedup.vs_target_ci95`` is a 95% bootstrap interval from the paired per-batch timings (per repeat with a single
batch). With several batches it holds the spread between prompts, not only the timing noise: two checkpoints
benched on the same prompts are compared by their per-batch speedups (``speedup_per_batch``), pair by pair.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib.metadata
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import GenerationConfig

from decode import kernels, kinds
from decode.compat import check_context, check_vocab_compatible, logits_width, text_config, with_rows
from decode.draft_length import AutoDraftLength, TreeShape, is_tree_spec, parse_tree
from decode.draft_vocab import with_subset_head
from decode.files import UnwrittenOutput, os_reason, write_whole
from decode.kinds.dispatch import BLOCK_KINDS, forwards_per_round, kind_of
from decode.metrics import (
    ForwardCostMeter,
    acceptance_metrics,
    best_block,
    leviathan_bound,
    solve_acceptance,
    speedup_ci95,
    speedup_with_prefill,
    sync,
    theoretical_speedup,
    verify_cost_curve,
)
from decode.output import SpecStats
from decode.prompts import encode_prompts, make_batches
from decode.speculative import _draft_length, speculative_generate, target_generate

METHODS = (
    "speculative",
    "target_loop",
    "target_generate",
    "hf_assisted",
    "hf_assisted_same_kernels",
    "hf_assisted_published",
)
# transformers' own defaults for the assistant (GenerationConfig), set explicitly: a draft's generation_config
# may override them, and then "HF defaults" would silently time something else.
HF_ASSISTED_DEFAULTS = {
    "num_assistant_tokens": 20,
    "num_assistant_tokens_schedule": "constant",
    "assistant_confidence_threshold": 0.4,
}


def published_assistant_settings(gamma: int) -> dict:
    """The assistant settings a published draft's generation_config carries (``distill.publishing.publish``)."""
    return {
        "num_assistant_tokens": int(gamma),
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.0,
    }


def _describe(settings: dict) -> str:
    return (
        f"num_assistant_tokens={settings['num_assistant_tokens']}, {settings['num_assistant_tokens_schedule']} "
        f"schedule, confidence threshold {settings['assistant_confidence_threshold']}"
    )


def _engine_version() -> str:
    try:
        return importlib.metadata.version("draftsmith")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


# ---------------------------------------------------------------------------------------------------------------
# Methods
# ---------------------------------------------------------------------------------------------------------------
def _strip(row: list[int], eos: set[int]) -> list[int]:
    """generate pads finished rows (often with EOS itself): keep up to and including the first EOS."""
    for i, tok in enumerate(row):
        if tok in eos:
            return row[: i + 1]
    return row


@contextlib.contextmanager
def _generation_configs(configs: dict[nn.Module, GenerationConfig]) -> Iterator[None]:
    """Give each model this generation config for the call: ``generate`` fills every field left unset in the one
    it is passed from ``model.generation_config``, and the assistant's settings are read from the assistant's."""
    saved = {model: model.generation_config for model in configs}
    try:
        for model, config in configs.items():
            model.generation_config = config
        yield
    finally:
        for model, config in saved.items():
            model.generation_config = config


class HFAssistant:
    """The draft as HF assisted generation takes it: with the target's vocabulary width, for the length of a call.

    transformers runs ``generate(assistant_model=draft)`` on shared token ids only when both configs give the same
    ``vocab_size``; otherwise it asks for both tokenizers and runs Universal Assisted Decoding, which decodes and
    re-encodes the text every round: a slower baseline than the draft deserves, and not how its published copy
    runs. A target whose embedding is padded past its tokenizer (Qwen2.5-7B: 152064 rows, its 0.5B sibling
    151936) differs from its draft only in padding, so the HF methods run the draft with its embedding and output
    layer swapped for copies of the target's width, padded as publishing pads them (``with_rows``, as
    ``decode.compat.match_vocab``): HF times the draft as published. Only those two layers are copied, and
    they are swapped back after every call: draftsmith's loop and everything else see the draft as it is.

        assistant = HFAssistant(target, draft)
        with assistant():
            target.generate(..., assistant_model=draft)
    """

    def __init__(self, target: nn.Module, draft: nn.Module) -> None:
        self.draft = draft
        self.rows, self.vocab = logits_width(target), text_config(target).vocab_size
        self.layers: tuple[nn.Module, nn.Module | None] | None = None
        if logits_width(draft) != self.rows:
            self.layers = self._resized(draft.get_input_embeddings(), draft.get_output_embeddings())

    def _resized(self, embedding: nn.Module, head: nn.Module | None) -> tuple[nn.Module, nn.Module | None]:
        """Copies of the embedding and output layer with `rows` rows (a tied head shares the new embedding)."""
        new_embedding = self._copy(embedding, "num_embeddings")
        if head is None:
            return new_embedding, None
        tied = head.weight is embedding.weight
        return new_embedding, self._copy(head, "out_features", new_embedding.weight if tied else None)

    def _copy(self, layer: nn.Module, size_attr: str, weight: nn.Parameter | None = None) -> nn.Module:
        """A shallow copy of `layer` (its class, so a scaled embedding keeps its scale) with every parameter
        resized to `rows` rows; `weight`: the (tied) weight to use instead of a resized copy."""
        new = copy.copy(layer)
        new._parameters = {
            name: param if param is None else nn.Parameter(with_rows(param.detach(), self.rows), requires_grad=False)
            for name, param in layer._parameters.items()
            if not (name == "weight" and weight is not None)
        }
        if weight is not None:
            new._parameters["weight"] = weight
        if hasattr(new, size_attr):
            setattr(new, size_attr, self.rows)
        return new

    @contextlib.contextmanager
    def __call__(self) -> Iterator[nn.Module]:
        config = text_config(self.draft)
        saved_vocab = config.vocab_size
        saved = (self.draft.get_input_embeddings(), self.draft.get_output_embeddings())
        try:
            config.vocab_size = self.vocab
            if self.layers is not None:
                self._set(*self.layers)
            yield self.draft
        finally:
            config.vocab_size = saved_vocab
            if self.layers is not None:
                self._set(*saved)

    def _set(self, embedding: nn.Module, head: nn.Module | None) -> None:
        self.draft.set_input_embeddings(embedding)
        if head is not None:
            self.draft.set_output_embeddings(head)


class _Runner:
    """Runs one method on one batch and returns (seconds, new tokens per row, stats or None).

    ``assistant``: the assistant settings of each HF assisted method (set once gamma is known).
    """

    def __init__(
        self, target, draft, *, max_new_tokens, temperature, top_k, top_p, controller, eos, pad_id, vocab, spec_draft
    ):
        self.target, self.draft = target, draft
        self.spec_draft = spec_draft  # the draft of draftsmith's loop (with its draft vocabulary, if any)
        self.vocab = vocab  # the shared width: both of draftsmith's loops choose among the same tokens
        self.max_new, self.temperature, self.top_k, self.top_p = max_new_tokens, temperature, top_k, top_p
        self.controller = controller
        self.eos = eos
        self.pad_id = pad_id
        self.device = next(target.parameters()).device
        self.assistant: dict[str, dict] = {}
        self.hf_assistant = HFAssistant(target, draft)

    def generation_config(self, assistant: dict | None = None) -> GenerationConfig:
        """A fresh config from the bench's own settings only (plus the assistant settings, for the draft)."""
        kw = dict(max_new_tokens=self.max_new, eos_token_id=sorted(self.eos) or None, pad_token_id=self.pad_id)
        if self.temperature > 0:
            kw.update(do_sample=True, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
        else:
            kw.update(do_sample=False)
        return GenerationConfig(**kw, **(assistant or {}))

    def run(self, method: str, ids: torch.Tensor, mask: torch.Tensor, seed: int):
        ids, mask = ids.to(self.device), mask.to(self.device)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        eos = sorted(self.eos)
        # Same conditions for every method: no garbage collection pause inside a timed run (as timeit does).
        torch.manual_seed(seed)  # model.generate samples from the global RNG
        # Young generations only: a full collection walks the whole torch/transformers heap (~0.4 s) every run.
        gc.collect(1)
        gc.disable()
        try:
            return self._run(method, ids, mask, seed, gen, eos)
        finally:
            gc.enable()

    def _run(self, method: str, ids: torch.Tensor, mask: torch.Tensor, seed: int, gen: torch.Generator, eos):
        sync(self.device)
        t0 = time.perf_counter()
        stats = None
        if method == "speculative":
            out = speculative_generate(
                self.target, self.spec_draft, ids, mask, max_new_tokens=self.max_new, num_draft_tokens=self.controller,
                temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, eos_token_id=eos, generator=gen,
                vocab=self.vocab,
            )  # fmt: skip
            tokens, stats = out.new_tokens, out.stats
        elif method == "target_loop":
            out = target_generate(
                self.target, ids, mask, max_new_tokens=self.max_new, temperature=self.temperature,
                top_k=self.top_k, top_p=self.top_p, eos_token_id=eos, generator=gen, vocab=self.vocab,
            )  # fmt: skip
            tokens = out.new_tokens
        else:
            config = self.generation_config()
            configs, extra = {self.target: config}, {}
            assistant = contextlib.nullcontext()
            if method.startswith("hf_assisted"):
                configs[self.draft] = self.generation_config(self.assistant[method])
                extra = {"assistant_model": self.draft}
                assistant = self.hf_assistant()  # the target's vocabulary width, as published
            models = (self.target, self.draft) if method == "hf_assisted_same_kernels" else ()
            with torch.inference_mode(), assistant, kernels.CpuLinears(*models), _generation_configs(configs):
                seqs = self.target.generate(ids, attention_mask=mask, generation_config=config, **extra)
            tokens = [_strip(row, self.eos) for row in seqs[:, ids.shape[1] :].tolist()]
        sync(self.device)
        return time.perf_counter() - t0, tokens, stats


# ---------------------------------------------------------------------------------------------------------------
# The bench
# ---------------------------------------------------------------------------------------------------------------
def _methods(baselines: Sequence[str], batch_size: int, same_kernels: bool) -> list[str]:
    unknown = set(baselines) - {"target", "hf"}
    if unknown:
        raise ValueError(f"unknown baselines {sorted(unknown)}; choose from target, hf")
    methods = ["speculative"]
    if "target" in baselines:
        methods += ["target_loop", "target_generate"]
    if "hf" in baselines and batch_size == 1:  # HF assisted generation is batch-1 only (transformers #32165)
        methods.append("hf_assisted")
        if same_kernels:
            methods.append("hf_assisted_same_kernels")
        methods.append("hf_assisted_published")
    return methods


def _published_gamma(num_draft_tokens: int | str, warm_up: SpecStats | None) -> int:
    """The gamma a published draft would carry: the fixed one, or under auto the mean used (as publishing does)."""
    if is_tree_spec(num_draft_tokens):
        return parse_tree(num_draft_tokens).depth  # HF runs no tree; what is published is a chain
    if num_draft_tokens != "auto":
        return int(num_draft_tokens)
    return max(1, round(warm_up.mean_num_draft_tokens if warm_up is not None else 1))


MIN_COST_SAMPLES = 5  # per forward kind; auto cycles its verify sizes, so it takes at least one round of them


def _draft_vocab_size(draft: nn.Module, draft_vocab: Sequence[int] | None) -> int | None:
    """Tokens the draft proposes from: the subset given, an EAGLE-3 head's own draft vocabulary, or None (all)."""
    if draft_vocab is not None:
        return len(set(draft_vocab))
    ids = getattr(draft, "draft_ids", None)
    return int(ids.numel()) if ids is not None else None


def _load_avg() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _verify_sizes(controller) -> Iterator[int]:
    """Verify sizes (gamma + 1 tokens) to time: the fixed one, or under auto a cycle over every gamma."""
    if isinstance(controller, AutoDraftLength):
        return itertools.cycle(range(2, controller.max_gamma + 2))
    if isinstance(controller, TreeShape):
        return itertools.repeat(controller.nodes + 1)
    return itertools.repeat(controller.max_gamma + 1)


def _paired(times: dict, tokens: dict, fast: str, base: str) -> tuple[list, list]:
    """Paired (tokens, seconds) units of two methods: per batch the medians over repeats (as ``_rate``), or with a
    single batch its repeats (each repeat ran both methods back to back)."""
    if len(times[fast]) > 1:
        return _batch_medians(times, tokens, fast), _batch_medians(times, tokens, base)
    return (
        [(n, t) for n, t in zip(tokens[fast][0], times[fast][0])],
        [(n, t) for n, t in zip(tokens[base][0], times[base][0])],
    )


def _batch_medians(times: dict, tokens: dict, method: str) -> list[tuple[float, float]]:
    """(tokens, seconds) of each batch: the medians over repeats, as ``_rate`` takes them."""
    return [(statistics.median(tokens[method][b]), statistics.median(times[method][b])) for b in times[method]]


def _per_batch(times: dict, tokens: dict, fast: str, base: str | None, batch_ids: list[list[str]]) -> dict | None:
    """Each batch's speedup of ``fast`` over ``base``, beside the ids of its prompts.

    Two checkpoints benched on the same prompts are compared batch by batch
    (``distill.training.checkpoints.beats``): what a prompt does to both (a long prompt, an easy continuation)
    cancels, and what is left is the draft and the timing noise. The bootstrap over batches in ``vs_target_ci95``
    keeps that prompt spread in."""
    if base is None:
        return None
    speedups = [
        nf / tf * tb / nb if tf > 0 and nb > 0 else None
        for (nf, tf), (nb, tb) in zip(_batch_medians(times, tokens, fast), _batch_medians(times, tokens, base))
    ]
    return {"prompt_ids": batch_ids, "vs_target": speedups}


def _ci(times: dict, tokens: dict, fast: str, base: str | None) -> list[float] | None:
    if base is None or fast not in times or base not in times:
        return None
    return speedup_ci95(*_paired(times, tokens, fast, base))


def _batch_ids(prompts: Sequence[dict], batch_size: int) -> list[list[str]]:
    """The prompt ids of each batch, as ``make_batches`` cuts them (a prompt without an id: its index)."""
    ids = [str(p.get("id", i)) for i, p in enumerate(prompts)]
    return [ids[start : start + batch_size] for start in range(0, len(ids), batch_size)]


def _rate(times: dict, tokens: dict, method: str) -> float | None:
    """Tokens/s: per batch the median over repeats of time (and of tokens), summed over batches."""
    if method not in times:
        return None
    total_t = sum(statistics.median(ts) for ts in times[method].values())
    total_n = sum(statistics.median(ns) for ns in tokens[method].values())
    return total_n / total_t if total_t > 0 else 0.0


def run_bench(
    target: nn.Module,
    draft: nn.Module,
    tokenizer,
    prompts: list[dict],
    *,
    target_name: str,
    draft_name: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    num_draft_tokens: int | str = 5,
    batch_size: int = 1,
    repeats: int = 3,
    seed: int = 0,
    baselines: Sequence[str] = ("target", "hf"),
    samples_out: str | Path | None = None,
    progress: bool = True,
    draft_vocab: Sequence[int] | None = None,
) -> dict:
    """Time the speculative decoder against its baselines on already-loaded models; return the bench JSON dict.

    Args:
        prompts: items of a prompt file (``load_prompts``); chat items are rendered with ``tokenizer``.
        baselines: any of ``"target"`` (own loop and ``model.generate``; the faster counts) and ``"hf"``
            (``generate(assistant_model=draft)``, batch 1 only).
        samples_out: JSONL path; one line per prompt and method with the first timed repeat's tokens and text.
        draft_vocab: token ids draftsmith's loop drafts from (``decode.draft_vocab``); None: the whole vocabulary.
            HF assisted generation always runs the draft as published, with its full head.

    Returns:
        The bench JSON dict (docs/bench.md), detail keys included (per-method rates, forward times, protocol).

    Raises:
        UnwrittenOutput: ``samples_out`` could not be written; its ``result`` is the bench JSON dict.
    """
    if not prompts:
        raise ValueError("no prompts to bench")
    if repeats < 1 or batch_size < 1:
        raise ValueError("repeats and batch_size must be >= 1")
    vocab = check_vocab_compatible(target, draft, tokenizer)
    kind = kind_of(draft)
    if not kinds.traits(kind).hf_assisted and "hf" in baselines:
        raise ValueError(f"HF assisted generation cannot run a draft of kind {kind}: bench it with baselines target")
    methods = _methods(baselines, batch_size, kernels.applies(target, draft))
    eos_id = tokenizer.eos_token_id
    eos = {eos_id} if eos_id is not None else set()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_id or 0)
    encoded = encode_prompts(tokenizer, prompts)
    check_context({"target": target, "draft": draft}, max(len(p) for p in encoded), max_new_tokens)
    batches = make_batches(encoded, batch_size, pad_id)
    # One draft-length object for the whole bench: auto's calibration carries over from prompt to prompt.
    controller = _draft_length(num_draft_tokens, None)
    spec_draft = with_subset_head(draft, draft_vocab)
    runner = _Runner(
        target, draft, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        controller=controller, eos=eos, pad_id=pad_id, vocab=vocab, spec_draft=spec_draft,
    )  # fmt: skip

    load_start = _load_avg()
    # Warm-up: every method once on the first batch (allocator, kernels, auto's calibration); speculative first,
    # so that under auto the gamma a published draft would carry is known before HF runs with it.
    _, _, warm_stats = runner.run("speculative", *batches[0], seed=seed)
    published = published_assistant_settings(_published_gamma(num_draft_tokens, warm_stats))
    settings = {"defaults": dict(HF_ASSISTED_DEFAULTS), "published": published}
    runner.assistant = {
        "hf_assisted": settings["defaults"],
        "hf_assisted_same_kernels": settings["defaults"],
        "hf_assisted_published": settings["published"],
    }
    for method in methods[1:]:
        runner.run(method, *batches[0], seed=seed)
    # c and v: standalone forwards sampled between the timed runs, so they see the same machine state.
    meter = ForwardCostMeter(target, spec_draft, *batches[0])
    verify_sizes = _verify_sizes(controller)

    times = {m: {b: [] for b in range(len(batches))} for m in methods}
    tokens = {m: {b: [] for b in range(len(batches))} for m in methods}
    outputs = {m: {} for m in methods}  # first repeat's tokens, per batch
    spec_stats = SpecStats()
    bar = tqdm(total=repeats * len(batches) * len(methods), desc="bench", disable=not progress, leave=False)
    for r in range(repeats):
        order = methods[r % len(methods) :] + methods[: r % len(methods)]
        for b, (ids, mask) in enumerate(batches):
            for method in order:
                # Same seed for every method on this batch and repeat; different across repeats.
                seconds, toks, stats = runner.run(method, ids, mask, seed=seed + 1000 * r + b)
                times[method][b].append(seconds)
                tokens[method][b].append(sum(len(t) for t in toks))
                if r == 0:
                    outputs[method][b] = toks
                if stats is not None:
                    spec_stats.merge(stats)
                bar.update(1)
            meter.sample([next(verify_sizes)])
            if progress:
                bar.set_postfix(acc=f"{spec_stats.acceptance_rate:.2f}", tau=f"{spec_stats.mean_accepted_length:.2f}")
    bar.close()

    minimum = MIN_COST_SAMPLES
    if isinstance(controller, AutoDraftLength):
        minimum = max(minimum, controller.max_gamma)
    while meter.samples_taken < minimum:
        meter.sample([next(verify_sizes)])
    gamma = spec_stats.mean_num_draft_tokens
    # A tree round drafts with `depth` head forwards but verifies all its nodes: v is costed at the nodes.
    verified = [controller.nodes] * len(spec_stats.gamma_used) if isinstance(controller, TreeShape) else None
    costs = meter.summary(spec_stats.gamma_used, verified)
    c, v = costs["c"], costs["v"]
    tau = spec_stats.mean_accepted_length
    theory = theoretical_speedup(tau, forwards_per_round(spec_draft, gamma), c, v)  # a block: one forward
    curve = {k: round(x, 4) for k, x in verify_cost_curve(meter).items()}
    block = None
    if kind in BLOCK_KINDS:  # the block a server should run (vLLM takes a fixed K): measured acceptance x curve
        limit = max(len(spec_stats.per_position_acceptance), 1)
        block = best_block(spec_stats.per_position_acceptance, curve, c, limit)
        if progress:
            why = "per-position acceptance x verify-cost curve"
            print(f"block size: K={block['k']} is expected fastest of 1..{limit} ({why})", file=sys.stderr)
    # The same zero-overhead figure once the prompt forwards that every method pays are counted (an average
    # batch: mean padded prompt width, mean new tokens per row); the draft's prompt forward is speculative's own.
    width = sum(ids.shape[1] for ids, _ in batches) / len(batches)
    prefill = {k: ms / costs["prefill_tokens"] * width for k, ms in costs["prefill_ms"].items()}
    decode_ms = spec_stats.new_tokens / (len(prompts) * repeats) * costs["target_ms"]
    theory_prefill = speedup_with_prefill(theory, decode_ms, prefill["target"], prefill["draft"])

    rate = {m: _rate(times, tokens, m) for m in METHODS}
    target_rates = [x for x in (rate["target_loop"], rate["target_generate"]) if x is not None]
    target_rate = max(target_rates) if target_rates else None
    target_method = max(("target_loop", "target_generate"), key=lambda m: rate[m] or 0.0) if target_rates else None
    spec_rate = rate["speculative"]
    hf_run = "hf_assisted" in methods
    match, agreement = None, None
    if temperature == 0 and "target_generate" in outputs:
        agreement = greedy_agreement(target, batches, outputs)
        match = agreement["rows_equal"]["speculative"] == agreement["rows"]

    result = {
        **result_header(
            target_name,
            draft_name,
            len(prompts),
            max_new_tokens,
            temperature,
            top_p,
            top_k,
            batch_size,
            num_draft_tokens,
        ),  # fmt: skip
        **acceptance_metrics(spec_stats),
        "draft_kind": kind,
        "draft_vocab_size": _draft_vocab_size(draft, draft_vocab),
        "draft_cost_ratio": c,
        "verify_cost_ratio": v,
        "leviathan_bound": leviathan_bound(solve_acceptance(tau, gamma), gamma, c),
        "theoretical_speedup": theory,
        "verify_cost_curve": curve,
        "block_choice": block,
        "tokens_per_s": {
            "speculative": spec_rate,
            "target": target_rate,
            "hf_assisted": rate["hf_assisted"],
            "hf_assisted_same_kernels": rate["hf_assisted_same_kernels"],
            "hf_assisted_published": rate["hf_assisted_published"],
        },
        "speedup": {
            "vs_target": spec_rate / target_rate if target_rate else None,
            "vs_target_ci95": _ci(times, tokens, "speculative", target_method),
            "vs_hf_assisted": spec_rate / rate["hf_assisted"] if rate["hf_assisted"] else None,
            # HF's assisted loop with draftsmith's CPU kernels: the gain of the decoding loop alone.
            "vs_hf_assisted_same_kernels": (
                spec_rate / rate["hf_assisted_same_kernels"] if rate["hf_assisted_same_kernels"] else None
            ),
            "vs_hf_assisted_published": (
                spec_rate / rate["hf_assisted_published"] if rate["hf_assisted_published"] else None
            ),
        },
        "outputs_match_target": match,
        "engine": "draftsmith",
        "engine_version": _engine_version(),
        "hf_assisted_settings": settings if hf_run else None,
        # Detail beyond the contract.
        "greedy_agreement": agreement,
        "efficiency": spec_rate / target_rate / theory if target_rate else None,
        "theoretical_speedup_with_prefill": theory_prefill,
        "efficiency_with_prefill": spec_rate / target_rate / theory_prefill if target_rate else None,
        "target_tokens_per_s": {"loop": rate["target_loop"], "generate": rate["target_generate"]},
        "forward_ms": {
            "target": costs["target_ms"],
            "draft": costs["draft_ms"],
            "verify": costs["verify_ms"],
            "prefill": prefill,
        },
        "cost_samples": costs["samples"],
        "rounds": spec_stats.rounds,
        "generated_tokens": spec_stats.new_tokens,
        "repeats": repeats,
        "seed": seed,
        "hf_assisted_config": _describe(settings["defaults"]) if hf_run else None,
        "speedup_per_batch": _per_batch(times, tokens, "speculative", target_method, _batch_ids(prompts, batch_size)),
        "hf_assisted_ci95": {
            "vs_hf_assisted": _ci(times, tokens, "speculative", "hf_assisted"),
            "vs_hf_assisted_published": _ci(times, tokens, "speculative", "hf_assisted_published"),
        },
        "device": str(runner.device),
        "dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
        "draft_dtype": str(next(draft.parameters()).dtype).replace("torch.", ""),
        "torch_threads": torch.get_num_threads(),
        # 1-minute load average at start and end: timings on a shared machine are only as good as its quiet.
        "load_avg": {"start": load_start, "end": _load_avg()},
    }
    if samples_out is not None:
        try:
            write_whole(samples_out, lambda tmp: _write_samples(tmp, tokenizer, prompts, batches, outputs, batch_size))
        except OSError as e:  # the figures are measured: they travel with the error
            raise UnwrittenOutput(result, f"{samples_out}: not written ({os_reason(e)})") from e
    return result


def result_header(
    target: str,
    draft: str,
    n_prompts: int,
    new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    batch_size: int,
    num_draft_tokens: int | str,
) -> dict:
    """The bench JSON's leading keys (what was measured, with which settings), the same for every engine."""
    return {
        "target": target,
        "draft": draft,
        "n_prompts": n_prompts,
        "new_tokens": new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "batch_size": batch_size,
        "num_draft_tokens": num_draft_tokens if isinstance(num_draft_tokens, str) else int(num_draft_tokens),
    }


def greedy_agreement(target: nn.Module, batches: list, outputs: dict) -> dict:
    """Rows whose greedy tokens equal ``model.generate``'s, per method, and what every first divergence was.

    In exact arithmetic the speculative decoder's greedy output equals the target's. In bf16 or fp16 a 5-token
    verify forward and a 1-token forward round differently (other kernels, other summation order), so where the
    target's top two logits are within rounding of each other the argmax can flip; the same happens between two
    target-only loops. For each first divergence this reports the target's logit margin between the two tokens
    (one full forward over the agreed prefix) in units of the dtype's spacing at that logit: a margin of a few
    units is a numerical tie, a large one would be a decoder bug.
    """
    reference = outputs["target_generate"]
    rows = sum(len(reference[b]) for b in range(len(batches)))
    equal: dict[str, int] = {}
    divergences = []
    for method in (m for m in outputs if m != "target_generate"):
        equal[method] = 0
        for b, (ids, mask) in enumerate(batches):
            for row, (got, want) in enumerate(zip(outputs[method][b], reference[b])):
                if got == want:
                    equal[method] += 1
                    continue
                at = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), None)
                if at is None:  # one is a prefix of the other: an EOS or a stop, not a flipped argmax
                    at = min(len(got), len(want))
                    divergences.append({"method": method, "batch": b, "row": row, "position": at})
                    continue
                prompt = ids[row][mask[row].bool()].tolist()
                margin, spacing = _logit_margin(target, prompt + want[:at], got[at], want[at])
                divergences.append({
                    "method": method, "batch": b, "row": row, "position": at,
                    "margin": margin, "margin_in_spacings": margin / spacing,
                })  # fmt: skip
    spacings = [d["margin_in_spacings"] for d in divergences if "margin_in_spacings" in d]
    return {
        "rows": rows,
        "rows_equal": equal,
        "divergences": divergences,
        "max_margin_in_spacings": max(spacings) if spacings else None,
    }


@torch.inference_mode()
def _logit_margin(target: nn.Module, ids: list[int], a: int, b: int) -> tuple[float, float]:
    """|logit(a) - logit(b)| after ``ids``, and the spacing of the output layer's dtype at that logit's magnitude."""
    head = target.get_output_embeddings().weight
    logits = target(input_ids=torch.tensor([ids], device=head.device), logits_to_keep=1).logits[0, -1]
    la, lb = float(logits[a]), float(logits[b])
    dtype = head.dtype if head.dtype.is_floating_point else logits.dtype
    spacing = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(abs(la), abs(lb), 1e-30)))
    return abs(la - lb), spacing


def _write_samples(path, tokenizer, prompts, batches, outputs, batch_size) -> None:
    names = {
        "speculative": "speculative",
        "target_generate": "target",
        "hf_assisted": "hf_assisted",
        "hf_assisted_published": "hf_assisted_published",
    }
    if "target_generate" not in outputs and "target_loop" in outputs:
        names["target_loop"] = "target"
    with Path(path).open("w", encoding="utf-8") as f:
        for b in range(len(batches)):
            for row in range(batches[b][0].shape[0]):
                index = b * batch_size + row
                prompt_id = str(prompts[index].get("id", index))  # a prompt without an id: its index (docs/data.md)
                for method, name in names.items():
                    if method not in outputs:
                        continue
                    ids = outputs[method][b][row]
                    line = {"id": prompt_id, "method": name, "new_token_ids": ids, "text": tokenizer.decode(ids)}
                    f.write(json.dumps(line) + "\n")
