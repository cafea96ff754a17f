#!/usr/bin/env bash
# The GPU check: tests/gpu and the GPU benchmark of issue 15 on one machine, in one go.
#
#   bash scripts/gpu-check.sh          # from the repository root, .gpu/ beside it (make gpu-build)
#
# Writes $OUT/gpu-check.json and $OUT/gpu-check.md (every figure beside its bar, plain
# torch's of the same run beside tessera's), $OUT/gpu-check.log (all the output) and
# $OUT/servers.log (the servers' logs). Every step runs under its own timeout, cut to
# what is left of the budget; a failed step is recorded and the next one runs; the
# report is written whatever happened.
#
# Environment:
#   GPU_CHECK_DEVICE        cuda (default) or cpu
#   GPU_CHECK_QUICK=1       short loads, few models: the CPU smoke run
#   GPU_CHECK_PYTHON        python3 (cpu: .venv/bin/python where there is one)
#   GPU_CHECK_SKIP_INSTALL  1: the python's own packages, no wheels or stand-in (cpu: 1)
#   GPU_CHECK_BUDGET_S      seconds for every step but the report (420; quick 240)
#   GPU_CHECK_MODELS        models of the many-model loads (100; quick 5)
#   GPU_CHECK_CLIENTS       client processes of a load (8; quick 1): on the H200 four
#                           httpx clients may have set the one-model pace (2026-12-04);
#                           the report says how busy they were
#   GPU_CHECK_PEER_PYTHON   the python that runs the peer, LitServe (cuda: the check's, with
#                           the carried wheels; cpu: make bench-peers' LitServe venv where
#                           there is one); a python without litserve skips the peer
#   GPU_CHECK_VARIANT       server config keys as JSON ('{"num_workers": 4}'): a step
#                           many_variant runs the all-resident load again with them
#                           (about 50 s on the H200), its rows beside many_all's
#   GPU_CHECK_VARIANT_CARD  card options as JSON for that step's models ('{"stack": 16}':
#                           stacked rounds across models); either runs the step
#   GPU_CHECK_CARD          card options as JSON for the models of every many-model step
#   GPU_CHECK_VARIANT_BUDGET=1  the variant step runs as many_budget does (the budget
#                           that holds a fifth, round robin and Zipf) instead of all resident
#   GPU_CHECK_VARIANT_2     server config keys as JSON for a second variant
#                           ('{"engine_loop": "uvloop"}'): a step many_variant_2 runs the
#                           all-resident load with them (about 50 s), its rows beside the rest
#   GPU_CHECK_STEPS         the steps to run, by name, comma-separated (all); the others are
#                           recorded as skipped: a second run in a lease's last minutes
#   GPU_CHECK_PROFILE=1     py-spy samples the servers during each load of one_model (but c=1)
#                           and of the many-model steps, three raw files a load (on a core,
#                           holding the interpreter lock, every thread), all packed in
#                           $OUT/profiles.tar.gz (the run tool brings back 8 files at most)
#   GPU_CHECK_LOG_LEVEL     the servers' log level (warning), their logs in servers.log
#   GPU_CHECK_WORK          scratch folder (a new temporary one)
#   OUT                     where the reports go (GPU_CHECK_WORK/out)
set -u
DEV=${GPU_CHECK_DEVICE:-cuda}
QUICK=${GPU_CHECK_QUICK:-0}
if [ "$DEV" = cpu ]; then
  [ -x .venv/bin/python ] && DEFAULT_PY=.venv/bin/python || DEFAULT_PY=python3
  DEFAULT_SKIP=1
else
  DEFAULT_PY=python3 DEFAULT_SKIP=0
fi
PY=${GPU_CHECK_PYTHON:-$DEFAULT_PY}
PEER_VENV_PY=${TESSERA_PEERS_DIR:-$HOME/.cache/tessera/peers}/litserve/bin/python
if [ "$DEV" = cpu ] && [ -x "$PEER_VENV_PY" ]; then DEFAULT_PEER_PY=$PEER_VENV_PY; else
  DEFAULT_PEER_PY=$PY; fi
