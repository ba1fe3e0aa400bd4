#!/usr/bin/env bash
# Ablation on the reference pair, two modes; prints a markdown table, runs go to $OUT.
#
# Grid (default): each divergence x each data source (DistillSpec's table), same training budget, measured
# speedup and acceptance of the final checkpoint on the dev prompts. Each cell's lr decays over its MINUTES (the
# recipe's train.schedule_by: minutes); `schedule` is target-generated data for the first SWITCH_AT of the
# budget, on-policy after (its target continuations come from the shared cache when `target` cells made them).
#
#   bash bench/ablation.sh                      # 4 losses x 4 sources, MINUTES=4 each (~1.3 h on 2 CPU cores)
#   MINUTES=2 LOSSES="fkl tvd" SOURCES="target" bash bench/ablation.sh eval.num_prompts=20   # extra overrides
#
# Cells: CELLS="NAME:KEY=VALUE,KEY=VALUE NAME2:..." runs the recipe as it is plus each cell's overrides, at the
# recipe's own budget unless MINUTES is set, evaluated every EVAL_MINUTES of training clock (the curve), and
# plots acceptance and speedup against training minutes for all cells into $OUT/curves.png.
#
#   CELLS="recipe: t1:distill.gen_temperature=1.0" EVAL_MINUTES=6 bash bench/ablation.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/ablation}
RECIPE=${RECIPE:-recipes/stdlib-30m_stdlib-3.7m_full_greedy.yaml}
export HF_HUB_OFFLINE=1 WANDB_MODE=offline
mkdir -p "$OUT"

if [ -n "${CELLS:-}" ]; then
    budget=()
    [ -n "${MINUTES:-}" ] && budget=(train.max_minutes="$MINUTES")
    for cell in $CELLS; do
        name=${cell%%:*}
        run="$OUT/$name"
        [ -f "$run/report.json" ] && continue
        IFS=, read -r -a overrides <<< "${cell#*:}"
        python train/distill.py --recipe "$RECIPE" --overwrite "${budget[@]}" "${overrides[@]}" \
            eval.every=100000 eval.every_minutes="${EVAL_MINUTES:-6}" eval.keep_top_k=100 log.report_to=none \
            output_dir="$run" "$@" > "$run.log" 2>&1 || { echo "failed: $run (see $run.log)"; continue; }
    done
    python - "$OUT" $CELLS <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| cell | overrides | steps | minutes | acceptance base -> final | speedup base -> final | best/ step |")
print("|---|---|---|---|---|---|---|")
for cell in sys.argv[2:]:
    name, _, overrides = cell.partition(":")
    report = out / name / "report.json"
    if not report.is_file():
        continue
    r = json.loads(report.read_text())
    base, final = r["checkpoints"][0], r["checkpoints"][-1]
    print(f"| {name} | {overrides.replace(',', ' ') or '(recipe)'} | {final['step']} | {r['train_minutes']:.1f} "
          f"| {base['acceptance_rate']:.3f} -> {final['acceptance_rate']:.3f} "
          f"| {base['speedup']:.2f}x -> {final['speedup']:.2f}x | {r['best_step']} |")
PY
    runs=()
    for cell in $CELLS; do [ -f "$OUT/${cell%%:*}/report.json" ] && runs+=("$OUT/${cell%%:*}"); done
    [ ${#runs[@]} -gt 0 ] && python bench/plot_curves.py "${runs[@]}" --out "$OUT/curves.png"
    exit 0
fi

MINUTES=${MINUTES:-4}
PROMPTS=${PROMPTS:-1000}  # target continuations are generated once (shared cache) and reused by every run
LOSSES=${LOSSES:-"fkl rkl jsd tvd"}
SOURCES=${SOURCES:-"target draft mix schedule"}
SWITCH_AT=${SWITCH_AT:-0.3}
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
