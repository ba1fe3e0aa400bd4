#!/usr/bin/env bash
# GPU check: the decoder bench (bf16 target, and a 4-bit NF4 target), a short distillation with one evaluation,
# a short EAGLE-3 head training on the same target and a bench of that head's draft tree, and a 2-process
# distillation when 2 GPUs are present; one summary table at the end. Under 8 minutes on one recent GPU (about 5
# with the built models on one H100/H200-class card).
#
#   bash bench/gpu_check.sh                       # random-init Llama pair: ~300M target, ~30M draft
#   PAIR=DIR bash bench/gpu_check.sh              # a real pair instead: DIR/target and DIR/draft
#   PAIR=DIR PROMPTS=FILE.jsonl bash bench/gpu_check.sh
#   OUT=DIR LIMIT=8 REPEATS=1 STEPS=20 bash bench/gpu_check.sh
#
# Random-init models share a tokenizer but not their predictions: acceptance is near 0 and the speculative
# decoder runs slower than the target there. What the built pair checks is the GPU path itself (CUDA forwards,
# cache rollback, bitsandbytes NF4, training, DDP) and the cost side of the bench: c, v, target-only tokens/s,
# memory. A trained pair (PAIR=...) gives acceptance and speedup. Without a CUDA GPU it stops at once (exit 2).
# Everything is written under $OUT (a new temporary directory by default), nothing into the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false

if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA GPU found (torch.cuda.is_available() is False): run it on a machine with an NVIDIA" \
         "GPU and a CUDA build of torch" >&2
    exit 2
fi

OUT=${OUT:-$(mktemp -d -t draftsmith-gpu-check.XXXXXX)}
LIMIT=${LIMIT:-8}          # bench prompts
REPEATS=${REPEATS:-1}      # timed repeats per bench method
STEPS=${STEPS:-20}         # distillation steps (evaluations at step 0 and at the end)
GAMMA=${GAMMA:-4}
mkdir -p "$OUT"
N_GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
echo "gpu_check: $N_GPUS GPU(s); output in $OUT"

# ---- models and prompts
if [[ -n ${PAIR:-} ]]; then
    TARGET=$PAIR/target DRAFT=$PAIR/draft
    [[ -f $TARGET/config.json && -f $DRAFT/config.json ]] || {
        echo "gpu_check: PAIR=$PAIR must hold target/ and draft/ model directories (config.json in each)" >&2
        exit 2
    }
else
    TARGET=$OUT/models/target DRAFT=$OUT/models/draft
    # A byte-level BPE trained on a slice of the standard library, then two random-init Llamas sharing it.
    python - "$OUT/models" <<'PY'
import sys
from pathlib import Path

import torch

from distill.config import ArchConfig, CorpusConfig
from distill.data.corpus import load_corpus, train_tokenizer
from distill.training.pretraining import build_model, count_params

out = Path(sys.argv[1])
corpus = load_corpus(CorpusConfig(source="python-stdlib", max_files=200))
tokenizer = train_tokenizer((d.text for d in corpus.train), 8192)
shapes = {
    "target": ArchConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=2816),
    "draft": ArchConfig(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, intermediate_size=1408),
}
for name, arch in shapes.items():
    torch.manual_seed(0)
    model = build_model(arch, 8192, tokenizer).to(torch.bfloat16)
    model.save_pretrained(out / name)
    tokenizer.save_pretrained(out / name)
    print(f"built {name}: {count_params(model) / 1e6:.0f}M params")
PY
fi
if [[ -n ${PROMPTS:-} ]]; then
    EVAL_PROMPTS=$PROMPTS TRAIN_PROMPTS=$PROMPTS
else
    python -c "import sys; from pathlib import Path; from distill.data.quickstart import ensure_stdlib_prompts; ensure_stdlib_prompts(Path(sys.argv[1]))" "$OUT"
    EVAL_PROMPTS=$OUT/prompts/stdlib-eval.jsonl TRAIN_PROMPTS=$OUT/prompts/stdlib-train.jsonl
