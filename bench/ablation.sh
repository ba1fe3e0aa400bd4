#!/usr/bin/env bash
# DistillSpec-style ablation on the reference pair: each divergence x each data source, same training budget,
# measured speedup and acceptance of best/ on the dev prompts. Prints a markdown table; runs go to $OUT.
#
# Each cell's lr decays over its MINUTES (the recipe's train.schedule_by: minutes); `schedule` is target-generated
# data for the first SWITCH_AT of the budget, on-policy after (its target continuations come from the shared cache
# when the `target` cells made them, else they are generated on its clock).
#
#   bash bench/ablation.sh                      # 4 losses x 4 sources, MINUTES=4 each (~1.3 h on 2 CPU cores)
#   MINUTES=2 LOSSES="fkl tvd" SOURCES="target" bash bench/ablation.sh eval.num_prompts=20   # extra overrides
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/ablation}
MINUTES=${MINUTES:-4}
PROMPTS=${PROMPTS:-1000}  # target continuations are generated once (shared cache) and reused by every run
LOSSES=${LOSSES:-"fkl rkl jsd tvd"}
SOURCES=${SOURCES:-"target draft mix schedule"}
SWITCH_AT=${SWITCH_AT:-0.3}
RECIPE=${RECIPE:-recipes/stdlib-30m_stdlib-3.7m_full_greedy.yaml}
export HF_HUB_OFFLINE=1 WANDB_MODE=offline
mkdir -p "$OUT"
for loss in $LOSSES; do
    for source in $SOURCES; do
        run="$OUT/${loss}_${source}"
        [ -f "$run/report.json" ] && continue
        python train/distill.py --recipe "$RECIPE" --overwrite \
            distill.loss="$loss" distill.beta=0.5 distill.source="$source" distill.mix_lambda=0.5 \
            distill.switch_at="$SWITCH_AT" \
            train.max_minutes="$MINUTES" train.max_steps=100000 eval.every=100000 log.report_to=none \
            data.max_train_prompts="$PROMPTS" distill.cache_dir="$OUT/rollout_cache" output_dir="$run" "$@" > "$run.log" 2>&1 || { echo "failed: $run (see $run.log)"; continue; }
    done
done
python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
# The final checkpoint is what the budget bought; best/ (chosen by measured speedup) may be the base draft itself.
print("| loss | source | steps | acceptance base -> final | tau final | speedup base -> final | best/ step |")
print("|---|---|---|---|---|---|---|")
for report in sorted(out.glob("*/report.json")):
    r = json.loads(report.read_text())
    loss, source = report.parent.name.split("_")
    base, final = r["checkpoints"][0], r["checkpoints"][-1]
    tau = json.loads((report.parent / "checkpoints" / f"step-{final['step']}" / "eval.json").read_text())
    print(f"| {loss} | {source} | {final['step']} | {base['acceptance_rate']:.3f} -> {final['acceptance_rate']:.3f} "
          f"| {tau['mean_accepted_length']:.2f} | {base['speedup']:.2f}x -> {final['speedup']:.2f}x | {r['best_step']} |")
PY
