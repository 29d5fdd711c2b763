#!/usr/bin/env bash
# The device calls of a GPU session, one `run` call each (plan, times, how to commit:
# docs/gpu-session.md). Each call carries ".whl" (filled by ../shared/tools/device-wheels.sh)
# and ends well inside the 10-minute limit of one command:
#
#   bash benchmarks/gpu_session.sh 1   # correctness gaps of issue 3, then the first timings (issue 6)   ~8.5 min
#   bash benchmarks/gpu_session.sh 2   # the remaining timings, resumed from benchmarks/results/kernels.json  ~8 min
#   bash benchmarks/gpu_session.sh 3   # DeltaProduct S4 and A5 (issue 4), the four runs side by side     ~5 min
#   bash benchmarks/gpu_session.sh 4   # 3 beside a recheck of the float32 n_h >= 4 paths, then the timings left  ~9 min
#   bash benchmarks/gpu_session.sh 5   # our kernels under several launch settings (benchmarks/variants.py)  ~9 min
#   bash benchmarks/gpu_session.sh 6   # the correctness check of CHECK's plans under the defaults, then call 5  ~8 min
#   bash benchmarks/gpu_session.sh 7   # check as 6, then every plan timed (ours; fla and torch rows --peers), then VARIANTS  ~8 min
#   bash benchmarks/gpu_session.sh 8   # the whole correctness check (--gaps, then the default suite or CHECK), then VARIANTS  ~9 min
#
# Every result lands flat in $OUT (at most 8 files come back, no deeper than $OUT/a/b).
# BUDGET_S overrides the call's budget in seconds (the whole command, installs included);
# RUN_S overrides call 3's training time per run; GAPS_S the budget of the --gaps check (calls 1, 8); CHECK_S call 7's check,
# CHECK_BT the B,T of calls 7 and 8's check (default 4,4096). DRY_CPU=1 rehearses a call on a machine
# without a GPU: no installs, the scripts' --smoke modes, runs of a few steps.
set -uo pipefail
cd "$(dirname "$0")/.."
call=${1:?usage: gpu_session.sh 1|2|3}
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Triton's disk cache inside the checkout, an ignored folder: the device keeps ignored
# outputs between the calls on a warm machine. In session 6 the second call on a warm
# machine compiled the --gaps suite's 48 specializations again (141 s of a 560-s call).
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
case $call in 8) budget=${BUDGET_S:-540} ;; 1) budget=${BUDGET_S:-510} ;; 2) budget=${BUDGET_S:-480} ;; 3) budget=${BUDGET_S:-300} ;; 4) budget=${BUDGET_S:-540} ;; 5) budget=${BUDGET_S:-500} ;; 6) budget=${BUDGET_S:-500} ;; 7) budget=${BUDGET_S:-480} ;; *) echo "no call $call"; exit 2 ;; esac
left() { echo $((budget - SECONDS)); }
say() { echo "[gpu_session $call, ${SECONDS}s] $*"; }

dry=${DRY_CPU:-}
smoke=${dry:+--smoke}
device=cuda
exp_set=()
[ -z "$dry" ] || { device=cpu; exp_set=(--set train.steps=2 --set train.batch_size=4 --set task.options.eval_size=8); }

# Wheels (pydantic, fla-core 0.6.0, matplotlib) and the project. A machine still warm from
# the previous call keeps /tmp/site and the editable install: skip them then.
if [ -n "$dry" ]; then
  :
elif [ ! -e /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }
  touch /tmp/site/.installed
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import archspec.kernels" 2>/dev/null ||
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }
say "installed; $(python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())')"

bench() {  # the timing benchmark for what is left of the budget, resumed from the committed results
  local s=$(($(left) - 15))
  [ "$s" -ge 60 ] || { say "no time left for the benchmark (${s}s)"; return; }
  say "benchmark, budget ${s}s"
  timeout $((s + 10)) python3 benchmarks/kernels.py --out "$OUT" --budget-s "$s" $smoke \
    --resume "${RESUME:-benchmarks/results/kernels.json}" 2>&1 | tee -a "$OUT/bench.log"
}

experiments() {
  # The two experiments of specs/experiments/run-gpu.sh, but each run in its own process,
  # all four at once (one small model leaves the H200 and 16 cores mostly idle), with a
  # training time limit that fits the call; then one pass per experiment assembles
  # results.md from the finished runs (the CLI skips runs already in DIR).
  local run_s=${run_s:-${RUN_S:-$((budget - SECONDS - 110))}}
  EXP=${EXP:-/tmp/gpu-session-exp}  # outside $OUT: the per-run folders lie too deep to come back (results.json sums them up)
  say "S4 and A5, 4 runs side by side, ${run_s}s of training each"
  for e in s4 a5; do
    for r in n_h-2-beta-in-0-2 n_h-1-beta-in-0-2; do
      timeout $((run_s + 90)) python3 -m archspec.search.cli experiment "specs/experiments/deltaproduct-$e-gpu.yaml" \
        --out "$EXP/$e" --device $device --quiet --only "$r" --set "train.time_limit_s=$run_s" "${exp_set[@]}" 2>&1 |
        sed -u "s/^/[$e $r] /" >>"$OUT/experiments.log" &
    done
  done
  wait
  for e in s4 a5; do
    # Only to assemble results.md from the finished runs: the CLI writes it before it
    # would (re)train a run that did not finish, which `timeout` then cuts off.
    timeout 40 python3 -m archspec.search.cli experiment "specs/experiments/deltaproduct-$e-gpu.yaml" --out "$EXP/$e" \
      --device $device --quiet --set "train.time_limit_s=$run_s" "${exp_set[@]}" >>"$OUT/experiments.log" 2>&1
    cp "$EXP/$e/results.md" "$OUT/deltaproduct-$e-gpu.md"
    cp "$EXP/$e/results.json" "$OUT/deltaproduct-$e-gpu.json"
    cat "$OUT/deltaproduct-$e-gpu.md"
  done
}