PEER_PY=${GPU_CHECK_PEER_PYTHON:-$DEFAULT_PEER_PY}
SKIP_INSTALL=${GPU_CHECK_SKIP_INSTALL:-$DEFAULT_SKIP}
W=${GPU_CHECK_WORK:-$(mktemp -d -t gpu-check.XXXXXX)}
OUT=${OUT:-$W/out}
P=$W/parts
if [ "${GPU_CHECK_PROFILE:-}" = 1 ]; then
  export GPU_CHECK_PROFILE=$W/profiles
  mkdir -p "$GPU_CHECK_PROFILE"
else
  unset GPU_CHECK_PROFILE
fi
SITE=$W/site
G=.gpu
if [ "$QUICK" = 1 ]; then
  BUDGET=${GPU_CHECK_BUDGET_S:-240} N=${GPU_CHECK_MODELS:-5} CLIENTS=${GPU_CHECK_CLIENTS:-1}
  SIZES=1,32 FIGURE_S=0.5 RR_S=1 LOAD_S=2 LEVELS=8 CONC=8 FIRST_C=4 PEER_WORKERS=1
else
  BUDGET=${GPU_CHECK_BUDGET_S:-420} N=${GPU_CHECK_MODELS:-100} CLIENTS=${GPU_CHECK_CLIENTS:-8}
  SIZES=1,8,32,128 FIGURE_S=2 RR_S=3 LOAD_S=10 LEVELS=64,256 CONC=64 FIRST_C=8 PEER_WORKERS=4
fi
# The second many-model server's budget holds a fifth of the models (20 of 100), and at
# least 2: the quick run's 5 would give 1, and one MiniLM and half another on the CPU
# got 413s (a batch's measured activations did not fit beside its weights).
HOLDS=$((N / 5 > 2 ? N / 5 : 2))
REPORT_S=60  # the report's timeout, after the budget
START=$(date +%s)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

log() { echo "[gpu-check +$(($(date +%s) - START))s] $*"; }

step() {  # step NAME TIMEOUT CMD...: CMD under the timeout, cut to the budget left; recorded
  local name=$1 limit=$2 left rc began ms
  shift 2
  if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ ",$GPU_CHECK_STEPS," != *",$name,"* ]]; then
    log "SKIP $name: not in GPU_CHECK_STEPS"
    echo "{\"step\": \"$name\", \"rc\": null, \"skipped\": \"not asked\"}" >> "$P/steps.jsonl"
    return 1
  fi
  left=$((BUDGET - ($(date +%s) - START)))
  if ((left < 5)); then
    log "SKIP $name: the budget is spent"
    echo "{\"step\": \"$name\", \"rc\": null, \"skipped\": \"budget\"}" >> "$P/steps.jsonl"
    return 1
  fi
  ((limit > left)) && limit=$left
  log "BEGIN $name (timeout ${limit}s): $*"
  began=$(date +%s%N)
  # -k: a step's python stops its servers on SIGTERM; KILL only what is left 30 s later.
  timeout -k 30 "$limit" "$@"
  rc=$?
  ms=$((($(date +%s%N) - began) / 1000000))
  log "END $name: exit $rc after $((ms / 1000)) s$( ((rc == 124)) && echo ' (timed out)')"
  printf '{"step": "%s", "rc": %d, "seconds": %d.%03d, "timeout": %d}\n' \
    "$name" "$rc" $((ms / 1000)) $((ms % 1000)) "$limit" >> "$P/steps.jsonl"
  return "$rc"
}

