#!/usr/bin/env bash
# Reproduce the decoder figures of docs/results.md: the stdlib reference pair ($PAIR, built by the recipes
# in recipes/pretrain; docs/data.md builds its prompt files), 30 eval prompts,
# 64 new tokens, this CPU. Greedy batch 1 at gamma 3/4/5/auto (vs target-only and HF assisted generation) in the
# default dtype (bf16 on a CPU with native bf16) and in float32 (gamma 3/auto), temperature 0.8, and greedy
# batch 4. JSON + plots go to $OUT (default runs/bench-decode).
#
#   bash bench/bench_decode.sh            # all runs (~35 min on 2 CPU cores)
#   LIMIT=5 REPEATS=1 bash bench/bench_decode.sh   # quick look
#   RUNS="greedy_g3 greedy_fp32_g3" bash bench/bench_decode.sh   # only these runs (names below)
set -euo pipefail
cd "$(dirname "$0")/.."
PAIR=${PAIR:-runs/stdlib-pair}
PROMPTS=${PROMPTS:-$PAIR/prompts/stdlib-eval.jsonl}
OUT=${OUT:-runs/bench-decode}
LIMIT=${LIMIT:-30}
REPEATS=${REPEATS:-3}
RUNS=${RUNS:-all}
export HF_HUB_OFFLINE=1
# One thread by default: on a shared 2-core machine two OpenMP threads stall whenever another process runs
# (10x slower forwards); one thread gives stable ratios. THREADS=2 on a quiet machine.
export OMP_NUM_THREADS=${THREADS:-1}
mkdir -p "$OUT"
common=(--target "$PAIR/target" --draft "$PAIR/draft"
        --prompts "$PROMPTS" --limit "$LIMIT" --repeats "$REPEATS" --max-new-tokens 64)

run() {  # name, extra args...
    local name=$1; shift
    if [[ $RUNS != all && " $RUNS " != *" $name "* ]]; then return; fi
    python -m decode bench "${common[@]}" "$@" --json "$OUT/$name.json" --plot "$OUT/$name.png" > /dev/null
    python - "$OUT/$name.json" "$name" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
f = lambda x: "-" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))
print(f"{sys.argv[2]:<14} acc {f(r['acceptance_rate'])} tau {f(r['mean_accepted_length'])} "
      f"g {f(r['mean_num_draft_tokens'])} c {f(r['draft_cost_ratio'])} v {f(r['verify_cost_ratio'])} "
      f"theory {f(r['theoretical_speedup'])} | tok/s spec {f(r['tokens_per_s']['speculative'])} "
      f"target {f(r['tokens_per_s']['target'])} (loop {f(r['target_tokens_per_s']['loop'])} "
      f"generate {f(r['target_tokens_per_s']['generate'])}) hf {f(r['tokens_per_s']['hf_assisted'])} | "
      f"vs_target {f(r['speedup']['vs_target'])} vs_hf {f(r['speedup']['vs_hf_assisted'])} "
      f"(same kernels {f(r['speedup'].get('vs_hf_assisted_same_kernels'))}) "
      f"eff {f(r['efficiency'])} match {f(r['outputs_match_target'])}")
PY
}

for g in 3 4 5 auto; do run "greedy_g$g" --num-draft-tokens "$g"; done
for g in 3 auto; do run "greedy_fp32_g$g" --num-draft-tokens "$g" --dtype float32; done
run sample_t0.8_auto --temperature 0.8 --num-draft-tokens auto --baselines target
run greedy_b4_auto --batch-size 4 --num-draft-tokens auto --baselines target