case $call in
1)
  say "correctness gaps (cu_seqlens, float16, n_h 4 and 8)"
  timeout $((${GAPS_S:-210} + 20)) python3 benchmarks/triton_gpu_check.py --gaps --out "$OUT" --budget-s "${GAPS_S:-210}" $smoke 2>&1 | tee "$OUT/check-gaps.log"
  bench
  ;;
2)
  bench
  ;;
3)
  experiments
  ;;
4)
  # The follow-up when call 1's float32 n_h >= 4 checks faulted: the experiments of call 3
  # and the float32 recheck side by side (correctness only, so sharing the GPU is harmless),
  # then the timings that are left, alone on the GPU. Logs go to stdout, not $OUT: at
  # most 8 files come back.
  run_s=${RUN_S:-180}
  experiments &
  timeout 260 python3 benchmarks/triton_gpu_check.py --gaps --plans "${RECHECK:-deltaproduct-4,gated-deltaproduct-4,kda-4,gated-deltaproduct-8-beta2,rwkv7-8}" \
    --out "$OUT" --budget-s 240 --compile-limit-s 200 $smoke 2>&1 | sed -u 's/^/[check] /' | tail -40
  wait
  rm -f "$OUT/pip.log"
  bench >/dev/null
  tail -60 "$OUT/bench.log"; rm -f "$OUT/bench.log" "$OUT/kernels.md"
  ;;
7)
  say "correctness check under the defaults: ${CHECK:?CHECK=plans}"
  timeout $((${CHECK_S:-180} + 20)) python3 benchmarks/triton_gpu_check.py --plans "$CHECK" --out "$OUT" --budget-s "${CHECK_S:-180}" \
    ${CHECK_BT:+--batch-tokens "$CHECK_BT"} $smoke 2>&1 |
    tee "$OUT/check.log" | tail -22
  s=$(($(left) - ${VARIANTS_S:-100} - 20))
  say "every plan, ours only (fla and torch from benchmarks/results/kernels.json), budget ${s}s"
  timeout $((s + 10)) python3 benchmarks/kernels.py --out "$OUT" --budget-s "$s" $smoke --no-fla --no-torch \
    --peers "${PEERS:-benchmarks/results/kernels.json}" --min-plan-s 15 2>&1 | tail -45
  s=$(($(left) - 15))
  rm -f "$OUT/pip.log"
  [ -z "${VARIANTS:-}" ] || [ "$s" -lt 40 ] || timeout $((s + 10)) python3 benchmarks/variants.py --out "$OUT" --budget-s "$s" $smoke \
    --variants "$VARIANTS" 2>&1 | tail -12
  ;;
8)
  say "correctness gaps (cu_seqlens, float16, n_h 4 and 8)"
  timeout $((${GAPS_S:-200} + 20)) python3 benchmarks/triton_gpu_check.py --gaps --out "$OUT" --budget-s "${GAPS_S:-200}" $smoke 2>&1 |
    tee "$OUT/check-gaps.log" | tail -34
  s=$(($(left) - 20)); [ "$s" -le "${CHECK_S:-180}" ] || s=${CHECK_S:-180}
  if [ "$s" -ge 90 ]; then
    say "correctness check: ${CHECK:-the default suite}, budget ${s}s"
    timeout $((s + 20)) python3 benchmarks/triton_gpu_check.py ${CHECK:+--plans "$CHECK"} --out "$OUT" --budget-s "$s" $smoke \
      ${CHECK_BT:+--batch-tokens "$CHECK_BT"} 2>&1 |
      tee "$OUT/check.log" | tail -20
  else
    say "no time left for the check suite (${s}s)"
  fi
  s=$(($(left) - 15))
  rm -f "$OUT/pip.log"
  [ -z "${VARIANTS:-}" ] || [ "$s" -lt 40 ] || timeout $((s + 10)) python3 benchmarks/variants.py --out "$OUT" --budget-s "$s" $smoke \
    --variants "$VARIANTS" 2>&1 | tail -12
  ;;
6|5)
  if [ "$call" = 6 ]; then  # a kernel change is timed only after it is right on the GPU
    say "correctness check under the defaults: ${CHECK:?CHECK=plans}"
    timeout 250 python3 benchmarks/triton_gpu_check.py --plans "$CHECK" --out "$OUT" --budget-s 230 $smoke 2>&1 |
      tee "$OUT/check.log" | tail -25
    unset CHECK
  fi
  s=$(($(left) - 20))
  say "launch settings, budget ${s}s: ${VARIANTS:-default}"
  timeout $((s + 15)) python3 benchmarks/variants.py --out "$OUT" --budget-s "$s" $smoke ${PLANS:+--plans "$PLANS"} \
    ${VARIANTS:+--variants "$VARIANTS"} ${CHECK:+--check "$CHECK"} 2>&1 | tail -40
  ;;
esac
say "done; files in \$OUT: $(ls "$OUT" | tr '\n' ' ')"