fi

declare -A WALL
timed() {  # name, command...: run it, keep its log and wall seconds
    local name=$1 start=$SECONDS; shift
    echo "gpu_check: $name"
    if ! "$@" > "$OUT/$name.log" 2>&1; then
        echo "gpu_check: $name failed; last lines of $OUT/$name.log:" >&2
        tail -n 20 "$OUT/$name.log" >&2
        exit 1
    fi
    WALL[$name]=$((SECONDS - start))
}

# ---- 1. decoder bench, bf16 target and draft
timed bench_bf16 python -m decode bench --target "$TARGET" --draft "$DRAFT" --prompts "$EVAL_PROMPTS" \
    --limit "$LIMIT" --repeats "$REPEATS" --max-new-tokens 64 --num-draft-tokens "$GAMMA" --dtype bfloat16 \
    --device cuda --no-progress --json "$OUT/bench_bf16.json"

# ---- 2. decoder bench, 4-bit NF4 target (bitsandbytes, bf16 compute) and bf16 draft
timed bench_nf4 python - "$TARGET" "$DRAFT" "$EVAL_PROMPTS" "$LIMIT" "$REPEATS" "$GAMMA" "$OUT/bench_nf4.json" <<'PY'
import json
import sys

import torch
from transformers import AutoModelForCausalLM

from decode.bench import run_bench
from decode.prompts import load_prompts
from distill.config import ModelConfig, QuantConfig
from distill.models import load_target, load_tokenizer

