#!/usr/bin/env bash
# A scenario's tessera configuration under another memory budget, this checkout
# against another source tree, alternating (new, old) for ROUNDS rounds in one
# sitting (this machine is shared and noisy: only side-by-side figures compare).
# Prints one line a run and writes them to benchmarks/results/NAME-pairs-DATE.md.
#
#   git worktree add /tmp/old <commit>
#   benchmarks/scenario_pairs.sh benchmarks/scenarios/mixed-zipf.yaml 680MiB 2 /tmp/old/src
set -euo pipefail
scenario=$1 budget=$2 rounds=$3 old_src=$4
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
name=$(basename "$scenario" .yaml)-$budget
sed "s/^memory_budget: .*/memory_budget: $budget/; s/^name: .*/name: $name/" "$scenario" > "$work/$name.yaml"
out="$root/benchmarks/results/$name-pairs-$(date +%F).md"
n=2
while [ -e "$out" ]; do  # another run of the day's is kept: this one is -2, -3...
  out="$root/benchmarks/results/$name-pairs-$(date +%F)-$n.md"
  n=$((n + 1))
done
{
  echo "# \`$(basename "$scenario" .yaml)\` under $budget: this checkout against $old_src"
  echo
  echo "This checkout: $(git -C "$root" rev-parse --short HEAD) (plus uncommitted changes: $(git -C "$root" status --porcelain | wc -l) files);"
  echo "the other: $(git -C "$old_src" rev-parse --short HEAD 2>/dev/null || echo "$old_src")."
  echo "Rerun: \`benchmarks/scenario_pairs.sh $scenario $budget $rounds $old_src\`"
  echo
  echo "| round | code | within target | pp-ocrv6 | smollm2-135m | evictions | server CPU s |"
  echo "|---|---|---|---|---|---|---|"
} > "$out"
for i in $(seq 1 "$rounds"); do
  for code in new old; do
    dir="$work/$code-$i"
    if [ "$code" = old ]; then path=$old_src; else path=$root/src; fi
    PYTHONPATH=$path timeout -k 5 600 "$root/.venv/bin/tessera" bench --scenario "$work/$name.yaml" \
      --only tessera --out-dir "$dir" --work-dir "$dir/work" > "$dir.log" 2>&1
    "$root/.venv/bin/python" - "$dir" "$i" "$code" >> "$out" <<'PY'
import glob, json, sys
run = json.load(open(glob.glob(sys.argv[1] + "/*.json")[0]))
step = run["configurations"]["tessera"]["steps"][0]
model = step["per_model"]
def share(figure: float) -> str:
    return f"{100 * figure:.1f}%"
print(
    f"| {sys.argv[2]} | {sys.argv[3]} | {share(step['within_target_share'])} |"
    f" {share(model['pp-ocrv6']['within_target_share']) if 'pp-ocrv6' in model else '-'} |"
    f" {share(model['smollm2-135m']['within_target_share']) if 'smollm2-135m' in model else '-'} |"
    f" {step['evictions']} | {step['cpu_seconds']:.1f} |"
)
PY
    tail -1 "$out"
  done
done
echo "wrote $out (runs kept in $work)"
