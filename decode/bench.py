"""Side-by-side timing: draftsmith's speculative decoder vs target-only decoding vs HF assisted generation.

Protocol (DESIGN.md, "Bench CLI"): one warm-up pass of every method, then the methods interleaved batch by
batch (their order rotating between repeats, so no method always runs on a warmer cache), ``repeats`` times;
per batch the median time over repeats, summed over batches. The target-only speed is the faster of
draftsmith's own loop and ``model.generate``: speedups are never measured against a slow baseline. c and v are
medians of standalone KV-cached forwards of the same models in the same run.

On CPU both of draftsmith's loops run the models' linear layers through ``decode.kernels``; HF assisted
generation is timed as HF runs it and, where those kernels apply, once more with them
(``hf_assisted_same_kernels``), so the gain over HF splits into kernels and decoding loop.
"""

from __future__ import annotations

import gc
import itertools
import json
import math
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from decode import kernels
from decode.draft_length import AutoDraftLength
from decode.metrics import (
    ForwardCostMeter,
    acceptance_metrics,
    leviathan_bound,
    solve_acceptance,
    speedup_with_prefill,
    theoretical_speedup,
)
from decode.speculative import (
    SpecStats,
    _draft_length,
    check_context,
    check_vocab_compatible,
    speculative_generate,
    target_generate,
)

METHODS = ("speculative", "target_loop", "target_generate", "hf_assisted", "hf_assisted_same_kernels")
HF_ASSISTED_CONFIG = "transformers defaults (num_assistant_tokens=20, constant schedule, confidence threshold 0.4)"


# ---------------------------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------------------------
def load_prompts(path: str | Path, tokenizer=None) -> list[dict]:
    """Read a prompt file: JSONL of ``{"prompt": str}`` or ``{"messages": [{"role", "content"}, ...]}``.

    Other keys (``id``, ``source``) are kept. With ``tokenizer``, chat items also get ``"prompt"`` rendered by its
    chat template (generation prompt added). Raises ValueError (one line) on a missing, empty or malformed file.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt file not found: {path}")
    items = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(item, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object")
            if isinstance(item.get("prompt"), str):
                pass
            elif isinstance(item.get("messages"), list) and all(
                isinstance(m, dict) and "role" in m and "content" in m for m in item["messages"]
            ):
                if tokenizer is not None:
                    item["prompt"] = render_chat(tokenizer, item["messages"])
            else:
                raise ValueError(f'{path}:{lineno}: needs "prompt" (string) or "messages" (list of role/content)')
            item.setdefault("id", f"{path.stem}-{len(items)}")
            items.append(item)
    if not items:
        raise ValueError(f"prompt file is empty: {path}")
    return items


def render_chat(tokenizer, messages: list[dict]) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"chat prompts need a chat template, and tokenizer {tokenizer.name_or_path!r} has none")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode_prompts(tokenizer, prompts: list[dict]) -> list[list[int]]:
    """Token ids of each prompt (chat template applied to ``messages`` items; no special tokens added to text
    the template already rendered)."""
    encoded = []
    for item in prompts:
        if "prompt" in item:
            text, special = item["prompt"], "messages" not in item
        else:
            text, special = render_chat(tokenizer, item["messages"]), False
        encoded.append(tokenizer(text, add_special_tokens=special)["input_ids"])
    return encoded


def make_batches(encoded: list[list[int]], batch_size: int, pad_id: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive prompts, left-padded: ``[(ids [B, L], mask [B, L])]``."""
    batches = []
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start : start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for b, p in enumerate(chunk):
            ids[b, width - len(p) :] = torch.tensor(p)
            mask[b, width - len(p) :] = 1
        batches.append((ids, mask))
    return batches


# ---------------------------------------------------------------------------------------------------------------
# Methods
# ---------------------------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _strip(row: list[int], eos: set[int]) -> list[int]:
    """generate pads finished rows (often with EOS itself): keep up to and including the first EOS."""
    for i, tok in enumerate(row):
        if tok in eos:
            return row[: i + 1]
    return row