target_path, draft_path, prompts_path, limit, repeats, gamma, out = sys.argv[1:]
quant = QuantConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype="bfloat16")
target = load_target(ModelConfig(model=target_path, dtype="bfloat16", quantization=quant), device="cuda")
draft = AutoModelForCausalLM.from_pretrained(draft_path, dtype=torch.bfloat16).to("cuda").eval()
tokenizer = load_tokenizer(target_path)
prompts = load_prompts(prompts_path, tokenizer=tokenizer)[: int(limit)]
result = run_bench(
    target, draft, tokenizer, prompts, target_name=f"{target_path} (nf4)", draft_name=draft_path,
    max_new_tokens=64, num_draft_tokens=int(gamma), repeats=int(repeats), progress=False,
)  # fmt: skip
result["max_memory_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
result["dtype"] = "nf4 (bf16 compute)"  # the first parameter (embeddings) stays bf16; the linears are 4-bit
with open(out, "w") as f:
    json.dump(result, f, indent=2)
PY

# ---- 3. a short distillation (on-policy FKL) with evaluations at step 0 and at the end, one process
distill_args=(--recipe recipes/stdlib-30m_stdlib-3.7m_full_greedy.yaml --overwrite
    target.model="$TARGET" draft.model="$DRAFT" data.train_prompts="$TRAIN_PROMPTS" data.eval_prompts="$EVAL_PROMPTS"
    train.max_steps="$STEPS" train.max_minutes=0 train.schedule_by=steps train.warmup_steps=2 train.batch_size=8 eval.every="$STEPS"
    eval.num_prompts=4 eval.max_new_tokens=32 eval.num_draft_tokens="$GAMMA" distill.max_new_tokens=32
    log.report_to=none log.every=5)
timed distill_1gpu python train/distill.py "${distill_args[@]}" output_dir="$OUT/distill_1gpu"

# ---- 3b. an EAGLE-3 head on the same target (draft.kind=eagle3): the target's hidden states every step, the
# head's chain drafting in the evaluations
eagle3_args=(--recipe recipes/stdlib-30m_eagle3.yaml --overwrite data.max_train_prompts=$((STEPS * 8))
    target.model="$TARGET" data.train_prompts="$TRAIN_PROMPTS" data.eval_prompts="$EVAL_PROMPTS"
    train.max_steps="$STEPS" train.max_minutes=0 train.schedule_by=steps train.warmup_steps=2 train.batch_size=8 eval.every="$STEPS"
    eval.num_prompts=4 eval.max_new_tokens=32 eval.num_draft_tokens="$GAMMA" distill.max_new_tokens=32
    log.report_to=none log.every=5)
timed eagle3_1gpu python train/distill.py "${eagle3_args[@]}" output_dir="$OUT/eagle3_1gpu"

# ---- 3c. that head drafting a tree (tree:4,5,16): what verifying 17 tokens costs on this GPU (v), beside the
# chain measured in 3b
timed bench_tree python -m decode bench --target "$TARGET" --draft "$OUT/eagle3_1gpu/best" \
    --prompts "$EVAL_PROMPTS" --limit "$LIMIT" --repeats "$REPEATS" --max-new-tokens 64 \
    --num-draft-tokens tree:4,5,16 --baselines target --dtype bfloat16 --device cuda --no-progress \
    --json "$OUT/bench_tree.json"

# ---- 4. the same run on 2 processes (DDP), when 2 GPUs are present
if (( N_GPUS >= 2 )); then
    timed distill_2gpu accelerate launch --multi_gpu --num_processes 2 train/distill.py "${distill_args[@]}" \
        output_dir="$OUT/distill_2gpu"
fi

# ---- summary
for name in "${!WALL[@]}"; do echo "$name ${WALL[$name]}"; done > "$OUT/wall_seconds.txt"
python - "$OUT" <<'PY'
import json
import sys
from pathlib import Path

import torch

out = Path(sys.argv[1])
wall = dict(line.split() for line in (out / "wall_seconds.txt").read_text().splitlines())


def fmt(x, spec="{:.2f}"):
    return "-" if x is None else spec.format(x)


def row(name, r, extra=""):
    tps, sp = r["tokens_per_s"], r["speedup"]
    return (f"| {name} | {fmt(r['acceptance_rate'], '{:.3f}')} | {fmt(r['mean_accepted_length'])} "
            f"| {fmt(r['draft_cost_ratio'], '{:.3f}')} | {fmt(r['verify_cost_ratio'])} "
            f"| {fmt(tps['speculative'], '{:.1f}')} | {fmt(tps['target'], '{:.1f}')} "
            f"| {fmt(tps['hf_assisted'], '{:.1f}')} | {fmt(sp['vs_target'], '{:.2f}x')} "
            f"| {fmt(r['outputs_match_target'], '{}')} | {extra} | {wall.get(name, '-')} |")  # fmt: skip


print(f"\n{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, torch {torch.__version__}\n")
print("| run | acceptance | tau | c | v | tok/s spec | tok/s target | tok/s HF assisted | vs target | "
      "greedy = target | notes | wall s |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for name in ("bench_bf16", "bench_nf4", "bench_tree"):
    r = json.loads((out / f"{name}.json").read_text())
    mem = r.get("max_memory_allocated_mib")
    note = f"{r['dtype']} target, peak {mem:.0f} MiB" if mem else f"{r['dtype']} target"
    print(row(name, r, note if name != "bench_tree" else f"EAGLE-3 head of eagle3_1gpu, {r['num_draft_tokens']}"))
for name in ("distill_1gpu", "eagle3_1gpu", "distill_2gpu"):
    report = out / name / "report.json"
    if not report.is_file():
        continue
    r = json.loads(report.read_text())
    train = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    tok_s = [m["train/tokens_per_s"] for m in train if "train/tokens_per_s" in m]
    note = (f"{r['checkpoints'][-1]['step']} steps x {r['world_size']} proc, "
            f"train {fmt(tok_s[-1] if tok_s else None, '{:.0f}')} tok/s, best step {r['best_step']}")  # fmt: skip
    print(row(name, r["best"], note))
PY
echo "gpu_check: done; JSON and logs in $OUT"
