#!/usr/bin/env bash
# The GPU checks, as one short script for a CUDA machine (an H100 or H200: under 6 minutes).
#
#   bash scripts/gpu_check.sh              # python3 with torch (CUDA), triton; cupy, pytest, hypothesis if there
#   PY=python RESULTS=/tmp/r bash scripts/gpu_check.sh
#   bash scripts/gpu_check.sh --cpu        # smoke run of every step on the CPU (tiny sizes, kernels in
#                                          # Triton's interpreter), results in /tmp: checks the script itself
#
# Writes docs/results/<gpu>-<date>/ (or $RESULTS): the logs of every step, the tables, and
# summary.json (scripts/gpu_summary.py). Each step has its own time limit and a failed or
# timed-out step only leaves its keys null: the summary is written in any case, and the
# benchmarks write what they have after each size or model. Where the caller sets $OUT (a
# folder whose files are returned, as on a lent device), the results folder is copied there too.
#
# Steps (limits in seconds; typical times are far below):
#   env        nvidia-smi and versions                                          15
#   compile    scripts/compile_kernels.py --quick: does this Triton compile them,
#              with how many registers, any spills                               40
#   tests      the exact-k tests on CUDA (compiled kernels against the reference,
#              the exchange's radix stage, its device syncs)                      90
#   tests_old  the existing CUDA tests (selection, CuPy kernels, bucket path)      30
#   selection  bench_selection.py: exact-k (torch ops, Triton, CUDA graph) and the
#              CuPy tbs/trimmed rows against torch.topk, 1M/16M/64M, D=0.001/0.01   60
#   stages     bench_bucket_select.py: the exact-k stages against model compute      35
#   overhead   bench_overhead.py: the exchange against compute and its host reads
#              per step (dense, the per-layer and tbs bucket paths, exact_k on
#              Triton and on torch ops)                                            70
#   summary    scripts/gpu_summary.py                                               10
# (350 s in all at the limits; --cpu scales every limit by 3: a shared CPU runs the same steps)
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
CPU=0 SCALE=1
[ "${1:-}" = "--cpu" ] && CPU=1 SCALE=3

if [ "$CPU" = 1 ]; then
  export TRITON_INTERPRET=1
  DEV=cpu
  RESULTS=${RESULTS:-/tmp/gpu_check_cpu-$(date +%Y-%m-%d)}
else
  unset TRITON_INTERPRET
  DEV=cuda
  NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  SLUG=$(echo "${NAME:-gpu}" | grep -oE '[A-Z][0-9]{2,4}' | head -1 | tr 'A-Z' 'a-z')
  RESULTS=${RESULTS:-docs/results/${SLUG:-gpu}-$(date +%Y-%m-%d)}
  if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "no CUDA device here: every CUDA step will fail and leave its keys null (bash $0 --cpu checks the script)"
  fi
fi
mkdir -p "$RESULTS"
: > "$RESULTS/steps.txt"
echo "results: $RESULTS"

step() {  # step NAME LIMIT_S COMMAND...: run with a limit, log to NAME.log, record status and time
  local name=$1 limit=$(( $2 * SCALE )) t0 rc
  shift 2
  t0=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" >"$RESULTS/$name.log" 2>&1
  rc=$?
  printf '%-10s rc=%-3s %4ss (limit %ss)%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$limit" \
    "$([ "$rc" = 124 ] && echo ' TIMED OUT')" | tee -a "$RESULTS/steps.txt"
  tail -n 4 "$RESULTS/$name.log" | sed 's/^/    /'
}

step env 15 "$PY" - "$RESULTS/env.json" "$DEV" <<'PY'
import json, subprocess, sys
import torch
cuda = sys.argv[2] == "cuda"
env = {"device": torch.cuda.get_device_name() if cuda else "cpu (smoke run)", "torch": torch.__version__,
       "cuda": torch.version.cuda}
for mod in ("triton", "cupy", "pytest", "hypothesis"):
    try:
        env[mod] = __import__(mod).__version__
    except ImportError:
        env[mod] = None
try:
    env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                   capture_output=True, text=True).stdout.strip()
except OSError:
    env["driver"] = None
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(env)
PY

if [ "$CPU" = 1 ]; then   # the same steps on tiny inputs: each command, its flags and the summary's parsing
  step compile 40 env -u TRITON_INTERPRET "$PY" scripts/compile_kernels.py --quick --arch 90
  step tests 90 "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_triton_select.py -k exchange
  step tests_old 30 "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_bucket_select.py -k cuda
  SEL=(--device cpu --sizes 64K --densities 0.001 --methods "" --exact-k torch,triton --repeats 2)
  STAGES=(--device cpu --models resnet20 --backends torch --steps 1 --warmup 0)
  OVER=(--device cpu --models resnet20 --rounds 1 --steps 1 --warmup 1 --methods dense,redsync_mc_exact_k)
else
  ARCH=$("$PY" -c 'import torch; a, b = torch.cuda.get_device_capability(); print(a * 10 + b)' 2>/dev/null)
  step compile 40 "$PY" scripts/compile_kernels.py --quick --arch "${ARCH:-90}"
  step tests 90 "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_triton_select.py tests/test_radix_select.py \
    -k "not compiles_for_sm90"   # the compile step above does that
  step tests_old 30 "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_selection.py tests/test_compressors.py \
    tests/test_bucket_select.py -k cuda
  # the CuPy kernels (select_topk's "cuda" backend) where CuPy is installed, beside the exact-k rows
  if "$PY" -c "import cupy" 2>/dev/null; then CUPY=(--methods tbs,trimmed --backend cuda); else CUPY=(--methods ""); fi
  SEL=(--device cuda --sizes 1M,16M,64M --densities 0.001,0.01 "${CUPY[@]}" --exact-k torch,triton,triton-graph
       --repeats 11)
  STAGES=(--device cuda)
  METHODS=$("$PY" -c "
import scripts.bench_overhead as b
print(','.join(m for m in b.METHODS if m in ('dense', 'redsync_mc_layer', 'redsync_mc_bucket') or 'exact_k' in m))" \
    2>/dev/null || echo dense,redsync_mc_layer,redsync_mc_bucket,redsync_mc_exact_k,redsync_mc_exact_k_torch)
  OVER=(--device cuda --threads 0 --rounds 2 --steps 6 --methods "$METHODS")
fi

step selection 60 "$PY" scripts/bench_selection.py --dists gauss "${SEL[@]}" --out "$RESULTS/selection.json"
sed -n '/^Machine:/,$p' "$RESULTS/selection.log" > "$RESULTS/selection.md"

step stages 35 "$PY" scripts/bench_bucket_select.py "${STAGES[@]}" --out "$RESULTS/stages.json"
sed -n '/^Device:/,$p' "$RESULTS/stages.log" > "$RESULTS/stages.md"

step overhead 70 "$PY" scripts/bench_overhead.py "${OVER[@]}" --out "$RESULTS/overhead_cuda.md" \
  --json "$RESULTS/overhead.json"

step summary 10 "$PY" scripts/gpu_summary.py "$RESULTS"
cat "$RESULTS/steps.txt"
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  mkdir -p "$OUT/$RESULTS" && cp -r "$RESULTS"/. "$OUT/$RESULTS"/ && echo "copied to $OUT/$RESULTS"
fi