class _Runner:
    """Runs one method on one batch and returns (seconds, new tokens per row, stats or None)."""

    def __init__(self, target, draft, *, max_new_tokens, temperature, top_k, top_p, controller, eos, pad_id):
        self.target, self.draft = target, draft
        self.max_new, self.temperature, self.top_k, self.top_p = max_new_tokens, temperature, top_k, top_p
        self.controller = controller
        self.eos = eos
        self.pad_id = pad_id
        self.device = next(target.parameters()).device

    def _generate_kwargs(self) -> dict:
        kw = dict(max_new_tokens=self.max_new, eos_token_id=sorted(self.eos) or None, pad_token_id=self.pad_id)
        if self.temperature > 0:
            kw.update(do_sample=True, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
        else:
            kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        return kw

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
        _sync(self.device)
        t0 = time.perf_counter()
        stats = None
        if method == "speculative":
            out = speculative_generate(
                self.target, self.draft, ids, mask, max_new_tokens=self.max_new, num_draft_tokens=self.controller,
                temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, eos_token_id=eos, generator=gen,
            )  # fmt: skip
            tokens, stats = out.new_tokens, out.stats
        elif method == "target_loop":
            out = target_generate(
                self.target, ids, mask, max_new_tokens=self.max_new, temperature=self.temperature,
                top_k=self.top_k, top_p=self.top_p, eos_token_id=eos, generator=gen,
            )  # fmt: skip
            tokens = out.new_tokens
        else:
            extra = {"assistant_model": self.draft} if method.startswith("hf_assisted") else {}
            models = (self.target, self.draft) if method == "hf_assisted_same_kernels" else ()
            with torch.inference_mode(), kernels.CpuLinears(*models):
                seqs = self.target.generate(ids, attention_mask=mask, **self._generate_kwargs(), **extra)
            tokens = [_strip(row, self.eos) for row in seqs[:, ids.shape[1] :].tolist()]
        _sync(self.device)
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
    return methods


MIN_COST_SAMPLES = 5  # per forward kind; auto cycles its verify sizes, so it takes at least one round of them


def _load_avg() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _verify_sizes(controller) -> Iterator[int]:
    """Verify sizes (gamma + 1 tokens) to time: the fixed one, or under auto a cycle over every gamma."""
    if isinstance(controller, AutoDraftLength):
        return itertools.cycle(range(2, controller.max_gamma + 2))
    return itertools.repeat(controller.max_gamma + 1)


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
) -> dict:
    """Time the speculative decoder against its baselines on already-loaded models; return the bench JSON dict.

    Args:
        prompts: items of a prompt file (``load_prompts``); chat items are rendered with ``tokenizer``.
        baselines: any of ``"target"`` (own loop and ``model.generate``; the faster counts) and ``"hf"``
            (``generate(assistant_model=draft)``, batch 1 only).
        samples_out: JSONL path; one line per prompt and method with the first timed repeat's tokens and text.

    Returns:
        The DESIGN.md bench dict, plus detail keys (per-method rates, forward times, protocol).
    """
    if not prompts:
        raise ValueError("no prompts to bench")
    if repeats < 1 or batch_size < 1:
        raise ValueError("repeats and batch_size must be >= 1")
    check_vocab_compatible(target, draft)
    methods = _methods(baselines, batch_size, kernels.applies(target, draft))
    eos_id = tokenizer.eos_token_id
    eos = {eos_id} if eos_id is not None else set()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_id or 0)
    encoded = encode_prompts(tokenizer, prompts)
    check_context({"target": target, "draft": draft}, max(len(p) for p in encoded), max_new_tokens)
    batches = make_batches(encoded, batch_size, pad_id)
    # One draft-length object for the whole bench: auto's calibration carries over from prompt to prompt.
    controller = _draft_length(num_draft_tokens, None)
    runner = _Runner(
        target, draft, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        controller=controller, eos=eos, pad_id=pad_id,
    )  # fmt: skip

    load_start = _load_avg()
    # Warm-up: every method once on the first batch (allocator, kernels, auto's calibration).
    for method in methods:
        runner.run(method, *batches[0], seed=seed)
    # c and v: standalone forwards sampled between the timed runs, so they see the same machine state.
    meter = ForwardCostMeter(target, draft, *batches[0])
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
    costs = meter.summary(spec_stats.gamma_used)
    c, v = costs["c"], costs["v"]
    tau = spec_stats.mean_accepted_length
    theory = theoretical_speedup(tau, gamma, c, v)
    # The same zero-overhead figure once the prompt forwards that every method pays are counted (an average
    # batch: mean padded prompt width, mean new tokens per row); the draft's prompt forward is speculative's own.
    width = sum(ids.shape[1] for ids, _ in batches) / len(batches)
    prefill = {k: ms / costs["prefill_tokens"] * width for k, ms in costs["prefill_ms"].items()}
    decode_ms = spec_stats.new_tokens / (len(prompts) * repeats) * costs["target_ms"]
    theory_prefill = speedup_with_prefill(theory, decode_ms, prefill["target"], prefill["draft"])

    rate = {m: _rate(times, tokens, m) for m in METHODS}
    target_rates = [x for x in (rate["target_loop"], rate["target_generate"]) if x is not None]
    target_rate = max(target_rates) if target_rates else None
    spec_rate = rate["speculative"]
    match, agreement = None, None
    if temperature == 0 and "target_generate" in outputs:
        agreement = greedy_agreement(target, batches, outputs)
        match = agreement["rows_equal"]["speculative"] == agreement["rows"]

    if samples_out is not None:
        _write_samples(samples_out, tokenizer, prompts, batches, outputs, batch_size)

    return {
        "target": target_name,
        "draft": draft_name,
        "n_prompts": len(prompts),
        "new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "batch_size": batch_size,
        "num_draft_tokens": num_draft_tokens if num_draft_tokens == "auto" else int(num_draft_tokens),
        **acceptance_metrics(spec_stats),
        "draft_cost_ratio": c,
        "verify_cost_ratio": v,
        "leviathan_bound": leviathan_bound(solve_acceptance(tau, gamma), gamma, c),
        "theoretical_speedup": theory,
        "tokens_per_s": {
            "speculative": spec_rate,
            "target": target_rate,
            "hf_assisted": rate["hf_assisted"],
            "hf_assisted_same_kernels": rate["hf_assisted_same_kernels"],
        },
        "speedup": {
            "vs_target": spec_rate / target_rate if target_rate else None,
            "vs_hf_assisted": spec_rate / rate["hf_assisted"] if rate["hf_assisted"] else None,
            # HF's assisted loop with draftsmith's CPU kernels: the gain of the decoding loop alone.
            "vs_hf_assisted_same_kernels": (
                spec_rate / rate["hf_assisted_same_kernels"] if rate["hf_assisted_same_kernels"] else None
            ),
        },
        "outputs_match_target": match,
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
        "hf_assisted_config": HF_ASSISTED_CONFIG if "hf_assisted" in methods else None,
        "device": str(runner.device),
        "dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
        "draft_dtype": str(next(draft.parameters()).dtype).replace("torch.", ""),
        "torch_threads": torch.get_num_threads(),
        # 1-minute load average at start and end: timings on a shared machine are only as good as its quiet.
        "load_avg": {"start": load_start, "end": _load_avg()},
        "engine": "draftsmith",
        "engine_version": _draftsmith_version(),
    }


def _draftsmith_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("draftsmith")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


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
    names = {"speculative": "speculative", "target_generate": "target", "hf_assisted": "hf_assisted"}
    if "target_generate" not in outputs and "target_loop" in outputs:
        names["target_loop"] = "target"
    with Path(path).open("w", encoding="utf-8") as f:
        for b in range(len(batches)):
            for row in range(batches[b][0].shape[0]):
                item = prompts[b * batch_size + row]
                for method, name in names.items():
                    if method not in outputs:
                        continue
                    ids = outputs[method][b][row]
                    line = {"id": item["id"], "method": name, "new_token_ids": ids, "text": tokenizer.decode(ids)}
                    f.write(json.dumps(line) + "\n")