main() {
  log "device $DEV, python $PY, quick $QUICK, budget ${BUDGET}s, $N models, $CLIENTS clients"
  log "work $W, reports to $OUT"
  local quick=false
  [ "$QUICK" = 1 ] && quick=true
  printf '{"device": "%s", "quick": %s, "budget_s": %d, "models": %d, "holds": %d, ' \
    "$DEV" "$quick" "$BUDGET" "$N" "$HOLDS" > "$P/plan.json"
  printf '"clients": %d, "started": %d}\n' "$CLIENTS" "$START" >> "$P/plan.json"
  if [ "$SKIP_INSTALL" != 1 ]; then
    step install 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
      "$G"/whl/*.whl
  fi
  export PYTHONPATH="$SITE:$PWD/src:$PWD/benchmarks" PATH="$SITE/bin:$PATH"
  if [ "$SKIP_INSTALL" != 1 ]; then
    step standin 60 "$PY" -m gpu_check standin-install --standin "$G/standin" --site "$SITE" \
      --out "$P/standin.json"
  fi
  step env 60 "$PY" -m gpu_check env --device "$DEV" --build "$G/build.json" --out "$P/env.json"
  # The device's own pytest plugins stay out: only pytest-asyncio, which the suite needs.
  step pytest 150 env PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$PY" -m pytest -p pytest_asyncio.plugin \
    -p no:cacheprovider -m gpu tests/gpu -q -rA --junitxml "$P/pytest.xml"
  step torch 120 "$PY" -m gpu_check torch --device "$DEV" --sizes "$SIZES" --seconds "$FIGURE_S" \
    --models "$N" --rr-seconds "$RR_S" --out "$P/torch.json"
  local common=(--device "$DEV" --work "$W" --clients "$CLIENTS" --seconds "$LOAD_S")
  step one_model 150 "$PY" -m gpu_check one-model "${common[@]}" --levels "$LEVELS" \
    --out "$P/one_model.json"
  local none='{}'
  local cards=${GPU_CHECK_CARD:-$none}
  local many=("${common[@]}" --models "$N" --concurrency "$CONC" --first-concurrency "$FIRST_C"
    --card-json "$cards")
  step many_all 180 "$PY" -m gpu_check many "${many[@]}" --label all --out "$P/many_all.json"
  # A variant of the all-resident server beside it, where one is named (the report's rows).
  if [ -n "${GPU_CHECK_VARIANT:-}${GPU_CHECK_VARIANT_CARD:-}" ]; then
    local under=()
    if [ "${GPU_CHECK_VARIANT_BUDGET:-0}" = 1 ]; then
      under=(--holds "$HOLDS" --sizes-from "$P/many_all.json" --zipf 1.1)
    fi
    step many_variant 150 "$PY" -m gpu_check many "${many[@]}" --label variant "${under[@]}" \
      --config-json "${GPU_CHECK_VARIANT:-$none}" --card-json "${GPU_CHECK_VARIANT_CARD:-$cards}" \
      --out "$P/many_variant.json"
  fi
  if [ -n "${GPU_CHECK_VARIANT_2:-}" ]; then
    step many_variant_2 150 "$PY" -m gpu_check many "${many[@]}" --label variant-2 \
      --config-json "$GPU_CHECK_VARIANT_2" --out "$P/many_variant_2.json"
  fi
  step many_budget 180 "$PY" -m gpu_check many "${many[@]}" --label budget --holds "$HOLDS" \
    --sizes-from "$P/many_all.json" --zipf 1.1 --out "$P/many_budget.json"
  # The process split's worth: the same model in one process (gateways 0), at the top level.
  step one_model_g0 90 "$PY" -m gpu_check one-model "${common[@]}" --levels "${LEVELS##*,}" \
    --gateways 0 --out "$P/one_model_g0.json"
  # The issue's peer on the same device: LitServe, several inference processes on it.
  step peer 120 "$PY" -m gpu_check peer "${common[@]}" --python "$PEER_PY" \
    --workers "$PEER_WORKERS" --levels "$LEVELS" --out "$P/peer.json"
  log "steps done"
}

finish() {
  for f in "$W"/server-*.log; do
    [ -f "$f" ] && { echo "==== $(basename "$f")"; tail -c 1000000 "$f"; }
  done > "$OUT/servers.log"
  if [ -n "${GPU_CHECK_PROFILE:-}" ] && [ -n "$(ls -A "$GPU_CHECK_PROFILE")" ]; then
    tar czf "$OUT/profiles.tar.gz" -C "$GPU_CHECK_PROFILE" .
  fi
  timeout "$REPORT_S" "$PY" -m gpu_check report --parts "$P" --device "$DEV" \
    --out-json "$OUT/gpu-check.json" --out-md "$OUT/gpu-check.md"
  local rc=$?
  log "the report: exit $rc ($OUT/gpu-check.json, $OUT/gpu-check.md)"
  return "$rc"
}

mkdir -p "$P" "$SITE" "$OUT"
# Exit 0 once the report is written, whatever the steps did: the report says.
{ main; finish; } 2>&1 | tee "$OUT/gpu-check.log"
exit "${PIPESTATUS[0]}"
